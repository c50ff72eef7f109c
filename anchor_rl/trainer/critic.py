"""The critic in the trainer (PPO, VAPO): build, pretrain or restore it, its values for a
batch, GAE advantages with decoupled lambdas, its update, its metrics.

Shapes: B responses, T response tokens.

Used when ``advantage.estimator = "gae"``; settings in the ``critic`` section
(:class:`anchor_rl.trainer.critic_config.CriticConfig`). One step of the critic, in stage 5
of the loop (:func:`critic_step`)::

    values   V(s_t) of the batch under the critic, no gradient       critic_values
    targets  GAE twice on the same values and token rewards:         gae_targets
             advantages with the policy's lambda (a number, or 1 - 1/(alpha l) per response),
             returns with the critic's lambda (1.0: Monte-Carlo returns; "policy": the same)
    metrics  explained variance, first-token error, advantages by length (before the update)
    update   epochs x mini-batches x micro-batches of the clipped value loss, AdamW      critic_update

The critic is updated before the policy (as verl does); neither update reads the other's
result within a step. Tool-output tokens and padding (``mask == 0``) are skipped by GAE
and carry no value loss.

The critic is a copy of the *initial* policy's backbone with a zero-initialised value
head (:mod:`anchor_rl.models.critic`): we initialise from the SFT reference, where the
VAPO paper initialises from a reward model, which this project does not have. Value
pretraining (``critic.pretrain_steps``) fits it to Monte-Carlo returns of the fixed
initial policy before RL, on a prompt stream and a sampling generator of its own, so the
RL run sees the same prompts with or without it; the result is cached and reused
(:func:`anchor_rl.models.value_pretrain.pretrain_value_cached`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anchor_rl.algos.advantages import outcome_to_token_rewards
from anchor_rl.algos.gae import gae, length_adaptive_lambda
from anchor_rl.algos.losses import kl, value_loss
from anchor_rl.models.critic import CONFIG_FILE as CRITIC_CONFIG_FILE
from anchor_rl.models.critic import Critic
from anchor_rl.models.sft import cache_root
from anchor_rl.models.spec import quiet_transformers
from anchor_rl.models.value_metrics import advantage_stats_by_length, value_metrics
from anchor_rl.models.value_pretrain import pretrain_value_cached
from anchor_rl.rollout.types import RolloutBatch
from anchor_rl.trainer.collect import generate, score
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.update import minibatches

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from anchor_rl.rollout.engine import HFEngine
    from anchor_rl.tasks.base import Task
    from anchor_rl.trainer.checkpoint import TrainState
    from anchor_rl.trainer.config import TrainConfig

CRITIC_DIR = "critic"
"""The critic's directory inside a checkpoint (``Critic.save`` layout plus ``optimizer.pt``)."""
OPTIMIZER_FILE = "optimizer.pt"
PRETRAIN_FILE = "critic_pretrain.json"
"""Value-pretraining history in the run directory."""
PRETRAIN_STREAM = 7919
"""Offset of value pretraining's prompt-stream and sampling seeds from the run's seed."""
PRETRAIN_FORMAT = 1
"""Bump when value pretraining changes in a way the cache key does not see."""
WHITEN_EPS = 1e-8


@dataclass
class CriticState:
    """The critic and its optimiser (constant learning rate: there is no scheduler)."""

    critic: Critic
    optimizer: torch.optim.Optimizer

    def save(self, path: Path) -> None:
        """Write the critic (``Critic.save``) and its optimiser state to directory ``path``."""
        with quiet_transformers():
            self.critic.save(path)
        torch.save(self.optimizer.state_dict(), Path(path) / OPTIMIZER_FILE)


@dataclass
class GAETargets:
    """GAE on one batch.

    values: FloatTensor[B, T], the critic's V(s_t) before its update (0 where mask is 0).
    advantages: FloatTensor[B, T], the policy's (whitened when ``critic.whiten``).
    returns: FloatTensor[B, T], the critic's regression targets.
    policy_lam: FloatTensor[B], the lambda each response's advantages used.
    """

    values: Tensor
    advantages: Tensor
    returns: Tensor
    policy_lam: Tensor


def uses_critic(cfg: TrainConfig) -> bool:
    """Whether the run trains a critic (the GAE estimator)."""
    return cfg.advantage.estimator == "gae"


# --- building, pretraining, restoring -------------------------------------------------


