"""The verl plug-in inside verl 0.9.1's own worker code, on the CPU.

- verl's model build beside trl 1.16: ``apply_monkey_patch`` on the tiny model raises
  ``ImportError`` without the plug-in (verl's own code, plug-ins off); with it the worker
  slice builds its model;
- the CPU mode (``VERL_PLATFORM=cpu``) is off unless asked: the platform is registered but
  never auto-detected, verl's process-group set-up and engine registry untouched;
- the worker slice (``verl_worker_slice.py``, a subprocess in the CPU mode): verl's actor
  worker (FSDP2, fp32, gloo) computing log-probs, training with ``anchor_rl_ppo`` and with
  VAPO's ``vapo_actor_loss``, saving and loading its engine checkpoint (the losses it
  reports are anchor-rl's own functions on the log-probs the worker computed), and verl's
  weight sync into the ``anchor_rl`` rollout backend (after it, the sampler's log-probs
  are the actor's); and a second actor in verl's bf16 mixed precision, one step;
- the start-up check of the registrations (:mod:`anchor_rl.integrations.verl.registry`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import verl.models.transformers.monkey_patch as monkey_patch
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from anchor_rl.algos.losses import nll, policy_loss
from anchor_rl.integrations.verl import compat, cpu
from anchor_rl.integrations.verl.registry import (
    PluginNotRegisteredError,
    check_registered,
    problems,
)
from anchor_rl.integrations.verl.trainer import AnchorRLTrainer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import verl_worker_slice as slice_  # noqa: E402

TOL = dict(rel=1e-4, abs=1e-5)


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``env`` over this one's (VERL_PLATFORM removed)."""
    full = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"} | env
    full["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], env=full, cwd=ROOT,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


BUILD = textwrap.dedent("""
    import verl
    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    model = build_model("tiny", build_tokenizer(), seed=0)
    try:
        apply_monkey_patch(model, use_remove_padding=False)
    except ImportError as e:
        print("IMPORT-ERROR", e)
    else:
        print("BUILT")
""")


def test_verl_model_build_with_trl_fails_without_the_plugin():
    """verl's own model-build patching on the tiny model, plug-ins off: trl 1.16 is importable
    and lacks the class, so verl raises. With the plug-in the same build runs: the worker
    slice below builds its actor through it (``init_model``)."""
    assert not compat.value_head_available(), "this trl has the value-head class: no crash"
    bare = run(BUILD, VERL_USE_EXTERNAL_PLUGINS="none")
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert "IMPORT-ERROR" in bare.stdout and "AutoModelForCausalLMWithValueHead" in bare.stdout


def test_value_head_probe_follows_trl(monkeypatch):
    """With a trl that has the class, verl's patch of it runs as before (the probe says yes)."""
    import types

    fake = types.ModuleType("trl.experimental.ppo")
    fake.AutoModelForCausalLMWithValueHead = type("AutoModelForCausalLMWithValueHead", (), {})
    monkeypatch.setitem(sys.modules, "trl.experimental.ppo", fake)
    compat.value_head_available.cache_clear()
    try:
        assert compat.value_head_available()
    finally:
        monkeypatch.delitem(sys.modules, "trl.experimental.ppo")
        compat.value_head_available.cache_clear()
    assert not compat.value_head_available()
    assert monkey_patch.is_trl_available is compat.value_head_available


def test_the_critic_loads_with_sdpa_wherever_flash_attention_is_missing(monkeypatch, tmp_path):
    """verl's critic loader asks for flash-attention 2 on every platform; without the package
    (this machine, or a GPU machine without it) the plug-in's loader takes ``sdpa`` and the
    critic loads. With flash-attn importable verl's own loader is kept."""
    import importlib.util

    import verl.utils.model as model_utils
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    assert importlib.util.find_spec("flash_attn") is None
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    compat.patch()  # the plug-in's load already did; a second call changes nothing
    loader = model_utils.load_valuehead_model
    assert loader.__wrapped__.__module__ == "verl.utils.model"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    critic_config = AutoConfig.from_pretrained(tmp_path, num_labels=1)
    critic = loader(str(tmp_path), torch.float32, critic_config, False)
    assert critic.config._attn_implementation == "sdpa" and critic.score.out_features == 1
    monkeypatch.setattr(model_utils, "load_valuehead_model", loader.__wrapped__)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real(name, *a))  # fmt: skip
    compat.patch()
    assert model_utils.load_valuehead_model is loader.__wrapped__


def test_cpu_mode_is_off_unless_asked(monkeypatch):
    from verl.plugin.platform.platform_manager import PlatformRegistry, _detect_platform_name
    from verl.utils import distributed
    from verl.workers.engine import EngineRegistry

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert PlatformRegistry.get("cpu") is not None
    assert _detect_platform_name() != "cpu"  # never auto-detected
    assert not cpu.requested() and not cpu.activate()
    assert not hasattr(distributed.initialize_global_process_group_ray, "__wrapped__")
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    assert not hasattr(fsdp_engine.CPUOffloadPolicy, "__wrapped__")
    for model_type in ("language_model", "value_model"):
        assert "cpu" not in EngineRegistry._engines[model_type]["fsdp2"]
    device = PlatformRegistry.get("cpu")().device_module
    assert device.max_memory_allocated() == 0 and device.mem_get_info()[1] > 0
    monkeypatch.setenv("VERL_PLATFORM", " CPU ")
    assert cpu.requested()


