"""benchmarks/probe_allocator.py: training steps in fresh processes with glibc's defaults and
with the run's own allocator settings, alternating."""

from __future__ import annotations

import sys

import probe_allocator as probe
import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_each_setting_trains_in_its_own_process_and_reports_its_faults() -> None:
    """Each setting runs in its own process with the allocator it names; the fault and time
    figures are recorded. How many fewer faults the kept setting takes is the probe's
    measurement (docs/results.md), not a test: with one timed step it varies with what
    else the machine runs (a parallel test suite can reverse it)."""
    result = probe.measure("random:tiny", rounds=1, steps=1, max_new_tokens=16)
    assert [r["kept"] for r in result["runs"]["default"]] == [False]
    assert [r["kept"] for r in result["runs"]["kept"]] == [True]
    medians = result["medians"]
    assert all(medians[way]["faults_per_step"] > 0 for way in ("default", "kept"))
    assert result["kept / default s"] > 0