def new_critic(cfg: TrainConfig, policy: PreTrainedModel) -> Critic:
    """A fresh critic (zero head) on the body of ``policy``: a copy (``separate``) or the
    live backbone (``shared``). Built before any update, so the body is the initial policy's."""
    return Critic.from_causal_lm(policy, cfg.critic.mode)


def critic_optimizer(cfg: TrainConfig, critic: Critic) -> torch.optim.Optimizer:
    """AdamW over the critic's parameters at ``critic.lr`` (betas and weight decay of ``optim``)."""
    oc = cfg.optim
    return torch.optim.AdamW(
        critic.parameters(), lr=cfg.critic.lr, betas=oc.betas, weight_decay=oc.weight_decay
    )


def start_critic(
    cfg: TrainConfig,
    policy: PreTrainedModel,
    engine: HFEngine,
    task: Task,
    run_dir: Path,
    state: TrainState,
) -> CriticState | None:
    """The critic of a new run, value-pretrained when ``critic.pretrain_steps > 0``; None when
    the run uses no critic. Call it before any policy update: pretraining samples from the
    live policy as the fixed reference. Writes the pretraining history to
    ``RUN_DIR/critic_pretrain.json`` and counts its rollouts in
    ``state.value_pretrain_rollouts`` (also when they came from the cache, so the run's
    total does not depend on it)."""
    if not uses_critic(cfg):
        return None
    if cfg.critic.pretrain_steps == 0:
        critic = new_critic(cfg, policy)
    else:
        with quiet_transformers():  # the cache saves the critic with save_pretrained
            critic, history = pretrain_critic(cfg, policy, engine, task)
        (Path(run_dir) / PRETRAIN_FILE).write_text(json.dumps(history, indent=2) + "\n")
        state.value_pretrain_rollouts = history["rollouts"]
    return CriticState(critic, critic_optimizer(cfg, critic))


def pretrain_critic(
    cfg: TrainConfig, policy: PreTrainedModel, engine: HFEngine, task: Task
) -> tuple[Critic, dict[str, Any]]:
    """Value pretraining (VAPO): ``(critic, history)``, cached under ``$ANCHOR_RL_CACHE/critic``.

    Each of ``critic.pretrain_steps`` steps samples ``rollout.prompts_per_step`` fresh
    prompts x ``rollout.n`` responses from the policy as it is now (the fixed reference),
    scores them with the training reward and fits the critic to Monte-Carlo returns
    (lambda = gamma = 1), in ``optim.mini_batches`` mini-batches at ``critic.lr``. The
    prompts and samples come from streams seeded by ``seed + PRETRAIN_STREAM``, not the
    run's. ``history`` adds ``rollouts`` (responses sampled) to
    :func:`~anchor_rl.models.value_pretrain.pretrain_value`'s and ``from_cache``.
    """
    cc, oc, rc = cfg.critic, cfg.optim, cfg.rollout
    sampler = PromptSampler(task.records("train"), cfg.seed + PRETRAIN_STREAM)
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed + PRETRAIN_STREAM)

    def sample(step: int) -> tuple[RolloutBatch, Tensor]:
        records = sampler.take(rc.prompts_per_step)
        batch = generate(engine, task, records, cfg, generator)
        return batch, score(task, batch, records, cfg).rewards

    size = rc.prompts_per_step * rc.n
    critic, history = pretrain_value_cached(
        cache_root() / "critic",
        pretrain_key(cfg, policy),
        lambda: new_critic(cfg, policy),
        sample,
        cc.pretrain_steps,
        cc.lr,
        policy=policy,
        device=cfg.device,
        value_clip=cc.value_clip,
        mini_batch=math.ceil(size / oc.mini_batches) if oc.mini_batches > 1 else None,
        micro_batch=oc.micro_batch_size,
        max_grad_norm=oc.grad_clip,
        weight_decay=oc.weight_decay,
        betas=oc.betas,
        ev_threshold=cc.pretrain_ev_threshold,
        seed=cfg.seed,
        progress=cfg.log.progress,
    )
    sampled_steps = len(history["explained_variance"])  # an early stop samples one more batch
    return critic, {**history, "rollouts": sampled_steps * size}


