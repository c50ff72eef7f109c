"""The CPU decoder's two attentions over its buffers, fused SDPA against batched matmuls,
one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/probe_decode_attention.py sft:tiny random:small \
        --repeats 8 --out FILE

The figures behind ``StaticDecoder``'s choice (``attention=None``: ``sdpa`` for a bfloat16
model on the CPU, ``matmul`` for a float32 one): for each model spec, one GRPO step's
rollout (8 arithmetic training prompts x 8 responses, <= 80 new tokens, T = 1, seed 0;
``_common.grpo_step_call``), sampled in float32 and with bfloat16
sampling (``precision=bf16``), each attention in turn in one process, alternating.
Median seconds of ``--repeats`` rounds and the ratio sdpa / matmul.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import statistics
from typing import Any

from _common import grpo_step_call, median_seconds, probe_cli

from anchor_rl.rollout import sampling
from anchor_rl.rollout.decoders import StaticDecoder, decoder_for


def rollout_times(spec: str, rounds: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Median seconds of one step's rollout with either attention, in both precisions."""
    from anchor_rl.rollout.engine import make_engine

    model, tokenizer, call = grpo_step_call(spec, max_new_tokens)
    result: dict[str, Any] = {"spec": spec}
    for precision in ("model", "bf16"):
        engine = make_engine("hf", model, tokenizer, precision=precision)
        times: dict[str, list[float]] = {"matmul": [], "sdpa": []}
        try:
            for i in range(rounds):
                for way in times if i % 2 == 0 else reversed(times):
                    sampling.decoder_for = _forcing(way)
                    times[way].append(median_seconds(lambda e=engine: e.rollout(*call), 1))
        finally:
            sampling.decoder_for = decoder_for
        medians = {way: statistics.median(seconds) for way, seconds in times.items()}
        result["fp32" if precision == "model" else "bf16 sampling"] = {
            "matmul_s": round(medians["matmul"], 4),
            "sdpa_s": round(medians["sdpa"], 4),
            "sdpa / matmul": round(medians["sdpa"] / medians["matmul"], 3),
        }
    return result


def _forcing(attention: str):
    """``decoder_for`` with the static decoder's attention fixed to ``attention``."""

    def make(model, mode="auto"):
        decoder = decoder_for(model, mode)
        if isinstance(decoder, StaticDecoder):
            decoder.attention = attention
        return decoder

    return make


def main() -> None:
    probe_cli(
        __doc__, lambda args: {"rollouts": [rollout_times(s, args.repeats) for s in args.specs]}
    )


if __name__ == "__main__":
    main()
