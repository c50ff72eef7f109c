"""A sweep's PVPO runs against GRPO at a small N over the same configurations, at equal cost.

Usage: ``python scripts/sweep_vs_small_n.py SWEEP_DIR SMALL_N_DIR [--out FILE.json]``

``SWEEP_DIR`` is a finished ``anchor-rl bench sweep`` (PVPO runs sharing one anchor store);
``SMALL_N_DIR`` the same configurations run with GRPO at a small N for longer, e.g.
``anchor-rl bench sweep --runs grpo+... rollout.n=2 steps=200``. For each k = 1..K (the
sweep's PVPO runs in run order) a PVPO run's cost per run is the sweep's cumulative cost of
its first k runs over k; GRPO's run is read at its last evaluation whose total rollouts are
at or below that cost. The difference (PVPO minus GRPO, held-out accuracy at the runs' last
evaluations) is a two-level bootstrap over the runs (a configuration at a seed) and the
held-out prompts, paired by configuration and seed; a seed present in only one directory is
left out. Also: the difference at equal steps (GRPO read at PVPO's
step count) and, per configuration, the rollouts GRPO needed to first reach PVPO's accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from anchor_rl.bench.budget import curve_points
from anchor_rl.bench.stats import two_level_bootstrap
from anchor_rl.trainer.logging import read_evals, read_metrics


def curve(run_dir: Path) -> list[tuple[int, int, list[float]]]:
    """(step, total rollouts, per-prompt held-out accuracy in prompt order) per evaluation."""
    points = curve_points(read_metrics(run_dir), read_evals(run_dir))
    return [
        (p.step, int(p.rollouts), [p.per_prompt[k] for k in sorted(p.per_prompt)]) for p in points
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("small_n", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    summary = json.loads((args.sweep / "summary.json").read_text())
    methods = summary["sweep"]["methods"]
    pvpo_preset = next(p for p, m in methods.items() if m["reads_anchors"])
    per_run = methods[pvpo_preset]["per_run"]["rollouts"]
    labels = list(
        dict.fromkeys(run["label"].split("+", 1)[1] for run in methods[pvpo_preset]["runs"])
    )

    def seeds(root: Path, label: str) -> set[str]:
        return {d.name for d in root.glob(f"{label}/seed*") if (d / "summary.json").exists()}

    # a run is a configuration at a seed: "lr1e-5_kl1e-3/seed0"
    configs = [
        f"{c}/{s}"
        for c in labels
        for s in sorted(seeds(args.sweep, f"{pvpo_preset}+{c}") & seeds(args.small_n, f"grpo+{c}"))
    ]
    pvpo = {c: curve(args.sweep / f"{pvpo_preset}+{c}") for c in configs}
    grpo = {c: curve(args.small_n / f"grpo+{c}") for c in configs}

    def at_most(points, budget):
        kept = [p for p in points if p[1] <= budget]
        return kept[-1] if kept else points[0]

    def compare(readings):
        ours = [pvpo[c][-1][2] for c in configs]
        theirs = [at_most(grpo[c], readings[c])[2] for c in configs]
        b = two_level_bootstrap(ours, minus=theirs, paired_runs=True)
        return {"diff": round(b.mean, 4), "low": round(b.low, 4), "high": round(b.high, 4)}

    steps = {c: pvpo[c][-1][0] for c in configs}
    equal_steps = {c: next(p[1] for p in grpo[c] if p[0] >= steps[c]) for c in configs}
    result = {
        "configurations": configs,
        "pvpo_accuracy": {c: round(sum(pvpo[c][-1][2]) / len(pvpo[c][-1][2]), 4) for c in configs},
        "equal_steps": compare(equal_steps),
        "equal_cost_per_run": [
            {"k": k + 1, "pvpo_per_run": round(cost), **compare(dict.fromkeys(configs, cost))}
            for k, cost in enumerate(per_run)
        ],
        "grpo_rollouts_to_match": {
            c: next((p[1] for p in grpo[c] if sum(p[2]) >= sum(pvpo[c][-1][2])), None)
            for c in configs
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
