"""The in-process engine's memory release (``rollout.release_memory``): the bfloat16 sampling
copy's parameters are freed and filled again by the next sync or rollout, which then samples
the same tokens with the same seeds; a run with it trains as one without; other engines
refuse it."""

from __future__ import annotations

import pytest
import torch
from helpers import metrics_but_timings, requests

from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import LoRAConfig, apply_lora, sampling_state
from anchor_rl.rollout.engine import HFEngine, release_memory
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run

PROMPTS = ["1+1=", "what is 12*3?", "x"]
PARAMS = SamplingParams(max_new_tokens=16)


def held(engine: HFEngine) -> int:
    """Bytes of the engine's sampling model's parameters."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def same(a, b) -> bool:
    return torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("lora", [False, True])
def test_released_copy_is_refilled_and_samples_the_same_tokens(tokenizer, lora):
    model = build_model("tiny", tokenizer, seed=0)
    if lora:
        model = apply_lora(model, LoRAConfig(rank=4), seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    engine = HFEngine(model, tokenizer, precision="bf16")
    size = held(engine)
    first = engine.rollout(requests(PROMPTS, 3, seed=5), PARAMS)
    assert release_memory(engine) == size > 0
    assert held(engine) == 0  # every parameter's storage freed (the tied embedding once)
    assert release_memory(engine) == 0  # nothing left to free
    # a rollout without a sync takes the policy's weights again: the same tokens
    assert same(engine.rollout(requests(PROMPTS, 3, seed=5), PARAMS), first)
    assert held(engine) == size
    # released, the policy moves, the sync fills the copy with the new weights
    release_memory(engine)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    engine.sync_weights(sampling_state(model))
    fresh = HFEngine(model, tokenizer, precision="bf16")
    expected = fresh.model.state_dict()
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    moved = engine.rollout(requests(PROMPTS, 3, seed=5), PARAMS)
    assert same(moved, fresh.rollout(requests(PROMPTS, 3, seed=5), PARAMS))
    assert not same(moved, first)


def test_an_engine_sampling_the_policy_itself_frees_nothing(tokenizer):
    model = build_model("tiny", tokenizer, seed=0)
    engine = HFEngine(model, tokenizer)
    first = engine.rollout(requests(PROMPTS, 2, seed=1), PARAMS)
    assert release_memory(engine) == 0 and engine.model is model
    assert held(engine) > 0
    assert same(engine.rollout(requests(PROMPTS, 2, seed=1), PARAMS), first)
    assert release_memory(object()) == 0  # an engine without the method


def test_a_run_with_release_memory_trains_as_one_without(parity, tiny, tmp_path, monkeypatch):
    freed = []
    original = HFEngine.release_memory

    def counted(self: HFEngine) -> int:
        freed.append(original(self))
        return freed[-1]

    monkeypatch.setattr(HFEngine, "release_memory", counted)
    base = [*tiny, "steps=2", "eval.every=1", "rollout.engine_args.precision=bf16"]
    runs = [
        train(
            start_run(
                load_config("grpo", [*base, f"rollout.release_memory={on}"]), tmp_path / str(on)
            )
        )
        for on in (False, True)
    ]
    assert metrics_but_timings(runs[0].run_dir) == metrics_but_timings(runs[1].run_dir)
    assert len(freed) == 2 and freed[0] > 0  # once a step, before the update


def test_release_memory_is_refused_for_engines_in_other_processes():
    with pytest.raises(ConfigError, match="rollout.release_memory frees the in-process hf"):
        load_config("grpo", ["cluster.rollout_workers=2", "rollout.release_memory=true"])
