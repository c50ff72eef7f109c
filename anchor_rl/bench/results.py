"""Bench results found under directories: each suite's methods (labels) with their runs'
metric records and figures, training runs outside suites, the ``baseline-mse``, ``trl`` and
``throughput`` payloads, and quickstarts' raw results (``quickstart.json``; the runs inside
a quickstart's directory are its, not runs of their own): what ``anchor-rl report`` reads."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anchor_rl.bench.quickstart_results import RAW_FILE, is_raw

RESULT_FILES = ("summary.json", "baseline_mse.json", "trl_compare.json", "throughput.json")


@dataclass
class Method:
    """One label of one bench suite: its seeds' metric records and the suite's figures."""

    suite: str
    label: str
    task: str
    seeds: list[int]
    records: list[list[dict[str, float]]]
    figures: dict[str, dict[str, Any]]
    run_dirs: list[Path] = field(default_factory=list)
    """The run directories the records come from."""
    name: str = ""
    """Label shown in plots: the label, prefixed by the suite when two suites share it."""


@dataclass
class Results:
    """Everything found under the report's inputs."""

    methods: list[Method] = field(default_factory=list)
    mse: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    trl: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    throughput: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    quickstart: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    sources: list[Path] = field(default_factory=list)
    budgets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Suite (as its methods name it) -> its common budget, ``{"rollouts", "mode",
    "to_budget"}``, for suites run with one (``budget`` in the suite file)."""
    sweeps: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Suite -> its sweep cost summary (:func:`~anchor_rl.bench.sweep.sweep_summary`), for
    suites run with ``shared_anchors = true``."""


def load_results(paths: Sequence[Path]) -> Results:
    """Find every result file under ``paths`` (directories, searched recursively)."""
    files: dict[Path, Path] = {}  # resolved path -> the path as found (shown in the report)
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory")
        for name in (*RESULT_FILES, RAW_FILE):
            for found in sorted(path.rglob(name)):
                files.setdefault(found.resolve(), found)
    results = Results()
    suite_roots = _suite_roots(files.values())
    trained: list[Path] = []  # runs of `anchor-rl train`, reported when no suite holds them
    suite_dirs: set[Path] = set()
    for file in files.values():
        payload = json.loads(file.read_text())
        if file.name == "summary.json":
            if "groups" not in payload or "suite" not in payload:
                if (file.parent / "config.json").is_file():
                    trained.append(file.parent)  # a training run's own summary
                continue  # else another file of that name (baseline-mse's combined summary)
            # the same suite run twice (other seeds, steps or overrides) stays two suites
            suite = payload["suite"]
            if suite_roots[suite] != file.parent:
                suite = f"{suite} ({file.parent.name})"
            results.methods += _suite_methods(file.parent, {**payload, "suite": suite})
            if budget := payload.get("budget"):
                keys = ("rollouts", "mode", "to_budget")
                results.budgets[suite] = {k: budget[k] for k in keys}
            if sweep := payload.get("sweep"):
                results.sweeps[suite] = sweep
            suite_dirs.add(file.parent.resolve())
        elif file.name == "baseline_mse.json":
            results.mse.append((file.parent, payload))
        elif file.name == RAW_FILE:
            if not is_raw(payload):
                continue  # another file of that name
            results.quickstart.append((file.parent, payload))
            suite_dirs.add(file.parent.resolve())
        elif file.name == "trl_compare.json":
            results.trl.append((file.parent, payload))
        else:
            results.throughput.append((file.parent, payload))
        results.sources.append(file)
    in_suites = {d.resolve() for m in results.methods for d in m.run_dirs}
    for run_dir in trained:
        inside = suite_dirs & {run_dir.resolve(), *run_dir.resolve().parents}
        if run_dir.resolve() not in in_suites and not inside:
            results.methods.append(_run_method(run_dir))
            results.sources.append(run_dir / "summary.json")
    _name_methods(results.methods)
    return results


def _suite_roots(files: Any) -> dict[str, Path]:
    """Suite name -> the directory whose results keep that name where several suite summaries
    (``summary.json`` with ``groups``) hold the same suite: the one named after the suite, else the first found (the others are named
    ``suite (directory)``), so adding a result elsewhere renames no suite."""
    roots: dict[str, list[Path]] = {}
    for file in files:
        if file.name != "summary.json":
            continue
        payload = json.loads(file.read_text())
        if "groups" in payload and isinstance(payload.get("suite"), str):
            roots.setdefault(payload["suite"], []).append(file.parent)
    return {s: next((d for d in dirs if d.name == s), dirs[0]) for s, dirs in roots.items()}


def _run_method(run_dir: Path) -> Method:
    """One training run (``anchor-rl train``'s directory) as a method of one seed, with the
    figures a suite computes for its runs."""
    from anchor_rl.bench.summary import run_figures, summarise
    from anchor_rl.trainer.logging import read_metrics

    config = json.loads((run_dir / "config.json").read_text())
    records = read_metrics(run_dir)
    label = config.get("preset") or run_dir.name
    seed = config.get("seed", 0)
    (group,) = summarise([{"label": label, "seed": seed, "figures": run_figures(records)}])
    return Method(
        suite=f"run {run_dir.name}",
        label=label,
        task=config.get("task", "unknown"),
        seeds=[seed],
        records=[records],
        figures=group["figures"],
        run_dirs=[run_dir],
    )


def _suite_methods(root: Path, summary: Mapping[str, Any]) -> list[Method]:
    from anchor_rl.trainer.logging import read_metrics

    by_label: dict[str, list[Mapping[str, Any]]] = {}
    for run in summary["runs"]:
        by_label.setdefault(run["label"], []).append(run)
    figures = {g["label"]: g["figures"] for g in summary["groups"]}
    methods = []
    for label, runs in by_label.items():
        records, task, dirs = [], "unknown", []
        for run in runs:
            run_dir = _run_dir(root, run)
            if run_dir is None:
                continue
            dirs.append(run_dir)
            records.append(read_metrics(run_dir))
            config = run_dir / "config.json"
            if config.is_file():
                task = json.loads(config.read_text()).get("task", task)
        methods.append(
            Method(
                suite=summary["suite"],
                label=label,
                task=task,
                seeds=[r["seed"] for r in runs],
                records=records,
                figures=figures.get(label, {}),
                run_dirs=dirs,
            )
        )
    return methods


def _run_dir(root: Path, run: Mapping[str, Any]) -> Path | None:
    """A run's directory: as stored, or where the runner puts it under the suite's directory."""
    from anchor_rl.trainer.logging import METRICS_FILE, jsonl_path

    for candidate in (Path(run["dir"]), root / run["label"] / f"seed{run['seed']}"):
        if jsonl_path(candidate / METRICS_FILE).is_file():
            return candidate
    return None


def _name_methods(methods: Sequence[Method]) -> None:
    counts: dict[tuple[str, str], int] = {}
    for m in methods:
        counts[(m.task, m.label)] = counts.get((m.task, m.label), 0) + 1
    for m in methods:
        m.name = m.label if counts[(m.task, m.label)] == 1 else f"{m.suite}/{m.label}"
