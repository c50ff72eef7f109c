"""benchmarks/probe_attention.py: every variant is timed on a real batch, and the module's
settings are restored after."""

from __future__ import annotations

import probe_attention as probe

from anchor_rl.models import shared_prefix


def test_scoring_and_decode_variants_are_timed_and_the_settings_restored() -> None:
    before = shared_prefix.BUCKET_ROWS, shared_prefix._attend
    scoring = probe.scoring_times("random:tiny", repeats=1, max_new_tokens=4)
    assert (shared_prefix.BUCKET_ROWS, shared_prefix._attend) == before
    assert 64 <= scoring["response_tokens"] <= 64 * 4 and 1 <= scoring["longest"] <= 4
    assert len(scoring["seconds"]) == 5 and all(s > 0 for s in scoring["seconds"].values())
    decode = probe.decode_times(1, columns=(3,), rows=2, layers=2)
    assert set(decode) == {"float32, K=3", "bfloat16, K=3"}
    assert all(set(v) == {"keys [L, D]", "keys [D, L]"} for v in decode.values())
