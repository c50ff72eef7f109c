"""An SFT run stopped by SIGINT or SIGTERM keeps its state beside its directory, and the same
call continues it to exactly the run never stopped (losses, class-stop evaluations, kept
weights); its progress line says when it stops."""

from __future__ import annotations

import json
import os
import signal

import pytest
from safetensors.torch import load_file

import anchor_rl.tasks
from anchor_rl.interrupt import Interrupted
from anchor_rl.models import sft
from anchor_rl.models.sft_state import STATE_FILE, partial_dir
from anchor_rl.tasks.base import Record, Task


class EchoTask(Task):
    """Repeat a two-letter word inside an answer tag."""

    name = "echo"

    def records(self, split):
        return [Record(id=a + b, prompt=a + b, answer=a + b) for a in "abcdefgh" for b in "abcd"]

    def reward(self, completion, record):
        return float(record.answer in completion)

    def trace(self, record):
        return f"<answer>{record.answer}</answer>"


def weight_shares(model, tokenizer, task, records, k):
    """A validator that reads the weights (so a restored run must restore them) and never
    stops the run early (acc=0 stays at half)."""
    x = float(sum(p.detach().double().sum() for p in model.parameters()))
    middle = abs(x * 1e3) % 0.3
    return {f"avg@{k}": x, "acc=0": 0.5, "0<acc<1": middle, "acc=1": 0.5 - middle}


KWARGS = dict(steps=20, batch_size=8, lr=3e-3, validate=weight_shares,
              class_stop={"val_prompts": 8, "every": 5, "k": 2, "coarse": 1})  # fmt: skip


@pytest.fixture
def echo(monkeypatch, tmp_path):
    monkeypatch.setattr(anchor_rl.tasks, "get_task", lambda name, **kw: EchoTask(), raising=False)
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))


def signal_at(monkeypatch, step: int, signum: int) -> None:
    """Send ``signum`` to this process as SFT step ``step`` (0-based) starts."""
    original = sft.lr_at

    def hooked(at, cfg):
        if at == step:
            os.kill(os.getpid(), signum)
        return original(at, cfg)

    monkeypatch.setattr(sft, "lr_at", hooked)


def test_an_interrupted_sft_continues_to_the_run_never_stopped(echo, tmp_path, monkeypatch, capsys):
    straight = sft.train_sft("echo", out=tmp_path / "straight", progress=False, **KWARGS)
    out = tmp_path / "stopped"
    with monkeypatch.context() as m:
        signal_at(m, 7, signal.SIGTERM)
        with pytest.raises(Interrupted) as stopped:
            sft.train_sft("echo", out=out, progress=False, **KWARGS)
    message = str(stopped.value)
    assert stopped.value.exit_code == 143
    assert message.startswith("sft echo/tiny stopped at step 8 of at most 20")
    assert f"kept: its state, {partial_dir(out) / STATE_FILE}" in message
    assert message.endswith("the same command continues it from step 8")
    assert not out.exists() and (partial_dir(out) / STATE_FILE).is_file()

    resumed = sft.train_sft("echo", out=out, progress=True, **KWARGS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "sft echo/tiny: stops when the validation classes settle (checked every 5 steps from "
        "step 0: acc=0 below 15% of 8 prompts); at most 20 steps; continuing an interrupted "
        "run from step 8"
    )
    assert lines[-1].startswith("sft echo/tiny: stopped at step 20 of at most 20: the step "
                                "budget ran out; kept step ")  # fmt: skip
    assert not partial_dir(out).exists()
    for name in ("loss.json", "class_stop.json"):
        assert json.loads((resumed / name).read_text()) == json.loads((straight / name).read_text())
    a, b = (load_file(p / "model.safetensors") for p in (straight, resumed))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_state_of_another_config_is_not_continued(echo, tmp_path, monkeypatch) -> None:
    out = tmp_path / "m"
    with monkeypatch.context() as m:
        signal_at(m, 3, signal.SIGINT)
        with pytest.raises(Interrupted):
            sft.train_sft("echo", out=out, progress=False, **KWARGS)
    other = {**KWARGS, "seed": 1}
    path = sft.train_sft("echo", out=out, progress=False, **other)
    fresh = sft.train_sft("echo", out=tmp_path / "fresh", progress=False, **other)
    losses = [json.loads((p / "loss.json").read_text()) for p in (path, fresh)]
    assert losses[0] == losses[1]  # trained from step 0, not from the other config's step 4


def test_run_sft_without_a_state_directory_says_it_starts_over(echo, tmp_path, monkeypatch):
    cfg = sft.default_config("echo", steps=6, batch_size=8, class_stop=None)
    signal_at(monkeypatch, 2, signal.SIGINT)
    with pytest.raises(Interrupted, match="stopped at step 3 of at most 6; nothing was kept: "
                                          "it starts over") as stopped:  # fmt: skip
        sft.run_sft(cfg, tmp_path, progress=False)
    assert stopped.value.exit_code == 130
