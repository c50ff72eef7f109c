"""KL estimators, aggregation modes, policy/value/NLL losses and entropy."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from anchor_rl.algos import losses as L

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_kl_hand_example_and_clamps():
    # x = logp - ref = 1, 50 (clamped to 20), -50 (clamped to -20)
    logp, ref = t([-1.0, 0.0, -50.0]), t([-2.0, -50.0, 0.0])
    torch.testing.assert_close(L.kl(logp, ref, "k1"), t([1.0, 20.0, -20.0]))
    torch.testing.assert_close(L.kl(logp, ref, "k2"), t([0.5, 200.0, 200.0]))
    # k3 = e^-x + x - 1: e^-1 = 0.367879; 19 -> 10; e^20 - 21 -> 10
    torch.testing.assert_close(L.kl(logp, ref, "k3"), t([math.exp(-1), 10.0, 10.0]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        L.kl(logp, ref, "k4")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=20))
def test_k3_non_negative_and_zero_at_equality(pairs):
    logp, ref = t([p for p, _ in pairs]), t([r for _, r in pairs])
    assert bool((L.kl(logp, ref, "k3") >= 0).all())
    assert bool((L.kl(logp, logp, "k3") == 0).all())


# Ragged mask: row 0 has 3 tokens (1, 2, 3), row 1 one token (4), row 2 none (garbage).
RAGGED_V = t([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [float("nan")] * 4])
RAGGED_M = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),  # 3.0 (empty row excluded)
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),  # 5.0
        ("seq-mean-token-sum-norm", (6.0 / 4 + 4.0 / 4) / 2),  # 1.25 (C = T = 4)
    ],
)
def test_agg_modes_on_ragged_mask(mode, expected):
    assert float(L.agg(RAGGED_V, RAGGED_M, mode)) == pytest.approx(expected)


def test_agg_norm_const_and_empty_mask():
    assert float(
        L.agg(RAGGED_V, RAGGED_M, "seq-mean-token-sum-norm", norm_const=2.0)
    ) == pytest.approx(2.5)
    empty = torch.zeros(2, 3, dtype=F64)
    for mode in L.AGG_MODES:
        assert float(L.agg(t([[1.0, float("nan"), 2.0]] * 2), empty, mode)) == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        L.agg(RAGGED_V, RAGGED_M, "sum")


def one_token_loss(ratio, adv, clip_low=0.2, clip_high=0.28, clip_c=None):
    """Loss and d loss / d logp of a single token with the given ratio and advantage."""
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = L.policy_loss(
        logp, t([[0.0]]), t([adv]), t([[1.0]]), clip_low, clip_high, clip_c
    )
    loss.backward()
    return float(loss.detach()), float(logp.grad), metrics


def test_policy_loss_hand_example():
    # tokens: (ratio 1.5, A +1) clipped at 1.28 -> -1.28; (ratio 0.5, A -2) clipped at 0.8 -> 1.6;
    # (ratio 1.1, A +1) unclipped -> -1.1; padding ignored. token-mean = (-1.28 + 1.6 - 1.1) / 3
    logp = t([[math.log(1.5), math.log(0.5)], [math.log(1.1), 9.0]])
    old = torch.zeros(2, 2, dtype=F64)
    adv = t([[1.0, -2.0], [1.0, 1.0]])
    mask = t([[1, 1], [1, 0]])
    loss, m = L.policy_loss(logp, old, adv, mask, 0.2, 0.28)
    assert float(loss) == pytest.approx((-1.28 + 1.6 - 1.1) / 3)
    assert float(m["clipfrac_high"]) == pytest.approx(1 / 3)
    assert float(m["clipfrac_low"]) == pytest.approx(1 / 3)
    assert float(m["clipfrac_dual"]) == 0.0
    logs = [math.log(1.5), math.log(0.5), math.log(1.1)]
    assert float(m["approx_kl"]) == pytest.approx(sum(x * x for x in logs) / 6)
    assert float(m["ratio_mean"]) == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # [B] advantages broadcast over tokens, seq-mean-token-mean aggregation
    loss_b, _ = L.policy_loss(logp, old, t([1.0, -1.0]), mask, 0.2, 0.28, agg="seq-mean-token-mean")
    assert float(loss_b) == pytest.approx(((-1.28 - 0.5) / 2 + 1.1) / 2)


@settings(max_examples=100, deadline=None)
@given(st.floats(0.05, 5.0), st.floats(0.01, 3.0))
def test_clip_higher_is_one_sided(ratio, size):
    assume(abs(ratio - 1.28) > 1e-9 and abs(ratio - 0.8) > 1e-9)  # gradient undefined on the kink
    # positive advantage: only the upper bound 1 + clip_high clips
    loss, grad, _ = one_token_loss(ratio, size)
    assert loss == pytest.approx(-size * min(ratio, 1.28))
    assert grad == pytest.approx(0.0 if ratio > 1.28 else -size * ratio, abs=1e-12)
    # negative advantage: only the lower bound 1 - clip_low clips
    loss, grad, _ = one_token_loss(ratio, -size)
    assert loss == pytest.approx(size * max(ratio, 0.8))
    assert grad == pytest.approx(0.0 if ratio < 0.8 else size * ratio, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.floats(0.05, 50.0), st.floats(0.01, 3.0), st.floats(1.5, 5.0))
def test_dual_clip_bounds_negative_advantage_loss(ratio, size, clip_c):
    assume(abs(ratio - clip_c) > 1e-9)  # exp(log(ratio)) may round across the bound
    loss, grad, m = one_token_loss(ratio, -size, clip_c=clip_c)
    assert loss <= size * clip_c + 1e-9
    assert loss == pytest.approx(size * min(max(ratio, 0.8), clip_c))
    assert float(m["clipfrac_dual"]) == (1.0 if ratio > clip_c else 0.0)
    if ratio > clip_c:
        assert grad == 0.0
    # positive advantages are untouched by the dual clip
    assert one_token_loss(ratio, size, clip_c=clip_c)[0] == pytest.approx(-size * min(ratio, 1.28))


def test_policy_loss_treats_old_logp_as_constant_from_any_behaviour_policy():
    # a teacher row: old_logp are the teacher's log-probs; gradient flows to logp only
    logp = t([[-1.0, -2.0]]).requires_grad_()
    teacher = t([[-0.5, -0.1]]).requires_grad_()
    loss, _ = L.policy_loss(logp, teacher, t([1.0]), t([[1, 1]]), 0.2, 0.28)
    loss.backward()
    assert teacher.grad is None
    ratio = torch.exp(t([-0.5, -1.9]))  # pi_theta / pi_teacher, both below 1 - clip_low
    torch.testing.assert_close(logp.grad, (-ratio / 2).unsqueeze(0))


def test_value_loss_hand_example():
    # token 0: v 0.5, old 0, R 1, clip 0.2: v_clip 0.2, errors 0.25 vs 0.64 -> 0.32 (clipped)
    # token 1: v 0.1, old 0, R 1: v_clip 0.1, both 0.81 -> 0.405; token 2 is padding
    values, old = t([[0.5, 0.1, 7.0]]), t([[0.0, 0.0, 0.0]])
    loss, m = L.value_loss(values, old, t([[1.0, 1.0, 0.0]]), t([[1, 1, 0]]), 0.2)
    assert float(loss) == pytest.approx((0.32 + 0.405) / 2)
    assert float(m["vf_clipfrac"]) == pytest.approx(0.5)
    assert float(m["vf_mse"]) == pytest.approx((0.25 + 0.81) / 2)


def test_nll_hand_example():
    logp = t([[-1.0, -2.0, float("-inf")], [-5.0, -5.0, -5.0], [-0.5, -1.5, -9.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    # rows 0 and 2 selected: (1 + 2 + 0.5 + 1.5) / 4 = 1.25
    assert float(L.nll(logp, mask, torch.tensor([True, False, True]))) == pytest.approx(1.25)
    assert float(L.nll(logp, mask, t([0.0, 0.0, 0.0]))) == 0.0


def test_entropy_from_logits():
    logits = torch.zeros(1, 2, 4, dtype=F64)
    logits[0, 1, 2:] = float("-inf")
    logits = logits.requires_grad_()
    ent = L.entropy_from_logits(logits)
    torch.testing.assert_close(ent, t([[math.log(4), math.log(2)]]))
    ent.sum().backward()
    assert bool(torch.isfinite(logits.grad).all())
    z = torch.randn(3, 5, 7, dtype=F64) * 20
    p = torch.softmax(z, -1)
    torch.testing.assert_close(L.entropy_from_logits(z), -(p * torch.log_softmax(z, -1)).sum(-1))
    assert L.entropy_from_logits(z.to(torch.bfloat16)).dtype == torch.float32
