"""group_filter: classification on hand-made statistics, teacher caching, statistics output."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from anchor_rl.anchors.filter import PAPER_DISTRIBUTIONS, group_filter
from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory
from anchor_rl.tasks.base import Record

KEY = AnchorKey(model="teacher", tokenizer="tok", task="echo", tag="teacher/fake")

# prompt id -> (n, n_correct): accuracies 1, 1/2, 0, 0, 1/4, 1, 0, 7/8
HAND = {
    "a": (4, 4),
    "b": (4, 2),
    "c": (4, 0),
    "d": (4, 0),
    "e": (4, 1),
    "f": (8, 8),
    "g": (8, 0),
    "h": (8, 7),
}


def stats() -> dict[str, AnchorStat]:
    return {
        pid: AnchorStat(pid, n, c, float(c), float(c), 0.0, 0.0) for pid, (n, c) in HAND.items()
    }


def recs() -> list[Record]:
    return [Record(id=pid, prompt=f"q {pid}", answer="") for pid in HAND]


class FakeTeacher:
    """Solves the prompts in ``solvable`` (at try 2), fails the rest; counts the prompts it is asked."""

    name = "fake"
    fingerprint = "fake-teacher"
    settings: dict = {}
    tries = 3
    generates = True
    policy_tokenizer = None

    def __init__(self, solvable: set[str]) -> None:
        self.solvable, self.asked = solvable, []

    def solve(self, records):
        self.asked += [r.id for r in records]
        return [
            TeacherTrajectory(
                r.id,
                torch.tensor([7, 8]),
                torch.tensor([-0.5, -0.1]),
                torch.ones(2),
                "<answer>x</answer>",
                1.0,
                "fake",
                tries=2,
            )
            if r.id in self.solvable
            else None
            for r in records
        ]


def ids(rs) -> list[str]:
    return [r.id for r in rs]


def test_classification_on_hand_stats():
    teacher = FakeTeacher({"d"})
    res = group_filter(recs(), stats(), teacher=teacher, progress=False)
    assert teacher.asked == ["c", "d", "g"]  # only accuracy-0 prompts go to the teacher
    assert ids(res.kept) == ["b", "e", "h"]
    assert ids(res.with_teacher) == ["d"]
    assert ids(res.dropped_solved) == ["a", "f"]
    assert ids(res.dropped_unsolved) == ["c", "g"]
    assert res.kept_unsolved == []
    assert ids(res.records) == ["b", "d", "e", "h"]  # training set in input order
    assert set(res.trajectories) == {"d"} and res.trajectories["d"].tries == 2
    s = res.stats
    assert (s.total, s.acc_zero, s.acc_mixed, s.acc_one) == (8, 3, 3, 2)
    assert (s.kept, s.with_teacher, s.dropped_solved, s.dropped_unsolved, s.training) == (
        3,
        1,
        2,
        2,
        4,
    )
    assert s.teacher_samples == 2 + 3 + 3  # d solved at try 2, c and g failed all 3
    assert s.teacher_rollouts == s.teacher_samples  # nothing was cached
    assert (s.min_rollouts, s.max_rollouts) == (4, 8)
    f = s.fractions()
    assert (f["acc_zero"], f["acc_mixed"], f["acc_one"]) == (3 / 8, 3 / 8, 2 / 8)
    assert (f["training"], f["dropped"], f["with_teacher"]) == (0.5, 0.5, 1 / 8)


def test_keep_unsolved_and_no_teacher():
    res = group_filter(recs(), stats(), keep_unsolved=True, progress=False)
    assert (
        ids(res.kept_unsolved) == ["c", "d", "g"]
        and res.with_teacher == []
        and res.dropped_unsolved == []
    )
    assert ids(res.records) == ["b", "c", "d", "e", "g", "h"]
    assert res.stats.teacher is None and res.stats.teacher_samples == 0
    assert res.stats.teacher_rollouts == 0
    res = group_filter(recs(), stats(), progress=False)
    assert ids(res.dropped_unsolved) == ["c", "d", "g"] and ids(res.records) == ["b", "e", "h"]


def test_teacher_outcomes_are_cached_in_the_store(tmp_path):
    with AnchorStore(tmp_path / "a.db") as store:
        first = FakeTeacher({"c"})
        res1 = group_filter(
            recs(), stats(), teacher=first, store=store, key=KEY, batch_size=2, progress=False
        )
        assert first.asked == ["c", "d", "g"]
        second = FakeTeacher(set())  # would fail everything, but is never asked
        res2 = group_filter(recs(), stats(), teacher=second, store=store, key=KEY, progress=False)
        assert second.asked == [] and res2.stats.teacher_samples == 0
        # the cost the cached outcomes rest on: c solved at try 2, d and g failed 3 times
        assert res2.stats.teacher_rollouts == res1.stats.teacher_rollouts == 2 + 3 + 3
        assert ids(res2.with_teacher) == ids(res1.with_teacher) == ["c"]
        assert ids(res2.dropped_unsolved) == ["d", "g"]  # failures are remembered too
        assert torch.equal(res2.trajectories["c"].logprobs, torch.tensor([-0.5, -0.1]))
        assert store.get_outcomes(KEY, ["d"]) == {"d": None}


def test_bad_inputs():
    with pytest.raises(KeyError, match="run presample first"):
        group_filter([*recs(), Record("zz", "q", "")], stats(), progress=False)
    with pytest.raises(ValueError, match="both store and key"):
        group_filter(recs(), stats(), teacher=FakeTeacher(set()), key=KEY, progress=False)

    class Liar(FakeTeacher):
        def solve(self, records):
            return super().solve(records)[:-1]

    with pytest.raises(ValueError, match="returned 2 outcomes for 3"):
        group_filter(recs(), stats(), teacher=Liar(set()), progress=False)


def test_statistics_json_and_table(tmp_path):
    res = group_filter(recs(), stats(), teacher=FakeTeacher({"d"}), progress=False)
    path = res.stats.save(tmp_path / "out" / "filter.json")
    data = json.loads(path.read_text())
    assert data["counts"]["with_teacher"] == 1 and data["fractions"]["acc_one"] == 0.25
    assert data["paper"]["accuracy_distribution"]["MuSiQue (M=5)"]["acc_zero"] == 0.498
    assert PAPER_DISTRIBUTIONS["DAPO-Math-17k (M=16)"] == (0.415, 0.579, 0.006)
    console = Console(record=True, width=200)
    res.print(console)
    text = console.export_text()
    for needle in (
        "49.8%",
        "42.6%",
        "7.6%",
        "41.5%",
        "57.9%",
        "0.6%",
        "37.5%",
        "40-60%",
        "M = 4-8",
        "(fake)",
    ):
        assert needle in text, needle


def test_a_teacher_that_generates_nothing_costs_no_rollouts():
    class Writer(FakeTeacher):
        generates = False  # like the oracle: writes a known solution

    res = group_filter(recs(), stats(), teacher=Writer({"c", "d"}), progress=False)
    assert ids(res.with_teacher) == ["c", "d"]
    assert res.stats.teacher_samples == 2 + 2 + 3 and res.stats.teacher_rollouts == 0
