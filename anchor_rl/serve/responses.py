"""The OpenAI-compatible answers of ``anchor-rl serve``: the ``text_completion`` and
``chat.completion`` bodies of a validated request (:class:`~anchor_rl.serve.protocol.Parsed`)
and the turns sampled for it."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from anchor_rl.rollout.sampling import EOS, Turn
from anchor_rl.serve.model import ModelServer
from anchor_rl.serve.protocol import Parsed


def _text(tok: PreTrainedTokenizerBase, turn: Turn, parsed: Parsed) -> str:
    """The choice's text: the stop string cut off unless ``include_stop_str_in_output``."""
    ids = turn.tokens
    if not parsed.include_stop and turn.stop is not None and ids:
        if turn.stop == EOS or tok.decode([ids[-1]]) == turn.stop:
            ids = ids[:-1]
        else:
            return _cut_at_stop(tok, ids, turn.stop, parsed.skip_special)
    return tok.decode(ids, skip_special_tokens=parsed.skip_special)


def _cut_at_stop(tok: PreTrainedTokenizerBase, ids: list[int], stop: str, skip: bool) -> str:
    """The text of ``ids`` before the string ``stop`` its last token completed.

    The sampler matched the stop on text decoded with special tokens kept, where its first
    occurrence is the one that stopped it (it checks after every token). With ``skip``
    (special tokens dropped), the text on both sides of a special token joins up and may
    spell the stop earlier, so the cut is measured from the end: the kept text from the
    stop on, which holds no special token, ends the skipped text too."""
    kept = tok.decode(ids)
    full = tok.decode(ids, skip_special_tokens=True) if skip else kept
    at = kept.find(stop)
    if at < 0:  # not found (decoding is not always the sampler's): cut nothing
        return full
    tail = kept[at:]
    if full.endswith(tail):
        return full[: len(full) - len(tail)]
    last = full.rfind(stop)
    return full[:last] if last >= 0 else full


def _tokens(tok: PreTrainedTokenizerBase, ids: list[int], parsed: Parsed) -> list[str]:
    return [f"token_id:{i}" for i in ids] if parsed.token_ids else [tok.decode([i]) for i in ids]


def _choice_common(turn: Turn, seed: int) -> dict[str, Any]:
    stop = turn.stop if turn.stop not in (None, EOS) else None
    return {
        "finish_reason": "length" if turn.stop is None else "stop",
        "stop_reason": stop,
        "token_ids": list(turn.tokens),
        "seed": seed,
    }


def _finite(value: float) -> float | None:
    """A log-prob as JSON has it: NaN and infinities (weights gone bad) become null, since
    JSON has no such numbers and the encoder would fail the whole answer with a 500."""
    return value if math.isfinite(value) else None


def _usage(parsed: Parsed, turns: list[Turn]) -> dict[str, int]:
    prompt = sum(len(p) for p in parsed.prompts)
    completion = sum(len(t.tokens) for t in turns)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    server: ModelServer, parsed: Parsed, turns: list[Turn], revision: str | None = None
) -> dict[str, Any]:
    """The ``text_completion`` answer: one choice per row, in ``i * n + j`` order;
    ``revision``: the weights that sampled it (default: the server's current ones)."""
    tok = server.tokenizer
    choices = []
    for index, (turn, seed) in enumerate(zip(turns, parsed.seeds, strict=True)):
        text = _text(tok, turn, parsed)
        logprobs = None
        if parsed.logprobs:
            logprobs = {
                "tokens": _tokens(tok, turn.tokens, parsed),
                "token_logprobs": [_finite(lp) for lp in turn.logprobs],
                "top_logprobs": None,
                "text_offset": text_offsets(tok, turn.tokens, parsed.skip_special, len(text)),
            }
        choices.append(
            {"index": index, "text": text, "logprobs": logprobs, **_choice_common(turn, seed)}
        )
    return _envelope(server, parsed, turns, "cmpl", "text_completion", choices, revision)


OFFSET_WINDOW = 6
"""Tokens of context :func:`text_offsets` decodes each token with: a character split over
several byte tokens (up to four in UTF-8) or a word-start space that depends on the token
before comes out right, as in an incremental detokenizer."""


def text_offsets(
    tok: PreTrainedTokenizerBase, ids: list[int], skip_special: bool, length: int
) -> list[int]:
    """The character offset in the choice's text at which each token's text starts.

    Each token adds what decoding it after the :data:`OFFSET_WINDOW` tokens before it adds
    (the difference of two decodes of the same window), so a token's text is not taken out
    of context (``decode([id])`` alone mangles byte-level and word-piece tokens), in time
    linear in the tokens. The offsets never decrease (the bytes of one character may first
    decode to more replacement characters than the character they complete) and stop at the
    text's length (tokens after a stop string cut from it)."""
    offsets, at = [], 0
    for k in range(len(ids)):
        offsets.append(min(max(at, offsets[-1] if offsets else 0), length))
        window = ids[max(0, k - OFFSET_WINDOW) : k + 1]
        before = tok.decode(window[:-1], skip_special_tokens=skip_special)
        at += len(tok.decode(window, skip_special_tokens=skip_special)) - len(before)
    return offsets


def chat_body(
    server: ModelServer, parsed: Parsed, turns: list[Turn], revision: str | None = None
) -> dict[str, Any]:
    """The ``chat.completion`` answer: one assistant message per choice (``revision`` as
    for :func:`completion_body`)."""
    tok = server.tokenizer
    choices = []
    for index, (turn, seed) in enumerate(zip(turns, parsed.seeds, strict=True)):
        logprobs = None
        if parsed.logprobs:
            logprobs = {
                "content": [
                    {
                        "token": t,
                        "logprob": _finite(lp),
                        "bytes": list(t.encode()),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(_tokens(tok, turn.tokens, parsed), turn.logprobs, strict=True)
                ]
            }
        message = {"role": "assistant", "content": _text(tok, turn, parsed)}
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, **_choice_common(turn, seed)}
        )
    return _envelope(server, parsed, turns, "chatcmpl", "chat.completion", choices, revision)


def _envelope(
    server: ModelServer,
    parsed: Parsed,
    turns: list[Turn],
    prefix: str,
    kind: str,
    choices: list[dict[str, Any]],
    revision: str | None,
) -> dict[str, Any]:
    """What every OpenAI answer wraps its choices in: id, object, time, model, usage, and
    as ``system_fingerprint`` the revision of the weights that sampled it."""
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": parsed.adapter or server.name,
        "system_fingerprint": revision or server.revision,
        "choices": choices,
        "usage": _usage(parsed, turns),
    }
