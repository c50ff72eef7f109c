"""HFEngine: groups, masks, per-row stops, sampling log-probs vs recomputation, seeding."""

from __future__ import annotations

import pytest
import torch

from anchor_rl.models.scoring import token_logprobs
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.types import SamplingParams

PROMPTS = ["1+1=", "what is 12*3?", "x"]


def check_masks(b):
    att, loss = b.attention_mask, b.loss_mask
    assert ((att == 0) | (att == 1)).all() and ((loss == 0) | (loss == 1)).all()
    assert (loss <= att).all()
    assert (b.logprobs[loss == 0] == 0).all()
    assert (b.response_ids[att == 0] == b.pad_id).all()
    lengths = att.sum(-1).long()
    # attention is one contiguous block from column 0
    assert torch.equal(att, (torch.arange(att.shape[1]) < lengths[:, None]).float())


def test_groups_prompts_and_shapes(tokenizer, tiny_model):
    b = HFEngine(tiny_model, tokenizer).rollout(
        PROMPTS,
        4,
        SamplingParams(max_new_tokens=12),
        instruction="Answer.",
        generator=torch.Generator().manual_seed(0),
    )
    assert len(b) == 12
    assert b.group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    for i, ids in enumerate(b.prompt_ids):
        assert ids == encode_prompt(tokenizer, PROMPTS[i // 4], "Answer.")
    assert b.response_ids.shape[1] <= 12
    check_masks(b)
    assert torch.equal(b.tool_calls, torch.zeros(12, dtype=torch.long))


def test_sampling_logprobs_match_recomputation_at_temperature_one(tokenizer, tiny_model):
    b = HFEngine(tiny_model, tokenizer).rollout(
        PROMPTS, 3, SamplingParams(max_new_tokens=20), generator=torch.Generator().manual_seed(3)
    )
    assert b.lengths.max() > 5  # some rows are long enough to exercise the cache
    logp, _ = token_logprobs(tiny_model, b)
    assert torch.allclose(logp, b.logprobs, atol=1e-4)


def test_logprobs_at_temperature_match_scaled_recomputation(tokenizer, tiny_model):
    b = HFEngine(tiny_model, tokenizer).rollout(
        PROMPTS,
        2,
        SamplingParams(temperature=0.7, max_new_tokens=10),
        generator=torch.Generator().manual_seed(4),
    )
    logp, _ = token_logprobs(tiny_model, b, temperature=0.7)
    assert torch.allclose(logp, b.logprobs, atol=1e-4)


def test_same_seed_same_rollout_other_seed_differs(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=16)
    a = engine.rollout(PROMPTS, 2, params, generator=torch.Generator().manual_seed(5))
    b = engine.rollout(PROMPTS, 2, params, generator=torch.Generator().manual_seed(5))
    c = engine.rollout(PROMPTS, 2, params, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts
    assert a.texts != c.texts


def test_chunked_generation_equals_one_batch_greedy(tokenizer, tiny_model):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    whole = HFEngine(tiny_model, tokenizer).rollout(PROMPTS, 2, params)
    chunked = HFEngine(tiny_model, tokenizer, max_batch=4).rollout(PROMPTS, 2, params)
    assert torch.equal(whole.response_ids, chunked.response_ids)
    # greedy samples of a prompt are identical and carry log-prob 0
    assert torch.equal(whole.response_ids[0], whole.response_ids[1])
    assert (whole.logprobs == 0).all()


def test_rows_stop_at_their_own_stop_and_pad_after(tokenizer, scripted):
    model = scripted({"a": "12</answer>99", "b": "1234567</answer>", "c": "123456789"})
    b = HFEngine(model, tokenizer).rollout(
        ["a", "b", "c"], 1, SamplingParams(max_new_tokens=6, stop=["</answer>"])
    )
    assert b.texts == ["12</answer>", "123456", "123456"]
    assert b.attention_mask.sum(-1).tolist() == [3, 6, 6]
    assert b.truncated.tolist() == [False, True, True]
    check_masks(b)
    assert b.response_ids[0, 2].item() == tokenizer.convert_tokens_to_ids("</answer>")
    # finished rows leave the batch: 3 rows at prefill, then fewer
    assert model.forward_rows[0] == 3 and model.forward_rows[-1] == 2


def test_eos_ends_a_row_and_is_kept_as_a_policy_token(tokenizer, scripted):
    model = scripted({"a": "hi"})
    b = HFEngine(model, tokenizer).rollout(["a"], 2, SamplingParams(max_new_tokens=8))
    assert b.response_ids[0, :3].tolist() == [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    assert b.lengths.tolist() == [3, 3] and b.texts == ["hi", "hi"]
    assert b.truncated.tolist() == [False, False]


def test_multi_token_stop_string_matches_text(tokenizer, scripted):
    model = scripted({"a": "ab\n\ncd"})
    b = HFEngine(model, tokenizer).rollout(
        ["a"], 1, SamplingParams(max_new_tokens=8, stop=["\n\n"])
    )
    assert b.texts == ["ab\n\n"]


def test_prompt_plus_budget_beyond_context_is_an_error(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="positions"):
        HFEngine(tiny_model, tokenizer).rollout(["x"], 1, SamplingParams(max_new_tokens=2000))
