"""Built-in tasks run their verifiers under a guard: a raising or timed-out ``reward`` or
``correct`` is 0.0 / not solved, the run goes on, and ``verifier_stats`` counts it."""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from anchor_rl.tasks import ArithmeticTask, CountdownTask, FileTask, MultihopTask
from anchor_rl.tasks.base import GuardedTask, Record, Split, Task
from anchor_rl.tasks.reward_set import REWARD_FUNCTIONS, RewardedTask

SMALL_KB = {"n_people": 20, "n_cities": 8, "n_countries": 2, "n_companies": 8}


def broken(*args, **kwargs):
    raise RuntimeError("verifier crashed")


def built_in(name: str, tmp_path) -> GuardedTask:
    if name == "arithmetic":
        return ArithmeticTask(n_train=1, n_test=1)
    if name == "countdown":
        return CountdownTask(n_train=1, n_test=1)
    if name.startswith("multihop"):
        return MultihopTask(n_train=1, n_test=1, reward=name.split("-")[1], **SMALL_KB)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "42"}) + "\n")
    kind, reward = name.split("-")[1:]
    return FileTask(
        path, question="question", answer="answer", kind=kind, reward=reward, test_size=0
    )


# The functions each task's verifiers call first (reward, then correct), made to raise.
VERIFIER_CALLS = {
    "arithmetic": ["anchor_rl.tasks.arithmetic.extract_answer"],
    "countdown": ["anchor_rl.tasks.countdown.extract_answer"],
    "multihop-em": ["anchor_rl.tasks.multihop.extract_answer"],
    "multihop-pvpo": ["anchor_rl.rewards.pvpo.reward", "anchor_rl.tasks.multihop.extract_answer"],
    "file-math-em": ["anchor_rl.tasks.loaders.extract_answer"],
    "file-qa-f1": ["anchor_rl.tasks.loaders.extract_answer"],
    "file-qa-pvpo": ["anchor_rl.rewards.pvpo.reward", "anchor_rl.tasks.loaders.extract_answer"],
}


@pytest.mark.parametrize("name", list(VERIFIER_CALLS))
def test_a_raising_verifier_scores_zero_and_is_counted(name, tmp_path, monkeypatch, caplog):
    task = built_in(name, tmp_path)
    record = task.records("train")[0]
    trace = f"<answer>{record.answer}</answer>" if name.startswith("file") else task.trace(record)
    assert task.reward(trace, record) == 1.0 and task.correct(trace, record) is True
    assert task.verifier_stats() == {"failures": 0, "timeouts": 0}

    for target in VERIFIER_CALLS[name]:
        monkeypatch.setattr(target, broken)
    with caplog.at_level(logging.WARNING, logger="anchor_rl.rewards.safe"):
        assert task.reward(trace, record) == 0.0
        assert task.correct(trace, record) is False
        assert task.reward(trace, record) == 0.0
    assert task.verifier_stats() == {"failures": 3, "timeouts": 0}
    assert f"verifier {task.name}.reward failure #1" in caplog.text
    assert "RuntimeError: verifier crashed" in task.reward_guard.last_error


def test_a_verifier_timeout_is_counted_as_a_timeout(tmp_path, monkeypatch):
    def deadline(pred, gold):
        raise TimeoutError("math-verify took more than 5s")

    task = built_in("file-math-em", tmp_path)
    monkeypatch.setattr("anchor_rl.tasks.loaders.math_equal", deadline)
    record = task.records("train")[0]
    assert task.reward("\\boxed{42.0}", record) == 0.0
    assert task.correct("\\boxed{42.0}", record) is False
    assert task.verifier_stats() == {"failures": 0, "timeouts": 2}


def test_a_bad_record_is_a_counted_failure_not_a_crash():
    task = CountdownTask(n_train=1, n_test=1)
    no_numbers = Record("x", "Use 3 7 to make 10", "10", {})  # meta lacks "numbers"
    assert task.reward("<answer>3+7</answer>", no_numbers) == 0.0
    assert task.verifier_stats() == {"failures": 1, "timeouts": 0}
    assert "KeyError" in task.reward_guard.last_error


def test_rewarded_task_adds_its_functions_counts_to_the_tasks(monkeypatch):
    monkeypatch.setitem(REWARD_FUNCTIONS, "broken", broken)
    inner = ArithmeticTask(n_train=1, n_test=1)
    task = RewardedTask(inner, ["broken", "format"], task_weight=1.0)
    record = inner.records("train")[0]
    assert task.reward(f"<answer>{record.answer}</answer>", record) == 2.0  # task + format
    assert task.verifier_stats() == {"failures": 1, "timeouts": 0}
    monkeypatch.setattr("anchor_rl.tasks.arithmetic.extract_answer", broken)
    assert task.reward("<answer>1</answer>", record) == 1.0  # format only
    assert task.correct("<answer>1</answer>", record) is False
    assert inner.verifier_stats() == {"failures": 2, "timeouts": 0}
    assert task.verifier_stats() == {"failures": 4, "timeouts": 0}
    assert task.failures() == {"broken": 2, "format": 0}


def test_a_task_that_guards_nothing_reports_zeros():
    class Plain(Task):
        def records(self, split: Split) -> list[Record]:
            return [Record("a", "q", "1")]

        def reward(self, completion: str, record: Record) -> float:
            return 1.0

        def trace(self, record: Record) -> str:
            return "1"

    assert Plain().verifier_stats() == {"failures": 0, "timeouts": 0}


def test_guarded_tasks_still_pickle():
    task = ArithmeticTask(n_train=1, n_test=1)
    record = task.records("train")[0]
    task.reward("<answer>1</answer>", Record("r", "q", "not a number"))  # one failure
    copy = pickle.loads(pickle.dumps(task))
    assert copy.verifier_stats() == {"failures": 1, "timeouts": 0}
    assert copy.reward(task.trace(record), record) == 1.0
    assert copy.reward_guard.fn.__self__ is copy  # the guard scores the copy, not the original
