"""The pieces of a Llama-architecture decoder layer, for the forward passes that run the
layers themselves instead of calling the model's ``forward``.

Two callers need that: the static-cache decoder (``anchor_rl.rollout.decoders``), which
writes keys and values into preallocated buffers, and the shared-prefix scoring pass
(``anchor_rl.models.shared_prefix``), which runs a prompt once for all the responses that
share it. Only the attention's bookkeeping (which keys a query sees) is theirs; the rest
of a layer is a :class:`LayerPass`: :class:`ModuleLayer` runs the layer's own modules, so
gradients reach the model's parameters as through its ``forward`` (the update, scoring);
:class:`FrozenLayer` computes the same on weights prepared once for a decoding turn on
the CPU, where a small model's step is bound by the number of operators.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, activations

from anchor_rl.models import packed
from anchor_rl.models.packed import Linear, Product, linears_for, plain, prepared_product

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


def rotary_tables(
    inner: torch.nn.Module, x: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``cos`` and ``signed_sin`` ``[B, n, D]`` of positions ``pos[B, n]``
    (``x`` gives the dtype), from the model's own rotary embedding: ``signed_sin`` is its
    ``sin`` with the first half of the dimensions negated, as :func:`rotate` takes it."""
    cos, sin = inner.rotary_emb(x, pos)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def static_rope(inner: torch.nn.Module) -> bool:
    """Whether the rotary embedding of ``inner`` gives a position the same table whatever
    other positions it is asked for: not a ``dynamic`` or ``longrope`` RoPE, whose
    frequencies transformers recomputes from the longest position of a call."""
    kind = getattr(inner.rotary_emb, "rope_type", "default")
    return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[..., D]`` with tables broadcastable to it (half-split
    rotation, as Llama's ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``).
    ``rotate_half(x) * sin`` is ``roll(x, D / 2) * signed_sin`` (:func:`rotary_tables`), the
    same products (a sign moved from one factor to the other is exact) in one operator
    where ``rotate_half`` takes four."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LayerPass(Protocol):
    """One decoder layer of a pass that runs the layers itself, around its attention."""

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values for ``hidden[..., H]``, heads split off: ``q[...,
        heads, D]`` and ``k``, ``v`` ``[..., kv_heads, D]``, ``q`` and ``k`` rotated by
        ``cos``/``signed_sin`` (``[..., 1, D]``, :func:`rotary_tables`)."""
        ...

    def finish(self, hidden: torch.Tensor, heads_out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: the output projection of ``heads_out[...,
        heads * D]`` added to ``hidden[..., H]``, then the gated MLP block (``down(act(gate(x))
        * up(x))``) with its residual."""
        ...


class ModuleLayer:
    """A decoder layer run through its own modules (norms, projections, activation), so
    gradients reach its parameters as through the model's ``forward`` and any hook runs.
    ``linear`` applies the projections (packed weights in a pass without grad,
    :mod:`anchor_rl.models.packed`)."""

    def __init__(self, layer: nn.Module, linear: Linear = plain):
        self.layer, self.linear = layer, linear

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, linear = self.layer.self_attn, self.linear
        x = self.layer.input_layernorm(hidden)
        lead, d = x.shape[:-1], attn.head_dim
        q = rotate(linear(attn.q_proj, x).view(*lead, -1, d), cos, signed_sin)
        k = rotate(linear(attn.k_proj, x).view(*lead, -1, d), cos, signed_sin)
        return q, k, linear(attn.v_proj, x).view(*lead, -1, d)

    def finish(self, hidden: torch.Tensor, heads_out: torch.Tensor) -> torch.Tensor:
        layer, linear = self.layer, self.linear
        hidden = hidden + linear(layer.self_attn.o_proj, heads_out)
        mlp, x = layer.mlp, layer.post_attention_layernorm(hidden)
        gated = mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x)
        return hidden + linear(mlp.down_proj, gated)


SILU = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))
"""The activation modules that compute ``F.silu``."""


