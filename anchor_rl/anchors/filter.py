"""PVPO group sampling: choose training prompts from their reference accuracy.

Each prompt's reference accuracy (fraction of its M presampled rollouts judged correct)
puts it in one of three classes:

- accuracy 1: the reference always solves it, no learning signal: dropped ("solved");
- 0 < accuracy < 1: kept;
- accuracy 0: a teacher is asked for a correct trajectory; with one, the prompt is kept
  and the trajectory replaces one of its N rollouts during training; without one it is
  dropped ("unsolvable"), or kept without a trajectory when ``keep_unsolved=True``.

The classes use exact counts (``n_correct == 0`` / ``== n``), never float comparisons.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory
from anchor_rl.progress import Progress
from anchor_rl.tasks.base import Record

if TYPE_CHECKING:
    from anchor_rl.anchors.teachers import Teacher

PAPER_DISTRIBUTIONS: dict[str, tuple[float, float, float]] = {
    "MuSiQue (M=5)": (0.498, 0.426, 0.076),
    "DAPO-Math-17k (M=16)": (0.415, 0.579, 0.006),
}
"""PVPO appendix: fractions of training prompts with reference accuracy 0, in (0, 1), and 1."""

PAPER_FILTERED = "40-60%"
"""PVPO: share of the training data group sampling filters out."""


@dataclass(frozen=True)
class FilterStats:
    """Counts of one group-sampling pass (see :meth:`fractions` for shares of ``total``).

    acc_zero / acc_mixed / acc_one: prompts by reference accuracy (0, in (0, 1), 1).
    kept: 0 < acc < 1. with_teacher: acc 0 with a teacher trajectory. kept_unsolved: acc 0
    without one, kept because ``keep_unsolved``. dropped_solved: acc 1.
    dropped_unsolved: acc 0 without a trajectory, dropped.
    teacher_samples: samples the teacher drew in this pass (cached outcomes cost nothing).
    teacher_rollouts: the generations the teacher outcomes of the accuracy-0 prompts rest on,
        cached ones included (a trajectory's ``tries``, ``teacher.tries`` for a failure; 0
        for a teacher that generates nothing, such as the oracle): the cost to count.
    min_rollouts / max_rollouts: the range of M over the prompts' statistics.
    """

    total: int
    acc_zero: int
    acc_mixed: int
    acc_one: int
    kept: int
    with_teacher: int
    kept_unsolved: int
    dropped_solved: int
    dropped_unsolved: int
    teacher: str | None
    teacher_samples: int
    min_rollouts: int
    max_rollouts: int
    teacher_rollouts: int = 0

    @property
    def training(self) -> int:
        """Prompts left for training."""
        return self.kept + self.with_teacher + self.kept_unsolved

    def fractions(self) -> dict[str, float]:
        """Each count (and the training and dropped totals) as a share of ``total``."""
        names = (
            "acc_zero",
            "acc_mixed",
            "acc_one",
            "kept",
            "with_teacher",
            "kept_unsolved",
            "dropped_solved",
            "dropped_unsolved",
        )
        total = max(self.total, 1)
        out = {name: getattr(self, name) / total for name in names}
        out["training"] = self.training / total
        out["dropped"] = (self.dropped_solved + self.dropped_unsolved) / total
        return out

    def to_dict(self) -> dict[str, Any]:
        """Counts, fractions and the paper's reference figures, JSON-serialisable."""
        return {
            "counts": asdict(self),
            "fractions": self.fractions(),
            "paper": {
                "accuracy_distribution": {
                    name: {"acc_zero": a, "acc_mixed": b, "acc_one": c}
                    for name, (a, b, c) in PAPER_DISTRIBUTIONS.items()
                },
                "filtered": PAPER_FILTERED,
                "source": "PVPO, arXiv 2508.21104 (appendix)",
            },
        }

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def table(self) -> Table:
        """A rich table of counts and fractions beside the paper's distributions."""
        papers = list(PAPER_DISTRIBUTIONS)
        table = Table(title=f"group sampling ({self.total} prompts, M = {self._m()})")
        table.add_column("")
        table.add_column("count", justify="right")
        table.add_column("fraction", justify="right")
        for name in papers:
            table.add_column(f"paper {name}", justify="right")
        frac = self.fractions()
        for idx, (label, name) in enumerate(
            [
                ("ref. acc = 0", "acc_zero"),
                ("ref. 0 < acc < 1", "acc_mixed"),
                ("ref. acc = 1", "acc_one"),
            ]
        ):
            table.add_row(
                label,
                str(getattr(self, name)),
                f"{frac[name]:.1%}",
                *(f"{PAPER_DISTRIBUTIONS[p][idx]:.1%}" for p in papers),
            )
        table.add_section()
        teacher = f" ({self.teacher})" if self.teacher else ""
        rows = [
            ("kept: 0 < acc < 1", "kept"),
            (f"kept: teacher trajectory{teacher}", "with_teacher"),
            ("kept: unsolved, no trajectory", "kept_unsolved"),
            ("dropped: solved (acc = 1)", "dropped_solved"),
            ("dropped: unsolvable", "dropped_unsolved"),
        ]
        for label, name in rows:
            table.add_row(
                label, str(getattr(self, name)), f"{frac[name]:.1%}", *("" for _ in papers)
            )
        table.add_section()
        dropped = self.dropped_solved + self.dropped_unsolved
        table.add_row(
            "training set", str(self.training), f"{frac['training']:.1%}", *("" for _ in papers)
        )
        table.add_row(
            "filtered out",
            str(dropped),
            f"{frac['dropped']:.1%}",
            *(PAPER_FILTERED for _ in papers),
        )
        return table

    def _m(self) -> str:
        return (
            str(self.min_rollouts)
            if self.min_rollouts == self.max_rollouts
            else f"{self.min_rollouts}-{self.max_rollouts}"
        )


