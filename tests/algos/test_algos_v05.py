"""V0.5 fusion, estimated MSE and the adaptive rollout budget."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.algos import v05

F64 = torch.float64
COST, K_MAX = 0.0039, 16  # the paper's budget for +-1 rewards (sigma2 = 1)


def t(x):
    return torch.tensor(x, dtype=F64)


def test_fuse_hand_example():
    # prompt 0: d = 1 - (-0.5) = 1.5, s = 1/4: w = 1 - 0.25/2.25 = 8/9, b = -0.5 + 8/9 * 1.5
    # prompt 1: d = -1 + 0.388 = -0.612, d^2 = 0.374544 > 0.25: w = 1 - 0.25/0.374544
    # prompt 2: d = 0.25, d^2 = 0.0625 <= 0.25: accepted, b = V
    # prompt 3: emp_mean == prior exactly: w = 0, no NaN
    emp, prior = t([1.0, -1.0, 0.0, 0.3]), t([-0.5, -0.388, -0.25, 0.3])
    k = torch.tensor([4, 4, 4, 4])
    b, w, rej = v05.fuse(emp, k, prior, 1.0)
    w1 = 1 - 0.25 / 0.374544
    torch.testing.assert_close(w, t([8 / 9, w1, 0.0, 0.0]))
    torch.testing.assert_close(b, t([-0.5 + 8 / 9 * 1.5, -0.388 - w1 * 0.612, -0.25, 0.3]))
    assert rej.tolist() == [True, True, False, False]


def test_fuse_zero_variance_and_tensor_sigma2():
    # sigma2 = 0: the empirical mean is exact (w = 1) unless it equals the prior (w = 0, b = V)
    b, w, rej = v05.fuse(t([0.5, 0.2]), torch.tensor([2, 2]), t([0.0, 0.2]), t([0.0, 0.0]))
    torch.testing.assert_close(b, t([0.5, 0.2]))
    torch.testing.assert_close(w, t([1.0, 0.0]))
    assert rej.tolist() == [True, False]
    # per-prompt sigma2: s = 0.5/2 = 0.25 rejects d^2 = 0.36; s = 2/2 = 1 accepts it
    _, w, rej = v05.fuse(t([0.6, 0.6]), torch.tensor([2, 2]), t([0.0, 0.0]), t([0.5, 2.0]))
    torch.testing.assert_close(w, t([1 - 0.25 / 0.36, 0.0]))
    assert rej.tolist() == [True, False]


def test_estimated_mse_hand_example():
    # d^2 = 0.374544, s = 0.25: D2 = 0.124544, MSE = D2 * s / (D2 + s) = D2 * 0.25 / 0.374544;
    # accepted prior -> 0; sigma2 = 0 and d = 0 -> 0 (no NaN)
    mse = v05.estimated_mse(t([-1.0, 0.0]), torch.tensor([4, 4]), t([-0.388, -0.25]), 1.0)
    torch.testing.assert_close(mse, t([0.124544 * 0.25 / 0.374544, 0.0]))
    zero = v05.estimated_mse(t([0.1]), torch.tensor([3]), t([0.1]), 0.0)
    torch.testing.assert_close(zero, t([0.0]))


def test_extra_rollouts_hand_example():
    # k = 4, sigma2 = 1, cost 0.0039, k_max 16; gain(n) = 1 / ((n + u)(n + 1 + u)), u = 1/D2.
    # prompt 0: d^2 = 4, D2 = 3.75, u = 0.2667: gain(15) = 1/(15.27 * 16.27) = 0.00403 > cost,
    #   so every n in 4..15 adds one: 12 (capped by k_max).
    # prompt 1: d^2 = 0.375, D2 = 0.125, u = 8: gain(4..7) = 1/156, 1/182, 1/210, 1/240 > cost,
    #   gain(8) = 1/272 = 0.00368 < cost: 4.
    # prompt 2: accepted prior: 0.   prompt 3: k = 15 already, strong rejection: 1 (to 16).
    emp = t([1.0, -1.0, 0.0, 1.0])
    prior = t([-1.0, -1.0 + math.sqrt(0.375), 0.2, -1.0])
    k = torch.tensor([4, 4, 4, 15])
    extra = v05.extra_rollouts(emp, k, prior, 1.0, COST, K_MAX)
    assert extra.dtype == torch.long
    assert extra.tolist() == [12, 4, 0, 1]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="k must be"):
        v05.fuse(t([0.0]), torch.tensor([0]), t([0.0]), 1.0)
    with pytest.raises(ValueError, match="sigma2"):
        v05.fuse(t([0.0]), torch.tensor([1]), t([0.0]), -1.0)
    with pytest.raises(ValueError, match="shape"):
        v05.fuse(t([0.0, 1.0]), torch.tensor([1]), t([0.0]), 1.0)


prompts = st.lists(
    st.tuples(
        st.floats(-1, 1),  # emp_mean
        st.integers(1, K_MAX),  # k
        st.floats(-1, 1),  # prior
        st.floats(0.01, 2.0),  # sigma2
    ),
    min_size=1,
    max_size=12,
)


def unpack(rows):
    emp = t([r[0] for r in rows])
    k = torch.tensor([r[1] for r in rows])
    prior = t([r[2] for r in rows])
    s2 = t([r[3] for r in rows])
    return emp, k, prior, s2


@settings(max_examples=80, deadline=None)
@given(prompts)
def test_fuse_properties(rows):
    emp, k, prior, s2 = unpack(rows)
    b, w, rej = v05.fuse(emp, k, prior, s2)
    d2, noise = (emp - prior).square(), s2 / k
    assert bool((w[d2 <= noise] == 0).all())  # accepted prior -> weight 0
    assert bool((rej == (d2 > noise)).all())
    assert bool(((w >= 0) & (w < 1)).all())
    assert bool(((b - emp).abs() <= noise.sqrt() + 1e-12).all())
    assert bool(torch.isfinite(b).all())


@settings(max_examples=80, deadline=None)
@given(prompts, st.floats(0.0, 0.05))
def test_extra_rollouts_properties(rows, cost):
    emp, k, prior, s2 = unpack(rows)
    extra = v05.extra_rollouts(emp, k, prior, s2, cost, K_MAX)
    accepted = (emp - prior).square() <= s2 / k
    assert bool((extra[accepted] == 0).all())
    assert bool((extra >= 0).all()) and bool((extra <= K_MAX - k).all())
    # moving the prior further from the empirical mean never lowers the budget
    for scale in (1.5, 3.0, 10.0):
        further = emp - scale * (emp - prior)
        assert bool((v05.extra_rollouts(emp, k, further, s2, cost, K_MAX) >= extra).all())


@settings(max_examples=60, deadline=None)
@given(prompts)
def test_estimated_mse_bounded_by_empirical_variance(rows):
    emp, k, prior, s2 = unpack(rows)
    mse = v05.estimated_mse(emp, k, prior, s2)
    assert bool(((mse >= 0) & (mse <= s2 / k)).all())
