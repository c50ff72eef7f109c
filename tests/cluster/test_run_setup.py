"""A run on Ray rollout workers, before its first step: worker sets that a local Ray cannot
hold together fail at once with the fix, and SIGTERM during the set-up (after ``ray.init``
installed its own handler) stops the command cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anchor_rl.cluster import connect
from anchor_rl.cluster.connect import WorkerSet, check_fit
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.run import ray_worker_sets, start_run

TESTS = Path(__file__).parents[1]
DRIVER = Path(__file__).with_name("setup_sigterm_driver.py")


def test_a_pvpo_run_on_ray_holds_the_policys_and_the_references_workers(tiny) -> None:
    pvpo = load_config("pvpo", [*tiny, "cluster.rollout_workers=2"])
    assert ray_worker_sets(pvpo) == [
        WorkerSet("the policy's", 2, 1.0, 0.0),
        WorkerSet("the reference's (PVPO presampling)", 2, 1.0, 0.0),
    ]
    grpo = load_config(
        "grpo", [*tiny, "rollout.engine=ray", "rollout.engine_args.num_cpus_per_worker=0.5"]
    )
    assert ray_worker_sets(grpo) == [WorkerSet("the policy's", 2, 0.5, 0.0)]
    assert ray_worker_sets(load_config("pvpo", tiny)) == []  # sampled in this process


def test_worker_sets_that_do_not_fit_name_the_fraction_and_the_workers_that_do() -> None:
    sets = [WorkerSet("the policy's", 2, 1.0, 0.0), WorkerSet("the reference's", 2, 1.0, 0.0)]
    with pytest.raises(ConfigError) as exc:
        check_fit(sets, {"CPU": 2.0}, "cluster.rollout_workers", cores=2)
    message = str(exc.value)
    assert "need 4 CPU together" in message and "Ray has 2 in all" in message
    assert "num_cpus_per_worker=0.5 or cluster.rollout_workers=1" in message
    check_fit([s._replace(cpus=0.5) for s in sets], {"CPU": 2.0}, "cluster.rollout_workers")
    # one set alone above the cores (a local Ray sized up for it): the fix fits the cores
    big = [s._replace(workers=3) for s in sets]
    with pytest.raises(ConfigError, match=r"num_cpus_per_worker=0.33 or cluster.rollout_workers=1"):
        check_fit(big, {"CPU": 3.0}, "cluster.rollout_workers", cores=2)
    gpus = [s._replace(gpus=1.0) for s in sets]
    with pytest.raises(ConfigError, match=r"need 4 GPU .*num_gpus_per_worker=0.5 or x=1"):
        check_fit(gpus, {"CPU": 8.0, "GPU": 2.0}, "x")


@pytest.mark.slow
def test_pvpo_on_ray_too_big_for_the_local_ray_fails_before_loading_anything(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    """2 + 2 workers x 1 CPU on a 2-core machine: refused at once (the reference's workers
    would wait startup_timeout), the run directory not created, the Ray it started stopped."""
    import ray

    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(connect, "local_cpus", lambda: 2)
    cfg = load_config("pvpo", [*tiny, "cluster.rollout_workers=2"])
    with pytest.raises(ConfigError, match=r"num_cpus_per_worker=0.5 or cluster.rollout_workers=1"):
        start_run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert not ray.is_initialized()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_while_the_run_is_set_up_on_ray_exits_143_and_stops_ray(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(tmp_path / "run")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # blocks until the worker is up (or the driver ends)
        assert line.startswith("workers started"), proc.stderr.read()[-3000:]
        worker = int(line.split()[-1])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM while the run was set up" in err
    assert "no checkpoint is needed before step 1" in err
    assert "Traceback" not in err and "ray initialized: False" in out
    deadline = time.monotonic() + 60  # the worker goes with the Ray the driver shut down
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
