"""A run's live objects (policy, reference, optimizer, prompt stream, RNG, counters), how
they are built for a new run or restored from its last checkpoint, and held-out evaluation.

Run directory layout::

    config.json     the validated TrainConfig
    metrics.jsonl   one line per step (and step 0: the evaluation before training)
    tb/             TensorBoard events
    checkpoints/    see anchor_rl.trainer.checkpoint
    summary.json    written when the run finishes: the last metrics and the counters
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.models.loading import load_policy
from anchor_rl.models.spec import frozen, load_spec, quiet_transformers
from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.evaluate import evaluate
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks import get_task
from anchor_rl.tasks.base import Task
from anchor_rl.trainer import checkpoint
from anchor_rl.trainer.config import ConfigError, TrainConfig, apply_overrides, build_config
from anchor_rl.trainer.critic import CriticState, load_critic, start_critic
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.pvpo import PVPO, setup_pvpo, uses_pvpo
from anchor_rl.trainer.v05 import V05State, build_v05

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
RESUMABLE_KEYS = ("steps", "time_limit", "eval.", "checkpoint.", "log.")
"""Fields a resumed run may change: how long it runs and what it records, not what it learns."""


@dataclass
class Run:
    """Everything the loop reads and updates."""

    cfg: TrainConfig
    run_dir: Path
    task: Task
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    ref: PreTrainedModel | None
    engine: HFEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    generator: torch.Generator
    state: checkpoint.TrainState
    critic: CriticState | None = None
    """The critic and its optimiser (PPO, VAPO: ``advantage.estimator = "gae"``)."""
    pvpo: PVPO | None = None
    """PVPO's anchors, training prompts and teacher trajectories (``anchor_rl.trainer.pvpo``)."""
    v05: V05State | None = None
    """V0.5's prior (``advantage.estimator = "v05"``, ``anchor_rl.trainer.v05``)."""

    def save(self) -> Path:
        """Checkpoint the current step."""
        self.state.consumed = self.sampler.consumed
        return checkpoint.save_checkpoint(
            self.run_dir, self.state, self.policy, self.tokenizer, self.optimizer,
            self.scheduler, self.generator, self.cfg.checkpoint.keep, critic=self.critic,
            v05=self.v05,
        )  # fmt: skip


