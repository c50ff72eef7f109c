"""`anchor-rl serve`'s HTTP API on loopback: the endpoints, the OpenAI fields, the seed
extension (the in-process engine's tokens), batching of concurrent requests, malformed
requests, clients that go away, and weight reloads."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import load_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.engine import Request, make_engine, request_seed
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.serve.app import ServerThread, build_app
from anchor_rl.serve.model import ModelServer

HI = [{"role": "user", "content": "hi"}]
"""A one-message chat."""


def post(url: str, path: str, body, timeout: float = 30.0) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def test_health_models_and_tokenizer_describe_the_served_model(served, tiny_dir) -> None:
    thread, server = served
    health = httpx.get(thread.url + "/health").json()
    assert health == {"status": "ok", "model": "tiny", "revision": server.revision}
    (card,) = httpx.get(thread.url + "/v1/models").json()["data"]
    from anchor_rl.anchors.keys import fingerprint_model, fingerprint_tokenizer

    model, tokenizer = load_policy(tiny_dir)
    assert card["id"] == "tiny" and card["max_model_len"] == 1024
    ext = card["anchor_rl"]
    assert ext["fingerprint"] == fingerprint_model(model)  # a content hash, as presample keys use
    assert ext["tokenizer_fingerprint"] == fingerprint_tokenizer(tokenizer)
    assert ext["max_batch"] == 256
    files = httpx.get(thread.url + "/v1/tokenizer").json()["files"]
    assert "tokenizer.json" in files


def test_models_answers_from_the_known_fingerprint_without_queueing(served, monkeypatch) -> None:
    """Once the weights are hashed, ``GET /v1/models`` does not wait for the model thread
    (which may be busy with a long batch)."""
    thread, server = served
    first = httpx.get(thread.url + "/v1/models").json()["data"][0]["anchor_rl"]
    assert server.known_fingerprint() == (first["revision"], first["fingerprint"])

    async def queued(*args):
        raise AssertionError("GET /v1/models queued work on the model thread")

    monkeypatch.setattr(thread.server.config.app.state.batcher, "call", queued)
    answer = httpx.get(thread.url + "/v1/models")
    assert answer.status_code == 200 and answer.json()["data"][0]["anchor_rl"] == first


def test_completions_follow_the_openai_shape_and_seed_each_choice(served) -> None:
    url = served[0].url
    body = {
        "model": "tiny",
        "prompt": ["ab", "cd"],
        "n": 2,
        "max_tokens": 6,
        "seed": 7,
        "logprobs": 1,
    }
    answer = post(url, "/v1/completions", body).json()
    assert answer["object"] == "text_completion" and answer["model"] == "tiny"
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt-major: i * n + j
    assert [c["seed"] for c in choices] == [request_seed(7, c) for c in range(4)]
    tok = build_tokenizer()
    for c in choices:
        assert 1 <= len(c["token_ids"]) <= 6 and c["finish_reason"] in ("stop", "length")
        assert c["logprobs"]["tokens"] == [tok.decode([i]) for i in c["token_ids"]]
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
    assert answer["usage"]["prompt_tokens"] == 4
    again = post(url, "/v1/completions", body).json()["choices"]
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in choices]  # seeded


def test_the_seed_extension_reproduces_the_in_process_engine(served, tiny_dir) -> None:
    """`seeds` (raw, one per choice) and token-id prompts give the hf engine's tokens and
    log-probs; `counters` continues a response mid-way with the same draws."""
    url = served[0].url
    model, tok = load_policy(tiny_dir)
    requests = [Request(f"{i}+{i}=", request_seed("t", i), i) for i in range(6)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, stop=["</answer>"])
    batch = make_engine("hf", model, tok).rollout(requests, params)
    body = {
        "prompt": batch.prompt_ids,
        "max_tokens": 12,
        "temperature": 0.8,
        "top_p": 0.9,
        "stop": ["</answer>"],
        "seeds": [r.seed for r in requests],
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "include_stop_str_in_output": True,
    }
    choices = post(url, "/v1/completions", body).json()["choices"]
    for row, c in enumerate(choices):
        n = int(batch.attention_mask[row].sum())
        assert c["token_ids"] == batch.response_ids[row, :n].tolist()
        assert c["logprobs"]["tokens"] == [f"token_id:{i}" for i in c["token_ids"]]
        torch.testing.assert_close(
            torch.tensor(c["logprobs"]["token_logprobs"]),
            batch.logprobs[row, :n],
            atol=1e-6,
            rtol=0,
        )
        assert c["text"] == batch.texts[row]
    # continue row 0 after its first 3 tokens: the counters say where the draws resume
    first = choices[0]["token_ids"]
    if len(first) > 3:
        rest = post(url, "/v1/completions", {
            **body, "prompt": [batch.prompt_ids[0] + first[:3]], "seeds": [requests[0].seed],
            "counters": [3], "max_tokens": 9,
        }).json()["choices"][0]  # fmt: skip
        assert rest["token_ids"] == first[3:]


def test_stop_strings_are_cut_from_the_text_unless_asked_to_keep_them(served) -> None:
    url = served[0].url
    tok = build_tokenizer()
    answer = tok.convert_tokens_to_ids("</answer>")
    # find a seed whose sample stops on </answer>
    body = {"prompt": "x", "max_tokens": 100, "stop": "</answer>", "temperature": 1.0}
    seeds = list(range(24))
    choices = post(url, "/v1/completions", {**body, "prompt": ["x"] * 24, "seeds": seeds}).json()
    hit = next(i for i, c in enumerate(choices["choices"]) if c["stop_reason"] == "</answer>")
    kept = post(
        url, "/v1/completions", {**body, "seeds": [hit], "include_stop_str_in_output": True}
    ).json()
    cut = post(url, "/v1/completions", {**body, "seeds": [hit]}).json()
    kept, cut = kept["choices"][0], cut["choices"][0]
    assert kept["token_ids"] == cut["token_ids"] and kept["token_ids"][-1] == answer
    assert kept["text"].endswith("</answer>") and kept["text"] == cut["text"] + "</answer>"
    assert cut["finish_reason"] == "stop"


def test_edge_values_of_the_sampling_fields_sample_sensibly(served) -> None:
    """A temperature too small to divide by samples greedily (and its log-probs are finite
    JSON); a counter at the top of its 64-bit range wraps instead of failing the batch; a
    single integer `seeds` is fine for a single choice."""
    url = served[0].url
    body = {"prompt": "q", "max_tokens": 6, "logprobs": 0}
    greedy = post(url, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]
    tiny = post(url, "/v1/completions", {**body, "temperature": 1e-40}).json()["choices"][0]
    assert tiny["token_ids"] == greedy["token_ids"]
    top = post(url, "/v1/completions", {**body, "seeds": 5, "counters": [2**64 - 1]})
    assert top.status_code == 200 and len(top.json()["choices"][0]["token_ids"]) >= 1


def test_the_stop_cut_is_where_the_sampler_stopped_not_an_earlier_spelling() -> None:
    """With special tokens skipped, the text around one joins up ("_" <unk> "P" reads "_P");
    the cut must still be at the stop the last tokens completed."""
    from anchor_rl.serve.responses import _cut_at_stop

    tok = build_tokenizer()
    ids = tok.encode("v_", add_special_tokens=False) + [tok.unk_token_id]
    ids += tok.encode("Pexyz_P", add_special_tokens=False)
    assert "_P" in tok.decode(ids[:-1], skip_special_tokens=True)  # the spurious spelling
    assert _cut_at_stop(tok, ids, "_P", skip=True) == "v_Pexyz"
    assert _cut_at_stop(tok, ids, "_P", skip=False) == f"v_{tok.unk_token}Pexyz"


def test_jobs_batch_together_only_with_their_stops_in_the_same_order() -> None:
    from anchor_rl.serve.protocol import Job

    def job(stop: tuple[str, ...]) -> Job:
        return Job([[5]], [4], [1], [0], 1.0, 1.0, stop)

    assert job(("a", "b")).key == job(("a", "b")).key
    assert job(("a", "b")).key != job(("b", "a")).key  # where both match, the first wins


def test_chat_completions_render_the_chat_template(served, tiny_dir) -> None:
    url = served[0].url
    _, tok = load_policy(tiny_dir)
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 5, "seeds": [3], "logprobs": True}
    chat = post(url, "/v1/chat/completions", body).json()
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    plain = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 5, "seeds": [3]}).json()
    (c,) = chat["choices"]
    assert chat["object"] == "chat.completion" and c["message"]["role"] == "assistant"
    assert c["token_ids"] == plain["choices"][0]["token_ids"]
    assert [e["token"] for e in c["logprobs"]["content"]] == [
        tok.decode([i]) for i in c["token_ids"]
    ]


def test_chat_fields_render_the_prompt_as_vllm_does(served, monkeypatch) -> None:
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``
    reach the template (ignoring them would sample from another prompt)."""
    from anchor_rl.serve.protocol import parse_chat

    server = served[1]
    tok = server.tokenizer
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

    def prompt(**fields) -> str:
        return tok.decode(parse_chat({"messages": talk, **fields}, server).prompts[0])

    assert prompt() == "<|user|>hi<|end|><|assistant|>ok<|end|><|assistant|>"
    assert prompt(add_generation_prompt=False) == "<|user|>hi<|end|><|assistant|>ok<|end|>"
    assert prompt(continue_final_message=True) == "<|user|>hi<|end|><|assistant|>ok"
    monkeypatch.setattr(tok, "chat_template", "{{ greeting }}" + tok.chat_template)
    assert prompt(chat_template_kwargs={"greeting": "12"}).startswith("12<|user|>hi")


