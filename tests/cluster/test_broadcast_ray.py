"""``weight_sync="collective"`` on a local 2-CPU Ray (gloo, CPU tensors): the workers hold the
driver's weights exactly after a broadcast (a plain and a LoRA policy), a worker that missed a
sync raises, a worker killed in the broadcast is replaced and the sync tried again, and a short
run's metrics are the in-process (and so the object store's) run's."""

from __future__ import annotations

import copy
import logging
import os
import signal

import pytest
import torch
from helpers import metrics_but_timings

import anchor_rl.cluster.broadcast as broadcast
from anchor_rl.cluster.engine import RayEngine
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run


@pytest.mark.slow
def test_a_run_with_collective_syncs_logs_the_in_process_runs_metrics(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    """The in-process run's metrics are the object store's (tests/cluster/test_ray_engine.py)."""
    overrides = [*tiny, "steps=2", "optim.lr=1e-2"]
    train(start_run(load_config("grpo", overrides), tmp_path / "hf"))
    workers = ["cluster.rollout_workers=1", "rollout.engine_args.threads_per_worker=1",
               "cluster.weight_sync=collective"]  # fmt: skip
    run = start_run(load_config("grpo", [*overrides, *workers]), tmp_path / "bcast")
    assert isinstance(run.engine, RayEngine) and run.engine._group is not None
    train(run)
    assert run.engine.syncs == 1 + 2
    metrics = metrics_but_timings(tmp_path / "hf")
    assert any(r.get("grad_norm", 0) > 0 for r in metrics)  # the weights did change
    assert metrics == metrics_but_timings(tmp_path / "bcast")


@pytest.fixture(scope="module")
def engine(ray_local, tokenizer, tiny_model):
    engine = RayEngine(
        copy.deepcopy(tiny_model), tokenizer, workers=2, num_cpus_per_worker=0.5,
        threads_per_worker=1, weight_sync="collective", sync_timeout=20,
    )  # fmt: skip
    yield engine
    engine.close()


def _worker_weights(engine: RayEngine) -> list[dict[str, torch.Tensor]]:
    ray = engine._ray
    read = lambda self: {k: v.cpu() for k, v in self.engine.model.state_dict().items()}  # noqa: E731
    return ray.get([w.__ray_call__.remote(read) for w in engine._workers])


def _shifted(model: torch.nn.Module, by: float) -> torch.nn.Module:
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model


def _assert_hold(engine: RayEngine, state) -> None:
    for weights in _worker_weights(engine):
        assert weights.keys() == state.keys()
        for name in state:
            assert torch.equal(weights[name], state[name]), name


def test_after_a_collective_sync_every_worker_holds_the_drivers_weights(engine, tiny_model) -> None:
    _assert_hold(engine, tiny_model.state_dict())  # the factory's push
    state = _shifted(tiny_model, 0.01).state_dict()
    before = engine.syncs
    engine.sync_weights(state)
    assert engine.syncs == before + 1
    _assert_hold(engine, state)


def test_a_lora_policy_sends_its_merged_weights(engine, tiny_model) -> None:
    pytest.importorskip("peft")
    from anchor_rl.models.lora import LoRAConfig, apply_lora, sampling_state

    policy = apply_lora(copy.deepcopy(tiny_model), LoRAConfig(rank=4))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)  # adapters that change the weights
    merged = {k: v.clone() for k, v in sampling_state(policy).items()}
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        tiny_model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    engine.sync_weights(sampling_state(policy))
    _assert_hold(engine, merged)


def test_a_worker_that_missed_a_sync_raises(engine, tiny_model) -> None:
    engine.syncs += 1  # the next sync's version skips one
    try:
        with pytest.raises(RuntimeError, match="missed a sync"):
            engine.sync_weights(tiny_model.state_dict())
    finally:
        engine.syncs -= 1
    engine.sync_weights(tiny_model.state_dict())  # in step again
    _assert_hold(engine, tiny_model.state_dict())


def test_a_worker_killed_in_the_broadcast_is_replaced_and_the_sync_tried_again(
    engine, tiny_model, monkeypatch, caplog
) -> None:
    """gloo reports the dead peer to the driver's broadcast at once; the second try restarts
    the worker (given the last synced weights), rebuilds the group and delivers the weights."""
    send = broadcast.SyncGroup.send
    killed = []

    def kill_then_send(group, *args):
        if not killed:
            killed.append(engine._pids[0])
            os.kill(killed[0], signal.SIGKILL)
        return send(group, *args)

    monkeypatch.setattr(broadcast.SyncGroup, "send", kill_then_send)
    restarts, syncs = engine.restarts, engine.syncs
    state = _shifted(tiny_model, 0.02).state_dict()
    with caplog.at_level(logging.WARNING, logger="anchor_rl.cluster.engine"):
        engine.sync_weights(state)
    assert engine.restarts == restarts + 1 and engine.syncs == syncs + 1
    assert engine._pids[0] != killed[0]
    assert "the collective weight sync (version" in caplog.text
    assert "worker 0: ActorDiedError" in caplog.text and "trying once more" in caplog.text
    _assert_hold(engine, state)
