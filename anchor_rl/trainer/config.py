"""The training configuration: one typed object, presets as TOML files, ``key=value`` overrides.

Precedence, lowest first: the field defaults below, a preset file
(``anchor_rl/trainer/presets/NAME.toml`` or a path to any TOML file), then ``key=value``
overrides with dotted keys for nested fields (``kl.coef=0.04``). Every field is
documented by the docstring under it; :func:`describe` lists them all.

An algorithm is a preset of orthogonal knobs, not a class: the advantage estimator (the
baseline source), reward shaping, the data filter, KL, loss aggregation and clipping are
separate sections, and a preset only sets the knobs its paper sets.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from anchor_rl.trainer.critic_config import CriticConfig
from anchor_rl.trainer.pvpo_config import PVPOConfig
from anchor_rl.trainer.v05_config import V05Config

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


class ConfigError(ValueError):
    """A configuration value, key or file is invalid; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class RolloutConfig(_Section):
    """How many responses are sampled per step and how."""

    prompts_per_step: int = Field(8, gt=0)
    """P: prompts (groups) trained on per step."""
    n: int = Field(8, gt=0)
    """Group size: responses sampled per prompt."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of training rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold of training rollouts."""
    max_new_tokens: int = Field(80, gt=0)
    """Maximum generated tokens per response (all turns together). The default fits the longest
    arithmetic trace (62 tokens) below DAPO's 20% overlong window."""
    max_turns: int = Field(4, gt=0)
    """Maximum policy turns per response on tool-using tasks."""
    budget: Literal["fixed", "adaptive"] = "fixed"
    """`fixed`: n responses per prompt. `adaptive` (V0.5): n to start with, then top-up rollouts
    for the prompts whose rollouts reject the prior (see the `v05` section)."""
    engine: str = "hf"
    """The registered rollout engine (anchor_rl.rollout.engine.register_engine): `hf` samples in
    this process with the policy's own weights. Every training, presampling and evaluation
    rollout goes through it; each response is seeded by (seed, stream, prompt, sample index)."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return _registered("engine", value)


class RewardConfig(_Section):
    """Shaping added to the task's reward."""

    overlong_cache: float = Field(0.0, ge=0, lt=1)
    """DAPO soft overlong punishment: the window as a fraction of rollout.max_new_tokens
    (L_cache = round(overlong_cache * max_new_tokens), at least 1 token). The reward gets 0
    up to max_new_tokens - L_cache, then a penalty falling linearly to -1 at max_new_tokens.
    0 disables it."""


class FilterConfig(_Section):
    """Which groups are trained on."""

    kind: Literal["none", "dynamic", "group"] = "none"
    """`none`: every group. `dynamic` (DAPO): drop groups whose rewards are all equal and sample
    more prompts until prompts_per_step groups are kept. `group` (PVPO group sampling): before
    training, drop the prompts the reference always solves and give the ones it never solves a
    teacher trajectory (see the `pvpo` section)."""
    max_rounds: int = Field(3, gt=0)
    """Dynamic sampling: most generation rounds per step; a step trains on the groups it has
    kept when the bound is hit (logged as filter/kept_groups)."""

    @field_validator("kind", mode="before")
    @classmethod
    def _none_is_a_kind(cls, value: Any) -> Any:
        return "none" if value is None else value  # `filter.kind=none` parses as None


def _registered(kind: str, name: str) -> str:
    """``name`` if it is a registered ``estimator``, ``policy loss`` or ``engine``; the
    registries are imported here, at validation, so importing the config needs no torch."""
    if kind == "engine":
        from anchor_rl.rollout.engine import ENGINES as names
    else:
        from anchor_rl.algos import registry

        names = registry.ESTIMATORS if kind == "estimator" else registry.POLICY_LOSSES
    if name not in names:
        raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(names)}")
    return name


class AdvantageConfig(_Section):
    """The baseline source: which estimator of anchor_rl.algos.registry turns rewards into advantages."""

    estimator: str = "grpo"
    """`grpo`: (r - group mean) / group std. `drgrpo`: r - group mean. `rloo`: r - mean of the
    other responses. `reinforce_pp`: token returns whitened over the batch. `reinforce_pp_baseline`:
    the group mean subtracted first. `pvpo`: r - V_sta(prompt), the mean reward of the reference's
    presampled rollouts (see the `pvpo` section). `gae`: GAE on a critic's values (PPO, VAPO;
    see the `critic` section). `v05`: r - b(prompt), the prompt's prior fused with its rollouts
    (see the `v05` section)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount of token returns (`reinforce_pp*`, `gae`)."""

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return _registered("estimator", value)


class KLConfig(_Section):
    """KL to the reference policy."""

    coef: float = Field(0.0, ge=0)
    """beta; 0 turns the KL penalty off."""
    kind: Literal["k1", "k2", "k3"] = "k3"
    """Estimator: k1 = x, k2 = x^2/2, k3 = e^-x + x - 1 with x = logp - ref_logp."""
    in_reward: bool = False
    """Penalise the reward instead of the loss: -coef * KL per token for token-level estimators
    (REINFORCE++), -coef * (sum of token KLs) on the sequence reward for the others (RLOO)."""
    track: bool = True
    """Log the KL to the reference even when coef is 0 (one extra forward pass per step)."""


