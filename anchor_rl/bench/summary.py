"""Per-run figures from metrics.jsonl, aggregated over seeds into mean and 95% t-interval,
and paired comparisons over held-out prompts from evals.jsonl.

Written as ``summary.json`` (every run's figures, every group's intervals, the paired
comparisons) and ``summary.md`` (one table row per preset/variant, then the paired table).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.bench.stats import (
    Interval,
    figure_cell,
    paired_bootstrap,
    t_interval,
    two_level_bootstrap,
)

FIGURES: dict[str, str] = {
    "eval_start": "held-out accuracy before training (step 0)",
    "eval_final": "held-out accuracy at the last evaluation",
    "eval_gain": "held-out accuracy gain over the reference: last evaluation minus step 0 (same prompts)",
    "eval_best": "best held-out accuracy over the evaluations",
    "train_start": "training-prompt accuracy before training (runs with eval.train_prompts)",
    "train_final": "training-prompt accuracy at the last evaluation",
    "reward_last": "mean training reward over the last fifth of the steps",
    "policy_rollouts": "the policy's responses (filtered ones and V0.5's top-ups included)",
    "rollouts": "per-run total: the policy's plus every rollout the method costs (PVPO's or V0.5's presampling, refreshes, a model teacher's generations, VAPO's value pretraining)",
    "amortised_rollouts": "`rollouts` with the presampling split over the suite's runs that share its anchors (the same reference, settings and anchor seed)",
    "tokens": "policy tokens generated",
    "scored_tokens": "prompt + response tokens through a log-prob pass before the update (the policy's re-scoring, the reference's), summed over the steps",
    "updated_tokens": "prompt + response tokens through the update (times its epochs), summed over the steps",
    "presample_rollouts": "reference rollouts the anchors rest on (PVPO, V0.5's anchor prior)",
    "wall_s": "wall-clock seconds, evaluation included",
    "generate_s": "mean seconds per step generating",
    "score_s": "mean seconds per step scoring",
    "update_s": "mean seconds per step in log-probs, advantage and update",
    "eval_fixed": "held-out accuracy at the last evaluation on the prompts the reference never solved at step 0 (its accuracy-0 class under the evaluation's k)",
    "eval_kept": "held-out accuracy at the last evaluation on the prompts the reference always solved at step 0 (its accuracy-1 class)",
    "v05_weight_nonzero": "V0.5: share of prompt-steps whose fusion weight on the empirical mean is non-zero (the prior was rejected; elsewhere the baseline is the prior alone)",
    "target_reached": "share of seeds whose accuracy (the suite's target_metric) reached its target_accuracy and stayed there",
    "target_wall_s": "wall-clock seconds to the evaluation from which accuracy stays at or above the target (seeds that reached it)",
    "target_rollouts": "rollouts (as `rollouts`) to that evaluation",
}
TRAIN = ("train_start", "train_final")
"""Figures of runs that evaluate training prompts; shown in the table only then."""
CLASSES = ("eval_fixed", "eval_kept")
"""Figures of runs with per-prompt held-out results (evals.jsonl); shown in the table then."""
V05 = ("v05_weight_nonzero",)
"""Figures of V0.5 runs; shown in the table only then."""
TARGET = ("target_reached", "target_wall_s", "target_rollouts")
"""Figures of a suite with ``target_accuracy``; shown in the table only then."""
TABLE = (
    "eval_start",
    "eval_final",
    "eval_gain",
    "reward_last",
    "policy_rollouts",
    "rollouts",
    "amortised_rollouts",
    "wall_s",
    "generate_s",
    "update_s",
)


def first_sustained(values: Sequence[float], target: float) -> int | None:
    """The first index from which every value is ``>= target`` to the end, or None.

    A target counts as reached only where the curve stays at or above it: a single noisy
    evaluation over the target followed by a drop is no hit (a speed-up claim built on it
    would be noise).
    """
    reached = None
    for i, v in enumerate(values):
        if v < target:
            reached = None
        elif reached is None:
            reached = i
    return reached


def time_to_accuracy(
    records: Sequence[Mapping[str, float]], target: float, metric: str = "eval/accuracy"
) -> dict[str, float]:
    """Wall time and rollouts at the evaluation from which ``metric`` stays >= ``target``
    (:func:`first_sustained`).

    ``{"target_reached": 1.0, "target_wall_s": ..., "target_rollouts": ...}``, or only
    ``{"target_reached": 0.0}`` when the run does not end at or above it.
    """
    evaluated = [r for r in records if metric in r]
    i = first_sustained([r[metric] for r in evaluated], target)
    if i is None:
        return {"target_reached": 0.0}
    r = evaluated[i]
    return {
        "target_reached": 1.0,
        "target_wall_s": r["time/elapsed"],
        "target_rollouts": r.get("rollouts/total", r["rollouts/cumulative"]),
    }


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
        "policy_rollouts": last["rollouts/cumulative"],
        "rollouts": last.get("rollouts/total", last["rollouts/cumulative"]),
        "tokens": last["tokens/cumulative"],
        "presample_rollouts": last.get("rollouts/presample", 0.0),
        "wall_s": last["time/elapsed"],
        "generate_s": _mean(r["time/generate"] for r in steps),
        "score_s": _mean(r["time/score"] for r in steps),
        "update_s": _mean(r["time/update"] for r in steps),
    }
    if evals:
        if evals[0]["step"] == 0:
            out["eval_start"] = evals[0]["eval/accuracy"]
        out["eval_final"] = evals[-1]["eval/accuracy"]
        if "eval_start" in out:
            out["eval_gain"] = out["eval_final"] - out["eval_start"]
        out["eval_best"] = max(r["eval/accuracy"] for r in evals)
    for key in ("scored", "updated"):  # the cost model's counts (anchor_rl.bench.costs)
        if any(f"tokens/{key}" in r for r in steps):
            out[f"{key}_tokens"] = sum(r.get(f"tokens/{key}", 0.0) for r in steps)
    fused = [r["v05/weight_zero_frac"] for r in steps if "v05/weight_zero_frac" in r]
    if fused:
        out["v05_weight_nonzero"] = 1.0 - _mean(fused)
    train = [r for r in records if "eval/train_accuracy" in r]
    if train:
        if train[0]["step"] == 0:
            out["train_start"] = train[0]["eval/train_accuracy"]
        out["train_final"] = train[-1]["eval/train_accuracy"]
    if target is not None:
        out |= time_to_accuracy(records, target, metric)
    return out


def amortise(runs: Sequence[dict[str, Any]]) -> None:
    """Add ``amortised_rollouts`` to each run's ``figures``: its ``rollouts`` with its
    ``presample_rollouts`` split evenly over the runs whose ``anchor_key`` is the same (runs
    without one keep their ``rollouts``). Refreshes and teachers are counted in full."""
    share: dict[str, int] = {}
    for run in runs:
        if run.get("anchor_key"):
            share[run["anchor_key"]] = share.get(run["anchor_key"], 0) + 1
    for run in runs:
        f = run["figures"]
        presampled = f.get("presample_rollouts", 0.0)
        k = share.get(run.get("anchor_key") or "", 1)
        f["amortised_rollouts"] = f["rollouts"] - presampled + presampled / k


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


def prompt_accuracy(
    evals: Sequence[Mapping[str, Any]], split: str = "test"
) -> tuple[dict[str, float], dict[str, float]] | None:
    """Per-prompt accuracy (correct / k) of a run at step 0 and at its last evaluation, from
    its ``evals.jsonl`` records; None without both (the last record per step counts)."""
    by_step = {e["step"]: e[split] for e in evals if split in e}
    if 0 not in by_step or len(by_step) < 2:
        return None

    def accuracy(entry: Mapping[str, Any]) -> dict[str, float]:
        return {pid: c / entry["k"] for pid, c in entry["correct"].items()}

    return accuracy(by_step[0]), accuracy(by_step[max(by_step)])


def class_accuracy(start: Mapping[str, float], final: Mapping[str, float]) -> dict[str, float]:
    """``eval_fixed`` / ``eval_kept``: the mean ``final`` accuracy over the prompts whose
    ``start`` accuracy is 0 / 1 (a class without prompts is left out)."""
    out = {}
    for name, value in (("eval_fixed", 0.0), ("eval_kept", 1.0)):
        ids = [p for p, acc in start.items() if acc == value and p in final]
        if ids:
            out[name] = sum(final[p] for p in ids) / len(ids)
    return out


def prompt_pairs(runs: Iterable[tuple[str, Path]]) -> dict[str, list[Any]]:
    """label -> the :func:`prompt_accuracy` pairs of that label's run directories, from
    ``(label, run_dir)`` pairs; runs without both evaluations and labels without any such
    run are left out. What :func:`paired` takes."""
    from anchor_rl.trainer.logging import read_evals

    out: dict[str, list[Any]] = {}
    for label, run_dir in runs:
        if (pair := prompt_accuracy(read_evals(run_dir))) is not None:
            out.setdefault(label, []).append(pair)
    return out


def paired(
    runs: Mapping[str, Sequence[tuple[dict[str, float], dict[str, float]]]],
    baseline: str | None = None,
    seeds: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Comparisons over held-out prompts with two-level bootstrap intervals (runs, then
    prompts: :func:`~anchor_rl.bench.stats.two_level_bootstrap`).

    ``runs``: label -> one ``(start, final)`` pair of per-prompt accuracies per run
    (:func:`prompt_accuracy`). For each label: ``accuracy``, its final held-out accuracy;
    ``gain``, final minus start per run and prompt; with a ``baseline`` label, for every
    other label ``vs_baseline``: its final accuracy minus the baseline's on the same prompts,
    the runs paired when ``seeds`` gives both labels the same seeds in the same order. Each
    is :func:`bootstrap_dict`: the two-level interval, and under ``prompt_only`` the
    percentile bootstrap over prompts of the per-prompt means over runs (blind to the runs'
    spread). Only prompts every run of both sides evaluated count.
    """
    seeds = seeds or {}
    out: dict[str, Any] = {"accuracy": {}, "gain": {}, "vs_baseline": {}, "baseline": baseline}
    for label, pairs in runs.items():
        if not pairs:
            continue
        ids = _common(pairs)
        gains = [[final[p] - start[p] for p in ids] for start, final in pairs]
        out["gain"][label] = bootstrap_dict(gains)
        out["accuracy"][label] = bootstrap_dict([[final[p] for p in ids] for _, final in pairs])
        if baseline in runs and label != baseline and runs[baseline]:
            ids = _common(pairs, *runs[baseline])
            ours = [[final[p] for p in ids] for _, final in pairs]
            theirs = [[final[p] for p in ids] for _, final in runs[baseline]]
            same = label in seeds and list(seeds[label]) == list(seeds.get(baseline, []))
            out["vs_baseline"][label] = bootstrap_dict(ours, theirs, paired_runs=same)
    return out


