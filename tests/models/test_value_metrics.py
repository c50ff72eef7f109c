"""Critic and advantage diagnostics on hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.models.value_metrics import (
    advantage_stats_by_length,
    explained_variance,
    first_token_value_error,
    value_metrics,
)

RETURNS = torch.tensor([[1.0, 1.0, 9.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 9.0 is masked out


def test_explained_variance_by_hand():
    # masked returns [1, 1, 0, 0]: Var = 0.25
    perfect = RETURNS.clone()
    mean_only = torch.full((2, 3), 0.5)
    half = torch.tensor([[1.0, 0.5, -7.0], [0.0, 0.5, 3.0]])  # residuals [0, .5, 0, -.5]: Var .125
    assert explained_variance(perfect, RETURNS, MASK) == pytest.approx(1.0)
    assert explained_variance(mean_only, RETURNS, MASK) == pytest.approx(0.0)
    assert explained_variance(half, RETURNS, MASK) == pytest.approx(0.5)
    assert explained_variance(torch.zeros(2, 3) - 1.0, RETURNS, MASK) == pytest.approx(0.0)
    worse = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # residuals [1, 1, -1, -1]: Var 1
    assert explained_variance(worse, RETURNS, MASK) == pytest.approx(1.0 - 1.0 / 0.25)


def test_explained_variance_zero_variance_is_nan():
    same = torch.ones(2, 3)
    assert math.isnan(explained_variance(torch.zeros(2, 3), same, MASK))
    assert math.isnan(explained_variance(RETURNS, RETURNS, torch.zeros(2, 3)))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(-3, 3), st.floats(0.1, 3))
def test_explained_variance_is_shift_invariant_and_at_most_one(seed, shift, scale):
    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(4, 5, generator=g)
    values = torch.randn(4, 5, generator=g)
    mask = torch.ones(4, 5)
    ev = explained_variance(values, returns, mask)
    assert ev <= 1.0
    # a constant offset in the critic does not change EV; scaling both does not either
    assert explained_variance(values + shift, returns, mask) == pytest.approx(ev, abs=1e-5)
    assert explained_variance(values * scale, returns * scale, mask) == pytest.approx(ev, abs=1e-5)


def test_first_token_value_error_by_hand():
    values = torch.tensor([[0.5, 9.0], [0.2, 9.0], [7.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 2 is an empty response
    assert first_token_value_error(values, rewards, mask) == pytest.approx((0.5 + 0.2) / 2)
    assert math.isnan(first_token_value_error(values, rewards, torch.zeros(3, 2)))


def test_value_metrics_by_hand():
    values = torch.tensor([[1.0, 0.5, -7.0], [0.0, 0.5, 3.0]])
    rewards = torch.tensor([1.0, 0.0])
    out = value_metrics(values, RETURNS, MASK, rewards)
    assert out == {
        "critic/value_mse": pytest.approx((0 + 0.25 + 0 + 0.25) / 4),
        "critic/explained_variance": pytest.approx(0.5),
        "critic/first_token_error": pytest.approx(0.0),
        "critic/value_mean": pytest.approx(0.5),
        "critic/return_mean": pytest.approx(0.5),
    }


ADV = torch.tensor(
    [
        [1.0, 3.0, 0.0, 0.0],  # length 2: tokens 1, 3
        [2.0, 0.0, 0.0, 0.0],  # length 1: token 2
        [4.0, 4.0, 4.0, 4.0],  # length 4
        [-1.0, 1.0, -1.0, 0.0],  # length 3
        [5.0, 5.0, 5.0, 5.0],  # length 0 (empty): left out
    ]
)
LEN_MASK = torch.tensor(
    [
        [1.0, 1.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
)


def test_advantage_stats_by_length_quantiles():
    out = advantage_stats_by_length(ADV, LEN_MASK, n_buckets=2)
    # sorted by length: rows 1 (1), 0 (2) | rows 3 (3), 2 (4)
    assert out == {
        "adv/len_q0/n_seq": 2.0,
        "adv/len_q0/length": 1.5,
        "adv/len_q0/mean": pytest.approx(2.0),  # tokens [2, 1, 3]
        "adv/len_q0/std": pytest.approx(math.sqrt(2 / 3)),
        "adv/len_q1/n_seq": 2.0,
        "adv/len_q1/length": 3.5,
        "adv/len_q1/mean": pytest.approx(15 / 7),  # tokens [-1, 1, -1, 4, 4, 4, 4]
        "adv/len_q1/std": pytest.approx(math.sqrt(67 / 7 - (15 / 7) ** 2)),
    }


def test_advantage_stats_by_length_fixed_edges_and_per_sequence_advantages():
    out = advantage_stats_by_length(
        torch.tensor([1.0, -1.0, 2.0, 0.5, 9.0]), LEN_MASK, edges=[2, 4, 10]
    )
    assert out == {
        "adv/len_0_2/n_seq": 1.0,  # row 1
        "adv/len_0_2/length": 1.0,
        "adv/len_0_2/mean": -1.0,
        "adv/len_0_2/std": 0.0,
        "adv/len_2_4/n_seq": 2.0,  # rows 0 (2 tokens of 1.0) and 3 (3 tokens of 0.5)
        "adv/len_2_4/length": 2.5,
        "adv/len_2_4/mean": pytest.approx((2 * 1.0 + 3 * 0.5) / 5),
        "adv/len_2_4/std": pytest.approx(math.sqrt((2 * 1.0 + 3 * 0.25) / 5 - 0.7**2)),
        "adv/len_4_10/n_seq": 1.0,  # row 2
        "adv/len_4_10/length": 4.0,
        "adv/len_4_10/mean": 2.0,
        "adv/len_4_10/std": 0.0,
        "adv/len_10_inf/n_seq": 0.0,
    }


def test_advantage_stats_bad_edges():
    with pytest.raises(ValueError, match="strictly increasing"):
        advantage_stats_by_length(ADV, LEN_MASK, edges=[4, 2])
