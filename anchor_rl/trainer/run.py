"""A run's live objects (policy, reference, optimizer, prompt stream, RNG, counters, method
components), how they are built for a new run or restored from its last checkpoint, and
held-out evaluation.

Run directory layout::

    config.json     the validated TrainConfig
    metrics.jsonl   one line per step (and step 0: the evaluation before training)
    tb/             TensorBoard events
    checkpoints/    see anchor_rl.trainer.checkpoint
    summary.json    written when the run finishes: the last metrics and the counters
"""

from __future__ import annotations

import inspect
import json
import random
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl import threads
from anchor_rl.allocator import keep_freed_memory
from anchor_rl.cluster.asynchronous import PrefetchingEngine
from anchor_rl.cluster.connect import WorkerSet, check_local_fit
from anchor_rl.cluster.engine import RayEngine
from anchor_rl.cluster.learners import LearnerGroup
from anchor_rl.errors import AnchorRLError
from anchor_rl.models import checkpointing
from anchor_rl.models.loading import check_device, disable_dropout, load_policy, quiet_transformers
from anchor_rl.models.lora import (
    STORED_LORA_CONTEXT,
    apply_lora,
    check_same_file_config,
    load_adapter,
    store_file_config,
    stored_file_config,
    trainable_parameters,
)
from anchor_rl.rollout.engine import Engine, close_engine, make_engine
from anchor_rl.rollout.evaluate import evaluate
from anchor_rl.rollout.spec import load_spec
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks import TASKS, get_task
from anchor_rl.tasks.base import Record, Task
from anchor_rl.tasks.reward_set import with_rewards
from anchor_rl.trainer import checkpoint
from anchor_rl.trainer.astar import AStarPO
from anchor_rl.trainer.component import COMPONENTS, Component, Setup
from anchor_rl.trainer.config import ConfigError, TrainConfig, apply_overrides, build_config
from anchor_rl.trainer.critic import PPOCritic
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.logging import METRICS_FILE, jsonl_path
from anchor_rl.trainer.perfect import UNCOUNTED, Perfect
from anchor_rl.trainer.pvpo import PVPO, presample_anchors
from anchor_rl.trainer.state import TrainState
from anchor_rl.trainer.update import make_optimizer
from anchor_rl.trainer.v05 import V05

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
RESUMABLE_KEYS = (
    "steps", "time_limit", "budget.", "eval.", "checkpoint.", "log.", "cluster.", "threads"
)  # fmt: skip
PREFETCH_STATE = "async_prefetch"
"""The checkpoint file (``NAME.pt``) of an asynchronous run's prefetched rollouts."""
"""Fields a resumed run may change: how long it runs, what it records and where its work
runs (rollouts are seeded per request, checkpoints are one consolidated state), not what it
learns."""


@dataclass
class Run:
    """Everything the loop reads and updates."""

    cfg: TrainConfig
    run_dir: Path
    task: Task
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    ref: PreTrainedModel | None
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    generator: torch.Generator
    state: TrainState
    components: dict[str, Component]
    """The method components (:func:`build_components`), in the order the loop calls them."""
    learners: LearnerGroup | None = None
    """The data-parallel learner ranks (``cluster.learners > 1``), started on first use."""
    threads: threads.ThreadChoice | None = None
    """The torch threads of each phase (:func:`anchor_rl.threads.choose_threads`)."""

    def learner_group(self) -> LearnerGroup:
        """The learner ranks 1..N-1 beside this process (rank 0), started on first use, after
        a resumed run has restored its optimiser."""
        if self.learners is None:
            critic = self.components.get("critic")
            value = None if critic is None else (critic.critic, critic.optimizer)
            self.learners = LearnerGroup(
                self.cfg, self.policy, self.optimizer, self.scheduler, critic=value
            )
        return self.learners

    def close(self) -> None:
        """End the run's use of other processes: drop a prefetched rollout no step will use,
        stop the learner ranks, if any, and close the engines the run and its components built
        (:func:`~anchor_rl.rollout.engine.close_engine`: a Ray engine's workers go back to the
        cluster, an HTTP engine's connections and weight files go). Idempotent;
        :func:`~anchor_rl.trainer.loop.train` calls it when it ends, so a run's engine samples
        nothing after its training."""
        if isinstance(self.engine, PrefetchingEngine):
            self.engine.discard()
        if self.learners is not None:
            self.learners.close()
            self.learners = None
        for component in self.components.values():
            component.close()
        close_engine(self.engine)

    def save(self) -> Path:
        """Checkpoint the current step (sharded learners first consolidate their optimiser
        state into the run's optimiser)."""
        self.state.consumed = self.sampler.consumed
        if self.learners is not None:
            self.learners.consolidate()
        extra = {}
        if isinstance(self.engine, PrefetchingEngine):  # the next steps' rollouts, exactly
            extra[PREFETCH_STATE] = self.engine.state_dict()
        return checkpoint.save_checkpoint(
            self.run_dir, self.state, self.policy, self.tokenizer, self.optimizer,
            self.scheduler, self.generator, self.cfg.checkpoint.keep, self.components, extra,
        )  # fmt: skip


