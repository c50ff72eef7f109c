"""The equal-budget headline: one suite's methods read at shares of its common budget, written
into marked blocks of hand-written pages (the README's Results section, the results page).

``anchor-rl report ... --readme README.md --results-page docs/results.md`` computes, from the
committed raw results of the budgeted suite (``pvpo_budget`` by default: its runs'
``metrics.jsonl`` and per-prompt ``evals.jsonl``), every label's held-out accuracy at 25%,
50% and 100% of the suite's common budget of total rollouts and its area under the held-out
curve (:func:`~anchor_rl.bench.budget.compare_at_budget`), each mean [95% two-level
bootstrap: runs, then prompts], and each label minus a baseline label. Every label the raw
results hold gets a row, so a new cell appears when its runs are committed.

The README's block (between :data:`README_MARKERS`) is the short table: run, group size,
steps, total rollouts and the three readings. The results page's block (between
:data:`PAGE_MARKERS`) adds the area, the prompt-only interval of the full-budget reading and
the differences to the baseline. Text outside the markers is left alone; a file without
both markers is an error (the block is never appended, so a page cannot silently grow a
second table).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.bench.budget import compare_at_budget, curve_points, read_at
from anchor_rl.bench.results import Method, Results

README_MARKERS = ("<!-- results:start -->", "<!-- results:end -->")
"""The README's generated block (the short equal-budget table)."""
PAGE_MARKERS = ("<!-- equal-budget-table:start -->", "<!-- equal-budget-table:end -->")
"""The results page's generated block (the full equal-budget tables)."""
SUITE = "pvpo_budget"
"""The suite the headline reads by default."""
BASELINE = "grpo+n2"
"""The label the results page's differences are taken against by default (the suite's
strongest GRPO at equal rollouts); the suite's first label when it has no such label."""
INTERVAL = (
    "mean [95% two-level bootstrap: the runs (seeds) of each method resampled, then the "
    "held-out prompts; 10,000 resamples]"
)


def headline(results: Results, suite: str = SUITE, baseline: str = BASELINE) -> dict[str, Any]:
    """The suite's equal-budget comparison: ``{"suite", "budget", "baseline", "rows",
    "comparison"}``, ``rows`` one per label (in the suite's order) with ``label``, ``runs``,
    ``n`` (group size), ``steps`` and ``rollouts`` (each the mean over its runs, the last
    logged step and total rollouts) and ``step0`` (fraction -> True where every run was read
    at step 0, before any update); ``comparison`` is
    :func:`~anchor_rl.bench.budget.compare_at_budget` at the suite's common budget of total
    rollouts. Raises ValueError when the inputs hold no such suite or it has no budget."""
    from anchor_rl.trainer.logging import read_evals

    methods = [m for m in results.methods if m.suite == suite]
    if not methods:
        found = ", ".join(sorted({m.suite for m in results.methods})) or "none"
        raise ValueError(f"no results of suite {suite!r} among the inputs (suites found: {found})")
    if suite not in results.budgets:
        raise ValueError(f"suite {suite!r} was not run with a common budget (`budget` in its file)")
    budget = float(results.budgets[suite]["rollouts"])
    curves: dict[str, list[tuple[int, list]]] = {}
    for m in methods:
        for seed, records, run_dir in zip(m.seeds, m.records, m.run_dirs, strict=False):
            points = curve_points(records, read_evals(run_dir))
            if points:
                curves.setdefault(m.label, []).append((seed, points))
    if not curves:
        raise ValueError(f"suite {suite!r} has no per-prompt held-out results (evals.jsonl)")
    if baseline not in curves:
        baseline = next(iter(curves))
    comparison = compare_at_budget(curves, budget, baseline)
    rows = []
    for m in methods:
        if m.label not in curves:
            continue
        readings = comparison["labels"][m.label]["at"]
        rows.append(
            {
                "label": m.label,
                "runs": len(curves[m.label]),
                "n": _group_size(m),
                "steps": _mean(_last(r, "step") for r in m.records),
                "rollouts": _mean(_last(r, "rollouts/total") for r in m.records),
                "step0": {
                    f: cell is not None
                    and all(_read_step(p, f * budget) == 0 for _, p in curves[m.label])
                    for f, cell in readings.items()
                },
            }
        )
    return {"suite": suite, "budget": budget, "baseline": baseline, "rows": rows,
            "comparison": comparison}  # fmt: skip


def readme_block(data: Mapping[str, Any]) -> str:
    """The README's short table: held-out accuracy at 25%, 50% and 100% of the common budget."""
    budget, comparison = data["budget"], data["comparison"]
    fractions = comparison["fractions"]
    header = ["run", "N", "steps", "total rollouts",
              *(f"held out at {_share(f, budget)}" for f in fractions)]  # fmt: skip
    rows = []
    for row in data["rows"]:
        at = comparison["labels"][row["label"]]["at"]
        cells = [_reading(at[f], row["step0"][f], signed=False) for f in fractions]
        rows.append([f"`{row['label']}`", *_shape(row), *cells])
    intro = (
        f"Suite `{data['suite']}` at equal total rollouts (every rollout counted, presampling "
        f"included), generated by `anchor-rl report` from its committed raw results: held-out "
        f"accuracy at shares of the common budget of {budget:,.0f} rollouts, {INTERVAL}. A run "
        "is read at its first evaluation at or past each share; – where its runs end before it; "
        "*step 0* where presampling spent that share before the first update."
    )
    return intro + "\n\n" + _table(header, rows)


