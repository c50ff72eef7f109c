"""What RewardedTask hands its reward functions (the rest is in tests/trainer/test_reward_set.py)."""

import json
from functools import partial

import pytest

from anchor_rl.tasks import get_task
from anchor_rl.tasks.base import Record
from anchor_rl.tasks.reward_set import RewardedTask


def test_reward_functions_see_the_aliases(tmp_path):
    """qa_em scored an alias 0 while the task scored it 1: only record.answer was passed."""
    path = tmp_path / "m.jsonl"
    row = {"id": "r0", "question": "Q", "answer": "United States", "answer_aliases": ["USA"]}
    path.write_text(json.dumps(row) + "\n")
    task = get_task("file", path=str(path), format="musique", test_size=0)
    [record] = task.records("train")
    rewarded = RewardedTask(task, ["qa_em"], task_weight=0)
    for completion, value in [
        ("<answer>USA</answer>", 1.0),
        ("<answer>united states</answer>", 1.0),
        ("<answer>Canada</answer>", 0.0),
    ]:
        assert task.reward(completion, record) == value
        assert rewarded.reward(completion, record) == value


def test_the_answer_column(monkeypatch):
    """A string without aliases (as before), the gold and its aliases as a list with them."""
    seen = []

    def spy(prompts, completions, answer=None, **columns):
        seen.append(answer)
        return [0.0]

    monkeypatch.setattr("anchor_rl.tasks.reward_set.REWARD_FUNCTIONS", {"spy": spy})
    task = get_task("arithmetic", n_train=5, n_test=5)
    rewarded = RewardedTask(task, ["spy"])
    plain = Record("a", "q", "Paris", {})
    empty = Record("b", "q", "Paris", {"aliases": []})
    aliased = Record("c", "q", "Paris", {"aliases": ["Paree"]})
    for record in (plain, empty, aliased):
        rewarded.reward("<answer>x</answer>", record)
    assert seen == [["Paris"], ["Paris"], [["Paris", "Paree"]]]


def half(prompts, completions, **columns):
    """A module-level reward function: 0.5 for every completion."""
    return [0.5] * len(completions)


def test_functions_themselves_go_by_their_module_function_name():
    """TRL's reward_funcs are callables: with_rewards takes them, keyed as if named."""
    from anchor_rl.rewards.functions import format_reward
    from anchor_rl.tasks.reward_set import with_rewards

    task = get_task("arithmetic", n_train=5, n_test=5)
    record = task.records("train")[0]
    rewarded = with_rewards(task, [half, format_reward], [0.5, 1.0], 1.0)
    named = with_rewards(task, [f"{half.__module__}:half", "format"], [0.5, 1.0], 1.0)
    assert rewarded.functions == named.functions == [f"{half.__module__}:half", "format"]
    assert rewarded.reward_spec() == named.reward_spec()  # the same anchors' key
    assert rewarded.reward("x", record) == task.reward("x", record) + 0.25
    for unnamed in (lambda prompts, completions, **_: [1.0] * len(completions), partial(half)):
        with pytest.raises(ValueError, match="no importable module:function names this one"):
            with_rewards(task, [unnamed], None, 1.0)
