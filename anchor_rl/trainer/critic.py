"""The critic in the trainer (PPO, VAPO): build, pretrain or restore it, its values for a
batch, GAE advantages with decoupled lambdas, its update, its metrics.

Shapes: B responses, T response tokens.

The run has a critic (the :class:`PPOCritic` component) when its estimator reads ``values``
(``advantage.estimator = "gae"``); settings in the ``critic`` section
(:class:`anchor_rl.methods.critic_config.CriticConfig`). One step of the critic, in stage 5
of the loop::

    values   V(s_t) of the batch under the critic, no gradient       advantage_inputs
             and the policy's lambda (a number, or 1 - 1/(alpha l) per response)
    GAE      the estimator: advantages with the policy's lambda       (algos: gae_advantage)
    targets  returns with the critic's lambda on the same values      on_advantages
             and token rewards (1.0: Monte-Carlo returns; "policy": the policy's)
    whiten   the policy's advantages over the batch (critic.whiten)
    metrics  explained variance, first-token error, advantages by length (before the update)
    update   epochs x mini-batches x micro-batches of the clipped value loss, AdamW

The critic is updated before the policy (as verl does); neither update reads the other's
result within a step. Tool-output tokens and padding (``mask == 0``) are skipped by GAE
and carry no value loss.

The critic starts from the *initial* policy's backbone (:mod:`anchor_rl.models.critic`).
Value pretraining (``critic.pretrain_steps``) fits it to Monte-Carlo returns of the fixed
initial policy before RL, on a prompt stream and sampling seeds of its own, so the
RL run sees the same prompts with or without it; the result is cached and reused
(:func:`anchor_rl.models.value_pretrain.pretrain_value_cached`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from anchor_rl.batch import RolloutBatch, minibatches
from anchor_rl.methods.vapo import critic_metrics, critic_targets, policy_lambda
from anchor_rl.models import checkpointing
from anchor_rl.models.critic import Critic
from anchor_rl.models.loading import disable_dropout, quiet_transformers
from anchor_rl.models.lora import is_lora, lora_backbone
from anchor_rl.models.value_pretrain import fit_values, pretrain_value_cached
from anchor_rl.paths import cache_root
from anchor_rl.rollout.engine import Engine
from anchor_rl.tasks.base import Task
from anchor_rl.trainer.collect import generate, score
from anchor_rl.trainer.component import Component, Setup, Step
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.update import adamw, layout, loss_mask


class ValueLearners(Protocol):
    """What runs the critic's update on data-parallel ranks (``trainer.learners.LearnerGroup``)."""

    def critic_update(
        self,
        batch: RolloutBatch,
        mask: Tensor,
        old_values: Tensor,
        returns: Tensor,
        schedule: list[Tensor],
    ) -> dict[str, float]:
        """``fit_values`` on every rank; the figures of the whole batch (``[B, T]`` tensors)."""
        ...


PRETRAIN_FILE = "critic_pretrain.json"
"""Value-pretraining history in the run directory."""
PRETRAIN_STREAM = 7919
"""Offset of value pretraining's prompt-stream and sampling seeds from the run's seed."""
PRETRAIN_FORMAT = 2
"""Bump when value pretraining changes in a way the cache key does not see (2: per-request
sampling seeds)."""


# --- building, pretraining, restoring -------------------------------------------------


def new_critic(cfg: TrainConfig, policy: PreTrainedModel) -> Critic:
    """A fresh critic (zero head) on the body of ``policy``: a copy (``separate``) or the
    live backbone (``shared``). Built before any update, so the body is the initial policy's.
    A LoRA run's ``separate`` critic is the base model's body, sharing the policy's frozen
    base tensors, with adapters of its own (the ``lora`` section's, A drawn from
    ``seed + 1``); its ``shared`` critic reads the LoRA policy's body, adapters applied."""
    if cfg.lora.enabled and cfg.critic.mode == "separate":
        backbone = lora_backbone(policy, cfg.lora, cfg.seed + 1)
        return configured(Critic(backbone, "separate", policy.name_or_path or None), cfg)
    return configured(Critic.from_causal_lm(policy, cfg.critic.mode), cfg)


def configured(critic: Critic, cfg: TrainConfig) -> Critic:
    """``critic`` with the run's settings, in place: its scoring layouts (packed unless
    ``optim.padding_free`` is off, shared prefixes unless ``optim.shared_prefix`` or
    ``optim.padding_free`` is off; ``on`` acts as ``auto``: each pass takes the layout
    :meth:`Critic.layout` picks among those the backbone allows) and its dropout off when
    ``disable_dropout`` (for value pretraining as for the RL stage)."""
    allowed = layout(cfg)
    critic.padding_free = allowed["packed"] is not False
    critic.shared_prefix = allowed["shared"] is not False
    if cfg.disable_dropout:
        disable_dropout(critic)
    if cfg.optim.activation_checkpointing and critic.mode == "separate":  # shared: no grad
        checkpointing.enable(critic.backbone)
    return critic


