"""oneDNN's float32 product on plain weights against PyTorch's (MKL's) on the CPU, one torch
thread: why the update's products stay with MKL.

    python benchmarks/probe_onednn.py --repeats 7 --out FILE

- ``products``: microseconds of each product of one linear layer ``x[M, in] @ W[out,
  in].T`` in float32, by ``torch.mm`` (MKL) and by ``mkldnn::_linear_pointwise`` on the
  plain weight: the forward, the input's gradient ``g @ W`` and the weight's gradient
  ``g.T @ x`` (operands as autograd has them: transposed views), at a GRPO update's
  token-wide shapes of ``tiny`` (1,756 tokens, 128 wide) and ``small`` (2,715, 256 wide),
  and at fewer rows (256, 64, 25) where oneDNN's fixed cost per call shows.
- ``cache_growth``: resident memory after oneDNN products on many distinct row counts (a
  GRPO step's token count differs every step) against as many on one row count.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from _common import median_seconds, probe_cli

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


def _rss_mib() -> float:
    """The process's resident memory now, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cache_growth(shapes: int = 60, k: int = 256, n: int = 1024) -> dict[str, Any]:
    """Resident memory after oneDNN products on ``shapes`` distinct row counts (2,000 +
    16 i, as a GRPO step's token count varies), against as many on one row count: oneDNN
    keeps a primitive per shape in its cache."""
    w = torch.randn(n, k)
    out: dict[str, Any] = {}
    for name, rows in (("one row count", [2000] * shapes),
                       ("distinct row counts", [2000 + 16 * i for i in range(shapes)])):  # fmt: skip
        before = _rss_mib()
        for m in rows:
            _onednn(torch.randn(m, k), w)
        out[name] = {"products": shapes, "rss_growth_mib": round(_rss_mib() - before, 1)}
    return out


def main() -> None:
    if not packed.HAS_ONEDNN:
        raise SystemExit("this PyTorch build has no oneDNN")
    probe_cli(
        __doc__,
        lambda args: {
            "products": product_times(max(args.repeats, 9)),
            "cache_growth": cache_growth(),
        },
    )


if __name__ == "__main__":
    main()
