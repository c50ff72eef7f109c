"""Faults leave recoverable state: a NaN step, a run stopped before its first checkpoint, a
torn metrics line, a failed or corrupt checkpoint, a missing accelerator, bad model
directories."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import ViTConfig

from anchor_rl.errors import AnchorRLError, NonFiniteError
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import check_device, load_policy, save_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer import checkpoint as checkpoint_mod
from anchor_rl.trainer import loop
from anchor_rl.trainer import run as run_mod
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import METRICS_FILE, read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run


def _cfg(tiny, *extra):
    return load_config("grpo", [*tiny, "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3",
                                "optim.lr=1e-2", *extra])  # fmt: skip


def test_a_nan_step_stops_the_run_and_keeps_the_last_good_checkpoint(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    calls = []
    real = loop.compute_advantages

    def second_step_nan(cfg, inputs):
        calls.append(1)
        adv = real(cfg, inputs)
        return adv * float("nan") if len(calls) == 2 else adv

    monkeypatch.setattr(loop, "compute_advantages", second_step_nan)
    run = start_run(_cfg(tiny, "steps=3"), tmp_path / "run")
    with pytest.raises(NonFiniteError) as error:
        train(run)
    message = str(error.value)
    assert message.startswith("step 2: the policy update: loss/policy = nan")
    assert "step_000001 (resume it with --resume" in message and "optim.lr (now 0.01)" in message
    assert [p.name for p in list_checkpoints(run.run_dir)] == ["step_000001"]
    saved = load_file(list_checkpoints(run.run_dir)[0] / "policy" / "model.safetensors")
    live = run.policy.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)  # the NaN step was not applied
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1]


def test_a_run_stopped_before_its_first_checkpoint_starts_again(parity, tiny, tmp_path) -> None:
    cfg = _cfg(tiny, "steps=2")
    start_run(cfg, tmp_path / "run")  # set up, then "killed" before any step
    again = train(start_run(cfg, tmp_path / "run"))  # the same command starts it over
    assert [r["step"] for r in read_metrics(again.run_dir)] == [1, 2]
    start_run(cfg, tmp_path / "other")
    resumed = train(resume_run(tmp_path / "other", {"steps": 2}))  # --resume starts at 0
    assert [r["step"] for r in read_metrics(resumed.run_dir)] == [1, 2]


def test_a_run_whose_set_up_failed_is_started_over_whatever_its_config(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    real = run_mod._assemble

    def fails(*args, **kwargs):
        raise ValueError("the engine could not start")

    monkeypatch.setattr(run_mod, "_assemble", fails)
    with pytest.raises(ValueError, match="could not start"):
        start_run(_cfg(tiny, "seed=5"), tmp_path / "run")
    assert (tmp_path / "run" / "config.json").is_file()  # written before the set-up failed
    monkeypatch.setattr(run_mod, "_assemble", real)
    start_run(_cfg(tiny), tmp_path / "run")  # the corrected command: nothing to lose there
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == 0
    (tmp_path / "run" / METRICS_FILE).write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    with pytest.raises(AnchorRLError, match=r"holds another run \(its config differs in seed\)"):
        start_run(_cfg(tiny, "seed=5"), tmp_path / "run")  # a run that logged: kept


def test_a_corrupt_run_config_is_named_on_resume(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"task": "arith')
    with pytest.raises(AnchorRLError, match=r"config.json is not a run's config"):
        resume_run(tmp_path)


def test_a_run_directory_given_as_a_model_points_at_its_checkpoints(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(load_config("grpo").model_dump(mode="json")))
    with pytest.raises(AnchorRLError, match="run directory, not a model.*no checkpoint yet"):
        load_policy(tmp_path)
    for step in ("step_000001", "step_000002"):
        (tmp_path / "checkpoints" / step / "policy").mkdir(parents=True)
    newest = tmp_path / "checkpoints" / "step_000002" / "policy"
    with pytest.raises(AnchorRLError, match=f"the newest is {newest}"):
        load_policy(tmp_path)


def test_the_same_command_on_a_saved_run_says_how_to_resume(parity, tiny, tmp_path) -> None:
    cfg = _cfg(tiny, "steps=1")
    train(start_run(cfg, tmp_path / "run"))
    with pytest.raises(AnchorRLError, match="continue it with anchor-rl train --resume"):
        start_run(cfg, tmp_path / "run")
    with pytest.raises(AnchorRLError, match=r"holds another run \(its config differs in seed\)"):
        start_run(_cfg(tiny, "steps=1", "seed=5"), tmp_path / "run")
    with pytest.raises(AnchorRLError, match="holds no run"):
        resume_run(tmp_path / "nothing")


def test_a_torn_last_metrics_line_is_dropped_on_resume(parity, tiny, tmp_path) -> None:
    run = train(start_run(_cfg(tiny, "steps=2"), tmp_path / "run"))
    with (run.run_dir / METRICS_FILE).open("a") as f:
        f.write('{"step": 3, "reward/me')  # killed mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        resumed = train(resume_run(run.run_dir, {"steps": 3}))
    assert [r["step"] for r in read_metrics(resumed.run_dir)] == [1, 2, 3]


def test_a_failed_checkpoint_write_leaves_no_partial_files(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    run = train(start_run(_cfg(tiny, "steps=1"), tmp_path / "run"))
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod.torch, "save", disk_full)
    run.state.step = 2
    with pytest.raises(AnchorRLError, match=r"No space left.*step_000001 is intact"):
        run.save()
    root = run.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no .tmp directory


def test_a_corrupt_checkpoint_is_named_and_the_previous_one_offered(parity, tiny, tmp_path) -> None:
    run = train(start_run(_cfg(tiny, "steps=2"), tmp_path / "run"))
    newest = list_checkpoints(run.run_dir)[-1]
    (newest / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(AnchorRLError) as error:
        resume_run(run.run_dir, {"steps": 3})
    assert "step_000002" in str(error.value) and "--from step_000001" in str(error.value)
    resumed = train(resume_run(run.run_dir, {"steps": 3}, from_checkpoint="step_000001"))
    assert resumed.state.step == 3
    with pytest.raises(AnchorRLError, match="has no checkpoint 'step_000009'"):
        resume_run(run.run_dir, {"steps": 4}, from_checkpoint="step_000009")


def test_a_missing_gpu_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AnchorRLError, match="device=cuda but no CUDA GPU is visible"):
        check_device("cuda")
    check_device("cpu")


def test_bad_model_directories_are_named(tmp_path) -> None:
    tokenizer = build_tokenizer()
    with pytest.raises(AnchorRLError, match="does not exist"):
        load_policy(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AnchorRLError, match="no config.json"):
        load_policy(empty)
    vision = tmp_path / "vision"
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=8).save_pretrained(vision)  # fmt: skip
    tokenizer.save_pretrained(vision)
    with pytest.raises(AnchorRLError, match=r"not a causal LM \(vit\)"):
        load_policy(vision)
    small = save_policy(build_model("tiny", tokenizer, seed=0), tokenizer, tmp_path / "m")
    bigger = build_tokenizer()
    bigger.add_tokens([f"<extra{i}>" for i in range(200)])
    bigger.save_pretrained(small)
    with pytest.raises(AnchorRLError, match="tokens but the model's embeddings only"):
        load_policy(small)