def start_run(cfg: TrainConfig, run_dir: Path) -> Run:
    """A new run in ``run_dir`` (created once the model has loaded).

    A directory that holds a run is refused with what to do: ``--resume`` when it has a
    checkpoint, another ``--out`` when its config differs. One whose run stopped before its
    first checkpoint holds nothing to lose: the run starts over in it; so does one whose
    set-up failed (no checkpoint and no metrics), whatever config it was set up with.
    """
    run_dir = Path(run_dir)
    if (run_dir / CONFIG_FILE).exists():
        _check_reusable(cfg, run_dir)
    check_device(cfg.device)
    check_ray_fit(cfg)
    task = load_task(cfg)
    threads.configure(cfg.threads)  # before load_spec: an sft: model may train here
    _seed_everything(cfg.seed)
    policy, tokenizer = load_spec(
        cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
    )
    policy = apply_lora(policy, cfg.lora, cfg.seed)  # lora.rank > 0: adapters on the base
    if cfg.disable_dropout:
        disable_dropout(policy)
    run_dir.mkdir(parents=True, exist_ok=True)  # not before: a model that fails leaves no dir
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    store_file_config(cfg.lora, run_dir)  # lora.config_file as read now: what resumes use
    return _assemble(cfg, run_dir, task, policy, tokenizer, TrainState())


def _check_reusable(cfg: TrainConfig, run_dir: Path) -> None:
    """AnchorRLError unless ``run_dir`` holds a run of ``cfg`` that never saved a checkpoint,
    or a run (of any config) whose set-up failed: no checkpoint and no metrics line, not even
    step 0's evaluation, so nothing it wrote is worth keeping."""
    if not checkpoint.list_checkpoints(run_dir) and not _has_metrics(run_dir):
        return
    stored = _stored_config(run_dir)
    fresh = cfg.model_dump(mode="json")
    changed = sorted(
        key
        for key in set(stored) | set(fresh)
        if stored.get(key) != fresh.get(key) and key not in ("steps", "time_limit")
        and not any(key == k.rstrip(".") for k in RESUMABLE_KEYS)
    )  # fmt: skip
    if changed:
        raise AnchorRLError(
            f"{run_dir} holds another run (its config differs in {', '.join(changed)}); "
            "choose another --out, or delete the directory"
        )
    if checkpoint.list_checkpoints(run_dir):
        raise AnchorRLError(
            f"{run_dir} already holds this run, with checkpoints: continue it with "
            f"anchor-rl train --resume {run_dir}"
        )


