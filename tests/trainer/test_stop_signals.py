"""SIGTERM and Ctrl-C stop a run cleanly (anchor_rl.interrupt): the step in progress
finishes, its checkpoint is written, the message names it with the resume command, the exit
code is 128 + the signal; a second signal abandons the step or the checkpoint being written
without leaving partial files; and the resumed run's metrics equal a run never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import TINY, metrics_but_timings
from typer.testing import CliRunner

from anchor_rl.cli import app
from anchor_rl.interrupt import Interrupted, reclaim_signals, shielded, stop_signals
from anchor_rl.trainer import checkpoint, loop
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import RUN_LOG, train
from anchor_rl.trainer.run import resume_run, start_run

FAST = {  # the run's scale cut further where a preset adds work before the first step
    "pvpo": ["pvpo.m=4"],  # M >= N = 4: the preset's reuse takes its first group from M
    "vapo": ["critic.pretrain_steps=2"],
}


def signal_during_step(monkeypatch, step: int, *signums: int) -> None:
    """Send ``signums`` to this process as step ``step`` starts (before its rollouts), in the
    first run trained from here on."""
    original = loop.train_step
    sent = []

    def hooked(run):
        if run.state.step + 1 == step and not sent:
            sent.append(step)
            for signum in signums:
                os.kill(os.getpid(), signum)
        return original(run)

    monkeypatch.setattr(loop, "train_step", hooked)


def names(run_dir) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir)]


@pytest.mark.parametrize("preset", ["grpo", "pvpo", "v05", "vapo"])
def test_sigterm_checkpoints_the_step_and_the_resumed_run_is_exact(
    preset, parity, tmp_path, monkeypatch
) -> None:
    overrides = [*TINY, *FAST.get(preset, []), "optim.lr=1e-2", "checkpoint.every=0", "steps=4"]

    def config(name: str):  # each run its own anchor store: pvpo/anchors_sampled counts draws
        store = [f"pvpo.store={tmp_path / name}.db"] if preset == "pvpo" else []
        return load_config(preset, [*overrides, *store])

    straight = train(start_run(config("straight"), tmp_path / "straight"))
    before = signal.getsignal(signal.SIGTERM)  # another test's Ray may have set its own
    signal_during_step(monkeypatch, 3, signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        train(start_run(config("stopped"), tmp_path / "stopped"))
    run_dir = tmp_path / "stopped"
    assert stopped.value.exit_code == 143 and stopped.value.signal_name == "SIGTERM"
    message = str(stopped.value)
    assert message.startswith("stopped by SIGTERM after step 3 of 4")
    assert f"kept: checkpoint step_000003 ({run_dir / 'checkpoints' / 'step_000003'})" in message
    assert message.endswith(f"resume with: anchor-rl train --resume {run_dir}")
    assert names(run_dir) == ["step_000003"] and not (run_dir / "summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers were restored
    resumed = train(resume_run(run_dir))
    assert [r["step"] for r in metrics_but_timings(run_dir)] == [0, 1, 2, 3, 4]
    assert metrics_but_timings(straight.run_dir) == metrics_but_timings(resumed.run_dir)
    log = (run_dir / RUN_LOG).read_text()
    assert "stopped by SIGTERM after step 3 of 4" in log
    assert f"resuming {run_dir} from step_000003: step 4 of 4 is next" in log


def test_a_second_signal_abandons_the_step_and_the_periodic_checkpoint_resumes_exactly(
    parity, tmp_path, monkeypatch, capfd
) -> None:
    overrides = [*TINY, "optim.lr=1e-2", "checkpoint.every=2", "steps=4"]
    straight = train(start_run(load_config("grpo", overrides), tmp_path / "straight"))
    signal_during_step(monkeypatch, 4, signal.SIGINT, signal.SIGINT)
    with pytest.raises(Interrupted) as stopped:
        train(start_run(load_config("grpo", overrides), tmp_path / "stopped"))
    run_dir = tmp_path / "stopped"
    assert stopped.value.exit_code == 130
    assert str(stopped.value).startswith("stopped by SIGINT: the step or checkpoint in progress")
    assert "kept: checkpoint step_000002" in str(stopped.value)
    assert [r["step"] for r in metrics_but_timings(run_dir)] == [0, 1, 2, 3]  # 4 was abandoned
    assert "SIGINT received: finishing the step in progress" in capfd.readouterr().err
    resumed = train(resume_run(run_dir))  # redoes step 3 (after the checkpoint) and step 4
    assert metrics_but_timings(straight.run_dir) == metrics_but_timings(resumed.run_dir)


def test_a_second_signal_while_checkpointing_leaves_no_partial_checkpoint(
    parity, tmp_path, monkeypatch
) -> None:
    overrides = [*TINY, "checkpoint.every=1", "steps=4"]
    signal_during_step(monkeypatch, 2, signal.SIGINT)
    original = checkpoint.save_policy
    calls = []

    def interrupted_save(model, tokenizer, path):
        calls.append(path)
        original(model, tokenizer, path)  # the weights are on disk, the rest is not yet
        if len(calls) == 2:  # step 2's checkpoint: the stop's second Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoint, "save_policy", interrupted_save)
    with pytest.raises(Interrupted) as stopped:
        train(start_run(load_config("grpo", overrides), tmp_path / "run"))
    assert "kept: checkpoint step_000001" in str(stopped.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001"]


def test_a_stop_before_the_first_step_keeps_no_checkpoint_and_says_so(
    parity, tmp_path, monkeypatch
) -> None:
    def evaluate_then_stop(run, step):
        os.kill(os.getpid(), signal.SIGTERM)
        return {"eval/accuracy": 0.0}, {}

    monkeypatch.setattr(loop, "evaluate_policy", evaluate_then_stop)
    with pytest.raises(Interrupted) as stopped:
        train(start_run(load_config("grpo", [*TINY, "steps=3"]), tmp_path / "run"))
    assert "kept: no checkpoint; anchor-rl train --resume" in str(stopped.value)
    assert "starts the run again from step 0" in str(stopped.value)
    assert names(tmp_path / "run") == []


def test_the_shield_defers_a_second_signal_to_its_end() -> None:
    with stop_signals() as request:
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.requested and request.signum == signal.SIGTERM
        done = []
        with pytest.raises(Interrupted) as stopped, shielded():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("rest of the block")
        assert done == ["rest of the block"] and stopped.value.exit_code == 143


def test_resume_of_a_missing_directory_gives_the_command_that_starts_one(tmp_path) -> None:
    missing = tmp_path / "nowhere"
    result = CliRunner().invoke(app, ["train", "--resume", str(missing)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "holds no run to resume (no such directory)" in lines[0]
    assert lines[0].endswith(f"start one there with: anchor-rl train --preset NAME --out {missing}")


def test_the_command_stopped_by_sigterm_exits_143_and_resumes_from_its_step(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--preset", "grpo", *TINY, "steps=200", "eval.every=0", "--out", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "anchor_rl.cli", *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    kept = names(run_dir)
    assert len(kept) == 1 and "run finished" not in out
    assert f"kept: checkpoint {kept[0]}" in err
    assert f"resume with: anchor-rl train --resume {run_dir}" in err.splitlines()[-1]
    step = int(kept[0].removeprefix("step_"))
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run_dir), f"steps={step + 1}"])
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming {run_dir} from {kept[0]}: step {step + 1} of {step + 1} is next" in (
        resumed.output
    )
    assert f"from {kept[0]}" in (run_dir / RUN_LOG).read_text()


def test_ctrl_c_while_the_run_is_set_up_says_nothing_was_kept(tmp_path, monkeypatch) -> None:
    def interrupted_setup(cfg, run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr("anchor_rl.trainer.run.start_run", interrupted_setup)
    result = CliRunner().invoke(app, ["train", *TINY, "--out", str(tmp_path / "run")])
    assert result.exit_code == 130
    assert "stopped by SIGINT while the run was set up, before its first step" in result.output


def test_a_block_with_nothing_to_keep_stops_at_the_first_signal_a_library_took() -> None:
    before = signal.getsignal(signal.SIGTERM)

    def librarys(signum, frame):  # as ray.init's handler: sys.exit wherever the run is
        raise AssertionError("the library's handler ran")

    try:
        with pytest.raises(Interrupted) as stopped, stop_signals(at_once="{signal}: none kept"):
            signal.signal(signal.SIGTERM, librarys)
            reclaim_signals()
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("the first signal did not stop the block")
        assert stopped.value.exit_code == 143 and str(stopped.value) == "SIGTERM: none kept"
        assert signal.getsignal(signal.SIGTERM) is librarys  # what the block ended on
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_while_the_run_is_set_up_exits_143_saying_no_checkpoint_is_needed(
    tmp_path, monkeypatch
) -> None:
    def terminated_setup(cfg, run_dir):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not stop the set-up")

    def unhandled(signum, frame):  # what the process had: the set-up must replace it
        raise RuntimeError("SIGTERM reached the process's own handler")

    monkeypatch.setattr("anchor_rl.trainer.run.start_run", terminated_setup)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        result = CliRunner().invoke(app, ["train", *TINY, "--out", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert result.exit_code == 143, result.output
    assert "stopped by SIGTERM while the run was set up, before its first step: no checkpoint" in (
        result.output
    )
