"""GAE over policy tokens and the length-adaptive lambda."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.algos.gae import LAMBDA_MAX, gae, length_adaptive_lambda

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_gae_hand_example_with_tool_span_and_padding():
    # Row 0 (gamma 1, lam 0.5): policy, TOOL, policy, policy. The tool token's reward 9 and
    # value 7 are ignored.
    #   t3: delta = 1 + 0 - 0.8 = 0.2                A3 = 0.2
    #   t2: delta = 0 + 0.8 - 0.6 = 0.2              A2 = 0.2 + 0.5 * 0.2 = 0.3
    #   t0: delta = 0 + 0.6 - 0.5 = 0.1 (next = t2)  A0 = 0.1 + 0.5 * 0.3 = 0.25
    rewards = t([[0, 9, 0, 1]])
    values = t([[0.5, 7, 0.6, 0.8]])
    mask = t([[1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, t([[0.25, 0, 0.3, 0.2]]))
    torch.testing.assert_close(ret, t([[0.75, 0, 0.9, 1.0]]))


def test_gae_hand_example_discounted_with_padding():
    # gamma 0.9, lam 1: t1: A = 1 - 0.4 = 0.6; t0: delta = 0.9 * 0.4 - 0.2 = 0.16,
    # A = 0.16 + 0.9 * 0.6 = 0.7; returns are the discounted reward-to-go 0.9, 1.0.
    adv, ret = gae(t([[0, 1, 0, 0]]), t([[0.2, 0.4, 5, 5]]), t([[1, 1, 0, 0]]), 0.9, 1.0)
    torch.testing.assert_close(adv, t([[0.7, 0.6, 0, 0]]))
    torch.testing.assert_close(ret, t([[0.9, 1.0, 0, 0]]))


def test_gae_outputs_constants_and_tolerates_nan_under_mask():
    values = t([[0.5, float("nan"), 0.2]]).requires_grad_()
    adv, ret = gae(t([[0, float("inf"), 1]]), values, t([[1, 0, 1]]), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad
    torch.testing.assert_close(adv, t([[0.5, 0, 0.8]]))


def slow_gae(rewards, values, mask, gamma, lam):
    """Reference: drop masked tokens, run textbook GAE on the compact list, scatter back."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = [i for i in range(T) if mask[b][i] > 0]
        running = 0.0
        for j in reversed(range(len(pos))):
            nv = values[b][pos[j + 1]] if j + 1 < len(pos) else 0.0
            delta = rewards[b][pos[j]] + gamma * nv - values[b][pos[j]]
            running = delta + gamma * lam[b] * running
            adv[b][pos[j]] = running
    ret = [
        [adv[b][i] + values[b][i] if mask[b][i] > 0 else 0.0 for i in range(T)] for b in range(B)
    ]
    return t(adv), t(ret)


