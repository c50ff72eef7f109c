"""The testbed controls' step accounting: SFT continued from a saved reference, its
learning rate, the matched step counts and the plateau stop."""

from __future__ import annotations

import json

import pytest
import torch

from anchor_rl.bench.controls import (
    Continuation,
    PlateauStop,
    SFTData,
    continuation_lr,
    continue_sft,
    time_matched_steps,
    token_matched_steps,
    train_to_plateau,
)
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import save_policy
from anchor_rl.models.sft import SFTConfig, lr_at, sft_example
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.tasks import get_task

CFG = SFTConfig(task="arithmetic", steps=100, lr=1e-3, batch_size=4, warmup=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny model saved as a reference, and 24 arithmetic SFT examples."""
    tokenizer = build_tokenizer()
    task = get_task("arithmetic")
    examples = [sft_example(tokenizer, task, r) for r in task.records("train")[:24]]
    data = SFTData(examples, task.records("train")[24:28], task, tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("ref")
    save_policy(build_model("tiny", tokenizer, seed=0), tokenizer, path)
    return path, data


def test_continuation_lr_warms_up_then_follows_the_schedule_and_holds_its_floor():
    assert continuation_lr(CFG, 40, 0) == pytest.approx(lr_at(40, CFG) / 5)
    assert continuation_lr(CFG, 40, 2) == pytest.approx(lr_at(42, CFG) * 3 / 5)
    assert continuation_lr(CFG, 40, 10) == pytest.approx(lr_at(50, CFG))
    assert continuation_lr(CFG, 40, 500) == pytest.approx(CFG.lr / 10)


def test_matched_step_counts():
    assert token_matched_steps(6400, 32) == 200
    assert token_matched_steps(6401, 32) == 201
    assert time_matched_steps(0.5, 100, 0.1) == 500
    with pytest.raises(ValueError):
        token_matched_steps(10, 0)
    with pytest.raises(ValueError):
        time_matched_steps(0.5, 100, 0)


def test_continuation_counts_its_steps_and_seeds_its_data_order(tiny):
    path, data = tiny
    tokenizer = build_tokenizer()
    orders = []
    for seed in (0, 0, 1):
        model = build_model("tiny", tokenizer, seed=0)
        run = Continuation(model, CFG, 40, data, seed, horizon=6)
        run.step(2)
        run.step(3)
        assert run.done == 5 and len(run.losses) == 5 and run.seconds > 0
        assert run.optimizer.param_groups[0]["lr"] == pytest.approx(continuation_lr(CFG, 40, 4))
        orders.append(run.losses)
    assert orders[0] == orders[1]
    assert orders[0] != orders[2]


def test_continue_sft_measures_at_each_checkpoint_in_order(tiny):
    path, data = tiny
    seen = []

    def measure(model, tokenizer, steps):
        seen.append((steps, model.training))
        return {"held_out": steps / 10}

    points = continue_sft(path, CFG, 40, 0, [4, 2, 4], measure, data)
    assert seen == [(2, False), (4, False)]
    assert [p["steps"] for p in points] == [2, 4]
    assert all(p["loss"] is not None and p["sft_seconds"] > 0 for p in points)


def test_plateau_stop_rule():
    rule = PlateauStop(patience=2, min_delta=0.01)
    assert not rule.stop_after([0.5, 0.6])
    assert not rule.stop_after([0.5, 0.6, 0.605, 0.62])
    assert rule.stop_after([0.5, 0.6, 0.605, 0.609])
    assert rule.best([0.5, 0.6, 0.6, 0.59]) == 1


def test_train_to_plateau_keeps_the_best_evaluation(tiny, tmp_path, monkeypatch):
    path, data = tiny
    import anchor_rl.bench.controls as controls
    from anchor_rl.models.loading import load_policy

    monkeypatch.setattr(controls, "sft_data", lambda cfg, tokenizer: data)
    scores = iter([0.2, 0.4, 0.3, 0.35])

    def validate(model, tokenizer, task, records, k):
        assert records == data.validation and k == 8
        return {"avg@8": next(scores), "acc=0": 0.0, "0<acc<1": 1.0, "acc=1": 0.0}

    rule = PlateauStop(every=2, patience=2, min_delta=0.05, max_steps=20)
    summary = train_to_plateau(path, CFG, 40, rule, validate, tmp_path / "out", echo=lambda _: None)
    assert [e["steps"] for e in summary["evaluations"]] == [0, 2, 4, 6]
    assert summary["kept"]["steps"] == 2 and summary["kept"]["sft_step"] == 42
    assert summary["stopped_after"] == 6
    saved = json.loads((tmp_path / "out" / "plateau.json").read_text())
    assert saved["kept"] == summary["kept"]
    # the saved weights are the continuation's after 2 steps, not after 6
    kept, _ = load_policy(tmp_path / "out")
    replay, _ = load_policy(path)
    Continuation(replay, CFG, 40, data, 0, horizon=20).step(2)
    for name, value in replay.state_dict().items():
        assert torch.equal(kept.state_dict()[name], value), name


def test_compare_reads_grpo_runs_from_the_controls_reference(tmp_path):
    import argparse

    import sft_control

    from anchor_rl.trainer.logging import pack_counts

    ref, sft_a, sft_b, grpo = "0011", "0111", "1111", "1101"
    seeds = {"0": [{"steps": 3, "counts": sft_a}, {"steps": 5, "counts": sft_b}]}
    control = {"reference": {"held_out": 0.5, "counts": ref},
               "sft": {"by_tokens": {"steps": 3}, "by_time": {"steps": 5}, "seeds": seeds}}  # fmt: skip
    (tmp_path / "sft_control.json").write_text(json.dumps(control))
    run = tmp_path / "grpo" / "seed0"
    run.mkdir(parents=True)

    def entry(step, counts):
        correct = {f"arithmetic-test-{i}": int(c) for i, c in enumerate(counts)}
        return json.dumps({"step": step, "test": pack_counts({"k": 1, "correct": correct})})

    (run / "evals.jsonl").write_text(entry(0, ref) + "\n" + entry(100, grpo) + "\n")
    args = argparse.Namespace(out=tmp_path, grpo_runs=tmp_path / "grpo")
    out = sft_control.compare(args)
    assert out["grpo_held_out"] == [0.75]
    assert out["grpo_gain"][0] == pytest.approx(0.25)
    assert out["by_tokens"]["grpo_minus_sft"][0] == pytest.approx(0.0)
    assert out["by_time"]["sft_gain"][0] == pytest.approx(0.5)
    assert out["by_time"]["grpo_minus_sft"][0] == pytest.approx(-0.25)
    (run / "evals.jsonl").write_text(entry(0, "1111") + "\n" + entry(100, grpo) + "\n")
    with pytest.raises(SystemExit, match="another reference"):
        sft_control.compare(args)
