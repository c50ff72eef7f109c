"""The OpenAI-compatible request bodies of ``anchor-rl serve``: their validation, and the
*job* a request becomes (one row per choice: its context token ids, token budget, seed and
counter). Refusals are :class:`BadRequest`, answered as OpenAI-style errors by
:mod:`anchor_rl.serve.app`; the answers' bodies are in :mod:`anchor_rl.serve.responses`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import secrets
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from anchor_rl.rollout.engine import request_seed
from anchor_rl.rollout.sampling import Turn

MAX_CHOICES = 4096
"""Most choices (prompts x n) one request may ask for."""

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing logits by a
temperature near 0 overflows them."""

UNSUPPORTED = {
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, -1, 0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "tools": (None, []),
    "stop_token_ids": (None, []),
    "ignore_eos": (None, False),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "structured_outputs": (None,),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "documents": (None, []),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
}
"""Request fields (OpenAI's and vLLM's) the sampler cannot honour, with the values that mean
"off" (anything else is refused: silently ignoring them would sample another distribution,
from another prompt, or report other than asked)."""


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class Served(Protocol):
    """What validating a request reads of the served model
    (:class:`~anchor_rl.serve.model.ModelServer` has it): its name, tokenizer, context limit
    (None: unknown), the token ids a prompt may hold and the names of the LoRA adapters
    loaded into it (``name in adapters``)."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    limit: int | None
    vocab: int
    adapters: Container[str]


@dataclass(eq=False)
class Job:
    """The rows of one request: one per choice, sampled together with the same settings.

    contexts: token ids each row continues; budgets: the most tokens each may generate;
    seeds, counters: row r's t-th token is drawn with ``uniforms(seeds[r], counters[r] + t)``.
    adapter: the loaded LoRA adapter the rows sample with (None: the served model alone).
    """

    contexts: list[list[int]]
    budgets: list[int]
    seeds: list[int]
    counters: list[int]
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    future: asyncio.Future[list[Turn]] | None = None
    cancelled: bool = False
    adapter: str | None = None
    revision: str | None = None
    """The weights' revision that sampled the rows (set by
    :meth:`~anchor_rl.serve.model.ModelServer.generate`): what the answer reports, even if a
    reload lands before it is written."""

    @property
    def key(self) -> tuple[float, float, tuple[str, ...], str | None]:
        """Jobs with equal keys may share a sampler call (the stops in order: where two
        match at once, the first listed wins; the same adapter, or none)."""
        return (self.temperature, self.top_p, self.stop, self.adapter)

    def __len__(self) -> int:
        return len(self.contexts)


def _typed(body: dict[str, Any], name: str, default: Any, kind: Any, what: str) -> Any:
    """``body[name]`` if it is a ``kind`` (a bool only where ``kind`` is bool), ``default``
    when absent or null; BadRequest saying it must be ``what`` otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise BadRequest(f"`{name}` must be {what}, got {value!r}", name)
    return value


def _int(
    body: dict[str, Any], name: str, default: int | None, low: int | None = None
) -> int | None:
    value = _typed(body, name, default, int, "an integer")
    if low is not None and value is not None and value < low:
        raise BadRequest(f"`{name}` must be >= {low}, got {value}", name)
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    return float(_typed(body, name, default, int | float, "a number"))


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    return _typed(body, name, default, bool, "true or false")


def _ids(value: list[Any], vocab: int, name: str) -> list[int]:
    if not value:
        raise BadRequest(f"`{name}` holds an empty prompt", name)
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise BadRequest(f"`{name}` token ids must be integers, got {i!r}", name)
        if not 0 <= i < vocab:
            raise BadRequest(f"`{name}` has token id {i}, outside the vocabulary of {vocab}", name)
    return list(value)


def _prompts(
    value: Any, tokenizer: PreTrainedTokenizerBase, add_special: bool, vocab: int
) -> list[list[int]]:
    """A completions ``prompt``: a string, a list of strings, a list of token ids or a list of
    lists of token ids (each below ``vocab``, the model's :func:`id_count`)."""

    def text(s: str) -> list[int]:
        if not s:
            raise BadRequest("`prompt` holds an empty prompt", "prompt")
        return tokenizer.encode(s, add_special_tokens=add_special)

    if isinstance(value, str):
        return [text(value)]
    if not isinstance(value, list) or not value:
        raise BadRequest(
            "`prompt` must be a string, a list of strings, a list of token ids or a list of lists "
            f"of token ids, got {type(value).__name__ if value != [] else 'an empty list'}",
            "prompt",
        )
    if all(isinstance(p, str) for p in value):
        return [text(p) for p in value]
    if all(isinstance(p, list) for p in value):
        return [_ids(p, vocab, "prompt") for p in value]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        return [_ids(value, vocab, "prompt")]
    raise BadRequest("`prompt` mixes strings, token ids and lists", "prompt")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest(f"`stop` must be a string or a list of strings, got {value!r}", "stop")
    if any(not s for s in value):
        raise BadRequest("`stop` holds an empty string", "stop")
    return tuple(dict.fromkeys(value))


