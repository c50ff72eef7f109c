"""benchmarks/activation_memory.py: the live tensor bytes of a policy and a critic update with
activation checkpointing off and on, counted by a dispatch mode and by the profiler."""

from __future__ import annotations

import argparse
import gc

import activation_memory as bench
import torch

ARGS = argparse.Namespace(
    prompts=2, n=2, prompt_tokens=8, response_tokens=32, micro_batch=2, repeats=1
)


def test_live_bytes_counts_each_storage_once_until_it_is_freed() -> None:
    held = torch.zeros(100)  # 400 bytes that exist before
    counter = bench.LiveBytes()
    counter.add(held, held[10:], held.view(10, 10))  # one storage
    assert counter.live == 400
    with counter:
        a = torch.ones(1000)  # +4000
        b = a * 2  # +4000: 8400 live
        c = b.view(10, 100)  # the same storage
        del a  # 4400
        d = c + 1  # 8400 again
        del b, c, d  # 400
    assert (counter.peak, counter.live) == (8400, 400)


def test_checkpointing_lowers_the_peak_of_the_policy_and_the_critic_update() -> None:
    # the garbage collections ``measure`` runs before each count scan only what it makes: what
    # this process held before (the suite's objects, none of them garbage) is frozen
    gc.collect()
    gc.freeze()
    try:
        rows = bench.measure("policy", "tiny", ARGS) + bench.measure("critic", "tiny", ARGS)
    finally:
        gc.unfreeze()
    layers = 4  # the built-in tiny
    rng_state = torch.get_rng_state().nbytes
    by = {(r["kind"], r["checkpointing"]): r for r in rows}
    for kind in bench.KINDS:
        off, on = by[kind, False], by[kind, True]
        assert on["checkpointed_layers"] and not off["checkpointed_layers"]
        assert off["start_bytes"] == on["start_bytes"] > 0  # weights, AdamW state, the batch
        # 4 layers keeping their inputs only (the gradients, 4.3 MB, count in both)
        assert on["peak_above_start"] < 0.75 * off["peak_above_start"]
        assert on["peak_bytes"] < off["peak_bytes"]
        # the profiler's allocator count: the same bytes, plus the RNG states checkpoint saves
        assert off["profiler_minus_dispatch"] == 0
        assert 0 < on["profiler_minus_dispatch"] <= layers * ARGS.micro_batch * rng_state
        assert on["profiler_minus_dispatch"] % rng_state == 0
        assert len(on["step_seconds_all"]) == 1
    table = bench.table(rows)
    assert table.count("| tiny |") == 2