def start_run(cfg: TrainConfig, run_dir: Path) -> Run:
    """A new run in ``run_dir`` (created; refuses one that already holds a run)."""
    run_dir = Path(run_dir)
    if (run_dir / CONFIG_FILE).exists():
        raise FileExistsError(f"{run_dir} already holds a run; resume it with --resume {run_dir}")
    task = load_task(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    _seed_everything(cfg.seed)
    policy, tokenizer = load_spec(
        cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
    )
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    run = _assemble(cfg, run_dir, task, policy, tokenizer, checkpoint.TrainState())
    run.critic = start_critic(cfg, policy, run.engine, task, run_dir, run.state)  # + pretraining
    return run


def resume_run(run_dir: Path, overrides: dict[str, object] | None = None) -> Run:
    """The run in ``run_dir`` restored from its newest checkpoint.

    ``overrides`` (dotted keys) may change only the fields in ``RESUMABLE_KEYS``; the
    stored config is updated with them.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} holds no run ({CONFIG_FILE} missing)")
    table = json.loads((run_dir / CONFIG_FILE).read_text())
    overrides = overrides or {}
    for key in overrides:
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS):
            raise ConfigError(
                f"{key!r} cannot change on resume (only steps, eval.*, checkpoint.*, log.*): "
                "it would change what the run learns"
            )
    cfg = build_config(apply_overrides(table, overrides))
    path = checkpoint.latest_checkpoint(run_dir)
    state = checkpoint.load_train_state(path)
    if state.step > cfg.steps:
        raise ConfigError(f"steps={cfg.steps} is below the checkpoint's step {state.step}")
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    task = load_task(cfg)

    with quiet_transformers():
        policy, tokenizer = load_policy(path / "policy", device=cfg.device)
    run = _assemble(cfg, run_dir, task, policy, tokenizer, state)
    checkpoint.load_training_states(path, run.optimizer, run.scheduler, run.generator)
    run.critic = load_critic(cfg, path, run.policy)
    if run.v05 is not None:
        run.v05.load(path)
    return run


def load_task(cfg: TrainConfig) -> Task:
    """The task the config names; ConfigError naming ``task``/``task_args`` if it is not one."""
    try:
        return get_task(cfg.task, **cfg.task_args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"task={cfg.task!r} task_args={cfg.task_args}: {e}") from None


def evaluate_policy(run: Run, step: int) -> dict[str, float]:
    """Held-out metrics (``eval/*``) of the run's current policy; see :func:`evaluate_model`."""
    return evaluate_model(run.policy, run.tokenizer, run.task, run.cfg, step)


def evaluate_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    cfg: TrainConfig,
    step: int,
) -> dict[str, float]:
    """Held-out metrics (``eval/*``) of ``model`` on the task's test split, per ``cfg.eval``
    (and ``eval/train_accuracy`` on the first ``eval.train_prompts`` training prompts).

    Sampling (when ``eval.temperature > 0``) draws from its own generator seeded by
    ``(seed, step)``, so evaluating never shifts the training run's random stream.
    """
    ec, rc = cfg.eval, cfg.rollout
    params = SamplingParams(
        temperature=ec.temperature, top_p=ec.top_p, max_new_tokens=rc.max_new_tokens,
        max_turns=rc.max_turns, stop=list(task.stop),
    )  # fmt: skip
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed * 1_000_003 + step)
    result = evaluate(model, tokenizer, task, "test", k=ec.k, params=params,
                      limit=ec.prompts, generator=generator)  # fmt: skip
    metrics = {
        "eval/accuracy": result[f"avg@{ec.k}"],
        "eval/reward": result["mean_reward"],
        "eval/length": result["mean_policy_tokens"],
        "eval/truncated_frac": result["truncated"],
    }
    if ec.k > 1:
        metrics[f"eval/pass@{ec.k}"] = result[f"pass@{ec.k}"]
    if ec.train_prompts:
        limit = min(ec.train_prompts, cfg.train_prompts or ec.train_prompts)
        train = evaluate(model, tokenizer, task, "train", k=ec.k, params=params,
                         limit=limit, generator=generator)  # fmt: skip
        metrics["eval/train_accuracy"] = train[f"avg@{ec.k}"]
    return metrics


def counters(state: checkpoint.TrainState) -> dict[str, float]:
    """The cumulative counters as metrics; ``rollouts/total`` adds PVPO's presample and refresh
    rollouts and VAPO's value-pretraining rollouts to the policy's ``rollouts/cumulative``."""
    extra = state.presample_rollouts + state.refresh_rollouts + state.value_pretrain_rollouts
    return {
        "rollouts/cumulative": float(state.rollouts),
        "tokens/cumulative": float(state.tokens),
        "rollouts/presample": float(state.presample_rollouts),
        "rollouts/refresh": float(state.refresh_rollouts),
        "rollouts/value_pretrain": float(state.value_pretrain_rollouts),
        "rollouts/total": float(state.rollouts + extra),
    }


def write_summary(run: Run, last: dict[str, float]) -> None:
    """summary.json: the preset, the last step's metrics and the latest evaluation."""
    summary = {"preset": run.cfg.preset, "steps": run.state.step, "last": last}
    (run.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))


def _assemble(
    cfg: TrainConfig,
    run_dir: Path,
    task: Task,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: checkpoint.TrainState,
) -> Run:
    ref = None
    if cfg.needs_ref:
        # The frozen initial policy: the same spec loaded again (deterministic for every spec).
        model, ref_tokenizer = load_spec(
            cfg.ref_model or cfg.model,
            cfg.task,
            cfg.task_args,
            cfg.seed,
            cfg.device,
            cfg.log.progress,
        )
        if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "ref_model's tokenizer differs from the policy's; KL needs the same vocabulary"
            )
        ref = frozen(model)
    records = task.records("train")[: cfg.train_prompts]
    # PVPO: presample the reference (anchor store) and, with group sampling, filter the prompts
    pvpo = (
        setup_pvpo(cfg, run_dir, task, records, tokenizer, ref, state) if uses_pvpo(cfg) else None
    )
    # V0.5: the prior (its anchor base presampled like PVPO's when the run has no anchors yet)
    v05 = build_v05(cfg, run_dir, task, records, tokenizer, ref, state, pvpo)
    oc = cfg.optim
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=oc.lr, betas=oc.betas, weight_decay=oc.weight_decay
    )
    warmup = oc.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        task=task,
        policy=policy,
        tokenizer=tokenizer,
        ref=ref,
        engine=HFEngine(policy, tokenizer),
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=PromptSampler(records if pvpo is None else pvpo.records, cfg.seed, state.consumed),
        generator=torch.Generator(device=cfg.device).manual_seed(cfg.seed),
        state=state,
        pvpo=pvpo,
        v05=v05,
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
