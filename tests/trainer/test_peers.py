"""A*-PO, the perfect baseline and V0.5 with the perfect prior in the trainer."""

from __future__ import annotations

import pytest
import torch

from anchor_rl.algos.advantages import optimal_value_binary
from anchor_rl.anchors.store import AnchorStat
from anchor_rl.errors import AnchorRLError
from anchor_rl.trainer import perfect as perfect_mod
from anchor_rl.trainer.astar import vstar_of
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Keep the anchor store out of the user's cache."""
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))


def _stat(pid: str, rewards: list[float]) -> AnchorStat:
    return AnchorStat(pid, len(rewards), int(sum(rewards)), sum(rewards),
                      sum(r * r for r in rewards), 0.0, 0.0)  # fmt: skip


def test_vstar_from_the_store_statistics_and_non_binary_refused() -> None:
    stats = {"a": _stat("a", [1, 0, 0, 1]), "b": _stat("b", [0, 0, 0, 0])}
    got = vstar_of(stats, 0.5)
    assert got["a"] == pytest.approx(
        0.5 * torch.log(torch.tensor(0.5 + 0.5 * 2.718281828**2)).item(), rel=1e-6
    )
    assert got["a"] == pytest.approx(float(optimal_value_binary(torch.tensor(0.5), 0.5)))
    assert got["b"] == 0.0
    with pytest.raises(AnchorRLError, match=r"rewards in \{0, 1\}"):
        vstar_of({"c": _stat("c", [0.5, 0.5])}, 0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.policy_loss=ppo"], "set loss.policy_loss=astarpo"),
        (["kl.in_reward=true", "kl.coef=0.01"], "kl.in_reward=true with A"),
        (["kl.track=false"], "kl.track=false with A"),
        (["filter.kind=dynamic"], "filter.kind=dynamic with A"),
        (["loss.agg=token-mean"], "loss.agg=token-mean with A"),
        (["pvpo.refresh_every=5"], "pvpo.refresh_every with A"),
        (["pvpo.keep_unsolved=true"], "pvpo.keep_unsolved has no effect"),
        (["perfect.samples=4"], "perfect.samples has no effect"),
    ],
)
def test_astarpo_refuses_nonsense(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("astarpo", overrides)


def test_astarpo_loss_needs_its_estimator_and_perfect_knobs_need_their_method() -> None:
    with pytest.raises(ConfigError, match="set advantage.estimator=astarpo"):
        load_config("grpo", ["loss.policy_loss=astarpo"])
    with pytest.raises(ConfigError, match="astarpo.beta1 has no effect"):
        load_config("grpo", ["astarpo.beta1=0.3"])
    with pytest.raises(ConfigError, match="perfect.samples has no effect"):
        load_config("v05", ["perfect.samples=4"])
    assert load_config("v05", ["v05.prior=perfect", "perfect.samples=4"]).perfect.samples == 4
    with pytest.raises(ConfigError, match="filter.kind=dynamic with advantage.estimator=perfect"):
        load_config("perfect", ["filter.kind=dynamic"])


def test_astarpo_preset_two_steps(parity, tiny, tmp_path) -> None:
    cfg = load_config("astarpo", [*tiny, "rollout.n=1", "steps=2", "eval.every=0",
                                  f"pvpo.store={tmp_path / 'a.db'}", "pvpo.m=4"])  # fmt: skip
    run = train(start_run(cfg, tmp_path / "astar"))
    steps = read_metrics(run.run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    component = run.components["astarpo"]
    train_ids = {r.id for r in component.records}
    presampled = len(component.set.records)  # the walk's prompts, the training ones among them
    assert train_ids <= {r.id for r in component.set.records}
    assert steps[-1]["rollouts/presample"] == 4 * presampled == component.presample_rollouts
    assert steps[-1]["rollouts/total"] == steps[-1]["rollouts/presample"] + 2 * 2  # 2 x P=2 x n=1
    for r in steps:
        assert r["policy/regression_mse"] == pytest.approx(r["loss/policy"], rel=1e-5)
        assert 0 <= r["astarpo/vstar_mean"] <= 1
    # V* is the binary formula on each prompt's stored reference statistics
    for pid in train_ids:
        stat = component.set.stats[pid]
        assert component.vstar[pid] == pytest.approx(
            float(optimal_value_binary(torch.tensor(stat.mean), 0.5)), abs=1e-6
        )


def _spy(monkeypatch) -> list:
    """Record every (values, extra rewards, groups) policy_values returns."""
    seen = []
    real_score = perfect_mod.score

    def score(task, batch, records, cfg, *args):
        graded = real_score(task, batch, records, cfg, *args)
        seen.append((batch.group.clone(), graded.rewards.clone()))
        return graded

    monkeypatch.setattr(perfect_mod, "score", score)
    return seen


def test_perfect_baseline_is_the_mean_of_uncounted_samples(parity, tiny, tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
    cfg = load_config("perfect", [*tiny, "steps=2", "eval.every=0", "perfect.samples=6"])
    run = train(start_run(cfg, tmp_path / "perfect"))
    steps = read_metrics(run.run_dir)
    assert len(seen) == 2  # one batch of extra samples per step
    group, rewards = seen[-1]
    means = torch.zeros(2).index_add_(0, group, rewards) / 6
    assert torch.equal(torch.bincount(group), torch.tensor([6, 6]))
    assert run.components["perfect"].values.tolist() == pytest.approx(means.tolist())
    last = steps[-1]
    assert last["rollouts/uncounted"] == 2 * 2 * 6
    assert last["rollouts/total"] == last["rollouts/cumulative"] == 2 * 2 * 4  # not the extras
    assert last["perfect/value_mean"] == pytest.approx(means.mean().item(), abs=1e-6)


def test_perfect_advantage_subtracts_the_estimate(parity, tiny, tmp_path, monkeypatch) -> None:
    captured = {}
    real = perfect_mod.Perfect.advantage_inputs

    def spy(self, step):
        out = real(self, step)
        captured["value"] = out["policy_value"]
        captured["rewards"] = step.scored.rewards.clone()
        captured["step"] = step
        return out

    monkeypatch.setattr(perfect_mod.Perfect, "advantage_inputs", spy)
    cfg = load_config("perfect", [*tiny, "steps=1", "eval.every=0", "perfect.samples=3"])
    train(start_run(cfg, tmp_path / "p1"))
    step = captured["step"]
    expected = (captured["rewards"] - captured["value"]).unsqueeze(-1) * step.mask
    assert torch.allclose(step.advantages, expected)


def test_v05_with_the_perfect_prior_two_steps(parity, tiny, tmp_path, monkeypatch) -> None:
    seen = _spy(monkeypatch)
    cfg = load_config("v05_perfect", [*tiny, "steps=2", "eval.every=0", "perfect.samples=5"])
    run = train(start_run(cfg, tmp_path / "v05p"))
    steps = read_metrics(run.run_dir)
    assert len(seen) == 2
    group, rewards = seen[-1]
    means = torch.zeros(2).index_add_(0, group, rewards) / 5
    prior = run.components["v05"].prior
    assert isinstance(prior, perfect_mod.PerfectPrior)
    assert sorted(prior.values.values()) == pytest.approx(sorted(means.tolist()))
    last = steps[-1]
    assert last["v05/prior_mean"] == pytest.approx(means.mean().item(), abs=1e-6)
    assert last["rollouts/uncounted"] == 2 * 2 * 5
    assert "rollouts/presample" not in last  # the perfect prior presamples nothing
    assert last["rollouts/total"] == last["rollouts/cumulative"]