class LossConfig(_Section):
    """The policy loss (a registered one, anchor_rl.algos.losses) and the other loss terms."""

    policy_loss: str = "ppo"
    """The registered policy loss: `ppo` is the clipped surrogate with clip-higher and the
    optional dual clip (anchor_rl.algos.losses.policy_loss); register others with
    anchor_rl.algos.registry.register_policy_loss."""

    agg: Aggregation = "seq-mean-token-mean"
    """How token losses are averaged into one number."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """Ratio clip below 1: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.2, gt=0)
    """Ratio clip above 1: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)."""
    clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant for negative advantages; None disables it."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of an NLL loss on correct samples (VAPO: 0.1)."""
    mask_truncated: bool = False
    """Overlong filtering: drop truncated responses from the loss."""

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        return _registered("policy loss", value)


class OptimConfig(_Section):
    """AdamW, warm-up then constant learning rate, PPO epochs over mini-batches."""

    lr: float = Field(3e-5, gt=0)
    """Peak learning rate (3e-5 suits the tiny SFT references; 2e-4 drifts away from them)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from lr/warmup_steps to lr over this many optimizer steps."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    epochs: int = Field(1, gt=0)
    """PPO epochs over each step's batch."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer steps per epoch: the batch is split into this many mini-batches."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Responses per forward/backward (gradient accumulation); None: a whole mini-batch."""


class EvalConfig(_Section):
    """Held-out evaluation on the task's test split."""

    every: int = Field(10, ge=0)
    """Evaluate before training, every this many steps and after the last step; 0 disables."""
    prompts: int = Field(64, gt=0)
    """Held-out prompts evaluated (the first ones of the test split)."""
    k: int = Field(1, gt=0)
    """Samples per prompt; eval/accuracy is avg@k."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    train_prompts: int = Field(0, ge=0)
    """Also evaluate the first this many training prompts (at most ``train_prompts``: the
    ones the run draws from), logged as eval/train_accuracy; 0 skips it. The built-in tiny reference solves its
    training prompts far more often than held-out ones (docs/testbed.md), so RL's gains
    show there first."""


class CheckpointConfig(_Section):
    """Resumable checkpoints in RUN_DIR/checkpoints/step_NNNNNN."""

    every: int = Field(25, ge=0)
    """Save every this many steps and after the last step; 0 saves only after the last step."""
    keep: int = Field(1, gt=0)
    """Checkpoints kept on disk (oldest deleted first)."""


class LogConfig(_Section):
    """Metric sinks. metrics.jsonl is always written."""

    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tb."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "anchor-rl"
    """W&B project name."""
    mlflow: bool = False
    """Log to MLflow (needs `pip install mlflow`)."""
    mlflow_experiment: str = "anchor-rl"
    """MLflow experiment name."""
    progress: bool = True
    """Show a progress bar with the key figures."""


class TrainConfig(_Section):
    """Everything a training run depends on."""

    preset: str | None = None
    """Name of the preset the run started from (informational)."""
    task: str = "arithmetic"
    """Task name for anchor_rl.tasks.get_task."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's constructor (override one with `task_args.NAME=value`)."""
    train_prompts: int | None = Field(None, gt=0)
    """Train on the first K prompts of the task's train split (None: all). Unlike
    `task_args.n_train` it leaves the task, and so the `sft:SIZE` reference, unchanged."""
    model: str = "sft:tiny"
    """Policy to train: a Hugging Face model directory, `sft:SIZE` (the cached SFT warm start of
    that size on this task) or `random:SIZE` (random init, for tests)."""
    ref_model: str | None = None
    """Reference policy for KL (same forms as `model`); None: a frozen copy of the initial policy."""
    seed: int = 0
    """Seeds the prompt order, sampling and random init."""
    steps: int = Field(100, gt=0)
    """Training steps."""
    time_limit: float | None = Field(None, gt=0)
    """Wall-clock budget in seconds (time/elapsed: steps and evaluations, not model loading):
    the run ends after the step that reaches it, with its final evaluation and checkpoint.
    None: run all `steps`."""
    device: str = "cpu"
    """Torch device of the policy and the reference."""
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    filter: FilterConfig = FilterConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    kl: KLConfig = KLConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    pvpo: PVPOConfig = PVPOConfig()
    critic: CriticConfig = CriticConfig()
    v05: V05Config = V05Config()

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if errors := combination_errors(self):
            raise ValueError("\n  ".join(errors))
        return self

    @property
    def needs_ref(self) -> bool:
        """Whether a reference policy is loaded (KL penalised or tracked)."""
        return self.kl.coef > 0 or self.kl.track

    @property
    def overlong_cache_tokens(self) -> int:
        """DAPO's L_cache in tokens (0: no overlong punishment)."""
        frac = self.reward.overlong_cache
        return 0 if frac == 0 else max(1, round(frac * self.rollout.max_new_tokens))


