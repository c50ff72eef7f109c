"""Sweeps sharing one anchor store: what a study of K runs costs with PVPO against GRPO.

A suite with ``shared_anchors = true`` is a sweep: its configurations (learning rates, KL
coefficients, seeds, ablations) are run with each preset, and every run that reads PVPO's
anchors draws them once for the whole sweep: ``pvpo.presample_seed`` fixed (the runs' own
value, else :data:`~anchor_rl.methods.pvpo.PRESAMPLE_SEED`) rather than each seed's own, and
one store (the runs' ``pvpo.store``, else ``OUT/anchors.db``, so the sweep measures its own
presampling). The first run that reads them pays for the presampling; later ones read the
store.

A run's own cost is its ``rollouts/total`` with the anchor rollouts it read from the store
taken out: ``rollouts/total - rollouts/presample - rollouts/refresh + pvpo/anchors_sampled``
(``rollouts/presample`` counts the rollouts the anchors rest on, cached ones included;
``pvpo/anchors_sampled`` the ones the run sampled itself). A model teacher's generations
(``rollouts/teacher``) are counted in full in every run. The cost summary gives, per preset
in run order, each run's own rollouts and wall seconds (its presampling before the first
step included), the cumulative cost of the first k runs, the cost per run (cumulative / k),
and for every preset that reads anchors against every preset that does not, the measured
break-even k: the smallest k at which the former's cumulative cost is at or below the
latter's (None within the sweep's K runs), with a projection from the measured costs (first
run, then the mean of the later ones) where the sweep is too short to reach it. Beside it, each configuration's held-out accuracy per
preset at its last evaluation, with two-level bootstrap intervals (runs, then prompts).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.errors import ConfigError

SAMPLED = "pvpo/anchors_sampled"
"""The metric of the reference rollouts a run sampled itself for its anchors."""
STORE_FILE = "anchors.db"
"""A sweep's anchor store in its output directory, for runs that name none."""
AXES = {"rollouts": "rollouts", "wall_seconds": "wall seconds"}
"""The costs the summary adds up: payload key -> unit."""


def shared_anchor_settings(pvpo: Any, out: Path) -> dict[str, Any]:
    """The ``pvpo`` settings that give a run the sweep's one anchor draw: ``presample_seed``
    and ``store`` where ``pvpo`` (a run's PVPOConfig) leaves them unset."""
    from anchor_rl.methods.pvpo import PRESAMPLE_SEED

    settings: dict[str, Any] = {}
    if pvpo.presample_seed is None:
        settings["presample_seed"] = PRESAMPLE_SEED
    if pvpo.store is None:
        settings["store"] = str(Path(out) / STORE_FILE)
    return settings


def check_shared(name: str, draws: Mapping[str, tuple[Any, Any]]) -> None:
    """ConfigError unless every anchor-reading run (run name -> ``(store, presample_seed)``)
    draws from the same store with the same seed."""
    distinct = sorted({(str(s), str(k)) for s, k in draws.values()})
    if len(distinct) > 1:
        shown = "; ".join(f"{run}: store {s}, presample_seed {k}" for run, (s, k) in draws.items())
        raise ConfigError(
            f"suite {name!r}: shared_anchors needs one anchor store and one presample_seed for "
            f"every run that reads anchors, got {len(distinct)} ({shown})"
        )


def presample_report(run_dir: Path | str | None) -> dict[str, Any]:
    """A run's ``pvpo.json`` (what its presampling did: the anchor key, seconds); ``{}`` for a
    run without."""
    path = Path(run_dir) / "pvpo.json" if run_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def setup_seconds(report: Mapping[str, Any]) -> float:
    """Seconds a run spent presampling before its first step (``pvpo.json``'s, reading the
    store included), which ``time/elapsed`` leaves out; 0 for a lazy walk, whose presampling
    falls inside its steps."""
    if report.get("presample_mode") == "lazy":
        return 0.0
    return float(report.get("presample", {}).get("seconds", 0.0))


