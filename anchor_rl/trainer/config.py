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
import inspect
import tomllib
import typing
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.methods.critic_config import CriticConfig
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.methods.v05_config import V05Config
from anchor_rl.section import Section

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


class RolloutConfig(Section):
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
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Options of the engine's factory (for `hf`: `max_batch=64`, responses generated together;
    `decode=auto|static|hf|graph`, the decoding forward pass (`auto`: `graph`, CUDA graphs, on a GPU, `static` on the CPU); `precision=model|bf16`, `bf16` samples
    from a bfloat16 copy of the weights; docs/models.md)."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return _registered("engine", value)


class RewardConfig(Section):
    """The training reward: the task's, reward functions added to or replacing it, shaping."""

    functions: list[str] = Field(default_factory=list)
    """Reward functions added to the task's reward, TRL's signature fn(prompts, completions,
    **columns) -> list[float | None] with columns answer, prompt_id and the record's meta:
    built-in names (qa_em, qa_f1, qa_cem, math, pvpo, format) or `module:function`. The
    task's verifier stays the accuracy metric (`correct`)."""
    weights: list[Annotated[float, Field(allow_inf_nan=False)]] | None = None
    """One weight per reward function (TRL's reward_weights); None: 1 each."""
    task_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the task's own reward in the training reward; 0 replaces it by the functions."""

    overlong_cache: float = Field(0.0, ge=0, lt=1)
    """DAPO soft overlong punishment: the window as a fraction of rollout.max_new_tokens
    (L_cache = round(overlong_cache * max_new_tokens), at least 1 token). The reward gets 0
    up to max_new_tokens - L_cache, then a penalty falling linearly to -1 at max_new_tokens.
    0 disables it."""

    @model_validator(mode="after")
    def _functions(self) -> RewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries for {len(self.functions)} "
                "reward.functions: give one weight per function"
            )
        if not self.functions and self.task_weight == 0:
            raise ValueError("reward.task_weight=0 without reward.functions leaves no reward")
        if self.functions:
            from anchor_rl.tasks.reward_set import resolve_reward_function

            for name in self.functions:
                try:
                    resolve_reward_function(name)
                except ValueError as exc:
                    raise ValueError(f"reward.functions: {exc}") from None
        return self


class FilterConfig(Section):
    """Which groups are trained on."""

    kind: Literal["none", "dynamic", "group"] = "none"
    """`none`: every group. `dynamic` (DAPO): drop the groups that carry no learning signal
    (`metric`) and sample more prompts until prompts_per_step groups are kept. `group` (PVPO
    group sampling): before training, drop the prompts the reference always solves and give the
    ones it never solves a teacher trajectory (see the `pvpo` section)."""
    metric: Literal["correct", "reward"] = "correct"
    """Dynamic sampling: which groups it drops. `correct` (DAPO's filter, verl's
    filter_groups.metric=acc): those whose responses are all correct or all wrong. `reward`:
    those whose shaped rewards (task reward plus the soft overlong punishment) are all equal,
    which keeps an all-correct group one of whose responses the punishment docked, and
    std-normalised advantages then make a small length penalty a full-sized one."""
    max_rounds: int = Field(3, gt=0)
    """Dynamic sampling: most generation rounds per step; a step trains on the groups it has
    kept when the bound is hit (logged as filter/kept_groups)."""

    @field_validator("kind", mode="before")
    @classmethod
    def _none_is_a_kind(cls, value: Any) -> Any:
        return "none" if value is None else value  # `filter.kind=none` parses as None


def engines() -> Any:
    """The engine registry with the built-in engines registered: ``hf``, ``http``
    (anchor_rl.rollout.http) and ``ray`` (anchor_rl.cluster, Ray imported only when used)."""
    import anchor_rl.cluster  # noqa: F401  (registers "ray")
    import anchor_rl.rollout.http  # noqa: F401  (registers "http")
    from anchor_rl.rollout.engine import ENGINES

    return ENGINES


