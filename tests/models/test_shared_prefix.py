"""The shared-prefix scoring layout: its index tensors on a hand example, and its log-probs,
entropies and gradients against the padded layout (ragged prompts, groups of different
sizes, an empty response, grouped-query attention, attention biases); when it is chosen."""

from __future__ import annotations

import pytest
import torch
from helpers import llama_variants, response_batch, scores_and_gradients
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from anchor_rl.models import llama, packed, scoring, shared_prefix
from anchor_rl.models.packed import PackedLinears, linears_for, plain
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.models.shared_prefix import (
    SharedPrefixLayout,
    has_shared_prompt,
    shared_prefix_unsupported,
)
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import ConfigError, load_config

TOK = build_tokenizer()
PAD = TOK.pad_token_id
MODELS = llama_variants(TOK)


def make_batch(prompts: list[list[int]], responses: list[list[int]]):
    return response_batch(prompts, responses, PAD)


def test_layout_of_a_hand_example(monkeypatch):
    """Two rows share prompt [5, 6, 7]; one row has prompt [8] and an empty response."""
    batch = make_batch([[5, 6, 7], [8], [5, 6, 7]], [[10, 11], [], [12, 13, 14]])
    layout = SharedPrefixLayout.of(batch)
    assert layout.prompt_ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert layout.prompt_pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert layout.prompt_of.tolist() == [0, 1, 0]
    # bucket order: the longest row first; the empty row is in no bucket
    assert layout.tokens.tolist() == [12, 13, 14, 10, 11]
    assert layout.token_pos.tolist() == [3, 4, 5, 3, 4]  # positions continue the prompt's
    (bucket,) = layout.buckets
    assert (bucket.start, bucket.stop, bucket.width) == (0, 5, 3)
    assert bucket.rows.tolist() == [2, 0] and bucket.prompt_of.tolist() == [0, 0]
    assert bucket.cells.tolist() == [0, 1, 2, 3, 4]
    # flat order (the outputs'): row by row, rows in order
    assert layout.row_of.tolist() == [0, 0, 2, 2, 2] and layout.t_of.tolist() == [0, 1, 0, 1, 2]
    # token 0 of a row <- its prompt's last state (0); token t <- the state before it, at
    # 2 + its bucket-order index - 1 (row 0's tokens are at 3 and 4, row 2's at 0, 1, 2)
    assert layout.predictor.tolist() == [0, 5, 0, 2, 3]
    monkeypatch.setattr(shared_prefix, "BUCKET_ROWS", 1)  # a grid per row
    one, two = SharedPrefixLayout.of(batch).buckets
    assert (one.start, one.stop, one.width, one.rows.tolist()) == (0, 3, 3, [2])
    assert (two.start, two.stop, two.width, two.rows.tolist()) == (3, 5, 2, [0])
    assert two.cells.tolist() == [0, 1]


