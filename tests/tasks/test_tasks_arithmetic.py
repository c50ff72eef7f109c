import random
import re

import pytest

from anchor_rl.tasks.arithmetic import (
    MAX_INT_DIGITS,
    ArithmeticTask,
    difficulty,
    exhausted_levels,
    make_expression,
    parse_int,
)
from anchor_rl.tasks.base import Record
from anchor_rl.tasks.countdown import evaluate

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
STEP = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")


def n_tokens(text: str) -> int:
    """Length under the built-in character tokenizer (each tag is one token)."""
    return len(text) - sum(text.count(t) * (len(t) - 1) for t in TAGS)


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask(n_train=600, n_test=100, seed=3)


def test_traces_are_correct_for_every_record(task):
    records = task.records("train") + task.records("test")
    assert len(records) == 700
    for r in records:
        value, _ = evaluate(r.prompt)  # precedence as Python's grammar has it
        assert value == int(r.answer) >= 0
        trace = task.trace(r)
        assert trace == f"<think>{' '.join(r.meta['steps'])}</think><answer>{r.answer}</answer>"
        for step in r.meta["steps"]:
            a, op, b, c = STEP.match(step).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
        assert int(STEP.match(r.meta["steps"][-1]).group(4)) == int(r.answer)
        assert len(r.meta["steps"]) == r.meta["operands"] - 1
        assert task.reward(trace, r) == 1.0
        assert n_tokens(r.prompt) + n_tokens(trace) <= 85


def test_levels_mix_and_difficulty(task):
    records = task.records("train")
    levels = {(r.meta["operands"], r.meta["digits"]) for r in records}
    assert levels == {(3, 1), (4, 1), (5, 1)}  # the calibrated default
    every = [(n, d) for n in (2, 3, 4, 5) for d in (1, 2, 3)]
    harder = ArithmeticTask(n_train=600, n_test=100, seed=3, levels=every).records("train")
    assert {(r.meta["operands"], r.meta["digits"]) for r in harder} == set(every)
    for r in records:
        assert r.meta["difficulty"] == (r.meta["operands"] - 1) * r.meta["digits"]
    assert difficulty((2, 1)) == 1 and difficulty((5, 3)) == 12


def test_products_come_first_in_the_trace():
    rng = random.Random(0)
    for _ in range(200):
        prompt, answer, meta = make_expression(rng, (5, 2), mul_prob=0.5)
        n_products = prompt.count("*")
        assert all("*" in s for s in meta["steps"][:n_products])
        assert not any("*" in s for s in meta["steps"][n_products:])
        assert "**" not in prompt


def test_splits_are_disjoint_seeded_and_deterministic(task):
    train, test = task.records("train"), task.records("test")
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert len({r.prompt for r in train}) == len(train)
    assert len({r.id for r in train + test}) == 700
    again = ArithmeticTask(n_train=600, n_test=100, seed=3)
    assert again.records("train") == train and again.records("test") == test
    other = ArithmeticTask(n_train=600, n_test=100, seed=4)
    assert other.records("train") != train
    # the test split does not depend on n_train
    assert ArithmeticTask(n_train=50, n_test=100, seed=3).records("test") == test


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<think>7*3=21 12+21=33 33-4=29</think><answer>29</answer>", 1.0),
        ("<answer> 29 </answer>", 1.0),
        ("\\boxed{29}", 1.0),
        ("<answer>30</answer>", 0.0),
        ("<answer>29.0</answer>", 0.0),
        ("<answer>twenty-nine</answer>", 0.0),
        ("29", 0.0),
    ],
)
def test_reward(completion, reward):
    record = Record("x", "12+7*3-4", "29", {})
    assert ArithmeticTask(n_train=1, n_test=1).reward(completion, record) == reward


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("29", 29),
        (" -3 ", -3),
        ("+4", 4),
        ("1,000", 1000),
        ("-12,345,678", -12345678),
        ("4,3", None),  # commas only as thousands separators: this was 43
        ("1,2345", None),
        ("12,34,567", None),
        ("0,123", None),  # a decimal comma, not 123
        (",29", None),
        ("29,", None),
        ("1,,000", None),
        ("1000,000", None),
        ("2.0", None),
        ("", None),
        (None, None),
        ("-", None),
        ("+-4", None),
        ("²", None),  # a digit to str.isdigit, but int() refuses it: it raised before
        ("٣", 3),  # a Unicode decimal digit, as int() reads it
        ("9" * MAX_INT_DIGITS, 10**MAX_INT_DIGITS - 1),
        ("-" + "9" * (MAX_INT_DIGITS + 1), None),  # over the cap: not converted
        ("9" * 5000, None),  # beyond Python's 4,300-digit conversion limit: it raised before
        ("0" * 5000 + "29", 29),  # leading zeros are not significant digits
    ],
)
def test_parse_int(text, value):
    assert parse_int(text) == value


def test_an_answer_of_5000_digits_scores_zero_without_a_failure():
    """It raised ValueError out of the reward (the int-string conversion limit)."""
    task = ArithmeticTask(n_train=1, n_test=1)
    record = Record("x", "12+7*3-4", "29", {})
    assert task.reward(f"<answer>{'9' * 5000}</answer>", record) == 0.0
    assert task.correct(f"\\boxed{{{'9' * 5000}}}", record) is False
    assert task.reward(f"<answer>{'0' * 5000}29</answer>", record) == 1.0
    assert task.verifier_stats() == {"failures": 0, "timeouts": 0}  # bounded, not just guarded


def test_rejects_bad_levels_and_impossible_counts():
    with pytest.raises(ValueError, match="outside operands"):
        ArithmeticTask(levels=[(6, 1)])
    with pytest.raises(ValueError, match="distinct prompts"):
        ArithmeticTask(n_train=5000, n_test=0, levels=[(2, 1)])
    with pytest.raises(ValueError, match="weights"):
        ArithmeticTask(levels=[(2, 1)], weights=[1, 2])


def test_an_exhausted_level_is_reported_and_the_others_fill_the_split(caplog) -> None:
    with caplog.at_level("WARNING", logger="anchor_rl.tasks.arithmetic"):
        task = ArithmeticTask(n_train=2000, n_test=100, levels=[(2, 1), (3, 2)], weights=[1, 1])
    counts = task.level_counts
    assert sum(counts.values()) == 2100 and counts[(2, 1)] < 500 < counts[(3, 2)]
    prompts = {r.prompt for r in task.records("train") + task.records("test")}
    assert len(prompts) == 2100  # still distinct
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"arithmetic level (2, 1) gave {counts[(2, 1)]} distinct prompts")
    assert "not the 1050 its weight asks for" in message
    assert exhausted_levels([(2, 1), (3, 2)], [1, 1], {(2, 1): 1000, (3, 2): 1100}) == []


def test_the_default_testbed_says_its_short_level_quietly(caplog) -> None:
    with caplog.at_level("INFO", logger="anchor_rl.tasks.arithmetic"):
        task = ArithmeticTask()  # 31,000 prompts: three one-digit operands run out near 3,700
    assert len(task.records("train")) == 30_000 and len(task.records("test")) == 1_000
    (record,) = caplog.records
    assert record.levelname == "INFO" and "level (3, 1) gave" in record.getMessage()
    assert task.level_counts[(3, 1)] < 4_000 < task.level_counts[(4, 1)]