def _per_choice(
    body: dict[str, Any], name: str, choices: int, low: int, high: int | None = None
) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value] * choices
    if not isinstance(value, list) or len(value) != choices:
        raise BadRequest(
            f"`{name}` must be a list of {choices} integers (one per choice: prompts x n), got "
            f"{len(value) if isinstance(value, list) else repr(value)}",
            name,
        )
    for v in value:
        if (
            isinstance(v, bool)
            or not isinstance(v, int)
            or v < low
            or (high is not None and v >= high)
        ):
            bound = f"in [{low}, {high})" if high is not None else f">= {low}"
            raise BadRequest(f"`{name}` values must be integers {bound}, got {v!r}", name)
    return value


@dataclass
class Parsed:
    """A validated request: its prompts' token ids and how to sample and report them.

    budgets: per prompt; seeds, counters: per choice (choice ``i * n + j`` is sample j of
    prompt i).
    """

    prompts: list[list[int]]
    n: int
    budgets: list[int]
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seeds: list[int]
    counters: list[int]
    logprobs: bool
    token_ids: bool = False
    include_stop: bool = False
    skip_special: bool = True
    adapter: str | None = None
    """The LoRA adapter named by the request's ``model`` (None: the served model)."""

    def job(self) -> Job:
        """The rows to sample, one per choice."""
        return Job(
            contexts=[p for p in self.prompts for _ in range(self.n)],
            budgets=[b for b in self.budgets for _ in range(self.n)],
            seeds=self.seeds,
            counters=self.counters,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            adapter=self.adapter,
        )


def _common(
    body: dict[str, Any],
    server: Served,
    prompts: list[list[int]],
    max_tokens: int | list[int] | None,
    field: str = "prompt",
) -> Parsed:
    """The sampling fields shared by both endpoints; ``max_tokens`` None: up to the context
    limit; ``field``: the request field the prompts came from (named by a refusal)."""
    model = body.get("model")
    adapter = model if isinstance(model, str) and model in server.adapters else None
    if model is not None and model != server.name and adapter is None:
        raise BadRequest(
            f"the model {model!r} is not served here; this server serves {server.name!r} "
            "and the LoRA adapters GET /v1/models lists",
            "model",
            404,
            "NotFoundError",
        )
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise BadRequest(f"`{name}` is not supported by this server (got {body[name]!r})", name)
    n = _int(body, "n", 1, low=1)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise BadRequest("`best_of` is not supported (only best_of = n)", "best_of")
    choices = len(prompts) * n
    if choices > MAX_CHOICES:
        raise BadRequest(f"{choices} choices (prompts x n) is more than {MAX_CHOICES}", "n")
    temperature = _float(body, "temperature", 1.0)
    if not temperature >= 0 or math.isinf(temperature):
        raise BadRequest(
            f"`temperature` must be a finite number >= 0, got {temperature}", "temperature"
        )
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy: logits / 1e-39 overflow to NaN
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"`top_p` must be in (0, 1], got {top_p}", "top_p")
    limit = server.limit
    for p in prompts:  # before the budgets: with no max_tokens, theirs would be <= 0
        if limit is not None and len(p) >= limit:
            raise BadRequest(
                f"the prompt's {len(p)} tokens leave no room in the model's {limit} positions: "
                f"shorten `{field}`",
                field,
            )
    if max_tokens is None:
        budgets = [(limit - len(p)) if limit else 16 for p in prompts]
    elif isinstance(max_tokens, list):
        budgets = max_tokens
    else:
        budgets = [max_tokens] * len(prompts)
    for p, b in zip(prompts, budgets, strict=True):
        if b < 1:
            raise BadRequest(f"`max_tokens` must be >= 1, got {b}", "max_tokens")
        if limit is not None and len(p) + b > limit:
            raise BadRequest(
                f"a prompt of {len(p)} tokens plus max_tokens={b} exceeds the model's {limit} "
                "positions",
                "max_tokens",
            )
    if isinstance(body.get("seeds"), int) and choices > 1:
        raise BadRequest(
            f"`seeds` must be a list of {choices} integers, one per choice (prompts x n): one "
            "integer would give every choice the same draws; use `seed` for one per request",
            "seeds",
        )
    seeds = _per_choice(body, "seeds", choices, 0, 2**64)
    if seeds is None:
        seed = _int(body, "seed", None)
        if seed is None:
            seeds = [secrets.randbits(63) for _ in range(choices)]
        else:
            seeds = [request_seed(seed, c) for c in range(choices)]
    counters = _per_choice(body, "counters", choices, 0, 2**64) or [0] * choices
    return Parsed(
        prompts=prompts,
        n=n,
        budgets=budgets,
        temperature=temperature,
        top_p=top_p,
        stop=_stops(body.get("stop")),
        seeds=seeds,
        counters=counters,
        logprobs=False,
        token_ids=_bool(body, "return_tokens_as_token_ids", False),
        include_stop=_bool(body, "include_stop_str_in_output", False),
        skip_special=_bool(body, "skip_special_tokens", True),
        adapter=adapter,
    )