def critic_optimizer(cfg: TrainConfig, critic: Critic) -> torch.optim.Optimizer:
    """AdamW over the critic's parameters that require gradients (every one, or a LoRA
    critic's adapters and head) at ``critic.lr`` (betas and weight decay of ``optim``)."""
    oc = cfg.optim
    trainable = [p for p in critic.parameters() if p.requires_grad]
    return adamw(trainable, lr=cfg.critic.lr, betas=oc.betas, weight_decay=oc.weight_decay)


def critic_state(critic: Critic) -> dict[str, Tensor]:
    """What a checkpoint keeps of ``critic``: its ``state_dict``, or of a LoRA critic (one
    whose base tensors are the policy's) the adapters' and the head's tensors only."""
    state = critic.state_dict()
    if critic.mode == "separate" and is_lora(critic.backbone):
        return {k: v for k, v in state.items() if ".lora_" in k or k.startswith("head.")}
    return state


def load_critic_state(critic: Critic, state: dict[str, Tensor]) -> None:
    """Load :func:`critic_state` into ``critic``; RuntimeError naming the tensors that differ."""
    expected = critic_state(critic).keys()
    if state.keys() != expected:
        differ = sorted(set(state) ^ set(expected))
        raise RuntimeError(f"the checkpoint's critic differs from this run's in {differ[:5]}")
    critic.load_state_dict(state, strict=False)


def pretrain_critic(
    cfg: TrainConfig, policy: PreTrainedModel, engine: Engine, task: Task
) -> tuple[Critic, dict[str, Any]]:
    """Value pretraining (VAPO): ``(critic, history)``, cached under ``$ANCHOR_RL_CACHE/critic``.

    Each of ``critic.pretrain_steps`` steps samples ``rollout.prompts_per_step`` fresh
    prompts x ``rollout.n`` responses from the policy as it is now (the fixed reference),
    scores them with the training reward and fits the critic as the RL stage does (its
    dropout off when ``disable_dropout``; on the tokens of ``update.loss_mask``, without
    truncated responses under ``loss.mask_truncated``) to Monte-Carlo returns (lambda = 1,
    discounted by ``advantage.gamma`` as the RL targets are), in ``optim.mini_batches`` mini-batches
    at ``critic.lr``. The prompts come from a stream seeded by ``seed + PRETRAIN_STREAM``
    and the samples from the seeds of the ``value_pretrain`` stream, not the run's.
    ``history`` adds ``rollouts`` (responses sampled) to
    :func:`~anchor_rl.models.value_pretrain.pretrain_value`'s and ``from_cache``.
    """
    cc, oc, rc = cfg.critic, cfg.optim, cfg.rollout
    sampler = PromptSampler(task.records("train"), cfg.seed + PRETRAIN_STREAM)

    def sample(step: int) -> tuple[RolloutBatch, Tensor]:
        first = sampler.consumed
        records = sampler.take(rc.prompts_per_step)
        draws = range(first, first + len(records))
        batch = generate(engine, task, records, draws, cfg, stream="value_pretrain")
        rewards = score(task, batch, records, cfg).rewards
        batch.loss_mask = loss_mask(batch, cfg)  # the tokens the RL stage fits values on
        return batch, rewards

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
        gamma=cfg.advantage.gamma,
        progress=cfg.log.progress,
    )
    sampled_steps = len(history["explained_variance"])  # an early stop samples one more batch
    return critic, {**history, "rollouts": sampled_steps * size}


def pretrain_key(cfg: TrainConfig, policy: PreTrainedModel) -> dict[str, Any]:
    """What value pretraining's result depends on besides its own settings: the reference
    weights (a digest), the critic mode, the task, the sampling and reward settings, the
    seed, whether dropout is off, whether truncated responses are fitted, and a LoRA run's
    ``lora`` section (its critic's adapters)."""
    return {
        "format": PRETRAIN_FORMAT,
        "policy_sha256": weights_digest(policy),
        "critic_mode": cfg.critic.mode,
        "task": cfg.task,
        "task_args": cfg.task_args,
        "rollout": cfg.rollout.model_dump(mode="json"),
        "reward": cfg.reward.model_dump(mode="json"),
        "seed": cfg.seed,
        "disable_dropout": cfg.disable_dropout,
        "mask_truncated": cfg.loss.mask_truncated,
        **({"lora": cfg.lora.model_dump(mode="json")} if cfg.lora.enabled else {}),
    }


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- one step ------------------------------------------------------------------------


@torch.no_grad()
def critic_values(critic: Critic, batch: RolloutBatch, cfg: TrainConfig) -> Tensor:
    """``V(s_t)`` ``[B, T]`` on the CPU, no gradient (0 where ``batch.attention_mask`` is 0)."""
    return critic.values(batch, micro_batch=cfg.optim.micro_batch_size).float().cpu()


