"""Metric sinks (JSONL, TensorBoard, W&B, MLflow) and the progress bar.

Every sink takes flat ``{name: float}`` dicts keyed by step. ``metrics.jsonl`` holds one
JSON object per line with ``step`` and the metrics; it is the source of truth the bench
reads. W&B and MLflow are imported only when asked for.
"""

from __future__ import annotations

import gzip
import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from anchor_rl.errors import AnchorRLError
from anchor_rl.progress import Progress, figure
from anchor_rl.trainer.config import LogConfig

METRICS_FILE = "metrics.jsonl"
EVALS_FILE = "evals.jsonl"
"""Per-prompt results of every evaluation: ``{"step": s, "test": {"k": k, "correct":
{record id: correct samples}}, "train": {...}}`` (paired comparisons over prompts)."""


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends ``{"step": s, **metrics}`` lines to RUN_DIR/metrics.jsonl (or RUN_DIR/``name``).

    On resume from step ``s`` the lines of steps after ``s`` (written after the checkpoint
    by the stopped run) are dropped first, so the file never holds a step twice.
    """

    def __init__(
        self, run_dir: Path, resume_step: int | None = None, name: str = METRICS_FILE
    ) -> None:
        self.path = Path(run_dir) / name
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None:
            self.path.write_text("")
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars in RUN_DIR/tb; on resume, events after the resumed step are purged."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(
        self, project: str, run_dir: Path, config: Mapping[str, Any], resume: bool
    ) -> None:
        wandb = _require("wandb", "log.wandb")
        self._run = wandb.init(
            project=project, dir=str(run_dir), name=Path(run_dir).name, config=dict(config),
            resume="allow" if resume else None,
        )  # fmt: skip

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, experiment: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        self._mlflow = _require("mlflow", "log.mlflow")
        self._mlflow.set_experiment(experiment)
        self._mlflow.start_run(run_name=Path(run_dir).name)
        self._mlflow.log_params(_flatten(config))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # MLflow metric names may not contain some characters; '/' is allowed.
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def open_sinks(
    cfg: LogConfig, run_dir: Path, config: Mapping[str, Any], resume_step: int | None = None
) -> list[Sink]:
    """The sinks ``cfg`` asks for; ImportError naming the extra if one is not installed."""
    sinks: list[Sink] = [JsonlSink(run_dir, resume_step)]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir, resume_step))
    if cfg.wandb:
        sinks.append(WandbSink(cfg.wandb_project, run_dir, config, resume_step is not None))
    if cfg.mlflow:
        sinks.append(MlflowSink(cfg.mlflow_experiment, run_dir, config))
    return sinks


def jsonl_path(path: Path) -> Path:
    """``path``, or ``path`` + ``.gz`` where only that exists: committed compact results
    (``scripts/compact_results.py``) store their JSON lines gzipped."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    return packed if not path.exists() and packed.is_file() else path


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file (a run directory or the file itself, gzipped or
    not); a torn last line (a process killed while writing it) is dropped with a warning."""
    path = Path(path)
    if path.is_dir():
        path = jsonl_path(path / METRICS_FILE)
    return read_jsonl(path)


def metrics_but_timings(run_dir: Path) -> list[dict[str, Any]]:
    """Every metric of every step of a run but its timings (``time/*`` and any ``*seconds*``
    key), NaN as the string ``"nan"`` so that two runs compare equal with ``==``: what an
    exact resume must reproduce."""
    return [
        {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()
         if not k.startswith("time/") and "seconds" not in k}
        for r in read_metrics(run_dir)
    ]  # fmt: skip


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The per-prompt evaluation records of a run (:data:`EVALS_FILE`, gzipped or not), oldest
    first; [] for a run that wrote none. A split packed by :func:`pack_counts` is unpacked."""
    path = jsonl_path(Path(run_dir) / EVALS_FILE)
    records = read_jsonl(path) if path.is_file() else []
    for record in records:
        for split, entry in record.items():
            if isinstance(entry, dict) and "counts" in entry:
                record[split] = unpack_counts(entry)
    return records


def pack_counts(entry: dict[str, Any]) -> dict[str, Any]:
    """An evaluation split's ``{"k", "correct": {id: count}}`` as ``{"k", "ids", "counts"}``
    when its ids are ``ids.format(i)`` for i = 0, 1, ... and every count is one digit (a
    thousand prompts in about a kilobyte); the entry unchanged otherwise (a packed one too)."""
    if "correct" not in entry:
        return entry
    correct = entry["correct"]
    ids = list(correct)
    stem = ids[0].rsplit("-", 1)[0] + "-{}" if ids else ""
    values = list(correct.values())
    if not ids or ids != [stem.format(i) for i in range(len(ids))] or max(values) > 9:
        return entry
    return {**{k: v for k, v in entry.items() if k != "correct"}, "ids": stem,
            "counts": "".join(str(int(v)) for v in values)}  # fmt: skip


def unpack_counts(entry: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`pack_counts`."""
    rest = {k: v for k, v in entry.items() if k not in ("ids", "counts")}
    ids = entry["ids"]
    return rest | {"correct": {ids.format(i): int(c) for i, c in enumerate(entry["counts"])}}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file a run appends to, one per line. Only the last line may be
    torn (a kill -9 mid-write): it is dropped with a warning; a bad line before it is an
    error naming the file and the line."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise AnchorRLError(f"{path}, line {number}, is not JSON: {exc}") from None
            warnings.warn(
                f"{path}: dropped a torn last line ({len(line)} characters; a process stopped "
                "while writing it)",
                stacklevel=2,
            )
    return records


class ProgressBar:
    """Training progress over steps with the latest key figures (:class:`anchor_rl.progress.Progress`:
    a bar on a terminal, a plain line every 30 s in a log file)."""

    FIGURES = {
        "reward/mean": "reward",
        "accuracy": "acc",
        "eval/accuracy": "eval",
        "response/length": "len",
        "kl/ref": "kl",
        "time/step": "s/step",
    }

    def __init__(self, total: int, start: int = 0, enabled: bool = True) -> None:
        self._progress = Progress("train", total, done=start, enabled=enabled)
        self._latest: dict[str, float] = {}

    def __enter__(self) -> ProgressBar:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        self._latest.update({k: v for k, v in metrics.items() if k in self.FIGURES})
        figures = " ".join(
            f"{self.FIGURES[k]} {figure(self._latest[k])}"
            for k in self.FIGURES
            if k in self._latest
        )
        self._progress.update(step, info=figures)


def _require(module: str, field: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{field}=true needs the {module!r} package: pip install 'anchor-rl[{module}]'"
        ) from e


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
