"""Methods compared at an equal budget: held-out accuracy read at fractions of a suite's
common budget and the area under the held-out curve, with two-level bootstrap intervals.

A run's curve is its held-out evaluations as points ``(x, accuracy)``, x its cost so far:
``rollouts/total`` (every rollout the run spent, presampling included), ``time/elapsed``
(wall seconds) or ``cost/modelled_s`` (:mod:`anchor_rl.bench.costs`). At a fraction f of
the budget B a run is read at its first evaluation with x >= f·B (a run stopped by
``budget.rollouts`` evaluates at the first step past each fraction, so that is within one
step of f·B); a run whose curve ends below ``(1 - TOLERANCE)·f·B`` has not reached it and
is left out (the cell shows how many runs reached it). The area is the mean accuracy over
[0, B]: the curve linear between evaluations, held at its first value before its first
point (the reference's, step 0, taken after any presampling: a run cannot do better before
it has paid for its set-up) and cut at B; a run that ends below ``(1 - TOLERANCE)·B`` has no
area. Both are linear in the per-prompt accuracies of the evaluations, so each run gives
per-prompt values and the intervals resample runs, then prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from anchor_rl.bench.summary import bootstrap_dict

TOLERANCE = 0.02
"""How far below a budget point a run's last evaluation may end and still be read there."""
FRACTIONS = (0.25, 0.5, 1.0)
"""The shares of the common budget the tables read."""


@dataclass(frozen=True)
class Point:
    """One held-out evaluation of a run: its step, cost ``x`` and per-prompt accuracy."""

    step: int
    x: float
    seconds: float
    rollouts: float
    accuracy: float
    per_prompt: dict[str, float]


def curve_points(
    records: Sequence[Mapping[str, Any]],
    evals: Sequence[Mapping[str, Any]],
    x: str = "rollouts/total",
    split: str = "test",
) -> list[Point]:
    """A run's held-out evaluations with their cost ``x`` and per-prompt accuracies (from
    ``metrics.jsonl`` and ``evals.jsonl``); evaluations without per-prompt results are left
    out. The last record of a step counts (a resumed run rewrites its later lines)."""
    details = {e["step"]: e[split] for e in evals if split in e}
    rows = {int(r["step"]): r for r in records if "eval/accuracy" in r and x in r}
    points = []
    for step in sorted(rows):
        r = rows[step]
        if step not in details:
            continue
        k = details[step]["k"]
        per_prompt = {p: c / k for p, c in details[step]["correct"].items()}
        rollouts = r.get("rollouts/total", r.get("rollouts/cumulative", 0.0))
        points.append(
            Point(
                step,
                float(r[x]),
                float(r.get("time/elapsed", 0.0)),
                float(rollouts),
                float(r["eval/accuracy"]),
                per_prompt,
            )  # fmt: skip
        )
    return points


def read_at(points: Sequence[Point], x: float) -> Point | None:
    """The first evaluation at or past ``x`` (within ``TOLERANCE`` below it); None when the
    run ends before."""
    for p in points:
        if p.x >= x * (1 - TOLERANCE):
            return p
    return None


def area_weights(xs: Sequence[float], budget: float) -> list[float] | None:
    """Weights w with ``sum(w_i * y_i)`` = the mean over [0, budget] of the curve through
    ``(xs[i], y_i)`` (linear between points, held at y_0 before xs[0], cut at the budget, held
    at the last value up to it when the last point is within ``TOLERANCE`` below); None when
    the curve ends further below the budget. ``xs`` increasing."""
    if not xs or budget <= 0 or xs[-1] < budget * (1 - TOLERANCE):
        return None
    n = len(xs)
    # knots on [0, budget], each value a weight vector over the points
    knots: list[tuple[float, list[float]]] = [(0.0, _unit(0, n))]
    for i, x in enumerate(xs):
        if x >= budget:
            if i == 0:
                knots.append((budget, _unit(0, n)))
            else:
                t = (budget - xs[i - 1]) / (x - xs[i - 1])
                mix = [0.0] * n
                mix[i - 1], mix[i] = 1 - t, t
                knots.append((budget, mix))
            break
        knots.append((x, _unit(i, n)))
    else:
        knots.append((budget, _unit(n - 1, n)))
    weights = [0.0] * n
    for (x0, v0), (x1, v1) in zip(knots, knots[1:], strict=False):
        for j in range(n):
            weights[j] += (x1 - x0) * (v0[j] + v1[j]) / 2 / budget
    return weights


def _unit(i: int, n: int) -> list[float]:
    out = [0.0] * n
    out[i] = 1.0
    return out


def run_readings(
    points: Sequence[Point], budget: float, fractions: Sequence[float] = FRACTIONS
) -> dict[str, Any]:
    """One run's readings: ``at``, fraction -> its :func:`read_at` point (or None), and
    ``area``, per-prompt areas under the curve (None without one)."""
    at = {f: read_at(points, f * budget) for f in fractions}
    weights = area_weights([p.x for p in points], budget)
    area = None
    if weights is not None:
        ids = sorted(set.intersection(*(set(p.per_prompt) for p in points)))
        area = {
            pid: sum(w * p.per_prompt[pid] for w, p in zip(weights, points, strict=True))
            for pid in ids
        }
    return {"at": at, "area": area}


