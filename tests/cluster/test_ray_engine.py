"""The ``ray`` engine on a local 2-CPU Ray: the same seeded GRPO run and the same PVPO anchors
as in one process, and rollouts that survive a worker killed with SIGKILL."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import metrics_but_timings

from anchor_rl.anchors.store import AnchorStore
from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.engine import RayEngine, shard_by_group
from anchor_rl.cluster.worker import RolloutWorker
from anchor_rl.rollout.engine import group_requests, make_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run

RAY = ["rollout.engine=ray", "rollout.engine_args.workers=2"]


def _record(engine) -> list[RolloutBatch]:
    """Keep every batch ``engine.rollout`` returns (wraps the instance's method)."""
    batches: list[RolloutBatch] = []
    inner = engine.rollout

    def rollout(*args, **kwargs):
        batches.append(inner(*args, **kwargs))
        return batches[-1]

    engine.rollout = rollout
    return batches


def _same_rows(a: RolloutBatch, b: RolloutBatch) -> None:
    assert a.texts == b.texts
    assert a.prompt_ids == b.prompt_ids
    for name in ("group", "response_ids", "attention_mask", "loss_mask", "tool_calls", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # the sampled tokens' log-probs: the same up to the forward pass's rounding, which the
    # shards' batch shapes may change in the last bits (anchor_rl.rollout.sampling)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_seeded_grpo_run_is_the_same_on_two_ray_workers(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    overrides = [*tiny, "steps=3", "optim.lr=1e-3"]
    local = start_run(load_config("grpo", overrides), tmp_path / "hf")
    local_batches = _record(local.engine)
    train(local)
    remote_cfg = load_config("grpo", [*overrides, *RAY, "rollout.engine_args.threads_per_worker=1"])
    remote = start_run(remote_cfg, tmp_path / "ray")
    engine = remote.engine
    try:
        assert isinstance(engine, RayEngine) and engine.workers == 2
        remote_batches = _record(engine)
        train(remote)
        # the same rollouts, call by call (training and evaluation), the same metrics and weights
        assert len(remote_batches) == len(local_batches) > 3
        for a, b in zip(local_batches, remote_batches, strict=True):
            _same_rows(a, b)
        assert metrics_but_timings(local.run_dir) == metrics_but_timings(remote.run_dir)
        assert any(r.get("grad_norm", 0) > 0 for r in read_metrics(local.run_dir))  # real updates
        for key, value in local.policy.state_dict().items():
            assert torch.equal(value, remote.policy.state_dict()[key]), key
        assert engine.syncs == 1 + 3  # the factory's push, then one after every update
        assert engine.restarts == 0
        assert engine.workers == 0  # the run closed its engine when it ended
    finally:
        engine.close()


@pytest.mark.slow
def test_pvpo_presampling_on_two_workers_stores_the_single_process_rows(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    overrides = [*tiny, "pvpo.m=2"]  # the paper's presampling: the walk before step 1
    local = start_run(
        load_config("pvpo_paper", [*overrides, f"pvpo.store={tmp_path}/hf.db"]), tmp_path / "hf"
    )
    # the policy's engine and presampling's engine (on the reference): 2 workers each
    half = [*RAY, "rollout.engine_args.num_cpus_per_worker=0.5"]
    remote_cfg = load_config("pvpo_paper", [*overrides, *half, f"pvpo.store={tmp_path}/ray.db"])
    remote = start_run(remote_cfg, tmp_path / "ray")
    presampler = remote.components["pvpo"].set.sampler.engine
    try:
        assert isinstance(presampler, RayEngine) and presampler is not remote.engine
        assert presampler.workers == 2 and presampler.syncs == 1

        def rows(path: str) -> list[dict]:
            with AnchorStore(path) as store:
                return [
                    {k: v for k, v in row.items() if k not in ("created", "updated")}
                    for row in store.rows("stats")
                ]

        local_rows, remote_rows = rows(f"{tmp_path}/hf.db"), rows(f"{tmp_path}/ray.db")
        assert len(local_rows) == len(parity.records("train")) == 8
        assert {r["n"] for r in remote_rows} == {2}
        assert remote_rows == local_rows  # same key, prompts, n, reward sums and correct counts
        local_set, remote_set = local.components["pvpo"].set, remote.components["pvpo"].set
        assert remote_set.key.digest == local_set.key.digest
        assert remote_set.result.rollouts == local_set.result.rollouts == 8 * 2
        remote.close()  # the run's engine and the component's presampling engine
        assert remote.engine.workers == presampler.workers == 0
    finally:
        remote.engine.close()
        presampler.close()


def test_a_second_cluster_address_in_one_process_is_refused(ray_local, tokenizer, tiny_model):
    with pytest.raises(
        ValueError, match=r"connected to the Ray cluster at .* cannot also join '10\.1\.2\.3:6379'"
    ):
        make_engine("ray", tiny_model, tokenizer, address="10.1.2.3:6379")


def test_workers_the_cluster_cannot_hold_are_refused(ray_local, tokenizer, tiny_model):
    with pytest.raises(ValueError, match=r"3 rollout workers x 1 CPU .* it has 2 CPU in all"):
        make_engine("ray", tiny_model, tokenizer, workers=3)


def test_an_unknown_decode_mode_is_refused_before_any_worker_starts(tokenizer, tiny_model):
    with pytest.raises(
        ValueError, match="decode must be one of auto, static, hf, graph, got 'fast'"
    ):
        make_engine("ray", tiny_model, tokenizer, decode="fast")


def test_a_worker_samples_with_the_decode_mode_it_was_given(tokenizer, tiny_model):
    spec = (type(tiny_model), tiny_model.config, None, tokenizer, torch.float32, "cpu", 1, 8)
    assert RolloutWorker(*spec, decode="hf").engine.decode == "hf"
    assert RolloutWorker(*spec).engine.decode == "auto"


def test_a_bf16_worker_samples_from_its_own_copy_as_the_in_process_bf16_engine(
    tokenizer, tiny_model
):
    spec = (type(tiny_model), tiny_model.config, None, tokenizer, torch.float32, "cpu", 1, 8)
    worker = RolloutWorker(*spec, precision="bf16")
    assert {p.dtype for p in worker.engine.model.parameters()} == {torch.bfloat16}
    worker.sync(tiny_model.state_dict())
    params = SamplingParams(max_new_tokens=12)
    local = make_engine("hf", tiny_model, tokenizer, precision="bf16").rollout(REQUESTS, params)
    _same_rows(worker.rollout(REQUESTS, params, None, None), local)


def test_an_unknown_precision_is_refused_before_any_worker_starts(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="precision must be one of model, bf16, got 'fp16'"):
        make_engine("ray", tiny_model, tokenizer, precision="fp16")


# -- faults: the engine below lives for the rest of the module (keep these tests last: it
# holds 1 of the 2 CPUs, which the runs above need) ---------------------------------------

PARAMS = SamplingParams(max_new_tokens=64)
REQUESTS = group_requests([f"q{i}" for i in range(8)], [f"p{i}" for i in range(8)], 4, 0, "kill")


@pytest.fixture(scope="module")
def threads():
    """One torch thread in this process, as in the workers, for the module's remaining tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(ray_local, threads, tokenizer, tiny_model):
    engine = make_engine(
        "ray", tiny_model, tokenizer, num_cpus_per_worker=0.5, threads_per_worker=1
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(threads, tokenizer, tiny_model):
    """The requests' batch sampled in this process."""
    return make_engine("hf", tiny_model, tokenizer).rollout(REQUESTS, PARAMS)


def test_a_worker_killed_between_calls_is_restarted(engine, expected, caplog):
    _same_rows(engine.rollout(REQUESTS, PARAMS), expected)
    pids, restarts = engine.pids(), engine.restarts
    os.kill(pids[0], signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="anchor_rl.cluster.engine"):
        batch = engine.rollout(REQUESTS, PARAMS)
    _same_rows(batch, expected)
    assert engine.restarts == restarts + 1
    now = engine.pids()
    assert now[0] != pids[0] and now[1] == pids[1]
    assert f"rollout worker 0 (pid {pids[0]}) died during rollout" in caplog.text
    assert "restarted it" in caplog.text


@dataclass
class StallingSearch:
    """A ``search`` tool whose first call (in any worker: ``marker`` is created atomically)
    writes its process id to ``marker`` and waits to be killed; other calls answer at once."""

    marker: str
    name: str = "search"

    def __call__(self, query: str) -> str:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return "found"
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(60)  # the test kills this process long before
        return "found"


@pytest.fixture
def by_value():
    """Send this module's classes (the tool) to the workers by value: they cannot import it."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_worker_killed_during_a_call_is_restarted_and_its_shard_resampled(
    engine, threads, by_value, tokenizer, tiny_model, tmp_path, caplog
) -> None:
    marker = tmp_path / "stalled.pid"
    marker.write_text("")  # present: the tool never stalls
    tools = {"search": StallingSearch(str(marker))}
    expected = make_engine("hf", tiny_model, tokenizer).rollout(REQUESTS, PARAMS, tools)
    marker.unlink()
    pids, restarts = engine.pids(), engine.restarts
    with (
        caplog.at_level(logging.WARNING, logger="anchor_rl.cluster.engine"),
        ThreadPoolExecutor(1) as pool,
    ):
        call = pool.submit(engine.rollout, REQUESTS, PARAMS, tools)
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline, "no worker called the tool (the seeds should)"
            time.sleep(0.05)
        stalled = int(marker.read_text())
        assert stalled in pids and not call.done()  # a worker in the middle of the call
        os.kill(stalled, signal.SIGKILL)
        batch = call.result(timeout=120)
    _same_rows(batch, expected)
    assert engine.restarts == restarts + 1
    assert f"(pid {stalled}) died during rollout" in caplog.text
    assert stalled not in engine.pids()


def test_a_death_met_by_a_sync_first_restarts_the_worker_once_for_its_pending_rollout(
    engine, threads, by_value, tokenizer, tiny_model, tmp_path, caplog
) -> None:
    """An asynchronous step: a rollout submitted, then its worker killed mid-shard, then the
    update's sync_weights, which meets the death first and restarts the worker. Collecting
    the rollout re-sends the shard to that replacement: one death, one restart, the healthy
    replacement kept (it used to be killed and replaced again). The re-sent shard is sampled
    with the weights the replacement holds, the newer ones; the other shard with the old."""
    marker = tmp_path / "stalled.pid"
    marker.write_text("")  # present: the tool never stalls
    tools = {"search": StallingSearch(str(marker))}
    old = make_engine("hf", tiny_model, tokenizer).rollout(REQUESTS, PARAMS, tools)
    newer = copy.deepcopy(tiny_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    new = make_engine("hf", newer, tokenizer).rollout(REQUESTS, PARAMS, tools)
    marker.unlink()
    pids, restarts = engine.pids(), engine.restarts
    try:
        with caplog.at_level(logging.WARNING, logger="anchor_rl.cluster.engine"):
            pending = engine.submit(REQUESTS, PARAMS, tools)
            deadline = time.monotonic() + 60
            while not (marker.exists() and marker.read_text()):
                assert time.monotonic() < deadline, "no worker called the tool"
                time.sleep(0.05)
            stalled = int(marker.read_text())
            w = pids.index(stalled)
            os.kill(stalled, signal.SIGKILL)
            engine.sync_weights(newer.state_dict())  # meets the death: restarts worker w
            assert engine.restarts == restarts + 1
            replacement = engine.pids()
            batch = pending.result()
        assert engine.restarts == restarts + 1  # not a second time
        assert engine.pids() == replacement and replacement[w] != stalled
        shards = shard_by_group([r.group for r in REQUESTS], 2)
        assert caplog.text.count("restarted it as pid") == 1
        assert f"re-sent its {len(shards[w])} requests to the new worker" in caplog.text
        assert "with the weights of 1 later sync(s)" in caplog.text
        # each row is the sample, log-probs included, of the weights that sampled it
        for rows, ref in ((shards[w], new), (shards[1 - w], old)):
            for i in rows:
                n = int(ref.attention_mask[i].sum())
                assert batch.texts[i] == ref.texts[i]
                torch.testing.assert_close(
                    batch.logprobs[i, :n], ref.logprobs[i, :n], rtol=0, atol=1e-5
                )
        assert [batch.texts[i] for i in shards[w]] != [old.texts[i] for i in shards[w]]
    finally:
        engine.sync_weights(tiny_model.state_dict())  # the module's engine, as it was


DRIVER = Path(__file__).with_name("presample_driver.py")


def _stats(db: Path) -> list[tuple]:
    """The store's statistics rows, timestamps left out, in prompt order."""
    if not db.exists():
        return []
    conn = sqlite3.connect(db)
    try:
        return conn.execute(
            "SELECT key, prompt_id, n, n_correct, reward_sum FROM stats ORDER BY prompt_id"
        ).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        conn.close()


@pytest.mark.slow
def test_a_driver_killed_mid_presample_on_workers_resumes_to_the_single_process_store(
    ray_local, tmp_path, one_thread
) -> None:
    """kill -9 of the driver while 2 Ray workers presample, then the same command again: the
    store ends with exactly the rows one process writes (the driver is the only writer). Both
    drivers join the module's running Ray (as drivers join a cluster), so neither pays for
    starting one; the single-process reference is sampled here while the second driver runs."""
    prompts, m = 24, 4
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    address = ray_local.get_runtime_context().gcs_address

    def driver(db: Path, engine: str) -> list[str]:
        return [sys.executable, str(DRIVER), str(db), str(prompts), str(m), engine, address]

    killed = tmp_path / "ray.db"
    proc = subprocess.Popen(driver(killed, "ray"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 180
    try:
        while len(_stats(killed)) < 8:
            assert proc.poll() is None, f"driver exited early: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "the driver made no progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 8 <= len(_stats(killed)) < prompts, "the kill must land mid-presample"
    again = subprocess.Popen(driver(killed, "ray"), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        spec = importlib.util.spec_from_file_location("presample_driver", DRIVER)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(str(tmp_path / "hf.db"), prompts, m, "hf")  # one process, one thread
        out, err = again.communicate(timeout=300)
    finally:
        if again.poll() is None:
            again.kill()
    assert again.returncode == 0 and "done" in out, err[-3000:]
    rows = _stats(killed)
    assert len(rows) == prompts and {r[2] for r in rows} == {m}
    assert rows == _stats(tmp_path / "hf.db")  # same key, prompts, counts and reward sums
