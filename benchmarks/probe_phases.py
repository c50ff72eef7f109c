"""The ``trl`` suite's step, phase by phase, for anchor-rl and for TRL's ``GRPOTrainer``: how
long each trainer spends generating, on the reference's log-probs and on the update, and how
many tokens its scoring passes run, measured in fresh processes that alternate.

    OMP_NUM_THREADS=1 python benchmarks/probe_phases.py sft:tiny --steps 16 --rounds 3 --out FILE
    OMP_NUM_THREADS=1 python benchmarks/probe_phases.py random:small --steps 8 --rounds 2 \
        --out FILE optim.autocast=bf16 rollout.engine_args.precision=bf16

Each process trains one trainer with the suite's settings (``anchor-rl bench trl``: 8
prompts x 8 responses of the arithmetic task, up to 80 new tokens, the same prompts, one
torch thread when run as above) for ``--steps`` steps, timing its phases with
``time.perf_counter`` around the trainer's own functions; the first two steps are left out
(warm-up). The phases, in milliseconds:

- ``generate``: anchor-rl's ``collect`` (the rollouts and their rewards); TRL's
  ``_generate`` (the rollouts; its rewards fall in ``other``);
- ``reference``: the reference's log-probs (``score_logprobs``; TRL's
  ``_get_per_token_logps_and_entropies`` on its reference model);
- ``update``: anchor-rl's ``ppo_update`` (the policy's forward, backward and optimizer
  step); TRL's ``training_step`` less ``_generate_and_score_completions`` (forward and
  backward: transformers' loop steps the optimizer outside ``training_step``, ~1% of a
  ``tiny`` step, not counted);
- ``step``: anchor-rl's ``train_step``, TRL's ``training_step``; ``other`` what the step
  holds besides the three.

``tokens_scored`` is the number of token positions a scoring pass runs: anchor-rl's
padding-free layout (every prompt once per group, the responses' real tokens), TRL's padded
``[rows, prompt + longest completion]``.

A probe, not the benchmark: ``anchor-rl bench trl`` gives the steps/s comparison; this says
where each trainer's step goes. Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARM_STEPS = 2
"""Steps left out of every phase's mean (oneDNN's primitives, the allocator's heap)."""

TRAINERS = ("anchor-rl", "trl")

PHASES = ("generate", "reference", "update")


