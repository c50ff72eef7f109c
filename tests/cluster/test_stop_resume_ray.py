"""SIGTERM stops a run whose rollouts run on two Ray workers like any other run: the step in
progress finishes, its checkpoint is written, the workers go back to the cluster, and the
resumed run (on two new workers) writes the metrics of a run never stopped."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import metrics_but_timings

from anchor_rl.interrupt import Interrupted
from anchor_rl.trainer import loop
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run


@pytest.mark.slow
def test_sigterm_on_ray_workers_resumes_to_the_metrics_of_a_straight_run(
    ray_local, parity, tiny, tmp_path, monkeypatch, one_thread
) -> None:
    overrides = [*tiny, "steps=3", "optim.lr=1e-2", "checkpoint.every=0"]
    straight = train(start_run(load_config("grpo", overrides), tmp_path / "straight"))
    workers = [*overrides, "cluster.rollout_workers=2"]
    original = loop.train_step

    def sigterm_in_step_2(run):
        if run.state.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(run)

    monkeypatch.setattr(loop, "train_step", sigterm_in_step_2)
    stopped = start_run(load_config("grpo", workers), tmp_path / "ray")
    with pytest.raises(Interrupted) as exc:
        train(stopped)
    assert exc.value.exit_code == 143 and "kept: checkpoint step_000002" in str(exc.value)
    assert stopped.engine.workers == 0  # the stopped run gave its workers back
    assert [p.name for p in list_checkpoints(tmp_path / "ray")] == ["step_000002"]
    monkeypatch.setattr(loop, "train_step", original)
    resumed = train(resume_run(tmp_path / "ray"))
    assert metrics_but_timings(straight.run_dir) == metrics_but_timings(resumed.run_dir)
