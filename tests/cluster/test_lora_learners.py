"""LoRA runs on data-parallel learners (cluster.learners = 2, gloo): every rank injects the same
adapters (a lora.config_file's included) and loads rank 0's, DDP sums the adapters' gradients,
and a PPO run (a critic of adapters too) matches one learner's."""

from __future__ import annotations

import json

import pytest
from helpers import assert_ranks_match

from anchor_rl.models.lora import is_lora
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run

KEYS = ("loss/policy", "loss/total", "grad_norm", "policy/ratio_mean", "critic/loss",
        "critic/grad_norm", "critic/value_mean")  # fmt: skip


@pytest.mark.slow
def test_a_lora_ppo_run_on_two_learners_matches_one(parity, tiny, tmp_path, one_thread) -> None:
    """PPO: the policy's adapters and the critic's (on the base model's body) on both ranks,
    their adapters from a PEFT config file, which the rank reads as rank 0 read it."""
    peft = tmp_path / "peft.json"
    peft.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                "target_modules": ["q_proj", "v_proj", "down_proj"]}))  # fmt: skip
    # padded layout, as the learner tests: packing each rank's shard changes the rounding
    base = [*tiny, "steps=3", "eval.every=0", "optim.lr=1e-2", "optim.mini_batches=2",
            "cluster.threads_per_learner=1", "optim.padding_free=off",
            f"lora.config_file={peft}"]  # fmt: skip
    one = train(start_run(load_config("ppo", base), tmp_path / "one"))
    two = start_run(load_config("ppo", [*base, "cluster.learners=2"]), tmp_path / "two")
    peft.write_text("{}")  # the ranks start on the first update: they read rank 0's copy
    train(two)
    assert is_lora(two.policy) and is_lora(two.components["critic"].critic.backbone)
    assert_ranks_match(one.run_dir, two.run_dir, KEYS, steps=3)
