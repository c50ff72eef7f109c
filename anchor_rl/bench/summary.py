"""Per-run figures from metrics.jsonl, aggregated over seeds into mean and 95% t-interval.

Written as ``summary.json`` (every run's figures and every group's intervals) and
``summary.md`` (one table row per preset/variant).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.bench.stats import Interval, t_interval

FIGURES: dict[str, str] = {
    "eval_start": "held-out accuracy before training (step 0)",
    "eval_final": "held-out accuracy at the last evaluation",
    "eval_best": "best held-out accuracy over the evaluations",
    "train_start": "training-prompt accuracy before training (runs with eval.train_prompts)",
    "train_final": "training-prompt accuracy at the last evaluation",
    "reward_last": "mean training reward over the last fifth of the steps",
    "rollouts": "responses generated (filtered ones included), PVPO's presampling and refresh included",
    "tokens": "policy tokens generated",
    "wall_s": "wall-clock seconds, evaluation included",
    "generate_s": "mean seconds per step generating",
    "score_s": "mean seconds per step scoring",
    "update_s": "mean seconds per step in log-probs, advantage and update",
    "target_reached": "share of seeds whose accuracy (the suite's target_metric) reached its target_accuracy",
    "target_wall_s": "wall-clock seconds to the first evaluation at or above the target (seeds that reached it)",
    "target_rollouts": "rollouts (as `rollouts`) to that evaluation",
}
TRAIN = ("train_start", "train_final")
"""Figures of runs that evaluate training prompts; shown in the table only then."""
TARGET = ("target_reached", "target_wall_s", "target_rollouts")
"""Figures of a suite with ``target_accuracy``; shown in the table only then."""
TABLE = (
    "eval_start",
    "eval_final",
    "reward_last",
    "rollouts",
    "wall_s",
    "generate_s",
    "score_s",
    "update_s",
)


def time_to_accuracy(
    records: Sequence[Mapping[str, float]], target: float, metric: str = "eval/accuracy"
) -> dict[str, float]:
    """Wall time and rollouts at the first evaluation with ``metric`` >= ``target``.

    ``{"target_reached": 1.0, "target_wall_s": ..., "target_rollouts": ...}``, or only
    ``{"target_reached": 0.0}`` when no evaluation reached it.
    """
    for r in records:
        if r.get(metric, -1.0) >= target:
            rollouts = r.get("rollouts/total", r["rollouts/cumulative"])
            return {
                "target_reached": 1.0,
                "target_wall_s": r["time/elapsed"],
                "target_rollouts": rollouts,
            }
    return {"target_reached": 0.0}


def run_figures(
    records: Sequence[Mapping[str, float]],
    target: float | None = None,
    metric: str = "eval/accuracy",
) -> dict[str, float]:
    """The figures of one run (keys of ``FIGURES``; eval ones only if the run evaluated, the
    ``target_*`` ones only for a ``target`` value of ``metric``)."""
    steps = [r for r in records if r["step"] > 0]
    if not steps:
        raise ValueError("the run has no training step in its metrics")
    evals = [r for r in records if "eval/accuracy" in r]
    tail = steps[-max(1, len(steps) // 5) :]
    last = steps[-1]
    out = {
        "reward_last": _mean(r["reward/mean"] for r in tail),
        "rollouts": last.get("rollouts/total", last["rollouts/cumulative"]),
        "tokens": last["tokens/cumulative"],
        "wall_s": last["time/elapsed"],
        "generate_s": _mean(r["time/generate"] for r in steps),
        "score_s": _mean(r["time/score"] for r in steps),
        "update_s": _mean(r["time/update"] for r in steps),
    }
    if evals:
        if evals[0]["step"] == 0:
            out["eval_start"] = evals[0]["eval/accuracy"]
        out["eval_final"] = evals[-1]["eval/accuracy"]
        out["eval_best"] = max(r["eval/accuracy"] for r in evals)
    train = [r for r in records if "eval/train_accuracy" in r]
    if train:
        if train[0]["step"] == 0:
            out["train_start"] = train[0]["eval/train_accuracy"]
        out["train_final"] = train[-1]["eval/train_accuracy"]
    if target is not None:
        out |= time_to_accuracy(records, target, metric)
    return out


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Group runs (dicts with ``label``, ``seed``, ``figures``) by label; intervals per figure."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["label"], []).append(run)
    out = []
    for label, members in groups.items():
        figures = {}
        for key in FIGURES:
            values = [m["figures"][key] for m in members if key in m["figures"]]
            if values:
                figures[key] = _interval_dict(t_interval(values), values)
        out.append({"label": label, "seeds": [m["seed"] for m in members], "figures": figures})
    return out


def write_summary(
    out: Path, suite: str, runs: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> tuple[Path, Path]:
    """summary.json and summary.md in ``out``."""
    out = Path(out)
    json_path, md_path = out / "summary.json", out / "summary.md"
    payload = {"suite": suite, "figures": FIGURES, "groups": list(groups), "runs": list(runs)}
    json_path.write_text(json.dumps(payload, indent=2))
    md_path.write_text(markdown_table(suite, groups))
    return json_path, md_path


def markdown_table(suite: str, groups: Sequence[Mapping[str, Any]]) -> str:
    """One row per group: mean ± 95% t-interval half-width over seeds."""
    lines = [
        f"# Suite `{suite}`",
        "",
        "Mean ± half-width of the 95% Student-t interval over seeds (no interval with one seed).",
        "",
    ]
    optional = (*TRAIN, *TARGET)
    columns = (*TABLE, *(k for k in optional if any(k in g["figures"] for g in groups)))
    lines += [
        "| run | seeds | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for g in groups:
        cells = []
        for key in columns:
            f = g["figures"].get(key)
            digits = (
                0
                if key in {"rollouts", "tokens", "target_rollouts"}
                else 3
                if key.startswith(("eval", "reward", "train"))
                else 2
            )
            cells.append(
                "–" if f is None else Interval(f["mean"], f["half_width"], f["n"]).fmt(digits)
            )
        lines.append(f"| {g['label']} | {len(g['seeds'])} | " + " | ".join(cells) + " |")
    lines += ["", *(f"- `{k}`: {v}" for k, v in FIGURES.items() if k in columns), ""]
    return "\n".join(lines)


def _interval_dict(interval: Interval, values: Sequence[float]) -> dict[str, Any]:
    return {
        "mean": interval.mean,
        "half_width": interval.half_width,
        "low": interval.low,
        "high": interval.high,
        "n": interval.n,
        "values": list(values),
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