def compare_at_budget(
    curves: Mapping[str, Sequence[tuple[int, Sequence[Point]]]],
    budget: float,
    baseline: str | None = None,
    fractions: Sequence[float] = FRACTIONS,
) -> dict[str, Any]:
    """Every label's held-out accuracy at each fraction of ``budget`` and its area under the
    curve, with two-level intervals (:func:`~anchor_rl.bench.summary.bootstrap_dict`), and
    each label minus ``baseline`` (runs paired where both have the same seeds).

    ``curves``: label -> ``(seed, points)`` per run. A cell needs every run of the label to
    reach it; ``reached`` counts those that did. Returns ``{"budget", "fractions",
    "baseline", "labels": {label: {"at": {f: cell}, "area": cell}}, "vs_baseline": {label:
    {"at": ..., "area": ...}}}``, a cell ``None`` where a run falls short, else the bootstrap
    dict with ``reached`` and, for ``at``, the mean ``x``, ``seconds`` and ``rollouts`` at the
    readings.
    """
    readings = {
        label: [(seed, run_readings(points, budget, fractions)) for seed, points in runs]
        for label, runs in curves.items()
    }
    out: dict[str, Any] = {"budget": budget, "fractions": list(fractions), "baseline": baseline,
                           "labels": {}, "vs_baseline": {}}  # fmt: skip

    def rows(label: str, key: str, f: float | None) -> tuple[list[dict], list[int]] | None:
        got = []
        for _, r in readings[label]:
            value = r["area"] if f is None else r["at"][f]
            if value is None:
                return None
            got.append(value if f is None else value.per_prompt)
        return got, [seed for seed, _ in readings[label]]

    def cell(label: str, f: float | None, other: str | None = None) -> dict[str, Any] | None:
        mine = rows(label, "at", f)
        theirs = rows(other, "at", f) if other else None
        if mine is None or (other and theirs is None):
            return None
        maps = mine[0] + (theirs[0] if theirs else [])
        ids = sorted(set.intersection(*(set(m) for m in maps)))
        a = [[m[p] for p in ids] for m in mine[0]]
        b = None if theirs is None else [[m[p] for p in ids] for m in theirs[0]]
        same = theirs is not None and mine[1] == theirs[1]
        result = bootstrap_dict(a, b, paired_runs=same)
        result["reached"] = len(mine[0])
        if f is not None and other is None:
            hits = [r["at"][f] for _, r in readings[label]]
            result |= {k: sum(getattr(h, k) for h in hits) / len(hits)
                       for k in ("x", "seconds", "rollouts")}  # fmt: skip
        return result

    for label in curves:
        out["labels"][label] = {
            "at": {f: cell(label, f) for f in fractions},
            "area": cell(label, None),
            "runs": len(readings[label]),
            "reached": {
                f: sum(r["at"][f] is not None for _, r in readings[label]) for f in fractions
            },  # fmt: skip
        }
        if baseline in curves and label != baseline:
            out["vs_baseline"][label] = {
                "at": {f: cell(label, f, baseline) for f in fractions},
                "area": cell(label, None, baseline),
            }
    return out


def budget_rows(
    comparison: Mapping[str, Any], unit: str = "rollouts"
) -> list[tuple[list[str], list[list[str]]]]:
    """The comparison as tables ``(header, rows)``: per label the accuracy at each fraction
    and the area, mean [two-level 95% interval]; then, with a baseline, each label minus it."""
    from anchor_rl.bench.summary import format_bootstrap

    fractions = comparison["fractions"]
    budget = comparison["budget"]
    digits = ",.0f" if unit == "rollouts" else ",.1f"
    head = [f"{f:.0%} ({f * budget:{digits}} {unit})" for f in fractions]

    def fmt(c: Mapping[str, Any] | None, signed: bool, reached: int | None, runs: int) -> str:
        if c is None:
            return f"– ({reached}/{runs} runs reach it)" if reached is not None else "–"
        return format_bootstrap(c, signed=signed)

    def key(f: float) -> Any:  # fractions are strings once read back from JSON
        return f if f in comparison["labels"][next(iter(comparison["labels"]))]["at"] else str(f)

    header = ["run", "runs", *head, "area under the curve"]
    rows = []
    for label, entry in comparison["labels"].items():
        runs = entry["runs"]
        cells = [fmt(entry["at"][key(f)], False, entry["reached"][key(f)], runs) for f in fractions]
        rows.append([label, str(runs), *cells, fmt(entry["area"], False, None, runs)])
    tables = [(header, rows)]
    if comparison["vs_baseline"]:
        diff = []
        for label, entry in comparison["vs_baseline"].items():
            runs = comparison["labels"][label]["runs"]
            cells = [fmt(entry["at"][key(f)], True, None, runs) for f in fractions]
            diff.append([label, str(runs), *cells, fmt(entry["area"], True, None, runs)])
        tables.append(([f"minus `{comparison['baseline']}`", *header[1:]], diff))
    return tables


