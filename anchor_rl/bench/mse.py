"""The ``baseline-mse`` suite: simulated baseline MSE of GRPO, RLOO, PVPO's anchor and V0.5.

Runs :func:`anchor_rl.bench.simulate.simulate` for both reward forms (+-1 and 0/1) and both
V0.5 sigma^2 modes (worst case and Bernoulli variance at the prior), then writes to
``out_dir``:

* ``baseline_mse.json``: configs, per-estimator ``[bias][p]`` MSE, standard error and
  rollouts, and per-bias summaries (mean and max over the p grid);
* ``baseline_mse.md``: one table per (reward form, sigma^2 mode);
* ``mse_vs_p_{form}_{sigma2}.png`` (``quick``: ``pm1_worst`` only): MSE against true p, one panel per prior bias;
* ``mse_vs_rollouts_{form}_{sigma2}.png`` (likewise): MSE (mean over the p grid) against mean
  rollouts per prompt, one panel per prior bias.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import track

from anchor_rl.bench.simulate import SimConfig, SimResult, simulate

CONFIGS: tuple[tuple[str, str], ...] = (
    ("pm1", "worst"),
    ("pm1", "prior"),
    ("binary", "worst"),
    ("binary", "prior"),
)
TABLE_ROWS = (
    "oracle",
    "group_mean_k4",
    "group_mean_k16",
    "loo_k4",
    "anchor",
    "v05_k4",
    "v05_k8",
    "v05_adaptive",
)
P_PLOT = (  # name, label, matplotlib style
    ("group_mean_k4", "group mean, k=4 (GRPO)", "-"),
    ("loo_k4", "leave-one-out, k=4 (RLOO)", "-"),
    ("group_mean_k16", "group mean, k=16", "--"),
    ("anchor", "static anchor (PVPO), 0 rollouts", "-"),
    ("v05_k4", "V0.5 fusion, k=4", "-"),
    ("v05_adaptive", "V0.5 + extra rollouts", "-"),
    ("oracle", "oracle", ":"),
)
COMMAND = (
    'python -c "from pathlib import Path; from anchor_rl.bench.mse import run_baseline_mse; '
    "run_baseline_mse(Path('runs/baseline-mse'))\""
)


def _configs(seed: int, quick: bool) -> list[SimConfig]:
    extra: dict[str, Any] = {"seed": seed}
    if quick:
        extra |= {"trials": 2_000, "p_grid": tuple(i / 10 for i in range(11))}
    return [SimConfig(reward_form=f, sigma2=s, **extra) for f, s in CONFIGS]  # type: ignore[arg-type]


def _key(cfg: SimConfig) -> str:
    return f"{cfg.reward_form}_{cfg.sigma2}"


def _summary(res: SimResult) -> dict[str, dict[str, list[float]]]:
    """Per estimator: mean and max MSE over the p grid, and mean rollouts, per bias."""
    return {
        name: {
            "mse_mean": mse.mean(1).tolist(),
            "mse_max": mse.amax(1).tolist(),
            "rollouts": res.rollouts[name].mean(1).tolist(),
        }
        for name, mse in res.mse.items()
    }


def _json_block(res: SimResult) -> dict[str, Any]:
    cfg = asdict(res.config) | {"cost": res.config.scaled_cost}
    methods = {
        name: {
            "mse": res.mse[name].tolist(),
            "se": res.se[name].tolist(),
            "rollouts": res.rollouts[name].tolist(),
        }
        for name in res.mse
    }
    return {"config": cfg, "methods": methods, "summary": _summary(res)}


def _table(res: SimResult) -> str:
    cfg = res.config
    lo, hi = cfg.reward_range
    head = ["estimator", "rollouts / prompt", *(f"MSE, bias {b:g}" for b in cfg.biases)]
    lines = [
        f"### rewards {lo:g}/{hi:g}, sigma^2 = {cfg.sigma2}, cost {cfg.scaled_cost:g}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name in TABLE_ROWS:
        rolls = res.rollouts[name].mean(1)
        if bool((rolls == rolls[0]).all()):
            roll = f"{rolls[0].item():g}"
        else:
            roll = " / ".join(f"{r:.2f}" for r in rolls.tolist())
        mse = [f"{m:.4f}" for m in res.mse[name].mean(1).tolist()]
        lines.append("| " + " | ".join([name, roll, *mse]) + " |")
    return "\n".join(lines)


def _markdown(results: list[SimResult], seed: int, quick: bool, elapsed: float) -> str:
    cfg = results[0].config
    intro = [
        "# baseline-mse: simulated baseline error",
        "",
        f"Seed {seed}{', quick' if quick else ''}; {cfg.trials} simulated prompts per "
        f"(p, bias) cell; p grid {min(cfg.p_grid):g}..{max(cfg.p_grid):g} "
        f"({len(cfg.p_grid)} points); V0.5 k_init {cfg.k_init}, k_max {cfg.k_max}. "
        f"Wall time {elapsed:.1f} s (simulation and plots).",
        "",
        "MSE against the true expected reward in the reward units in use, averaged over the "
        "p grid; bias is the prior's error in probability units (the static anchor is that "
        "prior). Per-p values and standard errors are in baseline_mse.json.",
        "",
        f"Command: `{COMMAND}`",
        "",
        "",
    ]
    return "\n".join(intro) + "\n\n".join(_table(r) for r in results) + "\n"


def _panels(
    res: SimResult, draw: Callable[[Any, int], None], ylabel: str, x: str, path: Path
) -> None:
    """One panel per prior bias (``draw(ax, bias index)`` fills it), one legend below them
    (every panel draws the same series), saved to ``path``."""
    from matplotlib.figure import Figure

    cfg = res.config
    fig = Figure(figsize=(4 * len(cfg.biases), 4.2), layout="constrained")
    axes = fig.subplots(1, len(cfg.biases), sharey=True, squeeze=False)[0]
    for i, (ax, bias) in enumerate(zip(axes, cfg.biases, strict=True)):
        draw(ax, i)
        ax.set_title(f"prior bias {bias:g}")
    axes[0].set_ylabel(ylabel)
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    lo, hi = cfg.reward_range
    fig.suptitle(f"Baseline MSE vs {x} (rewards {lo:g}/{hi:g}, sigma^2 {cfg.sigma2})")
    fig.savefig(path, dpi=110)


def _plot_vs_p(res: SimResult, path: Path) -> None:
    def draw(ax: Any, i: int) -> None:
        for name, label, style in P_PLOT:
            ax.plot(res.config.p_grid, res.mse[name][i].tolist(), style, label=label)
        ax.set_xlabel("true success probability p")
        ax.grid(alpha=0.3)

    _panels(res, draw, "baseline MSE", "p", path)


def _plot_vs_rollouts(res: SimResult, path: Path) -> None:
    cfg = res.config

    def draw(ax: Any, i: int) -> None:
        for prefix, label in (
            ("group_mean", "group mean"),
            ("loo", "leave-one-out"),
            ("v05", "V0.5 fusion"),
        ):
            names = [f"{prefix}_k{k}" for k in cfg.k_grid if f"{prefix}_k{k}" in res.mse]
            x = [res.rollouts[n][i].mean().item() for n in names]
            y = [res.mse[n][i].mean().item() for n in names]
            ax.plot(x, y, "o-", label=label)
        ada = "v05_adaptive"
        ax.plot(
            res.rollouts[ada][i].mean().item(),
            res.mse[ada][i].mean().item(),
            "*",
            markersize=14,
            label=f"V0.5 + extra rollouts (c={cfg.scaled_cost:g})",
        )
        anchor = res.mse["anchor"][i].mean().item()
        if anchor > 0:
            ax.plot(0, anchor, "s", label="static anchor")
        ax.set_yscale("log")
        ax.set_xlabel("mean rollouts per prompt")
        ax.grid(alpha=0.3, which="both")

    _panels(res, draw, "baseline MSE (mean over p)", "rollouts", path)


def run_baseline_mse(
    out_dir: Path, seed: int = 0, quick: bool = False, *, show_progress: bool = True
) -> dict[str, Any]:
    """Run the ``baseline-mse`` suite and write JSON, markdown and plots to ``out_dir``.

    ``quick`` uses 2,000 trials per cell and an 11-point p grid, and plots only the paper's
    setting (+-1 rewards, worst-case sigma^2); it is for tests and smoke runs.
    Returns ``{"suite", "seed", "quick", "elapsed_s", "files", "summary"}`` where
    ``summary[config][estimator]`` holds per-bias ``mse_mean``, ``mse_max`` and ``rollouts``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    configs = _configs(seed, quick)
    results = [
        simulate(cfg)
        for cfg in track(configs, description="baseline-mse", disable=not show_progress)
    ]
    files = [out_dir / "baseline_mse.json", out_dir / "baseline_mse.md"]
    for res in results[:1] if quick else results:
        key = _key(res.config)
        files += [out_dir / f"mse_vs_p_{key}.png", out_dir / f"mse_vs_rollouts_{key}.png"]
        _plot_vs_p(res, files[-2])
        _plot_vs_rollouts(res, files[-1])
    elapsed = time.perf_counter() - start
    blocks = {_key(r.config): _json_block(r) for r in results}
    report = {"suite": "baseline-mse", "seed": seed, "quick": quick, "elapsed_s": elapsed}
    files[0].write_text(json.dumps(report | {"configs": blocks}, indent=1))
    files[1].write_text(_markdown(results, seed, quick, elapsed))
    summary = {key: block["summary"] for key, block in blocks.items()}
    return report | {"files": [str(f) for f in files], "summary": summary}
