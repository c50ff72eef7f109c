"""The testbed's controls (docs/testbed.md, "Controls"): more SFT instead of RL, and the
reference trained to its validation plateau.

    OMP_NUM_THREADS=1 python benchmarks/sft_control.py control --out docs/results/controls
    OMP_NUM_THREADS=1 python benchmarks/sft_control.py plateau --out docs/results/controls \
        --model-dir runs/controls/plateau

``control``: from the default arithmetic reference (``sft:tiny``, trained or read from the
cache), times GRPO N = 8 steps of the pvpo suite's setting and SFT continuation steps in
alternation on this machine, then continues the SFT for each seed to the step count of equal
updated tokens and of equal wall time as a 100-step GRPO N = 8 run, and measures held-out
greedy accuracy on the 1,000 test prompts by the suites' code path at both. Compared with
the committed pvpo suite's GRPO N = 8 runs (docs/results/pvpo/grpo+n8). Writes
``OUT/sft_control.json``.

``plateau``: continues the reference's SFT until validation avg@8 stops improving
(``anchor_rl.bench.controls.PlateauStop``), saves the kept weights to ``--model-dir`` and
writes ``OUT/plateau.json`` with its held-out accuracy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from anchor_rl.bench.controls import (
    Continuation,
    PlateauStop,
    continue_sft,
    gain,
    sft_data,
    time_alternately,
    time_matched_steps,
    token_matched_steps,
    train_to_plateau,
)
from anchor_rl.bench.runner import load_suite, plan, run_spec
from anchor_rl.models.loading import load_policy
from anchor_rl.models.sft import default_config, train_sft
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.evaluate import class_shares
from anchor_rl.trainer.run import evaluate_details, load_task

SUITE, LABEL = "pvpo", "grpo+n8"
COMMITTED = Path(__file__).resolve().parents[1] / "docs/results/pvpo/grpo+n8"


def suite_config(seed: int, overrides: tuple[str, ...] = ()) -> Any:
    """The pvpo suite's GRPO N = 8 config for ``seed`` (what its evaluations use)."""
    with tempfile.TemporaryDirectory() as tmp:
        specs = plan(load_suite(SUITE), Path(tmp), seeds=[seed], overrides=overrides)
    return next(s for s in specs if s.label == LABEL)


def held_out(cfg: Any, task: Any) -> Any:
    """``measure(model, tokenizer, step)``: the suites' evaluation (eval/accuracy: greedy on
    the 1,000 test prompts; eval/train_accuracy on the first 200 training prompts), with the
    per-prompt correct counts as a string in test-record order (as evals.jsonl holds)."""

    def measure(model: torch.nn.Module, tokenizer: Any, step: int) -> dict[str, Any]:
        name, options = cfg.engine
        engine = make_engine(name, model, tokenizer, **options)
        t0 = time.perf_counter()
        metrics, details = evaluate_details(engine, task, cfg, step)
        counts = details["test"]["correct"]
        ids = [r.id for r in task.records("test")[: cfg.eval.prompts]]
        return {
            "held_out": metrics["eval/accuracy"],
            "train_prompts": metrics["eval/train_accuracy"],
            "eval_seconds": time.perf_counter() - t0,
            "counts": "".join(str(counts[i]) for i in ids),
        }

    return measure


def committed_grpo() -> dict[str, Any]:
    """The committed suite runs' held-out accuracy at steps 0 and 100 and their counters."""
    runs = {}
    for seed_dir in sorted(COMMITTED.glob("seed*")):
        evals = [
            json.loads(x)
            for x in gzip.decompress((seed_dir / "evals.jsonl.gz").read_bytes()).splitlines()
        ]
        acc = {e["step"]: e["test"]["counts"].count("1") / len(e["test"]["counts"]) for e in evals}
        rows = [
            json.loads(x)
            for x in gzip.decompress((seed_dir / "metrics.jsonl.gz").read_bytes()).splitlines()
        ]
        steps = [r for r in rows if "time/update" in r]
        seconds = sum(r["time/generate"] + r["time/score"] + r["time/update"] for r in steps)
        runs[seed_dir.name] = {
            "start": acc[0], "final": acc[max(acc)], "gain": acc[max(acc)] - acc[0],
            "tokens": rows[-1]["tokens/cumulative"], "rollouts": rows[-1]["rollouts/total"],
            "train_seconds": seconds, "steps": len(steps),
        }  # fmt: skip
    return runs


