"""anchor-rl's training config as the keyword arguments of TRL's ``GRPOConfig``: the mapping
the TRL suites (``trl``, ``trl-pvpo``) train TRL with, and the settings it refuses because
TRL has no equal of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from anchor_rl.trainer.config import ConfigError, TrainConfig
from anchor_rl.trainer.presets import parse_override

INSTALL_HINT = 'pip install -e ".[compare]"'

LOSS_TYPES = {
    "seq-mean-token-mean": "grpo",
    "token-mean": "dapo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
"""anchor-rl ``loss.agg`` -> TRL ``loss_type`` (same normalisation of the token losses)."""
SCALE_REWARDS = {"grpo": "group", "drgrpo": "none"}
"""anchor-rl ``advantage.estimator`` -> TRL ``scale_rewards``."""


OPTION_PREFIX = "trl."
"""Overrides ``trl.FIELD=VALUE`` of the ``trl`` suite set ``GRPOConfig`` field FIELD for
TRL's runs only; ``trl.best=true`` adds :data:`BEST_CPU`."""

BEST_CPU: dict[str, Any] = {}
"""TRL's own settings that make its step faster on a CPU without changing what is trained
(``trl.best=true``). Empty: none of TRL 1.16's generation and compilation options does
(docs/results/trl.md, "TRL at its best CPU settings", lists each and what it did)."""


