"""The ``baseline-mse`` suite: simulated baseline MSE, and measured baseline MSE inside real
V0.5 runs.

``anchor-rl bench baseline-mse`` runs, into ``OUT``:

1. the simulator (``anchor_rl.bench.mse.run_baseline_mse``) into ``OUT/simulator``;
2. the training runs of ``suites/baseline-mse.toml`` into ``OUT/training`` (the ``v05``
   preset with the ``v05_probe`` component of ``anchor_rl.bench.v05_probe``, which
   measures, with the policy of the run, every method's baseline against 64-rollout ground
   truth on a fixed prompt set, and the priors' AUC and calibration on held-out prompts
   against 32-rollout ground truth);
3. the probe report over those runs: ``OUT/probe.json``, ``OUT/probe.md`` and
   ``OUT/probe_mse.png``, and ``OUT/summary.md`` joining the simulator's tables, the probe
   report and the training summary.

Re-running the command skips finished runs like any suite; the simulator reruns (seconds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.bench.mse import run_baseline_mse
from anchor_rl.bench.runner import BenchArgs, RunSpec, load_suite, plan, report, run_spec
from anchor_rl.bench.stats import t_interval
from anchor_rl.bench.v05_probe import read_probe

SUITE = "baseline-mse"
PRIOR_PARTS = (
    ("prior_probe", "run's prior, probe prompts (training prompts)"),
    ("knn_heldout", "knn, context = probe prompts' truth, held-out prompts"),
    ("run_prior_heldout", "run's prior (knn-based), held-out prompts"),
)
PRIOR_KEYS = ("auc", "auc_rollout", "ece", "mse", "pred_mean", "true_mean")


def method_table(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per method, over the probes of one or several runs: ``mse`` (mean of the probes'
    noise-corrected MSEs), ``half_width`` (95% t-interval over probes; None with one),
    ``mse_raw``, ``rollouts`` (mean per prompt) and ``probes``."""
    by_method: dict[str, list[Mapping[str, float]]] = {}
    for rec in records:
        for name, m in rec["methods"].items():
            by_method.setdefault(name, []).append(m)
    out = {}
    for name, ms in by_method.items():
        iv = t_interval([m["mse"] for m in ms])
        out[name] = {
            "mse": iv.mean,
            "half_width": iv.half_width,
            "mse_raw": sum(m["mse_raw"] for m in ms) / len(ms),
            "rollouts": sum(m["rollouts"] for m in ms) / len(ms),
            "probes": len(ms),
        }
    return out


def prior_table(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per prior measurement (``PRIOR_PARTS``), the mean of each metric over the probes that
    have it (None where every probe's value is undefined, e.g. an AUC with one class)."""
    out: dict[str, dict[str, float | None]] = {}
    for part, _ in PRIOR_PARTS:
        found = [rec[part] for rec in records if part in rec]
        if not found:
            continue
        row: dict[str, float | None] = {"probes": float(len(found))}
        for key in PRIOR_KEYS:
            values = [f[key] for f in found if f.get(key) is not None]
            row[key] = sum(values) / len(values) if values else None
        out[part] = row
    return out


def _fmt(value: float | None, digits: int = 4) -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.{digits}f}"
    )