def _has_metrics(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a non-empty metrics file (the loop writes its first line, step
    0's evaluation or step 1, once set-up succeeded)."""
    path = jsonl_path(run_dir / METRICS_FILE)
    return path.is_file() and path.stat().st_size > 0


def _stored_config(run_dir: Path) -> dict[str, Any]:
    """The config stored in ``run_dir``; AnchorRLError naming the file when it is not JSON."""
    path = run_dir / CONFIG_FILE
    try:
        stored = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AnchorRLError(
            f"{path} is not a run's config ({e}); restore it, or start a new run with --out"
        ) from None
    if not isinstance(stored, dict):
        raise AnchorRLError(
            f"{path} is not a run's config (not a JSON object); restore it, or start a new run "
            "with --out"
        )
    return stored


def resume_run(
    run_dir: Path, overrides: dict[str, object] | None = None, from_checkpoint: str | None = None
) -> Run:
    """The run in ``run_dir`` restored from its newest checkpoint (or ``from_checkpoint``,
    a checkpoint directory's name such as ``step_000040``).

    ``overrides`` (dotted keys) may change only the fields in ``RESUMABLE_KEYS``; the
    stored config is updated with them. A run that stopped before its first checkpoint
    starts again from step 0 with its stored config.
    """
    run_dir = Path(run_dir)
    cfg = resumed_config(run_dir, overrides)
    found = resume_point(run_dir, cfg, from_checkpoint)
    if found is None:  # stopped before its first checkpoint
        (run_dir / CONFIG_FILE).unlink()
        return start_run(cfg, run_dir)
    path, state = found
    check_device(cfg.device)
    check_ray_fit(cfg)
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    task = load_task(cfg)

    with quiet_transformers(), checkpoint.readable(path / "policy"):
        if cfg.lora.enabled:  # the base model again, then the checkpoint's adapter
            policy, tokenizer = load_spec(
                cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
            )
            policy = load_adapter(policy, path / "policy")
        else:
            policy, tokenizer = load_policy(path / "policy", device=cfg.device)
    if cfg.disable_dropout:
        disable_dropout(policy)
    run = _assemble(cfg, run_dir, task, policy, tokenizer, state, resuming=True)
    with checkpoint.readable(path):
        checkpoint.load_training_states(path, run.optimizer, run.scheduler, run.generator)
        checkpoint.load_components(path, run.components)
        prefetched = path / f"{PREFETCH_STATE}.pt"
        if isinstance(run.engine, PrefetchingEngine) and prefetched.is_file():
            prefetches = torch.load(prefetched, weights_only=True)
            run.engine.load_state_dict(prefetches, max_staleness=cfg.cluster.async_steps)
    return run


def resume_point(
    run_dir: Path, cfg: TrainConfig, from_checkpoint: str | None = None
) -> tuple[Path, TrainState] | None:
    """The checkpoint a resumed run with ``cfg`` continues from and its training state (the
    newest, or ``from_checkpoint``), checked as :func:`resume_run` checks it before loading
    anything: it exists, is of this version's layout, and ``cfg.steps`` is not below its
    step (ConfigError). None when the run stopped before its first checkpoint (it starts
    again from step 0; ``from_checkpoint`` is then unused)."""
    if not checkpoint.list_checkpoints(run_dir):
        return None
    path = checkpoint.find_checkpoint(run_dir, from_checkpoint)
    state = checkpoint.load_train_state(path)
    if state.step > cfg.steps:
        raise ConfigError(f"steps={cfg.steps} is below the checkpoint's step {state.step}")
    return path, state


def resumed_config(run_dir: Path, overrides: dict[str, object] | None = None) -> TrainConfig:
    """The config a resumed run in ``run_dir`` trains with: its stored one with
    ``overrides`` (dotted keys; only the fields in ``RESUMABLE_KEYS`` may change), validated.
    A run started with ``lora.config_file`` reads the copy it stored then
    (``RUN_DIR/lora_config.json``), not the file, which may have moved or changed since; a
    ``lora.config_file`` override is accepted when it holds the same config, else refused."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        why = f"no {CONFIG_FILE} in it" if run_dir.is_dir() else "no such directory"
        raise AnchorRLError(
            f"{run_dir} holds no run to resume ({why}); start one there with: "
            f"anchor-rl train --preset NAME --out {run_dir}"
        )
    table = _stored_config(run_dir)
    overrides = dict(overrides or {})
    stored = stored_file_config(run_dir)
    if stored is not None and "lora.config_file" in overrides:  # the same config: no change
        check_same_file_config(str(overrides.pop("lora.config_file")), stored)
    for key in overrides:
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS):
            raise ConfigError(
                f"{key!r} cannot change on resume (only steps, time_limit, budget.*, eval.*, "
                "checkpoint.*, log.*, cluster.*): it would change what the run learns; start a "
                "new run with --out"
            )
    context = {STORED_LORA_CONTEXT: str(stored)} if stored is not None else None
    return build_config(apply_overrides(table, overrides), context)


def load_task(cfg: TrainConfig) -> Task:
    """The task the config names, its reward replaced per ``reward.functions`` and
    ``reward.task_weight`` when they ask (``tasks.reward_set``); ConfigError naming
    ``task``/``task_args`` if it is not one."""
    _check_task_args(cfg.task, cfg.task_args)
    try:
        task = get_task(cfg.task, **cfg.task_args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"task={cfg.task!r} task_args={cfg.task_args}: {e}") from None
    rc = cfg.reward
    return with_rewards(task, rc.functions, rc.weights, rc.task_weight)


def _check_task_args(name: str, task_args: dict[str, Any]) -> None:
    """ConfigError naming ``task_args.KEY`` and the type it wants when a value has another
    type (checked against the task constructor's annotations)."""
    cls = TASKS.get(name)
    if cls is None:
        return  # get_task names the valid tasks
    hints = typing.get_type_hints(cls.__init__)
    for key, value in task_args.items():
        if key not in hints:
            continue  # get_task names the valid arguments
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=False)
        except ValidationError:
            raise ConfigError(
                f"task_args.{key}={value!r}: task {name!r} wants {_type_name(hints[key])}"
            ) from None


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def evaluate_policy(run: Run, step: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Held-out metrics (``eval/*``) of the run's current policy and the per-prompt results
    behind them; see :func:`evaluate_details`."""
    return evaluate_details(run.engine, run.task, run.cfg, step)


def evaluate_model(engine: Engine, task: Task, cfg: TrainConfig, step: int) -> dict[str, float]:
    """Held-out metrics (``eval/*``) of the model ``engine`` samples; see :func:`evaluate_details`."""
    return evaluate_details(engine, task, cfg, step)[0]


def evaluate_details(
    engine: Engine, task: Task, cfg: TrainConfig, step: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """Held-out metrics of the model ``engine`` samples, on the task's test split, per
    ``cfg.eval`` (and ``eval/train_accuracy`` on the first ``eval.train_prompts`` training
    prompts), with the per-prompt correct counts behind them.

    Metrics: ``eval/accuracy`` (avg@k), ``eval/reward``, ``eval/length``,
    ``eval/truncated_frac``; with k > 1 ``eval/pass@k`` (unbiased) and ``eval/maj@k``;
    ``eval/by_difficulty/<d>`` (avg@k per ``meta["difficulty"]``). Details:
    ``{"test": {"k": k, "correct": {record id: count}}, "train": ...}`` (what
    ``RUN_DIR/evals.jsonl`` holds). Sampling (when ``eval.temperature > 0``) is seeded by
    ``(seed, step)`` and each sample's prompt and index, so evaluating never touches the
    training run's random stream.
    """
    ec, rc = cfg.eval, cfg.rollout
    params = SamplingParams(
        temperature=ec.temperature, top_p=ec.top_p, max_new_tokens=rc.max_new_tokens,
        max_turns=rc.max_turns, stop=list(task.stop),
    )  # fmt: skip
    seed = (cfg.seed, step)
    result = evaluate(engine, task, "test", k=ec.k, params=params, limit=ec.prompts, seed=seed)
    metrics = {
        "eval/accuracy": result[f"avg@{ec.k}"],
        "eval/reward": result["mean_reward"],
        "eval/length": result["mean_policy_tokens"],
        "eval/truncated_frac": result["truncated"],
    }
    if ec.k > 1:
        metrics[f"eval/pass@{ec.k}"] = result[f"pass@{ec.k}"]
        metrics[f"eval/maj@{ec.k}"] = result[f"maj@{ec.k}"]
    metrics |= {f"eval/by_difficulty/{d}": v for d, v in result["by_difficulty"].items()}
    details = {"test": {"k": ec.k, "correct": result["per_prompt"]}}
    if ec.train_prompts:
        limit = min(ec.train_prompts, cfg.train_prompts or ec.train_prompts)
        train = evaluate(engine, task, "train", k=ec.k, params=params, limit=limit, seed=seed)
        metrics["eval/train_accuracy"] = train[f"avg@{ec.k}"]
        details["train"] = {"k": ec.k, "correct": train["per_prompt"]}
    return metrics, details


def counters(run: Run) -> dict[str, float]:
    """The cumulative counters as metrics: the policy's ``rollouts/cumulative`` and
    ``tokens/cumulative``, the verifier calls that raised or timed out (``verifier/failures``,
    ``verifier/timeouts``; they scored 0), each component's (PVPO's ``rollouts/presample`` and
    ``rollouts/refresh``, VAPO's ``rollouts/value_pretrain``...), an asynchronous run's
    ``rollouts/discarded`` (prefetched, never used), and ``rollouts/total``, the policy's
    rollouts plus all of those."""
    out = {
        "rollouts/cumulative": float(run.state.rollouts),
        "tokens/cumulative": float(run.state.tokens),
    }
    out |= {f"verifier/{k}": float(v) for k, v in run.task.verifier_stats().items()}
    total = float(run.state.rollouts)
    if run.state.discarded:  # asynchronous prefetches the stream moved past
        out["rollouts/discarded"] = float(run.state.discarded)
        total += run.state.discarded
    for component in run.components.values():
        extra = component.counters()
        total += sum(v for k, v in extra.items() if k.startswith("rollouts/") and k != UNCOUNTED)
        out |= extra
    out["rollouts/total"] = total
    if run.threads is not None:  # not a counter: which threads the figures were measured with
        out["threads/generate"] = float(run.threads.generate)
        out["threads/update"] = float(run.threads.update)
    return out


def write_summary(run: Run, last: dict[str, float], stop: str | None = None) -> None:
    """summary.json: the preset, the last step's metrics and the latest evaluation, why the
    run ended (``stop``: steps, budget, time_limit) and its ``budget.rollouts``."""
    summary = {"preset": run.cfg.preset, "steps": run.state.step, "last": last}
    summary |= {"stop": stop, "budget_rollouts": run.cfg.budget.rollouts}
    (run.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))


def build_components(setup: Setup) -> dict[str, Component]:
    """The run's method components, in the order the loop calls them.

    The built-in ones are ``cfg.methods`` (the estimator's inputs decide them, see
    :attr:`~anchor_rl.trainer.config.TrainConfig.methods`); then each component named in
    ``components``, a registered one built by ``factory(setup, **component_args[name])``,
    which finds the components built before it in ``setup.components``.

    Order: V0.5 acts on a step's rollouts before PVPO injects teacher rows (its fusion and
    prior see the policy's own rollouts only); then the critic; then the added components,
    in the order ``components`` lists them.
    """
    cfg, methods = setup.cfg, setup.cfg.methods
    pvpo = PVPO(setup, presample_anchors(setup, lazy=True)) if "pvpo" in methods else None
    components = setup.components
    if "v05" in methods:
        components["v05"] = V05(setup, pvpo)
    if pvpo is not None:
        components["pvpo"] = pvpo
    if "critic" in methods:
        components["critic"] = PPOCritic(setup)
    if "astarpo" in methods:
        components["astarpo"] = AStarPO(setup)
    if "perfect" in methods:
        components["perfect"] = Perfect(setup)
    for name in cfg.components:
        if name in components:
            raise ConfigError(f"components: {name!r} is a built-in component's name")
        components[name] = COMPONENTS[name](setup, **cfg.component_args.get(name, {}))
    return dict(components)


def ray_worker_sets(cfg: TrainConfig) -> list[WorkerSet]:
    """The sets of Ray rollout workers a run of ``cfg`` holds at once: the policy's, and with
    PVPO the reference's (presampling builds its own engine with the same options and keeps
    it for refreshes); none when the run samples in this process or over HTTP."""
    name, options = cfg.engine
    if name != "ray":
        return []
    defaults = inspect.signature(RayEngine).parameters
    value = {k: options.get(k, defaults[k].default) for k in ("workers", "num_cpus_per_worker",
                                                             "num_gpus_per_worker")}  # fmt: skip
    shape = (value["workers"], value["num_cpus_per_worker"], value["num_gpus_per_worker"])
    sets = [WorkerSet("the policy's", *shape)]
    if "pvpo" in cfg.methods:
        sets.append(WorkerSet("the reference's (PVPO presampling)", *shape))
    return sets


def check_ray_fit(cfg: TrainConfig) -> None:
    """Before the run builds anything: a local Ray started for the run must hold every set
    of its rollout workers at once (:func:`~anchor_rl.cluster.connect.check_local_fit`),
    else a ConfigError with the fix."""
    sets = ray_worker_sets(cfg)
    if sets:
        option = "cluster.rollout_workers" if cfg.cluster.rollout_workers else (
            "rollout.engine_args.workers")  # fmt: skip
        check_local_fit(cfg.engine[1].get("address", "local"), sets, option)


def _engine(
    cfg: TrainConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> Engine:
    """The run's engine; able to prefetch the next step's rollouts with ``cluster.async_steps``."""
    engine = make_engine(cfg.engine[0], policy, tokenizer, **cfg.engine[1])
    return PrefetchingEngine(engine) if cfg.cluster.async_steps else engine


def _assemble(
    cfg: TrainConfig,
    run_dir: Path,
    task: Task,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: TrainState,
    resuming: bool = False,
) -> Run:
    keep_freed_memory()  # anchor_rl.allocator: no page faults for each step's tensors
    if cfg.optim.activation_checkpointing:  # each layer recomputed in the backward pass
        checkpointing.enable(policy)
    choice = _threads(cfg, policy)
    optimizer, scheduler = make_optimizer(cfg, trainable_parameters(policy))
    setup = Setup(
        cfg=cfg,
        run_dir=run_dir,
        task=task,
        records=task.records("train")[: cfg.train_prompts],
        policy=policy,
        tokenizer=tokenizer,
        engine=_engine(cfg, policy, tokenizer),
        generator=torch.Generator(device=cfg.device).manual_seed(cfg.seed),
        resuming=resuming,
    )
    # The frozen initial policy of the KL term (also PVPO's reference): the same spec loaded
    # again (deterministic for every spec); without a KL term, loaded when a component asks.
    ref = setup.get_reference() if cfg.needs_ref else None
    components = build_components(setup)
    records = setup.records
    for component in components.values():
        records = component.training_records(records)
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        task=task,
        policy=policy,
        tokenizer=tokenizer,
        ref=ref,
        engine=setup.engine,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=_prompt_stream(components, records, cfg.seed, state.consumed),
        generator=setup.generator,
        state=state,
        components=components,
        threads=choice,
    )
    critic = components.get("critic")
    if isinstance(critic, PPOCritic) and cfg.cluster.learners > 1:
        critic.learners = run.learner_group  # the critic's update runs on the ranks too
    return run


def _prompt_stream(
    components: dict[str, Component], records: list[Record], seed: int, consumed: int
) -> PromptSampler:
    """The first stream a component draws itself (``Component.prompt_stream``), else
    ``records`` shuffled each epoch."""
    for component in components.values():
        if (stream := component.prompt_stream(seed, consumed)) is not None:
            return stream
    return PromptSampler(records, seed, consumed)


def _threads(cfg: TrainConfig, policy: PreTrainedModel) -> threads.ThreadChoice:
    """The run's torch threads per phase (``cfg.threads``, ``$OMP_NUM_THREADS`` or ``auto``
    by the policy's size): this process runs at the update's count, the engine switches to
    the generation's while it samples. Printed as one line unless ``log.progress`` is off."""
    threads.configure(cfg.threads)
    choice = threads.choose_threads(threads.parameter_count(policy), cfg.threads)
    threads.apply(choice, "update")
    if cfg.log.progress:
        from rich.console import Console

        Console().print(choice.line(), highlight=False)
    return choice


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
