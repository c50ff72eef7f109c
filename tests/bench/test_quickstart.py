"""``anchor-rl quickstart`` end to end on a tiny configuration, and its settings."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from anchor_rl.bench.quickstart import MEASURED_S, expected_time, grpo_config, quickstart_config
from anchor_rl.bench.quickstart_results import CAVEAT, figure, headline, verdict
from anchor_rl.cli import app
from anchor_rl.trainer.config import ConfigError
from anchor_rl.trainer.logging import read_metrics

TINY = [
    "model=random:tiny", "train_prompts=4", "rollout.prompts_per_step=2", "rollout.n=2",
    "rollout.max_new_tokens=8", "eval.prompts=2", "eval.every=1", "pvpo.m=2", "log.progress=false",
]  # fmt: skip


def test_settings_layer_preset_quickstart_task_then_overrides() -> None:
    cfg = quickstart_config("arithmetic")
    assert (cfg.preset, cfg.advantage.estimator, cfg.filter.kind) == ("pvpo_paper", "pvpo", "group")
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


def _raw(low: float, high: float) -> dict:
    """A quickstart's raw results as the headline and the plot read them."""

    def run(after: float, presample: float) -> dict:
        return {"before": 0.571, "after": after, "rollouts_presample": presample,
                "rollouts_total": presample + 1920.0,
                "curve": [[0, presample, 0.1, 0.571], [20, presample + 640.0, 9.0, after]],
                "reward": [[1, 0.5], [20, 0.6]]}  # fmt: skip

    return {
        "task": "arithmetic", "settings": {"eval_prompts": 1000},
        "runs": {"pvpo": run(0.641, 2048.0), "grpo": run(0.624, 0.0)},
        "pvpo_minus_grpo": {"mean": (low + high) / 2, "low": low, "high": high, "prompts": 1000},
    }  # fmt: skip


def test_the_headline_is_worded_from_the_interval_and_names_each_run() -> None:
    above, below, across = _raw(0.006, 0.028), _raw(-0.03, -0.01), _raw(-0.002, 0.023)
    assert verdict(above["pvpo_minus_grpo"]) == (
        "PVPO ended ahead of GRPO in this run (the interval lies above 0)"
    )
    assert verdict(below["pvpo_minus_grpo"]).startswith("PVPO ended behind GRPO in this run")
    assert verdict(across["pvpo_minus_grpo"]) == (
        "this run cannot tell PVPO and GRPO apart (the interval covers 0)"
    )
    text = headline(across)
    assert text.startswith(
        "Held-out accuracy on 1000 prompts, before → after training: PVPO 0.571 → 0.641 "
        "(3968 rollouts, 2048 of them presampling), GRPO 0.571 → 0.624 (1920 rollouts). "
        "PVPO minus GRPO after training: +0.010 [-0.002, +0.023] "
    )
    assert "cannot tell PVPO and GRPO apart" in text and text.endswith(f"{CAVEAT[1:]}.")
    assert "ended ahead" in headline(above) and "ended behind" in headline(below)
    assert "->" in headline(above, arrow="->") and "→" not in headline(above, arrow="->")
    alone = _raw(0.0, 0.0)  # --no-compare: PVPO only, no verdict
    del alone["runs"]["grpo"], alone["pvpo_minus_grpo"]
    assert "GRPO" not in headline(alone) and "One seed" in headline(alone)


def test_the_plot_puts_both_runs_on_steps_and_on_total_rollouts() -> None:
    by_step, by_rollouts, reward = figure(_raw(0.0, 0.01)).axes
    for ax in (by_step, by_rollouts, reward):
        assert [line.get_label() for line in ax.get_lines()] == ["PVPO", "GRPO"]
    pvpo, grpo = by_rollouts.get_lines()
    assert list(pvpo.get_xdata()) == [2048.0, 2688.0]  # starts at its presampling cost
    assert list(grpo.get_xdata()) == [0.0, 640.0]
    assert list(by_step.get_lines()[0].get_xdata()) == [0, 20]
    assert list(pvpo.get_ydata()) == [0.571, 0.641]


@pytest.mark.slow
def test_quickstart_runs_end_to_end_and_reports(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "qs"
    runner = CliRunner()
    result = runner.invoke(app, ["quickstart", "--out", str(out), "--steps", "2", *TINY])
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output
    raw = json.loads((out / "quickstart.json").read_text())
    assert set(raw["runs"]) == {"pvpo", "grpo"} and raw["host"]["cpu"]
    assert "/" not in raw["command"].split("quickstart", 1)[1]  # no machine path
    before = raw["runs"]["pvpo"]["before"]
    assert f"PVPO held-out accuracy {before:.3f} -> " in result.output
    assert "GRPO held-out accuracy " in result.output and CAVEAT[1:] in result.output
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
    assert f"GRPO {g_before:.3f} → {g_after:.3f} (8 rollouts)" in report
    assert f"| held-out accuracy after training | {after:.3f} | {g_after:.3f} |" in report
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
    assert "GRPO" not in alone.output and "PVPO held-out accuracy" in alone.output
    bad = runner.invoke(app, ["quickstart", "--task", "chess", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "chess" in bad.output
    assert not (tmp_path / "b").exists()


def test_the_committed_raw_result_backs_the_readme_and_recomputes_its_interval() -> None:
    from pathlib import Path

    from anchor_rl.bench.quickstart_results import held_out_pair, is_raw
    from anchor_rl.bench.summary import paired

    root = Path(__file__).resolve().parents[2]
    raw = json.loads((root / "docs/results/quickstart/quickstart.json").read_text())
    assert is_raw(raw) and raw["command"] == "anchor-rl quickstart"  # the default settings
    pvpo, grpo = raw["runs"]["pvpo"], raw["runs"]["grpo"]
    pairs = {n: [held_out_pair(r)] for n, r in raw["runs"].items()}
    # one run a side: the two-level interval is the prompt-only one the raw result holds
    recomputed = paired(pairs, "grpo")["vs_baseline"]["pvpo"]
    assert {k: recomputed[k] for k in raw["pvpo_minus_grpo"]} == raw["pvpo_minus_grpo"]
    d = raw["pvpo_minus_grpo"]
    figures = (
        f"PVPO {pvpo['before']:.3f} → {pvpo['after']:.3f}, GRPO {grpo['before']:.3f} → "
        f"{grpo['after']:.3f}, +{d['mean']:.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
    ).replace("-", "−")
    readme = " ".join((root / "README.md").read_text().split())
    assert figures in readme and verdict(d).startswith("this run cannot tell")
