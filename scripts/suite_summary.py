"""Rebuild a suite's summary (summary.json, summary.md, plots) from its finished runs, without
running anything, optionally against another baseline label.

    python scripts/suite_summary.py anchor_rl/bench/suites/pvpo_budget.toml runs/pvpo_budget
    python scripts/suite_summary.py pvpo_budget docs/results/pvpo_budget --baseline grpo+n2 \\
        --out /tmp/vs_n2

``anchor-rl bench`` writes the same summary after its runs; this script serves a suite whose
cells ran in several output directories (copied into one) or whose runs were made before a
preset changed (the bench runner refuses a finished run whose config no longer matches the
suite's). The run directories are read as they are: their stored configs, not the suite's.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from anchor_rl.bench.runner import load_suite, max_rollouts, plan, report, with_budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", help="a built-in suite name or a suite TOML path")
    parser.add_argument("runs", type=Path, help="the suite's output directory (LABEL/seedK)")
    parser.add_argument("--baseline", help="the label compared against (default: the suite's)")
    parser.add_argument("--out", type=Path, help="write the summary here (default: RUNS)")
    args = parser.parse_args()
    suite = load_suite(args.suite)
    out = args.out or args.runs
    specs = plan(suite, args.runs, None)
    if suite.budget == "max":  # as the bench run read it: the most any other finished run spent
        done = [s for s in specs if not s.to_budget and (s.run_dir / "summary.json").exists()]
        suite = dataclasses.replace(suite, budget=max_rollouts(done))
    if suite.budget is not None and isinstance(suite.budget, int):
        specs = [with_budget(s, suite.budget, suite.name) if s.label in suite.to_budget else s
                 for s in specs]  # fmt: skip
    specs = [s for s in specs if (s.run_dir / "summary.json").exists()]
    if out != args.runs:
        out.mkdir(parents=True, exist_ok=True)
        for spec in specs:  # the plots and tables read the runs where the specs point
            target = out / spec.label / f"seed{spec.seed}"
            if not target.exists():
                shutil.copytree(spec.run_dir, target)
        specs = [s.__class__(s.label, s.seed, s.config, out / s.label / f"seed{s.seed}",
                             to_budget=s.to_budget) for s in specs]  # fmt: skip
    budget = None
    if isinstance(suite.budget, int):
        budget = {
            "rollouts": suite.budget,
            "mode": suite.budget,
            "to_budget": list(suite.to_budget),
        }
    report(suite.name, specs, out, target=getattr(suite, "target_accuracy", None),
           baseline=args.baseline or getattr(suite, "baseline", None), budget=budget)  # fmt: skip
    print(f"summary: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
