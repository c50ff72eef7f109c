"""A*-PO's V* and regression loss, and the perfect baseline's estimator."""

from __future__ import annotations

import math

import pytest
import torch

from anchor_rl.algos import advantages as A
from anchor_rl.algos import losses, registry

F64 = torch.float64


def test_optimal_value_matches_its_formula_and_limits() -> None:
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0], [0.2, 0.9, 0.4, 0.4, 0.1]], dtype=F64)
    beta = 0.5
    by_hand = [beta * math.log(sum(math.exp(x / beta) for x in row) / 5) for row in r.tolist()]
    assert A.optimal_value(r, beta).tolist() == pytest.approx(by_hand, abs=1e-12)
    # beta -> inf: the mean; beta -> 0: the best reward (logsumexp keeps it finite)
    assert A.optimal_value(r, 1e6).tolist() == pytest.approx(r.mean(-1).tolist(), abs=1e-6)
    assert A.optimal_value(r, 1e-4).tolist() == pytest.approx([1.0, 0.9], abs=1e-3)
    # between the mean and the max for every beta
    for b in (0.05, 0.5, 5.0):
        v = A.optimal_value(r, b)
        assert bool((v >= r.mean(-1) - 1e-12).all() and (v <= r.amax(-1) + 1e-12).all())
    with pytest.raises(ValueError, match="beta"):
        A.optimal_value(r, 0.0)


def test_binary_optimal_value_equals_the_draws_formula() -> None:
    draws = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1]], dtype=F64)
    p = draws.mean(-1)
    for beta in (1e-3, 0.1, 0.5, 3.0):
        assert A.optimal_value_binary(p, beta).tolist() == pytest.approx(
            A.optimal_value(draws, beta).tolist(), abs=1e-9
        )
    assert A.optimal_value_binary(p, 1e-3).tolist() == pytest.approx([0, 1, 1, 1], abs=1e-2)


def test_astarpo_estimator_and_loss_against_a_hand_computation() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    logp = torch.tensor(
        [[-1.0, -2.0, 9.0], [-0.5, -0.5, -1.0], [0.0, 0.0, 0.0]], requires_grad=True
    )
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -1.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    vstar = torch.tensor([0.6, 0.3, 0.5])
    beta = 0.1
    ref_ratio = ((old - ref) * mask).sum(-1)  # [-1.5, 0.5, 0]
    target = registry.compute_advantage(
        "astarpo", rewards=rewards, vstar=vstar, ref_log_ratio=ref_ratio, beta=beta, index=None
    )
    assert target.tolist() == pytest.approx([1 - 0.6 + 0.15, 0 - 0.3 - 0.05, 0.5])
    adv = target.unsqueeze(-1) * mask  # what the trainer passes: [B, T], 0 off the mask
    loss, metrics = losses.astarpo_loss(logp, old, adv, mask, beta=beta)
    # the paper's form on the two responses with tokens: (beta log(pi/pi_ref) - (r - V*))^2
    seq = [(-1 - 2) - (-1 - 1), (-0.5 - 0.5 - 1) - (-3)]  # log pi - log pi_ref: -1, 1
    by_hand = ((beta * seq[0] - (1 - 0.6)) ** 2 + (beta * seq[1] - (0 - 0.3)) ** 2) / 2
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert metrics["regression_mse"].item() == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    # d/dlogp_t = 2 beta (beta * seq - (r - V*)) / 2 responses, on the masked tokens only
    g0 = beta * (beta * seq[0] - 0.4)
    g1 = beta * (beta * seq[1] + 0.3)
    expected = torch.tensor([[g0, g0, 0.0], [g1, g1, g1], [0.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-7)
    with pytest.raises(ValueError, match="beta"):
        losses.astarpo_loss(logp, old, adv, mask, beta=0.0)


def test_perfect_estimator_subtracts_the_policy_value() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    value = torch.tensor([0.25, 0.25, 0.75, 0.75])
    adv = registry.compute_advantage("perfect", rewards=rewards, policy_value=value)
    assert adv.tolist() == [0.75, -0.25, 0.25, 0.25]
    assert set(registry.get_estimator("perfect").inputs) == {"rewards", "policy_value"}
