"""Attention on the CPU: the update's shared-prefix attention and the sampler's cache reads.

    python benchmarks/probe_attention.py sft:tiny random:small --repeats 5 --out FILE

Two measurements, one torch thread, the figures behind three choices of the code:

- ``scoring``: for each model spec, one GRPO step's batch (8 arithmetic training prompts x
  8 responses, <= 80 new tokens, T = 1, seed 0) scored in the shared-prefix layout with
  entropy, forward and backward, as the update does: in float32 and under bf16 autocast;
  the responses' attention in one grid of every row (``BUCKET_ROWS`` unbounded) or in
  buckets of 16 rows (the default); and, under bf16, with the CPU's bfloat16 attention
  kernel (what ran before ``_attend`` upcast to float32). Median seconds per pass.
- ``decode``: one decode step's attention over a static cache for 64 rows x 8 heads of
  width 32 in 10 layers (so the cache does not fit in the CPU's caches, as in a ``small``
  rollout), ``K`` columns seen, with keys stored ``[.., L, D]`` (read through a transposed
  view) or ``[.., D, L]`` (a column slice), values ``[.., L, D]``; float32 and bfloat16.
  Microseconds per layer.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from _common import grpo_step_call, median_seconds, probe_cli
from torch.nn.functional import scaled_dot_product_attention

from anchor_rl.models import shared_prefix


def _bf16_kernel(q, k, v, allowed, scale):
    """``_attend`` as it was: the inputs' own dtype, under autocast bfloat16."""
    out = scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).flatten(2)


def scoring_times(spec: str, repeats: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Seconds per scoring forward and backward of one step's batch under ``spec``."""
    from anchor_rl.models.scoring import token_logprobs
    from anchor_rl.rollout.engine import make_engine

    model, tokenizer, call = grpo_step_call(spec, max_new_tokens)
    batch = make_engine("hf", model, tokenizer).rollout(*call)
    model.train()

    def run(bucket_rows: int, bf16: bool, attend: Callable | None = None) -> float:
        def once() -> None:
            context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
            with context:
                logp, entropy = token_logprobs(model, batch, with_entropy=True, shared=True)
            (logp.sum() + entropy.sum()).backward()
            model.zero_grad(set_to_none=True)

        saved = shared_prefix.BUCKET_ROWS, shared_prefix._attend
        shared_prefix.BUCKET_ROWS = bucket_rows
        shared_prefix._attend = attend or saved[1]
        try:
            return median_seconds(once, repeats)
        finally:
            shared_prefix.BUCKET_ROWS, shared_prefix._attend = saved

    one_grid = 1 << 30
    lengths = batch.attention_mask.sum(-1)
    return {
        "spec": spec,
        "response_tokens": int(lengths.sum()),
        "longest": int(lengths.max()),
        "seconds": {
            "fp32, one grid": run(one_grid, False),
            "fp32, buckets of 16": run(16, False),
            "bf16, bf16 attention kernel, one grid": run(one_grid, True, _bf16_kernel),
            "bf16, one grid": run(one_grid, True),
            "bf16, buckets of 16": run(16, True),
        },
    }


def _decode_step(
    cache: dict[str, list[torch.Tensor]], q: torch.Tensor, seen: int, transposed: bool
):
    """One decode step's attention in every layer of ``cache`` over its first ``seen`` columns."""
    for k, k_t, v in zip(cache["keys"], cache["keys_t"], cache["values"], strict=True):
        if transposed:
            scores = torch.bmm(q, k_t[:, :, :seen])
        else:
            scores = torch.bmm(q, k[:, :seen].transpose(1, 2))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, v[:, :seen])


def decode_times(
    repeats: int, columns: tuple[int, ...] = (30, 70), rows: int = 64, layers: int = 10
) -> dict[str, Any]:
    """Microseconds per layer of a decode step's attention in both key layouts."""
    heads, dim, width = 8, 32, 95
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        shapes = {"keys": (width, dim), "keys_t": (dim, width), "values": (width, dim)}
        cache = {
            name: [torch.randn(rows * heads, *shape, dtype=dtype) for _ in range(layers)]
            for name, shape in shapes.items()
        }
        q = torch.randn(rows * heads, 1, dim, dtype=dtype)
        for seen in columns:
            per_layer = {}
            for layout, transposed in (("keys [L, D]", False), ("keys [D, L]", True)):
                step = partial(_decode_step, cache, q, seen, transposed)
                per_layer[layout] = round(median_seconds(step, repeats) / layers * 1e6, 1)
            out[f"{str(dtype).removeprefix('torch.')}, K={seen}"] = per_layer
    return out


def main() -> None:
    probe_cli(
        __doc__,
        lambda args: {
            "scoring": [scoring_times(spec, args.repeats) for spec in args.specs],
            "decode": decode_times(max(args.repeats, 20)),
        },
    )


if __name__ == "__main__":
    main()