def _registered(kind: str, name: str) -> str:
    """``name`` if it is a registered ``estimator``, ``policy loss``, ``engine`` or
    ``component``; the registries are imported here, at validation, so importing the config
    needs no torch."""
    if kind == "engine":
        registry = engines()
    elif kind == "component":
        from anchor_rl.trainer.registry import COMPONENTS as registry
    elif kind == "estimator":
        from anchor_rl.algos.registry import ESTIMATORS as registry
    else:
        from anchor_rl.algos.registry import POLICY_LOSSES as registry
    try:
        registry.lookup(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    return name


class AdvantageConfig(Section):
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


class KLConfig(Section):
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


class LossConfig(Section):
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


class OptimConfig(Section):
    """AdamW, warm-up then constant learning rate, PPO epochs over mini-batches."""

    lr: float = Field(3e-5, ge=0)
    """Peak learning rate (3e-5 suits the tiny SFT references; 2e-4 drifts away from them)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from lr/warmup_steps to lr over this many optimizer steps."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay. The optimizer is PyTorch's fused AdamW (one kernel over all
    parameters; TRL's default too) where every parameter is a plain CPU or CUDA tensor, else
    its default (foreach) implementation."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    """AdamW betas, each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    epochs: int = Field(1, gt=0)
    """PPO epochs over each step's batch."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer steps per epoch: the batch is split into this many mini-batches."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Responses per forward/backward (gradient accumulation); None: a whole mini-batch."""
    rescore: Literal["auto", "always"] = "auto"
    """The no-grad pass that recomputes the sampling policy's log-probs before the update.
    `auto` skips it where the update's own forward gives the same numbers: one optimiser
    step per batch (epochs = mini_batches = 1), dropout off, no KL in the reward, one
    learner, and nothing reading the log-probs before the update (PVPO's teacher rows);
    the ratio's denominator, the entropy and the KL metric then come from that forward.
    `always` keeps the separate pass."""
    padding_free: Literal["auto", "on", "off"] = "auto"
    """The layout of every scoring forward (update, re-scoring, reference, teacher rows, the
    critic's values).
    `on`: padding-free, each response's real tokens packed end to end with position ids
    restarting per row (Llama-architecture models; fails for others); `off`: left-padded
    prompts and right-padded responses; `auto`: padding-free where the model allows, except
    on a GPU, where a pass packs only if its forward is >= 0.5 TFLOP (2 x parameters x
    tokens) and padding would compute >= 1.2x the packed cells (smaller passes wait on
    kernel launches there; measured on an H100). The two agree within float rounding (1e-5 on log-probs); packing skips the
    padding's compute."""
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    """Score each distinct prompt once for all the responses that share it (a GRPO group's
    n responses pay for their prompt once, in the forward and the backward pass), the
    responses attending to its keys and values; the policy, the reference and the critic
    (PPO, VAPO). `auto`: on the CPU, in every padding-free pass where a prompt repeats and
    the model's layers are plain Llama layers; on a GPU never (measured on an H100 it was
    1.2-2.0x slower than the best layout in 7 of 8 cases); `on`: in every policy pass (fails
    for other models; the critic treats it as `auto`); `off`: never. Agrees with the other
    layouts within float rounding (1e-5 on log-probs); needs `padding_free` auto or on."""
    autocast: Literal["off", "bf16"] = "off"
    """`bf16`: the policy's and the reference's forward passes (re-scoring, reference
    scoring, the update) under torch.autocast with bfloat16: bf16 matmuls, float32
    weights, gradients, optimiser state and log-softmax. Per-token log-probs move by ~2e-3
    on average against float32 (up to ~0.25 on rare tokens; docs/results.md, "bf16"), and
    a bf16 forward depends on which rows share it, so the re-scored ratio starts at 1 only
    within ~2e-2 (exactly 1 with the single-pass update of `rescore = auto`). The critic stays
    float32; the engine samples in float32 unless `rollout.engine_args.precision=bf16`.
    `off`: float32 throughout."""


class EvalConfig(Section):
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


class CheckpointConfig(Section):
    """Resumable checkpoints in RUN_DIR/checkpoints/step_NNNNNN."""

    every: int = Field(25, ge=0)
    """Save every this many steps and after the last step; 0 saves only after the last step."""
    keep: int = Field(1, gt=0)
    """Checkpoints kept on disk (oldest deleted first)."""


class LogConfig(Section):
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


def load_plugin(name: str) -> None:
    """Import a plug-in: a module name (``my_pkg.estimators``) or a Python file
    (``path/to/file.py``), once. Its imports register estimators, policy losses, engines
    and components."""
    import hashlib
    import importlib
    import importlib.util
    import sys

    if name.endswith(".py"):
        path = Path(name).resolve()
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        module_name = f"anchor_rl_plugin_{path.stem}_{digest}"
        if module_name in sys.modules:
            return
        if not path.is_file():
            raise ValueError(f"plugin file {name!r} does not exist")
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise _plugin_failed(name, exc) from exc
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"plugin {name!r} cannot be imported ({exc}); name an importable module or a .py file"
        ) from None
    except Exception as exc:
        raise _plugin_failed(name, exc) from exc


