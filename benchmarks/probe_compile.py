"""torch.compile on the update's forward + backward, against eager, in both scoring layouts.

Usage: ``python benchmarks/probe_compile.py [MODEL_SPEC]`` (default ``sft:tiny``), one thread.
Samples four batches of 16 arithmetic prompts x 8 responses, then times one forward +
backward per batch (twice over, the first two left out) eagerly and compiled
(``torch.compile(dynamic=True)``; the packed layout calls the inner model directly, so it
compiles that), with the first compiled pass (the compilation) apart. Prints JSON.
The figures of docs/results.md ("torch.compile was measured and not adopted") came from it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from anchor_rl.models import scoring
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.spec import load_spec
from anchor_rl.tasks import get_task
from anchor_rl.trainer.collect import rollout_call
from anchor_rl.trainer.config import build_config


def _seconds(model, batch, packed: bool) -> float:
    start = time.perf_counter()
    logp, _ = token_logprobs(model, batch, packed=packed)
    (logp * batch.attention_mask).sum().backward()
    return time.perf_counter() - start


def _mean_after_two(model, batches, packed: bool) -> float:
    times = [_seconds(model, b, packed) for b in batches * 2][2:]
    return sum(times) / len(times)


def main(spec: str = "sft:tiny") -> None:
    torch.set_num_threads(1)
    cfg = build_config({"preset": "grpo", "task": "arithmetic", "model": spec})
    model, tokenizer = load_spec(spec, "arithmetic", {}, 0, "cpu", progress=False)
    task = get_task("arithmetic")
    engine = make_engine("hf", model, tokenizer)
    records = task.records("train")
    batches = [
        engine.rollout(
            *rollout_call(task, records[16 * i : 16 * (i + 1)], range(16 * i, 16 * (i + 1)), cfg)
        )
        for i in range(4)
    ]
    model.train()
    result = {"shapes": [list(b.response_ids.shape) for b in batches]}
    eager_padded = _mean_after_two(model, batches, packed=False)
    eager_packed = _mean_after_two(model, batches, packed=True)
    compiled = torch.compile(model, dynamic=True)
    first = _seconds(compiled, batches[0], packed=False)
    result["padded"] = {
        "eager_s": eager_padded,
        "compile_first_s": first,
        "compiled_s": _mean_after_two(compiled, batches, packed=False),
    }
    model.model = torch.compile(model.model, dynamic=True)  # what packed scoring calls
    # the compiled wrapper is no PreTrainedModel, so scoring's check would refuse to pack a
    # model it packed a moment ago: tell it the model packs, as it did before compiling
    scoring.packing_supported = lambda _: True
    first = _seconds(model, batches[0], packed=True)
    result["packed"] = {
        "eager_s": eager_packed,
        "compile_first_s": first,
        "compiled_s": _mean_after_two(model, batches, packed=True),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