def run_cost(records: Sequence[Mapping[str, Any]], setup_s: float = 0.0) -> dict[str, Any]:
    """One run's cost from its metric records (the last record with a rollout count):
    ``total`` (``rollouts/total``), ``anchors`` (presample + refresh rollouts its anchors
    rest on), ``sampled`` (those it sampled itself), ``rollouts`` (its own cost: total with
    the stored anchors taken out), ``wall_seconds`` (``time/elapsed`` plus ``setup_s``, the
    presampling before the first step) and ``measured`` (False where a run with anchors
    logged no ``pvpo/anchors_sampled``: its anchors are then counted in full)."""
    last = [r for r in records if "rollouts/total" in r or "rollouts/cumulative" in r]
    if not last:
        raise ValueError("the run has no rollout count in its metrics")
    r = last[-1]
    total = float(r.get("rollouts/total", r.get("rollouts/cumulative", 0.0)))
    anchors = float(r.get("rollouts/presample", 0.0)) + float(r.get("rollouts/refresh", 0.0))
    measured = SAMPLED in r or anchors == 0
    sampled = float(r[SAMPLED]) if SAMPLED in r else anchors
    return {
        "total": total,
        "anchors": anchors,
        "sampled": sampled,
        "rollouts": total - anchors + sampled,
        "wall_seconds": float(r.get("time/elapsed", 0.0)) + setup_s,
        "measured": measured,
    }


def cumulative(costs: Sequence[float]) -> list[float]:
    """The cost of the first k runs, k = 1..len(costs)."""
    return list(itertools.accumulate(costs))


def break_even(ours: Sequence[float], theirs: Sequence[float]) -> int | None:
    """The smallest k (1-based, up to the shorter sweep) at which the cumulative cost of
    ``ours``'s first k runs is at or below ``theirs``'s; None when none is."""
    for k, (a, b) in enumerate(zip(cumulative(ours), cumulative(theirs), strict=False), 1):
        if a <= b:
            return k
    return None


def holds_from(ours: Sequence[float], theirs: Sequence[float], k: int | None) -> bool:
    """Whether ``ours``'s cumulative cost stays at or below ``theirs``'s from run ``k`` to
    the end of the shorter sweep."""
    if k is None:
        return False
    pairs = list(zip(cumulative(ours), cumulative(theirs), strict=False))
    return all(a <= b for a, b in pairs[k - 1 :])


def projected_break_even(ours: Sequence[float], theirs: Sequence[float]) -> int | None:
    """The break-even k of the cost model ``ours[0] + (k-1)·a`` against ``k·b`` (``a`` the
    mean of ``ours``'s later runs, ``b`` the mean of ``theirs``): the smallest whole k with
    ``ours[0] - a <= k·(b - a)``; None without later runs or when a later run of ours costs
    at least one of theirs and the first is dearer (it never breaks even)."""
    if len(ours) < 2 or not theirs:
        return None
    a = sum(ours[1:]) / (len(ours) - 1)
    b = sum(theirs) / len(theirs)
    extra = ours[0] - a
    if extra <= b - a:  # already at k = 1 (b >= ours[0])
        return 1
    if b <= a:
        return None
    return max(1, math.ceil(extra / (b - a)))