def combination_errors(cfg: TrainConfig) -> list[str]:
    """What is inconsistent between sections (empty: nothing); each names the field and the fix."""
    errors = []
    vc, estimator = cfg.v05, cfg.advantage.estimator
    if cfg.rollout.budget == "adaptive" and estimator != "v05":
        errors.append(
            'rollout.budget="adaptive" sizes the budget from a V0.5 prior: it needs '
            f'advantage.estimator="v05" (got {estimator!r})'
        )
    if vc.probe_every and estimator != "v05":
        errors.append(f'v05.probe_every needs advantage.estimator="v05" (got {estimator!r})')
    if estimator != "v05":
        return errors
    if cfg.rollout.n > vc.k_max:
        errors.append(f"rollout.n (k_init) = {cfg.rollout.n} exceeds v05.k_max = {vc.k_max}")
    lo, hi = vc.reward_range
    if not lo < hi:
        errors.append(f"v05.reward_range must be (lo, hi) with lo < hi, got {vc.reward_range}")
    if vc.prior.startswith("anchor") and cfg.pvpo.refresh_every:
        errors.append(
            "v05.prior uses the static anchor, which V0.5 does not refresh: set "
            "pvpo.refresh_every=0 (the history layer follows the policy instead)"
        )
    return errors


# --- presets and overrides -------------------------------------------------------------


def builtin_names(package: str, folder: str) -> list[str]:
    """Names of the built-in TOML files in ``package``/``folder`` (presets, suites)."""
    files = resources.files(package) / folder
    return sorted(p.name.removesuffix(".toml") for p in files.iterdir() if p.name.endswith(".toml"))


def read_builtin_toml(
    kind: str, package: str, folder: str, name_or_path: str
) -> tuple[dict[str, Any], str]:
    """``(table, name)`` of a built-in ``kind`` (``preset``, ``suite``) by name, or of a TOML
    file by path; ConfigError naming the built-in ones or the TOML error."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        file = resources.files(package) / folder / f"{name_or_path}.toml"
        if not file.is_file():
            raise ConfigError(
                f"unknown {kind} {name_or_path!r}; built-in {kind}s: "
                f"{', '.join(builtin_names(package, folder))} (or pass a path to a .toml file)"
            )
        text, name = file.read_text(), name_or_path
    try:
        return tomllib.loads(text), name
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{kind} {name_or_path!r} is not valid TOML: {e}") from e


def preset_names() -> list[str]:
    """Names of the built-in presets."""
    return builtin_names("anchor_rl.trainer", "presets")


def read_preset(name_or_path: str) -> dict[str, Any]:
    """The raw table of a built-in preset name or a TOML file path, with `preset` set."""
    table, name = read_builtin_toml("preset", "anchor_rl.trainer", "presets", name_or_path)
    table.setdefault("preset", name)
    return table


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` into the dotted key and a typed value.

    The value is read as a TOML value when it is one (``8``, ``0.04``, ``true``, ``"a b"``,
    ``[0.9, 0.99]``), ``none``/``null`` gives None, and anything else is kept as a string
    (``model=sft:tiny``). The config's field types then coerce and check it.
    """
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    if raw.lower() in {"none", "null"}:
        return key, None
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def field_paths(model: type[BaseModel] = TrainConfig, prefix: str = "") -> Iterator[str]:
    """Every settable dotted key, sections expanded (``rollout.n``, ``kl.coef``, ...)."""
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from field_paths(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def apply_overrides(table: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a raw config table with dotted-key overrides set; unknown keys are rejected."""
    known = set(field_paths())
    out = _deep_copy(table)
    for key, value in overrides.items():
        if key not in known and not key.startswith("task_args."):
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {part!r} is a section, not a value")
        node[leaf] = value
    return out


def build_config(table: Mapping[str, Any]) -> TrainConfig:
    """Validate a raw table; errors name the offending field."""
    try:
        cfg = TrainConfig.model_validate(table)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            if not err["loc"]:  # a cross-field check: its message names the fields
                lines.append(err["msg"].removeprefix("Value error, "))
            elif err["type"] == "extra_forbidden":
                lines.append(f"{'.'.join(map(str, err['loc']))}: unknown key")
            else:
                lines.append(
                    f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err['input']!r})"
                )
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
    return cfg


def load_config(preset: str | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then a preset, then ``key=value`` overrides; validated."""
    table = read_preset(preset) if preset else {}
    return build_config(apply_overrides(table, dict(parse_override(o) for o in overrides)))


def describe(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, for docs and ``--help-config``."""
    rows = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            rows.extend(describe(sub, f"{prefix}{name}."))
        else:
            default = info.get_default(call_default_factory=True)
            rows.append(
                (f"{prefix}{name}", repr(default), " ".join((info.description or "").split()))
            )
    return rows


def _deep_copy(table: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in table.items()}
