"""The pieces of a Llama-architecture decoder layer, for the forward passes that run the
layers themselves instead of calling the model's ``forward``.

Two callers need that: the static-cache decoder (``anchor_rl.rollout.decoders``), which
writes keys and values into preallocated buffers, and the shared-prefix scoring pass
(``anchor_rl.models.shared_prefix``), which runs a prompt once for all the responses that
share it. Both use the model's own modules and weights (projections, norms, MLP, rotary
embedding), so gradients reach the model's parameters as through its ``forward``; only the
attention's bookkeeping (which keys a query sees) is theirs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from anchor_rl.models.packed import Linear, plain

LLAMA_LIKE = ("llama", "mistral", "qwen2")
"""``model_type`` values whose decoder layers are plain Llama layers."""


def body(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack of ``model``: ``model.model`` of a causal LM, or the model itself
    when it is the body (a critic's backbone)."""
    return getattr(model, "model", model)


def llama_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model``'s layers cannot be run by these helpers (``None`` when they can): a
    Llama-architecture causal LM or body (Llama, Mistral and Qwen2 without a sliding
    window) with plain attention (q/k/v/o projections, no q/k norms, sinks or
    tensor-parallel split)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_LIKE:
        return f"model_type {kind!r} is not one of {', '.join(LLAMA_LIKE)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    layers = getattr(body(model), "layers", None)
    if layers is None or not hasattr(body(model), "rotary_emb"):
        return "the model has no model.layers / model.rotary_emb"
    attn = layers[0].self_attn
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "its attention has no q/k/v/o projections"
    if not all(hasattr(layers[0].mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return "its MLP is not a gated gate/up/down MLP"
    if (
        any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks", "rotary_fn"))
        or getattr(config, "pretraining_tp", 1) != 1
    ):
        return "its attention is not plain Llama attention"
    return None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[..., D]`` with ``cos``/``sin`` broadcastable to it (half-split
    rotation, as Llama's ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def project(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    linear: Linear = plain,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of ``layer`` for ``hidden[..., H]``, heads split off:
    ``q[..., heads, D]`` and ``k``, ``v`` ``[..., kv_heads, D]``, ``q`` and ``k`` rotated by
    ``cos``/``sin`` (``[..., 1, D]``, the positions' rotary tables). ``linear`` applies the
    projections (:mod:`anchor_rl.models.packed`)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    lead, d = x.shape[:-1], attn.head_dim
    q = rotate(linear(attn.q_proj, x).view(*lead, -1, d), cos, sin)
    k = rotate(linear(attn.k_proj, x).view(*lead, -1, d), cos, sin)
    return q, k, linear(attn.v_proj, x).view(*lead, -1, d)


def finish(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    heads_out: torch.Tensor,
    linear: Linear = plain,
) -> torch.Tensor:
    """The rest of ``layer`` after attention: the output projection of ``heads_out[..., heads
    * D]`` added to ``hidden[..., H]``, then the gated MLP block (``down(act(gate(x)) *
    up(x))``, as the model's own) with its residual. ``linear`` applies the projections."""
    hidden = hidden + linear(layer.self_attn.o_proj, heads_out)
    mlp, x = layer.mlp, layer.post_attention_layernorm(hidden)
    gated = mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x)
    return hidden + linear(mlp.down_proj, gated)
