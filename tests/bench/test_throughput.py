"""Suite `throughput`: stage figures by hand, size selection, and a 1-step run on tiny."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from anchor_rl.bench import throughput
from anchor_rl.bench.throughput import (
    default_sizes,
    matmul_flops,
    model_shape,
    peak_fractions,
    stage_figures,
)
from anchor_rl.cli import app
from anchor_rl.models.factory import build_model, num_parameters
from anchor_rl.models.tokenizer import build_tokenizer


def _step(step, tokens, generate, score, update, total):
    return {
        "step": step, "tokens/step": tokens, "time/generate": generate, "time/score": score,
        "time/update": update, "time/step": total,
    }  # fmt: skip


def test_stage_figures_by_hand_leave_out_the_warmup_step() -> None:
    records = [
        {"step": 0, "eval/accuracy": 0.1},
        _step(1, 100.0, 9.0, 9.0, 9.0, 30.0),  # warm-up: left out
        _step(2, 100.0, 1.0, 0.25, 0.5, 2.0),
        _step(3, 100.0, 1.0, 0.25, 0.5, 2.0),
    ]
    f = stage_figures(records)
    assert f["steps"] == 2.0 and f["tokens_per_step"] == 100.0 and f["s_per_step"] == 2.0
    assert f["rollout_tok_s"] == 100.0  # 200 tokens / 2 s generating
    assert f["update_tok_s"] == 200.0  # 200 tokens / 1 s updating
    assert (f["frac_generate"], f["frac_score"], f["frac_update"]) == (0.5, 0.125, 0.25)
    assert f["frac_other"] == pytest.approx(0.125)
    assert f["frac_sync"] == 0.0  # records from before the weight push had its own timer
    synced = [{**r, "time/sync": 0.25} for r in records]  # the weight push: the rest of a step
    g = stage_figures(synced)
    assert g["frac_sync"] == 0.125 and g["frac_other"] == pytest.approx(0.0)
    assert g["update_tok_s"] == f["update_tok_s"]  # the push is not the update's time
    single = stage_figures(records[:2])  # one step: nothing left out
    assert single["steps"] == 1.0 and single["rollout_tok_s"] == pytest.approx(100 / 9)
    with pytest.raises(ValueError, match="no training step"):
        stage_figures(records[:1])
    # asynchronous rollouts: time/generate is a wait, so no rollout tokens/s
    stale = [{**r, "async/staleness": float(r["step"] > 1)} for r in records]
    assert "rollout_tok_s" not in stage_figures(stale)
    assert stage_figures(stale)["update_tok_s"] == 200.0


def test_default_sizes_and_model_shape() -> None:
    assert default_sizes("cpu") == ("tiny", "small", "base")
    assert default_sizes("cuda") == ("base",)
    assert default_sizes("cpu", "quick") == ("tiny",)
    assert model_shape("random:tiny")[0] == num_parameters(build_model("tiny", build_tokenizer()))


def test_one_step_on_tiny_through_the_cli(tmp_path) -> None:
    out = tmp_path / "tp"
    result = CliRunner().invoke(app, ["bench", "throughput", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads((out / "throughput.json").read_text())
    (row,) = payload["rows"]
    f = row["figures"]
    assert row["size"] == "tiny" and f["steps"] == 1.0
    assert f["rollout_tok_s"] > 0 and f["update_tok_s"] > 0
    shares = [f[f"frac_{k}"] for k in ("generate", "score", "update", "sync", "other")]
    assert sum(shares) == pytest.approx(1.0) and min(shares[:4]) >= 0
    assert payload["host"]["device"] == "cpu" and payload["settings"]["warmup_steps_excluded"] == 0
    assert "| tiny |" in (out / "throughput.md").read_text()
    assert (out / "stage_time.png").stat().st_size > 0
    assert "--profile quick" in payload["command"] and "from Python" not in payload["command"]
    assert f["rollout_peak_frac"] > 0 and f["update_peak_frac"] > 0


def test_peak_fractions_by_hand(monkeypatch) -> None:
    shapes = []

    def fake_flops(rows, hidden, device="cpu", repeats=10, dtype="float32"):
        shapes.append((rows, hidden, dtype))
        return 1e9 if rows == 64 else 2e9

    monkeypatch.setattr(throughput, "matmul_flops", fake_flops)
    figures = {"tokens_per_step": 1800.4, "rollout_tok_s": 1000.0, "update_tok_s": 500.0}
    out = peak_fractions(figures, parameters=1_000_000, hidden=128, batch=64)
    # a decode step's rows, then the step's tokens; float32 unless told
    assert shapes == [(64, 128, "float32"), (1800, 128, "float32")]
    assert out["rollout_peak_frac"] == pytest.approx(2 * 1e6 * 1000 / 1e9)  # 2.0
    assert out["update_peak_frac"] == pytest.approx(6 * 1e6 * 500 / 2e9)  # 1.5
    shapes.clear()
    peak_fractions(figures, 1_000_000, 128, 64, dtypes=("bfloat16", "float32"))
    assert [s[2] for s in shapes] == ["bfloat16", "float32"]
    assert matmul_flops(8, 16, repeats=2) > 0
    assert matmul_flops(8, 16, repeats=2, dtype="bfloat16") > 0


def test_matmul_dtypes_follow_the_precision_settings() -> None:
    from anchor_rl.bench.throughput import matmul_dtypes
    from anchor_rl.trainer.config import build_config

    def dtypes(**table):
        return matmul_dtypes(build_config({"preset": "grpo", **table}))

    assert dtypes() == ("float32", "float32")
    assert dtypes(optim={"autocast": "bf16"}) == ("float32", "bfloat16")
    bf16 = {"optim": {"autocast": "bf16"}, "rollout": {"engine_args": {"precision": "bf16"}}}
    assert dtypes(**bf16) == ("bfloat16", "bfloat16")


def test_a_model_directory_is_measured_as_its_own_row(tmp_path) -> None:
    """``model=DIR``: one row named after the directory, its parameters from its config."""
    from anchor_rl.bench.runner import BenchArgs
    from anchor_rl.bench.throughput import model_name, model_shape, run_throughput_suite
    from anchor_rl.models.loading import save_policy

    tokenizer = build_tokenizer()
    model = build_model("tiny", tokenizer, seed=3)
    model_dir = save_policy(model, tokenizer, tmp_path / "my-model+v2")
    assert model_name(str(model_dir)) == "my_model_v2"  # "+" would split the run label
    assert model_name("random:base") == "random_base"
    assert model_shape(str(model_dir)) == (num_parameters(model), 128)
    assert model_shape("sft:small") == (num_parameters(build_model("small", tokenizer)), 256)
    from anchor_rl.errors import AnchorRLError

    for bad in ("random:huge", str(tmp_path / "missing")):  # named, never a hub lookup
        with pytest.raises(AnchorRLError, match="neither a model directory"):
            model_shape(bad)
    out = tmp_path / "tp"
    overrides = [f"model={model_dir}"]
    result = run_throughput_suite(
        BenchArgs(out, profile="quick", overrides=overrides, echo=lambda _: None)
    )
    payload = json.loads(result["summary_json"].read_text())
    (row,) = payload["rows"]
    assert row["size"] == "my_model_v2" and row["model"] == str(model_dir)
    assert row["parameters"] == num_parameters(model) and row["figures"]["update_tok_s"] > 0
    assert f"model={model_dir}" in payload["command"]
    config = json.loads((out / "grpo+my_model_v2" / "seed0" / "config.json").read_text())
    assert config["model"] == str(model_dir)
    with pytest.raises(ValueError, match="either sizes or a model"):
        run_throughput_suite(BenchArgs(out, overrides=overrides), sizes=["tiny"])


def test_only_the_chosen_layouts_are_planned() -> None:
    """Planning makes only the runs chosen: the learner layouts (2 ranks: NCCL on CUDA, the
    GPU count checked when a rank is placed) are planned with the whole suite, not with a
    choice that leaves them out."""
    from pathlib import Path

    from anchor_rl.bench.runner import plan
    from anchor_rl.bench.throughput import throughput_suite

    whole = throughput_suite({"base": "random:base"})
    labels = {s.label for s in plan(whole, Path("unused"), overrides=["device=cuda"])}
    assert {"grpo+base", "grpo+base-g2", "grpo+base-l2"} <= labels
    chosen = throughput_suite({"base": "random:base"}, {"base", "base-g2"})
    specs = plan(chosen, Path("unused"), overrides=["device=cuda"])
    assert sorted(s.label for s in specs) == ["grpo+base", "grpo+base-g2"]
    g2 = next(s for s in specs if s.label == "grpo+base-g2").config
    assert g2.cluster.rollout_workers == 2 and g2.rollout.engine_args["num_gpus_per_worker"] > 0