def page_block(data: Mapping[str, Any]) -> str:
    """The results page's tables: every reading and the area with two-level intervals (the
    full budget's prompt-only interval beside it), then each label minus the baseline."""
    budget, comparison, baseline = data["budget"], data["comparison"], data["baseline"]
    fractions = comparison["fractions"]
    shares = [_share(f, budget) for f in fractions]
    header = ["run", "N", "steps", "total rollouts", *shares, "area under the curve",
              f"{shares[-1]}, prompt-only"]  # fmt: skip
    rows, diffs = [], []
    for row in data["rows"]:
        label = row["label"]
        entry = comparison["labels"][label]
        cells = [_reading(entry["at"][f], row["step0"][f], signed=False) for f in fractions]
        full = entry["at"][fractions[-1]]
        prompt_only = _reading(full and full["prompt_only"], False, signed=False)
        rows.append([f"`{label}`", *_shape(row), *cells,
                     _reading(entry["area"], False, signed=False), prompt_only])  # fmt: skip
        if (vs := comparison["vs_baseline"].get(label)) is not None:
            diffs.append([f"`{label}`", *(_reading(vs["at"][f], False) for f in fractions),
                          _reading(vs["area"], False)])  # fmt: skip
    text = (
        f"Generated by `anchor-rl report` from the committed raw results of suite "
        f"`{data['suite']}`. Held-out accuracy at shares of the common budget of "
        f"{budget:,.0f} total rollouts and the area under the held-out curve (the mean "
        f"accuracy over [0, {budget:,.0f}]), {INTERVAL}; the last column resamples the "
        "prompts only (per prompt the mean over seeds). – where a run ends before the share; "
        "*step 0* where presampling spent that share before the first update.\n\n"
        + _table(header, rows)
    )
    if diffs:
        text += (
            f"\n\nEach run minus `{baseline}` on the same prompts, two-level 95% intervals "
            "(runs paired where both have the same seeds):\n\n"
            + _table([f"minus `{baseline}`", *shares, "area under the curve"], diffs)
        )
    return text


def replace_block(text: str, markers: tuple[str, str], block: str, name: str = "file") -> str:
    """``text`` with everything between the two ``markers`` replaced by ``block``; ValueError
    when either marker is missing, repeated or out of order (``name`` says which file)."""
    start, end = markers
    counts = (text.count(start), text.count(end))
    if counts != (1, 1) or text.index(end) < text.index(start):
        raise ValueError(
            f"{name} needs exactly one `{start}` followed by one `{end}` around the generated "
            f"block (found {counts[0]} and {counts[1]}); add them where the table goes"
        )
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n\n{block.strip()}\n\n{end}{tail}"


def check_blocks(readme: Path | None = None, results_page: Path | None = None) -> None:
    """Raise ValueError (FileNotFoundError for a missing file) unless each given file has its
    block's markers (:data:`README_MARKERS`, :data:`PAGE_MARKERS`)."""
    for path, markers in ((readme, README_MARKERS), (results_page, PAGE_MARKERS)):
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path} does not exist")
            replace_block(Path(path).read_text(), markers, "", str(path))


def write_blocks(
    results: Results,
    readme: Path | None = None,
    results_page: Path | None = None,
    suite: str = SUITE,
    baseline: str = BASELINE,
) -> list[Path]:
    """Rewrite the README's and the results page's blocks from ``results``; returns the
    files written. Both files are checked for their markers before either is written."""
    targets = [(p, m, f) for p, m, f in ((readme, README_MARKERS, readme_block),
               (results_page, PAGE_MARKERS, page_block)) if p is not None]  # fmt: skip
    if not targets:
        return []
    check_blocks(readme, results_page)  # fail before computing anything
    data = headline(results, suite, baseline)
    for path, markers, render in targets:  # read now: the page may have changed meanwhile
        text = Path(path).read_text()
        Path(path).write_text(replace_block(text, markers, render(data), str(path)))
    return [Path(p) for p, _, _ in targets]


def _group_size(m: Method) -> int | None:
    import json

    sizes = set()
    for run_dir in m.run_dirs:
        config = run_dir / "config.json"
        if config.is_file():
            sizes.add(json.loads(config.read_text()).get("rollout", {}).get("n"))
    return sizes.pop() if len(sizes) == 1 else None


def _shape(row: Mapping[str, Any]) -> list[str]:
    steps, rollouts = row["steps"], row["rollouts"]
    return [
        "–" if row["n"] is None else str(row["n"]),
        "–" if steps is None else f"{steps:,.0f}",
        "–" if rollouts is None else f"{rollouts:,.0f}",
    ]


def _share(f: float, budget: float) -> str:
    return f"{f:.0%} ({f * budget:,.0f})"


def _reading(cell: Mapping[str, Any] | None, step0: bool, signed: bool = True) -> str:
    from anchor_rl.bench.summary import format_bootstrap

    if cell is None:
        return "–"
    return format_bootstrap(cell, signed=signed) + (" *step 0*" if step0 else "")


def _read_step(points: Sequence[Any], x: float) -> int | None:
    point = read_at(points, x)
    return None if point is None else point.step


def _last(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return float(values[-1]) if values else None


def _mean(values: Any) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
