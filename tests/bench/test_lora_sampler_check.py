"""benchmarks/lora_sampler_check.py: the LoRA sampler check's JSON, on the CPU."""

from __future__ import annotations

import json

import lora_sampler_check as bench


def test_the_check_reports_stale_and_synced_gaps_and_passes(tmp_path) -> None:
    out = tmp_path / "check.json"
    assert bench.main(["--sizes", "tiny", "--precisions", "bf16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["pass"] and row["pass"] and row["tolerance"] == bench.TOLERANCE["bf16"]
    # the bf16 copy samples the base until the sync, the updated adapters after it
    assert row["stale"]["to_policy"] > 3 * row["tolerance"] > row["synced"]["to_policy"]
    assert row["synced"]["to_base"] > 3 * row["tolerance"]
