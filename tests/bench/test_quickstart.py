"""``anchor-rl quickstart`` end to end on a tiny configuration, and its settings."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from anchor_rl.bench.quickstart import (
    MEASURED_S,
    expected_time,
    grpo_config,
    headline,
    quickstart_config,
)
from anchor_rl.cli import app
from anchor_rl.trainer.config import ConfigError
from anchor_rl.trainer.logging import read_metrics

TINY = [
    "model=random:tiny", "train_prompts=4", "rollout.prompts_per_step=2", "rollout.n=2",
    "rollout.max_new_tokens=8", "eval.prompts=2", "eval.every=1", "pvpo.m=2", "log.progress=false",
]  # fmt: skip


def test_settings_layer_preset_quickstart_task_then_overrides() -> None:
    cfg = quickstart_config("arithmetic")
    assert (cfg.preset, cfg.advantage.estimator, cfg.filter.kind) == ("pvpo", "pvpo", "group")
    assert (cfg.model, cfg.steps, cfg.rollout.n, cfg.pvpo.m) == ("sft:tiny", 60, 4, 8)
    mh = quickstart_config("multihop", steps=7, time_limit=30, overrides=["pvpo.m=3"])
    assert mh.task_args == {"reward": "pvpo"}  # the paper's reward manager on QA
    assert (mh.steps, mh.time_limit, mh.pvpo.m) == (7, 30.0, 3)
    with pytest.raises(ConfigError, match="rollout.n"):
        quickstart_config("arithmetic", overrides=["rollout.n=0"])


def test_the_grpo_comparison_differs_from_pvpo_only_in_the_method() -> None:
    pvpo = quickstart_config("multihop", steps=7, overrides=["optim.lr=5e-5", "pvpo.m=3"])
    grpo = grpo_config(pvpo)
    assert (grpo.preset, grpo.advantage.estimator, grpo.filter.kind) == ("grpo", "grpo", "none")
    for section in ("rollout", "eval", "optim", "checkpoint"):
        assert getattr(grpo, section) == getattr(pvpo, section), section
    assert (grpo.task, grpo.task_args, grpo.model, grpo.train_prompts, grpo.steps, grpo.seed) == (
        pvpo.task,
        pvpo.task_args,
        pvpo.model,
        pvpo.train_prompts,
        pvpo.steps,
        pvpo.seed,
    )
    assert grpo.kl.coef == pvpo.kl.coef == 0.001  # PVPO's, not the grpo preset's 0.04


def test_the_expected_time_is_the_measured_one_or_says_it_is_not(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path))  # nothing cached
    total = sum(MEASURED_S.values())
    assert expected_time(quickstart_config("arithmetic"), compare=True).startswith(
        f"expected time: about {total / 60:.0f} min on 2 CPU cores "
        f"({MEASURED_S['sft'] // 60} min of it the SFT"
    )
    other = quickstart_config("arithmetic", steps=5)
    assert expected_time(other, compare=True) == "expected time: not measured for these settings"


def test_the_headline_says_whether_the_interval_separates_the_runs() -> None:
    def comparison(low: float, high: float) -> dict:
        return {"pvpo_minus_grpo": {"mean": (low + high) / 2, "low": low, "high": high,
                                    "prompts": 1000}}  # fmt: skip

    assert headline(comparison(0.01, 0.03)).startswith("PVPO ended ahead of GRPO on 1000")
    assert headline(comparison(-0.03, -0.01)).startswith("PVPO ended behind GRPO")
    assert headline(comparison(-0.01, 0.02)).startswith("PVPO and GRPO cannot be told apart")
    assert "+0.005 [-0.010, +0.020]" in headline(comparison(-0.01, 0.02))


@pytest.mark.slow
def test_quickstart_runs_end_to_end_and_reports(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "qs"
    runner = CliRunner()
    result = runner.invoke(app, ["quickstart", "--out", str(out), "--steps", "2", *TINY])
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    report = (out / "report.md").read_text()
    before, after = records[0]["eval/accuracy"], records[-1]["eval/accuracy"]
    assert f"| held-out accuracy before training | {before:.3f} |" in report
    assert f"| held-out accuracy after training | {after:.3f} |" in report
    train_after = records[-1]["eval/train_accuracy"]  # on the run's 4 training prompts
    assert f"| training-prompt accuracy after training | {train_after:.3f} |" in report
    # 4 prompts x M = 2 presampled, 2 steps x 2 prompts x N = 2 trained
    assert "| rollouts: presampling | 8 |" in report and "| rollouts: total | 16 |" in report
    assert "## Group sampling" in report and "paper: MuSiQue (M=5)" in report
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # GRPO beside it, same steps and prompts, compared on the same held-out prompts
    grpo = read_metrics(out / "grpo")
    assert [r["step"] for r in grpo] == [0, 1, 2] and grpo[-1]["rollouts/total"] == 8
    g_before, g_after = grpo[0]["eval/accuracy"], grpo[-1]["eval/accuracy"]
    assert "## PVPO beside GRPO" in report
    assert f"| GRPO | {g_before:.3f} → {g_after:.3f} | " in report
    assert "expected time: not measured for these settings" in result.output
    assert "PVPO minus GRPO" in result.output
    assert json.loads((out / "pvpo.json").read_text())["prompts"] == 4
    again = runner.invoke(app, ["quickstart", "--out", str(out), "--steps", "2", *TINY])
    assert again.exit_code == 2 and "already holds this run, with checkpoints" in again.output
    alone = runner.invoke(
        app, ["quickstart", "--no-compare", "--out", str(tmp_path / "alone"), "--steps", "1", *TINY]
    )
    assert alone.exit_code == 0, alone.output
    assert not (tmp_path / "alone" / "grpo").exists()
    assert "## PVPO beside GRPO" not in (tmp_path / "alone" / "report.md").read_text()
    bad = runner.invoke(app, ["quickstart", "--task", "chess", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "chess" in bad.output
    assert not (tmp_path / "b").exists()
