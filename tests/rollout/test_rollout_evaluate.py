"""Evaluation metric math on hand numbers, and evaluate() on a scripted policy."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.evaluate import (
    accuracy_metrics,
    by_difficulty,
    evaluate,
    majority_correct,
    pass_at_k,
    pass_ks,
    trace_budget,
)
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 2, 1 - 21 / 45),
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (8, 1, 8, 1.0),
    ],
)
def test_pass_at_k_hand_numbers(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@given(n=st.integers(1, 30), data=st.data())
def test_pass_at_k_properties(n, data):
    c = data.draw(st.integers(0, n))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == (1.0 if c > 0 else 0.0)
    k = data.draw(st.integers(1, n))
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_accuracy_metrics_hand_example():
    m = accuracy_metrics([0, 2, 4], 4)
    assert pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]
    assert m["avg@4"] == pytest.approx(0.5)
    assert m["pass@1"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx((0 + 5 / 6 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert (m["acc=0"], m["0<acc<1"], m["acc=1"]) == pytest.approx((1 / 3, 1 / 3, 1 / 3))


class EchoTask(Task):
    """Answer the prompt's own text; the scripted policy gets some prompts wrong."""

    name = "echo"

    def records(self, split):
        return [Record(id=f"{split}-{w}", prompt=w, answer=w) for w in ("aa", "bb", "cc", "dd")]

    def reward(self, completion, record):
        return float(completion == f"<answer>{record.answer}</answer>")

    def trace(self, record):
        return f"<answer>{record.answer}</answer>"


def test_evaluate_on_scripted_policy(tokenizer, scripted):
    model = scripted(
        {
            "aa": "<answer>aa</answer>",
            "bb": "<answer>no</answer>",
            "cc": "<answer>cc</answer>",
            "dd": "xx",
        }
    )
    params = SamplingParams(max_new_tokens=12, stop=["</answer>"])
    engine = HFEngine(model, tokenizer)
    out = evaluate(engine, EchoTask(), "test", k=2, params=params, limit=3, chunk=4)
    assert out["prompts"] == 3 and out["samples"] == 6
    assert out["per_prompt"] == {"test-aa": 2, "test-bb": 0, "test-cc": 2}
    assert out["avg@2"] == pytest.approx(2 / 3) and out["pass@2"] == pytest.approx(2 / 3)
    assert (out["acc=0"], out["0<acc<1"], out["acc=1"]) == pytest.approx((1 / 3, 0, 2 / 3))
    assert out["mean_response_tokens"] == pytest.approx(
        len(tokenizer.encode("<answer>aa</answer>"))
    )
    assert out["mean_tool_calls"] == 0 and out["truncated"] == 0
    assert out["mean_reward"] == pytest.approx(2 / 3)
    assert out["maj@2"] == pytest.approx(2 / 3)  # both samples agree on every prompt
    assert out["by_difficulty"] == {}  # no record has a difficulty


@pytest.mark.parametrize(
    ("answers", "correct", "expected"),
    [
        (["7", "7", "8"], [True, True, False], True),
        (["8", "7", "7"], [False, True, True], True),  # the majority, not the first
        (["8", "8", "7"], [False, False, True], False),  # pass@3 would count it
        (["8", "7"], [False, True], False),  # a tie goes to the answer seen first
        ([" 7", "7 ", None], [True, True, False], True),  # stripped; no answer, no vote
        ([None, None], [False, False], False),
    ],
)
def test_majority_vote_by_hand(answers, correct, expected) -> None:
    texts = ["no answer" if a is None else f"<answer>{a}</answer>" for a in answers]
    assert majority_correct(texts, correct) is expected


def test_accuracy_by_difficulty_by_hand() -> None:
    records = [Record(f"r{i}", "q", "a", {"difficulty": d}) for i, d in enumerate([2, 1, 2])]
    records.append(Record("r3", "q", "a"))  # no difficulty: left out
    assert by_difficulty(records, [4, 1, 2, 0], 4) == {"1": 0.25, "2": 0.75}


def test_evaluate_is_seeded_per_sample_whatever_the_chunking(tokenizer, tiny_model):
    params = SamplingParams(max_new_tokens=6, stop=["</answer>"])
    engine = HFEngine(tiny_model, tokenizer)
    a = evaluate(engine, EchoTask(), "train", 2, params, seed=0)
    b = evaluate(engine, EchoTask(), "train", 2, params, seed=0, chunk=2)
    c = evaluate(engine, EchoTask(), "train", 2, params, seed=1)
    assert a == b
    assert a["mean_policy_tokens"] != c["mean_policy_tokens"] or a["per_prompt"] != c["per_prompt"]


def test_trace_budget_is_one_and_a_half_longest_trace_rounded_to_32(tokenizer):
    class Long(EchoTask):
        def trace(self, record):
            return "x" * (50 if record.answer == "bb" else 10)  # 50 tokens -> 75 -> 96

    task = Long()
    assert trace_budget(tokenizer, task, task.records("test")) == 96
    assert trace_budget(tokenizer, task, task.records("test")[:1]) == 32
