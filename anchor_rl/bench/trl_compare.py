"""Suite ``trl``: anchor-rl's ``grpo`` preset beside TRL's ``GRPOTrainer``, same settings.

Both trainers get the same initial model, the same prompt stream (anchor-rl's
``PromptSampler`` order for the seed; TRL reads that list in order with shuffling off), the
same group size, prompts per step, temperature, completion budget, stop tokens, learning
rate, clipping, KL and loss aggregation (:func:`grpo_config_kwargs` is the mapping), and run
the same number of steps. Each run happens in a fresh process, the two trainers in
alternation (seed 0: anchor-rl first, seed 1: TRL first, ...), so peak memory is that of one
trainer and slow drift in the machine's load falls on both. After training, both final
models are evaluated on the held-out prompts by the same function
(``anchor_rl.trainer.run.evaluate_model``).

Per run it records seconds per step, generated tokens, peak resident memory (``ru_maxrss``;
on CUDA also the peak allocated device memory) and per-step reward, KL and entropy, then
writes ``trl_compare.json``, ``trl_compare.md`` (mean and 95% t-interval over seeds, the
ratios, the TRL version, every setting mapped and everything that differs) and
``reward_vs_step.png``.

TRL and ``datasets`` come with the ``compare`` extra and are imported only here.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from anchor_rl.bench.runner import BenchArgs, RunSpec, Suite, plan
from anchor_rl.bench.stats import Interval, t_interval
from anchor_rl.bench.throughput import command_line, host_info
from anchor_rl.trainer.config import ConfigError, TrainConfig, build_config

INSTALL_HINT = 'pip install -e ".[compare]"'
RESULT_FILE = "result.json"
RUN_KEYS = ("config", "steps", "wall_s", "process_s", "memory", "eval", "allocator")
"""What the summary keeps of each run's ``result.json`` (``process_s``: the run's whole
process, start to exit, as the suite timed it; ``allocator``: how its glibc allocator was
set, :func:`allocator_settings`; both missing in runs from before they were recorded)."""
FRAMEWORKS = ("anchor-rl", "trl")

TRL_SUITE = Suite(
    name="trl",
    description="anchor-rl grpo beside TRL GRPOTrainer: same model, prompts and settings",
    presets=["grpo"],
    seeds=[0, 1],
    base={
        "task": "arithmetic",
        "model": "sft:tiny",
        "steps": 20,
        "rollout": {"prompts_per_step": 8, "n": 8, "max_new_tokens": 80},
        # No evaluation inside the timed steps: both final models are evaluated afterwards.
        "eval": {"every": 0, "prompts": 64},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": True},
    },
    profiles={
        "quick": {
            "model": "random:tiny",
            "steps": 1,
            "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 8},
            "eval": {"prompts": 4},
            "log": {"progress": False},
        }
    },
)
"""The suite: the ``grpo`` preset at the trainer's default CPU scale, 20 steps, 2 seeds."""

