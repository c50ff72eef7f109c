"""Helpers shared by the test packages (importable from every one of them: tests/ is on the
path because of tests/conftest.py): a toy task a random-init model earns reward on, the
tiny-run overrides, seeded engine requests, a run's metrics without its timings (the package's
``metrics_but_timings``, imported here for the tests), and a count of the reference sampler's
calls."""

from __future__ import annotations

from pathlib import Path

from anchor_rl.anchors.presample import RolloutSampler
from anchor_rl.rollout.engine import Request, group_requests
from anchor_rl.tasks.base import Record, Task
from anchor_rl.trainer.logging import metrics_but_timings  # noqa: F401 (the tests import it here)

TINY = [
    "model=random:tiny",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "eval.prompts=3",
    "eval.every=2",
    "log.progress=false",
]
"""Overrides that make any preset a run of a second or two on a random-init model."""


class ParityTask(Task):
    """Reward 1 when the completion's first character has an even code point.

    A random-init model gets it right about half the time, so groups of a few responses
    are mixed and all-equal about equally often (what dynamic sampling filters).
    """

    name = "parity"

    def records(self, split):
        offset = 0 if split == "train" else 100
        return [Record(f"{split}-{i}", f"q{i + offset}", "even") for i in range(8)]

    def reward(self, completion, record):
        return float(bool(completion) and ord(completion[0]) % 2 == 0)

    def trace(self, record):
        return "0"


def requests(prompts: list[str], n: int = 1, seed: int = 0) -> list[Request]:
    """``n`` seeded requests per prompt (group i for prompts[i])."""
    return group_requests(prompts, list(range(len(prompts))), n, "test", seed)


def response_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """A RolloutBatch of these prompts and right-padded responses (every response token a
    policy token), each row its own group."""
    import torch

    from anchor_rl.batch import RolloutBatch

    b, t = len(prompts), max(len(r) for r in responses)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros(b, t)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    return RolloutBatch(
        group=torch.arange(b),
        prompt_ids=prompts,
        response_ids=ids,
        attention_mask=mask,
        loss_mask=mask.clone(),
        logprobs=torch.zeros(b, t),
        texts=[""] * b,
        tool_calls=torch.zeros(b, dtype=torch.long),
        truncated=torch.zeros(b, dtype=torch.bool),
        pad_id=pad_id,
    )


def llama_variants(tokenizer) -> dict:
    """Three small models with plain Llama layers: the built-in ``tiny``, a Llama with
    grouped-query attention and a Qwen2 (q/k/v biases), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from anchor_rl.models.factory import build_model

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    small |= dict(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return {
        "tiny": build_model("tiny", tokenizer, seed=0),
        "llama-gqa": LlamaForCausalLM(LlamaConfig(**small)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**small)),
    }


def scores_and_gradients(model, batch, **layout):
    """``token_logprobs`` of ``batch`` under ``model`` with entropy, in the layout of the
    keyword arguments: ``(logp, entropy, gradients)`` of ``logp.sum() + 0.1 * entropy.sum()``
    (every parameter's gradient, in order); the model's gradients are cleared after."""
    from anchor_rl.models.scoring import token_logprobs

    logp, entropy = token_logprobs(model, batch, with_entropy=True, **layout)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), grads


def load_script(name: str):
    """``scripts/NAME.py`` as a module, imported by path (scripts/ is not a package)."""
    import importlib.util

    path = Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_sampled(monkeypatch) -> list[list[str]]:
    """From now on, the prompt ids of each reference-sampler call, appended to the list."""
    calls: list[list[str]] = []
    real_call = RolloutSampler.__call__

    def counting(self, records, n, first, seed):
        calls.append([r.id for r in records])
        return real_call(self, records, n, first, seed)

    monkeypatch.setattr(RolloutSampler, "__call__", counting)
    return calls


def assert_ranks_match(one: Path, two: Path, keys: tuple[str, ...], steps: int) -> list[dict]:
    """A run on several learner ranks (``two``) logged the same rollouts as one on one rank
    (``one``) and, per step, the same ``keys`` within float rounding (rel 1e-4, abs 1e-7);
    both trained (gradient norms above 0). Returns the one-rank run's metrics rows."""
    import pytest

    a, b = metrics_but_timings(one), metrics_but_timings(two)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b, strict=True):
        assert ra["reward/mean"] == rb["reward/mean"]  # the same rollouts
        for key in keys:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    assert all(r["grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in a)
    return a
