"""The ``anchor_rl`` rollout backend for verl (anchor_rl.integrations.verl.backend) on the CPU.

The server on its own (token ids and log-probs checked against a forward pass of the same
model, one seeded stream per request id, the refusal while asleep, a weight update) and the
registrations verl resolves the backend by. The replica's server actor under verl's own
``sleep`` / ``wake_up`` and the actor worker's weight sync through ``ServerAdapter`` run in
the worker slice (test_verl_worker.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class

from anchor_rl.integrations.verl.backend import (
    AnchorRLReplica,
    AnchorRLServer,
    RolloutAsleepError,
    ServerAdapter,
)
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
SAMPLE = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return build_tokenizer()("What is 2 + 3?", add_special_tokens=False)["input_ids"]


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens)]`` log-probs of ``tokens`` after ``prompt`` under ``model`` (temperature 1)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_verl_resolves_the_backend_by_name():
    assert get_rollout_replica_class("anchor_rl") is AnchorRLReplica
    assert get_rollout_class("anchor_rl", "async") is ServerAdapter


def test_the_server_generates_token_ids_with_their_log_probs(model_dir, prompt):
    server = AnchorRLServer({"prompt_length": 32, "response_length": 6, "seed": 0},
                            {"local_path": str(model_dir)})  # fmt: skip
    reference = build_model("tiny", build_tokenizer(), seed=0).eval()
    other = build_model("tiny", build_tokenizer(), seed=1).eval()

    async def scenario() -> None:
        out = await server.generate(prompt, SAMPLE, "request-a")
        assert len(out.token_ids) == 6 and out.stop_reason == "completed"  # response_length
        expected = logprobs_of(reference, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-5, rtol=0)
        assert out.extra_fields["global_steps"] is None  # no step's weights synced yet
        again = await server.generate(prompt, SAMPLE, "request-a")
        assert again.token_ids == out.token_ids  # a request id is one seeded stream
        await server.set_global_steps(3)
        assert (await server.generate(prompt, SAMPLE, "x")).extra_fields["global_steps"] == 3
        short = await server.generate(prompt, {**GREEDY, "max_tokens": 2}, "request-b")
        assert len(short.token_ids) == 2
        with pytest.raises(ValueError, match="top_k"):
            await server.generate(prompt, {**SAMPLE, "top_k": 5}, "request-c")
        # verl puts the server to sleep while it replaces the weights: no generation then
        await server.sleep()
        with pytest.raises(RolloutAsleepError, match="asleep"):
            await server.generate(prompt, SAMPLE, "request-d")
        await server.update_weights(dict(other.state_dict()), global_steps=7)
        await server.wake_up(["weights"])  # weights back, cache not yet: still asleep
        with pytest.raises(RolloutAsleepError):
            await server.generate(prompt, SAMPLE, "request-d")
        await server.wake_up(["kv_cache"])
        new = await server.generate(prompt, SAMPLE, "request-a")
        expected = logprobs_of(other, prompt, new.token_ids)
        torch.testing.assert_close(torch.tensor(new.log_probs), expected, atol=1e-5, rtol=0)
        assert new.extra_fields["global_steps"] == 7  # the step of the weights it sampled with

    asyncio.run(scenario())
    assert server.generated == 5  # refused calls generate nothing
