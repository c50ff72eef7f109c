"""The rollout budget: the stop rule, evaluations at fractions of it, exact resume, and the
combinations it refuses."""

from __future__ import annotations

import json

import pytest

from anchor_rl.trainer.budget import BudgetConfig, check_start, crossed, stop_reason
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_evals, read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

# grpo on the tiny settings: 2 prompts x 4 responses = 8 rollouts per step, no presampling
BUDGET = ["eval.every=0", "budget.rollouts=40", "budget.eval_fractions=[0.5, 1.0]", "steps=50"]


def test_budget_ends_the_run_and_evaluates_at_its_fractions(parity, tiny, tmp_path) -> None:
    run = train(start_run(load_config("grpo", [*tiny, *BUDGET]), tmp_path / "b"))
    records = read_metrics(run.run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]  # 5 x 8 = 40 reaches the budget
    assert [r["rollouts/total"] for r in records[1:]] == [8, 16, 24, 32, 40]
    # step 0, the first step past 20 (step 3: 24) and the end; eval.every=0 adds none
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3, 5]
    assert [r["step"] for r in read_evals(run.run_dir)] == [0, 3, 5]
    assert records[3]["budget/fraction"] == 0.5 and records[5]["budget/fraction"] == 1.0
    assert records[4]["budget/spent"] == pytest.approx(32 / 40)
    # the cost model's counts: grpo takes one update in a single pass (its forward gives the
    # policy's log-probs), so only the reference scores before it (kl.coef > 0); one epoch
    step = records[1]
    assert step["update/single_pass"] == 1 and step["tokens/scored"] == step["tokens/updated"]
    assert step["tokens/updated"] > step["tokens/step"] > 0
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["stop"] == "budget" and summary["budget_rollouts"] == 40


def test_steps_cap_a_budgeted_run_and_it_says_so(parity, tiny, tmp_path) -> None:
    overrides = [*tiny, *BUDGET, "steps=2"]
    run = train(start_run(load_config("grpo", overrides), tmp_path / "c"))
    assert [r["step"] for r in read_metrics(run.run_dir)] == [0, 1, 2]
    assert json.loads((run.run_dir / "summary.json").read_text())["stop"] == "steps"
    assert (
        "stopped by steps at step 2 with 16 of budget.rollouts=40"
        in (run.run_dir / "run.log").read_text()
    )


@pytest.mark.slow
def test_a_resumed_budget_run_matches_an_uninterrupted_one(parity, tiny, tmp_path) -> None:
    overrides = [*tiny, *BUDGET, "checkpoint.every=2", "optim.lr=1e-2"]
    straight = train(start_run(load_config("grpo", overrides), tmp_path / "straight"))
    half = train(start_run(load_config("grpo", [*overrides, "steps=2"]), tmp_path / "resumed"))
    resumed = train(resume_run(half.run_dir, {"steps": 50}))

    def values(run):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_metrics(run.run_dir)
        ]

    # the capped half evaluated at its end (step 2); otherwise the same lines and values
    a, b = values(straight), values(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5]
    assert [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in a] == [
        {k: v for k, v in r.items() if not k.startswith("eval/")} for r in b
    ]
    assert [r["step"] for r in a if "eval/accuracy" in r] == [0, 3, 5]
    assert [r["step"] for r in b if "eval/accuracy" in r] == [0, 2, 3, 5]


def test_budget_settings_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="eval_fractions is set without budget.rollouts"):
        load_config("grpo", ["budget.eval_fractions=[0.5]"])
    with pytest.raises(ConfigError, match="must increase"):
        load_config("grpo", ["budget.rollouts=10", "budget.eval_fractions=[0.5, 0.25]"])
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        load_config("grpo", ["budget.rollouts=10", "budget.eval_fractions=[1.5]"])
    with pytest.raises(ConfigError, match="budget.rollouts"):
        load_config("grpo", ["budget.rollouts=0"])
    budget = BudgetConfig(rollouts=100)
    with pytest.raises(ValueError, match="spent before the first step"):
        check_start(budget, 100.0, step=0)
    check_start(budget, 100.0, step=3)  # a resumed run at its budget just ends


def test_crossed_fractions_and_stop_reason() -> None:
    budget = BudgetConfig(rollouts=100)  # fractions 0.25, 0.5, 1.0
    assert crossed(budget, 0, 24) == []
    assert crossed(budget, 24, 60) == [0.25, 0.5]
    assert crossed(budget, 60, 100) == [1.0]
    assert crossed(BudgetConfig(), 0, 1e9) == []
    assert stop_reason(budget, 100, 3, 50, False) == "budget"
    assert stop_reason(budget, 99, 50, 50, False) == "steps"
    assert stop_reason(BudgetConfig(), 99, 3, 50, True) == "time_limit"
