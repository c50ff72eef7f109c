"""SFT warm start on a tiny synthetic task: example masks, loss goes down, determinism, caching."""

from __future__ import annotations

import json

import pytest
import torch

import anchor_rl.tasks
from anchor_rl.models import sft
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.tasks.base import Record, Task
from anchor_rl.tools.parsing import format_result


class CopyTask(Task):
    """Repeat a two-letter word inside an answer tag (the trace also makes one tool call)."""

    name = "copy"

    def records(self, split):
        words = [a + b for a in "abcdefgh" for b in "abcdefgh"]
        return [Record(id=w, prompt=w, answer=w) for w in words]

    def reward(self, completion, record):
        return float(f"<answer>{record.answer}</answer>" in completion)

    def trace(self, record):
        return (
            f"<search>{record.prompt}</search>{format_result('ok')}<answer>{record.answer}</answer>"
        )


@pytest.fixture
def copy_task(monkeypatch, tmp_path):
    monkeypatch.setattr(anchor_rl.tasks, "get_task", lambda name, **kw: CopyTask(), raising=False)
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))
    return CopyTask()


def test_example_masks_prompt_and_tool_output(copy_task):
    tok = build_tokenizer()
    ids, mask = sft.sft_example(tok, copy_task, copy_task.records("train")[0])
    prompt = tok.encode("<|user|>aa<|end|><|assistant|>")
    call, result = tok.encode("<search>aa</search>"), tok.encode(format_result("ok"))
    answer = tok.encode("<answer>aa</answer>")
    assert ids == prompt + call + result + answer + [tok.eos_token_id]
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)


def test_lr_schedule_hand_values():
    cfg = sft.SFTConfig(task="copy", steps=120, lr=1e-3, warmup=20)
    assert sft.lr_at(0, cfg) == pytest.approx(5e-5)
    assert sft.lr_at(19, cfg) == pytest.approx(1e-3)
    assert sft.lr_at(70, cfg) == pytest.approx(1e-3 * (0.1 + 0.45))
    assert sft.lr_at(120, cfg) == pytest.approx(1e-4)


def test_length_bucketed_batches_cover_each_epoch_with_similar_lengths():
    lengths = [(7 * i) % 64 for i in range(64)]  # a permutation of 0..63
    batches = list(
        sft.length_bucketed_batches(lengths, 4, 32, torch.Generator().manual_seed(0), pool=4)
    )
    assert len(batches) == 32 and all(len(b) == 4 for b in batches)
    for epoch in (batches[:16], batches[16:]):
        assert sorted(i for b in epoch for i in b) == list(range(64))
    # each pool of 16 (4 consecutive batches) is cut from a sorted list: the batches'
    # length ranges do not overlap
    for start in range(0, 32, 4):
        ranges = sorted(
            (min(lengths[i] for i in b), max(lengths[i] for i in b))
            for b in batches[start : start + 4]
        )
        assert all(hi < lo for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False))


def test_config_key_changes_with_any_field():
    base = sft.SFTConfig(task="copy")
    assert base.key() == sft.SFTConfig(task="copy").key()
    assert (
        len(
            {
                base.key(),
                sft.SFTConfig(task="copy", seed=1).key(),
                sft.SFTConfig(task="copy", lr=1e-4).key(),
            }
        )
        == 3
    )
    with pytest.raises(ValueError, match="steps"):
        sft.SFTConfig(task="copy", steps=0)


def test_scoring_only_task_arguments_do_not_change_the_reference():
    """multihop's reward changes no record or trace: the same cached SFT with or without it
    (a suite training with reward=pvpo reuses `anchor-rl sft`'s model); top_k changes the
    traces' tool results, so it keys another model."""
    plain = sft.default_config("multihop", "tiny").key()
    assert sft.default_config("multihop", "tiny", task_kwargs={"reward": "pvpo"}).key() == plain
    scored = sft.default_config("multihop", "small", "teacher", task_kwargs={"reward": "f1"})
    assert scored.key() == sft.default_config("multihop", "small", "teacher").key()
    assert scored.task_kwargs == {}
    assert sft.default_config("multihop", "tiny", task_kwargs={"top_k": 2}).key() != plain


