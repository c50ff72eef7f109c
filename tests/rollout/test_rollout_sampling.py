"""sample_next on hand-made distributions: greedy, top-p nucleus, log-probs, seeding."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.rollout.sampling import StopSet, sample_next

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))


def test_greedy_picks_argmax_with_logprob_zero():
    tokens, logp = sample_next(torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]]), 0.0, 1.0)
    assert tokens.tolist() == [1, 0]
    assert logp.tolist() == [0.0, 0.0]


def test_top_p_keeps_the_nucleus_and_renormalises():
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(LOGITS.expand(2000, 3), 1.0, 0.6, g)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.6, so token 1 joins; 0.8 >= 0.6 stops
    expected = {0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}
    for t, lp in zip(tokens.tolist(), logp.tolist(), strict=True):
        assert abs(lp - expected[t]) < 1e-5
    share = (tokens == 0).float().mean().item()
    assert abs(share - 0.625) < 0.05


def test_top_p_below_the_top_mass_keeps_one_token():
    tokens, logp = sample_next(LOGITS.expand(50, 3), 1.0, 0.45, torch.Generator().manual_seed(1))
    assert tokens.tolist() == [0] * 50
    assert torch.allclose(logp, torch.zeros(50), atol=1e-6)


def test_temperature_logprob_is_under_the_scaled_distribution():
    tokens, logp = sample_next(LOGITS.expand(20, 3), 2.0, 1.0, torch.Generator().manual_seed(2))
    scaled = torch.log_softmax(LOGITS[0] / 2.0, dim=-1)
    assert torch.allclose(logp, scaled[tokens], atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.floats(0.3, 2.0), top_p=st.floats(0.05, 1.0))
def test_same_seed_same_samples(seed, temperature, top_p):
    logits = torch.randn(8, 11, generator=torch.Generator().manual_seed(seed))
    a = sample_next(logits, temperature, top_p, torch.Generator().manual_seed(seed))
    b = sample_next(logits, temperature, top_p, torch.Generator().manual_seed(seed))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[1] <= 0).all()


def test_stop_set_splits_single_token_and_text_stops(tokenizer):
    stops = StopSet.build(tokenizer, ["</answer>", "\n\n", "</answer>"], [tokenizer.eos_token_id])
    answer = tokenizer.convert_tokens_to_ids("</answer>")
    assert stops.token_stops == {tokenizer.eos_token_id: "<eos>", answer: "</answer>"}
    assert stops.string_stops == ("\n\n",)