@pytest.mark.parametrize("bucket_rows", [16, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_shared_and_padded_layouts_give_the_same_logprobs_entropies_and_gradients(
    name, bucket_rows, monkeypatch
):
    """With one attention grid for every row (16) and with several (2: rows of different
    lengths in buckets of two)."""
    monkeypatch.setattr(shared_prefix, "BUCKET_ROWS", bucket_rows)
    model = MODELS[name].train()
    p1, p2, p3 = [5, 20, 21, 30, 31], [40, 41], [9, 60, 61]
    prompts = [p1, p2, p1, p3, p1, p2, p1]  # groups of 4, 2 and 1
    responses = [[11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21], [], [22, 23, 24], [25]]
    batch = make_batch(prompts, responses)
    a_logp, a_ent, a_grads = scores_and_gradients(model, batch, shared=True)
    b_logp, b_ent, b_grads = scores_and_gradients(model, batch, packed=False)
    torch.testing.assert_close(a_logp, b_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=1e-5)
    assert (a_logp[4] == 0).all() and (a_logp[1, 1:] == 0).all()  # no tokens, no log-probs
    for a, b in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_cpu_bf16_passes_pad_their_rows_and_give_the_same_logprobs_and_gradients(name, monkeypatch):
    """Under bf16 autocast on the CPU the token-wide products run on rows padded to a
    multiple of ROW_MULTIPLE (stable shapes for oneDNN's primitive cache): the padding rows
    attend to nothing and reach no output, so log-probs, entropies and gradients are those
    of the unpadded pass, within the rounding of another summation length. float32 pads
    nothing."""
    model = MODELS[name].train()
    p1, p2 = [5, 20, 21, 30, 31], [40, 41]
    batch = make_batch([p1, p2, p1, p2], [[11, 12, 13], [14], [15, 16, 17, 18, 19], []])
    heads = []  # the rows the output layer ran on
    hook = model.lm_head.register_forward_hook(lambda _m, args, _o: heads.append(len(args[0])))
    runs = {}
    for multiple in (1, 8):
        monkeypatch.setattr(shared_prefix, "ROW_MULTIPLE", multiple)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[multiple] = scores_and_gradients(model, batch, shared=True)
    scores_and_gradients(model, batch, shared=True)  # float32: no padding
    hook.remove()
    assert heads == [9, 16, 9]  # 9 response tokens; padded to 16 in bf16 only
    (a_logp, a_ent, a_grads), (b_logp, b_ent, b_grads) = runs[1], runs[8]
    torch.testing.assert_close(a_logp, b_logp, rtol=0, atol=1e-2)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=1e-2)
    for a, b in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    assert shared_prefix.padded_rows(9, torch.zeros(1, dtype=torch.bfloat16)) == 7
    assert shared_prefix.padded_rows(9, torch.zeros(1)) == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_scoring_without_grad_packs_the_weights_and_gives_the_same_logprobs(name, monkeypatch):
    """The reference's pass (no grad) runs the projections with packed weights (threshold
    lowered to 1: these models' weights are below the real one); a pass with grad never."""
    monkeypatch.setattr(packed, "ENABLED", True)
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 1)
    chosen = []

    def spy(inner, rows):
        chosen.append(linears_for(inner, rows))
        return chosen[-1]

    monkeypatch.setattr(llama, "linears_for", spy)
    model = MODELS[name].eval()
    batch = make_batch([[5, 20, 21], [40, 41], [5, 20, 21]], [[11, 12, 13], [14], [15, 16]])
    with torch.no_grad():
        a_logp, a_ent = token_logprobs(model, batch, with_entropy=True, shared=True)
        b_logp, b_ent = token_logprobs(model, batch, with_entropy=True, packed=False)
    assert isinstance(chosen[-1], PackedLinears) and len(chosen[-1]) > 0
    torch.testing.assert_close(a_logp, b_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=1e-5)
    token_logprobs(model, batch, shared=True)  # grad on
    assert chosen[-1] is plain


def test_a_batch_of_empty_responses_scores_to_zeros():
    batch = make_batch([[5, 6], [5, 6]], [[], []])
    logp, ent = token_logprobs(MODELS["tiny"], batch, with_entropy=True, shared=True)
    assert logp.shape == (2, 0) and ent.shape == (2, 0)


def test_auto_shares_only_where_a_prompt_repeats(monkeypatch):
    calls = []
    real = scoring._shared_logits
    monkeypatch.setattr(scoring, "_shared_logits", lambda *a: calls.append(len(a[2])) or real(*a))
    model = MODELS["tiny"].eval()
    repeated = make_batch([[5, 6], [7], [5, 6], [7]], [[10], [11], [12], [13]])
    distinct = make_batch([[5, 6], [7]], [[10], [11]])
    with torch.no_grad():
        token_logprobs(model, distinct)
        assert calls == []
        token_logprobs(model, repeated, micro_batch=2)  # each pass of 2 rows: distinct prompts
        assert calls == []
        token_logprobs(model, repeated)
        assert calls == [4]
        token_logprobs(model, repeated, shared=False)
        assert calls == [4]
    assert has_shared_prompt([[1, 2], [1, 2]]) and not has_shared_prompt([[1, 2], [1]])


def test_models_the_layout_cannot_run_are_named_or_fall_back():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(TOK)))
    batch = make_batch([[5, 6], [5, 6]], [[10], [11]])
    assert "model_type 'gpt2'" in shared_prefix_unsupported(gpt2)
    with pytest.raises(ValueError, match="shared-prefix scoring cannot run GPT2LMHeadModel"):
        token_logprobs(gpt2, batch, shared=True)
    logp, _ = token_logprobs(gpt2, batch)  # auto: the padded layout
    assert logp.shape == (2, 1) and (logp < 0).all()
    with pytest.raises(ValueError, match="cannot run with packed=False"):
        token_logprobs(MODELS["tiny"], batch, shared=True, packed=False)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=len(TOK))
    dropout = LlamaForCausalLM(LlamaConfig(attention_dropout=0.1, **small)).train()
    assert "attention dropout" in shared_prefix_unsupported(dropout)
    assert shared_prefix_unsupported(dropout.eval()) is None  # no dropout in eval mode