def probe_markdown(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> str:
    """Tables per label (``runs[label]`` = each seed's probe records)."""
    lines = ["# Baseline MSE inside training (probe)", ""]
    for label, seeds in runs.items():
        records = [r for seed in seeds for r in seed]
        if not records:
            continue
        first = records[0]
        steps = sorted({r["step"] for r in records})
        lines += [
            f"## {label}",
            "",
            f"{len(seeds)} seed(s), probes before steps {steps}; {first['prompts']} probe prompts, "
            f"ground truth {first['truth_rollouts']} rollouts each, k_init {first['k_init']}, "
            f"k_max {first['k_max']}. MSE in reward units, noise-corrected (mean over probes, "
            "± 95% t half-width over probes); `raw` includes the truth's own variance.",
            "",
            "| method | rollouts / prompt | MSE | raw |",
            "|---|---:|---:|---:|",
        ]
        for name, m in method_table(records).items():
            hw = "" if m["half_width"] is None else f" ± {m['half_width']:.4f}"
            lines.append(
                f"| {name} | {m['rollouts']:.2f} | {m['mse']:.4f}{hw} | {m['mse_raw']:.4f} |"
            )
        lines += ["", "Per probe (noise-corrected MSE):", ""]
        names = list(method_table(records))
        lines += ["| step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for step in steps:
            at = method_table([r for r in records if r["step"] == step])
            lines.append(f"| {step} | " + " | ".join(_fmt(at[n]["mse"]) for n in names) + " |")
        priors = prior_table(records)
        if priors:
            lines += [
                "",
                "Priors against ground truth (normalised units; mean over probes):",
                "",
                "| prior, prompts | AUC | AUC (rollouts) | ECE | MSE | pred mean | true mean |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for part, title in PRIOR_PARTS:
                if part in priors:
                    p = priors[part]
                    cells = [_fmt(p[k], 3) for k in PRIOR_KEYS]
                    lines.append(f"| {title} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_probe(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], path: Path) -> Path:
    """Noise-corrected MSE against the probe's step, one panel per label, one line per method
    (a method keeps its colour across panels)."""
    from matplotlib.figure import Figure

    labels = [label for label, seeds in runs.items() if any(seeds)]
    every = [r for label in labels for seed in runs[label] for r in seed]
    colours = {name: f"C{i}" for i, name in enumerate(method_table(every))}
    fig = Figure(figsize=(5.5 * len(labels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(labels), squeeze=False)[0]
    handles = {}
    for ax, label in zip(axes, labels, strict=True):
        records = [r for seed in runs[label] for r in seed]
        steps = sorted({r["step"] for r in records})
        tables = [method_table([r for r in records if r["step"] == s]) for s in steps]
        for name in method_table(records):
            y = [t[name]["mse"] if name in t else math.nan for t in tables]
            (handles[name],) = ax.plot(steps, y, "o-", color=colours[name], label=name)
        ax.set_title(label)
        ax.set_xlabel("training step probed")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("baseline MSE (noise-corrected)")
    names = [n for n in colours if n in handles]
    fig.legend([handles[n] for n in names], names, loc="outside lower center", ncol=4, fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def probe_report(specs: Sequence[RunSpec], out: Path) -> dict[str, Any]:
    """``probe.json``, ``probe.md`` and ``probe_mse.png`` in ``out`` from the runs' probe files."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for spec in specs:
        runs.setdefault(spec.label, []).append(read_probe(spec.run_dir))
    if not any(records for seeds in runs.values() for records in seeds):
        raise ValueError(
            "no run of the suite wrote probe records: add the v05_probe component to the suite"
        )
    payload = {
        label: {
            "methods": method_table([r for s in seeds for r in s]),
            "priors": prior_table([r for s in seeds for r in s]),
            "records": seeds,
        }
        for label, seeds in runs.items()
    }
    out = Path(out)
    files = {"json": out / "probe.json", "md": out / "probe.md", "plot": out / "probe_mse.png"}
    files["json"].write_text(json.dumps(payload, indent=1))
    files["md"].write_text(probe_markdown(runs))
    plot_probe(runs, files["plot"])
    return {"files": {k: str(v) for k, v in files.items()}, "summary": payload}


def run_baseline_mse_suite(
    args: BenchArgs,
) -> dict[str, Any]:
    """Simulator, probed training runs and the probe report (see the module docstring).

    ``profile="quick"`` runs the quick simulator and the suite's quick profile. The
    simulator uses the first seed. Returns ``{"summary_json", "summary_md", "plots"}``
    like ``runner.run_suite``, plus ``"simulator"`` and ``"probe"``.
    """
    out, seeds, steps, overrides, profile, echo = args.unpack()
    out.mkdir(parents=True, exist_ok=True)
    suite = load_suite(SUITE)
    specs = plan(suite, out / "training", seeds, steps, overrides, profile)
    sim_seed = (seeds or suite.seeds)[0]
    echo(f"[simulator] seed {sim_seed} -> {out / 'simulator'}")
    sim = run_baseline_mse(out / "simulator", seed=sim_seed, quick=profile == "quick")
    for i, spec in enumerate(specs, 1):
        echo(f"[{i}/{len(specs)}] {spec.label} seed {spec.seed} -> {spec.run_dir}")
        run_spec(spec)
    training = report(SUITE, specs, out / "training")
    probe = probe_report(specs, out)
    summary_md = out / "summary.md"
    summary_md.write_text(
        "\n".join(
            [
                Path(sim["files"][1]).read_text(),
                Path(probe["files"]["md"]).read_text(),
                training["summary_md"].read_text(),
            ]
        )
    )
    summary_json = out / "summary.json"
    summary_json.write_text(
        json.dumps(
            {
                "suite": SUITE,
                "simulator": sim["summary"],
                "probe": {k: v["methods"] for k, v in probe["summary"].items()},
                "training": str(training["summary_json"]),
            },
            indent=1,
        )
    )
    plots = [Path(f) for f in sim["files"] if f.endswith(".png")]
    plots += [Path(probe["files"]["plot"]), *training["plots"]]
    return {
        "summary_json": summary_json,
        "summary_md": summary_md,
        "plots": plots,
        "simulator": sim,
        "probe": probe,
    }