def sweep_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A sweep's cost summary and accuracy table (JSON-ready; :func:`sweep_blocks` renders it).

    ``runs``, in the order they ran: dicts with ``label`` (``preset[+config]``), ``seed``,
    ``reads_anchors``, ``records`` (metric records), ``evals`` (``evals.jsonl`` records) and
    ``dir``, the run directory (its ``pvpo.json`` gives the anchor key and the presampling's
    seconds; None or absent: no presampling). Returns ``{"methods": {preset: {"reads_anchors",
    "runs": [{label, seed, total, anchors, sampled, rollouts, wall_seconds, measured}],
    "cumulative": {axis: [...]}, "per_run": {axis: [...]}}}, "anchor_draws", "break_even":
    [{"method", "against", "k_max", axis: {"k", "holds", "projected"}}], "accuracy"}``,
    axes ``rollouts`` and ``wall_seconds``; ``accuracy`` is :func:`sweep_accuracy`'s.
    """
    methods: dict[str, dict[str, Any]] = {}
    keys: set[str] = set()
    for run in runs:
        if not run["records"]:
            continue
        preset = run["label"].split("+")[0]
        entry = methods.setdefault(preset, {"reads_anchors": False, "runs": []})
        entry["reads_anchors"] |= bool(run["reads_anchors"])
        report = presample_report(run.get("dir"))
        cost = run_cost(run["records"], setup_seconds(report))
        entry["runs"].append({"label": run["label"], "seed": run["seed"], **cost})
        if report.get("key"):
            keys.add(report["key"])
    for entry in methods.values():
        entry["cumulative"], entry["per_run"] = {}, {}
        for axis in AXES:
            total = cumulative([r[axis] for r in entry["runs"]])
            entry["cumulative"][axis] = total
            entry["per_run"][axis] = [c / k for k, c in enumerate(total, 1)]
    pairs = []
    for name, entry in methods.items():
        if not entry["reads_anchors"]:
            continue
        for other, theirs in methods.items():
            if theirs["reads_anchors"]:
                continue
            pair: dict[str, Any] = {"method": name, "against": other,
                                    "k_max": min(len(entry["runs"]), len(theirs["runs"]))}  # fmt: skip
            for axis in AXES:
                a = [r[axis] for r in entry["runs"]]
                b = [r[axis] for r in theirs["runs"]]
                k = break_even(a, b)
                pair[axis] = {"k": k, "holds": holds_from(a, b, k),
                              "projected": projected_break_even(a, b)}  # fmt: skip
            pairs.append(pair)
    return {"methods": methods, "anchor_draws": len(keys), "break_even": pairs,
            "accuracy": sweep_accuracy(runs, methods)}  # fmt: skip


def sweep_accuracy(
    runs: Sequence[Mapping[str, Any]], methods: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Each configuration's held-out accuracy per preset at its last evaluation, and each
    anchor-reading preset minus each other preset, two-level bootstraps
    (:func:`~anchor_rl.bench.summary.bootstrap_dict`; runs paired when both have the same
    seeds): ``{config: {"by_method": {preset: cell}, "diff": {"A - B": cell}}}``, a
    configuration the part of a label after ``+`` (``""`` without). Runs without per-prompt
    results are left out."""
    from anchor_rl.bench.summary import bootstrap_dict, prompt_accuracy

    finals: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] = {}
    for run in runs:
        pair = prompt_accuracy(run.get("evals") or [])
        if pair is None:
            continue
        preset, _, config = run["label"].partition("+")
        finals.setdefault(config, {}).setdefault(preset, []).append((run["seed"], pair[1]))
    out: dict[str, Any] = {}
    for config, by_preset in finals.items():
        ids = sorted(set.intersection(*(set(m) for rs in by_preset.values() for _, m in rs)))
        rows = {p: [[m[i] for i in ids] for _, m in rs] for p, rs in by_preset.items()}
        cells: dict[str, Any] = {"by_method": {p: bootstrap_dict(r) for p, r in rows.items()},
                                 "diff": {}}  # fmt: skip
        for a in rows:
            for b in rows:
                if methods.get(a, {}).get("reads_anchors") and not methods.get(b, {}).get(
                    "reads_anchors", True
                ):
                    same = [s for s, _ in by_preset[a]] == [s for s, _ in by_preset[b]]
                    cells["diff"][f"{a} - {b}"] = bootstrap_dict(rows[a], rows[b], paired_runs=same)
        out[config] = cells
    return out


def _k(value: int | None) -> str:
    return "none within K" if value is None else str(value)


