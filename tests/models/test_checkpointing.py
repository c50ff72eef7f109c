"""Activation checkpointing (``optim.activation_checkpointing``): the same log-probs and
gradients with it as without, in every scoring layout, on the built-in ``tiny``, on a Qwen2
model read from a Hugging Face directory, with LoRA, and for a critic; the layers really
recompute (their forward runs again in the backward pass); the trainer switches it on for
the policy and a separate critic."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import llama_variants, response_batch
from transformers import GPT2Config, GPT2LMHeadModel

from anchor_rl.errors import AnchorRLError
from anchor_rl.models import checkpointing
from anchor_rl.models.critic import Critic
from anchor_rl.models.loading import load_policy, save_policy
from anchor_rl.models.lora import LoRAConfig, apply_lora
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run

TOK = build_tokenizer()
PAD = TOK.pad_token_id
LAYOUTS = {
    "padded": {"packed": False},
    "packed": {"packed": True, "shared": False},
    "shared": {"shared": True},
}


def batch():
    """Two prompts, three responses each (the shared layout shares them), ragged lengths."""
    prompts = [[5, 6, 7]] * 3 + [[8, 9]] * 3
    responses = [[10, 11], [12], [13, 14, 15], [16, 17], [18, 19, 20, 21], [22]]
    return response_batch(prompts, responses, PAD)


def models(tmp_path) -> dict[str, torch.nn.Module]:
    """``tiny``, a Qwen2 saved and read back as a Hugging Face directory, and ``tiny`` with
    LoRA adapters (their B factors moved off zero, so the adapters count)."""
    variants = llama_variants(TOK)
    save_policy(variants["qwen2"], TOK, tmp_path / "qwen2")
    qwen2, _ = load_policy(tmp_path / "qwen2")
    lora = apply_lora(copy.deepcopy(variants["tiny"]), LoRAConfig(rank=4), seed=0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return {"tiny": variants["tiny"], "qwen2-dir": qwen2, "tiny-lora": lora}


def scores_and_gradients(model, batch, **layout):
    """``(logp, entropy, gradients)`` of ``logp.sum() + 0.1 * entropy.sum()`` in a layout (the
    gradients of the parameters that take one, in order); the gradients are cleared after."""
    logp, entropy = token_logprobs(model, batch, with_entropy=True, **layout)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), grads


def count_calls(module: torch.nn.Module) -> list[int]:
    """A one-element counter of ``module``'s forward calls (a hook stays on it)."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpointing_gives_the_same_logprobs_and_gradients_and_recomputes(tmp_path, layout):
    for name, model in models(tmp_path).items():
        model.train()
        twin = checkpointing.enable(copy.deepcopy(model)).train()
        assert checkpointing.is_enabled(twin) and not checkpointing.is_enabled(model)
        once = count_calls(model.model.layers[0].self_attn.q_proj)
        calls = count_calls(twin.model.layers[0].self_attn.q_proj)
        plain = scores_and_gradients(model, batch(), **LAYOUTS[layout])
        again = scores_and_gradients(twin, batch(), **LAYOUTS[layout])
        assert calls[0] == 2 * once[0] > 0, (name, layout)  # the forward, then its recomputation
        torch.testing.assert_close(again[0], plain[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(again[1], plain[1], rtol=0, atol=1e-6)
        assert len(again[2]) == len(plain[2])
        for g, h in zip(again[2], plain[2], strict=True):
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6, msg=f"{name} {layout}")
        if name == "tiny-lora":  # only the adapters take gradients, checkpointed or not
            grads = [n for n, p in twin.named_parameters() if p.requires_grad]
            assert grads and all(".lora_" in n for n in grads)


def test_no_recomputation_without_grad_or_in_eval_mode(tmp_path):
    model = checkpointing.enable(llama_variants(TOK)["tiny"])
    calls = count_calls(model.model.layers[0].self_attn.q_proj)
    model.eval()  # how the engine and the reference score: one pass, no checkpoint
    for layout in LAYOUTS.values():
        scores_and_gradients(model, batch(), **layout)
    assert calls[0] == 4  # one pass each (the shared layout projects prompts and tokens)


def test_a_separate_critic_checkpoints_with_the_same_gradients():
    critic = Critic.from_causal_lm(llama_variants(TOK)["tiny"], "separate")
    with torch.no_grad():
        critic.head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(critic)
    checkpointing.enable(twin.backbone)
    once = count_calls(critic.backbone.layers[0].self_attn.q_proj)
    calls = count_calls(twin.backbone.layers[0].self_attn.q_proj)
    grads = []
    for c in (critic, twin):
        c.train()
        for kind in ("shared", "padded"):
            c.shared_prefix = kind == "shared"
            c.padding_free = kind == "shared"
            c.values(batch()).square().sum().backward()
        grads.append([p.grad.clone() for p in c.parameters()])
    assert calls[0] == 2 * once[0] > 0  # each pass recomputed
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


def test_a_model_without_checkpointing_support_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    checkpointing.enable(gpt2)  # Hugging Face models that support it: every layer
    assert checkpointing.is_enabled(gpt2)
    with pytest.raises(AnchorRLError, match="does not support activation checkpointing"):
        checkpointing.enable(torch.nn.Linear(2, 2))


def test_a_run_with_activation_checkpointing_trains_as_one_without(parity, tiny, tmp_path):
    """The policy (GRPO) and a separate critic (PPO) are checkpointed in the run, and the
    metrics match a run without it."""
    for preset in ("grpo", "ppo"):
        overrides = [*tiny, "steps=2", "eval.every=0", "critic.pretrain_steps=0"]
        if preset == "grpo":
            overrides.remove("critic.pretrain_steps=0")
        runs = []
        for on in (False, True):
            cfg = load_config(preset, [*overrides, f"optim.activation_checkpointing={on}"])
            runs.append(train(start_run(cfg, tmp_path / f"{preset}-{on}")))
        assert not checkpointing.is_enabled(runs[0].policy)
        assert checkpointing.is_enabled(runs[1].policy)
        if preset == "ppo":
            critic = runs[1].components["critic"].critic
            assert critic.mode == "separate" and checkpointing.is_enabled(critic.backbone)
        off, on_ = (r.policy.state_dict() for r in runs)
        for key in off:
            torch.testing.assert_close(on_[key], off[key], rtol=1e-4, atol=1e-6)