def split_trl_options(overrides: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """``overrides`` without the ``trl.`` ones, and those as ``GRPOConfig`` fields for TRL's
    runs: ``trl.FIELD=VALUE`` sets FIELD (a TOML value: ``trl.cache_implementation=static``,
    ``trl.transformers_continuous_batching_config={num_blocks=80}``); ``trl.best=true`` adds
    :data:`BEST_CPU`, where a ``trl.FIELD`` given too wins. ConfigError for a malformed one."""
    rest: list[str] = []
    options: dict[str, Any] = {}
    best = False
    for text in overrides:
        key, value = parse_override(text)
        if not key.startswith(OPTION_PREFIX):
            rest.append(text)
            continue
        name = key[len(OPTION_PREFIX) :]
        if not name.isidentifier():
            raise ConfigError(
                f"{text!r}: a TRL option is trl.FIELD=VALUE, FIELD a GRPOConfig field"
            )
        if name == "best":
            if not isinstance(value, bool):
                raise ConfigError(f"trl.best takes true or false, got {value!r}")
            best = value
        else:
            options[name] = value
    return rest, (dict(BEST_CPU) if best else {}) | options


def check_trl_options(trl: Any, options: Mapping[str, Any]) -> None:
    """ConfigError naming each option that is not a field of the installed TRL's ``GRPOConfig``."""
    fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    if unknown := sorted(set(options) - fields):
        raise ConfigError(
            f"not fields of TRL {trl.__version__}'s GRPOConfig: "
            + ", ".join(f"trl.{name}" for name in unknown)
        )


def require_trl() -> Any:
    """The ``trl`` module; ImportError naming the ``compare`` extra when it (or ``datasets``) is missing."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as e:
        raise ImportError(f"the trl suite needs TRL and datasets ({e}): {INSTALL_HINT}") from e
    return trl


def checkpointing_argument() -> str:
    """The name of the installed transformers' activation-checkpointing switch:
    ``activation_checkpointing`` where ``TrainingArguments`` has that field (the other name
    then warns that it is deprecated), else ``gradient_checkpointing``."""
    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def grpo_config_kwargs(
    cfg: TrainConfig, output_dir: str, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments of TRL's ``GRPOConfig`` that train like ``cfg``, with ``options``
    (TRL's own speed settings, :func:`split_trl_options`) added.

    One anchor-rl step (P prompts x n responses, ``optim.epochs`` passes of
    ``optim.mini_batches`` optimizer steps, micro-batches of ``optim.micro_batch_size``)
    becomes one TRL generation of P * n completions, ``steps_per_generation`` micro-batches
    with gradient accumulation, reused ``num_iterations`` times, so ``max_steps`` counts
    optimizer steps: ``steps * epochs * mini_batches``.

    Raises ConfigError naming the knob for settings TRL cannot express the same way, and for
    an option that would replace one of the mapped settings.
    """
    _check_expressible(cfg)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    if batch % cfg.optim.mini_batches:
        raise ConfigError(
            f"optim.mini_batches={cfg.optim.mini_batches} must divide prompts_per_step * n = "
            f"{batch}: TRL splits a generation into equal mini-batches"
        )
    mini = batch // cfg.optim.mini_batches
    micro = cfg.optim.micro_batch_size or mini
    if mini % micro:
        raise ConfigError(
            f"optim.micro_batch_size={micro} must divide the mini-batch of {mini} responses "
            "for TRL's gradient accumulation"
        )
    accumulation = mini // micro
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "seed": cfg.seed,
        "max_steps": cfg.steps * cfg.optim.epochs * cfg.optim.mini_batches,
        "use_cpu": cfg.device == "cpu",
        # rollout
        "num_generations": cfg.rollout.n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": cfg.optim.mini_batches * accumulation,
        "num_iterations": cfg.optim.epochs,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": 0,
        "max_completion_length": cfg.rollout.max_new_tokens,
        "shuffle_dataset": False,  # the dataset is already anchor-rl's prompt stream, in order
        # advantage and loss
        "scale_rewards": SCALE_REWARDS[cfg.advantage.estimator],
        "loss_type": LOSS_TYPES[cfg.loss.agg],
        "epsilon": cfg.loss.clip_low,
        "epsilon_high": cfg.loss.clip_high,
        "delta": cfg.loss.clip_c,
        "mask_truncated_completions": cfg.loss.mask_truncated,
        "beta": cfg.kl.coef,
        "use_bias_correction_kl": False,  # anchor-rl's KL term is plain k3, not ratio * k3
        # optimiser
        "learning_rate": cfg.optim.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch_fused",  # anchor-rl's AdamW is fused too (update.adamw)
        "adam_beta1": cfg.optim.betas[0],
        "adam_beta2": cfg.optim.betas[1],
        "weight_decay": cfg.optim.weight_decay,
        "max_grad_norm": cfg.optim.grad_clip,
        # precision (bf16: torch.autocast around the forward, generation included; see
        # _check_expressible) and bookkeeping: no checkpointing, no saves, no sinks
        "bf16": cfg.optim.autocast == "bf16",
        "fp16": False,
        checkpointing_argument(): False,
        "remove_unused_columns": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    if clash := sorted(set(options or {}) & set(kwargs)):
        raise ConfigError(
            f"trl.{clash[0]}: the comparison maps this GRPOConfig field from anchor-rl's config "
            "(an option may only add TRL speed settings)"
        )
    return kwargs | dict(options or {})


def _check_expressible(cfg: TrainConfig) -> None:
    """ConfigError for every knob TRL's GRPOTrainer has no equal setting for."""
    problems = []
    if cfg.advantage.estimator not in SCALE_REWARDS:
        problems.append(
            f"advantage.estimator={cfg.advantage.estimator!r} (TRL's GRPOTrainer has grpo and drgrpo)"
        )
    if cfg.loss.agg not in LOSS_TYPES:
        problems.append(f"loss.agg={cfg.loss.agg!r} (no TRL loss_type normalises the same way)")
    if cfg.kl.coef > 0 and (cfg.kl.kind != "k3" or cfg.kl.in_reward):
        problems.append("kl: TRL's KL is k3 in the loss (kl.kind='k3', kl.in_reward=false)")
    if cfg.filter.kind != "none":
        problems.append(f"filter.kind={cfg.filter.kind!r} (TRL samples every group once)")
    if cfg.reward.overlong_cache > 0:
        problems.append("reward.overlong_cache > 0 (no shaping on the TRL side)")
    if cfg.loss.nll_coef > 0:
        problems.append("loss.nll_coef > 0 (TRL has no NLL term)")
    if cfg.loss.clip_c is not None and cfg.loss.clip_c <= 1 + cfg.loss.clip_high:
        problems.append(
            "loss.clip_c must exceed 1 + clip_high to equal TRL's delta (two-sided clipping)"
        )
    if cfg.optim.warmup_steps:
        problems.append(
            "optim.warmup_steps > 0 (TRL's warm-up starts at 0, anchor-rl's at lr / warmup_steps)"
        )
    if cfg.optim.weight_decay:
        problems.append(
            "optim.weight_decay > 0 (TRL exempts biases and norm weights, anchor-rl decays all)"
        )
    if cfg.rollout.budget != "fixed":
        problems.append("rollout.budget must be 'fixed'")
    sampling = cfg.rollout.engine_args.get("precision", "model")
    if (cfg.optim.autocast == "bf16") != (sampling == "bf16"):
        problems.append(
            "optim.autocast and rollout.engine_args.precision must both be bf16 or neither "
            "(TRL's one bf16 switch covers generation and training)"
        )
    if problems:
        raise ConfigError("not comparable with TRL's GRPOTrainer: " + "; ".join(problems))