def critic_update(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    mask: Tensor,
    old_values: Tensor,
    returns: Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    learners: ValueLearners | None = None,
) -> dict[str, float]:
    """``optim.epochs`` x ``optim.mini_batches`` AdamW steps on the clipped value loss
    (:func:`anchor_rl.models.value_pretrain.fit_values`; clip range ``critic.value_clip``,
    gradient norm clipped to ``optim.grad_clip``, micro-batches of ``optim.micro_batch_size``),
    here or, with ``learners`` (``cluster.learners > 1``), data-parallel on their ranks.

    Args:
        mask, old_values (the values the advantages were computed with), returns: ``[B, T]``.
        generator: shuffles mini-batches when ``optim.mini_batches > 1``.

    Returns ``critic/loss``, ``critic/vf_clipfrac`` (token-weighted over the mini-batches),
    ``critic/grad_norm`` (mean over optimiser steps) and ``critic/lr``; nothing when no
    mini-batch had a policy token.
    """
    oc = cfg.optim
    schedule = list(minibatches(len(batch), oc.epochs, oc.mini_batches, generator))
    if learners is not None:
        fit = learners.critic_update(batch, mask, old_values, returns, schedule)
    else:
        critic.train()
        fit = fit_values(
            critic, optimizer, batch, mask, old_values, returns, schedule,
            value_clip=cfg.critic.value_clip, micro_batch=oc.micro_batch_size,
            max_grad_norm=oc.grad_clip,
        )  # fmt: skip
    if fit["updates"] == 0:
        return {}
    return {
        "critic/loss": fit["loss"],
        "critic/vf_clipfrac": fit["vf_clipfrac"],
        "critic/grad_norm": fit["grad_norm"],
        "critic/lr": optimizer.param_groups[0]["lr"],
    }


# --- the component ---------------------------------------------------------------------


class PPOCritic(Component):
    """The critic of PPO and VAPO in a run: values for GAE, returns, whitening, its update.

    critic: the value model; optimizer: its AdamW (constant learning rate).
    learners: the run's data-parallel learner group, started on first use
        (``cluster.learners > 1``, set by the run); None: the update runs here.
    value_pretrain_rollouts: reference rollouts value pretraining used (cached ones included).
    """

    name = "critic"

    def __init__(self, setup: Setup) -> None:
        """A new run's critic is value-pretrained when ``critic.pretrain_steps > 0`` (before
        any policy update: pretraining samples from the live policy as the fixed reference),
        writing the history to ``RUN_DIR/critic_pretrain.json``; a resumed run's critic is
        restored by :meth:`load_state_dict`."""
        cfg = setup.cfg
        self.cfg, self.generator = cfg, setup.generator
        self.value_pretrain_rollouts = 0
        if cfg.critic.pretrain_steps == 0 or setup.resuming:
            self.critic = new_critic(cfg, setup.policy)
        else:
            with quiet_transformers():  # the cache saves the critic with save_pretrained
                self.critic, history = pretrain_critic(cfg, setup.policy, setup.engine, setup.task)
            (Path(setup.run_dir) / PRETRAIN_FILE).write_text(json.dumps(history, indent=2) + "\n")
            self.value_pretrain_rollouts = history["rollouts"]
            configured(self.critic, cfg)  # a critic from the cache has the defaults
        self.optimizer = critic_optimizer(cfg, self.critic)
        self.learners: Callable[[], ValueLearners] | None = None

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``values[B, T]`` (the critic's, before its update) and the policy's ``lam[B]``."""
        assert step.mask is not None
        values = critic_values(self.critic, step.scored.batch, self.cfg)
        return {"values": values, "lam": policy_lambda(self.cfg.critic, step.mask)}

    def on_advantages(self, step: Step) -> None:
        """Returns with the critic's lambda and whitening (:func:`critic_targets`), the metrics
        of the values the advantages were built on, then the critic's update."""
        inputs, mask = step.inputs, step.inputs["mask"]
        assert step.advantages is not None
        cfg = self.cfg
        step.advantages, returns = critic_targets(
            cfg.critic, cfg.advantage.gamma, inputs, step.advantages
        )
        values = inputs["values"]
        step.metrics |= critic_metrics(
            values, returns, step.advantages, inputs["lam"], mask, step.scored.rewards
        )
        group = None if self.learners is None else self.learners()
        step.metrics |= critic_update(
            self.critic, self.optimizer, step.scored.batch, mask, values, returns, self.cfg,
            self.generator, group,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "critic": critic_state(self.critic),
            "optimizer": self.optimizer.state_dict(),
            "value_pretrain_rollouts": self.value_pretrain_rollouts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_critic_state(self.critic, state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.value_pretrain_rollouts = int(state["value_pretrain_rollouts"])

    def counters(self) -> dict[str, float]:
        return {"rollouts/value_pretrain": float(self.value_pretrain_rollouts)}