def pretrain_key(cfg: TrainConfig, policy: PreTrainedModel) -> dict[str, Any]:
    """What value pretraining's result depends on besides its own settings: the reference
    weights (a digest), the critic mode, the task, the sampling and reward settings, the seed."""
    return {
        "format": PRETRAIN_FORMAT,
        "policy_sha256": weights_digest(policy),
        "critic_mode": cfg.critic.mode,
        "task": cfg.task,
        "task_args": cfg.task_args,
        "rollout": cfg.rollout.model_dump(mode="json"),
        "reward": cfg.reward.model_dump(mode="json"),
        "seed": cfg.seed,
    }


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_critic(cfg: TrainConfig, checkpoint: Path, policy: PreTrainedModel) -> CriticState | None:
    """The critic and optimiser saved in a checkpoint directory; None when the run uses no
    critic. ``policy`` is the restored policy (a shared critic reads its backbone)."""
    if not uses_critic(cfg):
        return None
    path = Path(checkpoint) / CRITIC_DIR
    if not (path / CRITIC_CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"{checkpoint} holds no critic ({CRITIC_DIR}/{CRITIC_CONFIG_FILE} missing) but the "
            "run uses advantage.estimator='gae'"
        )
    with quiet_transformers():
        critic = Critic.load(path, policy=policy, device=cfg.device)
    optimizer = critic_optimizer(cfg, critic)
    optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
    return CriticState(critic, optimizer)


# --- one step ------------------------------------------------------------------------


def critic_step(
    state: CriticState,
    batch: RolloutBatch,
    rewards: Tensor,
    mask: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    cfg: TrainConfig,
    generator: torch.Generator,
) -> tuple[Tensor, dict[str, float]]:
    """Values -> GAE -> metrics -> critic update: ``(advantages[B, T], metrics)``.

    Args:
        rewards: FloatTensor[B], training rewards. mask: FloatTensor[B, T], the policy
            tokens that enter the loss. old_logp, ref_logp: ``[B, T]`` (``ref_logp`` is read
            only for a KL penalty in the reward).
        generator: shuffles mini-batches when ``optim.mini_batches > 1``.
    """
    targets = gae_targets(cfg, rewards, mask, critic_values(state, batch, cfg), old_logp, ref_logp)
    metrics = critic_metrics(targets, mask, rewards)
    metrics |= critic_update(state, batch, mask, targets, cfg, generator)
    return targets.advantages, metrics


@torch.no_grad()
def critic_values(state: CriticState, batch: RolloutBatch, cfg: TrainConfig) -> Tensor:
    """``V(s_t)`` ``[B, T]`` on the CPU, no gradient (0 where ``batch.attention_mask`` is 0)."""
    return state.critic.values(batch, micro_batch=cfg.optim.micro_batch_size).float().cpu()


def policy_lambda(cfg: TrainConfig, mask: Tensor) -> Tensor:
    """FloatTensor[B]: ``critic.policy_lam``, or VAPO's ``1 - 1/(alpha l)`` per response
    (``l = mask.sum(-1)``, clamped to ``[lam_min, 1 - 1e-6]``) when it is ``adaptive``."""
    cc = cfg.critic
    if cc.policy_lam == "adaptive":
        return length_adaptive_lambda(mask.sum(-1), cc.lam_alpha, cc.lam_min)
    return torch.full((mask.shape[0],), float(cc.policy_lam))


