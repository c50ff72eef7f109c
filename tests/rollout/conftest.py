"""Fixtures for the rollout tests: a scripted fake LM (tokenizer and tiny model: tests/conftest.py).

``ScriptedLM`` speaks the slice of the Hugging Face causal-LM interface the engine uses
(``logits_to_keep``, a cache with ``batch_select_indices``). For each row it writes a
fixed policy text chosen by the prompt, one token at a time, skipping over tool-result
blocks the environment inserted; after the script it writes eos. Every other token gets
a logit 100 below, so sampling at temperature 1 follows the script with log-prob ~0.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from anchor_rl.models.tokenizer import ASSISTANT


class ListCache:
    """Per-row token history standing in for a KV cache."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in indices.tolist()]


class ScriptedLM(torch.nn.Module):
    def __init__(self, tokenizer, script: Callable[[str], str]):
        super().__init__()
        self.tokenizer, self.script = tokenizer, script
        self.config = SimpleNamespace(max_position_embeddings=1024)
        self.generation_config = None
        self.result_open = tokenizer.convert_tokens_to_ids("<result>")
        self.result_close = tokenizer.convert_tokens_to_ids("</result>")
        self.assistant = tokenizer.convert_tokens_to_ids(ASSISTANT)
        self.forward_rows: list[int] = []  # batch size of every forward call
        self.prefill_rows: list[int] = []  # batch size of every call without a cache (a turn start)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def next_token(self, row: list[int]) -> int:
        start = len(row) - row[::-1].index(self.assistant)
        prompt = self.tokenizer.decode(row[: start - 1], skip_special_tokens=True)
        policy, in_result = [], False
        for tok in row[start:]:
            if tok == self.result_open:
                in_result = True
            elif tok == self.result_close:
                in_result = False
            elif not in_result:
                policy.append(tok)
        target = self.tokenizer.encode(self.script(prompt), add_special_tokens=False)
        return target[len(policy)] if len(policy) < len(target) else self.tokenizer.eos_token_id

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids=None,
        past_key_values=None,
        use_cache=True,
        logits_to_keep=0,
    ):
        self.forward_rows.append(input_ids.shape[0])
        if past_key_values is None:
            self.prefill_rows.append(input_ids.shape[0])
        new = attention_mask[:, -input_ids.shape[1] :]
        cache = (
            past_key_values if past_key_values is not None else ListCache([[] for _ in input_ids])
        )
        for row, ids, ms in zip(cache.rows, input_ids.tolist(), new.tolist(), strict=True):
            row.extend(
                t for t, m in zip(ids, ms, strict=True) if m
            )  # updated in place, like a KV cache
        logits = torch.full((len(cache.rows), 1, len(self.tokenizer)), -100.0)
        for i, row in enumerate(cache.rows):
            logits[i, 0, self.next_token(row)] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=cache)


@pytest.fixture
def scripted(tokenizer):
    """``scripted({prompt: policy_text})`` -> a ScriptedLM following that table."""

    def make(table: dict[str, str]) -> ScriptedLM:
        return ScriptedLM(tokenizer, lambda prompt: table[prompt])

    return make
