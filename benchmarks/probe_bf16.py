"""bf16 autocast against float32 on real rollouts: log-prob differences and the update's speed.

Usage: ``python benchmarks/probe_bf16.py [MODEL_SPEC]`` (default ``sft:tiny``), one thread.
Samples 16 arithmetic training prompts x 8 responses with the built-in engine, then prints
JSON: per-token |bf16 - float32| log-prob (mean, 99th percentile, max), the mean over
responses of the summed difference, the largest difference between two bf16 micro-batchings
of the same rows, and the seconds of one forward + backward of the batch in each precision.
The figures of docs/results.md ("bf16 forward passes") and docs/training.md came from it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from anchor_rl.models.scoring import token_logprobs
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.spec import load_spec
from anchor_rl.tasks import get_task
from anchor_rl.trainer.collect import rollout_call
from anchor_rl.trainer.config import build_config


def main(spec: str = "sft:tiny") -> None:
    torch.set_num_threads(1)
    cfg = build_config({"preset": "grpo", "task": "arithmetic", "model": spec})
    model, tokenizer = load_spec(spec, "arithmetic", {}, 0, "cpu", progress=False)
    model.eval()
    task = get_task("arithmetic")
    engine = make_engine("hf", model, tokenizer)
    batch = engine.rollout(*rollout_call(task, task.records("train")[:16], range(16), cfg))
    mask = batch.attention_mask.bool()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        f32, _ = token_logprobs(model, batch)
        with bf16:
            b16, _ = token_logprobs(model, batch)
            b16_micro, _ = token_logprobs(model, batch, micro_batch=8)
    diff = (b16 - f32)[mask].abs()

    def forward_backward(autocast: bool) -> float:
        start = time.perf_counter()
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logp, _ = token_logprobs(model, batch)
            (logp * mask).sum().backward()
        return (time.perf_counter() - start) / 3

    model.train()
    forward_backward(False), forward_backward(True)  # warm-up
    result = {
        "model": spec,
        "tokens": int(mask.sum()),
        "abs_diff_mean": float(diff.mean()),
        "abs_diff_p99": float(diff.quantile(0.99)),
        "abs_diff_max": float(diff.max()),
        "response_sum_diff_mean": float(((b16 - f32) * mask).sum(-1).abs().mean()),
        "bf16_microbatching_max_diff": float((b16 - b16_micro)[mask].abs().max()),
        "fwd_bwd_s_float32": forward_backward(False),
        "fwd_bwd_s_bf16": forward_backward(True),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
