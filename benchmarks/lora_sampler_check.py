"""Does the in-process engine sample with a LoRA policy's adapters after an update, on this
device? The check of the LoRA tests (``anchor_rl.rollout.lora_check``) on any device, size and
sampling precision.

    python benchmarks/lora_sampler_check.py --device cpu --sizes tiny
    python benchmarks/lora_sampler_check.py --device cuda --sizes tiny,base \\
        --precisions model,bf16 --out lora_sampler_check.json

For each size and precision: a random-init Llama of that size (seed 0) on ``--device`` with
fresh rank-4 adapters on every linear layer (B = 0), the ``hf`` engine on it with
``precision`` (``model``: the engine samples the live policy; ``bf16``: a bfloat16 copy of
the merged weights, refreshed by ``sync_weights``). Three rollouts of 12 responses each, and
for each the largest gap over the sampled tokens between the engine's log-probs and the
policy's own scores (``to_policy``) and its base model's (``to_base``):

* ``before``: before any update (the policy is its base model: both gaps small);
* ``stale``: after 3 AdamW steps on the adapters, without a sync (a ``bf16`` copy still holds
  the base weights: its ``to_policy`` is large; ``model`` samples the live policy: small);
* ``synced``: after ``engine.sync_weights(sampling_state(policy))``, what the training loop
  does after every update (``to_policy`` small, ``to_base`` large).

A row passes when ``before.to_policy``, ``synced.to_policy`` (and for ``model`` also
``stale.to_policy``) are below the precision's tolerance and ``synced.to_base`` (and for
``bf16`` also ``stale.to_policy``) above 3x it. Tolerances (:data:`TOLERANCE`): ``model``
1e-3 (float32 sampling and scoring differ in kernel and summation order only: ~1e-5 on the
CPU), ``bf16`` 0.15 (the sampler's weights rounded to bfloat16, 8 mantissa bits, while the
policy scores in float32). Prints the JSON and writes it to ``--out``; exits 1 when a row
fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from anchor_rl.models.factory import SIZES, build_model
from anchor_rl.models.lora import sampling_state
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.engine import PRECISIONS, make_engine
from anchor_rl.rollout.lora_check import PARAMS, lora_policy, sampled_gaps, update_adapters

TOLERANCE = {"model": 1e-3, "bf16": 0.15}
"""The largest gap of sampled-token log-probs that counts as "the same distribution", per
sampling precision."""


def check(size: str, precision: str, device: str) -> dict[str, Any]:
    """One row: the gaps before an update, stale and synced, and whether they pass."""
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    policy = lora_policy(build_model(size, tokenizer, seed=0)).to(device)
    engine = make_engine("hf", policy, tokenizer, precision=precision)
    gaps = {"before": sampled_gaps(engine, policy)}
    update_adapters(engine, policy)
    gaps["stale"] = sampled_gaps(engine, policy)
    engine.sync_weights(sampling_state(policy))  # what the loop does after an update
    gaps["synced"] = sampled_gaps(engine, policy)
    tol = TOLERANCE[precision]
    stale_policy = gaps["stale"][0]
    ok = (
        gaps["before"][0] < tol
        and gaps["synced"][0] < tol
        and gaps["synced"][1] > 3 * tol
        and (stale_policy < tol if precision == "model" else stale_policy > 3 * tol)
    )
    if device == "cuda":
        torch.cuda.synchronize()
    return {
        "size": size,
        "precision": precision,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "tolerance": tol,
        **{k: {"to_policy": v[0], "to_base": v[1]} for k, v in gaps.items()},
        "pass": ok,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default="tiny", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--precisions", default="model,bf16", help=f"of {list(PRECISIONS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    for name, given, known in (("size", sizes, SIZES), ("precision", precisions, PRECISIONS)):
        if unknown := [x for x in given if x not in known]:
            parser.error(f"unknown {name} {unknown}; choose of {sorted(known)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    rows = [check(s, p, args.device) for s in sizes for p in precisions]
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    result = {
        "device": args.device,
        "device_name": device or platform.machine(),
        "torch": torch.__version__,
        "sampling": {"temperature": PARAMS.temperature, "max_new_tokens": PARAMS.max_new_tokens},
        "tolerance": TOLERANCE,
        "rows": rows,
        "pass": all(r["pass"] for r in rows),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
