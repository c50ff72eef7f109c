"""A run names its own reward functions: weighted with the task's reward or replacing it,
guarded, in the anchor store's key; "correct" stays the task's verifier."""

from __future__ import annotations

import json

import pytest
import reward_fns

from anchor_rl.tasks.base import Record
from anchor_rl.tasks.reward_set import RewardedTask, resolve_reward_function, with_rewards
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run


def test_the_reward_is_the_weighted_sum_and_correct_stays_the_verifiers(parity) -> None:
    record = Record("r", "q", "even", meta={"level": 3})
    task = RewardedTask(parity, ["reward_fns:quarter", "format"], [2.0, 1.0], task_weight=0.5)
    reward_fns.CALLS.clear()
    # "0": parity reward 1, quarter 0.25, format 0 (no <answer> block)
    assert task.reward("0", record) == pytest.approx(0.5 * 1 + 2 * 0.25 + 0)
    assert task.reward("1<answer>x</answer>", record) == pytest.approx(0 + 0.5 + 1)
    assert reward_fns.CALLS[0] == {"answer": ["even"], "prompt_id": ["r"], "level": [3]}
    assert task.correct("0", record) and not task.correct("1<answer>x</answer>", record)
    assert task.records("train") == parity.records("train") and task.stop == parity.stop
    assert task.reward_spec() == {
        "functions": ["reward_fns:quarter", "format"], "weights": [2.0, 1.0], "task_weight": 0.5,
        "answer": "gold and aliases",  # what the functions' answer column holds, in the key
    }  # fmt: skip
    assert with_rewards(parity, [], None, 1.0) is parity and parity.reward_spec() is None


def test_none_and_failing_rewards_add_nothing_and_are_counted(parity) -> None:
    task = RewardedTask(parity, ["reward_fns:answer_length", "reward_fns:broken"], task_weight=0)
    assert task.reward("0", Record("a", "q", "abc")) == 3.0
    assert task.reward("0", Record("b", "q", "abcd")) == 0.0  # None: no verdict
    assert task.failures() == {"reward_fns:answer_length": 0, "reward_fns:broken": 2}


def test_bad_reward_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="reward.functions: unknown reward function 'nope'"):
        load_config("grpo", ['reward.functions=["nope"]'])
    with pytest.raises(ConfigError, match="reward.functions: .*reward_fns:missing"):
        load_config("grpo", ['reward.functions=["reward_fns:missing"]'])
    with pytest.raises(ConfigError, match="one weight per function"):
        load_config("grpo", ['reward.functions=["format"]', "reward.weights=[1, 2]"])
    with pytest.raises(ConfigError, match="leaves no reward"):
        load_config("grpo", ["reward.task_weight=0"])
    assert resolve_reward_function("math").__name__ == "math_reward"


@pytest.mark.slow
def test_a_run_trains_on_its_reward_functions(parity, tiny, tmp_path) -> None:
    cfg = load_config(
        "grpo", [*tiny, "steps=1", "eval.every=1", 'reward.functions=["reward_fns:quarter"]',
                 "reward.task_weight=0"],
    )  # fmt: skip
    run = train(start_run(cfg, tmp_path / "run"))
    step = read_metrics(run.run_dir)[1]
    assert step["reward/mean"] == 0.25 and step["eval/reward"] == 0.25  # the run's reward
    assert 0 < step["accuracy"] < 1  # the task's verifier: about half the parity answers
    assert step["advantage/zero_frac"] == 1.0  # equal rewards in every group


@pytest.mark.slow
def test_anchors_presampled_under_another_reward_are_not_reused(parity, tiny, tmp_path) -> None:
    store = f"pvpo.store={tmp_path / 'anchors.db'}"
    base = [*tiny, "steps=1", "eval.every=0", "pvpo.m=2", store, "filter.kind=none"]
    paper = "pvpo_paper"  # the paper's presampling: the walk is sampled by start_run
    plain = start_run(load_config(paper, base), tmp_path / "plain")
    shaped = start_run(
        load_config(paper, [*base, 'reward.functions=["reward_fns:quarter"]']), tmp_path / "shaped"
    )
    again = start_run(load_config(paper, base), tmp_path / "again")

    def sampled(run):
        return json.loads((run.run_dir / "pvpo.json").read_text())["presample"]

    assert sampled(plain)["rollouts_sampled_now"] == 16
    assert sampled(shaped)["rollouts_sampled_now"] == 16  # its own key: nothing reused
    assert sampled(again)["rollouts_sampled_now"] == 0
    keys = [json.loads((r.run_dir / "pvpo.json").read_text())["key"] for r in (plain, shaped)]
    assert keys[0] != keys[1]
    # the anchors are means of the run's reward: parity's 0/1 plus 0.25, over M = 2 rollouts
    means = {s.mean for s in shaped.components["pvpo"].anchors.values()}
    assert means <= {0.25, 0.75, 1.25} and {
        s.mean for s in plain.components["pvpo"].anchors.values()
    } <= {0.0, 0.5, 1.0}
