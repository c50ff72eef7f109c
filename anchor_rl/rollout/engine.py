"""The Hugging Face rollout engine: n samples per prompt, packed into a ``RolloutBatch``.

The engine holds a reference to the live policy, so weight updates are seen by the next
``rollout`` without any sync. Sampling log-probs are taken under the distribution each
token was drawn from (``logits / temperature``, top-p renormalised; 0 for greedy), see
``anchor_rl.rollout.sampling``. Another backend (vLLM, an OpenAI-compatible server) only
needs the same ``rollout`` method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.agent import Response, run_agent
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool


def pack(
    responses: Sequence[Response],
    prompt_ids: list[list[int]],
    group: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
) -> RolloutBatch:
    """Right-pad built responses into a ``RolloutBatch`` (T = longest response, at least 1)."""
    b, t = len(responses), max(1, *(len(r.tokens) for r in responses))
    pad_id = tokenizer.pad_token_id
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention, loss, logprobs = (torch.zeros((b, t)) for _ in range(3))
    for i, r in enumerate(responses):
        n = len(r.tokens)
        ids[i, :n] = torch.as_tensor(r.tokens, dtype=torch.long)
        attention[i, :n] = 1.0
        loss[i, :n] = torch.as_tensor(r.policy, dtype=torch.float32)
        logprobs[i, :n] = torch.as_tensor(r.logprobs, dtype=torch.float32)
    return RolloutBatch(
        group=group,
        prompt_ids=prompt_ids,
        response_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        logprobs=logprobs * loss,
        texts=tokenizer.batch_decode([r.tokens for r in responses], skip_special_tokens=True),
        tool_calls=torch.as_tensor([r.tool_calls for r in responses], dtype=torch.long),
        truncated=torch.as_tensor([r.truncated for r in responses], dtype=torch.bool),
        pad_id=pad_id,
    )


class HFEngine:
    """Batched sampling with a ``transformers`` causal LM and a KV cache.

    max_batch: most responses generated together (rows beyond it run in further chunks;
    the KV cache of one chunk is the memory peak).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch: int = 256
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch

    def rollout(
        self,
        prompts: list[str],
        n: int,
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch:
        """``n`` responses per prompt; rows ``i*n .. i*n+n-1`` belong to prompt i (group i).

        With ``tools`` the agent loop runs (see ``run_agent``). ``generator`` (on the
        model's device) makes the sampling reproducible.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        encoded = [encode_prompt(self.tokenizer, p, instruction) for p in prompts]
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in encoded)
        if limit is not None and longest + params.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={params.max_new_tokens} "
                f"exceeds the model's {limit} positions"
            )
        rows = [ids for ids in encoded for _ in range(n)]
        responses: list[Response] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(rows), self.max_batch):
                    chunk = rows[start : start + self.max_batch]
                    responses += run_agent(
                        self.model, self.tokenizer, chunk, params, tools, generator
                    )
        finally:
            self.model.train(was_training)
        group = torch.arange(len(prompts)).repeat_interleave(n)
        return pack(responses, rows, group, self.tokenizer)