LOSS_TYPES = {
    "seq-mean-token-mean": "grpo",
    "token-mean": "dapo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
"""anchor-rl ``loss.agg`` -> TRL ``loss_type`` (same normalisation of the token losses)."""
SCALE_REWARDS = {"grpo": "group", "drgrpo": "none"}
"""anchor-rl ``advantage.estimator`` -> TRL ``scale_rewards``."""

DIFFERENCES: tuple[tuple[str, str, str, str], ...] = (
    (
        "sampler",
        "own loop with a static KV cache (`decode=auto`: eager on the CPU, where finished "
        "rows leave the batch; on a GPU each step a CUDA graph replay, finished rows kept)",
        "`model.generate`; finished rows are padded until the longest ends",
        "each library's generation path; same temperature, top-p, budget and stop tokens",
    ),
    (
        "random stream",
        "per-request uniforms: splitmix64 of the request's seed and the token's index",
        "`set_seed(seed)` (global RNG)",
        "the same seed draws different samples, so the runs agree in distribution, not token by token",
    ),
    (
        "scoring forward",
        "on the CPU padding-free, each prompt once for the group that shares it; on a GPU "
        "padded unless a pass is large and much of it padding "
        "(`optim.padding_free=auto`, `optim.shared_prefix=auto`)",
        "a padded batch (prompt and completion tensors): each prompt once per completion",
        "each library's default layout; the same log-probs up to float rounding (on the CPU "
        "the prompt's share of the forward and backward pass is paid once per group by "
        "anchor-rl)",
    ),
    (
        "old log-probs",
        "the loss pass's own log-probs, detached (the single pass, `optim.rescore=auto`)",
        "the loss pass's own log-probs, detached (one update per generation)",
        "the same arithmetic (ratio 1); `optim.rescore=always` would add anchor-rl's separate "
        "no-grad pass, one forward per step",
    ),
    (
        "precision",
        "float32; with `optim.autocast=bf16` and `rollout.engine_args.precision=bf16`, scoring "
        "and update under `torch.autocast` to bfloat16 and sampling from a bfloat16 copy of "
        "the weights",
        "float32; with `bf16=True`, accelerate's `torch.autocast` around the model's forward, "
        "generation included",
        "the same bfloat16 matmuls with float32 master weights; anchor-rl's sampler reads "
        "bfloat16 weights where autocast casts the float32 ones at every op",
    ),
    (
        "allocator",
        "glibc's mmap and trim thresholds raised when the run starts (`anchor_rl.allocator`; "
        "`ANCHOR_RL_MALLOC=default` turns it off)",
        "glibc's defaults",
        "each library's process as a user gets it; freed memory kept for the next step saves "
        "anchor-rl the page faults of re-allocating it (a control: the `MALLOC_*_THRESHOLD_` "
        "variables set for both, docs/results.md)",
    ),
    (
        "std epsilon",
        "1e-6",
        "1e-4 (hard-coded)",
        "TRL has no setting for it; for 0/1 rewards at n = 8 a non-zero group std is >= 0.35, so "
        "advantages differ by < 3e-4 relative",
    ),
    (
        "step time",
        "`time/step` (rollout, rewards, log-probs, update, metric line)",
        "wall time between consecutive `on_step_end` callbacks",
        "both cover generation, scoring, reference log-probs and the update; neither includes "
        "model loading or the final save",
    ),
    (
        "process memory",
        "imports torch, transformers",
        "also imports trl, accelerate, datasets, pandas",
        "peak RSS counts everything the process loaded; the RSS before training is shown too",
    ),
)
"""What cannot be made equal: (setting, anchor-rl, TRL, why)."""


def require_trl() -> Any:
    """The ``trl`` module; ImportError naming the ``compare`` extra when it (or ``datasets``) is missing."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as e:
        raise ImportError(f"the trl suite needs TRL and datasets ({e}): {INSTALL_HINT}") from e
    return trl


def checkpointing_argument() -> str:
    """The name of transformers' activation-checkpointing switch: ``activation_checkpointing``
    since it was renamed (the old name, ``gradient_checkpointing``, then warns that it is
    deprecated), the old name before (transformers 5.17 knows only that one)."""
    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def grpo_config_kwargs(cfg: TrainConfig, output_dir: str) -> dict[str, Any]:
    """Keyword arguments of TRL's ``GRPOConfig`` that train like ``cfg``.

    One anchor-rl step (P prompts x n responses, ``optim.epochs`` passes of
    ``optim.mini_batches`` optimizer steps, micro-batches of ``optim.micro_batch_size``)
    becomes one TRL generation of P * n completions, ``steps_per_generation`` micro-batches
    with gradient accumulation, reused ``num_iterations`` times, so ``max_steps`` counts
    optimizer steps: ``steps * epochs * mini_batches``.

    Raises ConfigError naming the knob for settings TRL cannot express the same way.
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
    return kwargs


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


def stop_token_ids(tokenizer: Any, stops: Sequence[str]) -> list[int]:
    """The single token id of each stop string (TRL ends a completion only on eos ids)."""
    ids = []
    for stop in stops:
        encoded = tokenizer.encode(stop, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(
                f"stop string {stop!r} is {len(encoded)} tokens; the TRL side can stop only on "
                "single-token stops (passed to it as eos ids)"
            )
        ids.append(encoded[0])
    return ids


def prompt_rows(tokenizer: Any, task: Any, records: Sequence[Any]) -> list[dict[str, Any]]:
    """Dataset rows ``{"prompt": text, "record": i}``: the prompt rendered exactly as
    anchor-rl's engine renders it (``encode_prompt``: chat template, the task's instruction
    as the system message), as text that tokenises back to the same ids."""
    from anchor_rl.models.tokenizer import encode_prompt

    rows = []
    for i, record in enumerate(records):
        ids = encode_prompt(tokenizer, record.prompt, task.instruction)
        text = tokenizer.decode(ids)
        if tokenizer(text=text, add_special_tokens=False)["input_ids"] != ids:
            raise ConfigError(
                f"prompt of record {record.id!r} does not survive decode/encode with this "
                "tokenizer; the TRL side would see different tokens"
            )
        rows.append({"prompt": text, "record": i})
    return rows


def task_reward_function(
    task: Any, records: Sequence[Any], generated: list[int]
) -> Callable[..., list[float]]:
    """The task's reward in TRL's signature; appends the tokens generated per call to ``generated``.

    ``record[i]`` (a dataset column) indexes ``records``.
    """

    def task_reward(
        prompts: list[str],
        completions: list[str],
        record: list[int],
        completion_ids: list[list[int]],
        **_: Any,
    ) -> list[float]:
        generated.append(sum(len(ids) for ids in completion_ids))
        return [task.reward(text, records[i]) for text, i in zip(completions, record, strict=True)]

    return task_reward


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


# --- the suite ---------------------------------------------------------------------------


JAX_SETTINGS = {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
"""What :func:`keep_jax_off_the_gpu` sets where the environment does not say otherwise."""


def keep_jax_off_the_gpu() -> None:
    """Keep JAX, if an import of the comparison's processes loads it, off the GPU: on an
    H200 with JAX installed, a process of this suite held 75% of the GPU's memory (JAX's
    default preallocation) and both trainers ran out of memory. Nothing here uses JAX; the
    runs' processes inherit the setting. A variable the environment sets wins."""
    for name, value in JAX_SETTINGS.items():
        os.environ.setdefault(name, value)


def run_trl_suite(
    args: BenchArgs,
) -> dict[str, Any]:
    """Train anchor-rl and TRL for every seed (alternating, each in a fresh process),
    evaluate both final models, write the comparison. Finished runs of the same config are
    kept; others are started over (a timing benchmark is not resumed).

    Returns ``{"summary_json", "summary_md", "plots"}`` paths.
    """
    out, seeds, steps, overrides, profile, echo = args.unpack()
    require_trl()
    keep_jax_off_the_gpu()
    specs = plan(TRL_SUITE, out, seeds, steps, overrides, profile)
    for spec in specs:
        grpo_config_kwargs(spec.config, "")  # fail before any run
    _check_task(specs[0].config)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    command = command_line("trl", out, seeds, steps, overrides, profile)
    planned = [spec.seed for spec in specs]
    total = 2 * len(specs)
    done = 0
    written: dict[str, Any] = {}
    for k, spec in enumerate(specs):
        order = FRAMEWORKS if k % 2 == 0 else FRAMEWORKS[::-1]
        for framework in order:
            done += 1
            run_dir = out / framework / f"seed{spec.seed}"
            echo(f"[{done}/{total}] {framework} seed {spec.seed} -> {run_dir}")
            result = _run_once(framework, spec.config, run_dir)
            results[framework].append(result)
            echo(
                f"    {framework} seed {spec.seed}: {result['wall_s']:.1f} s training, "
                f"{result.get('process_s', 0.0):.1f} s for its whole process (start, imports, "
                "loading, training, saving)"
            )
        started = time.perf_counter()
        _evaluate_seed(spec, out, results)
        echo(f"    seed {spec.seed} evaluated in {time.perf_counter() - started:.1f} s")
        # after every seed, so a comparison cut short leaves the summary of its seeds
        written = _write(out, specs[0].config, results, command, planned)
    return written


def rewrite_summary(
    out: Path, command: str, planned: Sequence[int] | None = None, note: str = ""
) -> dict[str, Any]:
    """Summarise the finished runs in ``out`` again (``trl_compare.json`` / ``.md``, the
    plot), e.g. of a comparison stopped before its last seed: seeds that only one trainer
    finished are left out, and the summary names them. ``command`` is the one the runs came
    from; ``planned`` its seeds (default: those with a finished run); ``note`` a sentence
    for the summary (e.g. what the runs' code did differently from today's).

    Returns ``{"summary_json", "summary_md", "plots"}`` paths, like the suite."""
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    for framework in FRAMEWORKS:
        for path in sorted((out / framework).glob(f"seed*/{RESULT_FILE}")):
            results[framework].append(json.loads(path.read_text()))
    paired, _ = _paired(results)
    if not paired["trl"]:
        raise ValueError(f"{out} holds no seed that both trainers finished")
    if planned is None:
        planned = {r["config"]["seed"] for runs in results.values() for r in runs}
    cfg = build_config(paired["anchor-rl"][0]["config"])
    return _write(out, cfg, results, command, sorted(planned), note)


def _paired(
    results: dict[str, list[dict[str, Any]]],
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """The runs of the seeds both trainers finished (each framework's in seed order), and
    the others as ``framework seed N``."""
    by_seed = {f: {r["config"]["seed"]: r for r in runs} for f, runs in results.items()}
    both = sorted(set.intersection(*(set(runs) for runs in by_seed.values())))
    alone = [
        f"{f} seed {seed}"
        for f, runs in by_seed.items()
        for seed in sorted(runs)
        if seed not in both
    ]
    return {f: [runs[seed] for seed in both] for f, runs in by_seed.items()}, alone


def _check_task(cfg: TrainConfig) -> None:
    from anchor_rl.trainer.run import load_task

    task = load_task(cfg)
    if task.tools:
        raise ConfigError(
            f"task {cfg.task!r} uses tools; the TRL comparison covers single-turn tasks only"
        )


def _run_once(framework: str, cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """One training run in a fresh process (skipped when a finished one of this config exists)."""
    config = cfg.model_dump(mode="json")
    path = run_dir / RESULT_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["config"] == config:
            return stored
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    process = multiprocessing.get_context("spawn").Process(
        target=_worker, args=(framework, config, str(run_dir))
    )
    started = time.perf_counter()
    process.start()
    process.join()
    if process.exitcode != 0 or not path.is_file():
        raise RuntimeError(
            f"the {framework} run in {run_dir} failed (exit code {process.exitcode}); "
            "its traceback is printed above"
        )
    result = json.loads(path.read_text())
    result["process_s"] = time.perf_counter() - started  # the run's whole process
    path.write_text(json.dumps(result, indent=2))
    return result


def _worker(framework: str, config: dict[str, Any], run_dir: str) -> None:
    """Process entry point: train one framework and write ``result.json``."""
    from anchor_rl.models.loading import quiet_transformers

    cfg = build_config(config)
    train = _train_anchor if framework == "anchor-rl" else _train_trl
    with quiet_transformers():  # loading/saving bars; the training bar stays
        result = train(cfg, Path(run_dir))
    result |= {"framework": framework, "config": config, "host": host_info(cfg.device)}
    result["allocator"] = allocator_settings()
    (Path(run_dir) / RESULT_FILE).write_text(json.dumps(result, indent=2))


def allocator_settings() -> dict[str, Any]:
    """How this process's glibc allocator was set: by anchor-rl (``kept``, the run set its
    thresholds: ``anchor_rl.allocator``) or by ``MALLOC_*`` variables."""
    from anchor_rl import allocator

    names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return {"kept": allocator.kept()} | {k: os.environ[k] for k in names if k in os.environ}


def _train_anchor(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    from anchor_rl.trainer.checkpoint import latest_checkpoint
    from anchor_rl.trainer.logging import read_metrics
    from anchor_rl.trainer.loop import train
    from anchor_rl.trainer.run import start_run

    run = start_run(cfg, run_dir)
    memory = _Memory(cfg.device)
    started = time.perf_counter()
    train(run)
    wall = time.perf_counter() - started
    steps = [
        {
            "step": r["step"],
            "seconds": r["time/step"],
            "tokens": r["tokens/step"],
            "reward": r["reward/mean"],
            "kl": r.get("kl/ref"),
            "entropy": r.get("policy/entropy"),
            "length": r["response/length"],
        }
        for r in read_metrics(run_dir)
        if r["step"] > 0
    ]
    return {
        "version": metadata.version("anchor-rl"),
        "steps": steps,
        "wall_s": wall,
        "memory": memory.read(),
        "policy_dir": str(latest_checkpoint(run_dir) / "policy"),
    }


def _train_trl(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    trl = require_trl()
    import datasets
    from transformers.trainer_callback import PrinterCallback

    from anchor_rl.models.loading import save_policy
    from anchor_rl.trainer.data import PromptSampler
    from anchor_rl.trainer.run import load_task

    task = load_task(cfg)
    policy, tokenizer = _initial_policy(cfg, run_dir)
    eos = policy.generation_config.eos_token_id
    policy.generation_config.eos_token_id = sorted(
        {tokenizer.eos_token_id, *stop_token_ids(tokenizer, task.stop)}
    )
    p = cfg.rollout.prompts_per_step
    # The stream anchor-rl's run draws (run._assemble: the first train_prompts records).
    train = task.records("train")[: cfg.train_prompts]
    records = PromptSampler(train, cfg.seed).take(cfg.steps * p)
    dataset = datasets.Dataset.from_list(prompt_rows(tokenizer, task, records))
    generated: list[int] = []
    clock = _StepClock(trl_steps_per_step=cfg.optim.epochs * cfg.optim.mini_batches)
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=task_reward_function(task, records, generated),
        args=trl.GRPOConfig(**grpo_config_kwargs(cfg, str(run_dir / "trainer"))),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock.callback(cfg.steps, cfg.log.progress)],
    )
    trainer.remove_callback(PrinterCallback)
    memory = _Memory(cfg.device)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    policy.generation_config.eos_token_id = eos
    save_policy(trainer.model, tokenizer, run_dir / "policy")
    steps = clock.steps(generated)
    return {
        "version": trl.__version__,
        "steps": steps,
        "wall_s": wall,
        "memory": memory.read(),
        "policy_dir": str(run_dir / "policy"),
    }


def _initial_policy(cfg: TrainConfig, run_dir: Path) -> tuple[Any, Any]:
    """The run's initial policy, loaded from a directory (TRL builds its reference model
    from the policy's ``name_or_path``); a ``random:`` spec is saved to ``run_dir/initial``."""
    from anchor_rl.models.loading import load_policy, quiet_transformers, save_policy
    from anchor_rl.rollout.spec import load_spec

    policy, tokenizer = load_spec(
        cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
    )
    if (Path(policy.config.name_or_path) / "config.json").is_file():
        return policy, tokenizer
    path = run_dir / "initial"
    save_policy(policy, tokenizer, path)
    with quiet_transformers():
        return load_policy(path, device=cfg.device)


class _Memory:
    """Resident memory before training (everything imported and loaded) and its peak after."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        self.before_mb = peak_rss_mb()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, float | None]:
        import torch

        cuda = torch.cuda.max_memory_allocated() / 2**20 if self.device.startswith("cuda") else None
        return {"rss_before_mb": self.before_mb, "rss_peak_mb": peak_rss_mb(), "cuda_peak_mb": cuda}


class _StepClock:
    """Wall time of TRL's optimizer steps and the logged metrics, grouped into anchor-rl steps."""

    LOGS = {
        "reward": "reward",
        "kl": "kl",
        "entropy": "entropy",
        "length": "completions/mean_length",
    }

    def __init__(self, trl_steps_per_step: int) -> None:
        self.group = trl_steps_per_step
        self.ends: list[float] = []
        self.logs: list[dict[str, float]] = []
        self.start = 0.0

    def callback(self, total: int, progress: bool) -> Any:
        from transformers import TrainerCallback

        from anchor_rl.progress import Progress

        clock = self
        bar = Progress("trl", total, enabled=progress)

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.start = time.perf_counter()
                bar.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.perf_counter())
                if len(clock.ends) % clock.group == 0:
                    bar.update(advance=1)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    clock.logs.append(dict(logs))

            def on_train_end(self, args, state, control, **kwargs):
                bar.__exit__(None, None, None)

        return Clock()

    def steps(self, generated: Sequence[int]) -> list[dict[str, Any]]:
        """Per anchor-rl step: seconds, generated tokens and the mean logged figures."""
        times = [b - a for a, b in zip([self.start, *self.ends], self.ends, strict=False)]
        out = []
        for s in range(len(times) // self.group):
            part = slice(s * self.group, (s + 1) * self.group)
            logs = self.logs[part]
            row: dict[str, Any] = {
                "step": s + 1,
                "seconds": sum(times[part]),
                "tokens": float(generated[s]),
            }
            for key, name in self.LOGS.items():
                values = [log[name] for log in logs if name in log]
                row[key] = sum(values) / len(values) if values else None
            out.append(row)
        return out


def _evaluate_seed(spec: RunSpec, out: Path, results: dict[str, list[dict[str, Any]]]) -> None:
    """Held-out metrics of the initial and both final models (same function, same prompts)."""
    from anchor_rl.models.loading import load_policy, quiet_transformers
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.spec import load_spec
    from anchor_rl.trainer.run import evaluate_model, load_task

    cfg = spec.config
    pending = {f: results[f][-1] for f in FRAMEWORKS if "eval" not in results[f][-1]}
    if not pending:
        return
    task = load_task(cfg)
    initial, tokenizer = load_spec(cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, False)
    start = evaluate_model(make_engine("hf", initial, tokenizer), task, cfg, 0)
    for framework, result in pending.items():
        with quiet_transformers():
            model, tok = load_policy(result["policy_dir"], device=cfg.device)
        final = evaluate_model(make_engine("hf", model, tok), task, cfg, cfg.steps)
        result["eval"] = {"start": start, "final": final}
        path = out / framework / f"seed{spec.seed}" / RESULT_FILE
        path.write_text(json.dumps(result, indent=2))


# --- summary -----------------------------------------------------------------------------

FIGURES: dict[str, str] = {
    "s_per_step": "seconds per step (mean over steps)",
    "s_per_step_warm": "seconds per step after the first (mean; the first warms caches up)",
    "tokens_per_s": "generated tokens per second of training",
    "tokens_per_step": "generated tokens per step",
    "rss_peak_mb": "peak resident memory of the process (MiB)",
    "rss_before_mb": "resident memory before the first step (MiB)",
    "cuda_peak_mb": "peak allocated GPU memory during training (MiB)",
    "eval_start": "held-out accuracy of the initial model",
    "eval_final": "held-out accuracy after the last step",
    "reward_last": "training reward, mean over the last fifth of the steps",
}


def figure_digits(key: str) -> int:
    """Decimals a figure is shown with: accuracies and rewards 3, seconds 2, counts 0."""
    return 3 if key.startswith(("eval", "reward")) else 2 if key.startswith("s_per_step") else 0


RATIOS = (
    "s_per_step",
    "s_per_step_warm",
    "tokens_per_s",
    "tokens_per_step",
    "rss_peak_mb",
    "cuda_peak_mb",
)


def run_figures(result: dict[str, Any]) -> dict[str, float]:
    """The ``FIGURES`` of one run's ``result.json`` (those it has)."""
    steps = result["steps"]
    if not steps:
        raise ValueError("the run has no step")
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    tail = steps[-max(1, len(steps) // 5) :]
    memory = result["memory"]
    out = {
        "s_per_step": seconds / len(steps),
        "tokens_per_s": tokens / seconds,
        "tokens_per_step": tokens / len(steps),
        "rss_peak_mb": memory["rss_peak_mb"],
        "rss_before_mb": memory["rss_before_mb"],
        "reward_last": sum(s["reward"] for s in tail) / len(tail),
    }
    if len(steps) > 1:
        out["s_per_step_warm"] = sum(s["seconds"] for s in steps[1:]) / (len(steps) - 1)
    if memory.get("cuda_peak_mb") is not None:
        out["cuda_peak_mb"] = memory["cuda_peak_mb"]
    if "eval" in result:
        out["eval_start"] = result["eval"]["start"]["eval/accuracy"]
        out["eval_final"] = result["eval"]["final"]["eval/accuracy"]
    return out


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per framework and figure: mean, 95% t half-width, n and the per-seed values."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for framework, runs in results.items():
        figures = [run_figures(r) for r in runs]
        out[framework] = {}
        for key in FIGURES:
            values = [f[key] for f in figures if key in f]
            if values:
                iv = t_interval(values)
                out[framework][key] = {
                    "mean": iv.mean,
                    "half_width": iv.half_width,
                    "n": iv.n,
                    "values": values,
                }
    return out


def ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per seed (the two runs of a seed ran back to back), TRL / anchor-rl for the cost
    figures and TRL - anchor-rl for the final accuracy (``eval_final_diff``); mean, 95%
    t half-width, n and the per-seed values, like ``summarise``."""
    ours, theirs = summary["anchor-rl"], summary["trl"]
    paired: dict[str, list[float]] = {}
    for key in RATIOS:
        if key in ours and key in theirs:
            pairs = zip(theirs[key]["values"], ours[key]["values"], strict=True)
            paired[key] = [t / o for t, o in pairs]
    if "eval_final" in ours and "eval_final" in theirs:
        pairs = zip(theirs["eval_final"]["values"], ours["eval_final"]["values"], strict=True)
        paired["eval_final_diff"] = [t - o for t, o in pairs]
    out = {}
    for key, values in paired.items():
        iv = t_interval(values)
        out[key] = {"mean": iv.mean, "half_width": iv.half_width, "n": iv.n, "values": values}
    return out


def _write(
    out: Path,
    cfg: TrainConfig,
    results: dict[str, list[dict[str, Any]]],
    command: str,
    planned: Sequence[int],
    note: str = "",
) -> dict[str, Any]:
    """Summarise the seeds both trainers finished (of the ``planned`` ones)."""
    results, alone = _paired(results)
    summary = summarise(results)
    mapped = grpo_config_kwargs(cfg, "")
    host = results["trl"][0]["host"]
    payload = {
        "suite": "trl",
        "command": command,
        "trl_version": results["trl"][0]["version"],
        "host": host,
        "seeds": [r["config"]["seed"] for r in results["anchor-rl"]],
        "seeds_planned": list(planned),
        "unpaired": alone,
        "note": note,
        "settings": _settings(cfg),
        "grpo_config": {k: v for k, v in mapped.items() if k != "output_dir"},
        "differences": [list(d) for d in DIFFERENCES],
        "figures": FIGURES,
        "summary": summary,
        "ratios": ratios(summary),
        "runs": {
            f: [{k: r[k] for k in RUN_KEYS if k in r} for r in rs] for f, rs in results.items()
        },
    }
    json_path, md_path = out / "trl_compare.json", out / "trl_compare.md"
    json_path.write_text(json.dumps(payload, indent=2))
    md_path.write_text(markdown(payload))
    plot = out / "reward_vs_step.png"
    plot_rewards(payload["runs"], plot)
    return {"summary_json": json_path, "summary_md": md_path, "plots": [plot]}


def _settings(cfg: TrainConfig) -> dict[str, Any]:
    r, o = cfg.rollout, cfg.optim
    return {
        "preset": cfg.preset,
        "task": cfg.task,
        "model": cfg.model,
        "steps": cfg.steps,
        "prompts_per_step": r.prompts_per_step,
        "group_size": r.n,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "max_new_tokens": r.max_new_tokens,
        "lr": o.lr,
        "epochs": o.epochs,
        "mini_batches": o.mini_batches,
        "kl_coef": cfg.kl.coef,
        "clip": [cfg.loss.clip_low, cfg.loss.clip_high],
        "loss_agg": cfg.loss.agg,
        "precision": "bf16" if cfg.optim.autocast == "bf16" else "fp32",
        "anchor_rl_decode": cfg.rollout.engine_args.get("decode", "auto"),
        "eval_prompts": cfg.eval.prompts,
        "eval_temperature": cfg.eval.temperature,
    }


def _cell(figure: dict[str, Any] | None, digits: int) -> str:
    if figure is None:
        return "–"
    return Interval(figure["mean"], figure["half_width"], figure["n"]).fmt(digits)


def ratio_cells(ratio: dict[str, dict[str, Any]], key: str, times: str = "x") -> tuple[str, str]:
    """The paired TRL / anchor-rl cell of figure ``key`` (mean ± half-width of the per-seed
    ratios, ``times`` after it; for the final accuracy the difference) and the median of the
    per-seed values (with three seeds, the middle one); empty strings where ``key`` has none."""
    if key in ratio:
        median = statistics.median(ratio[key]["values"])
        return _cell(ratio[key], 2) + times, f"{median:.2f}{times}"
    if key == "eval_final" and "eval_final_diff" in ratio:
        diff = ratio["eval_final_diff"]
        return _cell(diff, 3) + " (difference)", f"{statistics.median(diff['values']):+.3f}"
    return "", ""


def _decode_note(decode: str) -> str:
    """What the summary says of anchor-rl's decoder when it is not the default one (the
    differences table describes ``decode=auto``)."""
    if decode == "auto":
        return ""
    return f" anchor-rl samples with `rollout.engine_args.decode={decode}`."


def partial_note(payload: dict[str, Any]) -> list[str]:
    """The payload's note, and a paragraph when fewer seeds were summarised than planned."""
    planned = payload.get("seeds_planned", payload["seeds"])
    note = [payload["note"], ""] if payload.get("note") else []
    if list(planned) == list(payload["seeds"]):
        return note
    left = ", ".join(payload.get("unpaired", [])) or "none"
    return [
        *note,
        f"**Partial**: {len(payload['seeds'])} of the {len(planned)} planned seeds "
        f"({', '.join(map(str, planned))}) finished with both trainers; finished runs left "
        f"out for want of their pair: {left}.",
        "",
    ]


def markdown(payload: dict[str, Any]) -> str:
    """The comparison as markdown: figures with ratios, settings, the mapping, the differences."""
    summary, ratio, host = payload["summary"], payload["ratios"], payload["host"]
    versions = ", ".join(f"{k} {v}" for k, v in host["versions"].items() if v and k != "trl")
    s = payload["settings"]
    lines = [
        "# Suite `trl`: anchor-rl `grpo` beside TRL `GRPOTrainer`",
        "",
        f"TRL {payload['trl_version']} ({versions}); device {host['device']} "
        f"({host['device_name']}, {host['torch_threads']} torch threads); seeds "
        f"{', '.join(map(str, payload['seeds']))}, each trainer in a fresh process, in alternation.",
        "",
        f"Same for both: task `{s['task']}`, model `{s['model']}`, {s['steps']} steps of "
        f"{s['prompts_per_step']} prompts x {s['group_size']} completions (the same prompts in the "
        f"same order), temperature {s['temperature']}, top-p {s['top_p']}, at most "
        f"{s['max_new_tokens']} new tokens, lr {s['lr']:g}, KL beta {s['kl_coef']:g} (k3 in the "
        f"loss), clip {s['clip'][0]}/{s['clip'][1]}, loss `{s['loss_agg']}`, {s['epochs']} "
        f"epoch(s) x {s['mini_batches']} mini-batch(es), {s.get('precision', 'fp32')}. "
        "Held-out accuracy: "
        f"{s['eval_prompts']} test prompts, temperature {s['eval_temperature']}, the same "
        "`evaluate_model` call for both final models."
        + _decode_note(s.get("anchor_rl_decode", "auto")),
        "",
        *partial_note(payload),
        "Mean ± half-width of the 95% Student-t interval over seeds; the last two columns "
        "pair the two runs of each seed (they ran back to back): the mean of the per-seed "
        "ratios and their median. Wall-clock figures were taken on a shared machine; the "
        "ratio is the comparable number.",
        "",
        "| figure | anchor-rl | TRL | TRL / anchor-rl | median of seeds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in FIGURES.items():
        ours, theirs = summary["anchor-rl"].get(key), summary["trl"].get(key)
        if ours is None and theirs is None:
            continue
        digits = figure_digits(key)
        rel, median = ratio_cells(ratio, key)
        lines.append(
            f"| {label} | {_cell(ours, digits)} | {_cell(theirs, digits)} | {rel} | {median} |"
        )
    lines += [
        "",
        "## Settings mapped to `GRPOConfig`",
        "",
        ", ".join(f"`{k}={v!r}`" for k, v in payload["grpo_config"].items()),
        "",
        "## What differs, and why",
        "",
        "| setting | anchor-rl | TRL | why |",
        "| --- | --- | --- | --- |",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in payload["differences"]),
        "",
        f"Command: `{payload['command']}`",
        "",
    ]
    return "\n".join(lines)


def plot_rewards(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Training reward against step, mean over seeds, one line per framework."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for framework, rs in runs.items():
        n = min(len(r["steps"]) for r in rs)
        xs = list(range(1, n + 1))
        ys = [sum(r["steps"][i]["reward"] for r in rs) / len(rs) for i in range(n)]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{framework} (n={len(rs)})")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (mean over the step's completions)")
    ax.set_title("anchor-rl grpo vs TRL GRPOTrainer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