@st.composite
def batches(draw, min_t=1):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(min_t, 9))
    floats = st.floats(-2, 2, allow_nan=False, width=32)
    rewards = draw(st.lists(st.lists(floats, min_size=T, max_size=T), min_size=B, max_size=B))
    values = draw(st.lists(st.lists(floats, min_size=T, max_size=T), min_size=B, max_size=B))
    mask = draw(
        st.lists(
            st.lists(st.sampled_from([0.0, 1.0]), min_size=T, max_size=T), min_size=B, max_size=B
        )
    )
    return t(rewards), t(values), t(mask)


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0, 1), st.lists(st.floats(0, 1), min_size=4, max_size=4))
def test_gae_matches_slow_reference_float64(batch, gamma, lams):
    rewards, values, mask = batch
    lam = t(lams[: rewards.shape[0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = slow_gae(
        rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam.tolist()
    )
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_gae_gamma_lam_one_gives_reward_to_go(batch):
    rewards, values, mask = batch
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, (to_go - values) * mask)


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_gae_ignores_anything_under_mask_zero(batch, data):
    rewards, values, mask = batch
    adv, ret = gae(rewards, values, mask, 0.9, 0.7)
    noise = st.floats(-50, 50, allow_nan=False, width=32)
    B, T = rewards.shape
    garbage_r = t(
        data.draw(st.lists(st.lists(noise, min_size=T, max_size=T), min_size=B, max_size=B))
    )
    garbage_v = t(
        data.draw(st.lists(st.lists(noise, min_size=T, max_size=T), min_size=B, max_size=B))
    )
    off = mask == 0
    adv2, ret2 = gae(
        torch.where(off, garbage_r, rewards), torch.where(off, garbage_v, values), mask, 0.9, 0.7
    )
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_gae_inserting_masked_tokens_changes_nothing(batch, data):
    rewards, values, _ = batch
    B, T = rewards.shape
    mask = torch.ones(B, T, dtype=F64)
    adv, ret = gae(rewards, values, mask, 0.95, 0.8)
    # insert masked columns (tool output) at random places, with garbage rewards/values
    inserted = data.draw(st.lists(st.integers(0, T), max_size=5))
    cols_r, cols_v, cols_m, keep = [], [], [], []
    for i in range(T + 1):
        for _ in range(inserted.count(i)):
            cols_r.append(torch.full((B,), 3.0, dtype=F64))
            cols_v.append(torch.full((B,), -4.0, dtype=F64))
            cols_m.append(torch.zeros(B, dtype=F64))
            keep.append(False)
        if i < T:
            cols_r.append(rewards[:, i])
            cols_v.append(values[:, i])
            cols_m.append(mask[:, i])
            keep.append(True)
    adv2, ret2 = gae(
        torch.stack(cols_r, 1), torch.stack(cols_v, 1), torch.stack(cols_m, 1), 0.95, 0.8
    )
    keep = torch.tensor(keep)
    torch.testing.assert_close(adv2[:, keep], adv)
    torch.testing.assert_close(ret2[:, keep], ret)
    assert bool((adv2[:, ~keep] == 0).all()) and bool((ret2[:, ~keep] == 0).all())


@settings(max_examples=40, deadline=None)
@given(batches(), st.lists(st.floats(0, 1), min_size=4, max_size=4))
def test_per_sequence_lambda_matches_per_row_calls(batch, lams):
    rewards, values, mask = batch
    lam = t(lams[: rewards.shape[0]])
    adv, ret = gae(rewards, values, mask, 0.99, lam)
    for b in range(rewards.shape[0]):
        a_b, r_b = gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 0.99, float(lam[b]))
        torch.testing.assert_close(adv[b : b + 1], a_b)
        torch.testing.assert_close(ret[b : b + 1], r_b)


def test_gae_rejects_bad_lambda():
    r = t([[1.0, 0.0]])
    with pytest.raises(ValueError, match="lam"):
        gae(r, r, r, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"\[B\]"):
        gae(r, r, r, 1.0, t([0.5, 0.5]))


def test_length_adaptive_lambda_hand_example():
    # alpha 0.05: l = 0 -> -inf, l = 10 -> 1 - 1/0.5 = -1 (both clamp to lam_min),
    # l = 40 -> 0.5, l = 100 -> 0.8, l = 1e9 -> 1 - 2e-8 (clamps to LAMBDA_MAX).
    lengths = torch.tensor([0, 10, 40, 100, 10**9])
    lam = length_adaptive_lambda(lengths, 0.05)
    expected = torch.tensor([0.0, 0.0, 0.5, 0.8, LAMBDA_MAX], dtype=lam.dtype)
    torch.testing.assert_close(lam, expected)
    assert float(lam.max()) < 1.0
    lam = length_adaptive_lambda(lengths, 0.05, lam_min=0.3)
    torch.testing.assert_close(lam[:3], torch.tensor([0.3, 0.3, 0.5], dtype=lam.dtype))
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(lengths, 0.0)