@pytest.mark.slow
def test_sft_reduces_loss_is_deterministic_and_cached(copy_task, tmp_path, monkeypatch):
    kwargs = {"steps": 40, "lr": 3e-3, "batch_size": 16, "seed": 0, "progress": False}
    path = sft.train_sft("copy", "tiny", **kwargs)
    assert path.parent == tmp_path / "cache" / "sft"
    losses = json.loads((path / "loss.json").read_text())
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert (path / "loss_curve.png").stat().st_size > 1000
    assert json.loads((path / "sft_config.json").read_text())["steps"] == 40

    other = sft.train_sft("copy", "tiny", out=tmp_path / "again", **kwargs)
    assert json.loads((other / "loss.json").read_text()) == losses

    def no_training(*args, **kw):
        raise AssertionError("a cached config must not train again")

    monkeypatch.setattr(sft, "run_sft", no_training)
    assert sft.train_sft("copy", "tiny", **kwargs) == path
    with pytest.raises(AssertionError, match="must not train"):
        sft.train_sft("copy", "tiny", **{**kwargs, "seed": 1})


def test_out_dir_holding_something_else_is_refused(copy_task, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file.txt").write_text("x")
    with pytest.raises(FileExistsError, match="does not hold this SFT config"):
        sft.train_sft("copy", "tiny", steps=1, out=tmp_path / "busy", progress=False)


def test_data_kwargs_shape_the_sft_data_only(tmp_path, monkeypatch):
    seen = []

    def get_task(name, **kwargs):
        seen.append(kwargs)
        return CopyTask()

    monkeypatch.setattr(anchor_rl.tasks, "get_task", get_task, raising=False)
    cfg = sft.default_config("copy", task_kwargs={"hops": [2, 3, 4], "seed": 1},
                             data_kwargs={"hops": [2, 3]}, steps=1, batch_size=2)  # fmt: skip
    assert cfg.key() != sft.default_config("copy", task_kwargs=cfg.task_kwargs, steps=1).key()
    sft.run_sft(cfg, tmp_path / "m", progress=False)
    assert seen == [{"hops": [2, 3], "seed": 1}]  # layered on task_kwargs
    assert sft.default_config("multihop").data_kwargs == {"hops": [2, 3]}
    assert sft.default_config("multihop", data_kwargs={}).data_kwargs == {}


def test_the_teacher_role_trains_on_every_record_for_longer():
    reference, teacher = (
        sft.default_config("multihop"),
        sft.default_config("multihop", "tiny", "teacher"),
    )
    assert (reference.steps, reference.data_kwargs) == (400, {"hops": [2, 3]})
    assert (teacher.steps, teacher.data_kwargs) == (600, {})  # every hop: no curriculum
    assert teacher.key() != reference.key()
    assert sft.default_config("arithmetic", "small", "teacher").steps == 4000
    assert sft.default_config("multihop", "tiny", "teacher", steps=5).steps == 5  # an override wins
    with pytest.raises(ValueError, match="role must be one of reference, teacher, got 'oracle'"):
        sft.default_config("multihop", "tiny", "oracle")


def test_a_teacher_spec_loads_the_cached_teacher_sft(copy_task, monkeypatch):
    from anchor_rl.models.spec import load_spec

    monkeypatch.setitem(
        sft.TASK_DEFAULTS, "copy", {"steps": 1, "batch_size": 2, "data_kwargs": {"x": 1}}
    )
    monkeypatch.setitem(sft.TEACHER_DEFAULTS, "copy", {"steps": 2})
    model, _ = load_spec("teacher:tiny", "copy", {}, seed=0, device="cpu", progress=False)
    stored = json.loads((sft.cache_root() / "sft").glob("*/sft_config.json").__next__().read_text())
    assert (stored["steps"], stored["data_kwargs"], stored["batch_size"]) == (2, {}, 2)
    assert model.config.hidden_size == 128  # the tiny size
    load_spec("sft:tiny", "copy", {}, seed=0, device="cpu", progress=False)
    assert (
        len(list((sft.cache_root() / "sft").glob("*/sft_config.json"))) == 2
    )  # not the same model


def test_sft_cli_trains_the_teacher(copy_task, monkeypatch):
    from typer.testing import CliRunner

    from anchor_rl.cli import app

    monkeypatch.setitem(anchor_rl.tasks.TASKS, "copy", CopyTask)
    monkeypatch.setitem(sft.TASK_DEFAULTS, "copy", {"steps": 3})
    result = CliRunner().invoke(app, ["sft", "--task", "copy", "--teacher", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert (
        "SFT copy/tiny teacher: steps=6" in result.output
    )  # no teacher entry: 2 x the reference's
    stored = json.loads((sft.cache_root() / "sft").glob("*/sft_config.json").__next__().read_text())
    assert (stored["steps"], stored["data_kwargs"]) == (6, {})
