"""The OpenAI-compatible server behind ``anchor-rl serve`` (starlette on uvicorn).

Requests are parsed on the event loop into *jobs* (one row per choice: its context token
ids, token budget, seed and counter); a :class:`Batcher` merges the jobs that arrive within
``batch_wait_ms`` of each other (same temperature, top-p and stops, at most ``max_batch``
rows) into one call of the built-in sampler, ``generate_turn``, on one model thread. Each
row keeps its own seed: row ``r``'s ``t``-th token is drawn with ``uniforms(seed_r,
counter_r + t)`` (:mod:`anchor_rl.rollout.sampling`), so what a choice samples does not
depend on the requests it was batched with (up to the caveat on floating-point rounding of
other batch shapes) and a client that sends the seeds of its ``Request`` objects gets the
tokens the in-process ``hf`` engine samples. Weight reloads run on the same model thread,
between batches. Endpoints and fields: docs/models.md, "Serving and the HTTP engine".
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import inspect
import json
import logging
import math
import secrets
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.anchors.keys import fingerprint_model, fingerprint_tokenizer
from anchor_rl.models.tokenizer import id_count
from anchor_rl.rollout.engine import request_seed
from anchor_rl.rollout.sampling import EOS, StopSet, Turn, eos_ids, generate_turn

__all__ = [
    "BadRequest",
    "Batcher",
    "Job",
    "ModelServer",
    "ServerThread",
    "build_app",
    "parse_chat",
    "parse_completion",
]

log = logging.getLogger("anchor_rl.serve")

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


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# -- the model side ---------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """The rows of one request: one per choice, sampled together with the same settings.

    contexts: token ids each row continues; budgets: the most tokens each may generate;
    seeds, counters: row r's t-th token is drawn with ``uniforms(seeds[r], counters[r] + t)``.
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
    revision: str | None = None
    """The weights' revision that sampled the rows (set by :meth:`ModelServer.generate`):
    what the answer reports, even if a reload lands before it is written."""

    @property
    def key(self) -> tuple[float, float, tuple[str, ...]]:
        """Jobs with equal keys may share a sampler call (the stops in order: where two
        match at once, the first listed wins)."""
        return (self.temperature, self.top_p, self.stop)

    def __len__(self) -> int:
        return len(self.contexts)


