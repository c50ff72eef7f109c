"""LoRA policies (anchor_rl.models.lora): the config section, the shared-weight reference, merged
weights, adapter files, fingerprints, and the in-process and http engines sampling with the
adapters after an update."""

from __future__ import annotations

import json

import pytest
import torch

from anchor_rl.anchors.keys import fingerprint_model
from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import (
    MergedState,
    inert_lora_base,
    is_lora,
    load_adapter,
    lora_base,
    merge_adapter,
    merged_copy,
    sampling_state,
    save_adapter,
    trainable_parameters,
)
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.lora_check import lora_policy, sampled_gaps, update_adapters
from anchor_rl.trainer.config import load_config

IDS = torch.tensor([[5, 17, 30, 44, 9, 60, 71, 3], [8, 8, 21, 90, 33, 2, 14, 50]])


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def moved(tokenizer):
    """A tiny LoRA policy whose B factors moved (the adapters change its outputs)."""
    policy = lora_policy(build_model("tiny", tokenizer, seed=0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(3)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def test_the_section_is_validated_with_messages_naming_the_fix(tmp_path) -> None:
    assert not load_config("grpo").lora.enabled  # absent: full fine-tuning
    assert load_config("grpo", ["lora.rank=8"]).lora.enabled
    cases = {
        ("lora.alpha=32",): "has no effect with lora.rank=0",
        ("lora.rank=-1",): "lora.rank",
        ("lora.rank=8", "lora.dropout=0.1"): "disable_dropout=true switches every dropout off",
        ("lora.config_file=nowhere.json",): "cannot read a PEFT config",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config("grpo", list(overrides))
    assert load_config("grpo", ["lora.rank=8", "lora.dropout=0.1", "disable_dropout=false"])
    assert load_config(
        "grpo", ["lora.rank=8", "cluster.learners=2", "cluster.learner_sharding=fsdp"]
    )
    biased = tmp_path / "biased.json"
    biased.write_text(json.dumps({"peft_type": "LORA", "r": 4, "bias": "all"}))
    with pytest.raises(ConfigError, match="bias='none'"):
        load_config("grpo", [f"lora.config_file={biased}"])
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(ConfigError, match="the file sets the adapters"):
        load_config("grpo", [f"lora.config_file={good}", "lora.rank=4"])
    assert load_config("grpo", [f"lora.config_file={good}"]).lora.enabled


def test_a_fresh_lora_is_its_base_model_and_trains_only_its_adapters(tokenizer) -> None:
    base = build_model("tiny", tokenizer, seed=0)
    policy = lora_policy(build_model("tiny", tokenizer, seed=0))
    assert is_lora(policy) and not is_lora(base)
    assert torch.equal(logits(policy), logits(base))  # B = 0
    trainable = trainable_parameters(policy)
    assert trainable and all(p.requires_grad for p in trainable)
    names = {id(p): n for n, p in policy.named_parameters()}
    assert all(".lora_" in names[id(p)] for p in trainable)
    # the PVPO anchors of a fresh adapter are the base model's: one rule for both forms
    assert fingerprint_model(policy) == fingerprint_model(base)
    assert inert_lora_base(policy) is not None


def test_the_reference_is_the_base_model_sharing_the_policys_tensors(moved, tokenizer) -> None:
    base = build_model("tiny", tokenizer, seed=0)
    reference = lora_base(moved)
    assert not is_lora(reference) and is_lora(moved)
    assert torch.equal(logits(reference), logits(base))  # the adapters are out
    assert not torch.allclose(logits(moved), logits(base), atol=1e-3)  # they moved the policy
    assert fingerprint_model(reference) == fingerprint_model(base)
    assert fingerprint_model(moved) != fingerprint_model(base)
    ptrs = {p.data_ptr() for p in moved.parameters()}
    assert all(p.data_ptr() in ptrs for p in reference.parameters())  # no second copy
    assert not any(p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in trainable_parameters(moved))  # the policy still trains


def test_merged_weights_sample_as_the_adapters_do(moved, tokenizer) -> None:
    state = sampling_state(moved)
    assert isinstance(state, MergedState) and state.source is moved
    plain = build_model("tiny", tokenizer, seed=5)
    plain.load_state_dict(dict(state))  # the plain model's names, every one
    assert torch.allclose(logits(plain), logits(moved), atol=1e-5)
    assert torch.allclose(logits(merged_copy(moved)), logits(moved), atol=1e-5)
    assert is_lora(moved)  # the copy merged, not the policy
    assert sampling_state(plain).keys() == plain.state_dict().keys()


def test_the_adapter_saves_alone_and_loads_exactly(moved, tokenizer, tmp_path) -> None:
    save_adapter(moved, tokenizer, tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)
    loaded = load_adapter(build_model("tiny", tokenizer, seed=0), tmp_path / "adapter")
    assert torch.equal(logits(loaded), logits(moved))
    assert all(".lora_" in n for n, p in loaded.named_parameters() if p.requires_grad)
    merged = merge_adapter(
        load_adapter(build_model("tiny", tokenizer, seed=0), tmp_path / "adapter")
    )
    assert not is_lora(merged) and torch.allclose(logits(merged), logits(moved), atol=1e-5)
    with pytest.raises(AnchorRLError, match="does not fit this base model"):
        load_adapter(build_model("small", tokenizer, seed=0), tmp_path / "adapter")
    with pytest.raises(AnchorRLError, match="not a LoRA adapter directory"):
        load_adapter(build_model("tiny", tokenizer, seed=0), tmp_path)


@pytest.mark.parametrize("precision", ["model", "bf16"])
def test_the_in_process_engine_samples_the_updated_adapters(tokenizer, precision) -> None:
    """The failure TRL users met: a LoRA policy whose sampler keeps the base weights. After an
    update and the loop's sync, the engine's log-probs are the policy's, not the base's."""
    policy = lora_policy(build_model("tiny", tokenizer, seed=0))
    engine = make_engine("hf", policy, tokenizer, precision=precision)
    update_adapters(engine, policy)
    engine.sync_weights(sampling_state(policy))  # what the loop does after an update
    to_policy, to_base = sampled_gaps(engine, policy)
    tolerance = 1e-4 if precision == "model" else 0.1  # bf16 weights: rounding
    assert to_policy < tolerance and to_base > 3 * tolerance, (to_policy, to_base)


def test_the_http_engine_samples_the_updated_adapters_merged(tokenizer) -> None:
    """Through `anchor-rl serve`: the http engine sends the merged weights."""
    import anchor_rl.rollout.http  # noqa: F401  (registers the http engine)
    from anchor_rl.serve.app import ServerThread, build_app
    from anchor_rl.serve.model import ModelServer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server = ModelServer(build_model("tiny", tokenizer, seed=9), tokenizer, "tiny")
        policy = lora_policy(build_model("tiny", tokenizer, seed=0))
        with ServerThread(build_app(server)) as thread:
            engine = make_engine("http", policy, tokenizer, url=thread.url, lora_sync="merged")
            update_adapters(make_engine("hf", policy, tokenizer), policy)
            engine.sync_weights(sampling_state(policy))
            to_policy, to_base = sampled_gaps(engine, policy)
            engine.close()
    finally:
        torch.set_num_threads(before)
    assert to_policy < 1e-4 and to_base > 1e-2, (to_policy, to_base)


def test_no_grad_passes_do_not_pack_the_base_layers_lora_runs_itself(tokenizer) -> None:
    """Packing copies a weight for oneDNN; a LoRA layer's base layer runs inside the LoRA
    layer's forward, so a pack of it would be a copy nothing reads."""
    from anchor_rl.models.packed import HAS_ONEDNN, PackedLinears, linears_for

    plain = build_model("small", tokenizer, seed=0)
    policy = lora_policy(build_model("small", tokenizer, seed=0))
    with torch.no_grad():
        packs_plain, packs_lora = linears_for(plain.model, 16), linears_for(policy.model, 16)
    if HAS_ONEDNN:
        assert isinstance(packs_plain, PackedLinears) and len(packs_plain) > 0
    packed = packs_lora.packed if isinstance(packs_lora, PackedLinears) else {}
    bases = {m.base_layer for m in policy.modules() if hasattr(m, "lora_A")}
    assert not bases & set(packed)


def test_lora_without_peft_installed_names_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'anchor-rl\[lora\]'"):
        load_config("grpo", ["lora.rank=8"])
    assert not load_config("grpo").lora.enabled  # full fine-tuning needs no peft