@pytest.mark.parametrize(
    ("template", "messages", "fields", "message"),
    [
        (
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
            HI,
            {},
            "Conversation roles must alternate user/assistant",
        ),
        (  # transformers' ValueError: the template drops the system message it should continue
            None,
            [*HI, {"role": "system", "content": "zz"}],
            {"continue_final_message": True},
            "final message does not appear",
        ),
    ],
)
def test_a_chat_template_refusal_is_a_400_naming_messages(
    served, monkeypatch, template, messages, fields, message
) -> None:
    """A 400, not a 500 that HTTP clients retry: the same messages fail the same way again."""
    if template is not None:
        monkeypatch.setattr(served[1].tokenizer, "chat_template", template)
    body = {"messages": messages, "max_tokens": 2, **fields}
    answer = post(served[0].url, "/v1/chat/completions", body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages" and message in error["message"]


def test_a_hundred_concurrent_requests_complete_in_shared_batches(served) -> None:
    thread, server = served
    batches, rows = server.batches, server.rows

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=thread.url, timeout=60) as client:
            return await asyncio.gather(*(
                client.post("/v1/completions", json={
                    "prompt": f"q{i}", "max_tokens": 8, "seeds": [1000 + i],
                    "return_tokens_as_token_ids": True, "logprobs": 1,
                })
                for i in range(100)
            ))  # fmt: skip

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 100
    assert server.rows - rows == 100
    assert server.batches - batches < 50  # merged: the batcher waits a few ms for company
    for i in (0, 37, 99):  # each kept its own seed: alone it samples the same tokens
        alone = post(
            thread.url, "/v1/completions", {"prompt": f"q{i}", "max_tokens": 8, "seeds": [1000 + i]}
        )
        assert (
            alone.json()["choices"][0]["token_ids"] == answers[i].json()["choices"][0]["token_ids"]
        )