class ModelServer:
    """The served model and tokenizer; sampling and weight reloads, one call at a time (the
    :class:`Batcher` runs them on its single model thread).

    name: the served model's name (the ``model`` field of requests).
    max_batch: most rows per forward batch (a larger job runs in chunks of that size, like
        the ``hf`` engine's ``max_batch``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        max_batch: int = 256,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.name, self.max_batch = (
            model.eval(),
            tokenizer,
            name,
            max_batch,
        )
        self.limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab = id_count(model, tokenizer)  # the ids a prompt may hold
        self.eos = eos_ids(model, tokenizer)
        self.revision = uuid.uuid4().hex
        self.weights_path: str | None = None
        self.created = int(time.time())
        self.tokenizer_fingerprint = fingerprint_tokenizer(tokenizer)
        self._fingerprint: tuple[str, str] | None = None  # (revision, fingerprint_model)
        self.batches = self.rows = 0
        with tempfile.TemporaryDirectory(prefix="anchor-rl-serve-") as folder:
            tokenizer.save_pretrained(folder)
            self.tokenizer_files = {
                p.name: base64.b64encode(p.read_bytes()).decode()
                for p in sorted(Path(folder).iterdir())
                if p.is_file()
            }

    def fingerprint(self) -> str:
        """``fingerprint_model`` of the current weights (computed once per revision)."""
        return self.revision_fingerprint()[1]

    def revision_fingerprint(self) -> tuple[str, str]:
        """``(revision, fingerprint_model)`` of the current weights, computed once per revision
        (it reads every weight: call it on the model thread, between batches and reloads)."""
        known = self.known_fingerprint()
        if known is None:
            known = self._fingerprint = (self.revision, fingerprint_model(self.model))
        return known

    def known_fingerprint(self) -> tuple[str, str] | None:
        """``(revision, fingerprint)`` of the current weights if :meth:`revision_fingerprint`
        computed it already, else None. Safe on the event loop while the model thread
        samples (``GET /v1/models`` need not wait for a batch): it reads one tuple, replaced
        whole, so the pair always names the same weights."""
        known = self._fingerprint
        return known if known is not None and known[0] == self.revision else None

    def generate(self, jobs: Sequence[Job]) -> list[list[Turn]]:
        """One ``generate_turn`` over the rows of ``jobs`` (equal keys), in chunks of
        ``max_batch`` rows; the turns of each job, in its row order."""
        first = jobs[0]
        contexts = [c for j in jobs for c in j.contexts]
        budgets = [b for j in jobs for b in j.budgets]
        seeds = [s for j in jobs for s in j.seeds]
        counters = [c for j in jobs for c in j.counters]
        stops = StopSet.build(self.tokenizer, list(first.stop), self.eos)
        turns: list[Turn] = []
        self.model.eval()
        for start in range(0, len(contexts), self.max_batch):
            part = slice(start, start + self.max_batch)
            turns += generate_turn(
                self.model, self.tokenizer, contexts[part], budgets[part], first.temperature,
                first.top_p, stops, seeds[part], counters[part],
            )  # fmt: skip
        self.batches += 1
        self.rows += len(contexts)
        for job in jobs:  # reloads run on this thread too: these are the weights that sampled
            job.revision = self.revision
        out, at = [], 0
        for j in jobs:
            out.append(turns[at : at + len(j)])
            at += len(j)
        return out

    def reload(self, path: str) -> dict[str, Any]:
        """Load the weights at ``path`` (a safetensors file or a Hugging Face model directory)
        into the model; BadRequest when they do not fit it. Returns the new revision."""
        try:
            state = _read_weights(Path(path))
        except BadRequest:
            raise
        except Exception as exc:  # a corrupt file, a header error...
            raise BadRequest(f"cannot read weights from {path}: {exc}", "path") from exc
        own = self.model.state_dict()
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise BadRequest(
                f"{path} has {len(unexpected)} tensors the served model does not have, e.g. "
                f"{unexpected[:3]}: is it a checkpoint of this architecture?",
                "path",
            )
        loaded = {own[k].data_ptr() for k in state}
        missing = sorted(k for k in set(own) - set(state) if own[k].data_ptr() not in loaded)
        if missing:  # tied weights (lm_head = embed_tokens) may be left out
            raise BadRequest(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}", "path")
        shapes = [
            f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
            for k in state
            if tuple(state[k].shape) != tuple(own[k].shape)
        ]
        if shapes:
            raise BadRequest(f"{path} has tensors of other shapes: {shapes[:3]}", "path")
        for k, v in state.items():  # NaN weights sample noise, with log-probs JSON cannot hold
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise BadRequest(
                    f"{path} has NaN or infinite values in tensor {k!r}; the served weights stay",
                    "path",
                )
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self._fingerprint = None
        self.revision, self.weights_path = uuid.uuid4().hex, str(path)
        return {"revision": self.revision, "tensors": len(state), "path": str(path)}


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.is_file():
        if path.suffix != ".safetensors":
            raise BadRequest(
                f"{path} is not a .safetensors file; send a safetensors file or a model directory",
                "path",
            )
        return load_file(str(path))
    if path.is_dir():
        if (path / "model.safetensors").is_file():
            return load_file(str(path / "model.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(load_file(str(path / shard)))
            return state
        if (path / "config.json").is_file():
            from anchor_rl.models.loading import load_policy

            return load_policy(path)[0].state_dict()
        raise BadRequest(
            f"{path} holds no model weights (no model.safetensors or config.json)", "path"
        )
    raise BadRequest(f"no such file or directory: {path}", "path")


class _Batch:
    """The jobs of one sampler call: equal keys, at most ``max_batch`` rows together."""

    def __init__(self, first: Job, max_batch: int) -> None:
        self.jobs, self.rows, self.max_batch = [first], len(first), max_batch

    @property
    def full(self) -> bool:
        return self.rows >= self.max_batch

    def take(self, job: Job) -> bool:
        """Add ``job`` if it fits; True when it is handled (added, or dropped as cancelled)."""
        if job.cancelled:
            return True
        if job.key != self.jobs[0].key or self.rows + len(job) > self.max_batch:
            return False
        self.jobs.append(job)
        self.rows += len(job)
        return True


class Batcher:
    """Merges jobs that arrive within ``wait_s`` of each other into one sampler call.

    The first job waiting opens a batch; for ``wait_s`` seconds (or until ``max_batch`` rows)
    the jobs that arrive join it if their key is equal and they fit, others wait for a later
    batch, in arrival order. A job larger than ``max_batch`` runs alone, in chunks. A job
    whose client went away before its batch started is dropped. All model work (sampling,
    reloads, fingerprints) runs on one thread, one call at a time.
    """

    def __init__(self, server: ModelServer, max_batch: int = 256, wait_s: float = 0.005) -> None:
        if wait_s < 0:
            raise ValueError(f"the batch wait must be >= 0, got {wait_s}")
        self.server, self.max_batch, self.wait_s = server, max_batch, wait_s
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anchor-rl-model")
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop and the model thread (waits for a call in progress)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def submit(self, job: Job) -> list[Turn]:
        """Queue ``job``; its turns, once its batch ran (an exception of the sampler is raised here)."""
        if self._queue is None:
            raise RuntimeError("the batcher is not running")
        job.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(job)
        return await job.future

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        deferred: deque[Job] = deque()
        while True:
            first = deferred.popleft() if deferred else await self._queue.get()
            if first.cancelled:
                continue
            batch = _Batch(first, self.max_batch)
            for job in list(deferred):
                if batch.take(job):
                    deferred.remove(job)
            deadline = loop.time() + self.wait_s
            while not batch.full and (remaining := deadline - loop.time()) > 0:
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
                if not batch.take(job):
                    deferred.append(job)
            live = [j for j in batch.jobs if not j.cancelled]
            if not live:
                continue
            try:
                turns = await loop.run_in_executor(self.executor, self.server.generate, live)
            except Exception as exc:
                for j in live:
                    if j.future is not None and not j.future.done():
                        j.future.set_exception(exc)
                continue
            for j, t in zip(live, turns, strict=True):
                if j.future is not None and not j.future.done():
                    j.future.set_result(t)


# -- request parsing --------------------------------------------------------------------------


def _int(
    body: dict[str, Any], name: str, default: int | None, low: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"`{name}` must be an integer, got {value!r}", name)
    if low is not None and value < low:
        raise BadRequest(f"`{name}` must be >= {low}, got {value}", name)
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"`{name}` must be a number, got {value!r}", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"`{name}` must be true or false, got {value!r}", name)
    return value


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
        )


def _common(
    body: dict[str, Any],
    server: ModelServer,
    prompts: list[list[int]],
    max_tokens: int | list[int] | None,
    field: str = "prompt",
) -> Parsed:
    """The sampling fields shared by both endpoints; ``max_tokens`` None: up to the context
    limit; ``field``: the request field the prompts came from (named by a refusal)."""
    model = body.get("model")
    if model is not None and model != server.name:
        raise BadRequest(
            f"the model {model!r} is not served here; this server serves {server.name!r}",
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
    )


def parse_completion(body: Any, server: ModelServer) -> Parsed:
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


def parse_chat(body: Any, server: ModelServer) -> Parsed:
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


# -- responses --------------------------------------------------------------------------------


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
        "model": server.name,
        "system_fingerprint": revision or server.revision,
        "choices": choices,
        "usage": _usage(parsed, turns),
    }


# -- the app ----------------------------------------------------------------------------------

Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(fn: Handler) -> Handler:
    """Turn refusals into 4xx JSON errors and anything else into a 500 JSON error: a bad
    request or a failing call never takes the server down."""

    @functools.wraps(fn)
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.param, exc.kind)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(500, f"{type(exc).__name__}: {exc}", kind="internal_error")

    return wrapped


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sample(request: Request, batcher: Batcher, job: Job) -> list[Turn] | None:
    """The job's turns, or None when the client went away first (its rows are then dropped
    unless their batch already started)."""
    result = asyncio.ensure_future(batcher.submit(job))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if result.done():
        return result.result()
    job.cancelled = True
    result.cancel()
    return None


def build_app(
    server: ModelServer, max_batch: int | None = None, batch_wait_ms: float = 5.0
) -> Starlette:
    """The starlette app serving ``server`` (see docs/models.md for the endpoints).

    max_batch: most rows per sampler call (default: the server's ``max_batch``).
    batch_wait_ms: how long a batch waits for more requests to join it.
    """
    batcher = Batcher(server, max_batch or server.max_batch, batch_wait_ms / 1000)

    @_endpoint
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": server.name, "revision": server.revision})

    @_endpoint
    async def models(request: Request) -> Response:
        known = server.known_fingerprint()
        if known is None:  # new weights: hash them on the model thread, between batches
            known = await batcher.call(server.revision_fingerprint)
        revision, fingerprint = known
        card = {
            "id": server.name,
            "object": "model",
            "created": server.created,
            "owned_by": "anchor-rl",
            "max_model_len": server.limit,
            "anchor_rl": {
                "fingerprint": fingerprint,
                "tokenizer_fingerprint": server.tokenizer_fingerprint,
                "revision": revision,
                "max_batch": batcher.max_batch,
                "vocab_size": server.vocab,
                "batches": server.batches,
                "rows": server.rows,
            },
        }
        return JSONResponse({"object": "list", "data": [card]})

    @_endpoint
    async def tokenizer(request: Request) -> Response:
        return JSONResponse({"files": server.tokenizer_files})

    @_endpoint
    async def weights(request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"revision": server.revision, "path": server.weights_path})
        body = await _json(request)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise BadRequest(
                'the body must be {"path": "<safetensors file or model directory>"}', "path"
            )
        return JSONResponse(await batcher.call(server.reload, path))

    @_endpoint
    async def completions(request: Request) -> Response:
        parsed = parse_completion(await _json(request), server)
        job = parsed.job()
        turns = await _sample(request, batcher, job)
        if turns is None:
            return Response(status_code=499)
        return JSONResponse(completion_body(server, parsed, turns, job.revision))

    @_endpoint
    async def chat(request: Request) -> Response:
        parsed = parse_chat(await _json(request), server)
        job = parsed.job()
        turns = await _sample(request, batcher, job)
        if turns is None:
            return Response(status_code=499)
        return JSONResponse(chat_body(server, parsed, turns, job.revision))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/tokenizer", tokenizer, methods=["GET"]),
        Route("/v1/weights", weights, methods=["GET", "POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )
    app.state.server, app.state.batcher = server, batcher
    return app


class ServerThread:
    """Serve an app with uvicorn in a daemon thread (tests, notebooks): ``with
    ServerThread(app) as s: ... s.url``. ``port=0`` picks a free port."""

    def __init__(
        self, app: Starlette, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        import uvicorn

        self.host = host
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="anchor-rl-serve")
        self.port = port

    @property
    def url(self) -> str:
        """``http://host:port`` (the API is under ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; returns once the socket listens (RuntimeError if it never does)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Shut down and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
