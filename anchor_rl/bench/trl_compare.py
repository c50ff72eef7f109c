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

Overrides ``trl.FIELD=VALUE`` set TRL's own ``GRPOConfig`` fields for its runs only (speed
settings such as ``cache_implementation``); ``trl.best=true`` adds those that make TRL's CPU
step faster without changing what is trained (``trl_config.BEST_CPU``).

TRL learns from the TRL plug-in's dataset and reward (``anchor_rl.integrations.trl.data``).
TRL and ``datasets`` come with the ``compare`` extra and are imported inside the runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from anchor_rl.bench.host import host_info
from anchor_rl.bench.runner import BenchArgs, RunSpec, Suite, command_line, plan
from anchor_rl.bench.trl_config import (
    check_trl_options,
    grpo_config_kwargs,
    require_trl,
    split_trl_options,
)
from anchor_rl.bench.trl_report import FRAMEWORKS, RESULT_FILE, write_summary
from anchor_rl.trainer.config import ConfigError, TrainConfig, build_config

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


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


# --- the suite ---------------------------------------------------------------------------


JAX_SETTINGS = {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
"""What :func:`keep_jax_off_the_gpu` sets where the environment does not say otherwise."""


def keep_jax_off_the_gpu() -> None:
    """Keep JAX, if an import of the comparison's processes loads it, off the GPU: JAX
    preallocates most of a GPU's memory by default, which leaves the trainers too little.
    Nothing here uses JAX; the runs' processes inherit the setting. A variable the
    environment sets wins."""
    for name, value in JAX_SETTINGS.items():
        os.environ.setdefault(name, value)


def run_trl_suite(
    args: BenchArgs,
) -> dict[str, Any]:
    """Train anchor-rl and TRL for every seed (alternating, each in a fresh process),
    evaluate both final models, write the comparison. Finished runs of the same config are
    kept; others are started over (a timing benchmark is not resumed).

    Overrides ``trl.FIELD=VALUE`` (and ``trl.best=true``) set TRL's own ``GRPOConfig``
    fields for its runs (:func:`split_trl_options`); the others configure both trainers.

    Returns ``{"summary_json", "summary_md", "plots"}`` paths.
    """
    out, seeds, steps, given, profile, echo = args.unpack()
    overrides, options = split_trl_options(given)
    check_trl_options(require_trl(), options)
    keep_jax_off_the_gpu()
    specs = plan(TRL_SUITE, out, seeds, steps, overrides, profile)
    for spec in specs:
        grpo_config_kwargs(spec.config, "", options)  # fail before any run
    _check_task(specs[0].config)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    command = command_line("trl", out, seeds, steps, given, profile)
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
            result = _run_once(framework, spec.config, run_dir, options)
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
        written = write_summary(out, specs[0].config, results, command, planned, options=options)
    return written


def _check_task(cfg: TrainConfig) -> None:
    from anchor_rl.trainer.run import load_task

    task = load_task(cfg)
    if task.tools:
        raise ConfigError(
            f"task {cfg.task!r} uses tools; the TRL comparison covers single-turn tasks only"
        )


def _run_once(
    framework: str, cfg: TrainConfig, run_dir: Path, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One training run in a fresh process (skipped when a finished one of this config, and
    for TRL of these ``options``, exists)."""
    config = cfg.model_dump(mode="json")
    options = dict(options or {}) if framework == "trl" else {}
    path = run_dir / RESULT_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["config"] == config and stored.get("trl_options", {}) == options:
            return stored
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    process = multiprocessing.get_context("spawn").Process(
        target=_worker, args=(framework, config, str(run_dir), options)
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


def _worker(framework: str, config: dict[str, Any], run_dir: str, options: dict[str, Any]) -> None:
    """Process entry point: train one framework and write ``result.json`` (TRL's with the
    ``GRPOConfig`` ``options`` it ran with)."""
    from anchor_rl.models.loading import quiet_transformers

    cfg = build_config(config)
    with quiet_transformers():  # loading/saving bars; the training bar stays
        if framework == "anchor-rl":
            result = _train_anchor(cfg, Path(run_dir))
        else:
            result = _train_trl(cfg, Path(run_dir), options) | {"trl_options": options}
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


def _train_trl(
    cfg: TrainConfig, run_dir: Path, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    trl = require_trl()
    from transformers.trainer_callback import PrinterCallback

    from anchor_rl.integrations.trl.data import (
        stop_token_ids,
        task_dataset,
        task_reward_function,
    )
    from anchor_rl.models.loading import save_policy
    from anchor_rl.trainer.data import PromptSampler
    from anchor_rl.trainer.run import load_task

    task = load_task(cfg)
    policy, tokenizer = initial_policy(cfg, run_dir)
    eos = policy.generation_config.eos_token_id
    policy.generation_config.eos_token_id = sorted(
        {tokenizer.eos_token_id, *stop_token_ids(tokenizer, task.stop)}
    )
    p = cfg.rollout.prompts_per_step
    # The stream anchor-rl's run draws (run._assemble: the first train_prompts records).
    train = task.records("train")[: cfg.train_prompts]
    records = PromptSampler(train, cfg.seed).take(cfg.steps * p)
    reward = RewardCounter(task_reward_function(task, records))
    clock = _StepClock(trl_steps_per_step=cfg.optim.epochs * cfg.optim.mini_batches)
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=trl.GRPOConfig(**grpo_config_kwargs(cfg, str(run_dir / "trainer"), options)),
        train_dataset=task_dataset(task, tokenizer, records),
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
    steps = clock.steps(reward.tokens)
    return {
        "version": trl.__version__,
        "steps": steps,
        "wall_s": wall,
        "memory": memory.read(),
        "policy_dir": str(run_dir / "policy"),
    }


def initial_policy(cfg: TrainConfig, run_dir: Path) -> tuple[Any, Any]:
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


class RewardCounter:
    """A TRL reward function that counts what it scores: ``completions`` in all, and
    ``tokens``, the completion tokens of each call (one call per generation)."""

    def __init__(self, fn: Callable[..., list[float]]) -> None:
        self.fn, self.completions = fn, 0
        self.tokens: list[int] = []
        self.__name__ = fn.__name__

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        **kwargs: Any,
    ) -> list[float]:
        self.completions += len(completions)
        self.tokens.append(sum(len(ids) for ids in completion_ids))
        return self.fn(prompts, completions, completion_ids=completion_ids, **kwargs)


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
