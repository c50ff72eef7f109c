"""HFEngine: groups, masks, per-row stops, sampling log-probs vs recomputation, per-request
seeding, weight sync, the engine registry."""

from __future__ import annotations

import pytest
import torch
from helpers import requests

from anchor_rl.models.factory import build_model
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.engine import (
    ENGINES,
    Engine,
    HFEngine,
    Request,
    group_requests,
    make_engine,
    register_engine,
    request_seed,
)
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
        requests(PROMPTS, 4), SamplingParams(max_new_tokens=12), instruction="Answer."
    )
    assert len(b) == 12
    assert b.group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    for i, ids in enumerate(b.prompt_ids):
        assert ids == encode_prompt(tokenizer, PROMPTS[i // 4], "Answer.")
    assert b.response_ids.shape[1] <= 12
    check_masks(b)
    assert torch.equal(b.tool_calls, torch.zeros(12, dtype=torch.long))


def test_rows_follow_the_requests_order_and_groups(tokenizer, tiny_model):
    reqs = [Request("x", 1, group=5), Request("1+1=", 2, group=0), Request("x", 3, group=5)]
    b = HFEngine(tiny_model, tokenizer).rollout(reqs, SamplingParams(max_new_tokens=4))
    assert b.group.tolist() == [5, 0, 5]
    assert b.prompt_ids[1] == encode_prompt(tokenizer, "1+1=")


def test_sampling_logprobs_match_recomputation_at_temperature_one(tokenizer, tiny_model):
    b = HFEngine(tiny_model, tokenizer).rollout(
        requests(PROMPTS, 3, seed=3), SamplingParams(max_new_tokens=20)
    )
    assert b.lengths.max() > 5  # some rows are long enough to exercise the cache
    logp, _ = token_logprobs(tiny_model, b)
    assert torch.allclose(logp, b.logprobs, atol=1e-4)


def test_logprobs_at_temperature_match_scaled_recomputation(tokenizer, tiny_model):
    b = HFEngine(tiny_model, tokenizer).rollout(
        requests(PROMPTS, 2, seed=4), SamplingParams(temperature=0.7, max_new_tokens=10)
    )
    logp, _ = token_logprobs(tiny_model, b, temperature=0.7)
    assert torch.allclose(logp, b.logprobs, atol=1e-4)


def test_same_seed_same_rollout_other_seed_differs(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=16)
    a = engine.rollout(requests(PROMPTS, 2, seed=5), params)
    b = engine.rollout(requests(PROMPTS, 2, seed=5), params)
    c = engine.rollout(requests(PROMPTS, 2, seed=6), params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts
    assert a.texts != c.texts


def test_a_response_does_not_depend_on_its_batch_mates_or_chunking(tokenizer, tiny_model):
    params = SamplingParams(max_new_tokens=16)
    reqs = requests(PROMPTS, 4, seed=7)
    whole = HFEngine(tiny_model, tokenizer).rollout(reqs, params)
    chunked = HFEngine(tiny_model, tokenizer, max_batch=3).rollout(reqs, params)
    shuffled = [reqs[i] for i in (11, 0, 5, 2, 9)]
    alone = HFEngine(tiny_model, tokenizer).rollout(shuffled, params)
    assert chunked.texts == whole.texts
    assert alone.texts == [whole.texts[i] for i in (11, 0, 5, 2, 9)]
    assert len(set(whole.texts)) > 4  # the seeds differ, so do the samples


def test_group_requests_number_samples_and_continue_from_first():
    reqs = group_requests(["a", "b"], ["ida", "idb"], 2, 9, "train", first=[0, 3])
    assert [r.group for r in reqs] == [0, 0, 1, 1]
    assert [r.prompt for r in reqs] == ["a", "a", "b", "b"]
    assert reqs[0].seed == request_seed(9, "train", "ida", 0)
    assert reqs[3].seed == request_seed(9, "train", "idb", 4)  # sample 4 of prompt b
    assert len({r.seed for r in reqs}) == 4
    assert request_seed(1, "x") != request_seed("1", "x", 0) and 0 <= request_seed(1) < 2**63
    with pytest.raises(ValueError, match="keys"):
        group_requests(["a"], [], 1)


def test_chunked_generation_equals_one_batch_greedy(tokenizer, tiny_model):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    whole = HFEngine(tiny_model, tokenizer).rollout(requests(PROMPTS, 2), params)
    chunked = HFEngine(tiny_model, tokenizer, max_batch=4).rollout(requests(PROMPTS, 2), params)
    assert torch.equal(whole.response_ids, chunked.response_ids)
    # greedy samples of a prompt are identical and carry log-prob 0
    assert torch.equal(whole.response_ids[0], whole.response_ids[1])
    assert (whole.logprobs == 0).all()


def test_rows_stop_at_their_own_stop_and_pad_after(tokenizer, scripted):
    model = scripted({"a": "12</answer>99", "b": "1234567</answer>", "c": "123456789"})
    b = HFEngine(model, tokenizer).rollout(
        requests(["a", "b", "c"]), SamplingParams(max_new_tokens=6, stop=["</answer>"])
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
    b = HFEngine(model, tokenizer).rollout(requests(["a"], 2), SamplingParams(max_new_tokens=8))
    assert b.response_ids[0, :3].tolist() == [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    assert b.lengths.tolist() == [3, 3] and b.texts == ["hi", "hi"]
    assert b.truncated.tolist() == [False, False]


def test_multi_token_stop_string_matches_text(tokenizer, scripted):
    model = scripted({"a": "ab\n\ncd"})
    b = HFEngine(model, tokenizer).rollout(
        requests(["a"]), SamplingParams(max_new_tokens=8, stop=["\n\n"])
    )
    assert b.texts == ["ab\n\n"]


def test_prompt_plus_budget_beyond_context_is_an_error(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="positions"):
        HFEngine(tiny_model, tokenizer).rollout(
            requests(["x"]), SamplingParams(max_new_tokens=2000)
        )


def test_sync_weights_is_free_for_the_own_model_and_copies_others(tokenizer):
    model = build_model("tiny", tokenizer, seed=0)
    engine = make_engine("hf", model, tokenizer)
    assert isinstance(engine, Engine)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.sync_weights(model.state_dict())  # its own tensors: nothing to do
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    other = build_model("tiny", tokenizer, seed=1).state_dict()
    engine.sync_weights(other)
    assert all(torch.equal(other[k], v) for k, v in model.state_dict().items())


def test_bf16_engine_samples_from_a_bfloat16_copy_kept_in_sync(tokenizer):
    model = build_model("tiny", tokenizer, seed=0)
    engine = HFEngine(model, tokenizer, precision="bf16")
    copy = engine.model
    assert copy is not model
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy untouched
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers stay float32
    assert not any(p.requires_grad for p in copy.parameters())
    other = build_model("tiny", tokenizer, seed=1).state_dict()
    engine.sync_weights(other)
    for name, value in copy.state_dict().items():
        assert torch.equal(value, other[name].to(value.dtype)), name
    # what it samples: the behaviour log-probs of the bfloat16 weights, within bfloat16's
    # rounding (8 mantissa bits) of a float32 forward pass over the same tokens
    model.load_state_dict(other)
    b = engine.rollout(requests(PROMPTS, 4, seed=3), SamplingParams(max_new_tokens=20))
    check_masks(b)
    fp32, _ = token_logprobs(model, b)
    gap = (fp32 - b.logprobs).abs()[b.attention_mask.bool()]
    assert 0 < gap.mean() < 0.01 and gap.max() < 0.05


def test_bf16_engine_reuses_a_bfloat16_model_and_checks_its_option(tokenizer):
    model = build_model("tiny", tokenizer, seed=0).to(torch.bfloat16)
    assert HFEngine(model, tokenizer, precision="bf16").model is model
    assert HFEngine(model, tokenizer).model is model
    with pytest.raises(ValueError, match="precision must be one of model, bf16, got 'fp8'"):
        HFEngine(model, tokenizer, precision="fp8")


def test_engines_register_by_name(tokenizer, tiny_model):
    assert "hf" in ENGINES
    with pytest.raises(KeyError, match="registered: hf"):
        make_engine("vllm-typo", tiny_model, tokenizer)
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf")(lambda model, tokenizer: None)
