"""oneDNN's products on the CPU: pre-packed weights for the forward passes that take no
gradient (sampling with the static decoder; scoring without grad: the reference's
log-probs, re-scoring, evaluation), and oneDNN's product on the plain weight for the
token-wide products of every pass, the update's included (:func:`onednn`).

PyTorch's float32 product ``x @ W.T`` on the CPU is MKL's GEMM on the plain ``[out, in]``
weight, at every call (bfloat16 goes to oneDNN). A weight reordered once into oneDNN's
blocked layout (``mkldnn::_reorder_linear_weight``, what ``torch.compile``'s CPU freezing
does) and multiplied by ``mkldnn::_linear_pointwise`` is faster at the shapes of a GRPO
step where the weight is large: on the 2-core AMD EPYC of ``docs/results.md``, one thread,
a ``[25, 256] x [256, 1024]`` decode product takes 133 µs instead of 172 in float32 and 76
instead of 88 in bfloat16, a ``[2809, 256] x [256, 1024]`` scoring one 13.7 ms instead of
16.7; a ``[64, 128] x [128, 512]`` one gains nothing in float32 and a ``[20, 128] x [128,
128]`` one takes twice as long, hence :data:`PACK_MIN_ELEMENTS`. Packing takes ~1 ms per
million weights, once per decoding turn or scoring pass (``scripts/probe_packed.py``).
Without packing, ``_linear_pointwise`` on the plain weight is still faster than MKL from a
few hundred rows on, forward and for the input's gradient (:data:`ONEDNN_MIN_ROWS`,
``scripts/probe_onednn.py``): so a pass's token-wide products that are not packed, and
those of the update, which a packed weight cannot serve (it has no backward), go there.

The products are the same function; bfloat16 ones are bitwise equal to ``F.linear``'s
(the same oneDNN kernel), float32 ones differ by the summation order (~1e-6 relative).
Only weights on the CPU are packed or sent to oneDNN; everything else goes through the
module's own ``forward``. ``ANCHOR_RL_PACKED=off`` in the environment turns both off
(:data:`ENABLED`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

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
"""Whether no-grad passes pack their weights and token-wide products go to oneDNN: on
wherever PyTorch has oneDNN, unless the environment sets ``ANCHOR_RL_PACKED=off`` (the
packs are a second copy of the packed weights while a turn or pass runs: mind it for a
large model on a small machine)."""


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
        return onednn(module, x) if product is None else product(x)

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
    """Whether a pass packs its weights (without gradients) and sends its token-wide
    products to oneDNN now: :data:`ENABLED`, and CPU autocast off (``optim.autocast=bf16``:
    autocast does not cast for these products)."""
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
    """How a forward pass of ``model`` of about ``rows`` rows should apply its linear layers.
    Without gradients: packed where :class:`PackedLinears` packs any, the rest through
    :func:`onednn`. With grad enabled (an update's forward): :func:`onednn`, whose backward
    is written out (a packed weight has none). :func:`plain` where :func:`packing_on` says
    no."""
    if not packing_on():
        return plain
    if torch.is_grad_enabled():
        return onednn
    modules = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed = PackedLinears(modules, rows)
    return packed if len(packed) else onednn


ONEDNN_MIN_ROWS = 256
"""Float32 products of at least this many rows go to oneDNN on the plain weight
(:func:`onednn`). On the EPYC core of ``docs/results.md``, one thread
(``scripts/probe_onednn.py``, ``docs/results/throughput-decode/onednn.json``): at a GRPO
update's 2,715 tokens of ``small`` the forward products take 1.17-1.29x less time than
MKL's and the input-gradient ones 1.19-1.58x (``[2715, 256] x [256, 1024]`` forward 14.3
against 17.7 ms), at 256 rows 1.31x and 1.49x; below a few dozen rows oneDNN's fixed cost
per call outweighs the product (``[25, 256] x [256, 256]`` forward 87 against 54 µs): so
the update's and scoring's token-wide products qualify, the decoder's and a pass's
prompt-wide ones do not."""


def onednn(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through oneDNN's product on the plain weight where that is faster: a
    plain, unhooked float32 ``nn.Linear`` on the CPU (outside autocast) applied to at
    least :data:`ONEDNN_MIN_ROWS` rows of float32 ``x[..., in]``. Gradients flow
    (:class:`OneDNNProduct`); the result equals ``F.linear``'s within the summation order
    (~1e-6 relative). Anything else runs the module's own forward."""
    weight, bias = module.weight, module.bias
    if (
        type(module) is nn.Linear
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32)
        and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]
        and unhooked(module)
        and not torch.is_autocast_enabled("cpu")
    ):
        return OneDNNProduct.apply(x, weight, bias)
    return module(x)


class OneDNNProduct(torch.autograd.Function):
    """``x[..., in] @ weight[out, in].T + bias[out]`` by oneDNN's product on the plain
    weight, forward and for the gradient of ``x`` (``grad @ weight``, the weight read
    through its transpose, as fast as a contiguous copy would be). The weight's gradient
    ``grad.T @ x`` stays with ``torch.mm`` (MKL), which oneDNN does not beat on those
    transposed operands (measured in ``docs/results.md``). Not twice differentiable."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])  # [rows, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            product = torch.ops.mkldnn._linear_pointwise(flat, weight.t(), None, "none", [], "")
            grad_x = product.view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias
