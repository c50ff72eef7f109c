"""Suite `trl-pvpo` (TRL GRPOTrainer beside PVPOGRPOTrainer): one step of one seed, smoke."""

from __future__ import annotations

import json

import pytest

from anchor_rl.bench.runner import BenchArgs
from anchor_rl.bench.trl_pvpo import run_trl_pvpo_suite
from anchor_rl.cli.bench import FUNCTION_SUITES
from anchor_rl.errors import ConfigError


def test_one_step_of_both_trainers_writes_the_comparison(tmp_path, parity, one_thread) -> None:
    assert FUNCTION_SUITES["trl-pvpo"] == "anchor_rl.bench.trl_pvpo:run_trl_pvpo_suite"
    out = tmp_path / "bench"
    args = BenchArgs(out, seeds=[0], profile="quick", overrides=["pvpo.m=3"], echo=lambda _: None)
    result = run_trl_pvpo_suite(args)
    payload = json.loads(result["summary_json"].read_text())
    assert payload["pvpo"]["m"] == 3 and payload["seeds"] == [0]
    (grpo,), (pvpo,) = payload["runs"]["grpo"], payload["runs"]["pvpo"]
    n = payload["grpo_config"]["num_generations"]
    prompts = len(parity.records("train"))  # the quick profile's 8 training prompts
    assert grpo["steps"] == pvpo["steps"] == 1
    assert grpo["rollouts"] == {"policy": 2 * n, "presample": 0, "teacher": 0, "total": 2 * n}
    r = pvpo["rollouts"]
    assert r["policy"] == 2 * n and r["presample"] == 3 * prompts  # M per training prompt
    assert r["total"] == r["policy"] + r["presample"] + r["teacher"]
    assert grpo["eval"]["start"] == pvpo["eval"]["start"]  # the same initial model, evaluated once
    for run in (grpo, pvpo):
        assert 0.0 <= run["eval"]["final"]["eval/accuracy"] <= 1.0
    assert set(payload["summary"]["pvpo"]) >= {"eval_final", "rollouts_total"}
    assert "PVPOGRPOTrainer" in result["summary_md"].read_text()
    # A second call reuses the finished runs.
    again = run_trl_pvpo_suite(args)
    assert json.loads(again["summary_json"].read_text())["runs"] == payload["runs"]


def test_a_bad_pvpo_override_fails_before_any_run(tmp_path, parity) -> None:
    args = BenchArgs(tmp_path, seeds=[0], profile="quick", overrides=["pvpo.m=0"])
    with pytest.raises(ConfigError, match=r"pvpo\.m"):
        run_trl_pvpo_suite(args)
    assert not (tmp_path / "grpo").exists()
