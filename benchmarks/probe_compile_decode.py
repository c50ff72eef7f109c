"""torch.compile on the sampler's decode step, against eager.

Usage: ``python benchmarks/probe_compile_decode.py [MODEL_SPEC] [ROUNDS]`` (default ``sft:tiny``,
3), one thread. Samples the same 8 arithmetic prompts x 8 responses (the TRL comparison's
step: T = 1, <= 80 new tokens) with the static decoder eagerly and with its layer loop
compiled (``torch.compile(dynamic=True)`` on ``StaticDecoder._layers``), alternating, the
first compiled call (the compilation) timed apart. Checks that both give the same tokens
and log-probs within 1e-4. Prints JSON: seconds per rollout call and response tokens/s.
The figures of docs/results.md ("The sampler's decode step compiled") came from it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from _common import grpo_step_call

from anchor_rl.rollout import decoders
from anchor_rl.rollout.engine import make_engine


def main(spec: str = "sft:tiny", rounds: str = "3") -> None:
    torch.set_num_threads(1)
    model, tokenizer, call = grpo_step_call(spec)
    engine = make_engine("hf", model, tokenizer)
    eager_layers = decoders.StaticDecoder._layers
    compiled_layers = torch.compile(eager_layers, dynamic=True)

    def timed(layers) -> tuple[float, object]:
        decoders.StaticDecoder._layers = layers
        start = time.perf_counter()
        batch = engine.rollout(*call)
        return time.perf_counter() - start, batch

    _, reference = timed(eager_layers)
    first_s, compiled = timed(compiled_layers)
    if not torch.equal(reference.response_ids, compiled.response_ids):
        raise SystemExit("compiled decoding sampled other tokens")
    logp_diff = (reference.logprobs - compiled.logprobs).abs().max().item()
    if logp_diff > 1e-4:
        raise SystemExit(f"compiled log-probs differ from eager by {logp_diff:.2e}")
    eager, fast = [], []
    for _ in range(int(rounds)):
        eager.append(timed(eager_layers)[0])
        fast.append(timed(compiled_layers)[0])
    tokens = int(reference.loss_mask.sum())
    result = {
        "spec": spec,
        "response_tokens": tokens,
        "max_abs_logprob_diff": logp_diff,
        "eager_s": statistics.median(eager),
        "compiled_s": statistics.median(fast),
        "compile_first_s": first_s,
        "eager_tok_s": tokens / statistics.median(eager),
        "compiled_tok_s": tokens / statistics.median(fast),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
