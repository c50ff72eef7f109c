"""What RewardedTask hands its reward functions (the rest is in tests/trainer/test_reward_set.py)."""

import json

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