MALFORMED = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", [1, 2], 400, "JSON object"),
    ("/v1/completions", {"max_tokens": 3}, 400, "`prompt` is required"),
    ("/v1/completions", {"prompt": []}, 400, "empty list"),
    ("/v1/completions", {"prompt": ""}, 400, "empty prompt"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "token id 999"),
    ("/v1/completions", {"prompt": ["a", 3]}, 400, "mixes"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "`n` must be >= 1"),
    ("/v1/completions", {"prompt": "a", "n": "two"}, 400, "`n` must be an integer"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, 400, "exceeds the model's 1024"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "empty string"),
    ("/v1/completions", {"prompt": "a", "n": 2, "seeds": [1]}, 400, "list of 2 integers"),
    ("/v1/completions", {"prompt": "a", "seeds": [-1]}, 400, "`seeds` values"),
    ("/v1/completions", {"prompt": "a", "stream": True}, 400, "`stream` is not supported"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 1}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "n": 5000}, 400, "more than 4096"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "finite number"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e400}', 400, "finite number"),
    ("/v1/completions", {"prompt": "a", "n": 3, "seeds": 7}, 400, "the same draws"),
    ("/v1/completions", {"prompt": "a", "counters": [2**70]}, 400, "`counters` values"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [34]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": True}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "a", "guided_json": {}}, 400, "guided_json"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [5]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["b"]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 1}, 400, "truncate_prompt"),
    ("/v1/completions", {"prompt": "a", "logits_processors": ["x"]}, 400, "logits_processors"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "serves 'tiny'"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "`messages`"),
    ("/v1/chat/completions", {"messages": HI, "chat_template": "{{ 1 }}"}, 400, "`chat_template`"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": "x"}, 400, "an object"),
    (
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": {"tokenize": True}},
        400,
        "may not set ['tokenize']",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
        400,
        "cannot both be true",
    ),
    ("/v1/chat/completions", {"messages": HI, "add_special_tokens": "no"}, 400, "true or false"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a" * 1100}]},  # no max_tokens: the rest
        400,
        "the prompt's 1103 tokens leave no room in the model's 1024 positions",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("/v1/weights", {}, 400, "path"),
    ("/v1/weights", {"path": "/nonexistent/weights.safetensors"}, 400, "no such file"),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), MALFORMED)
def test_a_malformed_request_gets_a_4xx_json_error(served, path, body, status, message) -> None:
    url = served[0].url
    answer = post(url, path, body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert httpx.get(url + "/health").status_code == 200


def test_a_wrong_method_gets_405(served) -> None:
    answer = httpx.get(served[0].url + "/v1/completions")
    assert answer.status_code == 405 and "Method Not Allowed" in answer.json()["error"]["message"]


def _send_and_hang_up(port: int, body: dict, after: float) -> None:
    """POST ``body`` on a raw socket and close it after ``after`` seconds, before the answer."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + data)
        time.sleep(after)


def test_clients_that_hang_up_leave_the_server_healthy(served) -> None:
    thread, server = served
    rows = server.rows
    long = {"prompt": "a", "max_tokens": 300, "n": 2, "temperature": 0}  # greedy: runs to the end
    _send_and_hang_up(thread.port, long, after=0.1)  # mid-generation
    # a request queued behind the long one whose client goes away is dropped unsampled
    _send_and_hang_up(thread.port, {"prompt": "b", "max_tokens": 5, "n": 7}, after=0.05)
    assert httpx.get(thread.url + "/health", timeout=5).status_code == 200  # the loop is free
    ok = post(thread.url, "/v1/completions", {"prompt": "c", "max_tokens": 4, "seeds": [1]})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    assert server.rows - rows == 2 + 1  # the long request's rows and the last one's


def test_weights_reload_from_a_safetensors_file_or_a_model_directory(
    tiny_dir, tmp_path, one_thread
) -> None:
    model, tokenizer = load_policy(tiny_dir)
    server = ModelServer(model, tokenizer, "tiny")
    other = build_model("tiny", build_tokenizer(), seed=1)
    with ServerThread(build_app(server)) as thread:
        body = {"prompt": "ab", "max_tokens": 8, "seeds": [5], "logprobs": 1}
        before = post(thread.url, "/v1/completions", body).json()["choices"][0]
        fingerprint = httpx.get(thread.url + "/v1/models").json()["data"][0]["anchor_rl"][
            "fingerprint"
        ]
        path = tmp_path / "other.safetensors"
        save_file({k: v.clone().contiguous() for k, v in other.state_dict().items()}, str(path))
        loaded = post(thread.url, "/v1/weights", {"path": str(path)}).json()
        assert (
            loaded["revision"]
            == server.revision
            == httpx.get(thread.url + "/health").json()["revision"]
        )
        assert httpx.get(thread.url + "/v1/weights").json() == {
            "revision": server.revision,
            "path": str(path),
        }
        after = post(thread.url, "/v1/completions", body).json()["choices"][0]
        assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
        card = httpx.get(thread.url + "/v1/models").json()["data"][0]["anchor_rl"]
        assert card["fingerprint"] != fingerprint
        # the original directory (tied lm_head left out of the file) brings the first weights back
        assert post(thread.url, "/v1/weights", {"path": str(tiny_dir)}).status_code == 200
        again = post(thread.url, "/v1/completions", body).json()["choices"][0]
        assert again["token_ids"] == before["token_ids"]
        # weights of another architecture are refused, and the served ones stay
        small = build_model("small", build_tokenizer(), seed=0)
        bad = tmp_path / "small.safetensors"
        save_file({k: v.clone().contiguous() for k, v in small.state_dict().items()}, str(bad))
        refused = post(thread.url, "/v1/weights", {"path": str(bad)})
        assert refused.status_code == 400 and "tensors" in refused.json()["error"]["message"]
        text = tmp_path / "weights.txt"
        text.write_text("x")
        refused = post(thread.url, "/v1/weights", {"path": str(text)})
        assert refused.status_code == 400 and ".safetensors" in refused.json()["error"]["message"]
        assert (
            post(thread.url, "/v1/completions", body).json()["choices"][0]["token_ids"]
            == before["token_ids"]
        )


def test_an_answer_names_the_weights_that_sampled_it_even_after_a_reload(
    tiny_dir, tmp_path, one_thread
) -> None:
    """``system_fingerprint`` is the revision stamped on the job when its batch ran, not the
    server's revision when the answer is written (a reload may land in between)."""
    from anchor_rl.serve.protocol import parse_completion
    from anchor_rl.serve.responses import completion_body

    model, tokenizer = load_policy(tiny_dir)
    server = ModelServer(model, tokenizer, "tiny")
    parsed = parse_completion({"prompt": "ab", "max_tokens": 3, "seed": 4}, server)
    job = parsed.job()
    (turns,) = server.generate([job])
    sampled_by = server.revision
    assert job.revision == sampled_by
    path = tmp_path / "same.safetensors"
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    server.reload(str(path))  # what a POST /v1/weights between the batch and the answer does
    assert server.revision != sampled_by
    assert completion_body(server, parsed, turns, job.revision)["system_fingerprint"] == sampled_by


def test_weights_with_nan_are_refused_naming_the_tensor(served, tmp_path) -> None:
    thread, server = served
    state = {k: v.clone().contiguous() for k, v in server.model.state_dict().items()}
    name = next(k for k in state if k.endswith("weight") and state[k].dim() == 2)
    state[name][0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path))
    revision = server.revision
    refused = post(thread.url, "/v1/weights", {"path": str(path)})
    assert (
        refused.status_code == 400
        and f"NaN or infinite values in tensor {name!r}" in (refused.json()["error"]["message"])
    )
    assert server.revision == revision


def test_non_finite_logprobs_are_null_in_the_json_answer(served) -> None:
    """Not a 500 from the JSON encoder (which HTTP clients would retry)."""
    from anchor_rl.rollout.sampling import Turn
    from anchor_rl.serve.protocol import parse_chat, parse_completion
    from anchor_rl.serve.responses import chat_body, completion_body

    server = served[1]
    turn = Turn(tokens=[88, 89], logprobs=[float("nan"), float("-inf")], stop=None)
    plain = parse_completion({"prompt": "ab", "max_tokens": 2, "logprobs": 1, "seed": 1}, server)
    chat = parse_chat({"messages": HI, "max_tokens": 2, "logprobs": True, "seed": 1}, server)
    text = json.dumps(completion_body(server, plain, [turn]), allow_nan=False)
    assert json.loads(text)["choices"][0]["logprobs"]["token_logprobs"] == [None, None]
    content = json.loads(json.dumps(chat_body(server, chat, [turn]), allow_nan=False))
    assert [e["logprob"] for e in content["choices"][0]["logprobs"]["content"]] == [None, None]


def byte_level_tokenizer():
    """A byte-level BPE tokenizer trained here: characters it never saw take one token per
    UTF-8 byte, and a byte alone decodes to a replacement character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    raw.train_from_iterator(["hello world", "the cafe is open", "a naive test"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw)


@pytest.mark.parametrize("which", ["built-in", "byte-level"])
def test_text_offsets_are_where_each_token_starts_in_the_text(which) -> None:
    from anchor_rl.serve.responses import text_offsets

    tok = build_tokenizer() if which == "built-in" else byte_level_tokenizer()
    text = "hello café — the € test, naïve world" if which == "byte-level" else "12+7=19 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    offsets = text_offsets(tok, ids, skip_special=True, length=len(text))
    assert len(offsets) == len(ids) and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for k in range(len(ids)):
        prefix = tok.decode(ids[:k])
        if "\ufffd" not in prefix:  # k falls between whole characters
            assert offsets[k] == len(prefix), (k, prefix)
    pieces = [len(tok.decode([i])) for i in ids]
    if which == "byte-level":  # decoding each token alone would have drifted off the text
        assert sum(pieces) != len(text)
    # a stop string cut off the text: the tokens after the cut start at its end
    assert text_offsets(tok, ids, skip_special=True, length=3)[-1] == 3
