"""LoRA policies with Ray rollout workers: the workers hold plain models and receive the merged
weights (``models.lora.sampling_state``), so after an update they sample the policy, not its
base model."""

from __future__ import annotations

import pytest
from helpers import metrics_but_timings

from anchor_rl.cluster.engine import RayEngine
from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import sampling_state
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.lora_check import lora_policy, sampled_gaps, update_adapters
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run


def test_a_ray_worker_samples_the_updated_adapters(ray_local, tokenizer, one_thread) -> None:
    policy = lora_policy(build_model("tiny", tokenizer, seed=0))
    engine = make_engine("ray", policy, tokenizer, workers=1, threads_per_worker=1)
    try:
        update_adapters(make_engine("hf", policy, tokenizer), policy)
        stale, _ = sampled_gaps(engine, policy)  # the worker still holds the base weights
        engine.sync_weights(sampling_state(policy))  # what the loop does after an update
        to_policy, to_base = sampled_gaps(engine, policy)
    finally:
        engine.close()
    assert stale > 1e-2 and to_policy < 1e-4 and to_base > 1e-2, (stale, to_policy, to_base)


@pytest.mark.slow
def test_a_lora_run_on_a_ray_worker_is_the_in_process_run(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    overrides = [*tiny, "steps=3", "lora.rank=4", "optim.lr=1e-2"]
    local = train(start_run(load_config("grpo", overrides), tmp_path / "hf"))
    workers = ["cluster.rollout_workers=1", "rollout.engine_args.threads_per_worker=1"]
    remote = start_run(load_config("grpo", [*overrides, *workers]), tmp_path / "ray")
    assert isinstance(remote.engine, RayEngine)
    train(remote)
    assert remote.engine.syncs == 1 + 3  # the merged weights after every update
    metrics = metrics_but_timings(local.run_dir)
    assert metrics[-1]["kl/ref"] > 0
    assert metrics == metrics_but_timings(remote.run_dir)