def sweep_blocks(payload: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The sweep's summary as report blocks (``("p", text)``, ``("table", (header, rows))``;
    :func:`~anchor_rl.bench.budget.blocks_markdown` renders them)."""
    from anchor_rl.bench.summary import format_bootstrap

    methods = payload["methods"]
    readers = [m for m, e in methods.items() if e["reads_anchors"]]
    unmeasured = [r["label"] for e in methods.values() for r in e["runs"] if not r["measured"]]
    blocks: list[tuple[str, Any]] = [
        (
            "p",
            f"The runs of {', '.join(f'`{m}`' for m in readers) or 'no preset'} share one "
            f"anchor store and anchor seed; their anchors rest on {payload['anchor_draws']} "
            "distinct anchor key(s) (one where their reference and sampling settings agree). "
            "A run's own cost is the rollouts it sampled itself: rollouts/total with "
            "the anchor rollouts it read from the store taken out (pvpo/anchors_sampled); a "
            "model teacher's generations count in full. Its seconds are time/elapsed plus "
            "the presampling before its first step. k counts runs in the order they ran; "
            "per run = cumulative / k."
            + (
                f" No pvpo/anchors_sampled (anchors counted in full): {unmeasured}."
                if unmeasured
                else ""
            ),
        )  # fmt: skip
    ]
    header = ["k"]
    for m in methods:
        header += [f"`{m}` run", f"{m} own rollouts", f"{m} cumulative", f"{m} per run",
                   f"{m} cumulative s"]  # fmt: skip
    rows = []
    for k in range(max(len(e["runs"]) for e in methods.values()) if methods else 0):
        row = [str(k + 1)]
        for e in methods.values():
            if k < len(e["runs"]):
                r = e["runs"][k]
                row += [f"{r['label']} s{r['seed']}", f"{r['rollouts']:,.0f}",
                        f"{e['cumulative']['rollouts'][k]:,.0f}",
                        f"{e['per_run']['rollouts'][k]:,.0f}",
                        f"{e['cumulative']['wall_seconds'][k]:,.1f}"]  # fmt: skip
            else:
                row += ["–"] * 5
        rows.append(row)
    blocks.append(("table", (header, rows)))
    if payload["break_even"]:
        be_rows = []
        for pair in payload["break_even"]:
            cells = []
            for axis in AXES:
                c = pair[axis]
                holds = "" if c["k"] is None or c["holds"] else " (not held to K)"
                proj = "never" if c["projected"] is None else str(c["projected"])
                cells += [_k(c["k"]) + holds, proj]
            be_rows.append([f"`{pair['method']}` vs `{pair['against']}`", str(pair["k_max"]),
                            *cells])  # fmt: skip
        blocks.append(
            (
                "p",
                "Break-even k: the smallest k at which the first method's cumulative cost of "
                "its first k runs is at or below the second's, measured over the K runs both "
                "ran; projected: from the first run and the mean of the later ones.",
            )
        )
        head = ["sweep", "K", "break-even k (rollouts)", "projected (rollouts)",
                "break-even k (wall s)", "projected (wall s)"]  # fmt: skip
        blocks.append(("table", (head, be_rows)))
    accuracy = payload.get("accuracy") or {}
    if accuracy:
        presets = list(dict.fromkeys(p for c in accuracy.values() for p in c["by_method"]))
        diffs = list(dict.fromkeys(d for c in accuracy.values() for d in c["diff"]))
        head = ["configuration", *[f"`{p}` held-out" for p in presets], *diffs]
        acc_rows = []
        for config, c in accuracy.items():
            runs = [str(c["by_method"][p]["runs"]) for p in presets if p in c["by_method"]]
            cells = [format_bootstrap(c["by_method"].get(p), signed=False) for p in presets]
            cells += [format_bootstrap(c["diff"].get(d)) for d in diffs]
            acc_rows.append([f"{config or '(base)'} ({'/'.join(runs)} runs)", *cells])
        blocks.append(
            (
                "p",
                "Held-out accuracy at the last evaluation per configuration: mean [95% two-level "
                "bootstrap, runs then prompts; prompts only with one run].",
            )
        )
        blocks.append(("table", (head, acc_rows)))
    return blocks


def sweep_markdown(payload: Mapping[str, Any]) -> str:
    """The sweep's summary as a section of summary.md."""
    from anchor_rl.bench.budget import blocks_markdown

    return blocks_markdown(sweep_blocks(payload), "Sweep sharing one anchor store")
