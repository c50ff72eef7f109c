"""The `pvpo` bench suites and the time-to-accuracy figures of the bench summary."""

from __future__ import annotations

import pytest

from anchor_rl.bench.runner import load_suite, plan
from anchor_rl.bench.summary import markdown_table, run_figures, summarise, time_to_accuracy

RECORDS = [
    {"step": 0, "eval/accuracy": 0.2, "time/elapsed": 1.0, "rollouts/cumulative": 0.0,
     "rollouts/total": 100.0},
    {"step": 5, "reward/mean": 0.5, "time/elapsed": 10.0, "rollouts/cumulative": 40.0,
     "rollouts/total": 140.0, "tokens/cumulative": 9.0, "time/generate": 1.0, "time/score": 0.0,
     "time/update": 1.0},
    {"step": 10, "reward/mean": 0.5, "eval/accuracy": 0.3, "time/elapsed": 20.0,
     "rollouts/cumulative": 80.0, "rollouts/total": 180.0, "tokens/cumulative": 18.0,
     "time/generate": 1.0, "time/score": 0.0, "time/update": 1.0},
]  # fmt: skip


def test_time_to_accuracy_by_hand() -> None:
    assert time_to_accuracy(RECORDS, 0.25) == {
        "target_reached": 1.0,
        "target_wall_s": 20.0,
        "target_rollouts": 180.0,  # presampling included
    }
    assert time_to_accuracy(RECORDS, 0.2) == {
        "target_reached": 1.0,
        "target_wall_s": 1.0,
        "target_rollouts": 100.0,
    }
    assert time_to_accuracy(RECORDS, 0.5) == {"target_reached": 0.0}
    figures = run_figures(RECORDS, 0.25)
    assert figures["rollouts"] == 180.0 and figures["target_wall_s"] == 20.0
    assert "target_reached" not in run_figures(RECORDS)


def test_training_prompt_accuracy_figures_and_a_target_on_them() -> None:
    records = [dict(r) for r in RECORDS]
    records[0]["eval/train_accuracy"], records[2]["eval/train_accuracy"] = 0.5, 0.7
    figures = run_figures(records, 0.6, "eval/train_accuracy")
    assert figures["train_start"] == 0.5 and figures["train_final"] == 0.7
    assert figures["target_wall_s"] == 20.0 and figures["eval_final"] == 0.3
    assert "train_final" in markdown_table(
        "s", summarise([{"label": "a", "seed": 0, "figures": figures}])
    )
    assert "train_final" not in run_figures(RECORDS)


def test_target_columns_appear_only_for_a_suite_with_a_target() -> None:
    with_target = summarise([{"label": "a", "seed": 0, "figures": run_figures(RECORDS, 0.25)}])
    assert "target_wall_s" in markdown_table("s", with_target)
    without = summarise([{"label": "a", "seed": 0, "figures": run_figures(RECORDS)}])
    assert "target" not in markdown_table("s", without)


CORE = ("grpo+n8", "grpo+n2", "pvpo+n2", "pvpo+static_n2")


@pytest.mark.parametrize("name", ["pvpo", "pvpo_multihop"])
def test_pvpo_suites_plan_grpo_and_pvpo_at_equal_steps(name, tmp_path) -> None:
    suite = load_suite(name)
    specs = plan(suite, tmp_path)
    assert len(specs) == len(suite.runs) * len(suite.seeds) and len(suite.seeds) >= 3
    cells = {
        s.label: (s.config.advantage.estimator, s.config.filter.kind, s.config.rollout.n)
        for s in specs
    }
    assert {k: v for k, v in cells.items() if k in CORE} == {
        "grpo+n8": ("grpo", "none", 8),
        "grpo+n2": ("grpo", "none", 2),
        "pvpo+n2": ("pvpo", "group", 2),
        "pvpo+static_n2": ("pvpo", "none", 2),
    }
    # the other cells are PVPO N = 2 with group sampling and one setting changed
    assert all(v == ("pvpo", "group", 2) for k, v in cells.items() if k not in CORE)
    assert len({(s.config.steps, s.config.train_prompts, s.config.task) for s in specs}) == 1
    if name == "pvpo":  # equal settings but the method: one KL coefficient for every run
        assert {s.config.kl.coef for s in specs} == {0.001}
        modes = {(s.config.pvpo.refresh_every, s.config.pvpo.refresh_mode) for s in specs}
        assert {(50, "reference"), (50, "policy")} <= modes  # both refresh modes exercised
    assert suite.target_accuracy is not None
    # held out: >= 1,000 greedy prompts, or avg@k at T > 0 over >= 1,000 samples
    for s in specs:
        assert s.config.eval.prompts * s.config.eval.k >= 1000, s.label
        assert s.config.eval.k == 1 or s.config.eval.temperature > 0, s.label
    quick = plan(suite, tmp_path, seeds=[0], profile="quick")
    assert all(s.config.model == "random:tiny" and s.config.steps == 2 for s in quick)