def _common(pairs, *more) -> list[str]:
    """The prompt ids every per-prompt map of ``pairs`` (and ``more``) holds."""
    maps = [m for pair in (*pairs, *more) for m in pair]
    return sorted(set.intersection(*(set(m) for m in maps)))


def bootstrap_dict(
    rows: Sequence[Sequence[float]],
    minus: Sequence[Sequence[float]] | None = None,
    paired_runs: bool = False,
) -> dict[str, Any]:
    """The two-level bootstrap of ``rows`` (runs x prompts; minus ``minus``, another method's
    runs on the same prompts) as ``{"mean", "low", "high", "prompts", "runs", "resamples",
    "interval": "two-level", "prompt_only": {...}}``; ``prompt_only`` resamples the prompts
    of the per-prompt means over runs (differences of means with ``minus``)."""
    import numpy as np

    b = two_level_bootstrap(rows, minus, paired_runs=paired_runs)
    per_prompt = np.asarray(rows, dtype=np.float64).mean(axis=0)
    if minus is not None:
        per_prompt = per_prompt - np.asarray(minus, dtype=np.float64).mean(axis=0)
    runs = len(rows) if minus is None else [len(rows), len(minus)]
    return {"mean": b.mean, "low": b.low, "high": b.high, "prompts": b.n, "runs": runs,
            "resamples": b.resamples, "interval": "two-level",
            "prompt_only": _bootstrap_dict(per_prompt.tolist())}  # fmt: skip


