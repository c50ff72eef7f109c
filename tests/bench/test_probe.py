"""The baseline-MSE probe's arithmetic on hand numbers, its report, and the suite command."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from anchor_rl.bench.probe import method_table, prior_table, probe_markdown
from anchor_rl.bench.v05_probe import adaptive_counts, baseline_errors, probe_due, probe_records
from anchor_rl.cli import app
from anchor_rl.methods.v05_config import V05Config

# cost 0: any positive gain buys a rollout, so a rejected prior gets rollouts up to k_max
VC = V05Config(k_max=4, cost=0.0, top_up_rounds=1)
POOL = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
TRUTH = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])  # mu 0.75, 0.25
PRIOR = torch.tensor([0.5, 0.0])


def test_baseline_errors_by_hand() -> None:
    got = baseline_errors(POOL, TRUTH, PRIOR, torch.tensor([0.6, 0.1]), VC, k_init=2)
    # Var(mu_hat) = (unbiased var 0.25) / 4 = 0.0625 for both prompts
    expected = {
        "group_mean_k2": (0.0625, 2),  # means 1, 0: errors 0.25^2 each
        "loo_k2": (0.0625, 2),  # each sample's other sample: 1, 1 | 0, 0
        "group_mean_k4": (0.03125, 4),  # 0.75 exact, 0 off by 0.25
        "anchor": (0.0225, 0),  # off by 0.15 each
        "prior": (0.0625, 0),
        # k=2, s = 1/8: prompt 0 d^2 = 1/4 > s: w = 1/2, b = 0.75; prompt 1 d = 0: b = 0
        "v05_k2": (0.03125, 2),
        # prompt 0 rejected: 2 more (k_max 4): mean 0.75, d^2 = 1/16 = s: accepted, b = 0.5;
        # prompt 1 accepted at 2
        "v05_adaptive": (0.0625, 3),
    }
    assert list(got) == [
        "group_mean_k2", "loo_k2", "group_mean_k4", "anchor", "prior", "v05_k2", "v05_adaptive",
    ]  # fmt: skip
    for name, (raw, rollouts) in expected.items():
        assert got[name]["mse_raw"] == pytest.approx(raw), name
        assert got[name]["mse"] == pytest.approx(raw - 0.0625), name
        assert got[name]["rollouts"] == rollouts, name
    assert got["group_mean_k2"]["se"] == pytest.approx(0.0)
    assert "anchor" not in baseline_errors(POOL, TRUTH, PRIOR, None, VC, k_init=2)
    assert "loo_k1" not in baseline_errors(POOL, TRUTH, PRIOR, None, VC, k_init=1)


def test_adaptive_counts_follow_the_trainers_rounds() -> None:
    assert adaptive_counts(POOL, PRIOR, VC, 2).tolist() == [4, 2]
    assert adaptive_counts(POOL, PRIOR, VC.model_copy(update={"top_up_rounds": 0}), 2).tolist() == [
        2,
        2,
    ]


def test_probe_schedule_and_prompt_set() -> None:
    assert [s for s in range(1, 32) if probe_due(10, s)] == [1, 11, 21, 31]
    assert probe_records(list(range(10)), 4) == [0, 2, 5, 7]
    assert probe_records([1, 2], 4) == [1, 2]


def _record(step: int, mse: float, auc: float | None) -> dict:
    return {
        "step": step, "prompts": 2, "truth_rollouts": 4, "k_init": 2, "k_max": 4,
        "methods": {"group_mean_k2": {"mse": mse, "mse_raw": mse + 0.1, "se": 0.0, "rollouts": 2}},
        "prior_probe": {"auc": auc, "auc_rollout": None, "ece": 0.2, "mse": 0.1,
                        "pred_mean": 0.5, "true_mean": 0.4},
    }  # fmt: skip


def test_report_tables_average_over_probes() -> None:
    records = [_record(1, 0.1, 0.5), _record(11, 0.3, None)]
    table = method_table(records)["group_mean_k2"]
    assert table["mse"] == pytest.approx(0.2) and table["mse_raw"] == pytest.approx(0.3)
    assert table["probes"] == 2 and table["half_width"] == pytest.approx(
        12.7062 * 0.1, rel=1e-4
    )  # t(0.975, 1) s / sqrt 2
    priors = prior_table(records)["prior_probe"]
    assert priors["auc"] == 0.5 and priors["auc_rollout"] is None and priors["ece"] == 0.2
    md = probe_markdown({"v05+anchor": [records]})
    assert "| group_mean_k2 | 2.00 | 0.2000 ± 1.2706 | 0.3000 |" in md
    assert "| 11 | 0.3000 |" in md


@pytest.mark.slow
def test_bench_baseline_mse_quick(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))  # the anchor store
    result = CliRunner().invoke(
        app, ["bench", "baseline-mse", "--quick", "--seeds", "0", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    for name in ("summary.md", "summary.json", "probe.md", "probe.json", "probe_mse.png"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "simulator" / "baseline_mse.json").is_file()
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert set(probe) == {"v05+anchor", "v05+knn"}
    assert {"group_mean_k4", "v05_k4", "v05_adaptive"} <= set(probe["v05+anchor"]["methods"])
    assert "knn_heldout" in probe["v05+knn"]["priors"]
    assert "Baseline MSE inside training" in result.output


def test_v05_suite_plans_the_papers_comparison(tmp_path) -> None:
    from anchor_rl.bench.runner import Suite, load_suite, plan
    from anchor_rl.trainer.config import ConfigError

    suite = load_suite("v05")
    specs = plan(suite, tmp_path, seeds=[0])
    # every cell cheaper than DAPO k16 has a copy run to the common budget ("max": DAPO's)
    assert suite.budget == "max" and {s.label for s in specs if s.to_budget} == set(
        suite.to_budget
    ) == {"v05+k4_budget", "grpo+k4_budget", "grpo+k12_budget", "grpo+k16_budget"}
    by = {s.label: s.config.model_dump() for s in specs}
    for label in suite.to_budget:
        mine, same = dict(by[label]), dict(by[label.removesuffix("_budget")])
        for name in ("budget", "eval", "checkpoint"):  # the copies evaluate less often
            mine.pop(name), same.pop(name)
        assert mine == same and by[label]["budget"]["rollouts"] is not None, label
    specs = [s for s in specs if not s.to_budget]
    cells = [(s.label, s.config.advantage.estimator, s.config.rollout.n) for s in specs]
    assert cells == [
        ("v05+k4", "v05", 4), ("grpo+k4", "grpo", 4), ("grpo+k12", "grpo", 12),
        ("grpo+k16", "grpo", 16), ("dapo+k16", "grpo", 16),
    ]  # fmt: skip
    assert {s.config.steps for s in specs} == {50} and specs[0].config.rollout.budget == "adaptive"
    # each prompt drawn once: 50 steps x 8 prompts = the 400 training prompts
    assert {(s.config.train_prompts, s.config.rollout.prompts_per_step) for s in specs} == {
        (400, 8)
    }
    assert {s.config.kl.coef for s in specs if s.label.startswith(("v05", "grpo"))} == {0.04}
    with pytest.raises(ConfigError, match=r"runs \['grpo\+k8'\] are not among"):
        plan(Suite("s", "", ["grpo"], [0], variants={"k4": {}}, runs=["grpo+k8"]), tmp_path)
