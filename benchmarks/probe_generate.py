"""anchor-rl's sampler against ``transformers``' ``generate`` on the same batch and device.

Usage: ``python benchmarks/probe_generate.py [SPEC ...] [--device cuda] [--dtype bfloat16]
[--repeats 5] [--decodes auto,graph] [--out FILE]`` (specs default to ``random:base``).

One ``grpo`` step's rollout (the TRL comparison's: the first 8 arithmetic prompts x 8
responses, T = 1, top_p = 1, at most 80 new tokens), sampled by anchor-rl's ``hf`` engine
(the static decoder; it also returns each token's log-prob) and by ``model.generate``
(``do_sample=True``, ``top_k=0``, the default dynamic cache; what TRL's ``GRPOTrainer``
calls without vLLM), in alternation, ``repeats`` calls each after one warm-up call each.
Both stop at eos or the budget only (the task's stop strings are dropped, so both sides
decode the same way) and both run until the batch's last response ends, so their work per
call is the same up to which responses sample eos early. Prints JSON per spec: the median
seconds per call, the mean generated tokens per call and tokens/s (all tokens over all
timed seconds) of each, ``generate``'s seconds per call over each anchor-rl mode's, whether
each mode sampled the same tokens as the first (the same seeds), peak GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import emit, grpo_step_call

from anchor_rl.models.padding import left_pad
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.engine import make_engine


def _side(decode: str) -> str:
    """A decode mode's name in the results: ``anchor-rl`` for ``auto``."""
    return "anchor-rl" if decode == "auto" else f"anchor-rl {decode}"


def measure(
    spec: str, device: str, dtype: str, repeats: int, decodes: tuple[str, ...] = ("auto",)
) -> dict[str, Any]:
    model, tokenizer, (requests, params, tools, instruction) = grpo_step_call(spec, device=device)
    model = model.to(getattr(torch, dtype)).eval()
    params = dataclasses.replace(params, stop=[])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    tokens: dict[str, int] = {}
    sampled: dict[str, torch.Tensor] = {}  # each decode mode's tokens (the same seeds)

    def engine_call(decode: str) -> Callable[[], None]:
        side, engine = _side(decode), make_engine("hf", model, tokenizer, decode=decode)

        def call() -> None:
            batch = engine.rollout(requests, params, tools, instruction)
            sync()
            tokens[side] = int(batch.loss_mask.sum())
            sampled[side] = batch.response_ids

        return call

    prompts = [encode_prompt(tokenizer, r.prompt, instruction) for r in requests]
    pad = tokenizer.pad_token_id
    ids, mask = (t.to(device) for t in left_pad(prompts, pad))
    width = ids.shape[1]

    def generate_call() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=params.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=params.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        sync()
        new = out[:, width:]
        ended = (new == tokenizer.eos_token_id).int().cumsum(1)
        # tokens up to and including the first eos
        tokens["transformers"] = int(
            ((ended == 0) | ((ended == 1) & (new == tokenizer.eos_token_id))).sum()
        )

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    calls = {
        **{_side(d): engine_call(d) for d in decodes},
        "transformers": generate_call,
    }
    seconds: dict[str, list[float]] = {side: [] for side in calls}
    counts: dict[str, list[int]] = {side: [] for side in calls}
    for call in calls.values():  # warm-up
        call()
    for _ in range(repeats):  # alternating
        for side, call in calls.items():
            begin = time.perf_counter()
            call()
            seconds[side].append(time.perf_counter() - begin)
            counts[side].append(tokens[side])
    result: dict[str, Any] = {"spec": spec, "device": device, "dtype": dtype, "rows": len(requests)}
    for side in calls:
        result[side] = {
            "s_per_call": statistics.median(seconds[side]),
            "tokens_per_call": statistics.mean(counts[side]),
            "tok_s": sum(counts[side]) / sum(seconds[side]),
        }
    first = next(iter(sampled.values()))
    for side, tokens_sampled in sampled.items():  # the anchor-rl modes
        result[side]["generate_over_this"] = (
            result["transformers"]["s_per_call"] / result[side]["s_per_call"]
        )
        result[side]["same_tokens_as_first_mode"] = torch.equal(tokens_sampled, first)
    if device.startswith("cuda"):
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["device_name"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("specs", nargs="*", default=["random:base"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--decodes",
        default="auto",
        help="anchor-rl decode modes, comma-separated (e.g. static,graph; auto is graph on a GPU)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    decodes = tuple(args.decodes.split(","))
    results = [measure(s, args.device, args.dtype, args.repeats, decodes) for s in args.specs]
    emit({"torch": torch.__version__, "results": results}, args.out)


if __name__ == "__main__":
    main()
