"""The transport of the ``http`` engine (:mod:`anchor_rl.rollout.http`): a JSON client for one
OpenAI-compatible server, with retries, back-off and a timeout, its errors, and what the
server says about the model it serves (``GET /v1/models``, ``GET /v1/tokenizer``).
"""

from __future__ import annotations

import base64
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from transformers import PreTrainedTokenizerBase

from anchor_rl.errors import AnchorRLError

RETRY_STATUS = frozenset({500, 502, 503, 504})
"""HTTP statuses retried with back-off (a server restarting or overloaded); other errors are final."""


class ServerUnreachableError(AnchorRLError, ConnectionError):
    """The server could not be reached (connection refused, reset, timed out) after the retries."""


class ServerTimeoutError(ServerUnreachableError):
    """The server took the request but did not answer within the timeout. Not retried: it
    may still be generating the answer, and the same request again would queue the same
    work behind it (a generation longer than the timeout would time out on every attempt)."""


class ServerError(RuntimeError):
    """The server answered with an error status (its message included) or an unreadable body."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def base_url(url: str) -> str:
    """The API base of ``url``: ``http://host:port`` becomes ``http://host:port/v1``; a URL
    with a path (``.../v1``) is kept (trailing slashes dropped). ValueError if it is not http(s)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL like http://127.0.0.1:8000/v1")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


def parse_http_spec(spec: str) -> tuple[str, str | None]:
    """``http:URL`` or ``http:URL#MODEL`` -> ``(API base URL, served model name or None)``."""
    if not spec.startswith("http:"):
        raise ValueError(f"{spec!r} is not an http:URL spec")
    url, _, model = spec.removeprefix("http:").partition("#")
    return base_url(url), model or None


@dataclass(frozen=True)
class ServerInfo:
    """What ``GET /v1/models`` says about the served model.

    model: its name (the ``model`` field of requests).
    anchor_rl: the server is ``anchor-rl serve`` (it takes the ``seeds`` extension and has
        the weight-reload and tokenizer endpoints).
    fingerprint: content hash of the served weights (``anchor-rl serve`` only; the
        ``fingerprint_model`` of ``anchor_rl.anchors.keys``), else None.
    tokenizer_fingerprint: ``fingerprint_tokenizer`` of the served tokenizer, else None.
    max_batch: the most rows the server samples together (``anchor-rl serve`` only).
    max_model_len: its context limit in tokens, when reported.
    vocab_size: the token ids its model reads (``anchor-rl serve`` only: its embedding rows,
        which may exceed the tokenizer's length).
    """

    model: str
    anchor_rl: bool = False
    fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    max_batch: int | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