def test_config_refuses_shared_prefix_without_padding_free():
    with pytest.raises(ConfigError, match="shared-prefix forward is padding-free"):
        load_config("grpo", ["optim.shared_prefix=on", "optim.padding_free=off"])
    assert load_config("grpo", []).optim.shared_prefix == "auto"


def test_bf16_attention_on_the_cpu_runs_in_float32():
    """Under bf16 autocast (the update's ``optim.autocast=bf16``) and for bfloat16 inputs, the
    layout's attention is float32 attention of the same inputs, in ``v``'s dtype, with
    gradients; the CPU's bfloat16 kernel would give other numbers (and a ~4x slower backward)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from anchor_rl.models.shared_prefix import _attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 5, 8, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 1, 5, 5)
    expected = sdpa(q.float(), k.float(), v.float(), attn_mask=allowed, scale=0.3)
    expected = expected.to(torch.bfloat16).transpose(1, 2).flatten(2)
    in_bf16 = sdpa(q, k, v, attn_mask=allowed, scale=0.3).transpose(1, 2).flatten(2)
    assert not torch.equal(in_bf16, expected)  # the check below can tell the two apart
    assert torch.equal(_attend(q, k, v, allowed, 0.3), expected)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _attend(leaves[0], leaves[1], leaves[2].to(torch.bfloat16), allowed, 0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in leaves)


def test_grouped_heads_expanded_for_the_masked_cuda_kernels_give_the_same_attention(monkeypatch):
    """Grouped-query attention with a mask: on CUDA the key/value heads are repeated before
    the call (PyTorch's fused kernels take a mask or grouped heads, not both), elsewhere
    ``enable_gqa`` is passed; the two compute the same function, values and gradients."""
    from anchor_rl.models.shared_prefix import _attend, expand_kv_heads

    assert expand_kv_heads("cuda") and not expand_kv_heads("cpu")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 5, 4, generator=gen, requires_grad=True)  # 8 query heads
    k, v = (torch.randn(3, 2, 5, 4, generator=gen, requires_grad=True) for _ in range(2))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 1, 5, 5)
    outs, grads = [], []
    for expand in (False, True):
        monkeypatch.setattr(shared_prefix, "expand_kv_heads", lambda device, e=expand: e)
        out = _attend(q, k, v, allowed, 0.5)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert outs[0].shape == (3, 5, 8 * 4)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for expanded, grouped in zip(*grads, strict=True):
        torch.testing.assert_close(expanded, grouped, rtol=1e-5, atol=1e-6)
    # the pairing of heads is the one enable_gqa uses: query head h reads key head h // 4
    moved = k.detach().clone()
    moved[:, 1] += 1.0  # changes what query heads 4..7 attend to, not heads 0..3
    changed = (_attend(q, moved, v, allowed, 0.5) - outs[1]).abs().view(3, 5, 8, 4)
    assert changed[:, :, :4].max() == 0 and changed[:, :, 4:].max() > 0


def test_cuda_attention_leaves_the_cudnn_backend_out(monkeypatch):
    """On CUDA the layout's attention runs with cuDNN's SDPA backend disabled (it plans every
    new shape) and the others enabled, restored afterwards; ``SDPA_CUDNN`` keeps PyTorch's
    choice, as does every other device."""
    from anchor_rl.models.shared_prefix import sdpa_backends

    cuda = torch.backends.cuda
    before = cuda.cudnn_sdp_enabled(), cuda.mem_efficient_sdp_enabled()
    assert before == (True, True)  # PyTorch's defaults: the check below can fail
    with sdpa_backends("cuda"):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.mem_efficient_sdp_enabled() and cuda.flash_sdp_enabled()
        assert cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    with sdpa_backends("cpu"):
        assert cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(shared_prefix, "SDPA_CUDNN", True)
    with sdpa_backends("cuda"):
        assert cuda.cudnn_sdp_enabled()
