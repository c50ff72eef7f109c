"""The update's three scoring layouts against each other at short and long response lengths.

    python benchmarks/probe_layouts.py random:base runs/gpu/llama-0.7b --device cuda \
        --autocast bf16 --repeats 3 --out FILE

What ``optim.padding_free`` and ``optim.shared_prefix`` choose between: for each model spec
and each length profile, one synthetic GRPO batch (8 prompts x 8 responses of random
tokens, seeded) is scored in the padded, packed (padding-free) and shared-prefix layouts
(:mod:`anchor_rl.models.scoring`), alternating: the update's pass (forward with entropy and
backward, ``micro_batch`` rows at a time as ``optim.micro_batch_size``) and the reference's
(forward only, no grad). Median seconds over the whole batch after a warm-up, the update's
peak device memory, and the token cells each layout computes: padded, every row the longest
prompt plus the longest response of its micro-batch (``RolloutBatch.trimmed``); packed,
its bins (first-fit, twice the longest row wide); shared, each distinct prompt once plus
the responses. A pass is one micro-batch; ``layouts_chosen`` counts the passes
``token_logprobs`` would run in each layout by default on a GPU
(:func:`anchor_rl.models.scoring.pass_layout`). On a GPU set ``JAX_PLATFORMS=cpu``: a
library that imports JAX otherwise takes most of the GPU's memory.

Profiles (prompt tokens; response tokens):

- ``short``: 8-12; 8-80, uniform (the ``trl`` suite's scale, with uneven lengths);
- ``long-truncated``: 128-256; all 1024 (every response hits the budget: no response padding);
- ``long-uniform``: 128-256; 64-1024, uniform;
- ``long-skewed``: 128-256; three in four 64-256, uniform, the rest 1024 (a few truncated).

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _common import emit
from transformers import PreTrainedTokenizerBase

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.scoring import pass_cells, pass_layout, token_logprobs
from anchor_rl.models.shared_prefix import SharedPrefixLayout
from anchor_rl.rollout.agent import Response
from anchor_rl.rollout.engine import pack
from anchor_rl.rollout.spec import load_spec

PROMPTS, RESPONSES = 8, 8
PROFILES = {  # name: (prompt lengths (lo, hi), response lengths (lo, hi), budget, share long)
    "short": ((8, 12), (8, 80), 80, 0.0),
    "long-truncated": ((128, 256), (1024, 1024), 1024, 0.0),
    "long-uniform": ((128, 256), (64, 1024), 1024, 0.0),
    "long-skewed": ((128, 256), (64, 256), 1024, 0.25),
}
LAYOUTS = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}


def synthetic_batch(
    profile: str, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int = 0
) -> RolloutBatch:
    """8 prompts x 8 responses of random token ids below ``vocab`` (none of them the
    tokenizer's pad id) with the profile's lengths, as the engine packs a rollout."""
    (p_lo, p_hi), (r_lo, r_hi), budget, share_long = PROFILES[profile]
    gen, pad_id = torch.Generator().manual_seed(seed), tokenizer.pad_token_id

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    def tokens(n: int) -> list[int]:
        ids = torch.randint(1, vocab, (n,), generator=gen)
        return torch.where(ids == pad_id, ids + 1, ids).tolist()

    prompts = [tokens(between(p_lo, p_hi)) for _ in range(PROMPTS)]
    lengths = [
        budget if torch.rand((), generator=gen) < share_long else between(r_lo, r_hi)
        for _ in range(PROMPTS * RESPONSES)
    ]
    responses = [Response(tokens(n), [0.0] * n, [True] * n, truncated=n >= budget) for n in lengths]
    rows = range(PROMPTS * RESPONSES)
    group = torch.arange(PROMPTS).repeat_interleave(RESPONSES)
    return pack(responses, [prompts[i // RESPONSES] for i in rows], group, tokenizer)


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    """``batch`` in runs of ``size`` rows, in order (``optim.micro_batch_size``)."""
    for start in range(0, len(batch), size):
        yield batch.select(range(start, min(start + size, len(batch))))


def token_cells(batch: RolloutBatch, micro_batch: int) -> dict[str, int]:
    """Token positions each layout runs through the model, summed over the micro-batches
    (:func:`~anchor_rl.models.scoring.pass_cells`; shared: each distinct prompt's real
    tokens once plus the responses')."""
    cells = {"real": 0, "padded": 0, "packed": 0, "shared": 0}
    for chunk in micro_batches(batch, micro_batch):
        for name, count in pass_cells(chunk).items():
            cells[name] += count
        layout = SharedPrefixLayout.of(chunk)
        cells["shared"] += int(layout.prompt_mask.sum()) + len(layout.tokens)
    return cells


def gpu_defaults(batch: RolloutBatch, micro_batch: int, parameters: int) -> dict[str, int]:
    """How many of the passes ``token_logprobs`` runs in each layout by default on a GPU
    for a model of ``parameters``."""
    chosen: dict[str, int] = {}
    gpu = torch.device("cuda")
    for chunk in micro_batches(batch, micro_batch):
        kind = pass_layout(chunk, None, None, True, True, gpu, parameters)
        chosen[kind] = chosen.get(kind, 0) + 1
    return chosen


def layout_times(
    model: torch.nn.Module,
    batch: RolloutBatch,
    device: str,
    autocast: bool,
    repeats: int,
    micro_batch: int,
) -> dict[str, Any]:
    """Median seconds of the update's and the reference's pass in each layout (alternating)."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device_type = "cuda" if cuda else "cpu"

    def update(packed: bool, shared: bool) -> None:
        for chunk in micro_batches(batch, micro_batch):  # gradient accumulation
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                logp, entropy = token_logprobs(model, chunk, True, packed=packed, shared=shared)
            (logp.sum() + entropy.sum()).backward()
        model.zero_grad(set_to_none=True)

    def reference(packed: bool, shared: bool) -> None:
        with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            token_logprobs(model, batch, False, micro_batch, packed=packed, shared=shared)

    times: dict[str, dict[str, list[float]]] = {
        p: {n: [] for n in LAYOUTS} for p in ("update", "reference")
    }
    peak: dict[str, int] = {}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, (packed, shared) in LAYOUTS.items():
            for phase, fn in (("update", update), ("reference", reference)):
                if cuda and phase == "update":
                    torch.cuda.reset_peak_memory_stats()
                sync()
                start = time.perf_counter()
                fn(packed, shared)
                sync()
                if round_:
                    times[phase][name].append(time.perf_counter() - start)
                if cuda and phase == "update":
                    peak[name] = torch.cuda.max_memory_allocated() >> 20
    out: dict[str, Any] = {
        phase: {name: round(sorted(ts)[len(ts) // 2], 4) for name, ts in by_layout.items()}
        for phase, by_layout in times.items()
    }
    if peak:
        out["update_peak_mib"] = peak
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for spec in args.specs:
        model, tokenizer = load_spec(spec, "arithmetic", {}, 0, args.device, progress=False)
        model.train()
        vocab = model.config.vocab_size
        parameters = sum(p.numel() for p in model.parameters())
        for profile in args.profiles:
            batch = synthetic_batch(profile, tokenizer, vocab)
            row = {
                "spec": spec,
                "profile": profile,
                "cells": token_cells(batch, args.micro_batch),
                "layouts_chosen": gpu_defaults(batch, args.micro_batch, parameters),
                **layout_times(
                    model,
                    batch,
                    args.device,
                    args.autocast == "bf16",
                    args.repeats,
                    args.micro_batch,
                ),
            }
            print(row, flush=True)
            results.append(row)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"device": device_name(args.device), "autocast": args.autocast, "rows": results}


def device_name(device: str) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("specs", nargs="*", default=["random:base"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=["off", "bf16"], default="off")
    parser.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"torch": torch.__version__, "micro_batch": args.micro_batch, **measure(args)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