class Client:
    """A small JSON client for one OpenAI-compatible server, with retries and a timeout.

    url: the API base (``http://host:port/v1``; a bare ``http://host:port`` gets ``/v1``).
    timeout: seconds per HTTP request (connect, read and write each).
    retries: further attempts after a connection error, a connect timeout or a 5xx answer
        (500/502/503/504), waiting ``backoff * 2**i`` seconds (at most 10) before attempt i + 1.
        A request the server took but did not answer within ``timeout`` is not retried
        (:class:`ServerTimeoutError`).
    api_key: sent as ``Authorization: Bearer``.
    Thread-safe (one ``httpx.Client`` connection pool).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        api_key: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url, self.timeout, self.retries, self.backoff = (
            base_url(url),
            timeout,
            retries,
            backoff,
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            timeout=timeout, headers=headers, limits=httpx.Limits(max_connections=256)
        )
        self._closer = weakref.finalize(self, self._http.close)

    def close(self) -> None:
        """Close the connections (idempotent; also done when the client is collected)."""
        self._closer()

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, text: bool = False
    ) -> Any:
        """``method`` ``url + path`` with a JSON ``body``; the decoded JSON answer (with
        ``text``, an answer that is not JSON is returned as its text: vLLM answers its LoRA
        endpoints with plain text).

        Raises :class:`ServerUnreachableError` (naming the URL, the timeout and the retries)
        when every attempt failed to connect, :class:`ServerTimeoutError` at once when the
        server took the request and did not answer within the timeout, :class:`ServerError`
        for an error status (with the server's message) or a body that is not JSON, and a
        ``RuntimeError`` once the client is closed.
        """
        if not self._closer.alive:
            raise RuntimeError(f"the client of {self.url} is closed (its engine's run ended)")
        target = self.url + path
        failure, status = "", None  # the last attempt's: an HTTP status survives the retries
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 10.0))
            try:
                response = self._http.request(method, target, json=body)
            except httpx.ReadTimeout as exc:
                raise ServerTimeoutError(
                    f"{method} {target} sent no answer within the timeout of {self.timeout:g} s "
                    f"(ReadTimeout, attempt {attempt + 1}); not retried: the server may still be "
                    "generating it. For long generations raise the timeout "
                    "(rollout.engine_args.timeout, or the engine's timeout option)."
                ) from exc
            except httpx.TransportError as exc:  # connect and protocol errors, other timeouts
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                status = None
                continue
            if response.status_code in RETRY_STATUS:
                failure = f"HTTP {response.status_code}: {_message(response)}"
                status = response.status_code
                continue
            if response.status_code >= 400:
                raise ServerError(
                    f"{method} {target} answered HTTP {response.status_code}: {_message(response)}",
                    response.status_code,
                )
            try:
                return response.json()
            except ValueError as exc:
                if text:
                    return response.text
                raise ServerError(
                    f"{method} {target} answered with a body that is not JSON: {response.text[:200]!r}",
                    response.status_code,
                ) from exc
        tries = f"{self.retries + 1} attempt{'s' * bool(self.retries)} ({self.retries} retries with back-off)"
        if status is not None:
            raise ServerError(f"{method} {target} failed after {tries}: {failure}", status)
        raise ServerUnreachableError(
            f"cannot reach {target}: {failure}; gave up after {tries}, timeout {self.timeout:g} s "
            "per request. Is the server running there (e.g. `anchor-rl serve`)?"
        )

    def info(self, model: str | None = None) -> ServerInfo:
        """The served model's :class:`ServerInfo` from ``GET /models``; ``model`` picks one when
        the server serves several (ValueError naming them otherwise; the LoRA adapters a
        server lists with a ``parent`` model do not count). A server without the endpoint
        gives ``ServerInfo(model)`` when ``model`` is given."""
        try:
            answer = self.request("GET", "/models")
            cards = answer.get("data", []) if isinstance(answer, dict) else []
        except ServerError:
            if model is None:
                raise
            return ServerInfo(model)
        names = [c.get("id") for c in cards if isinstance(c, dict)]
        if model is None:  # LoRA adapters loaded into a server (their `parent` set) are not it
            names = [c.get("id") for c in cards if isinstance(c, dict) and not c.get("parent")]
            if len(names) != 1:
                raise ValueError(
                    f"{self.url} serves {len(names)} models ({', '.join(map(str, names)) or 'none'}); "
                    "name one (http:URL#MODEL, or the engine's `model` option)"
                )
            model = names[0]
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
        if card is None:
            return ServerInfo(model)
        ext = card.get("anchor_rl") if isinstance(card.get("anchor_rl"), dict) else None
        return ServerInfo(
            model=model,
            anchor_rl=ext is not None,
            fingerprint=(ext or {}).get("fingerprint"),
            tokenizer_fingerprint=(ext or {}).get("tokenizer_fingerprint"),
            max_batch=(ext or {}).get("max_batch"),
            max_model_len=card.get("max_model_len"),
            vocab_size=(ext or {}).get("vocab_size"),
            raw=card,
        )

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The served tokenizer, from ``GET /tokenizer`` (an ``anchor-rl serve`` extension:
        its ``save_pretrained`` files), loaded with ``AutoTokenizer``; ServerError if the
        server has no such endpoint."""
        from transformers import AutoTokenizer

        answer = self.request("GET", "/tokenizer")
        files = answer.get("files") if isinstance(answer, dict) else None
        if not isinstance(files, dict) or not files:
            raise ServerError(f"GET {self.url}/tokenizer returned no tokenizer files")
        with tempfile.TemporaryDirectory(prefix="anchor-rl-tokenizer-") as folder:
            for name, data in files.items():
                if Path(name).name != name:
                    raise ServerError(f"GET {self.url}/tokenizer returned a file path {name!r}")
                (Path(folder) / name).write_bytes(base64.b64decode(data))
            tokenizer = AutoTokenizer.from_pretrained(folder)
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer


def _message(response: httpx.Response) -> str:
    """The error message of an error answer (OpenAI's ``{"error": {"message"}}`` or the text)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    return str(body)[:500]
