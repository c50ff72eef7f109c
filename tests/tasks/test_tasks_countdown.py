from fractions import Fraction

import pytest

from anchor_rl.tasks.base import Record
from anchor_rl.tasks.countdown import CountdownTask, check, evaluate


@pytest.mark.parametrize(
    ("expr", "numbers", "target", "ok"),
    [
        ("(7+3)*9", [3, 7, 9], 90, True),
        ("9*(3+7)", [3, 7, 9], 90, True),  # another valid expression
        ("9 * (7 + 3)", [3, 7, 9], 90, True),
        ("7*9+3", [3, 7, 9], 66, True),
        ("9*7", [3, 7, 9], 63, True),  # a subset: each number at most once
        ("9*7+9", [3, 7, 9], 72, False),  # 9 used twice
        ("10*9", [3, 7, 9], 90, False),  # 10 is not given
        ("3*3+9", [3, 3, 9], 18, True),  # a repeated number may be used as often as given
        ("3/2*4", [2, 3, 4], 6, True),  # exact rational arithmetic
        ("(7+3)*9", [3, 7, 9], 91, False),
        ("9/(3-3)", [3, 3, 9], 0, False),  # division by zero: invalid, no exception
        ("-3+9", [3, 9], 6, False),  # no unary minus
        ("2**3", [2, 3], 8, False),
        ("3.0+3", [3, 3], 6, False),
        ("9 7", [7, 9], 16, False),
        ("9+7=16", [7, 9], 16, False),
        ("__import__('os').getpid()", [1], 1, False),
        ("(" * 300 + "1" + ")" * 300, [1], 1, False),
        ("3\x00+7", [3, 7], 10, False),  # NUL: ast.parse raises, the check says no
        ("3+7\ud800", [3, 7], 10, False),  # a lone surrogate: UnicodeEncodeError, no
        ("9" * 5000, [1], 1, False),  # over MAX_EXPRESSION_CHARS: never parsed
        ("", [1], 1, False),
    ],
)
def test_check(expr, numbers, target, ok):
    assert check(expr, numbers, target) is ok


def test_use_all_requires_every_number_once():
    assert check("9*7", [3, 7, 9], 63, use_all=True) is False
    assert check("9*7*3", [3, 7, 9], 189, use_all=True) is True


def test_evaluate():
    assert evaluate("(3+5)/2") == (Fraction(4), [3, 5, 2])
    assert evaluate("7/2") == (Fraction(7, 2), [7, 2])
    with pytest.raises(ValueError, match="division by zero"):
        evaluate("1/(2-2)")
    with pytest.raises(ValueError, match="Call is not allowed"):
        evaluate("abs(3)")


@pytest.fixture(scope="module")
def task():
    return CountdownTask(n_train=500, n_test=100, seed=1)


def test_traces_solve_their_puzzles(task):
    for r in task.records("train") + task.records("test"):
        numbers, target = r.meta["numbers"], r.meta["target"]
        assert r.prompt == f"Use {' '.join(map(str, numbers))} to make {target}"
        assert str(target) == r.answer and target not in numbers
        assert len(numbers) == r.meta["difficulty"] == len(r.meta["steps"]) + 1
        trace = task.trace(r)
        assert trace.endswith(f"<answer>{r.meta['solution']}</answer>")
        assert check(r.meta["solution"], numbers, target, use_all=True)
        assert task.reward(trace, r) == 1.0
        tag_chars = len("<think></think><answer></answer>")
        assert len(r.prompt) + len(trace) - tag_chars + 4 <= 100  # each tag is one token


def test_sizes_mix_splits_and_determinism(task):
    train, test = task.records("train"), task.records("test")
    assert {r.meta["difficulty"] for r in train} == {2, 3, 4}
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert CountdownTask(n_train=500, n_test=100, seed=1).records("train") == train
    assert CountdownTask(n_train=500, n_test=100, seed=2).records("train") != train


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<think>7+3=10 10*9=90</think><answer>(7+3)*9</answer>", 1.0),
        ("<answer>9*(7+3)</answer>", 1.0),
        ("<answer>9*7+3*9</answer>", 0.0),
        ("<answer>90</answer>", 0.0),
        ("(7+3)*9", 0.0),
    ],
)
def test_reward(completion, reward):
    record = Record("x", "Use 3 7 9 to make 90", "90", {"numbers": [3, 7, 9], "target": 90})
    assert CountdownTask(n_train=1, n_test=1).reward(completion, record) == reward


def test_use_all_task():
    task = CountdownTask(n_train=20, n_test=5, use_all=True)
    assert "exactly once" in task.instruction
    record = Record("x", "Use 3 7 9 to make 63", "63", {"numbers": [3, 7, 9], "target": 63})
    assert task.reward("<answer>9*7</answer>", record) == 0.0


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="sizes"):
        CountdownTask(sizes=[1])
