"""benchmarks/probe_parallel_ceiling.py: its layouts sample the same requests, split in halves."""

from __future__ import annotations

import dataclasses

import probe_parallel_ceiling as probe


def test_the_halves_split_the_one_call_and_sampling_counts_response_tokens() -> None:
    _, (whole,) = probe._calls("tiny", 1)
    engine, halves = probe._calls("tiny", 2)
    _, (_, second) = probe._calls("tiny", 2)  # a worker's own build: the same second half
    requests = [(r.prompt, r.seed) for call in halves for r in call[0]]
    assert len(halves) == 2 and [len(c[0]) for c in halves] == [32, 32]
    assert requests == [(r.prompt, r.seed) for r in whole[0]]  # the same 64 (group ids aside)
    assert list(second[0]) == list(halves[1][0]) and second[1] == whole[1]  # same sampling
    requests, params, *rest = halves[0]
    short = (requests[:4], dataclasses.replace(params, max_new_tokens=3), *rest)
    tokens, seconds = probe._sample(engine, [short], repeats=2)
    assert 2 * 4 <= tokens <= 2 * 4 * 3 and seconds > 0  # 4 responses of 1-3 tokens, twice
