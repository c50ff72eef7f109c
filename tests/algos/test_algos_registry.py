"""The name registry the trainer and presets use."""

import pytest
import torch

from anchor_rl.algos import advantages as A
from anchor_rl.algos import losses, registry

F64 = torch.float64


def test_names():
    assert list(registry.ESTIMATORS) == [
        "grpo",
        "drgrpo",
        "rloo",
        "pvpo",
        "v05",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "astarpo",
        "perfect",
    ]
    token_level = {n for n, e in registry.ESTIMATORS.items() if e.token_level}
    assert token_level == {"reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert all(set(e.inputs) <= set(registry.INPUTS) for e in registry.ESTIMATORS.values())
    assert list(registry.POLICY_LOSSES) == ["ppo", "astarpo"]
    assert (
        registry.AGG_MODES
        == losses.AGG_MODES
        == (
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        )
    )
    assert registry.KL_KINDS == ("k1", "k2", "k3")


def test_get_advantage_unknown_name_lists_valid_names():
    assert registry.get_advantage("rloo") is A.rloo
    with pytest.raises(KeyError, match="registered: grpo, drgrpo, rloo, pvpo"):
        registry.get_advantage("ppo")


def test_compute_advantage_matches_direct_calls():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)
    index = torch.tensor([5, 5, 8, 8])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 1]], dtype=F64)
    token_rewards = A.outcome_to_token_rewards(rewards, mask)
    inputs = {
        "rewards": rewards,
        "index": index,
        "anchor": torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=F64),
        "baseline": torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=F64),
        "token_rewards": token_rewards,
        "mask": mask,
        "gamma": 1.0,
        "values": torch.zeros_like(mask),
        "lam": 1.0,
        "vstar": torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=F64),
        "ref_log_ratio": torch.tensor([2.0, -1.0, 0.0, 4.0], dtype=F64),
        "beta": 0.5,
        "policy_value": torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=F64),
    }
    expected = {
        "grpo": A.grpo(rewards, index),
        "drgrpo": torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=F64),
        "rloo": A.rloo(rewards, index),
        "pvpo": torch.tensor([0.5, -0.5, 0.75, 0.75], dtype=F64),
        "v05": torch.tensor([0.5, -0.5, 0.75, 0.75], dtype=F64),
        "reinforce_pp": A.reinforce_pp(token_rewards, mask),
        "reinforce_pp_baseline": A.reinforce_pp_baseline(rewards, index, mask),
        # zero values, lambda 1: GAE's advantages are the reward-to-go on every policy token
        "gae": rewards[:, None] * mask,
        # r - V* - beta * ref_log_ratio
        "astarpo": torch.tensor([-0.5, 0.0, 0.75, -1.25], dtype=F64),
        "perfect": torch.tensor([0.5, -0.5, 0.75, 0.75], dtype=F64),
    }
    for name, estimator in registry.ESTIMATORS.items():
        got = registry.compute_advantage(name, **inputs)
        torch.testing.assert_close(got, expected[name])
        assert got.dim() == (2 if estimator.token_level else 1)
    with pytest.raises(TypeError, match="anchor.*inputs supplied: rewards"):
        registry.compute_advantage("pvpo", rewards=rewards)


def test_a_registered_estimator_is_callable_by_name_and_names_are_unique():
    @registry.register_advantage("test_double_reward", inputs=("rewards",))
    def double(rewards):
        return 2 * rewards

    try:
        rewards = torch.tensor([1.0, 0.5])
        torch.testing.assert_close(
            registry.compute_advantage("test_double_reward", rewards=rewards, index=None),
            2 * rewards,
        )
        with pytest.raises(ValueError, match="already registered"):
            registry.register_advantage("grpo", inputs=("rewards",))(double)
        with pytest.raises(ValueError, match="distinct input names"):
            registry.register_advantage("bad", inputs=("reward", "reward"))
    finally:
        registry.ESTIMATORS.pop("test_double_reward")


def test_unknown_policy_loss_lists_the_registered_ones():
    assert registry.get_policy_loss("ppo") is losses.policy_loss
    with pytest.raises(KeyError, match="registered: ppo"):
        registry.get_policy_loss("gspo-typo")