def reference() -> tuple[Path, Any, int]:
    """The default arithmetic reference: its directory, SFT config and kept step."""
    path = train_sft("arithmetic", "tiny", validate=class_shares)
    cfg = default_config("arithmetic", "tiny")
    kept = json.loads((path / "class_stop.json").read_text())["kept_step"]
    return path, cfg, kept


def time_grpo(steps: int, seed: int = 0, model: str = "sft:tiny") -> tuple[float, int]:
    """Train ``steps`` GRPO N = 8 steps of the pvpo suite's setting, no evaluation; the
    seconds its steps spent generating, scoring and updating, and ``steps``."""
    overrides = (f"steps={steps}", "eval.every=0", "checkpoint.every=0", f"model={model}",
                 "log.progress=false", "log.tensorboard=false")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spec = suite_config(seed, overrides)
        spec = type(spec)(spec.label, spec.seed, spec.config, Path(tmp) / "run")
        run_spec(spec)
        rows = [json.loads(x) for x in (spec.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r]
    return sum(r["time/generate"] + r["time/score"] + r["time/update"] for r in rows), len(rows)


def control(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: SFT continued for a GRPO N = 8 run's compute (see the module docstring)."""
    path, cfg, kept = reference()
    committed = committed_grpo()
    _, tokenizer = load_policy(path)
    data = sft_data(cfg, tokenizer)
    per_step = data.loss_tokens_per_example * cfg.batch_size
    rl_tokens = sum(r["tokens"] for r in committed.values()) / len(committed)
    by_tokens = token_matched_steps(rl_tokens, per_step)

    timer_model, _ = load_policy(path)
    timer = Continuation(timer_model, cfg, kept, data, seed=10_000, horizon=10**6)

    def sft_timed() -> tuple[float, int]:
        before = timer.seconds
        timer.step(args.sft_timing_steps)
        return timer.seconds - before, args.sft_timing_steps

    print(f"timing: {args.rounds} rounds of {args.rl_timing_steps} GRPO steps, "
          f"{args.sft_timing_steps} SFT steps", flush=True)  # fmt: skip
    timing = time_alternately(lambda: time_grpo(args.rl_timing_steps), sft_timed, args.rounds)
    by_time = time_matched_steps(timing["rl_median"], 100, timing["sft_median"])
    print(f"matched: {by_tokens} SFT steps by updated tokens, {by_time} by wall time "
          f"({timing['rl_median']:.3f} s per GRPO step, {timing['sft_median']:.3f} per SFT step)",
          flush=True)  # fmt: skip

    seeds = {}
    start_eval = None
    for seed in args.seeds:
        spec = suite_config(seed)
        task = load_task(spec.config)
        measure = held_out(spec.config, task)
        if start_eval is None:
            model, tok = load_policy(path)
            model.eval()
            start_eval = measure(model, tok, 0)
            print(f"reference: held out {start_eval['held_out']:.3f}", flush=True)
        points = continue_sft(path, cfg, kept, seed, [by_tokens, by_time], measure, data)
        for p in points:
            print(f"seed {seed}: +{p['steps']} SFT steps, held out {p['held_out']:.3f}", flush=True)
        seeds[str(seed)] = points

    def at(steps: int) -> dict[str, Any]:
        accs = [next(p for p in pts if p["steps"] == steps)["held_out"] for pts in seeds.values()]
        return {"steps": steps, **gain(accs, start_eval["held_out"])}

    grpo = gain([r["final"] for r in committed.values()], start=0.0)
    starts = {r["start"] for r in committed.values()}
    return {
        "reference": {
            "dir_key": path.name,
            "kept_step": kept,
            "sft_config": cfg.key(),
            "held_out": start_eval["held_out"],
            "train_prompts": start_eval["train_prompts"],
            "counts": start_eval["counts"],
        },  # fmt: skip
        "matching": {
            "grpo_updated_tokens": rl_tokens,
            "sft_loss_tokens_per_step": per_step,
            "by_tokens": by_tokens,
            "by_time": by_time,
            "timing": timing,
            "grpo_committed_train_seconds": {k: r["train_seconds"] for k, r in committed.items()},
        },
        "sft": {"by_tokens": at(by_tokens), "by_time": at(by_time), "seeds": seeds},
        "grpo_n8_committed": {
            "runs": committed,
            "start": sorted(starts),
            "mean": grpo["mean"],
            "gain": grpo["mean"] - sum(r["start"] for r in committed.values()) / len(committed),
        },
        "threads": torch.get_num_threads(),
    }


def plateau(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: the reference continued to its validation plateau, saved to ``--model-dir``."""
    path, cfg, kept = reference()
    rule = PlateauStop(every=args.every, patience=args.patience, min_delta=args.min_delta,
                       max_steps=cfg.steps - kept)  # fmt: skip
    out = Path(args.model_dir)
    if out.exists():
        shutil.rmtree(out)
    summary = train_to_plateau(path, cfg, kept, rule, class_shares, out, seed=0)
    spec = suite_config(0)
    task = load_task(spec.config)
    model, tok = load_policy(out)
    model.eval()
    summary["held_out"] = held_out(spec.config, task)(model, tok, 0)
    print(f"plateau: kept +{summary['kept']['steps']} steps, held out "
          f"{summary['held_out']['held_out']:.3f}", flush=True)  # fmt: skip
    return summary


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: the SFT control (``OUT/sft_control.json``) against GRPO N = 8 runs from the same
    reference (``--grpo-runs``: a suite's ``grpo+n8`` directory of ``seed*`` runs), with
    two-level bootstrap intervals (runs, then the 1,000 held-out prompts)."""
    from anchor_rl.bench.stats import two_level_bootstrap
    from anchor_rl.trainer.logging import read_evals

    control = json.loads((args.out / "sft_control.json").read_text())
    ref = [int(c) for c in control["reference"]["counts"]]
    runs = []
    for run_dir in sorted(Path(args.grpo_runs).glob("seed*")):
        evals = {e["step"]: e["test"]["correct"] for e in read_evals(run_dir)}
        first, last = (list(evals[s].values()) for s in (min(evals), max(evals)))
        if first != ref:
            raise SystemExit(f"{run_dir} starts from another reference than the control's")
        runs.append(last)

    def interval(a: list[list[int]], b: list[list[int]]) -> list[float]:
        boot = two_level_bootstrap(a, b)
        return [round(boot.mean, 4), round(boot.low, 4), round(boot.high, 4)]

    out: dict[str, Any] = {
        "grpo_runs": str(args.grpo_runs),
        "reference_held_out": control["reference"]["held_out"],
        "grpo_held_out": [sum(r) / len(r) for r in runs],
        "grpo_gain": interval(runs, [ref]),
    }
    for name in ("by_tokens", "by_time"):
        steps = control["sft"][name]["steps"]
        sft = [
            [int(c) for c in next(p for p in pts if p["steps"] == steps)["counts"]]
            for pts in control["sft"]["seeds"].values()
        ]
        out[name] = {"steps": steps, "sft_gain": interval(sft, [ref]),
                     "grpo_minus_sft": interval(runs, sft)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["control", "plateau", "compare"])
    parser.add_argument("--out", type=Path, default=Path("docs/results/controls"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rl-timing-steps", type=int, default=10)
    parser.add_argument("--sft-timing-steps", type=int, default=40)
    parser.add_argument("--model-dir", default="runs/controls/plateau")
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--min-delta", type=float, default=0.01)
    parser.add_argument("--grpo-runs", default="docs/results/controls/grpo_local/grpo+n8")
    args = parser.parse_args()
    t0 = time.time()
    result = {"control": control, "plateau": plateau, "compare": compare}[args.part](args)
    result["wall_seconds"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    names = {"control": "sft_control.json", "plateau": "plateau.json", "compare": "compare.json"}
    target = args.out / names[args.part]
    target.write_text(json.dumps(result, indent=1))
    print(target)


if __name__ == "__main__":
    main()
