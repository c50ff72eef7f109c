"""Copy a finished bench suite into a compact tree that `anchor-rl report` still reads.

Usage: ``python scripts/compact_results.py SUITE_DIR DEST_DIR``

Keeps the suite's own result files (summaries, the probe's and the simulator's) and, per run, ``config.json``, ``summary.json``, PVPO's
``pvpo.json`` and ``pvpo_filter.json`` (the anchor key the amortised cost groups by), the
metrics every figure and curve of the report reads (the other per-step keys dropped, floats
to 6 significant digits) and the per-prompt held-out results of every evaluation (what the
paired table and the comparisons at equal budget read; packed, ``read_evals`` unpacks them), both
gzipped (``metrics.jsonl.gz``, ``evals.jsonl.gz``: a run's per-step lines repeat their keys
and shrink about six-fold; every reader of a run directory takes either form).
Training-prompt per-prompt results and checkpoints are left out. A suite of another shape
(``trl-pvpo``) keeps only its summary (``trl_pvpo.json`` holds every seed's figures);
machine paths become the copy's path or, for the anchor store, its file name.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from anchor_rl.trainer.logging import pack_counts

KEPT_PREFIXES = ("eval/", "budget/")
KEPT_KEYS = {
    "step", "reward/mean", "rollouts/cumulative", "rollouts/total", "rollouts/presample",
    "tokens/cumulative", "time/elapsed", "time/generate", "time/score", "time/update",
    "rollouts/step", "tokens/step", "tokens/scored", "tokens/updated", "time/sync",
    "advantage/std", "policy/entropy", "kl/ref", "v05/weight_zero_frac", "pvpo/teacher_logp",
}  # fmt: skip
SUITE_FILES = (
    "summary.json", "summary.md", "trl_pvpo.json", "trl_pvpo.md", "probe.json", "probe.md",
    "baseline_mse.json", "baseline_mse.md",
)  # fmt: skip
"""A suite's own result files, wherever they are in its tree (outside its runs)."""


def compact_metrics(path: Path) -> str:
    """The lines of a metrics.jsonl with only the keys the report reads."""
    lines = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            kept = {
                k: _short(v)
                for k, v in record.items()
                if k in KEPT_KEYS or k.startswith(KEPT_PREFIXES)
            }
            lines.append(json.dumps(kept, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def _short(value):
    """A float to 6 significant digits (what every table shows survives; the file halves)."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def compact_evals(path: Path) -> str:
    """Every evaluation of an evals.jsonl (the last line of each step: a resumed run rewrites
    later ones), held-out split only, the per-prompt counts packed (``read_evals`` unpacks
    them): the paired table reads the first and last, the comparisons at equal budget every
    one (anchor_rl.bench.budget)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ends = list({r["step"]: r for r in records}.values())
    return "".join(
        json.dumps({"step": r["step"], "test": pack_counts(r["test"])}, separators=(",", ":"))
        + "\n"
        for r in ends
    )


def write_gzip(path: Path, text: str) -> None:
    """``text`` gzipped to ``path``, byte for byte the same for the same text (no timestamp),
    so re-compacting an unchanged suite changes no committed file."""
    path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))


def compact_presample(path: Path) -> str:
    """A run's pvpo.json with the anchor store's machine path reduced to its file name."""
    summary = json.loads(path.read_text())
    summary["store"] = Path(summary["store"]).name
    return json.dumps(summary, indent=2) + "\n"


def copy_text(source: Path, dest: Path, root: Path, new_root: Path) -> None:
    """Copy a text file with the suite's own directory renamed to its copy's (no machine
    path in a committed file)."""
    dest.write_text(source.read_text().replace(str(root), str(new_root)))


def main(source: Path, dest: Path) -> None:
    source, dest = source.resolve(), dest.resolve()
    shown = Path(
        dest.relative_to(Path.cwd().resolve())
        if dest.is_relative_to(Path.cwd().resolve())
        else dest.name
    )
    dest.mkdir(parents=True, exist_ok=True)
    runs = {p.parent for p in source.rglob("metrics.jsonl")}  # runs of `anchor-rl train`
    for name in SUITE_FILES:
        for path in source.rglob(name):
            if path.parent not in runs:
                (dest / path.parent.relative_to(source)).mkdir(parents=True, exist_ok=True)
                copy_text(path, dest / path.relative_to(source), source, shown)
    for run in sorted(runs):
        out = dest / run.relative_to(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "summary.json", "pvpo_filter.json"):
            if (run / name).is_file():
                copy_text(run / name, out / name, source, shown)
        if (run / "pvpo.json").is_file():
            (out / "pvpo.json").write_text(compact_presample(run / "pvpo.json"))
        if (run / "metrics.jsonl").is_file():
            write_gzip(out / "metrics.jsonl.gz", compact_metrics(run / "metrics.jsonl"))
        if (run / "evals.jsonl").is_file():
            write_gzip(out / "evals.jsonl.gz", compact_evals(run / "evals.jsonl"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
