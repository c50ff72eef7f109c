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

from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from anchor_rl.errors import ConfigError
from anchor_rl.methods.critic_config import CriticConfig
from anchor_rl.methods.peers_config import AStarPOConfig, PerfectConfig
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.methods.v05_config import V05Config
from anchor_rl.models.lora import LoRAConfig
from anchor_rl.section import Section
from anchor_rl.trainer.budget import BudgetConfig
from anchor_rl.trainer.plugins import check_registered, load_plugin
from anchor_rl.trainer.presets import parse_override, read_preset, suggest_keys
from anchor_rl.trainer.rules import combination_errors

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
    release_memory: bool = False
    """Free what the in-process `hf` engine holds while the policy updates: its bfloat16
    sampling copy (`engine_args.precision=bf16`) and, on a GPU, the allocator's cached blocks
    (the last rollout's key/value buffers and CUDA graph pools); the sync after the update
    fills the copy again (docs/training.md, "Memory"). Samples the same tokens."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_registered("engine", value)


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
        return check_registered("estimator", value)


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
        return check_registered("policy loss", value)


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
    tokens) and padding would compute >= 1.2x the packed cells (docs/results.md, "The update's
    layouts on a GPU"). The two agree within float rounding (1e-5 on log-probs); packing skips the
    padding's compute."""
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    """Score each distinct prompt once for all the responses that share it (a GRPO group's
    n responses pay for their prompt once, in the forward and the backward pass), the
    responses attending to its keys and values; the policy, the reference and the critic
    (PPO, VAPO). `auto`: on the CPU, in every padding-free pass where a prompt repeats and
    the model's layers are plain Llama layers; on a GPU never (docs/results.md, "The update's
    layouts on a GPU"); `on`: in every policy pass (fails for other models; the critic
    treats it as `auto`); `off`: never. Agrees with the other
    layouts within float rounding (1e-5 on log-probs); needs `padding_free` auto or on."""
    autocast: Literal["off", "bf16"] = "off"
    """`bf16`: the policy's and the reference's forward passes (re-scoring, reference
    scoring, the update) under torch.autocast with bfloat16: bf16 matmuls, float32
    weights, gradients, optimiser state and log-softmax. Per-token log-probs move against
    float32 (docs/results.md, "bf16"), and a bf16 forward depends on which rows share it, so
    the re-scored ratio starts at 1 only within rounding (exactly 1 with the single-pass
    update of `rescore = auto`). The critic stays
    float32; the engine samples in float32 unless `rollout.engine_args.precision=bf16`.
    `off`: float32 throughout."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (torch.utils.checkpoint, non-reentrant), for the policy's update and a separate critic's:
    the update's activation memory drops to one hidden state per layer, for about one more
    forward pass of compute; the gradients are unchanged (docs/training.md, "Memory")."""


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
    weight_sync: Literal["object_store", "collective"] = "object_store"
    """How the rollout workers get the learner's weights after each update: `object_store`, one
    copy put in Ray's object store that every worker loads; `collective`, a broadcast in a
    torch.distributed group of this process and the workers (gloo on the CPU; NCCL on CUDA,
    each worker on whole GPUs of its own, never run on a GPU yet)."""
    learners: int = Field(1, gt=0)
    """Data-parallel learner ranks of the policy update and the critic's (torch.distributed:
    gloo on the CPU; NCCL with one GPU per rank on CUDA, never run on a GPU yet): this process
    is rank 0, the others are spawned processes with replicas; the batch is sharded, the loss
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
    """Training steps (the cap, with `budget.rollouts`)."""
    time_limit: float | None = Field(None, gt=0)
    """Wall-clock budget in seconds (time/elapsed: steps and evaluations, not model loading):
    the run ends after the step that reaches it, with its final evaluation and checkpoint.
    None: run all `steps`."""
    device: str = "cpu"
    """Torch device of the policy and the reference."""
    threads: Literal["auto"] | int = "auto"
    """Torch intra-op threads on the CPU: `auto` picks them per phase from the model's size
    and the cores (one for models below 30M parameters; anchor_rl.threads), a number N sets
    every phase to N. Wins over `$OMP_NUM_THREADS`, which wins over `auto`."""
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
    lora: LoRAConfig = LoRAConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    pvpo: PVPOConfig = PVPOConfig()
    critic: CriticConfig = CriticConfig()
    v05: V05Config = V05Config()
    astarpo: AStarPOConfig = AStarPOConfig()
    perfect: PerfectConfig = PerfectConfig()
    cluster: ClusterConfig = ClusterConfig()
    budget: BudgetConfig = BudgetConfig()
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

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        from anchor_rl.threads import parse_setting

        return parse_setting(value)

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
                check_registered("component", name)
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
            if self.cluster.weight_sync != "object_store":
                workers["weight_sync"] = self.cluster.weight_sync
            return "ray", {**self.rollout.engine_args, **workers}
        return self.rollout.engine, dict(self.rollout.engine_args)

    @property
    def methods(self) -> tuple[str, ...]:
        """The built-in method components the run builds, in the order the loop calls them
        (``run.build_components``): ``v05`` when the estimator reads ``baseline``, ``pvpo``
        when it reads ``anchor`` or ``filter.kind = "group"``, ``critic`` when it reads
        ``values`` (``gae``: PPO, VAPO), ``astarpo`` when it reads ``vstar``, ``perfect``
        when it reads ``policy_value``."""
        from anchor_rl.algos.registry import get_estimator

        reads = set(get_estimator(self.advantage.estimator).inputs)
        built = {
            "v05": "baseline" in reads,
            "pvpo": "anchor" in reads or self.filter.kind == "group",
            "critic": "values" in reads,
            "astarpo": "vstar" in reads,
            "perfect": "policy_value" in reads,
        }
        return tuple(name for name, on in built.items() if on)

    @property
    def needs_ref(self) -> bool:
        """Whether a reference policy is loaded (KL penalised or tracked)."""
        return self.kl.coef > 0 or self.kl.track

    @property
    def overlong_cache_tokens(self) -> int:
        """DAPO's L_cache in tokens (0: no overlong punishment)."""
        frac = self.reward.overlong_cache
        return 0 if frac == 0 else max(1, round(frac * self.rollout.max_new_tokens))


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
            close = suggest_keys(key, field_paths())  # in the order the sections are declared
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


def build_config(table: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> TrainConfig:
    """Validate a raw table; errors name the offending field. ``context``: pydantic's
    validation context (a resumed run's stored LoRA config, ``models.lora.STORED_LORA_CONTEXT``)."""
    try:
        cfg = TrainConfig.model_validate(table, context=context)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where, msg = ".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error" and (not where or "." not in where):
                lines.append(msg)  # a check across fields or sections: its message names them
            elif err["type"] == "value_error":
                lines.append(f"{where}: {msg}")  # the message names the value
            elif err["type"] == "extra_forbidden":
                close = suggest_keys(where, field_paths())
                lines.append(
                    f"{where}: unknown key"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
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
