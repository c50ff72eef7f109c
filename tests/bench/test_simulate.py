"""baseline-mse simulator: analytic MSEs, V0.5 vs the group mean, determinism, the suite files."""

from __future__ import annotations

import json

import pytest
import torch

from anchor_rl.bench.mse import run_baseline_mse
from anchor_rl.bench.simulate import SimConfig, SimResult, prior_values, simulate

P = (0.0, 0.2, 0.5, 0.9, 1.0)


@pytest.fixture(scope="module")
def pm1() -> SimResult:
    return simulate(SimConfig(p_grid=P, biases=(0.0, 0.2), trials=40_000, k_grid=(1, 4, 16)))


def test_group_mean_and_loo_match_the_bernoulli_variance(pm1):
    p = torch.tensor(P, dtype=torch.float64)
    var = 4 * p * (1 - p)  # +-1 rewards: Var(r) = 4 p (1 - p)
    for k in (1, 4, 16):
        got = pm1.mse[f"group_mean_k{k}"][0]
        assert torch.allclose(got, var / k, rtol=0.05, atol=1e-12), (k, got)
        assert bool(((got - var / k).abs() <= 5 * pm1.se[f"group_mean_k{k}"][0] + 1e-12).all())
    for k in (4, 16):
        assert torch.allclose(pm1.mse[f"loo_k{k}"][0], var / (k - 1), rtol=0.05, atol=1e-12)


def test_oracle_anchor_and_rollout_counts(pm1):
    assert bool((pm1.mse["oracle"] == 0).all())
    # the static anchor is off by exactly the bias: (2 * 0.2)^2 for +-1 rewards
    assert torch.allclose(pm1.mse["anchor"][1], torch.full((5,), 0.16, dtype=torch.float64))
    assert bool((pm1.mse["anchor"][0] == 0).all())
    assert bool((pm1.rollouts["group_mean_k4"] == 4).all())
    ada = pm1.rollouts["v05_adaptive"]
    assert bool(((ada >= 4) & (ada <= 16)).all())
    assert bool((ada[1].mean() > ada[0].mean()).item())  # a biased prior buys more rollouts


def test_v05_with_an_unbiased_prior_beats_the_group_mean_at_k4(pm1):
    v05, mean = pm1.mse["v05_k4"][0], pm1.mse["group_mean_k4"][0]
    interior = slice(1, 4)  # p = 0 and 1 have zero variance: both estimators exact
    assert bool((v05[interior] < 0.5 * mean[interior]).all())
    assert bool((v05 <= mean).all())


def test_binary_rewards_scale_the_mse_by_a_quarter():
    kw = {"p_grid": (0.1, 0.5, 0.7), "biases": (0.0, 0.1), "trials": 3_000, "k_grid": (4,)}
    a = simulate(SimConfig(reward_form="pm1", **kw))
    b = simulate(SimConfig(reward_form="binary", **kw))
    assert b.config.scaled_cost == pytest.approx(0.0039 / 4)
    for name in a.mse:  # same draws, cost and sigma^2 scaled with the range: same decisions
        assert torch.allclose(b.mse[name], a.mse[name] / 4, rtol=1e-9, atol=1e-15), name
        assert torch.equal(b.rollouts[name], a.rollouts[name])


def test_seeded_determinism():
    kw = {"p_grid": (0.3, 0.6), "biases": (0.1,), "trials": 500, "sigma2": "prior"}
    a, b = simulate(SimConfig(seed=3, **kw)), simulate(SimConfig(seed=3, **kw))
    c = simulate(SimConfig(seed=4, **kw))
    assert all(torch.equal(a.mse[n], b.mse[n]) for n in a.mse)
    assert not torch.equal(a.mse["group_mean_k4"], c.mse["group_mean_k4"])


def test_prior_values_keep_the_bias_inside_the_range():
    got = prior_values(torch.tensor([0.0, 0.05, 0.5, 1.0]), 0.1)
    assert torch.allclose(got, torch.tensor([0.1, 0.15, 0.4, 0.9]))


def test_config_validation():
    with pytest.raises(ValueError, match="reward_form"):
        SimConfig(reward_form="pm2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="biases"):
        SimConfig(biases=(0.6,))
    with pytest.raises(ValueError, match="k_grid"):
        SimConfig(k_grid=(32,))


def test_run_baseline_mse_quick_writes_json_markdown_and_plots(tmp_path):
    out = run_baseline_mse(tmp_path, seed=1, quick=True, show_progress=False)
    assert out["suite"] == "baseline-mse" and out["quick"]
    assert {p.name for p in tmp_path.iterdir()} == {
        "baseline_mse.json",
        "baseline_mse.md",
        "mse_vs_p_pm1_worst.png",
        "mse_vs_rollouts_pm1_worst.png",
    }
    data = json.loads((tmp_path / "baseline_mse.json").read_text())
    assert set(data["configs"]) == {"pm1_worst", "pm1_prior", "binary_worst", "binary_prior"}
    block = data["configs"]["binary_prior"]
    assert len(block["methods"]["v05_k4"]["mse"]) == 4  # biases
    assert len(block["methods"]["v05_k4"]["mse"][0]) == 11  # p grid
    assert out["summary"]["pm1_worst"]["oracle"]["mse_mean"] == [0.0] * 4
    md = (tmp_path / "baseline_mse.md").read_text()
    assert md.count("| v05_adaptive |") == 4
