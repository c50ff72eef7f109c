"""token_logprobs against per-row unpadded forwards; entropy; micro-batching; gradients."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import response_batch, scores_and_gradients
from transformers import GPT2Config, GPT2LMHeadModel

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.factory import build_model
from anchor_rl.models.scoring import (
    entropy_from_logp,
    left_pad,
    pack_rows,
    packing_supported,
    position_ids,
    token_logprobs,
)
from anchor_rl.models.tokenizer import build_tokenizer

TOK = build_tokenizer()
MODEL = build_model("tiny", TOK, seed=0).eval()
PROMPTS = [
    TOK.encode("<|user|>1+1<|end|><|assistant|>"),
    TOK.encode("<|user|>a longer prompt<|end|><|assistant|>"),
]
RESPONSES = [TOK.encode("<answer>2</answer>"), TOK.encode("abc")]


def make_batch() -> RolloutBatch:
    return response_batch(PROMPTS, RESPONSES, TOK.pad_token_id)


def reference(prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one unpadded row, computed directly."""
    with torch.no_grad():
        logits = MODEL(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(response)), torch.tensor(response)], -(logp.exp() * logp).sum(-1)


def test_padding_layout_helpers():
    ids, mask = left_pad([[4, 5], [6]], pad_id=0)
    assert ids.tolist() == [[4, 5], [0, 6]] and mask.tolist() == [[1, 1], [0, 1]]
    assert position_ids(mask).tolist() == [[0, 1], [0, 0]]


@pytest.mark.parametrize("packed", [True, False])
def test_logprobs_and_entropy_match_unpadded_rows(packed):
    with torch.no_grad():
        logp, ent = token_logprobs(MODEL, make_batch(), with_entropy=True, packed=packed)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        ref_logp, ref_ent = reference(p, r)
        assert torch.allclose(logp[i, : len(r)], ref_logp, atol=1e-5)
        assert torch.allclose(ent[i, : len(r)], ref_ent, atol=1e-5)
        assert (logp[i, len(r) :] == 0).all() and (ent[i, len(r) :] == 0).all()


def test_micro_batches_and_no_entropy():
    with torch.no_grad():
        whole, _ = token_logprobs(MODEL, make_batch())
        parts, ent = token_logprobs(MODEL, make_batch(), micro_batch=1)
    assert ent is None
    assert torch.allclose(whole, parts, atol=1e-6)


def test_gradients_flow_under_grad():
    logp, _ = token_logprobs(MODEL, make_batch())
    logp.sum().backward()
    grad = MODEL.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    MODEL.zero_grad(set_to_none=True)


def test_entropy_hand_values():
    uniform = torch.log_softmax(torch.zeros(4), -1)
    assert math.isclose(entropy_from_logp(uniform).item(), math.log(4), rel_tol=1e-6)
    peaked = torch.log_softmax(torch.tensor([0.0, -1e4, -1e4]), -1)
    assert entropy_from_logp(peaked).item() == 0.0
    logits = torch.tensor([1.0, 1.0, float("-inf")], requires_grad=True)
    masked = entropy_from_logp(torch.log_softmax(logits, -1))
    assert math.isclose(masked.item(), math.log(2), rel_tol=1e-6)
    masked.backward()
    assert torch.isfinite(logits.grad).all()


def test_rows_pack_first_fit_decreasing_into_bins_twice_the_longest_row():
    where, offset, width = pack_rows([5, 3, 4, 2, 6])
    assert width == 12
    # longest first: 6 -> bin 0 [0, 6); 5 -> bin 0 [6, 11); 4 -> bin 1; 3 -> bin 1; 2 -> bin 1
    assert where == [0, 1, 1, 1, 0] and offset == [6, 4, 0, 7, 0]


def test_packed_and_padded_layouts_give_the_same_loss_and_gradients():
    """Ragged prompts and responses (one response empty), entropy included: the packed
    layout computes only real tokens, in other shapes, so equal within float rounding."""
    batch = make_batch()
    batch = batch.select([0, 1, 0, 1])
    batch.attention_mask[3] = 0
    batch.response_ids[3] = TOK.pad_token_id
    batch.prompt_ids = [*PROMPTS, PROMPTS[0][2:], PROMPTS[1]]
    a_logp, a_ent, a_grads = scores_and_gradients(MODEL, batch, packed=True, shared=False)
    b_logp, b_ent, b_grads = scores_and_gradients(MODEL, batch, packed=False)
    torch.testing.assert_close(a_logp, b_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=1e-5)
    assert (a_logp[3] == 0).all() and (a_ent[3] == 0).all()
    for a, b in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_packing_needs_a_llama_architecture_model():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(TOK)))
    assert packing_supported(MODEL) and not packing_supported(gpt2)
    with pytest.raises(ValueError, match="packed scoring needs a Llama-architecture model"):
        token_logprobs(gpt2, make_batch(), packed=True)
    logp, _ = token_logprobs(gpt2, make_batch())  # auto: the padded layout
    assert logp.shape == make_batch().response_ids.shape
