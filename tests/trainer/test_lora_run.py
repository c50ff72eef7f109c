"""LoRA runs end to end (lora.rank > 0): `tiny`, `small` and an HF-format model directory; the
KL reference is the base model; checkpoints hold the adapter and its optimiser state only;
resume is exact; PVPO's anchors of a fresh adapter are the base model's; eval --adapter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import llama_variants, metrics_but_timings
from safetensors.torch import load_file
from typer.testing import CliRunner

from anchor_rl.anchors.presample import RolloutSampler
from anchor_rl.cli import app
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import save_policy
from anchor_rl.models.lora import is_lora
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

LORA = ["lora.rank=4", "optim.lr=1e-2", "checkpoint.every=2"]


def test_a_lora_run_resumes_exactly_and_checkpoints_the_adapter_only(
    parity, tiny, tmp_path
) -> None:
    overrides = [*tiny, *LORA]
    straight = train(start_run(load_config("grpo", [*overrides, "steps=4"]), tmp_path / "a"))
    half = train(start_run(load_config("grpo", [*overrides, "steps=2"]), tmp_path / "b"))
    resumed = train(resume_run(half.run_dir, {"steps": 4}))
    assert is_lora(straight.policy) and is_lora(resumed.policy)
    metrics = metrics_but_timings(straight.run_dir)
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert metrics == metrics_but_timings(resumed.run_dir)  # bit-identical
    # the reference is the base model: the KL to it grows from 0 as the adapters move
    assert metrics[1]["kl/ref"] == 0.0 and metrics[-1]["kl/ref"] > 1e-3
    assert all(r["grad_norm"] > 0 for r in metrics[1:])
    last = [list_checkpoints(r.run_dir)[-1] for r in (straight, resumed)]
    files = {p.name for p in (last[0] / "policy").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    adapters = [load_file(c / "policy" / "adapter_model.safetensors") for c in last]
    assert adapters[0] and all(".lora_" in k for k in adapters[0])
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    optimizer = torch.load(last[0] / "optimizer.pt", weights_only=True)
    lora_params = sum(".lora_" in n for n, _ in straight.policy.named_parameters())
    assert len(optimizer["state"]) == lora_params  # the adapters' moments, nothing else
    # the base weights never moved, and the reference shares them
    base = build_model("tiny", build_tokenizer(), seed=0).state_dict()
    for name, tensor in straight.policy.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor, base[name.replace(".base_layer.", ".")]), name


def test_a_small_lora_step_trains_the_adapters_against_the_base(parity, tiny, tmp_path) -> None:
    cfg = load_config("grpo", [*tiny, *LORA, "model=random:small", "steps=2", "eval.every=0"])
    run = train(start_run(cfg, tmp_path / "small"))
    metrics = metrics_but_timings(run.run_dir)
    assert metrics[-1]["grad_norm"] > 0 and metrics[-1]["kl/ref"] > 0
    assert run.ref is not None and not is_lora(run.ref)
    ptrs = {p.data_ptr() for p in run.policy.parameters()}
    assert all(p.data_ptr() in ptrs for p in run.ref.parameters())  # no second copy


@pytest.fixture
def qwen_dir(tmp_path):
    """An HF-format model directory: a small Qwen2 (q/k/v biases) with the built-in tokenizer."""
    tokenizer = build_tokenizer()
    return save_policy(llama_variants(tokenizer)["qwen2"], tokenizer, tmp_path / "qwen2")


def test_an_hf_model_directory_trains_chosen_modules_and_evaluates_with_adapter(
    parity, tiny, tmp_path, qwen_dir
) -> None:
    overrides = [*tiny, *LORA, f"model={qwen_dir}", 'lora.target_modules=["q_proj","v_proj"]']
    run = train(start_run(load_config("grpo", [*overrides, "steps=2"]), tmp_path / "run"))
    adapter = list_checkpoints(run.run_dir)[-1] / "policy"
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved and {k.split(".")[-3] for k in saved} == {"q_proj", "v_proj"}
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    runner, out = CliRunner(env={"COLUMNS": "1000"}), tmp_path / "eval.json"
    common = ["--task", "arithmetic", "--k", "1", "--limit", "2", "--max-new-tokens", "4"]
    result = runner.invoke(
        app,
        ["eval", "--model", str(qwen_dir), "--adapter", str(adapter), *common, "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["prompts"] == 2
    alone = runner.invoke(app, ["eval", "--model", str(adapter), *common])
    assert alone.exit_code == 2 and "is a LoRA adapter, not a model" in alone.output
    wrong = runner.invoke(
        app, ["eval", "--model", "random:small", "--adapter", str(adapter), *common]
    )
    assert wrong.exit_code == 2 and "does not fit this base model" in wrong.output
    served = runner.invoke(app, ["serve", "--model", "random:tiny", "--adapter", str(tmp_path)])
    assert served.exit_code == 2 and "not a LoRA adapter directory" in served.output


def test_pvpo_anchors_of_a_fresh_adapter_are_the_base_models(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    """A LoRA run presamples nothing where its base model's anchors are in the store: its
    reference is the base model (adapters out), hashed as the base."""
    drawn = []
    real_call = RolloutSampler.__call__

    def recording(self, records, n, first, seed):
        drawn.append(len(records))
        return real_call(self, records, n, first, seed)

    monkeypatch.setattr(RolloutSampler, "__call__", recording)
    extra = [*tiny, "pvpo.m=2", f"pvpo.store={tmp_path / 'anchors.db'}"]
    paper = "pvpo_paper"  # the paper's presampling: the walk is sampled by start_run
    plain = start_run(load_config(paper, extra), tmp_path / "plain").components["pvpo"]
    assert drawn
    drawn.clear()
    lora = start_run(load_config(paper, [*extra, "lora.rank=4"]), tmp_path / "lora")
    assert drawn == [] and lora.components["pvpo"].anchor_key == plain.anchor_key


@pytest.mark.slow
def test_a_vapo_lora_run_trains_a_critic_of_adapters_and_resumes_exactly(
    parity, tiny, tmp_path
) -> None:
    """The critic of a LoRA run: adapters of its own on the base model's body (whose tensors
    are the policy's), value-pretrained (the second run reads the cache: a saved LoRA critic),
    checkpointed as its adapters and head only, resumed bit-identically."""
    overrides = [*tiny, *LORA, "critic.pretrain_steps=2"]
    straight = train(start_run(load_config("vapo", [*overrides, "steps=4"]), tmp_path / "a"))
    half = train(start_run(load_config("vapo", [*overrides, "steps=2"]), tmp_path / "b"))
    resumed = train(resume_run(half.run_dir, {"steps": 4}))
    metrics = metrics_but_timings(straight.run_dir)
    assert metrics == metrics_but_timings(resumed.run_dir)  # bit-identical
    (cached,) = Path(os.environ["ANCHOR_RL_CACHE"]).glob("critic/**/critic.json")
    assert (cached.parent / "backbone_adapter" / "adapter_model.safetensors").is_file()
    assert not (cached.parent / "backbone").exists()  # the adapters only, no weights
    assert all(r["critic/grad_norm"] > 0 for r in metrics[1:])
    assert metrics[-1]["grad_norm"] > 0
    critic = straight.components["critic"].critic
    assert is_lora(critic.backbone) and not is_lora(straight.ref)
    ptrs = {p.data_ptr() for p in straight.policy.parameters()}
    frozen = [p for p in critic.backbone.parameters() if not p.requires_grad]
    assert frozen and all(p.data_ptr() in ptrs for p in frozen)  # no copy of the weights
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith("head.") for n in trained)
    saved = torch.load(list_checkpoints(straight.run_dir)[-1] / "critic.pt", weights_only=True)
    assert set(saved["critic"]) == trained  # the adapters and the head, no base weights
    assert len(saved["optimizer"]["state"]) == len(trained)
    # the adapters moved (B left zero), so the critic is no longer its base's body
    assert any(bool(v.any()) for k, v in saved["critic"].items() if "lora_B" in k)


def test_a_lora_run_with_a_shared_critic_probes_the_policys_body(parity, tiny, tmp_path) -> None:
    overrides = [*tiny, *LORA, "critic.mode=shared", "steps=2"]
    run = train(start_run(load_config("ppo", overrides), tmp_path / "shared"))
    critic = run.components["critic"].critic
    assert critic.backbone is run.policy.base_model  # the LoRA policy's body, adapters in it
    assert [n for n, _ in critic.named_parameters()] == ["head.weight", "head.bias"]
    assert metrics_but_timings(run.run_dir)[-1]["critic/grad_norm"] > 0