def parse_completion(body: Any, server: Served) -> Parsed:
    """Validate a ``POST /v1/completions`` body; BadRequest naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in body:
        raise BadRequest("`prompt` is required", "prompt")
    add_special = _bool(body, "add_special_tokens", True)
    prompts = _prompts(body["prompt"], server.tokenizer, add_special, server.vocab)
    value = body.get("max_tokens")
    if isinstance(value, list):
        if len(value) != len(prompts) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise BadRequest(
                f"`max_tokens` must be an integer or a list of {len(prompts)} integers (one per prompt)",
                "max_tokens",
            )
        max_tokens: int | list[int] | None = value
    else:
        max_tokens = _int(body, "max_tokens", 16)
    parsed = _common(body, server, prompts, max_tokens)
    logprobs = _int(body, "logprobs", None, low=0)
    parsed.logprobs = logprobs is not None
    return parsed


def parse_chat(body: Any, server: Served) -> Parsed:
    """Validate a ``POST /v1/chat/completions`` body. The served tokenizer's chat template
    renders the messages, as vLLM does: with the generation prompt unless
    ``add_generation_prompt`` is false, the last message left open with
    ``continue_final_message``, ``chat_template_kwargs`` as template variables, and no
    special tokens added unless ``add_special_tokens``. A template that refuses the messages
    (``raise_exception``, or transformers' ValueError) is a BadRequest naming ``messages``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "`messages` must be a non-empty list of {role, content} objects", "messages"
        )
    rendered = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"each message needs a string `role`, got {m!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest("only text message parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"message content must be a string, got {content!r}", "messages")
        rendered.append({"role": m["role"], "content": content})
    tok = server.tokenizer
    if body.get("chat_template") is not None:
        raise BadRequest(
            "`chat_template` is not supported: the served tokenizer's template renders the "
            "messages; leave the field out",
            "chat_template",
        )
    if not tok.chat_template:
        raise BadRequest(
            "the served tokenizer has no chat template: use /v1/completions", "messages"
        )
    cont = _bool(body, "continue_final_message", False)
    if cont and body.get("add_generation_prompt") is True:
        raise BadRequest(
            "`continue_final_message` and `add_generation_prompt` cannot both be true: set "
            "add_generation_prompt to false to continue the last message",
            "continue_final_message",
        )
    generation_prompt = _bool(body, "add_generation_prompt", not cont)
    variables = body.get("chat_template_kwargs")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict):
        raise BadRequest(
            f"`chat_template_kwargs` must be an object of template variables, got {variables!r}",
            "chat_template_kwargs",
        )
    reserved = sorted(set(variables) & set(inspect.signature(tok.apply_chat_template).parameters))
    if reserved:
        raise BadRequest(
            f"`chat_template_kwargs` may not set {reserved}: they are arguments of "
            "apply_chat_template, not template variables (add_generation_prompt and "
            "continue_final_message are request fields)",
            "chat_template_kwargs",
        )
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        text = tok.apply_chat_template(
            rendered,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            continue_final_message=cont,
            **variables,
        )
    except (TemplateError, ValueError, TypeError) as exc:  # raise_exception(...) and kin
        raise BadRequest(f"the chat template cannot render `messages`: {exc}", "messages") from exc
    prompt = tok.encode(text, add_special_tokens=_bool(body, "add_special_tokens", False))
    if not prompt:
        raise BadRequest("the chat template rendered `messages` as an empty prompt", "messages")
    max_tokens = _int(body, "max_completion_tokens", None, low=1)
    max_tokens = _int(body, "max_tokens", max_tokens, low=1)
    parsed = _common(body, server, [prompt], max_tokens, "messages")
    parsed.logprobs = _bool(body, "logprobs", False)
    return parsed
