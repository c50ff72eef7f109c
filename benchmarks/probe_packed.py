"""Packed (oneDNN-reordered) weights against plain ones on the CPU, one torch thread.

    python benchmarks/probe_packed.py sft:tiny random:small --repeats 5 --out FILE

The figures behind ``anchor_rl.models.packed``:

- ``products``: microseconds of one ``x[M, in] @ W[out, in].T`` with ``F.linear`` and with
  a packed ``W`` (packing not counted), float32 and bfloat16, at the shapes of a GRPO step
  on ``tiny`` (128 wide) and ``small`` (256 wide): decode rows (64 down to 18 as rows
  finish) and a scoring pass's ~2,800 tokens; and the packing's cost per million weights.
- ``passes``: for each model spec, one GRPO step's no-grad passes (8 arithmetic training
  prompts x 8 responses, <= 80 new tokens, T = 1, seed 0): the rollout, and the
  reference's scoring of its batch in the shared-prefix layout (float32), each with packing
  off and on, alternating in one process; the rollout also with bfloat16 sampling
  (``precision=bf16``).
  Median seconds; how many weights each spec packs.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import grpo_step_call, median_seconds, probe_cli

from anchor_rl.models import packed

SHAPES = {
    "tiny": [(64, 128, 512), (64, 512, 128), (20, 128, 128), (1756, 128, 512)],
    "small": [(64, 256, 1024), (25, 256, 1024), (25, 1024, 256), (25, 256, 256),
              (2809, 256, 1024), (2809, 1024, 256)],
}  # fmt: skip


def product_times(repeats: int, shapes: dict[str, list] = SHAPES) -> dict[str, Any]:
    """Microseconds per product, plain and packed, and the packing cost."""
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for size, rows in shapes.items():
            for m, k, n in rows:
                w, x = torch.randn(n, k, dtype=dtype), torch.randn(m, k, dtype=dtype)
                w_packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                plain = median_seconds(lambda w=w, x=x: F.linear(x, w), repeats)
                fast = median_seconds(
                    lambda w=w_packed, x=x: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""
                    ),
                    repeats,
                )
                out[f"{name} {size} [{m}, {k}] x [{k}, {n}]"] = {
                    "plain_us": round(plain * 1e6, 1),
                    "packed_us": round(fast * 1e6, 1),
                    "ratio": round(plain / fast, 3),
                }
        w = torch.randn(1024, 1024, dtype=dtype)
        pack = median_seconds(lambda w=w: torch.ops.mkldnn._reorder_linear_weight(w, 64), repeats)
        out[f"{name} packing, ms per million weights"] = round(pack * 1e3 / w.numel() * 1e6, 3)
    return out


def pass_times(spec: str, rounds: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Median seconds of one step's rollout and reference scoring, packing off and on."""
    from anchor_rl.models.scoring import token_logprobs
    from anchor_rl.rollout.engine import make_engine

    model, tokenizer, call = grpo_step_call(spec, max_new_tokens)
    layers = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    packs = len(packed.PackedLinears(layers, 64))  # what the decoder and scoring pack
    result: dict[str, Any] = {"spec": spec, "packed_weights": packs}
    for precision in ("model", "bf16"):
        engine = make_engine("hf", model, tokenizer, precision=precision)
        batch = engine.rollout(*call)

        def score(batch=batch) -> None:
            with torch.no_grad():
                token_logprobs(model, batch, shared=True)

        passes: dict[str, Callable[[], Any]] = {"rollout": lambda e=engine: e.rollout(*call)}
        if precision == "model":  # the scoring pass does not depend on the sampler
            passes["reference"] = score
        times: dict[str, list[float]] = {
            f"{p}, {s}": [] for p in passes for s in ("plain", "packed")
        }
        saved = packed.ENABLED
        try:
            for _ in range(rounds):
                for name, fn in passes.items():
                    for setting, on in (("plain", False), ("packed", saved)):
                        packed.ENABLED = on
                        times[f"{name}, {setting}"].append(median_seconds(fn, 1))
        finally:
            packed.ENABLED = saved
        label = "fp32" if precision == "model" else "bf16 sampling"
        result[label] = {k: round(statistics.median(v), 4) for k, v in times.items()}
    result["response_tokens"] = int(batch.attention_mask.sum())
    return result


def main() -> None:
    if not packed.ENABLED:
        raise SystemExit("packing is off: no oneDNN in this PyTorch build, or ANCHOR_RL_PACKED=off")
    probe_cli(
        __doc__,
        lambda args: {
            "products": product_times(max(args.repeats, 50)),
            "passes": [pass_times(spec, args.repeats) for spec in args.specs],
        },
    )


if __name__ == "__main__":
    main()
