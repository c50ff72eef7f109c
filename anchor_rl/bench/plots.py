"""Accuracy curves of a suite against steps, cumulative rollouts and wall time: held-out
accuracy, and training-prompt accuracy for runs that log it (``eval.train_prompts``).

Each preset/variant is one colour: the mean over seeds as a line (x averaged over seeds
at each evaluation, since rollouts and seconds differ between seeds) and a band of the
95% t-interval of the accuracy when there are several seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from anchor_rl.bench.stats import t_interval

AXES = {
    "step": ("step", "accuracy_vs_steps.png"),
    "rollouts/total": ("rollouts (cumulative, presampling included)", "accuracy_vs_rollouts.png"),
    "time/elapsed": ("wall time (s)", "accuracy_vs_time.png"),
}
Y = "eval/accuracy"
METRICS = {
    Y: ("held-out accuracy", ""),
    "eval/train_accuracy": ("training-prompt accuracy", "train_"),
}
"""Metric -> (axis label, file-name prefix)."""


def eval_curve(
    records: Sequence[Mapping[str, float]], x: str, y: str = Y
) -> list[tuple[float, float]]:
    """``(x, accuracy)`` at every evaluation of one run."""
    return [(float(r[x]), float(r[y])) for r in records if y in r and x in r]


def mean_curve(
    curves: Sequence[Sequence[tuple[float, float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Pointwise mean x, mean y and the y interval over seeds, truncated to the shortest curve."""
    n = min(len(c) for c in curves)
    xs, ys, lows, highs = [], [], [], []
    for i in range(n):
        iv = t_interval([c[i][1] for c in curves])
        xs.append(sum(c[i][0] for c in curves) / len(curves))
        ys.append(iv.mean)
        lows.append(iv.mean if iv.low is None else iv.low)
        highs.append(iv.mean if iv.high is None else iv.high)
    return xs, ys, lows, highs


def grid_curve(
    curves: Sequence[Sequence[tuple[float, float]]], points: int = 50
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Like :func:`mean_curve` for seeds evaluated at different x (runs to a budget): each
    seed's curve interpolated linearly on ``points`` x values from the latest first x to the
    earliest last x of the seeds (the range every seed covers), then the pointwise mean and
    interval."""
    import numpy as np

    lo, hi = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    if hi <= lo:
        return mean_curve(curves)
    xs = np.linspace(lo, hi, points)
    ys = [np.interp(xs, [p[0] for p in c], [p[1] for p in c]) for c in curves]
    means, lows, highs = [], [], []
    for i in range(points):
        iv = t_interval([float(y[i]) for y in ys])
        means.append(iv.mean)
        lows.append(iv.mean if iv.low is None else iv.low)
        highs.append(iv.mean if iv.high is None else iv.high)
    return [float(x) for x in xs], means, lows, highs


def plot_suite(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, float]]]],
    out: Path,
    title: str,
    budget: float | None = None,
) -> list[Path]:
    """One PNG per x axis in ``AXES`` and metric in ``METRICS`` that some run logged; ``runs``
    maps a label to its seeds' metric records. With a common rollout ``budget`` the seeds'
    curves are averaged on a grid (:func:`grid_curve`) and the budget is drawn on the
    rollouts axis."""
    paths = []
    for y, (ylabel, prefix) in METRICS.items():
        for x, (xlabel, filename) in AXES.items():
            series = {
                label: [eval_curve(records, x, y) for records in seeds]
                for label, seeds in runs.items()
            }
            path = Path(out) / f"{prefix}{filename}"
            line = budget if x == "rollouts/total" else None
            grid = budget is not None and x != "step"
            if plot_curves(series, xlabel, ylabel, title, path, vline=line, grid=grid):
                paths.append(path)
    return paths


def plot_curves(
    series: Mapping[str, Sequence[Sequence[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    vline: float | None = None,
    grid: bool = False,
) -> bool:
    """One line per label (pointwise mean over seeds, a 95% band when there are several;
    ``grid``: seeds averaged on a common x grid, :func:`grid_curve`), a dashed vertical line
    at ``vline`` (a common budget); returns False (and writes nothing) when no label has a
    point."""
    from matplotlib.figure import Figure

    series = {k: [c for c in v if c] for k, v in series.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return False
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for label, curves in series.items():
        xs, ys, lows, highs = grid_curve(curves) if grid else mean_curve(curves)
        marker = None if grid else "o"  # a grid's points are not evaluations
        (line,) = ax.plot(xs, ys, marker=marker, markersize=2, label=f"{label} (n={len(curves)})")
        if len(curves) > 1:
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
    if vline is not None:
        ax.axvline(vline, color="0.4", linestyle="--", linewidth=1, label="common budget")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return True
