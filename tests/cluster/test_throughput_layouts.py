"""Suite `throughput` in its cluster layouts: which layouts run, and one measured step of
2 Ray rollout workers beside 2 learner ranks."""

from __future__ import annotations

import json

import pytest

from anchor_rl.bench.runner import BenchArgs
from anchor_rl.bench.throughput import (
    GPU_LAYOUTS,
    LAYOUTS,
    default_layouts,
    run_throughput_suite,
)


def test_every_cpu_layout_runs_on_the_cpu_for_the_small_sizes_only() -> None:
    cpu_layouts = tuple(k for k in LAYOUTS if k not in GPU_LAYOUTS)
    assert default_layouts("cpu", "tiny") == cpu_layouts == default_layouts("cpu", "small")
    assert set(GPU_LAYOUTS) <= set(LAYOUTS) and "" in cpu_layouts
    assert default_layouts("cpu", "base") == ("",)
    assert default_layouts("cuda", "tiny") == ("",)
    assert default_layouts("cpu", "tiny", "quick") == ("",)


def test_an_unknown_layout_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown layouts \['w3'\]"):
        run_throughput_suite(BenchArgs(tmp_path, profile="quick"), layouts=["w3"])


def test_two_workers_and_two_learners_measure_a_step(ray_local, tmp_path, one_thread) -> None:
    result = run_throughput_suite(
        BenchArgs(tmp_path / "tp", profile="quick", echo=lambda _: None), layouts=["w2l2"]
    )
    payload = json.loads(result["summary_json"].read_text())
    (row,) = payload["rows"]
    assert (row["size"], row["layout"], row["driver_threads"]) == (
        "tiny",
        "2 workers, 2 learners",
        1,
    )
    assert row["figures"]["rollout_tok_s"] > 0 and row["figures"]["update_tok_s"] > 0
    config = json.loads((tmp_path / "tp" / "grpo+tiny-w2l2" / "seed0" / "config.json").read_text())
    assert config["cluster"]["rollout_workers"] == 2 and config["cluster"]["learners"] == 2
    assert "| tiny | 2 workers, 2 learners |" in result["summary_md"].read_text()
    # the layout subset is part of the command that reproduces the figures
    assert payload["command"].endswith("sizes=('tiny',), layouts=('w2l2',)))")
