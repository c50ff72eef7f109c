"""benchmarks/time_shared_prefix.py: one timed run per setting, on a random-init tiny model."""

from __future__ import annotations

import pytest
import time_shared_prefix as probe


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_timed_run_leaves_out_its_warm_up_step(tmp_path, mode):
    row = probe.time_run("grpo", "random:tiny", mode, 2, tmp_path)
    assert row["preset"] == "grpo" and row["shared_prefix"] == mode and row["steps"] == 1
    assert row["update_s"] > 0 and row["generate_s"] > 0 and row["tokens_per_step"] > 64