def _plugin_failed(name: str, exc: Exception) -> AnchorRLError:
    """The error for a plugin whose own code raised on import: names the plugin, the line."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return AnchorRLError(
        f"plugin {name!r} raised {type(exc).__name__}: {exc}{where} while importing "
        "(--debug shows the traceback)"
    )


class ClusterConfig(Section):
    """Where a run's work goes beyond this process (docs/distributed.md)."""

    rollout_workers: int = Field(0, ge=0)
    """Ray actors that sample the rollouts (the built-in engine in each, groups kept together,
    weights from the learner after every update; anchor_rl.cluster). 0: this process samples
    (`rollout.engine`). Other Ray engine options go in `rollout.engine_args`
    (`threads_per_worker`, `num_cpus_per_worker`, `num_gpus_per_worker`, `max_batch`)."""
    address: str = "local"
    """The Ray cluster of the rollout workers: `local` starts Ray in this process, `auto` joins
    the cluster `ray start --head` started, or HOST:PORT."""
    learners: int = Field(1, gt=0)
    """Data-parallel learner ranks of the policy update and the critic's (torch.distributed,
    gloo): this process is rank 0, the others are spawned processes with replicas; the batch is sharded, the loss
    normalisers are the whole batch's and the gradients are summed, so N learners take the
    step one would. Checkpoints are rank 0's and resume on any count."""
    threads_per_learner: int = Field(0, ge=0)
    """torch threads of each spawned learner rank; 0: this process's thread count."""
    learner_sharding: Literal["replicate", "fsdp"] = "replicate"
    """How the learner ranks hold the policy and the critic: `replicate`, a whole copy and
    optimiser on each rank, trained through torch DistributedDataParallel (gradients summed
    by all-reduce); `fsdp`, torch FSDP2 (`fully_shard` per decoder layer and the root): each
    rank holds 1/N of the parameters, gradients and AdamW state, and rank 0 gathers the
    updated weights into the run's policy and critic (rollouts, scoring, checkpoints) after
    each update. `fsdp` scores the update in the padded layout and needs
    `critic.mode=separate` for a critic."""
    async_steps: int = Field(0, ge=0)
    """k > 0: the rollout workers sample the next k steps' rollouts with the weights they hold
    while this step's update runs (up to k steps off-policy; the ratio's denominator is the
    behaviour log-probs the engine returns). 0: every step samples with the latest weights.
    Needs Ray rollout workers (`rollout_workers` > 0, or `rollout.engine=ray`) and
    `rollout.top_p` = 1."""
    async_correction: Literal["none", "tis"] = "none"
    """With `async_steps`: `tis` takes the ratio's denominator from the current policy and
    weights each token's advantage by min(pi_current / pi_behaviour, `tis_cap`) (token-level
    truncated importance sampling, as verl's rollout correction); `none` divides by the
    behaviour log-probs."""
    tis_cap: float = Field(2.0, gt=0)
    """The truncation of `async_correction = tis`'s importance weights."""


