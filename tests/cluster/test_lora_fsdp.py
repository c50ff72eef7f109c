"""LoRA runs on FSDP2-sharded learners (cluster.learners = 2, learner_sharding = fsdp, gloo):
each rank holds half of the frozen base weights and of the adapters, the optimiser steps the
adapters alone, rank 0 gathers only the adapters into the run's policy (whose base tensors, and
its reference's, stay as they were), a run matches one learner's, and a resumed run matches one
never stopped, its checkpoints holding the adapter and its optimiser state only."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import assert_ranks_match, metrics_but_timings

from anchor_rl.cluster import learners as learners_module
from anchor_rl.models.lora import ADAPTER_WEIGHTS, is_lora
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

KEYS = ("loss/policy", "loss/kl", "loss/total", "grad_norm", "policy/ratio_mean", "critic/loss",
        "critic/grad_norm", "critic/value_mean")  # fmt: skip
FSDP = ["cluster.learners=2", "cluster.learner_sharding=fsdp"]


def _base(tiny: list[str], steps: int) -> list[str]:
    # padded layout, as the learner tests: packing each rank's shard changes the rounding
    return [*tiny, f"steps={steps}", "eval.every=0", "optim.lr=1e-2", "optim.mini_batches=2",
            "cluster.threads_per_learner=1", "optim.padding_free=off", "lora.rank=4"]  # fmt: skip


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple]:
    """What rank 0's ``learners.<name>`` returns (its shard of the policy or the critic,
    with the optimiser), appended as it builds them."""
    shards: list[tuple] = []
    real = getattr(learners_module, name)
    monkeypatch.setattr(learners_module, name, lambda *a: shards.append(real(*a)) or shards[-1])
    return shards


def _check_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``model`` (rank 0's FSDP2 shard) holds about half of each frozen weight's bytes, and
    ``optimizer`` steps its trainable (adapter, head) parameters and nothing else."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    whole = sum(p.numel() * p.element_size() for p in frozen)  # a DTensor's: the full shape
    held = sum(p.to_local().numel() * p.element_size() for p in frozen)
    assert whole > 0 and 0.45 * whole <= held <= 0.55 * whole
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trains = {id(p) for p in model.parameters() if p.requires_grad}
    assert stepped == trains and 0 < len(trains) < len(frozen) * 3


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_a_lora_ppo_run_on_two_fsdp_learners_matches_one(
    parity, tiny, tmp_path, one_thread, monkeypatch
) -> None:
    """PPO with a KL term (the reference: the base model, adapters taken out, sharing the run's
    policy's base tensors) and a critic of adapters on the base model's body: 3 steps of 2
    mini-batches on one learner and on 2 FSDP shards of the policy and of the critic."""
    policies, critics = _spy(monkeypatch, "_sharded_learner"), _spy(monkeypatch, "_sharded_critic")
    gathered: list[set[str]] = []  # the names rank 0 gathers from the shards after an update
    real = learners_module.full_weights
    monkeypatch.setattr(
        learners_module, "full_weights", lambda m: gathered.append(set(s := real(m))) or s
    )
    cfg = [*_base(tiny, 3), "kl.coef=0.04", "critic.lr=1e-2"]
    one = train(start_run(load_config("ppo", cfg), tmp_path / "one"))
    two = start_run(load_config("ppo", [*cfg, *FSDP]), tmp_path / "two")
    start_base = _frozen(two.policy)
    train(two)
    a = assert_ranks_match(one.run_dir, two.run_dir, KEYS, steps=3)
    assert any(r["loss/kl"] > 0 for r in a)

    assert len(policies) == len(critics) == 1  # rank 0's shards, half of every frozen weight
    _check_shard(*policies[0][:2])
    _check_shard(*critics[0])

    # the run's policy: its base tensors untouched (the reference's, the critic's), its
    # adapters one learner's within rounding (AdamW steps of lr = 1e-2, 6 of them)
    assert is_lora(two.policy) and is_lora(two.components["critic"].critic.backbone)
    for name, tensor in _frozen(two.policy).items():
        assert torch.equal(tensor, start_base[name]), name
    # only the trained tensors travel: the policy's adapters, the critic's and its head
    assert len(gathered) == 3 * 2  # 3 steps: the policy's update, the critic's
    policy_names = set(_adapters(two.policy))
    critic_names = set(_adapters(two.components["critic"].critic))
    assert gathered.count(policy_names) == gathered.count(critic_names) == 3
    moved = _adapters(two.policy)
    diff = torch.cat([(t - moved[n]).abs().flatten() for n, t in _adapters(one.policy).items()])
    assert float(diff.max()) <= 2 * 6 * 1e-2
    assert int((diff > 1e-4).sum()) <= 3  # off by > 1% of lr: float rounding only


def test_a_lora_fsdp_run_resumes_as_one_never_stopped(
    parity, tiny, tmp_path, one_thread, monkeypatch
) -> None:
    """2 FSDP learners: the checkpoints hold the adapter and its AdamW state only (gathered
    from the shards); resumed from step 1, the run logs step 2 exactly as it did unstopped,
    and ends with the same adapters."""
    shards = _spy(monkeypatch, "_sharded_learner")
    cfg = [*_base(tiny, 2), *FSDP, "checkpoint.every=1", "checkpoint.keep=2"]
    run = train(start_run(load_config("grpo", cfg), tmp_path / "run"))
    first, last = list_checkpoints(run.run_dir)
    assert {p.name for p in (last / "policy").glob("*.safetensors")} == {ADAPTER_WEIGHTS}
    saved = torch.load(last / "optimizer.pt", weights_only=True)
    adapters = _adapters(run.policy)
    assert len(saved["state"]) == len(adapters) > 0  # the adapters' state, nothing else
    assert all(float(entry["step"]) == 2 * 2 for entry in saved["state"].values())
    unstopped = metrics_but_timings(run.run_dir)
    shutil.rmtree(last)  # as if stopped after step 1
    resumed = train(resume_run(run.run_dir, {}))
    assert len(shards) == 2  # the resumed run's update ran on 2 sharded learners again
    assert metrics_but_timings(resumed.run_dir) == unstopped
    assert [r["step"] for r in unstopped] == [1, 2]
    for name, tensor in _adapters(resumed.policy).items():
        assert torch.equal(tensor, adapters[name]), name
