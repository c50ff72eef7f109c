"""The ``http`` engine: the :class:`~anchor_rl.rollout.engine.Engine` protocol against any
OpenAI-compatible ``/v1/completions`` server (``anchor-rl serve``, vLLM, SGLang, ...).

The client does what :class:`~anchor_rl.rollout.engine.HFEngine` does around the model: it
renders each prompt (``encode_prompt``), sends the token ids, runs the agent loop (tools run
here, between turns, their output masked out of the loss) and packs the
:class:`~anchor_rl.batch.RolloutBatch`. The server only samples turns. Each turn asks for
the sampled tokens' log-probs (``logprobs``) as token ids (vLLM's
``return_tokens_as_token_ids``); a server that answers with token strings instead has its
text re-tokenised here and checked against them (:class:`TokenMismatchError`).

Seeds. Every request carries the ``seeds`` and ``counters`` extension of ``anchor-rl serve``
(one raw seed per choice, and the counter of its first token): that server then draws
token ``t`` of a response with ``uniforms(seed, t)``, exactly as the in-process engine does,
so an ``http`` rollout of ``Request(seed=S)`` gives the tokens ``hf`` gives. Other servers
ignore the extension and get the standard ``seed`` field (one request per response).

``batched`` mode (the default against ``anchor-rl serve``, detected from ``GET /v1/models``)
sends each turn of up to ``max_batch`` rows as one request, the rows the in-process engine
would put in one forward batch; otherwise one request per row, ``concurrency`` at a time.

Weights: :meth:`HTTPEngine.sync_weights` saves the state dict as a safetensors file and
posts its path to ``POST /v1/weights``, the reload endpoint of ``anchor-rl serve`` (the
server must see the file). OpenAI-compatible servers have no common reload API.

LoRA policies (``lora_sync``): where the server has vLLM's runtime LoRA endpoints
(``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM started with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and ``anchor-rl serve``),
a sync writes only the adapter (a PEFT adapter directory), loads it under a new name, unloads
the previous one and samples with ``model=<that name>``; elsewhere it sends the merged
weights. vLLM refuses to load a name that is loaded already, hence a new name per sync.

The requests go through :class:`~anchor_rl.rollout.http_client.Client` (retries, back-off,
the timeout, the server's errors).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.lora import sampling_state
from anchor_rl.models.tokenizer import encode_prompt, id_count
from anchor_rl.rollout.agent import Response
from anchor_rl.rollout.engine import Engine, Request, pack, register_engine, request_seed
from anchor_rl.rollout.http_client import Client, ServerError, ServerInfo, base_url, parse_http_spec
from anchor_rl.rollout.http_lora import AdapterSync, LoraSync
from anchor_rl.rollout.sampling import EOS, StopSet
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool

TurnResult = tuple[list[int], list[float], str | None]
"""One turn of one row: (token ids, their log-probs, the server's finish_reason)."""


class TokenMismatchError(ValueError):
    """The server's tokens are not the client tokenizer's tokens of its text.

    detail: what differs (token counts and the first difference), for a caller's own message.
    """

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


class HTTPEngine:
    """An :class:`~anchor_rl.rollout.engine.Engine` that samples through an OpenAI-compatible
    ``/v1/completions`` server.

    tokenizer: the client-side tokenizer (the policy's); prompts are rendered and sent as its
        token ids, and the returned ids are read with it.
    url: the server's API base (``http://127.0.0.1:8000/v1``).
    model: the served model's name; None asks ``GET /v1/models`` (it must serve exactly one).
    timeout, retries, backoff, api_key: of the :class:`~anchor_rl.rollout.http_client.Client`.
    batched: one request per turn of up to ``max_batch`` rows (True) or one per row (False);
        None: batched iff the server is ``anchor-rl serve``.
    max_batch: rows per batched request (the ``hf`` engine's ``max_batch``; same value, same
        chunks); None: what the server reports, else 256.
    concurrency: requests in flight at once in per-row mode.
    extra_body: merged into every completions request (after the defaults).
    check_text: with token ids, check that they decode to the server's text (a server with
        another tokenizer fails here rather than training on wrong ids).
    weights_dir: where :meth:`sync_weights` writes its safetensors file or adapter directory
        (a directory the server can read; default: a fresh temporary directory, removed with
        the engine).
    vocab_size: the token ids a response may hold: the policy's embedding rows (the ``http``
        factory passes them; a model's embedding is often padded past its tokenizer, and a
        sampler may draw those ids); None: what ``anchor-rl serve`` reports, else the
        tokenizer's length. A larger id is a :class:`TokenMismatchError`.
    lora_sync: how a LoRA policy's weights are synced
        (:data:`~anchor_rl.rollout.http_lora.LORA_SYNC`): ``auto`` sends only the adapter
        where the server has the runtime LoRA endpoints, else the merged weights; ``adapter``
        fails (:class:`ServerError`) where it has not; ``merged`` always merges.

    Shapes: ``rollout`` returns the usual ``RolloutBatch`` (B requests, T the longest response).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        url: str,
        model: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        api_key: str | None = None,
        batched: bool | None = None,
        max_batch: int | None = None,
        concurrency: int = 16,
        extra_body: Mapping[str, Any] | None = None,
        check_text: bool = True,
        weights_dir: str | None = None,
        vocab_size: int | None = None,
        lora_sync: LoraSync = "auto",
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.tokenizer = tokenizer
        self.client = Client(
            url, timeout=timeout, retries=retries, backoff=backoff, api_key=api_key
        )
        self.url = self.client.url
        self._model, self._batched, self._max_batch = model, batched, max_batch
        self.concurrency, self.check_text = concurrency, check_text
        self.extra_body = dict(extra_body or {})
        self._weights_dir = weights_dir
        self._vocab_size = vocab_size
        self._remove_weights: weakref.finalize | None = None  # a temporary folder's removal
        self._info: ServerInfo | None = None
        self._lock = threading.Lock()
        self._revision: str | None = None  # the server revision our last sync_weights made
        self._weights: Path | None = None
        self.lora = AdapterSync(self, lora_sync)
        self.syncs = 0
        self.sync_mode: str | None = None
        """How the last :meth:`sync_weights` went: ``adapter`` or ``merged``."""
        self.sync_bytes = 0
        """The bytes the last :meth:`sync_weights` wrote for the server to read (an adapter
        sync that first loads the base model into ``anchor-rl serve`` counts both)."""

    # -- the server ---------------------------------------------------------------------

    def info(self, refresh: bool = False) -> ServerInfo:
        """The served model's :class:`~anchor_rl.rollout.http_client.ServerInfo` (asked once,
        then cached; ``refresh`` asks again, e.g. for the fingerprint after a weight sync)."""
        with self._lock:
            if self._info is None or refresh:
                self._info = self.client.info(self._model)
            return self._info

    @property
    def model(self) -> str:
        """The served model's name (asks the server when it was not given)."""
        return self._model if self._model is not None else self.info().model

    @property
    def batched(self) -> bool:
        """Whether each turn goes out as one request of many rows (see the class docstring)."""
        return self._batched if self._batched is not None else self.info().anchor_rl

    @property
    def max_batch(self) -> int:
        """Rows per batched request."""
        if self._max_batch is not None:
            return self._max_batch
        return (self.info().max_batch if self.batched else None) or 256

    @property
    def vocab_size(self) -> int:
        """The token ids a response may hold (see the class docstring)."""
        size = self._vocab_size or (self.info().vocab_size if self.batched else None)
        return max(size or 0, len(self.tokenizer))

    # -- Engine ---------------------------------------------------------------------------

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """One response per request (see :class:`~anchor_rl.rollout.engine.Engine`); with
        ``tools`` the agent loop runs here, the server sampling each turn."""
        if not requests:
            raise ValueError("rollout needs at least one request")
        self._ensure_weights()
        tok = self.tokenizer
        encoded = {p: encode_prompt(tok, p, instruction) for p in {r.prompt for r in requests}}
        rows = [encoded[r.prompt] for r in requests]
        seeds = [r.seed for r in requests]
        size = self.max_batch
        responses: list[Response] = []
        for start in range(0, len(rows), size):
            end = start + size
            responses += self._agent(rows[start:end], params, seeds[start:end], tools)
        group = torch.as_tensor([r.group for r in requests], dtype=torch.long)
        return pack(responses, rows, group, tok)

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Have the server sample with ``state``.

        A LoRA policy's merged weights (``sampling_state``'s
        :class:`~anchor_rl.models.lora.MergedState`) go as the adapter alone where
        ``lora_sync`` allows it and the server has the runtime LoRA endpoints: a PEFT adapter
        directory loaded under a new name (``POST /v1/load_lora_adapter``), the previous
        name unloaded, later completions asking for the new one. Otherwise ``state`` is saved
        as a safetensors file the server loads (``POST /v1/weights``, ``anchor-rl serve``
        only). The server must be able to read the file or directory. Tensors sharing
        storage (tied embeddings) are written once each, as copies."""
        self.sync_bytes = 0
        policy = self.lora.policy_of(state)
        if policy is not None:
            self.lora.sync(policy, self.syncs)
            self.sync_mode = "adapter"
        else:
            self._sync_state(state)
            self.lora.name = None  # sample the served model itself
            self.sync_mode = "merged"
        self.syncs += 1

    def _sync_state(self, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self._weights_path()
        tensors, seen = {}, set()
        for name, value in state.items():
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            elif t.untyped_storage().data_ptr() in seen:
                t = t.clone()  # safetensors stores each storage once
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t.contiguous()
        save_file(tensors, str(path))
        self.sync_bytes += path.stat().st_size
        self._weights = path
        self._post_weights(path)

    def close(self) -> None:
        """Close the connections and remove the temporary weights folder this engine made,
        if any (idempotent; both also happen when the engine is collected). The server keeps
        running, with the weights it loaded; a request after this fails."""
        self.client.close()
        if self._remove_weights is not None:
            self._remove_weights()
            self._remove_weights = self._weights_dir = None

    # -- weights --------------------------------------------------------------------------

    def _folder(self) -> Path:
        if self._weights_dir is None:
            folder = tempfile.mkdtemp(prefix="anchor-rl-weights-")
            self._remove_weights = weakref.finalize(self, shutil.rmtree, folder, True)
            self._weights_dir = folder
        Path(self._weights_dir).mkdir(parents=True, exist_ok=True)
        return Path(self._weights_dir).resolve()

    def _weights_path(self) -> Path:
        return self._folder() / "weights.safetensors"

    @property
    def sampling_model(self) -> str:
        """The ``model`` field of completions: the loaded adapter's name after an adapter
        sync, else the served model's."""
        return self.lora.name or self.model

    def _post_weights(self, path: Path) -> None:
        try:
            answer = self.client.request("POST", "/weights", {"path": str(path)})
        except ServerError as exc:
            if exc.status in (404, 405):
                raise ServerError(
                    f"{self.url} has no weight-reload endpoint (POST /v1/weights, which `anchor-rl "
                    "serve` has): OpenAI-compatible servers share no reload API, so sync_weights "
                    "works only against anchor-rl serve",
                    exc.status,
                ) from exc
            raise
        self._revision = answer.get("revision") if isinstance(answer, dict) else None

    def _ensure_weights(self) -> None:
        """After a sync, make sure the server still holds our weights: another engine (say, a
        reference's) may have loaded its own since (``GET /v1/weights`` reports the revision);
        if so, load ours again (after an adapter sync: the policy's base model)."""
        if self.lora.name is not None:
            self.lora.ensure_base()
            return
        if self._weights is None or self._revision is None:
            return
        current = self.client.request("GET", "/weights")
        if not isinstance(current, dict) or current.get("revision") != self._revision:
            self._post_weights(self._weights)

    # -- the agent loop --------------------------------------------------------------------

    def _agent(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        tools: Mapping[str, Tool] | None,
    ) -> list[Response]:
        """``run_agent`` with the server sampling each turn (same stops, budgets and counters)."""
        tok = self.tokenizer
        tools = dict(tools or {})
        close_tags = {f"</{tag}>" for tag in tools}
        stop = list(dict.fromkeys([*params.stop, *close_tags]))
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        stops = StopSet.build(tok, stop, eos)
        responses = [Response() for _ in prompts]
        while active := [i for i, r in enumerate(responses) if not r.done]:
            turns = self._turn(
                [[*prompts[i], *responses[i].tokens] for i in active],
                [params.max_new_tokens - len(responses[i].tokens) for i in active],
                params,
                stop,
                [seeds[i] for i in active],
                [len(responses[i].tokens) for i in active],
            )
            for i, (ids, logprobs, finish) in zip(active, turns, strict=True):
                r = responses[i]
                r.extend(ids, logprobs)
                ended = _stop_of(ids, finish, stops, tok)
                if ended is None:
                    r.truncated = r.done = True
                elif not ids or ended not in close_tags or r.tool_calls >= params.max_turns:
                    r.done = True
                else:
                    r.add_tool_result(ids, tok, tools, params.max_new_tokens)
        return responses

    def _turn(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        params: SamplingParams,
        stop: list[str],
        seeds: list[int],
        counters: list[int],
    ) -> list[TurnResult]:
        """One generation turn of every row: (ids, log-probs, finish_reason) per row."""
        common: dict[str, Any] = {
            "model": self.sampling_model,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": 1,
            "stop": stop,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": True,
        }
        if self.batched:
            body = {
                **common,
                "prompt": contexts,
                "max_tokens": budgets[0] if len(set(budgets)) == 1 else budgets,
                "seeds": seeds,
                "counters": counters,
                **self.extra_body,
            }
            return self._complete(body, len(contexts))

        def one(i: int) -> TurnResult:
            seed = seeds[i] if counters[i] == 0 else request_seed(seeds[i], counters[i])
            body = {
                **common,
                "prompt": contexts[i],
                "max_tokens": budgets[i],
                "seed": seed,
                "seeds": [seeds[i]],
                "counters": [counters[i]],
                **self.extra_body,
            }
            return self._complete(body, 1)[0]

        if len(contexts) == 1:
            return [one(0)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(contexts))) as pool:
            return list(pool.map(one, range(len(contexts))))

    def _complete(self, body: dict[str, Any], rows: int) -> list[TurnResult]:
        answer = self.client.request("POST", "/completions", body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != rows:
            got = len(choices) if isinstance(choices, list) else "no"
            raise ServerError(f"{self.url}/completions returned {got} choices for {rows} prompts")
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        return [self._read(c) for c in choices]

    def _read(self, choice: Any) -> TurnResult:
        """A choice's token ids and log-probs, checked against its text."""
        try:
            text = choice["text"]
            logprobs = choice["logprobs"]
            tokens, values = list(logprobs["tokens"]), list(logprobs["token_logprobs"])
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(
                f"{self.url}/completions returned no choices[i].text/logprobs.tokens/logprobs.token_logprobs "
                "(does it support `logprobs` on /completions?)"
            ) from exc
        if len(tokens) != len(values) or any(v is None for v in values):
            raise ServerError(
                f"{self.url}/completions returned {len(tokens)} tokens but log-probs {values[:5]}..."
            )
        finish = choice.get("finish_reason")
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            return self._ids_of_token_ids(text, tokens), [float(v) for v in values], finish
        return self._ids_of_strings(text, tokens), [float(v) for v in values], finish

    def _ids_of_token_ids(self, text: str, tokens: list[str]) -> list[int]:
        tok = self.tokenizer
        try:
            ids = [int(t.removeprefix("token_id:")) for t in tokens]
        except ValueError as exc:
            raise ServerError(f"{self.url} returned a malformed token {exc}") from exc
        vocab = self.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            bad = next(i for i in ids if not 0 <= i < vocab)
            detail = f"token id {bad} is outside the client vocabulary of {vocab} token ids"
            raise TokenMismatchError(
                f"the server {self.url} (model {self.model!r}): {detail}", detail
            )
        if self.check_text and tok.decode(ids, skip_special_tokens=True) != text:
            decoded = tok.decode(ids, skip_special_tokens=True)
            detail = (
                f"its token ids decode to {decoded[:60]!r} with the client tokenizer but its text "
                f"is {text[:60]!r}"
            )
            raise TokenMismatchError(
                f"the server {self.url} (model {self.model!r}) uses another tokenizer: {detail}",
                detail,
            )
        return ids

    def _ids_of_strings(self, text: str, tokens: list[str]) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode(text, add_special_tokens=False)
        eos = tok.eos_token_id
        if "".join(tokens) != text:
            eos_text = tok.decode([eos]) if eos is not None else None
            if tokens and tokens[-1] == eos_text and "".join(tokens[:-1]) == text:
                ids.append(eos)  # the eos token is in the tokens, not in the text
            else:
                raise ServerError(
                    f"{self.url} returned tokens that do not spell its text; if it trimmed the stop "
                    "string, keep it (vLLM: include_stop_str_in_output, SGLang: no_stop_trim in extra_body)"
                )
        ours = [tok.decode([i]) for i in ids]
        if ours != tokens:
            at = next(
                (k for k, (a, b) in enumerate(zip(tokens, ours, strict=False)) if a != b),
                min(len(tokens), len(ours)),
            )
            detail = (
                f"{len(tokens)} vs {len(ours)} tokens, first difference at token {at}: "
                f"endpoint {tokens[at : at + 3]!r} vs policy {ours[at : at + 3]!r}"
            )
            raise TokenMismatchError(
                f"the server {self.url} (model {self.model!r}) tokenises its text differently "
                f"from the client tokenizer: {detail}",
                detail,
            )
        return ids


def _stop_of(
    ids: list[int], finish: str | None, stops: StopSet, tokenizer: PreTrainedTokenizerBase
) -> str | None:
    """How a turn ended, as ``generate_turn`` decides it: the stop its last token completes,
    ``EOS`` when the server stopped on a stop of its own, None when it ran out of budget."""
    if ids and (hit := stops.match(tokenizer, ids)) is not None:
        return hit
    return None if finish == "length" else EOS


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer directory for an ``http`` model whose server does not serve its tokenizer
    (``AutoTokenizer``; eos becomes the pad token when there is none). ValueError if it cannot load."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def connect(
    spec: str, tokenizer: PreTrainedTokenizerBase | None = None, **options: Any
) -> HTTPEngine:
    """An :class:`HTTPEngine` for ``http:URL`` or ``http:URL#MODEL`` (or a bare URL).

    Without ``tokenizer``, the served one is fetched (``anchor-rl serve`` has it at
    ``GET /v1/tokenizer``; other servers need the tokenizer passed). ``options`` go to
    :class:`HTTPEngine`.
    """
    bare = spec.startswith(("http://", "https://"))  # "http://..." starts with "http:" too
    url, model = (base_url(spec), None) if bare else parse_http_spec(spec)
    model = options.pop("model", None) or model
    if tokenizer is None:
        client = Client(
            url,
            **{k: options[k] for k in ("timeout", "retries", "backoff", "api_key") if k in options},
        )
        try:
            tokenizer = client.tokenizer()
        except ServerError as exc:
            raise ValueError(
                f"{url} does not serve its tokenizer (GET /v1/tokenizer is an anchor-rl serve "
                f"extension: {exc}); pass the tokenizer (--tokenizer DIR)"
            ) from exc
    return HTTPEngine(tokenizer, url, model, **options)


@register_engine("http")
def _http_engine(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    /,
    url: str = "http://127.0.0.1:8000/v1",
    model: str | None = None,
    timeout: float = 60.0,
    retries: int = 3,
    api_key: str | None = None,
    batched: bool | None = None,
    max_batch: int | None = None,
    concurrency: int = 16,
    sync_on_start: bool = True,
    weights_dir: str | None = None,
    lora_sync: LoraSync = "auto",
) -> Engine:
    """An :class:`HTTPEngine` on ``url`` with the learner's tokenizer. ``sync_on_start``
    loads the learner's current weights into the server first (``anchor-rl serve``, or for a
    LoRA policy any server with the runtime LoRA endpoints), so the server samples the policy
    whatever it was started with. ``lora_sync``: see :class:`HTTPEngine`."""
    engine = HTTPEngine(
        tokenizer, url, model, timeout=timeout, retries=retries, api_key=api_key,
        batched=batched, max_batch=max_batch, concurrency=concurrency, weights_dir=weights_dir,
        vocab_size=id_count(policy, tokenizer), lora_sync=lora_sync,
    )  # fmt: skip
    if sync_on_start:
        engine.sync_weights(sampling_state(policy))  # a LoRA policy: its adapter, or merged
    return engine
