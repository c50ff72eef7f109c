"""Linear layers with pre-packed weights, for the forward passes on the CPU that take no
gradient: sampling (the static decoder) and scoring without grad (the reference's
log-probs, re-scoring, evaluation).

PyTorch's float32 product ``x @ W.T`` on the CPU is MKL's GEMM on the plain ``[out, in]``
weight, at every call (bfloat16 goes to oneDNN). A weight reordered once into oneDNN's
blocked layout (``mkldnn::_reorder_linear_weight``, what ``torch.compile``'s CPU freezing
does) and multiplied by ``mkldnn::_linear_pointwise`` is faster at the shapes of a GRPO
step where the weight is large and slower where it is small, hence
:data:`PACK_MIN_ELEMENTS` (``docs/results.md``, ``benchmarks/probe_packed.py``). Packing
happens once per decoding turn or scoring pass.

The products are the same function; bfloat16 ones are bitwise equal to ``F.linear``'s
(the same oneDNN kernel), float32 ones differ by the summation order (~1e-6 relative).
Only weights on the CPU, in float32 or bfloat16, with grad off are packed; everything
else goes through the module's own ``forward``. ``ANCHOR_RL_PACKED=off`` in the
environment turns packing off (:data:`ENABLED`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]
"""How a forward pass applies one of the model's linear layers to ``x[..., in]``."""

PACK_MIN_ELEMENTS = 1 << 18
"""Weights with fewer elements than this (a 256 x 1024 matrix has this many) keep the
plain product: packing gains nothing at 128 x 512 or 256 x 256 and loses at 128 x 128."""

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def plain(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward."""
    return module(x)


def _has_onednn() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # internal operators of PyTorch's CPU build (torch.compile's freezing uses them)
        torch.ops.mkldnn._reorder_linear_weight.default  # noqa: B018
        torch.ops.mkldnn._linear_pointwise.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


HAS_ONEDNN = _has_onednn()

ENABLED = HAS_ONEDNN and os.environ.get("ANCHOR_RL_PACKED", "on").lower() not in ("0", "off")
"""Whether no-grad passes pack their weights: on wherever PyTorch has oneDNN, unless the
environment sets ``ANCHOR_RL_PACKED=off`` (the packs are a second copy of the packed
weights while a turn or pass runs: mind it for a large model on a small machine)."""


class PackedProduct:
    """``x[..., in] -> x @ weight.T + bias`` with ``weight[out, in]`` reordered for oneDNN
    here, once (a copy: it holds the weight as it is now). ``rows`` is the number of rows a
    product is expected to have (oneDNN picks its blocking for it; any number works)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, rows))
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class PackedLinears:
    """``linear(module, x)`` with the weights of ``modules`` that are worth it packed once,
    here (:class:`PackedProduct`); other modules run their own forward.

    The packs are copies: they hold the weights as they are now, so build a new
    ``PackedLinears`` after the weights change (the decoder packs once per turn).
    """

    def __init__(self, modules: list[nn.Linear], rows: int):
        self.packed: dict[nn.Linear, PackedProduct] = {
            m: PackedProduct(m.weight, m.bias, rows) for m in modules if _worth_packing(m)
        }

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        product = self.packed.get(module)
        return module(x) if product is None else product(x)

    def __len__(self) -> int:
        return len(self.packed)


def _worth_packing(module: nn.Linear) -> bool:
    return (
        type(module) is nn.Linear and worth_packing(module.weight, module.bias) and unhooked(module)
    )


def unhooked(module: nn.Module) -> bool:
    """Whether ``module`` has no forward hooks, which a pass that applies its weights
    itself instead of calling it would skip."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def packing_on() -> bool:
    """Whether a pass without gradients packs its weights now: :data:`ENABLED`, and CPU
    autocast off (``optim.autocast=bf16``: autocast does not cast for a packed product)."""
    return ENABLED and not torch.is_autocast_enabled("cpu")


def worth_packing(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a product with ``weight[out, in]`` (and ``bias``) gains from packing: a CPU
    weight of a packed dtype with at least :data:`PACK_MIN_ELEMENTS` elements."""
    return (
        HAS_ONEDNN
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.numel() >= PACK_MIN_ELEMENTS
        and (bias is None or bias.dtype == weight.dtype)
    )


Product = Callable[[torch.Tensor], torch.Tensor]
"""``x[..., in] -> x @ weight.T + bias``, for one prepared weight."""


def prepared_product(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int, pack: bool
) -> Product:
    """The product with ``weight[out, in]`` and ``bias[out]`` for a pass without gradients:
    a :class:`PackedProduct` when ``pack`` and :func:`worth_packing`, else ``F.linear`` on
    the tensors themselves."""
    if pack and worth_packing(weight, bias):
        return PackedProduct(weight, bias, rows)
    return functools.partial(F.linear, weight=weight, bias=bias)


def linears_for(model: nn.Module, rows: int) -> Linear:
    """How a forward pass of ``model`` without gradients should apply its linear layers:
    packed where :class:`PackedLinears` packs any, else :func:`plain`. With grad enabled
    (an update's forward) always :func:`plain`: the packed product has no backward; so
    too where :func:`packing_on` says no."""
    if torch.is_grad_enabled() or not packing_on():
        return plain
    # a LoRA layer's base layer runs inside the LoRA layer's own forward: packing it would
    # only copy its weights (anchor_rl.models.lora)
    wrapped = {id(m.base_layer) for m in model.modules() if hasattr(m, "lora_A")}
    modules = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in wrapped]
    packed = PackedLinears(modules, rows)
    return packed if len(packed) else plain