class FrozenLayer:
    """A decoder layer's weights prepared once for a pass without gradients on the CPU:
    q, k and v as one product and gate and up as another (their weights concatenated),
    each product's weight packed for oneDNN where that pays (``pack``, ``rows``:
    :func:`~anchor_rl.models.packed.prepared_product`), and the norms and the activation
    computed as the modules compute them, without a module call.

    On the CPU a small model's decode step is bound by dispatch, not arithmetic, so four
    products in place of seven and no module calls sample faster (``docs/results.md``). The
    outputs are the modules': the same operations on the same values, bfloat16 products bitwise (each
    output is the same dot product), float32 ones within their summation order. The
    concatenated weights are copies made here: prepare again after the weights change
    (the decoder does, once per turn).
    """

    def __init__(self, layer: nn.Module, rows: int, pack: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim = d = attn.head_dim
        self.split_qk = (attn.q_proj.out_features // d, attn.k_proj.out_features // d)
        self.split_qkv = (sum(self.split_qk), attn.v_proj.out_features // d)
        self.inner_size = mlp.gate_proj.out_features
        self.qkv = _product((attn.q_proj, attn.k_proj, attn.v_proj), rows, pack)
        self.o = _product((attn.o_proj,), rows, pack)
        self.gate_up = _product((mlp.gate_proj, mlp.up_proj), rows, pack)
        self.down = _product((mlp.down_proj,), rows, pack)
        self.norms = [
            (norm.weight.detach(), norm.variance_epsilon)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        self.act = F.silu if isinstance(mlp.act_fn, SILU) else mlp.act_fn

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = rms_norm(hidden, *self.norms[0])
        qkv = self.qkv(x).view(*x.shape[:-1], -1, self.head_dim)
        qk, v = qkv.split(self.split_qkv, dim=-2)
        q, k = rotate(qk, cos, signed_sin).split(self.split_qk, dim=-2)  # both in one go
        return q, k, v

    def finish(self, hidden: torch.Tensor, heads_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.o(heads_out)
        gate, up = self.gate_up(rms_norm(hidden, *self.norms[1])).split(self.inner_size, -1)
        return hidden + self.down(self.act(gate) * up)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (as ``LlamaRMSNorm.forward``, Mistral's and Qwen2's): normalised in
    float32, cast back to ``hidden``'s dtype, then scaled by ``weight``. The normalisation is
    PyTorch's one operator (``F.rms_norm``) where the module spells out six; the same values
    (bitwise, float32 and bfloat16, in the tests). In float32 the weight's product is inside the operator too
    (the same product in the same order: bitwise), and no cast is dispatched."""
    if hidden.dtype == weight.dtype == torch.float32:
        return F.rms_norm(hidden, hidden.shape[-1:], weight, eps)
    x = F.rms_norm(hidden.to(torch.float32), hidden.shape[-1:], None, eps)
    return weight * x.to(hidden.dtype)


def _product(modules: tuple[nn.Linear, ...], rows: int, pack: bool) -> Product:
    if len(modules) == 1:
        weight, bias = modules[0].weight, modules[0].bias
    else:
        weight = torch.cat([m.weight for m in modules])
        biases = [m.bias for m in modules]
        bias = None if biases[0] is None else torch.cat(biases)  # all or none (frozen_unsupported)
    return prepared_product(weight.detach(), None if bias is None else bias.detach(), rows, pack)


def frozen_unsupported(layer: nn.Module) -> str | None:
    """Why :class:`FrozenLayer` cannot run ``layer`` (``None`` when it can): its linear
    layers must be plain ``nn.Linear`` without hooks (an adapter's forward would be
    skipped), on the CPU (on a GPU the concatenated q/k/v and gate/up would be a second
    copy of most of the weights, for launches a CUDA graph makes free), of one dtype,
    q/k/v (and gate/up) all with a bias or none; its norms Llama RMSNorms without hooks."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    all_linear = all(type(m) is nn.Linear for m in linears)
    if not all_linear or not all(map(packed.unhooked, [*linears, *norms])):
        return "its linear layers or norms carry hooks or are not plain nn.Linear"
    if any(m.weight.device.type != "cpu" for m in linears):
        return "its weights are not on the CPU"
    if len({m.weight.dtype for m in linears}) > 1:
        return "its linear layers differ in dtype"
    groups = [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]
    if any(len({m.bias is None for m in group}) > 1 for group in groups):
        return "only some of q, k and v (or of gate and up) have a bias"
    if not all(
        type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms
    ):
        return "its norms are not Llama RMSNorms"
    return None


def module_layers(inner: nn.Module, rows: int) -> list[ModuleLayer]:
    """The decoder layers of ``inner`` run through their modules, for a pass of ``rows``
    rows, with packed weights when no gradient is taken (``packed.linears_for``). The
    scoring passes run so: at their thousands of rows the prepared layers gain nothing
    (their q, k and v are strided views of one product)."""
    linear = linears_for(inner, rows)
    return [ModuleLayer(layer, linear) for layer in inner.layers]


def decode_layers(inner: nn.Module, rows: int) -> list[LayerPass]:
    """The decoder layers of ``inner`` for a decoding turn of ``rows`` rows: each a
    :class:`FrozenLayer`, packed where ``packed.packing_on`` (not with
    ``ANCHOR_RL_PACKED=off`` or under CPU autocast, which casts for the unpacked products
    only); :func:`module_layers` with grad enabled or where :func:`frozen_unsupported`
    says so (on a GPU, for one)."""
    layers = list(inner.layers)
    if torch.is_grad_enabled() or any(frozen_unsupported(layer) for layer in layers):
        return module_layers(inner, rows)
    return [FrozenLayer(layer, rows, packed.packing_on()) for layer in layers]
