"""The TRL plug-in with a PEFT policy (``peft_config=``): first-use presampling and
``reference`` refreshes presample the base model (a fresh adapter's initial policy) through
a module tree sharing the policy's base tensors, not a copy; ``policy`` refreshes sample a
merged copy of the policy. Neither runs TRL's patched forward of the policy."""

from __future__ import annotations

import peft
import pytest
import torch
from helpers import ParityTask
from test_trl_plugin import M, anchor_key, fill_store, grpo_args, record, record_steps

from anchor_rl.anchors.keys import fingerprint_model
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.integrations.trl import PVPOGRPOTrainer
from anchor_rl.integrations.trl.base import fresh_copy, initial_peft_policy
from anchor_rl.models.factory import build_model

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.tensor([[5, 9, 3, 7, 2, 11]])


def test_a_fresh_adapters_initial_policy_is_its_base_sharing_its_tensors(tokenizer, ids) -> None:
    base = build_model("tiny", tokenizer, seed=0)
    expected = _logits(base, ids)
    policy = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    reference = initial_peft_policy(policy)
    assert not hasattr(reference, "peft_config")
    shared = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() in shared for p in reference.parameters())  # no second copy
    with torch.no_grad():  # the adapters move: the reference stays the initial policy
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    torch.testing.assert_close(_logits(reference, ids), expected, rtol=0, atol=0)
    assert not torch.allclose(_logits(policy, ids), expected)
    copied = initial_peft_policy(policy)  # a trained adapter: a merged copy of the policy
    assert all(p.data_ptr() not in shared for p in copied.parameters())
    merged = dict(rtol=0, atol=1e-4)  # W + BA merged: the float sums in another order
    torch.testing.assert_close(_logits(copied, ids), _logits(policy, ids), **merged)
    torch.testing.assert_close(_logits(fresh_copy(policy), ids), _logits(policy, ids), **merged)


def test_first_use_presampling_with_a_peft_policy_samples_the_base_model(
    tmp_path, tokenizer, one_thread, ids
) -> None:
    task = ParityTask()
    base = build_model("tiny", tokenizer, seed=0)
    base_logits = _logits(base, ids)
    store = tmp_path / "anchors.db"
    trainer = PVPOGRPOTrainer(
        model=base, args=grpo_args(tmp_path, max_steps=2, learning_rate=5e-2),
        processing_class=tokenizer, task=task, pvpo={"m": M, "store": str(store)},
        group_sampling=False, progress=False, peft_config=peft.LoraConfig(**LORA),
    )  # fmt: skip
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(policy, peft.PeftModel)
    assert "forward" in vars(policy.get_base_model())  # TRL's fused LM head on the policy
    reference = trainer.anchor_set.sampler.engine.model
    assert "forward" not in vars(reference)
    batches = record(trainer)
    trainer.train()
    seen = {row["prompt_id"] for inputs, _, _ in batches for row in inputs}
    with AnchorStore(store) as s:  # under the base model's key, every prompt trained on
        stored = s.get_anchors(anchor_key(build_model("tiny", tokenizer, seed=0), tokenizer, task))
    assert seen and set(stored) == seen and all(stat.n == M for stat in stored.values())
    torch.testing.assert_close(_logits(reference, ids), base_logits, rtol=0, atol=0)
    assert fingerprint_model(reference) == fingerprint_model(build_model("tiny", tokenizer, seed=0))
    assert not torch.allclose(_logits(policy, ids), base_logits)  # the adapters trained


def test_a_policy_refresh_of_a_peft_policy_samples_its_merged_weights(
    tmp_path, tokenizer, one_thread
) -> None:
    task = ParityTask()
    model = build_model("tiny", tokenizer, seed=0)
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)  # the base's anchors
    pvpo = {"m": M, "store": str(store), "refresh_every": 2, "refresh_mode": "policy"}
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, max_steps=3, learning_rate=5e-2),
        processing_class=tokenizer, task=task, pvpo=pvpo, progress=False,
        peft_config=peft.LoraConfig(**LORA),
    )  # fmt: skip
    assert trainer.rollout_counts()["presample_now"] == 0  # a fresh adapter is its base
    steps = record_steps(trainer)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    snapshot = steps[2][1]  # the PEFT policy's fingerprint when the refresh was made
    assert trainer.last_refresh["fingerprint"] != anchor_key(model, tokenizer, task).model
    assert trainer.last_refresh["step"] == 2 and snapshot != steps[0][1]
    assert trainer.rollout_counts()["refresh_now"] > 0
    assert isinstance(policy, peft.PeftModel)