@dataclass
class FilterResult:
    """The outcome of :func:`group_filter`; every list keeps the input order.

    records: the training set (kept, with_teacher and kept_unsolved, in input order).
    trajectories: prompt id -> teacher trajectory, for the ``with_teacher`` prompts.
    """

    records: list[Record]
    kept: list[Record]
    with_teacher: list[Record]
    kept_unsolved: list[Record]
    dropped_solved: list[Record]
    dropped_unsolved: list[Record]
    trajectories: dict[str, TeacherTrajectory]
    stats: FilterStats

    def print(self, console: Console | None = None) -> None:
        """Print the statistics table."""
        (console or Console()).print(self.stats.table())


def _ask_teacher(
    teacher: Teacher,
    records: Sequence[Record],
    store: AnchorStore | None,
    key: AnchorKey | None,
    batch_size: int,
    progress: bool,
) -> tuple[dict[str, TeacherTrajectory | None], int]:
    """Teacher outcomes for ``records``: cached ones from the store, the rest asked in batches (each stored)."""
    outcomes = (
        store.get_outcomes(key, [r.id for r in records])
        if store is not None and key is not None
        else {}
    )
    todo = [r for r in records if r.id not in outcomes]
    samples = 0
    label = f"teacher ({teacher.name})"
    with Progress(label, len(todo), enabled=progress and bool(todo)) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            results = teacher.solve(batch)
            if len(results) != len(batch):
                raise ValueError(
                    f"teacher {teacher.name} returned {len(results)} outcomes for {len(batch)} prompts"
                )
            new = {}
            for record, traj in zip(batch, results, strict=True):
                if traj is not None and traj.prompt_id != record.id:
                    raise ValueError(
                        f"teacher {teacher.name} answered prompt {traj.prompt_id!r} for {record.id!r}"
                    )
                new[record.id] = traj
                samples += traj.tries if traj is not None else teacher.tries
            if store is not None and key is not None:
                store.put_trajectories(key, new, teacher=teacher.name, tries=teacher.tries)
            outcomes.update(new)
            bar.update(advance=len(batch))
    return outcomes, samples


def _teacher_rollouts(
    teacher: Teacher | None,
    asked: Sequence[Record],
    outcomes: Mapping[str, TeacherTrajectory | None],
) -> int:
    """Generations behind the teacher's outcomes on ``asked`` (see ``FilterStats.teacher_rollouts``)."""
    if teacher is None or not teacher.generates:
        return 0
    return sum(t.tries if (t := outcomes.get(r.id)) is not None else teacher.tries for r in asked)


def group_filter(
    records: Sequence[Record],
    stats: Mapping[str, AnchorStat],
    teacher: Teacher | None = None,
    store: AnchorStore | None = None,
    key: AnchorKey | None = None,
    keep_unsolved: bool = False,
    batch_size: int = 8,
    progress: bool = True,
) -> FilterResult:
    """PVPO group sampling of ``records`` from their reference statistics ``stats`` (id -> stat).

    teacher: asked for the accuracy-0 prompts (None: they are all unsolved).
    store, key: cache of teacher outcomes (``teacher_key(teacher, task_id)``); outcomes
        already stored are reused, new ones are stored per batch of ``batch_size``
        prompts, so an interrupted pass resumes. Both or neither.
    keep_unsolved: keep accuracy-0 prompts the teacher cannot solve (without a trajectory).
    """
    if (store is None) != (key is None):
        raise ValueError("pass both store and key (the teacher's cache) or neither")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    missing = [r.id for r in records if r.id not in stats]
    if missing:
        raise KeyError(
            f"{len(missing)} of {len(records)} prompts have no reference statistics (first: {missing[:5]}); run presample first"
        )
    zero = [r for r in records if stats[r.id].none_correct]
    outcomes: dict[str, TeacherTrajectory | None] = {}
    samples = 0
    if teacher is not None and zero:
        outcomes, samples = _ask_teacher(teacher, zero, store, key, batch_size, progress)
    groups: dict[str, list[Record]] = {
        k: []
        for k in ("kept", "with_teacher", "kept_unsolved", "dropped_solved", "dropped_unsolved")
    }
    training: list[Record] = []
    for r in records:
        s = stats[r.id]
        if s.all_correct:
            groups["dropped_solved"].append(r)
            continue
        if not s.none_correct:
            name = "kept"
        elif outcomes.get(r.id) is not None:
            name = "with_teacher"
        else:
            name = "kept_unsolved" if keep_unsolved else "dropped_unsolved"
        groups[name].append(r)
        if name != "dropped_unsolved":
            training.append(r)
    ns = [stats[r.id].n for r in records]
    filter_stats = FilterStats(
        total=len(records),
        acc_zero=len(zero),
        acc_mixed=len(groups["kept"]),
        acc_one=len(groups["dropped_solved"]),
        **{k: len(v) for k, v in groups.items()},
        teacher=teacher.name if teacher is not None else None,
        teacher_samples=samples,
        min_rollouts=min(ns, default=0),
        max_rollouts=max(ns, default=0),
        teacher_rollouts=_teacher_rollouts(teacher, zero, outcomes),
    )
    trajectories = {r.id: t for r in groups["with_teacher"] if (t := outcomes[r.id]) is not None}
    return FilterResult(
        records=training,
        trajectories=trajectories,
        stats=filter_stats,
        **groups,
    )
