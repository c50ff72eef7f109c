"""benchmarks/probe_phases.py: both trainers' phases from fresh processes (tiny random model)."""

from __future__ import annotations

from pathlib import Path

import probe_phases as probe
import pytest


def test_phase_means_leave_out_the_warm_up_calls() -> None:
    means = probe.phase_means({"a": [9.0, 9.0, 0.001, 0.003], "b": [0.002]})
    assert means == {"a": 2.0, "b": 2.0}


def test_both_trainers_phases_add_up_to_their_steps(tmp_path: Path) -> None:
    out = tmp_path / "phases.json"
    argv = ["random:tiny", "--steps", "3", "--rounds", "1", "--out", str(out)]
    result = probe.main([*argv, "rollout.prompts_per_step=2", "rollout.max_new_tokens=6"])
    assert out.is_file() and result["steps"] == 3
    for trainer in probe.TRAINERS:
        (run,) = result["runs"][trainer]
        assert all(run[p] > 0 for p in (*probe.PHASES, "step"))
        assert run["other"] == pytest.approx(run["step"] - sum(run[p] for p in probe.PHASES))
        assert run["other"] > -1.0  # the phases lie inside the step (rounding aside)
    # TRL pads every row to the prompt and the longest completion; anchor-rl scores each
    # prompt once per group and the real response tokens only
    tokens = {t: result["runs"][t][0]["tokens_scored"] for t in probe.TRAINERS}
    assert 0 < tokens["anchor-rl"] < tokens["trl"]
    # the ratio is rounded to 3 decimals, the medians to 0.01 ms
    assert result["trl_over_anchor_rl"]["step"] == pytest.approx(
        result["median"]["trl"]["step"] / result["median"]["anchor-rl"]["step"], abs=6e-4
    )


def test_the_warm_up_must_leave_steps_to_time() -> None:
    with pytest.raises(SystemExit):
        probe.main(["random:tiny", "--steps", "2"])
