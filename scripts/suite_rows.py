"""Print the per-run figures docs/results.md's hand-written tables quote, for one suite.

Usage: ``python scripts/suite_rows.py docs/results/SUITE [FIGURE ...]``
       ``python scripts/suite_rows.py docs/results/SUITE --baseline LABEL``

Reads the suite's ``summary.json`` (written by ``anchor-rl bench``, kept by
``scripts/compact_results.py``) and prints, per run: the held-out accuracy after training
(mean ± 95% t half-width over seeds, then each seed), the gain over the reference on the
paired bootstrap over held-out prompts and on the seed-level t interval, the difference to
the suite's baseline (paired bootstrap), and the other figures named (default: accuracy on
the reference's wrong / right prompts, training-prompt accuracy after, the three rollout
costs, wall seconds). Figures a run lacks print as ``–``. Nothing is recomputed here that
``summary.json`` does not hold, so the printed rows are the tables' source.

With ``--baseline LABEL`` it prints instead every run's final held-out accuracy minus
LABEL's, paired over held-out prompts (the per-prompt results of the run directories, as
``anchor-rl bench`` computes its own baseline column), for comparisons against a run other
than the suite's baseline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from anchor_rl.bench.summary import format_bootstrap, paired, prompt_pairs

DEFAULT_FIGURES = (
    "eval_fixed",
    "eval_kept",
    "train_final",
    "v05_weight_nonzero",
    "policy_rollouts",
    "rollouts",
    "amortised_rollouts",
    "wall_s",
)

DIGITS = {"policy_rollouts": 0, "rollouts": 0, "amortised_rollouts": 0, "wall_s": 1}
"""Decimals of the figures that are not accuracies (default 3)."""


def _interval(figure: dict[str, Any] | None, digits: int = 3) -> str:
    if figure is None:
        return "–"
    if figure["n"] < 2:
        return f"{figure['mean']:.{digits}f}"
    return f"{figure['mean']:.{digits}f} ± {figure['half_width']:.{digits}f}"


def _seed_t(figure: dict[str, Any] | None) -> str:
    """The seed-level t interval; "–" without one (one seed has no interval)."""
    if figure is None or figure["n"] < 2:
        return "–"
    return f"[{figure['low']:+.3f}, {figure['high']:+.3f}]"


def rows(suite_dir: Path, figures: tuple[str, ...] = DEFAULT_FIGURES) -> list[str]:
    """One line per run of the suite in ``suite_dir``, ``|``-separated."""
    summary = json.loads((suite_dir / "summary.json").read_text())
    comparisons = summary.get("paired", {})
    baseline = comparisons.get("baseline")
    lines = [
        "| run | held-out after (t over seeds; per seed) | gain [paired bootstrap] / [seed t] "
        f"| vs `{baseline}` [paired bootstrap] | " + " | ".join(figures) + " |"
    ]
    for group in summary["groups"]:
        label, f = group["label"], group["figures"]
        final = f.get("eval_final")
        seeds = " / ".join(f"{v:.3f}" for v in final["values"]) if final else "–"
        boot = format_bootstrap(comparisons.get("gain", {}).get(label))
        gain = f"{boot} / {_seed_t(f.get('eval_gain'))}"
        vs = format_bootstrap(comparisons.get("vs_baseline", {}).get(label))
        rest = [_interval(f.get(name), DIGITS.get(name, 3)) for name in figures]
        start = _interval(f.get("eval_start"))
        lines.append(
            f"| {label} | {_interval(final)} ({seeds}) | {gain} | {vs} | "
            + " | ".join(rest)
            + f" |  (held-out before {start})"
        )
    return lines


def against(suite_dir: Path, baseline: str) -> list[str]:
    """``run: difference [paired bootstrap]`` to ``baseline`` for every other run."""
    summary = json.loads((suite_dir / "summary.json").read_text())
    runs = (
        (run["label"], suite_dir / run["label"] / f"seed{run['seed']}") for run in summary["runs"]
    )
    per_prompt = prompt_pairs(runs)
    if baseline not in per_prompt:
        raise SystemExit(f"no run {baseline!r} with per-prompt results in {suite_dir}")
    comparisons = paired(per_prompt, baseline)
    return [
        f"{label} vs {baseline}: {format_bootstrap(b)}"
        for label, b in comparisons["vs_baseline"].items()
    ]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    if len(argv) == 3 and argv[1] == "--baseline":
        print("\n".join(against(Path(argv[0]), argv[2])))
        return 0
    figures = tuple(argv[1:]) or DEFAULT_FIGURES
    print("\n".join(rows(Path(argv[0]), figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
