"""The ``http`` engine against `anchor-rl serve` on loopback: the in-process engine's rollouts
(tools included), weight syncs, retries, timeouts and an unreachable server."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from anchor_rl.anchors.keys import fingerprint_model
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import load_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.engine import ENGINES, group_requests, make_engine
from anchor_rl.rollout.http import HTTPEngine, TokenMismatchError, connect
from anchor_rl.rollout.http_client import ServerError, ServerTimeoutError, ServerUnreachableError
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.serve.app import ServerThread, build_app
from anchor_rl.serve.model import ModelServer
from anchor_rl.trainer.config import ConfigError, load_config

A = build_tokenizer().convert_tokens_to_ids("a")
TOOLS = {"search": lambda query: f"found {query[:5]}"}


def assert_same_batch(a, b, atol: float = 0.0) -> None:
    assert a.prompt_ids == b.prompt_ids and a.texts == b.texts
    for name in ("group", "response_ids", "attention_mask", "loss_mask", "tool_calls", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("batched", [True, False])
def test_the_http_engine_samples_what_the_hf_engine_samples(served, tiny_dir, batched) -> None:
    """Same requests, same rows: tokens, masks, tool turns and log-probs. Batched, each turn is
    the forward batch the hf engine runs (bit for bit); one request per row, the log-probs may
    differ in the last bits (other batch shapes)."""
    model, tok = load_policy(tiny_dir)
    requests = group_requests([f"{i}*{i}=" for i in range(5)], range(5), 3, "test", 0)
    params = SamplingParams(temperature=0.9, max_new_tokens=40, max_turns=2, stop=["</answer>"])
    local = make_engine("hf", model, tok).rollout(requests, params, TOOLS, "Think.")
    engine = HTTPEngine(tok, served[0].url, batched=batched)
    remote = engine.rollout(requests, params, TOOLS, "Think.")
    assert_same_batch(local, remote, atol=0.0 if batched else 1e-5)
    assert local.tool_calls.sum() > 0 and local.loss_mask.sum() < local.attention_mask.sum()
    assert engine.model == "tiny" and engine.batched is batched


def test_sync_weights_makes_the_server_sample_the_learner(tiny_dir, one_thread) -> None:
    """The factory loads the learner's weights into the server; a sync after an update loads
    the new ones; an engine whose weights another engine replaced loads its own back."""
    model, tok = load_policy(tiny_dir)
    server = ModelServer(model, tok, "tiny")
    learner = build_model("tiny", tok, seed=1)
    requests = group_requests(["1+1=", "2+2="], ["a", "b"], 2, "sync", 0)
    params = SamplingParams(max_new_tokens=10)
    with ServerThread(build_app(server)) as thread:
        engine = make_engine("http", learner, tok, url=thread.url)
        assert server.fingerprint() == fingerprint_model(learner) and engine.syncs == 1
        assert_same_batch(
            engine.rollout(requests, params),
            make_engine("hf", learner, tok).rollout(requests, params),
        )
        with torch.no_grad():
            learner.model.norm.weight.mul_(1.5)  # an "update"
        engine.sync_weights(learner.state_dict())
        assert server.fingerprint() == fingerprint_model(learner) and engine.syncs == 2
        reference = build_model("tiny", tok, seed=2)
        make_engine("http", reference, tok, url=thread.url)  # another engine, its weights
        assert server.fingerprint() == fingerprint_model(reference)
        batch = engine.rollout(requests, params)  # ours are loaded back first
        assert server.fingerprint() == fingerprint_model(learner)
        assert_same_batch(batch, make_engine("hf", learner, tok).rollout(requests, params))
        folder = engine._weights.parent  # the engine's own temporary folder
        assert folder.is_dir()
        engine.close()
        engine.close()  # idempotent
        assert not folder.exists()
        with pytest.raises(RuntimeError, match="is closed"):
            engine.rollout(requests, params)
        assert server.fingerprint() == fingerprint_model(learner)  # the server keeps them


def _free_port() -> int:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error(tokenizer) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    engine = HTTPEngine(tokenizer, url, "m", batched=False, retries=2, backoff=0.01, timeout=1.5)
    message = (
        r"cannot reach http://127\.0\.0\.1:\d+/v1/completions: ConnectError.*3 attempts \(2 retries "
        r"with back-off\), timeout 1\.5 s per request"
    )
    with pytest.raises(ServerUnreachableError, match=message):
        engine.rollout(group_requests(["q"], [0], 1, "x"), SamplingParams(max_new_tokens=2))
    with pytest.raises(ServerUnreachableError, match=r"/v1/tokenizer"):
        connect(f"http:{url}/v1", retries=0)  # the CLI's http:URL asks for the tokenizer first
    for bare in (url, url.replace("http://", "https://")):  # a bare URL too, as documented
        assert connect(bare, tokenizer, retries=0).url == bare + "/v1"


class Flaky:
    """A stub /v1/completions: ``fail`` answers 503 first, then a one-token completion (or a
    slow one with ``delay``)."""

    def __init__(self, fail: int = 0, delay: float = 0.0) -> None:
        self.fail, self.delay, self.calls = fail, delay, 0
        self.app = Starlette(routes=[Route("/v1/completions", self.complete, methods=["POST"])])

    async def complete(self, request):
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.calls <= self.fail:
            return JSONResponse({"error": {"message": "warming up"}}, status_code=503)
        choice = {
            "index": 0, "text": "a", "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{A}"], "token_logprobs": [-0.5]},
        }  # fmt: skip
        return JSONResponse({"choices": [choice]})


def test_5xx_answers_are_retried_with_back_off(tokenizer) -> None:
    requests = group_requests(["q"], [0], 1, "x")
    params = SamplingParams(max_new_tokens=1)
    stub = Flaky(fail=2)
    with ServerThread(stub.app) as thread:
        engine = HTTPEngine(tokenizer, thread.url, "m", batched=False, retries=2, backoff=0.01)
        batch = engine.rollout(requests, params)
        assert stub.calls == 3 and batch.response_ids.tolist() == [[A]] and batch.truncated.all()
        assert batch.logprobs.tolist() == [[-0.5]]
        stub.calls, stub.fail = 0, 10
        with pytest.raises(ServerError, match="after 2 attempts.*HTTP 503: warming up") as failed:
            HTTPEngine(tokenizer, thread.url, "m", batched=False, retries=1, backoff=0.01).rollout(
                requests, params
            )
        assert failed.value.status == 503  # kept once the retries ran out


def test_a_request_slower_than_the_timeout_fails_at_once_naming_it(tokenizer) -> None:
    """A read timeout is not retried: the server is still at work on the first request, and
    the same request again would only queue behind it (and time out again)."""
    stub = Flaky(delay=0.6)
    with ServerThread(stub.app) as thread:
        engine = HTTPEngine(
            tokenizer, thread.url, "m", batched=False, retries=3, backoff=0.01, timeout=0.15
        )
        with pytest.raises(
            ServerTimeoutError, match=r"timeout of 0\.15 s \(ReadTimeout, attempt 1\)"
        ):
            engine.rollout(group_requests(["q"], [0], 1, "x"), SamplingParams(max_new_tokens=1))
        assert stub.calls == 1
    assert issubclass(ServerTimeoutError, ServerUnreachableError)  # callers catching it still do


def test_the_http_engine_is_registered_with_its_options() -> None:
    options = ["rollout.engine_args.url=http://127.0.0.1:9/v1", "rollout.engine_args.model=m"]
    cfg = load_config("grpo", ["rollout.engine=http", *options])
    assert "http" in ENGINES and cfg.rollout.engine_args == {
        "url": "http://127.0.0.1:9/v1",
        "model": "m",
    }
    with pytest.raises(ConfigError, match="the 'http' engine takes url, model, timeout, retries"):
        load_config(
            "grpo",
            ["rollout.engine=http", "rollout.engine_args.port=1"],
        )


def test_ids_past_the_tokenizer_in_a_padded_embedding_go_through_both_sides(one_thread) -> None:
    """A model whose embedding has rows past its tokenizer (as most released models: padded to
    a multiple of 64 or 128) may sample those ids; the server takes them back in the next
    turn's prompt and the client accepts them, as the in-process engine does."""
    tok = build_tokenizer()
    model = build_model("tiny", tok, seed=0)
    extra = 5
    model.resize_token_embeddings(len(tok) + extra)
    with torch.no_grad():  # the padded rows as likely as common tokens (tied embeddings)
        weight = model.get_input_embeddings().weight
        weight[len(tok) :] = weight[A : A + extra]
    requests = group_requests([f"{i}+{i}=" for i in range(4)], range(4), 3, "pad", 0)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, max_turns=2, stop=["</answer>"])
    local = make_engine("hf", model, tok).rollout(requests, params, TOOLS, "Think.")
    assert (local.response_ids >= len(tok)).any()  # the case under test happens
    server = ModelServer(model, tok, "padded")
    with ServerThread(build_app(server)) as thread:
        engine = HTTPEngine(tok, thread.url)
        assert engine.vocab_size == len(tok) + extra  # reported by the server
        assert_same_batch(local, engine.rollout(requests, params, TOOLS, "Think."))
        factory = make_engine("http", model, tok, url=thread.url, sync_on_start=False)
        assert factory.vocab_size == len(tok) + extra  # from the policy itself
        strict = HTTPEngine(tok, thread.url, batched=False)  # another server: the tokenizer's
        with pytest.raises(TokenMismatchError, match="outside the client vocabulary"):
            strict.rollout(requests, params, TOOLS, "Think.")
        past = {"model": "padded", "prompt": [1, 2, len(tok) + extra], "max_tokens": 2}
        answer = httpx.post(thread.url + "/v1/completions", json=past)
        assert answer.status_code == 400 and f"{len(tok) + extra}" in answer.text