AXES = {
    "rollouts/total": "rollouts",
    "time/elapsed": "wall seconds",
    "cost/modelled_s": "modelled seconds",
}
"""The costs a suite with a budget is compared at: x key -> unit."""


def suite_comparison(
    runs: Sequence[Mapping[str, Any]],
    budget: Mapping[str, Any],
    baseline: str | None,
    costs: Any = None,
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A budgeted suite's comparisons at equal rollouts (its common budget), at equal wall
    seconds and at equal modelled seconds (each the largest value that every run of one label
    outside ``to_budget`` reached): ``(payload, blocks)``, the blocks as ``anchor-rl report`` writes them
    (``("h3" | "p", text)``, ``("table", (header, rows))``; :func:`blocks_markdown`).

    ``runs``: dicts with ``label``, ``seed``, ``records`` (metric records) and ``evals``
    (``evals.jsonl`` records). ``budget``: ``{"rollouts", "mode", "to_budget"}``. ``costs``:
    the :class:`~anchor_rl.bench.costs.Costs` the modelled seconds use (None: fitted from
    these runs; no modelled comparison when they logged no token counts). The payload is
    ``budget`` with ``costs`` and ``at_equal``: ``rollouts``, ``wall_seconds`` and
    ``modelled_seconds`` -> :func:`compare_at_budget` (fractions as string keys).
    """
    from anchor_rl.bench.costs import MODELLED, fit_costs, with_modelled_seconds

    given = costs is not None
    if costs is None:
        try:
            costs = fit_costs([r["records"] for r in runs])
        except ValueError:
            costs = None
    fixed = [r for r in runs if r["label"] not in budget["to_budget"]]
    payload: dict[str, Any] = {**budget, "costs": None if costs is None else costs.to_dict()}
    payload["at_equal"] = {}
    cells = ", ".join(f"`{x}`" for x in budget["to_budget"])
    how = " (the most any other run spent)" if budget["mode"] == "max" else ""
    blocks: list[tuple[str, Any]] = [
        (
            "p",
            f"Run to the common budget of {budget['rollouts']:,} total rollouts{how}: {cells}. "
            "Each cell is the held-out accuracy at the first evaluation at or past that share "
            "of the budget, mean [95% two-level bootstrap: runs, then prompts]; the area is "
            "the mean accuracy over [0, budget] (anchor_rl.bench.budget). A run that ends "
            "short of a point leaves its cell empty. Wall and modelled seconds are compared "
            "at the most that every run of one label outside the list spent.",
        )
    ]
    for x, unit in AXES.items():
        if x == MODELLED:
            if costs is None:
                continue
            records = {id(r): with_modelled_seconds(r["records"], costs) for r in runs}
        else:
            records = {id(r): r["records"] for r in runs}
        if x == "rollouts/total":
            common = float(budget["rollouts"])
        else:  # the most a label outside to_budget spent on every one of its runs
            reached: dict[str, float] = {}
            for r in fixed:
                if (v := _last(records[id(r)], x)) is not None:
                    reached[r["label"]] = min(v, reached.get(r["label"], v))
            if not reached:
                continue
            common = max(reached.values())
        curves: dict[str, list] = {}
        for r in runs:
            points = curve_points(records[id(r)], r["evals"], x)
            curves.setdefault(r["label"], []).append((r["seed"], points))
        comparison = compare_at_budget(curves, common, baseline)
        payload["at_equal"][unit.replace(" ", "_")] = _jsonable(comparison)
        size = f"{common:,.0f}" if unit == "rollouts" else f"{common:,.1f} s"
        blocks.append(("h3", f"At equal {unit} ({size})"))
        blocks += [("table", table) for table in budget_rows(comparison, unit)]
    if costs is not None:
        where = "given (costs.json)" if given else "fitted from these runs"
        blocks.append(
            (
                "p",
                f"Modelled seconds (anchor_rl.bench.costs), per-unit costs {where}: "
                + ", ".join(f"{k} {v:.3g}" for k, v in costs.to_dict().items())
                + ".",
            )
        )
    return payload, blocks


def blocks_markdown(blocks: Sequence[tuple[str, Any]], title: str = "At equal budget") -> str:
    """:func:`suite_comparison`'s blocks as a markdown section of summary.md."""
    parts = [f"## {title}"]
    for kind, value in blocks:
        if kind == "h3":
            parts.append(f"### {value}")
        elif kind == "p":
            parts.append(value)
        else:
            header, rows = value
            lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
            parts.append("\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]))
    return "\n\n".join(parts) + "\n"


def _last(records: Sequence[Mapping[str, Any]], x: str) -> float | None:
    values = [r[x] for r in records if x in r]
    return float(values[-1]) if values else None


def _jsonable(comparison: Mapping[str, Any]) -> dict[str, Any]:
    """Fractions as string keys (JSON objects)."""

    def fix(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): fix(v) for k, v in value.items()}
        return value

    return fix(comparison)
