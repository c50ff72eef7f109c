"""The OpenAI-compatible server behind ``anchor-rl serve`` (starlette on uvicorn).

Requests are parsed on the event loop into *jobs* (:mod:`anchor_rl.serve.protocol`: one row
per choice, its context token ids, token budget, seed and counter); a
:class:`~anchor_rl.serve.batcher.Batcher` merges the jobs that arrive within
``batch_wait_ms`` of each other (same temperature, top-p and stops, at most ``max_batch``
rows) into one call of the built-in sampler, ``generate_turn``, on one model thread
(:class:`~anchor_rl.serve.model.ModelServer`); :mod:`anchor_rl.serve.responses` writes the
answers. Each row keeps its own seed: row ``r``'s ``t``-th token is drawn with ``uniforms(seed_r,
counter_r + t)`` (:mod:`anchor_rl.rollout.sampling`), so what a choice samples does not
depend on the requests it was batched with (up to the caveat on floating-point rounding of
other batch shapes) and a client that sends the seeds of its ``Request`` objects gets the
tokens the in-process ``hf`` engine samples. Weight reloads run on the same model thread,
between batches, and so do the loads and unloads of LoRA adapters (vLLM's runtime LoRA API,
:mod:`anchor_rl.serve.adapters`). Endpoints and fields: docs/models.md, "Serving and the HTTP engine".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from anchor_rl.rollout.sampling import Turn
from anchor_rl.serve.batcher import Batcher
from anchor_rl.serve.model import ModelServer
from anchor_rl.serve.protocol import BadRequest, Job, Parsed, parse_chat, parse_completion
from anchor_rl.serve.responses import chat_body, completion_body

log = logging.getLogger("anchor_rl.serve")


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


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


def _field(body: Any, name: str) -> str:
    """``body[name]``, a non-empty string; BadRequest naming the field otherwise."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"the body needs `{name}`, a non-empty string", name)
    return value


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
        cards = [card, *server.adapters.cards(server.name, server.limit)]
        return JSONResponse({"object": "list", "data": cards})

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
    async def load_lora(request: Request) -> Response:
        body = await _json(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        return PlainTextResponse(await batcher.call(server.adapters.load, name, path))

    @_endpoint
    async def unload_lora(request: Request) -> Response:
        name = _field(await _json(request), "lora_name")
        return PlainTextResponse(await batcher.call(server.adapters.unload, name))

    def sampling(parse: Callable[..., Parsed], answer: Callable[..., dict]) -> Handler:
        """An endpoint that parses a request with ``parse``, samples it, answers with ``answer``."""

        @_endpoint
        async def endpoint(request: Request) -> Response:
            parsed = parse(await _json(request), server)
            job = parsed.job()
            turns = await _sample(request, batcher, job)
            if turns is None:
                return Response(status_code=499)
            return JSONResponse(answer(server, parsed, turns, job.revision))

        return endpoint

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
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/v1/completions", sampling(parse_completion, completion_body), methods=["POST"]),
        Route("/v1/chat/completions", sampling(parse_chat, chat_body), methods=["POST"]),
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
