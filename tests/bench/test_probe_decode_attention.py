"""benchmarks/probe_decode_attention.py: one step's rollout is timed with either attention in
both precisions, and the decoder choice it overrides is restored after."""

from __future__ import annotations

import probe_decode_attention as probe

from anchor_rl.rollout import decoders, sampling


def test_rollouts_are_timed_both_ways_and_the_choice_restored(monkeypatch) -> None:
    ways = []  # the attention each turn's decoder ran
    layers = decoders.StaticDecoder._layers

    def spy(self, *args):
        ways.append(("sdpa" if self.sdpa else "matmul", self.keys[0].dtype))
        return layers(self, *args)

    monkeypatch.setattr(decoders.StaticDecoder, "_layers", spy)
    result = probe.rollout_times("random:tiny", 1, max_new_tokens=4)
    assert sampling.decoder_for is decoders.decoder_for  # restored
    assert {w for w, _ in ways} == {"sdpa", "matmul"} and len({d for _, d in ways}) == 2
    for precision in ("fp32", "bf16 sampling"):
        figures = result[precision]
        assert figures["matmul_s"] > 0 and figures["sdpa_s"] > 0