def gae_targets(
    cfg: TrainConfig,
    rewards: Tensor,
    mask: Tensor,
    values: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
) -> GAETargets:
    """Decoupled GAE on the same values and token rewards (pure tensor function).

    Token rewards: each outcome reward on its response's last policy token, minus
    ``kl.coef * KL_t`` per token when ``kl.in_reward``. Advantages use the policy's lambda
    (:func:`policy_lambda`), returns the critic's (``critic.lam``; ``"policy"``: the policy's,
    so returns = advantages + values). Both use ``gamma = advantage.gamma``.

    Args:
        rewards: FloatTensor[B]. mask, values, old_logp, ref_logp: ``[B, T]``.
    """
    cc = cfg.critic
    gamma = cfg.advantage.gamma
    token_rewards = outcome_to_token_rewards(rewards, mask)
    if cfg.kl.in_reward and cfg.kl.coef > 0:
        if ref_logp is None:
            raise ValueError("kl.in_reward with kl.coef > 0 needs reference log-probs")
        token_rewards = token_rewards - cfg.kl.coef * kl(old_logp, ref_logp, cfg.kl.kind) * mask
    lam = policy_lambda(cfg, mask)
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    if cc.lam != "policy":
        # For lambda = 1 the values cancel out of the returns (the discounted reward-to-go);
        # leaving them out keeps those returns exact, so equal outcomes give equal returns
        # (explained variance NaN, not float noise divided by float noise).
        lam_critic = float(cc.lam)
        bootstrap = values if lam_critic < 1 else torch.zeros_like(values)
        _, returns = gae(token_rewards, bootstrap, mask, gamma, lam_critic)
    if cc.whiten:
        advantages = masked_whiten(advantages, mask)
    return GAETargets(values, advantages * mask, returns, lam)


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance over the tokens
    where ``mask > 0``; 0 elsewhere."""
    keep = mask > 0
    n = int(keep.sum())
    if n == 0:
        return torch.zeros_like(x)
    mean = x[keep].mean()
    var = x[keep].var() if n > 1 else x.new_zeros(())
    return torch.where(keep, (x - mean) * torch.rsqrt(var + WHITEN_EPS), 0)


def critic_update(
    state: CriticState,
    batch: RolloutBatch,
    mask: Tensor,
    targets: GAETargets,
    cfg: TrainConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """``optim.epochs`` x ``optim.mini_batches`` AdamW steps on the clipped value loss.

    Per token ``0.5 * max((V - R)^2, (V_clip - R)^2)``, ``V_clip`` = the step's old value
    moved by at most ``critic.value_clip``, token-mean over the mini-batch; micro-batches of
    ``optim.micro_batch_size`` responses accumulate gradients weighted by their tokens, so
    they change memory, not the update. Gradient norm clipped to ``optim.grad_clip``.

    Returns ``critic/loss``, ``critic/vf_clipfrac`` (token-weighted over the mini-batches),
    ``critic/grad_norm`` (mean over optimiser steps) and ``critic/lr``.
    """
    oc = cfg.optim
    critic, optimizer = state.critic, state.optimizer
    params = [p for p in critic.parameters() if p.requires_grad]
    device = critic.device
    critic.train()
    critic.zero_grad(set_to_none=True)  # value pretraining leaves its last gradients behind
    sums: dict[str, float] = defaultdict(float)
    tokens_seen, steps = 0.0, 0
    for rows in minibatches(len(batch), oc.epochs, oc.mini_batches, generator):
        tokens = mask[rows].sum().item()
        if tokens == 0:
            continue
        for part in torch.split(rows, oc.micro_batch_size or len(rows)):
            m = mask[part].to(device)
            part_tokens = m.sum().item()
            if part_tokens == 0:
                continue
            loss, metrics = value_loss(
                critic.values(batch.select(part)),
                targets.values[part].to(device),
                targets.returns[part].to(device),
                m,
                clip=cfg.critic.value_clip,
            )
            (loss * (part_tokens / tokens)).backward()
            sums["critic/loss"] += loss.item() * part_tokens
            sums["critic/vf_clipfrac"] += metrics["vf_clipfrac"].item() * part_tokens
            tokens_seen += part_tokens
        sums["critic/grad_norm"] += torch.nn.utils.clip_grad_norm_(params, oc.grad_clip).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    if steps == 0:
        return {}
    return {
        "critic/loss": sums["critic/loss"] / tokens_seen,
        "critic/vf_clipfrac": sums["critic/vf_clipfrac"] / tokens_seen,
        "critic/grad_norm": sums["critic/grad_norm"] / steps,
        "critic/lr": optimizer.param_groups[0]["lr"],
    }


def critic_metrics(targets: GAETargets, mask: Tensor, rewards: Tensor) -> dict[str, float]:
    """Diagnostics of the values the step's advantages were built on (before the update).

    ``critic/value_mse``, ``critic/explained_variance`` (of the returns by the values, NaN
    when every return is equal), ``critic/first_token_error`` (mean ``|V(s_0) - r|``),
    ``critic/value_mean``, ``critic/return_mean``; ``critic/policy_lam`` (mean lambda of
    the responses' advantages); and ``advantage/len_q{0..3}/{n_seq,length,mean,std}``: the
    advantages by response-length quartile.
    """
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    lam = targets.policy_lam[nonempty].mean().item() if bool(nonempty.any()) else math.nan
    return {
        **value_metrics(targets.values, targets.returns, mask, rewards, prefix="critic"),
        "critic/policy_lam": lam,
        **advantage_stats_by_length(targets.advantages, mask, prefix="advantage"),
    }