class TrainConfig(Section):
    """Everything a training run depends on."""

    plugins: list[str] = Field(default_factory=list)
    """Modules (`my_pkg.methods`) or Python files (`path/to/methods.py`) imported before the rest
    of the config is checked: what they register (estimators, policy losses, engines,
    components) can then be named. Resumed runs import them again."""
    preset: str | None = None
    """Name of the preset the run started from (informational; not an override: start from a
    preset with `--preset NAME`)."""
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
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds the prompt order, sampling and random init (0 <= seed < 2**32, as numpy takes it)."""
    steps: int = Field(100, gt=0)
    """Training steps."""
    time_limit: float | None = Field(None, gt=0)
    """Wall-clock budget in seconds (time/elapsed: steps and evaluations, not model loading):
    the run ends after the step that reaches it, with its final evaluation and checkpoint.
    None: run all `steps`."""
    device: str = "cpu"
    """Torch device of the policy and the reference."""
    disable_dropout: bool = True
    """Switch every dropout of the policy, the reference and the critic off for the whole run
    (as TRL and OpenRLHF do): the recomputed old log-probs then equal the update's, and the
    first mini-batch's ratio is exactly 1. `false` keeps the model's dropout in the update
    only; the old log-probs stay those of the dropout-free model that sampled the tokens
    (docs/training.md)."""
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
    cluster: ClusterConfig = ClusterConfig()
    components: list[str] = Field(default_factory=list)
    """Registered method components (anchor_rl.trainer.component.register_component) added to
    the run, in this order, after the built-in ones (PVPO, V0.5 and the critic, which the
    estimator's inputs decide)."""
    component_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Keyword arguments of each added component's factory (`component_args.NAME.KEY=value`)."""

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for key in ("plugins", "components"):  # `plugins=a.py,b` on the command line
            if isinstance(data.get(key), str):
                data[key] = [part.strip() for part in data[key].split(",") if part.strip()]
        for plugin in data.get("plugins") or []:
            load_plugin(str(plugin))
        return data

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        import torch  # here, at validation: importing the config needs no torch

        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(
                f"device={value!r} is not a torch device; use cpu, cuda, cuda:N or mps"
            ) from None
        return value

    @field_validator("components")
    @classmethod
    def _known_components(cls, value: list[str]) -> list[str]:
        try:
            for name in value:
                _registered("component", name)
        except ValueError as exc:
            raise ValueError(f"components: {exc} (a plugin registers it)") from None
        if len(set(value)) != len(value):
            raise ValueError(f"components lists a name twice: {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if errors := combination_errors(self):
            raise ValueError("\n  ".join(errors))
        return self

    @property
    def engine(self) -> tuple[str, dict[str, Any]]:
        """The engine the run samples with and its options: the Ray engine when
        ``cluster.rollout_workers > 0``, else ``rollout.engine`` with ``rollout.engine_args``."""
        if self.cluster.rollout_workers:
            workers = {"workers": self.cluster.rollout_workers, "address": self.cluster.address}
            return "ray", {**self.rollout.engine_args, **workers}
        return self.rollout.engine, dict(self.rollout.engine_args)

    @property
    def needs_ref(self) -> bool:
        """Whether a reference policy is loaded (KL penalised or tracked)."""
        return self.kl.coef > 0 or self.kl.track

    @property
    def overlong_cache_tokens(self) -> int:
        """DAPO's L_cache in tokens (0: no overlong punishment)."""
        frac = self.reward.overlong_cache
        return 0 if frac == 0 else max(1, round(frac * self.rollout.max_new_tokens))


def _changed(section: BaseModel, names: tuple[str, ...] | None = None) -> list[str]:
    """Fields of ``section`` (all, or ``names``) whose value differs from the default."""
    fields = type(section).model_fields
    return [
        name
        for name in (names or tuple(fields))
        if getattr(section, name) != fields[name].get_default(call_default_factory=True)
    ]


def _no_effect(section: str, names: list[str], why: str) -> str:
    keys = ", ".join(f"{section}.{n}" for n in names)
    return f"{keys} {'has' if len(names) == 1 else 'have'} no effect: {why}"


def combination_errors(cfg: TrainConfig) -> list[str]:
    """Settings that cannot mean what the user thinks (empty: none); each message names the
    field and the fix. docs/training.md ("Refused combinations") lists every rule.

    A setting the run ignores is refused when it differs from its default (a preset that
    writes a default value out is not an error); the method components a run builds follow
    from the estimator's inputs (``run.build_components``).
    """
    from anchor_rl.algos.registry import get_estimator

    errors: list[str] = []
    est = cfg.advantage.estimator
    reads = set(get_estimator(est).inputs)
    critic = "values" in reads  # the components the run builds (run.build_components)
    pvpo = "anchor" in reads or cfg.filter.kind == "group"
    v05 = "baseline" in reads
    vc, pc, cc = cfg.v05, cfg.pvpo, cfg.critic
    v05_anchor = v05 and vc.prior.split("+")[0] == "anchor"

    # --- sections the run does not use ---------------------------------------------------
    if not critic and (names := _changed(cc)):
        errors.append(
            _no_effect(
                "critic",
                names,
                f"advantage.estimator={est} has no critic "
                "(it does not read values); drop them or use advantage.estimator=gae",
            )
        )
    if not v05 and (names := _changed(vc)):
        errors.append(
            _no_effect(
                "v05",
                names,
                f"advantage.estimator={est} is not V0.5; drop them or use advantage.estimator=v05",
            )
        )
    if not pvpo and not v05_anchor and (names := _changed(pc)):
        errors.append(
            _no_effect(
                "pvpo",
                names,
                "the run presamples no anchors; drop them or "
                "use advantage.estimator=pvpo or filter.kind=group",
            )
        )
    if not pvpo and v05_anchor:
        group_only = ("teacher", "teacher_model", "teacher_tries", "keep_unsolved", "refresh_mode")
        if names := _changed(pc, group_only):
            errors.append(
                _no_effect(
                    "pvpo",
                    names,
                    "V0.5's anchor prior uses only pvpo.m, pvpo.prompts, pvpo.store, "
                    "pvpo.presample_batch and pvpo.presample_seed; the rest belongs to "
                    "group sampling (filter.kind=group)",
                )
            )
    if v05_anchor and pc.refresh_every:
        errors.append(
            "v05.prior uses the static anchor, which V0.5 does not refresh: set "
            "pvpo.refresh_every=0 (the history layer follows the policy instead)"
        )

    # --- estimator and filter ------------------------------------------------------------
    if cfg.rollout.n == 1 and "index" in reads:
        errors.append(
            f"rollout.n=1 with advantage.estimator={est}: a group of one response is "
            "its own baseline, so every advantage is 0; set rollout.n >= 2"
        )
    if cfg.filter.kind == "dynamic" and reads & {"anchor", "baseline"}:
        errors.append(
            f"filter.kind=dynamic with advantage.estimator={est}: dynamic sampling "
            "drops groups whose responses all score alike, which carry gradient against "
            "a per-prompt baseline (r - V is not 0); use filter.kind=group or none"
        )
    if cfg.filter.kind != "dynamic" and (names := _changed(cfg.filter, ("max_rounds", "metric"))):
        errors.append(
            _no_effect(
                "filter",
                names,
                f"only dynamic sampling reads {'it' if len(names) == 1 else 'them'}; "
                f"set filter.kind=dynamic or drop {'it' if len(names) == 1 else 'them'}",
            )
        )
    if "gamma" not in reads and _changed(cfg.advantage, ("gamma",)):
        errors.append(
            _no_effect(
                "advantage",
                ["gamma"],
                f"advantage.estimator={est} has no token returns to discount",
            )
        )
    if cfg.optim.shared_prefix == "on" and cfg.optim.padding_free == "off":
        errors.append(
            "optim.shared_prefix=on with optim.padding_free=off: the shared-prefix forward is "
            "padding-free; set optim.padding_free=auto or optim.shared_prefix=off"
        )
    uses_ref = cfg.needs_ref or pvpo or v05_anchor
    if cfg.ref_model is not None and not uses_ref:
        errors.append(
            "ref_model has no effect: nothing reads a reference (kl.coef=0, "
            "kl.track=false, no anchors); drop it or set kl.coef or kl.track=true"
        )

    # --- the adaptive budget and V0.5 ------------------------------------------------------
    if cfg.rollout.budget == "adaptive" and not v05:
        errors.append(
            'rollout.budget="adaptive" sizes the budget from a V0.5 prior: it needs '
            f'advantage.estimator="v05" (got {est!r})'
        )
    if v05:
        lo, hi = vc.reward_range
        if cfg.rollout.n > vc.k_max:
            errors.append(f"rollout.n (k_init) = {cfg.rollout.n} exceeds v05.k_max = {vc.k_max}")
        if cfg.reward.overlong_cache > 0 and lo > -1:
            errors.append(
                "reward.overlong_cache punishes overlong responses down to -1, below "
                f"v05.reward_range={list(vc.reward_range)}: set v05.reward_range=[-1, {hi}]"
            )
        if cfg.rollout.budget != "adaptive" and (names := _changed(vc, ("cost", "top_up_rounds"))):
            errors.append(
                _no_effect("v05", names, 'they size top-ups: set rollout.budget="adaptive"')
            )
        if vc.prior.split("+")[0] != "knn" and (
            names := _changed(vc, ("knn_window", "knn_top_k", "knn_temperature"))
        ):
            errors.append(_no_effect("v05", names, f"v05.prior={vc.prior} has no knn base"))
        if "history" not in vc.prior and (
            names := _changed(vc, ("history_strength", "history_gamma"))
        ):
            errors.append(_no_effect("v05", names, f"v05.prior={vc.prior} has no history layer"))
        probe = ("probe_prompts", "probe_truth", "probe_heldout", "probe_heldout_truth")
        if not vc.probe_every and (names := _changed(vc, probe)):
            errors.append(_no_effect("v05", names, "v05.probe_every=0 switches the probe off"))

    # --- PVPO ----------------------------------------------------------------------------
    if pvpo:
        http = pc.teacher is not None and pc.teacher.startswith("http:")
        sampled = pc.teacher is not None and pc.teacher.split(":")[0] in ("hf", "http")
        if pc.teacher_model is not None and not http:
            errors.append(
                _no_effect("pvpo", ["teacher_model"], "it names the model an http: teacher serves")
            )
        if not sampled and _changed(pc, ("teacher_tries",)):
            errors.append(
                _no_effect("pvpo", ["teacher_tries"], f"pvpo.teacher={pc.teacher} does not sample")
            )
        if cfg.filter.kind != "group" and (
            names := _changed(pc, ("teacher", "teacher_model", "teacher_tries", "keep_unsolved"))
        ):
            errors.append(
                _no_effect(
                    "pvpo",
                    names,
                    "teachers and unsolved prompts belong to group sampling: set filter.kind=group",
                )
            )
        if not pc.refresh_every and _changed(pc, ("refresh_mode",)):
            errors.append(
                _no_effect("pvpo", ["refresh_mode"], "pvpo.refresh_every=0 never refreshes")
            )
        if cfg.filter.kind == "group" and pc.teacher is not None and cfg.rollout.n < 2:
            errors.append(
                f"rollout.n=1 with pvpo.teacher={pc.teacher}: a teacher trajectory replaces one "
                "of its group's n rollouts, here the policy's only one; set rollout.n >= 2 or "
                "pvpo.teacher=none"
            )
        if "anchor" in reads and cfg.reward.overlong_cache > 0:
            errors.append(
                f"reward.overlong_cache={cfg.reward.overlong_cache} with advantage.estimator="
                f"{est}: the static anchor is the reference's mean task reward, without the "
                "overlong punishment the training reward gets, so every advantage r - V_sta "
                "would carry the mean punishment; drop reward.overlong_cache"
            )
        if pc.teacher == "oracle:reference" and cfg.rollout.top_p < 1:
            errors.append(
                "pvpo.teacher=oracle:reference scores the trace without a nucleus, so "
                "with rollout.top_p < 1 its pi_gt is not the distribution the reference "
                "samples from; use pvpo.teacher=oracle or rollout.top_p=1"
            )

    if cfg.cluster.rollout_workers and cfg.rollout.engine not in ("hf", "ray"):
        errors.append(
            f"cluster.rollout_workers runs the built-in engine in Ray actors, not "
            f"rollout.engine={cfg.rollout.engine}: drop one of them"
        )
    if not cfg.cluster.rollout_workers and _changed(cfg.cluster, ("address",)):
        errors.append(_no_effect("cluster", ["address"], "cluster.rollout_workers=0 uses no Ray"))
    name, options = cfg.engine
    signature = inspect.signature(engines().lookup(name))
    try:
        signature.bind(None, None, **options)
    except TypeError as exc:
        takes = ", ".join(list(signature.parameters)[2:]) or "no options"
        errors.append(f"rollout.engine_args: {exc} (the {name!r} engine takes {takes})")
    else:
        errors += _engine_option_errors(name, engines().lookup(name), options)
    if unlisted := sorted(set(cfg.component_args) - set(cfg.components)):
        errors.append(f"component_args names {unlisted}, which components does not list")

    if cfg.cluster.rollout_workers and {"workers", "address"} & set(cfg.rollout.engine_args):
        errors.append(
            "rollout.engine_args.workers / .address with cluster.rollout_workers: the cluster "
            "section sets them (cluster.rollout_workers, cluster.address); set them there, or "
            "name the engine directly (rollout.engine=ray) without cluster.rollout_workers"
        )
    if cfg.cluster.async_steps:
        if cfg.engine[0] != "ray":
            errors.append(
                "cluster.async_steps needs cluster.rollout_workers > 0 (or rollout.engine=ray): "
                "rollouts sampled in this process cannot overlap its update"
            )
        if cfg.rollout.top_p < 1:
            errors.append(
                "cluster.async_steps needs rollout.top_p = 1: the engine's log-probs are of the "
                "nucleus-renormalised distribution, which the update's ratio cannot divide by"
            )
        if cfg.cluster.async_correction != "tis" and _changed(cfg.cluster, ("tis_cap",)):
            errors.append(_no_effect("cluster", ["tis_cap"], "set cluster.async_correction=tis"))
    elif names := _changed(cfg.cluster, ("async_correction", "tis_cap")):
        errors.append(_no_effect("cluster", names, "they correct asynchronous rollouts"))

    if cfg.cluster.learner_sharding == "fsdp":
        if cfg.cluster.learners < 2:
            errors.append(
                _no_effect("cluster", ["learner_sharding"], "it shards over cluster.learners > 1")
            )
        if critic and cfg.critic.mode == "shared":
            errors.append(
                "cluster.learner_sharding=fsdp shards a separate critic only: a shared critic's "
                "value head runs on the policy's body outside the module FSDP gathers through; "
                "set critic.mode=separate or cluster.learner_sharding=replicate"
            )
        if cfg.optim.padding_free == "on":
            errors.append(
                "cluster.learner_sharding=fsdp scores the update padded (the packed forward "
                "bypasses the root module FSDP gathers through): set optim.padding_free=auto or off"
            )
        if cfg.optim.shared_prefix == "on":
            errors.append(
                "cluster.learner_sharding=fsdp scores the update padded (the shared-prefix "
                "forward runs the layers' parts, which FSDP does not gather): set "
                "optim.shared_prefix=auto or off"
            )
    if cfg.cluster.learners > 1 and not cfg.device.startswith("cpu"):
        errors.append(
            f"cluster.learners > 1 on device={cfg.device} is not built yet (the learners use "
            "gloo on the CPU; NCCL ranks, one GPU each, are open work); use device=cpu"
        )

    # --- the critic ------------------------------------------------------------------------
    if critic:
        if cc.policy_lam != "adaptive" and (names := _changed(cc, ("lam_alpha", "lam_min"))):
            errors.append(
                _no_effect(
                    "critic",
                    names,
                    "they shape the length-adaptive lambda: set critic.policy_lam=adaptive",
                )
            )
        if cc.pretrain_steps == 0 and _changed(cc, ("pretrain_ev_threshold",)):
            errors.append(
                _no_effect(
                    "critic",
                    ["pretrain_ev_threshold"],
                    "critic.pretrain_steps=0 switches value pretraining off",
                )
            )
    return errors


def _engine_option_errors(name: str, factory: Any, options: Mapping[str, Any]) -> list[str]:
    """``rollout.engine_args.KEY=value: why`` for each option whose value the engine's factory
    annotation rejects (``decode``'s modes, ``max_batch`` >= 1...), so that it fails with the
    config rather than after the model is loaded. Options the run sets itself (the cluster
    section's ``workers``, ``address``) are named as such by the check that follows."""
    try:
        target = factory.__init__ if inspect.isclass(factory) else factory
        hints = typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError):  # annotations this process cannot resolve: the engine checks
        return []
    errors = []
    for key, value in options.items():
        if key not in hints:
            continue
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=True)  # passed unconverted
        except ValidationError as exc:
            why = "; ".join(e["msg"] for e in exc.errors())
            errors.append(f"rollout.engine_args.{key}={value!r}: {why} (the {name!r} engine)")
    return errors


