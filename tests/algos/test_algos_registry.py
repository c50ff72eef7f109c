"""The name registry the trainer and presets use."""

import pytest
import torch

from anchor_rl.algos import advantages as A
from anchor_rl.algos import losses, registry

F64 = torch.float64


def test_names():
    assert list(registry.ADVANTAGES) == [
        "grpo",
        "drgrpo",
        "rloo",
        "pvpo",
        "v05",
        "reinforce_pp",
        "reinforce_pp_baseline",
    ]
    assert set(registry.ADVANTAGE_INPUTS) == set(registry.ADVANTAGES)
    assert registry.TOKEN_LEVEL.issubset(registry.ADVANTAGES)
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
    with pytest.raises(KeyError, match="valid names: grpo, drgrpo, rloo, pvpo"):
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
        "token_rewards": token_rewards,
        "mask": mask,
        "gamma": 1.0,
    }
    expected = {
        "grpo": A.grpo(rewards, index),
        "drgrpo": torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=F64),
        "rloo": A.rloo(rewards, index),
        "pvpo": torch.tensor([0.5, -0.5, 0.75, 0.75], dtype=F64),
        "v05": torch.tensor([0.5, -0.5, 0.75, 0.75], dtype=F64),
        "reinforce_pp": A.reinforce_pp(token_rewards, mask),
        "reinforce_pp_baseline": A.reinforce_pp_baseline(rewards, index, mask),
    }
    for name in registry.ADVANTAGES:
        got = registry.compute_advantage(name, **inputs)
        torch.testing.assert_close(got, expected[name])
        assert got.dim() == (2 if name in registry.TOKEN_LEVEL else 1)
    with pytest.raises(TypeError, match="anchor"):
        registry.compute_advantage("pvpo", rewards=rewards)