def _bootstrap_dict(diffs: Sequence[float]) -> dict[str, Any]:
    b = paired_bootstrap(diffs)
    return {"mean": b.mean, "low": b.low, "high": b.high, "prompts": b.n,
            "resamples": b.resamples}  # fmt: skip


def write_summary(
    out: Path,
    suite: str,
    runs: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    comparisons: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    extra_md: str = "",
) -> tuple[Path, Path]:
    """summary.json and summary.md in ``out`` (``comparisons``: :func:`paired`; ``extra``:
    more top-level keys of summary.json, ``extra_md``: a section appended to summary.md)."""
    out = Path(out)
    json_path, md_path = out / "summary.json", out / "summary.md"
    payload = {"suite": suite, "figures": FIGURES, "groups": list(groups), "runs": list(runs)}
    if comparisons is not None:
        payload["paired"] = dict(comparisons)
    payload |= dict(extra or {})
    json_path.write_text(json.dumps(payload, indent=2))
    text = markdown_table(suite, groups)
    if comparisons is not None and comparisons["gain"]:
        text += paired_table(comparisons)
    if extra_md:
        text += "\n" + extra_md
    md_path.write_text(text)
    return json_path, md_path


def paired_table(comparisons: Mapping[str, Any]) -> str:
    """The comparisons over held-out prompts as markdown: final accuracy, gain over the
    reference and difference to the baseline, each mean [95% two-level bootstrap interval],
    with the prompt-only interval of the difference as a secondary column."""
    baseline = comparisons.get("baseline")
    lines = [
        "## Over held-out prompts, two-level intervals",
        "",
        "Mean [95% percentile interval of a two-level bootstrap: runs (seeds) resampled within "
        "each method, then prompts; 10,000 resamples]. The last column resamples prompts only "
        "(per prompt the mean over seeds), blind to the spread between runs. The t intervals "
        "above are over seeds.",
        "",
        f"| run | runs | prompts | held-out (final) | gain over the reference | vs `{baseline}` "
        "(final accuracy) | vs baseline, prompt-only |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, gain in comparisons["gain"].items():
        vs = comparisons["vs_baseline"].get(label)
        accuracy = comparisons.get("accuracy", {}).get(label)
        cells = [
            format_bootstrap(accuracy, signed=False),
            format_bootstrap(gain),
            format_bootstrap(vs),
            format_bootstrap(None if vs is None else vs.get("prompt_only")),
        ]
        runs = gain.get("runs", "–")
        lines.append(f"| {label} | {runs} | {gain['prompts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_bootstrap(b: Mapping[str, Any] | None, signed: bool = True) -> str:
    """A bootstrap result as ``+0.012 [+0.005, +0.020]`` (``0.512 [0.490, 0.533]`` unsigned);
    ``–`` for None."""
    if b is None:
        return "–"
    f = "+.3f" if signed else ".3f"
    return f"{b['mean']:{f}} [{b['low']:{f}}, {b['high']:{f}}]"


def markdown_table(suite: str, groups: Sequence[Mapping[str, Any]]) -> str:
    """One row per group: mean ± 95% t-interval half-width over seeds."""
    lines = [
        f"# Suite `{suite}`",
        "",
        "Mean ± half-width of the 95% Student-t interval over seeds (no interval with one seed).",
        "",
    ]
    optional = (*CLASSES, *TRAIN, *V05, *TARGET)
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
                if key.endswith("rollouts") or key == "tokens"
                else 3
                if key.startswith(("eval", "reward", "train"))
                else 2
            )
            cells.append(figure_cell(f, digits))
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
