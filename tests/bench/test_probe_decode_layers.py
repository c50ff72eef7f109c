"""benchmarks/probe_decode_layers.py: one step's rollout is timed with module and prepared
layers in both precisions, and the switch it flips is restored after."""

from __future__ import annotations

import probe_decode_layers as probe

from anchor_rl.models import llama


def test_rollouts_are_timed_both_ways_and_the_switch_restored(monkeypatch) -> None:
    unsupported = llama.frozen_unsupported
    ways = []  # what the decoder ran at each prefill: prepared layers or modules
    decode_layers = llama.decode_layers

    def spy(inner, rows):
        layers = decode_layers(inner, rows)
        ways.append(type(layers[0]).__name__)
        return layers

    monkeypatch.setattr("anchor_rl.rollout.decoders.decode_layers", spy)
    result = probe.rollout_times("random:tiny", 1, max_new_tokens=4)
    assert llama.frozen_unsupported is unsupported  # restored
    assert {"ModuleLayer", "FrozenLayer"} == set(ways)
    for precision in ("fp32", "bf16 sampling"):
        figures = result[precision]
        assert figures["modules_s"] > 0 and figures["prepared_s"] > 0
        assert figures["same_tokens"] is True  # the same function, the same samples
        assert 64 <= figures["response_tokens"] <= 64 * 4
