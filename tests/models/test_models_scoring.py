"""token_logprobs against per-row unpadded forwards; entropy; micro-batching; gradients."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import response_batch, scores_and_gradients
from transformers import GPT2Config, GPT2LMHeadModel

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.factory import build_model
from anchor_rl.models.padding import left_pad, position_ids
from anchor_rl.models.scoring import (
    GPU_PACK_MIN_FLOP,
    ScoringForward,
    entropy_from_logp,
    gpu_packs,
    pack_rows,
    packing_supported,
    pass_layout,
    shares_by_default,
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


def group_batch(prompt_len: int, response_lens: list[int], groups: int = 2) -> RolloutBatch:
    """``groups`` prompts of ``prompt_len`` tokens, each with responses of ``response_lens``."""
    prompts = [[7 + g] * prompt_len for g in range(groups) for _ in response_lens]
    responses = [[9] * n for _ in range(groups) for n in response_lens]
    return response_batch(prompts, responses, TOK.pad_token_id)


CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_gpu_packs_only_passes_of_much_work_with_much_padding():
    short = group_batch(10, [5, 80])  # heavy padding, but ~200 tokens
    skewed = group_batch(200, [64, 64, 64, 1024])  # padded 8 x 1224 against ~3 bins of 2448
    even = group_batch(200, [1024, 1024, 1024, 1024])  # no padding at all
    big = 700_000_000
    real = sum(len(p) for p in short.prompt_ids) + int(short.attention_mask.sum())
    assert 2 * big * real < GPU_PACK_MIN_FLOP <= 2 * big * 4032  # 4032: skewed's real tokens
    assert not gpu_packs(short, big)
    assert gpu_packs(skewed, big) and not gpu_packs(even, big)
    assert not gpu_packs(skewed, 1_000_000)  # the same batch on a small model: launch-bound


def test_pass_layout_defaults_differ_by_device_and_explicit_settings_win():
    short, skewed = group_batch(10, [5, 80]), group_batch(200, [64, 64, 64, 1024])
    distinct = group_batch(10, [5], groups=3)  # no prompt repeats
    assert shares_by_default(CPU) and not shares_by_default(GPU)

    def layout(batch, packed=None, shared=None, can_pack=True, can_share=True, device=CPU):
        return pass_layout(batch, packed, shared, can_pack, can_share, device, 700_000_000)

    # CPU: shared prefixes where a prompt repeats, else packed, whatever the lengths
    assert layout(short) == layout(skewed) == "shared"
    assert layout(distinct) == layout(short, shared=False) == layout(short, can_share=False)
    assert layout(distinct) == "packed"
    # GPU: never shared by default; packed only where gpu_packs
    assert layout(short, device=GPU) == "padded"
    assert layout(skewed, device=GPU) == "packed"
    # explicit settings and what the model allows, on either device
    for device in (CPU, GPU):
        assert layout(short, shared=True, device=device) == "shared"
        assert layout(short, packed=True, shared=False, device=device) == "packed"
        assert layout(skewed, packed=False, device=device) == "padded"
        assert layout(skewed, can_pack=False, device=device) == "padded"


def test_padded_micro_batches_score_only_their_own_columns():
    """A padded micro-batch of short rows is cut to its longest response (RolloutBatch.trimmed)
    and its outputs padded back with zeros: the same numbers as the whole batch."""
    short, long = TOK.encode("abc"), TOK.encode("a much longer response than that")
    batch = response_batch(PROMPTS, [short, long], TOK.pad_token_id)
    n = len(short)
    assert n < batch.response_ids.shape[1]
    widths = []  # the columns each padded pass runs

    class Recording(ScoringForward):
        def forward(self, ids, positions, **kwargs):
            widths.append(ids.shape[1])
            return super().forward(ids, positions, **kwargs)

    whole, whole_ent = token_logprobs(MODEL, batch, with_entropy=True, packed=False)
    with torch.no_grad():
        parts, ent = token_logprobs(
            MODEL, batch, True, micro_batch=1, packed=False, forward=Recording(MODEL)
        )
    assert widths == [len(PROMPTS[0]) + n, len(PROMPTS[1]) + len(long)]
    assert parts.shape == whole.shape == batch.response_ids.shape
    torch.testing.assert_close(parts, whole.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, whole_ent.detach(), rtol=0, atol=1e-5)
    assert (parts[0, n:] == 0).all() and (ent[0, n:] == 0).all()
