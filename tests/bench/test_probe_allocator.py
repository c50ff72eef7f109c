"""benchmarks/probe_allocator.py: training steps in fresh processes with glibc's defaults and
with the run's own allocator settings, alternating."""

from __future__ import annotations

import sys

import probe_allocator as probe
import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_each_setting_trains_in_its_own_process_and_the_kept_one_faults_less() -> None:
    result = probe.measure("random:tiny", rounds=1, steps=1, max_new_tokens=16)
    assert [r["kept"] for r in result["runs"]["default"]] == [False]
    assert [r["kept"] for r in result["runs"]["kept"]] == [True]
    medians = result["medians"]
    assert medians["kept"]["faults_per_step"] < medians["default"]["faults_per_step"] / 2
    assert result["kept / default s"] > 0
