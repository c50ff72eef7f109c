"""The static decoder's layers on prepared weights against the layers' own modules, on the
CPU, one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/probe_decode_layers.py sft:tiny random:small \
        --repeats 15 --out FILE

The figures behind ``anchor_rl.models.llama.FrozenLayer``: for each model spec, one GRPO
step's rollout (8 arithmetic training prompts x 8 responses, <= 80 new tokens, T = 1,
seed 0; ``_common.grpo_step_call``), sampled in float32 and with
bfloat16 sampling (``precision=bf16``), each way alternating in one process: ``modules``
(every layer through its modules, what ``decode_layers`` returns where
``frozen_unsupported`` gives a reason) and ``prepared`` (q/k/v and gate/up as one product
each, no module calls; the default on the CPU). Median seconds of ``--repeats`` rounds,
the ratio, and whether both ways sampled the same tokens.

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from _common import grpo_step_call, median_seconds, probe_cli

from anchor_rl.models import llama
from anchor_rl.rollout.engine import make_engine


def rollout_times(spec: str, rounds: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Median seconds of one step's rollout with module and with prepared layers."""
    model, tokenizer, call = grpo_step_call(spec, max_new_tokens)
    result: dict[str, Any] = {"spec": spec}
    unsupported = llama.frozen_unsupported
    for precision in ("model", "bf16"):
        engine = make_engine("hf", model, tokenizer, precision=precision)
        times: dict[str, list[float]] = {"modules": [], "prepared": []}
        tokens = {}
        try:
            for _ in range(rounds):
                for way in times:
                    llama.frozen_unsupported = (
                        unsupported if way == "prepared" else lambda _layer: "probe: modules"
                    )
                    times[way].append(median_seconds(lambda e=engine: e.rollout(*call), 1))
                    if way not in tokens:  # every round samples the same: keep the first
                        tokens[way] = engine.rollout(*call).response_ids
        finally:
            llama.frozen_unsupported = unsupported
        medians = {way: statistics.median(seconds) for way, seconds in times.items()}
        label = "fp32" if precision == "model" else "bf16 sampling"
        result[label] = {
            "modules_s": round(medians["modules"], 4),
            "prepared_s": round(medians["prepared"], 4),
            "modules / prepared": round(medians["modules"] / medians["prepared"], 3),
            "same_tokens": bool(torch.equal(tokens["modules"], tokens["prepared"])),
            "response_tokens": int((tokens["prepared"] != tokenizer.pad_token_id).sum()),
        }
    return result


def main() -> None:
    probe_cli(
        __doc__, lambda args: {"rollouts": [rollout_times(s, args.repeats) for s in args.specs]}
    )


if __name__ == "__main__":
    main()
