"""The layer passes that run a Llama-architecture model's layers outside its ``forward``:
the rotary embedding, a layer through its modules and a layer on prepared weights."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import llama_variants
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from anchor_rl.models import packed
from anchor_rl.models.llama import (
    FrozenLayer,
    ModuleLayer,
    decode_layers,
    frozen_unsupported,
    rms_norm,
    rotary_tables,
    rotate,
)
from anchor_rl.models.packed import PackedProduct
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.engine import cast_parameters

MODELS = llama_variants(build_tokenizer())


def cast_copy(model, dtype: torch.dtype):
    """A copy of ``model`` with ``dtype`` parameters, as the bf16 sampler holds it."""
    return cast_parameters(copy.deepcopy(model), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_the_models_rotary_embedding_bitwise(dtype):
    """``x * cos + roll(x) * signed_sin`` multiplies and adds the same numbers as
    ``apply_rotary_pos_emb``'s ``x * cos + rotate_half(x) * sin``."""
    inner = MODELS["tiny"].model
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 32, generator=gen).to(dtype)  # [B, heads, n, D], HF's layout
    k = torch.randn(3, 4, 5, 32, generator=gen).to(dtype)
    pos = torch.arange(15).view(3, 5) * 7
    cos, sin = inner.rotary_emb(q, pos)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    cos, signed_sin = rotary_tables(inner, q, pos)
    for x, expected in ((q, expected_q), (k, expected_k)):
        got = rotate(x.transpose(1, 2), cos[:, :, None], signed_sin[:, :, None]).transpose(1, 2)
        assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (64, 1, 128), (3, 700, 128), (5, 256)])
def test_rms_norm_is_the_models_norm_bitwise(dtype, shape):
    """The one-operator normalisation gives the module's numbers, not merely close ones."""
    gen = torch.Generator().manual_seed(2)
    norm = MODELS["tiny"].model.layers[0].input_layernorm
    norm = cast_copy(norm, dtype) if dtype != torch.float32 else norm
    hidden_size = shape[-1]
    if norm.weight.shape[0] != hidden_size:
        norm = type(norm)(hidden_size, eps=norm.variance_epsilon).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden_size, generator=gen))
    hidden = (torch.randn(shape, generator=gen) * 3).to(dtype)
    got = rms_norm(hidden, norm.weight.detach(), norm.variance_epsilon)
    assert got.dtype == dtype and torch.equal(got, norm(hidden).detach())


def _hidden(model, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden[2, 6, H]`` and its rotary tables ``[2, 6, 1, D]``."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, model.config.hidden_size, generator=gen).to(dtype)
    cos, sin = rotary_tables(model.model, hidden, torch.arange(12).view(2, 6))
    return hidden, cos[:, :, None], sin[:, :, None]


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_frozen_layer_computes_what_its_modules_compute(name, dtype, pack, monkeypatch):
    """q, k, v and the layer's output on prepared weights (q/k/v and gate/up concatenated,
    packed with the threshold lowered to 1) against the modules: bfloat16 bitwise (the
    same dot products, the same roundings), float32 within its summation order."""
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 1)
    model = MODELS[name] if dtype == torch.float32 else cast_copy(MODELS[name], dtype)
    layer = model.model.layers[0]
    hidden, cos, sin = _hidden(model, dtype)
    with torch.no_grad():
        frozen, modules = FrozenLayer(layer, rows=12, pack=pack), ModuleLayer(layer)
        assert isinstance(frozen.gate_up, PackedProduct) == pack
        got, expected = frozen.project(hidden, cos, sin), modules.project(hidden, cos, sin)
        heads_out = torch.randn(2, 6, model.config.hidden_size).to(dtype)
        got += (frozen.finish(hidden, heads_out),)
        expected += (modules.finish(hidden, heads_out),)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decoding_prepares_layers_only_without_grad_and_for_plain_cpu_layers():
    """With grad, or a layer whose forward would change what a prepared copy computes (a
    hook, say an adapter's), the layers run through their modules."""
    model = MODELS["qwen2"]
    assert all(isinstance(x, ModuleLayer) for x in decode_layers(model.model, 4))  # grad on
    with torch.no_grad():
        assert all(isinstance(x, FrozenLayer) for x in decode_layers(model.model, 4))
        hook = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda _m, _a, out: out)
        try:
            assert "hooks" in frozen_unsupported(model.model.layers[1])
            assert all(isinstance(x, ModuleLayer) for x in decode_layers(model.model, 4))
        finally:
            hook.remove()
    layer = cast_copy(MODELS["llama-gqa"], torch.float32).model.layers[0]
    assert frozen_unsupported(layer) is None
    layer.self_attn.k_proj = torch.nn.Linear(64, 32, bias=True)
    assert "bias" in frozen_unsupported(layer)
    layer.self_attn.k_proj = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    assert "dtype" in frozen_unsupported(layer)
    layer.self_attn.k_proj = torch.nn.Linear(64, 32, bias=False)
    layer.mlp.up_proj = torch.nn.Linear(64, 128, bias=True)
    assert "bias" in frozen_unsupported(layer)
    layer.mlp.up_proj = torch.nn.Linear(64, 128, bias=False)
    layer.input_layernorm = torch.nn.LayerNorm(64)
    assert "RMSNorm" in frozen_unsupported(layer)