# --- presets and overrides -------------------------------------------------------------


def builtin_names(package: str, folder: str) -> list[str]:
    """Names of the built-in TOML files in ``package``/``folder`` (presets, suites)."""
    files = resources.files(package) / folder
    return sorted(p.name.removesuffix(".toml") for p in files.iterdir() if p.name.endswith(".toml"))


def read_builtin_toml(
    kind: str, package: str, folder: str, name_or_path: str, others: Sequence[str] = ()
) -> tuple[dict[str, Any], str]:
    """``(table, name)`` of a built-in ``kind`` (``preset``, ``suite``) by name, or of a TOML
    file by path; ConfigError naming the built-in ones (with ``others``, the names the
    command takes besides its files) or the TOML error. A path (a name ending in ``.toml``
    or holding a directory) that names no TOML file is reported as such, not as a name."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text, name = path.read_text(), path.stem
    elif path.suffix == ".toml" or len(path.parts) > 1:  # a path, not a name
        what = (
            "does not exist" if not path.exists()
            else "is a directory" if path.is_dir() else "does not end in .toml"
        )  # fmt: skip
        raise ConfigError(f"{kind} file {name_or_path} {what}; give the path of a .toml file")
    else:
        file = resources.files(package) / folder / f"{name_or_path}.toml"
        if not file.is_file():
            names = sorted({*builtin_names(package, folder), *others})
            raise ConfigError(
                f"unknown {kind} {name_or_path!r}; built-in {kind}s: "
                f"{', '.join(names)} (or pass a path to a .toml file)"
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
        if key == "preset":  # the field only records the preset a run started from
            raise ConfigError(
                f"preset={value} as an override would only relabel the run: start from a "
                f"preset with --preset {value}"
            )
        if key not in known and not key.startswith(
            ("task_args.", "component_args.", "rollout.engine_args.")
        ):
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
            where, msg = ".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error" and (not where or "." not in where):
                lines.append(msg)  # a check across fields or sections: its message names them
            elif err["type"] == "value_error":
                lines.append(f"{where}: {msg}")  # the message names the value
            elif err["type"] == "extra_forbidden":
                lines.append(f"{where}: unknown key")
            else:
                lines.append(f"{where}: {msg} (got {err['input']!r})")
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