SHARD = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    __ENGINE__
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=__PORT__)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    # the reference's policy, as verl's FSDP2 engine builds it for a forward-only model
    policy = fsdp_engine.CPUOffloadPolicy(pin_memory=True)
    mesh = init_device_mesh("cpu", (1,))
    try:
        for layer in model:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        with torch.no_grad():
            out = model(x)
    except RuntimeError as e:
        print("SHARD-ERROR", e)
    else:
        print("SHARDED", policy.pin_memory, torch.allclose(out, expected))
""")


@pytest.mark.parametrize("mode", ["cpu", "none"])
def test_reference_offload_runs_on_the_cpu(mode):
    """verl shards the reference model (forward-only) with a pinned-memory CPU offload, which
    needs an accelerator: without the CPU mode it fails on this machine, with it the policy is
    unpinned and the sharded model computes what the plain one does."""
    # verl's engine module in the CPU mode; else torch's policy, which verl's engine uses
    # unchanged outside the CPU mode (test_cpu_mode_is_off_unless_asked)
    engine = (
        "import verl.workers.engine.fsdp.transformer_impl as fsdp_engine"
        if mode == "cpu"
        else "import torch.distributed.fsdp as fsdp_engine"
    )
    env = {"VERL_PLATFORM": "cpu"} if mode == "cpu" else {}
    code = SHARD.replace("__ENGINE__", engine).replace("__PORT__", repr(str(slice_._free_port())))
    done = run(code, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    if mode == "cpu":
        assert "SHARDED False True" in done.stdout, done.stdout[-2000:]
    else:
        assert "SHARD-ERROR" in done.stdout and "accelerator" in done.stdout, done.stdout[-2000:]


@pytest.fixture(scope="module")
def worker_slice(tmp_path_factory) -> dict:
    """``verl_worker_slice.py``'s results, run once per test session: under pytest-xdist the
    workers share one run (the session's common temporary folder, under a file lock): a
    worker that gets some of this module's tests while or after the other one runs it waits
    for its file and reads it."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.getbasetemp().parent / "verl_worker_slice"
    else:
        out = tmp_path_factory.mktemp("verl_worker")
    with FileLock(f"{out}.lock"):
        if not (out / "slice.pt").exists():
            env = dict(os.environ) | {
                "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
            }  # fmt: skip
            proc = subprocess.run(
                [sys.executable, str(HERE / "verl_worker_slice.py"), str(out)], env=env,
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return torch.load(out / "slice.pt", weights_only=False)


def test_worker_runs_on_the_cpu_platform_with_gloo(worker_slice):
    assert worker_slice["platform"] == ("cpu", "gloo")
    assert worker_slice["trl"]  # verl built the model with trl 1.16 importable: the fix held
    assert worker_slice["lp0"].abs().sum() > 0
    assert (worker_slice["lp0"][worker_slice["mask"] == 0] == 0).all()


def test_anchor_rl_ppo_trains_in_verls_worker(worker_slice):
    r = worker_slice
    mask, adv = r["mask"].float(), r["advantages"]
    low, high, clip_c = r["clip"]
    assert r["loss_agg_mode"] == "token-mean"
    # the loss verl's worker reports is anchor-rl's clipped surrogate on its own log-probs
    for step, (logp, old) in (("m1", (r["lp0"], r["lp0"])), ("m2", (r["lp1"], r["lp0"]))):
        expected, _ = policy_loss(logp, old, adv, mask, low, high, clip_c, "token-mean")
        assert r[step]["actor/pg_loss"][0] == pytest.approx(float(expected), **TOL)
        assert r[step]["loss"][0] == pytest.approx(float(expected), **TOL)
    assert 0 < r["m2"]["actor/anchor_rl/clipfrac_high"][0] < 1  # step 2 is off-policy
    # log-probs rose on the positive-advantage rows and fell on the negative ones
    for later in ("lp1", "lp2"):
        change = (r[later] - r["lp0"]).sum(-1)
        signs = torch.tensor(slice_.SIGNS)
        assert (torch.sign(change) == signs).all(), (later, change)


def test_vapo_actor_loss_adds_the_nll_of_correct_rows(worker_slice):
    r = worker_slice
    mask, logp = r["mask"].float(), r["lp2"]
    weight = torch.tensor(slice_.NLL_WEIGHTS)
    batches = [slice(i, i + slice_.MICRO) for i in range(0, slice_.B, slice_.MICRO)]
    local = [nll(logp[b], mask[b], weight[b] > 0) for b in batches]
    metrics = r["m3"]
    # the NLL metric: anchor-rl's token-mean NLL of each micro-batch's correct rows, averaged
    assert metrics["actor/anchor_rl/nll_loss"][0] == pytest.approx(
        float(sum(local) / len(local)), **TOL
    )
    # the loss: verl's PPO loss + nll_coef x the NLL on verl's global token normaliser
    tokens = mask.sum()
    term = sum(
        n * (mask[b].sum(-1) * weight[b]).sum() / tokens
        for n, b in zip(local, batches, strict=True)
    )
    assert metrics["loss"][0] - metrics["actor/pg_loss"][0] == pytest.approx(
        slice_.NLL_COEF * float(term), **TOL
    )
    assert (r["lp3"][0] - r["lp2"][0]).sum() > 0  # a correct row's likelihood rose


def test_engine_checkpoint_saves_and_restores(worker_slice):
    r = worker_slice
    assert {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt",
            "extra_state_world_size_1_rank_0.pt"} <= set(r["checkpoint_files"])  # fmt: skip
    assert not torch.equal(r["lp4"], r["lp3"])  # step 4 moved the weights
    torch.testing.assert_close(r["lp5"], r["lp3"], rtol=0, atol=1e-6)  # the weights came back
    # the optimizer state too: step 4 from the loaded state repeats step 4
    torch.testing.assert_close(r["lp6"], r["lp4"], rtol=0, atol=1e-5)
    assert r["m4_again"]["loss"][0] == pytest.approx(r["m4"]["loss"][0], **TOL)


def test_bf16_mixed_precision_trains_on_the_cpu(worker_slice):
    """verl's bf16 mixed precision in the CPU mode (FSDP2 ``param_dtype=bf16``, fp32 master
    weights and reduction): the worker computes its log-probs in bf16, within bf16's
    rounding of the fp32 worker's on the same initial weights (unlike those, not equal to
    them), and an ``anchor_rl_ppo`` step on them raises the positive rows and lowers the
    negative ones, the weights and AdamW's moments staying fp32."""
    r, bf16 = worker_slice, worker_slice["bf16"]
    assert r["lp_dtypes"] == ["torch.float32"] and bf16["lp_dtypes"] == ["torch.bfloat16"]
    mask = r["mask"] > 0
    gap = (bf16["lp0"] - r["lp0"])[mask].abs()
    assert 0 < gap.max() < 0.1, gap  # bf16 keeps 8 bits of mantissa: ~0.02 at |log p| ~ 5
    assert (bf16["lp0"][~mask] == 0).all()
    # on-policy step 1: the ratio is 1, the loss anchor-rl's surrogate (as the fp32 step 1)
    assert bf16["m1"]["actor/anchor_rl/ratio_mean"][0] == pytest.approx(1.0, abs=1e-6)
    assert bf16["m1"]["grad_norm"][0] > 0
    change = (bf16["lp1"] - bf16["lp0"]).sum(-1)
    assert (torch.sign(change) == torch.tensor(slice_.SIGNS)).all(), change
    assert bf16["param_dtypes"] == ["torch.float32"] and bf16["moment_dtypes"] == ["torch.float32"]


def test_registrations_are_checked_at_trainer_start(monkeypatch):
    assert problems() == []
    check_registered()
    monkeypatch.delitem(ADV_ESTIMATOR_REGISTRY, "anchor_rl_pvpo")
    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "anchor_rl_ppo", POLICY_LOSS_REGISTRY["vanilla"])
    monkeypatch.delitem(_agent_loop_registry, "anchor_rl_teacher")
    monkeypatch.setitem(TRAINER_REGISTRY, "anchor_rl", PPOTrainerSync)
    found = problems()
    assert len(found) == 4
    with pytest.raises(PluginNotRegisteredError) as info:
        AnchorRLTrainer(config=None)  # refused before the config is read
    message = str(info.value)
    for name in (
        "anchor_rl_pvpo",
        "anchor_rl_ppo",
        "anchor_rl_teacher",
        "VERL_USE_EXTERNAL_PLUGINS",
    ):
        assert name in message
    assert "compute_policy_loss_vanilla" in message and "PPOTrainerSync" in message


def test_registration_check_sees_the_trl_fix_missing(monkeypatch):
    from verl.utils.import_utils import is_trl_available

    monkeypatch.setattr(monkey_patch, "is_trl_available", is_trl_available)
    with pytest.raises(PluginNotRegisteredError, match="trl fix"):
        check_registered()


def test_verls_weight_sync_reaches_the_anchor_rl_rollout_backend(worker_slice):
    r = worker_slice
    before, after, woken = r["before_sync"], r["after_sync"], r["after_wake"]
    # the server samples with the initial weights until verl syncs the trained actor's
    assert (before["rollout"] - before["actor"]).abs().max() > 1e-3
    assert "RolloutAsleepError" in r["asleep"]  # replica.sleep(): generation refused
    # after the worker's own update_weights the sampler's log-probs are the actor's
    assert after["mask"].sum() > 0
    torch.testing.assert_close(after["rollout"], after["actor"], atol=1e-5, rtol=0)
    torch.testing.assert_close(woken["rollout"], after["rollout"], atol=0, rtol=0)  # same ids
    assert before["steps"] == {None} and after["steps"] == {5}  # the synced step, reported
    assert r["generated"] == 3 * slice_.B  # the refused request generated nothing
