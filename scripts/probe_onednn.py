"""oneDNN's float32 product on plain weights against PyTorch's (MKL's) on the CPU, one torch
thread.

    python scripts/probe_onednn.py sft:tiny random:small --repeats 7 --out FILE

The figures behind ``anchor_rl.models.packed.onednn`` (and its ``ONEDNN_MIN_ROWS``):

- ``products``: microseconds of each product of one linear layer ``x[M, in] @ W[out,
  in].T`` in float32, by ``torch.mm`` (MKL) and by ``mkldnn::_linear_pointwise`` on the
  plain weight: the forward, the input's gradient ``g @ W`` and the weight's gradient
  ``g.T @ x`` (operands as autograd has them: transposed views), at a GRPO update's
  token-wide shapes of ``tiny`` (1,756 tokens, 128 wide) and ``small`` (2,715, 256 wide),
  and at fewer rows (256, 64, 25) where oneDNN's fixed cost per call shows.
- ``layers``: milliseconds of one layer's forward and backward, ``F.linear`` against
  ``packed.onednn``, at the same token-wide shapes.
- ``updates``: for each model spec, one GRPO step's update compute on its rollout (8
  arithmetic training prompts x 8 responses, <= 80 new tokens, T = 1, seed 0): the
  policy's token log-probs in the shared-prefix layout with grad, and their backward,
  with the token-wide products on MKL and on oneDNN, alternating in one process (the
  weights do not change: no optimiser step). Median seconds.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from anchor_rl.bench.throughput import grpo_step_call, median_seconds, probe_cli
from anchor_rl.models import packed

SHAPES = {
    "tiny": [(1756, 128, 512), (1756, 512, 128), (1756, 128, 128)],
    "small": [(2715, 256, 1024), (2715, 1024, 256), (2715, 256, 256),
              (256, 256, 1024), (64, 256, 1024), (25, 256, 256)],
}  # fmt: skip


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, tuple]:
    """A layer's three products, each ``(by MKL, by oneDNN)``, operands as autograd has them."""
    return {
        "forward": (lambda: torch.mm(x, w.t()), lambda: _onednn(x, w)),
        "input grad": (lambda: torch.mm(g, w), lambda: _onednn(g, w.t())),
        "weight grad": (lambda: torch.mm(g.t(), x), lambda: _onednn(g.t(), x.t())),
    }


def product_times(repeats: int, shapes: dict[str, list] = SHAPES) -> dict[str, Any]:
    """Microseconds of the forward and both gradients' products, MKL and oneDNN."""
    out: dict[str, Any] = {}
    for size, rows in shapes.items():
        for m, k, n in rows:
            products = _products(torch.randn(m, k), torch.randn(n, k), torch.randn(m, n))
            for name, (mkl, onednn) in products.items():
                a, b = median_seconds(mkl, repeats), median_seconds(onednn, repeats)
                out[f"{size} [{m}, {k}] x [{k}, {n}] {name}"] = {
                    "mkl_us": round(a * 1e6, 1),
                    "onednn_us": round(b * 1e6, 1),
                    "ratio": round(a / b, 3),
                }
    return out


def _layer_step(
    layer: torch.nn.Linear, x: torch.Tensor, g: torch.Tensor, onednn: bool
) -> Callable[[], Any]:
    """One forward and backward of ``layer`` on ``x`` (gradient ``g``)."""
    forward = packed.onednn if onednn else (lambda module, x: F.linear(x, module.weight))
    return lambda: torch.autograd.grad(forward(layer, x), [x, layer.weight], g)


def layer_times(repeats: int, shapes: dict[str, list] = SHAPES) -> dict[str, Any]:
    """Milliseconds of one layer's forward and backward: ``F.linear`` and ``packed.onednn``."""
    out: dict[str, Any] = {}
    for size, rows in shapes.items():
        for m, k, n in rows:
            if m < packed.ONEDNN_MIN_ROWS:
                continue  # onednn would run F.linear
            layer = torch.nn.Linear(k, n, bias=False)
            x, g = torch.randn(m, k, requires_grad=True), torch.randn(m, n)
            plain = median_seconds(_layer_step(layer, x, g, onednn=False), repeats)
            fast = median_seconds(_layer_step(layer, x, g, onednn=True), repeats)
            out[f"{size} [{m}, {k}] x [{k}, {n}]"] = {
                "plain_ms": round(plain * 1e3, 3),
                "onednn_ms": round(fast * 1e3, 3),
                "ratio": round(plain / fast, 3),
            }
    return out


def update_times(spec: str, rounds: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Median seconds of one step's policy forward and backward, MKL and oneDNN products."""
    from anchor_rl.models.scoring import token_logprobs
    from anchor_rl.rollout.engine import make_engine

    model, tokenizer, call = grpo_step_call(spec, max_new_tokens)
    batch = make_engine("hf", model, tokenizer).rollout(*call)
    model.train()

    def update() -> None:
        model.zero_grad(set_to_none=True)
        token_logprobs(model, batch, shared=True)[0].sum().backward()

    times: dict[str, list[float]] = {"mkl": [], "onednn": []}
    saved = packed.ONEDNN_MIN_ROWS
    try:
        for _ in range(rounds):
            for name, rows in (("mkl", 1 << 62), ("onednn", saved)):
                packed.ONEDNN_MIN_ROWS = rows
                times[name].append(median_seconds(update, 1))
    finally:
        packed.ONEDNN_MIN_ROWS = saved
    medians = {k: round(statistics.median(v), 4) for k, v in times.items()}
    return {
        "spec": spec,
        "tokens": int(batch.attention_mask.sum()),
        "seconds": medians,
        "ratio": round(medians["mkl"] / medians["onednn"], 3),
    }


def main() -> None:
    if not packed.ENABLED:
        raise SystemExit("oneDNN is off: not in this PyTorch build, or ANCHOR_RL_PACKED=off")
    probe_cli(
        __doc__,
        lambda args: {
            "products": product_times(max(args.repeats, 9)),
            "layers": layer_times(max(args.repeats, 9)),
            "updates": [update_times(spec, args.repeats) for spec in args.specs],
        },
    )


if __name__ == "__main__":
    main()