def _timed(
    owner: Any, name: str, times: dict[str, list[float]], label: Callable[..., str] | None = None
) -> None:
    """Replace ``owner.name`` with a wrapper that appends its wall time to
    ``times[label(*args) or name]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = original(*args, **kwargs)
        key = label(*args, **kwargs) if label is not None else name
        times.setdefault(key, []).append(time.perf_counter() - started)
        return result

    setattr(owner, name, timed)


def _anchor_phases(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """anchor-rl's phases over the steps of the suite's run ``cfg``."""
    from anchor_rl.trainer import loop
    from anchor_rl.trainer.run import start_run

    times: dict[str, list[float]] = {}
    tokens: list[int] = []
    for name in ("collect", "score_logprobs", "ppo_update"):
        _timed(loop, name, times)
    original = loop.score_logprobs

    def counted(*args: Any, **kwargs: Any) -> Any:  # the batch's scored positions
        batch = next(a for a in args if hasattr(a, "attention_mask"))  # the RolloutBatch
        prompts = {tuple(p) for p in batch.prompt_ids}
        tokens.append(sum(map(len, prompts)) + int(batch.attention_mask.sum()))
        return original(*args, **kwargs)

    loop.score_logprobs = counted
    run = start_run(cfg, run_dir)
    for _ in range(cfg.steps):
        started = time.perf_counter()
        loop.train_step(run)
        times.setdefault("step", []).append(time.perf_counter() - started)
        run.state.step += 1
    return {"times": times, "tokens_scored": tokens}


def _trl_phases(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """TRL ``GRPOTrainer``'s phases over the steps of the suite's TRL run ``cfg``."""
    import trl.trainer.grpo_trainer as grpo

    from anchor_rl.bench.trl_compare import _train_trl

    times: dict[str, list[float]] = {}
    tokens: list[int] = []

    def logps_label(trainer: Any, model: Any, input_ids: Any = None, *args: Any, **kw: Any) -> str:
        if model is trainer.ref_model:
            tokens.append(int((input_ids if input_ids is not None else kw["input_ids"]).numel()))
            return "reference"
        return "policy log-probs"

    trainer = grpo.GRPOTrainer
    _timed(trainer, "_generate", times)
    _timed(trainer, "_get_per_token_logps_and_entropies", times, logps_label)
    _timed(trainer, "_generate_and_score_completions", times)
    _timed(trainer, "training_step", times, lambda *a, **k: "step")
    _train_trl(cfg, run_dir)
    return {"times": times, "tokens_scored": tokens}


def phase_means(times: dict[str, list[float]], warm: int = WARM_STEPS) -> dict[str, float]:
    """Mean milliseconds of each phase past the first ``warm`` calls (all calls where there
    are no more than ``warm``)."""
    return {
        name: round(1000 * statistics.mean(values[warm:] if len(values) > warm else values), 2)
        for name, values in times.items()
    }


def summary(trainer: str, measured: dict[str, Any]) -> dict[str, Any]:
    """One process's phases in the common names: ``generate``, ``reference``, ``update``,
    ``step`` (ms, means past the warm-up) and the scored tokens per step."""
    ms = phase_means(measured["times"])
    if trainer == "anchor-rl":
        phases = {
            "generate": ms["collect"],
            "reference": ms["score_logprobs"],
            "update": ms["ppo_update"],
            "step": ms["step"],
        }
    else:
        phases = {
            "generate": ms["_generate"],
            "reference": ms["reference"],
            "update": round(ms["step"] - ms["_generate_and_score_completions"], 2),
            "step": ms["step"],
        }
    phases["other"] = round(phases["step"] - sum(phases[p] for p in PHASES), 2)
    tokens = measured["tokens_scored"][WARM_STEPS:] or measured["tokens_scored"]
    return phases | {"tokens_scored": round(statistics.mean(tokens)) if tokens else None}


def worker(trainer: str, model: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Train ``trainer`` here and return its :func:`summary`."""
    from anchor_rl.bench.runner import plan
    from anchor_rl.bench.trl_compare import TRL_SUITE

    with tempfile.TemporaryDirectory(prefix="probe-phases-") as tmp:
        settings = [f"model={model}", "log.progress=false", *overrides]
        cfg = plan(TRL_SUITE, Path(tmp), [0], steps, settings)[0].config
        run = _anchor_phases if trainer == "anchor-rl" else _trl_phases
        return summary(trainer, run(cfg, Path(tmp) / trainer))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="processes per trainer")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps must be above the {WARM_STEPS} warm-up steps")
    if args.worker:  # one trainer in this process: its summary on stdout's last line
        print(json.dumps(worker(args.worker, args.model, args.overrides, args.steps)))
        return {}
    import torch

    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TRAINERS}
    for r in range(args.rounds):
        for trainer in TRAINERS if r % 2 == 0 else TRAINERS[::-1]:
            print(f"round {r + 1}/{args.rounds}: {trainer}", file=sys.stderr, flush=True)
            command = [sys.executable, __file__, args.model, *args.overrides]
            command += ["--steps", str(args.steps), "--worker", trainer]
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"the {trainer} process failed:\n{out.stderr[-4000:]}")
            runs[trainer].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {
        trainer: {
            key: statistics.median(run[key] for run in rows)
            for key in rows[0]
            if rows[0][key] is not None
        }
        for trainer, rows in runs.items()
    }
    result = {
        "model": args.model,
        "overrides": args.overrides,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "warm_steps": WARM_STEPS,
        "runs": runs,
        "median": medians,
        "trl_over_anchor_rl": {
            key: round(medians["trl"][key] / medians["anchor-rl"][key], 3)
            for key in medians["anchor-rl"]
            if key in medians["trl"] and medians["anchor-rl"][key]
        },
    }
    from _common import emit

    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
