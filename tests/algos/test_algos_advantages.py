"""Outcome and token-level advantage estimators: hand-worked numbers and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.algos import advantages as A

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# Groups interleaved and non-contiguous: group 7 = rows 0,2,4,6 with rewards 1,0,1,1;
# group 2 = rows 1,5 with rewards 0,0; group 9 = row 3 alone.
REWARDS = t([1.0, 0.0, 0.0, 5.0, 1.0, 0.0, 1.0])
INDEX = torch.tensor([7, 2, 7, 9, 7, 2, 7])


def test_grpo_hand_example():
    # group 7: mean 0.75, centred (0.25, -0.75, 0.25, 0.25), unbiased var 0.75/3 = 0.25, std 0.5
    adv = A.grpo(REWARDS, INDEX)
    expected = t([0.5, 0.0, -1.5, 0.0, 0.5, 0.0, 0.5])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    # exact with eps = 0 on a group with spread
    torch.testing.assert_close(
        A.grpo(t([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.long), eps=0.0),
        t([0.5, -1.5, 0.5, 0.5]),
    )


def test_grpo_without_std_is_centred():
    adv = A.grpo(REWARDS, INDEX, scale_by_std=False)
    torch.testing.assert_close(adv, t([0.25, 0.0, -0.75, 0.0, 0.25, 0.0, 0.25]))


def test_rloo_hand_example():
    # group 7: r_i - mean(others): 1 - 2/3, 0 - 1, 1 - 2/3, 1 - 2/3; singleton group -> 0
    adv = A.rloo(REWARDS, INDEX)
    torch.testing.assert_close(adv, t([1 / 3, 0.0, -1.0, 0.0, 1 / 3, 0.0, 1 / 3]))


def test_pvpo_hand_example():
    adv = A.pvpo(t([1.0, 0.0, 1.0]), t([0.4, 0.4, 0.9]))
    torch.testing.assert_close(adv, t([0.6, -0.4, 0.1]))


def test_outcome_to_token_rewards():
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    out = A.outcome_to_token_rewards(t([2.0, 3.0, 4.0, 5.0]), mask)
    expected = t([[0, 0, 2, 0], [0, 0, 3, 0], [0, 0, 0, 0], [0, 5, 0, 0]])
    torch.testing.assert_close(out, expected)


def test_reinforce_pp_hand_example():
    # gamma 0.5. Row 0: rewards (0, 0, 1 | pad) -> returns (0.25, 0.5, 1).
    # Row 1: policy, tool output (reward 9 ignored), policy, pad: rewards (0, 9, -1, 0)
    #   -> returns (-0.5, 0, -1): the masked token is skipped by the discount.
    # Masked returns: 0.25, 0.5, 1, -0.5, -1 -> mean 0.05, unbiased var 2.55 / 4 = 0.6375.
    rewards = t([[0, 0, 1, 0], [0, 9, -1, 0]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0]])
    adv = A.reinforce_pp(rewards, mask, gamma=0.5)
    std = math.sqrt(0.6375 + 1e-8)
    expected = t([[0.25, 0.5, 1.0, 0.05], [-0.5, 0.05, -1.0, 0.05]])
    expected = (expected - 0.05) / std * mask
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_hand_example():
    # groups (0, 0, 1, 1) with rewards (1, 0, 0.5, 0.5): centred (0.5, -0.5, 0, 0); gamma 1
    # puts the centred value on every policy token: 0.5, 0.5 | -0.5 | 0 | 0, 0
    # -> mean 1/12, unbiased var = sum((x - 1/12)^2) / 5.
    mask = t([[1, 1], [1, 0], [1, 0], [1, 1]])
    adv = A.reinforce_pp_baseline(t([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]), mask)
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    mean = sum(tokens) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / 5 + 1e-8)
    expected = (t([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]) - mean) / std * mask
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_adds_dense_rewards():
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    dense = t([[-0.1, 0.2, 5.0], [0.0, -0.3, 0.1], [0.4, 0.0, 0.0]])
    rewards, index = t([1.0, 0.0, 1.0]), torch.tensor([3, 3, 4])
    got = A.reinforce_pp_baseline(rewards, index, mask, dense_rewards=dense, gamma=0.9)
    centred = t([0.5, -0.5, 0.0])
    want = A.reinforce_pp(A.outcome_to_token_rewards(centred, mask) + dense, mask, gamma=0.9)
    torch.testing.assert_close(got, want)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="index"):
        A.grpo(t([1.0, 0.0]), t([0.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        A.rloo(t([1.0, 0.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="mask"):
        A.reinforce_pp(t([[1.0, 0.0]]), t([[1.0]]))


groups = st.lists(
    st.tuples(st.integers(-5, 5), st.floats(-3, 3, allow_nan=False, width=32)),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_grpo_sums_to_zero_within_each_group(rows):
    index = torch.tensor([g for g, _ in rows])
    rewards = t([r for _, r in rows])
    for scale in (True, False):
        adv = A.grpo(rewards, index, scale_by_std=scale)
        for g in index.unique():
            assert abs(float(adv[index == g].sum())) < 1e-6 * max(1, len(rows))


@settings(max_examples=60, deadline=None)
@given(groups)
def test_rloo_is_scaled_centred_reward_and_leave_one_out(rows):
    index = torch.tensor([g for g, _ in rows])
    rewards = t([r for _, r in rows])
    adv = A.rloo(rewards, index)
    for i, (g, r) in enumerate(rows):
        others = [r2 for j, (g2, r2) in enumerate(rows) if g2 == g and j != i]
        n = len(others) + 1
        if n == 1:
            assert float(adv[i]) == 0.0
            continue
        mean = (sum(others) + r) / n
        assert float(adv[i]) == pytest.approx(r - sum(others) / len(others), abs=1e-9)
        assert float(adv[i]) == pytest.approx(n / (n - 1) * (r - mean), abs=1e-9)
