"""Teachers: oracle scoring, the HF teacher, the HTTP teacher against a loopback fake server."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from anchor_fakes import EchoTask
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from anchor_rl.anchors.keys import fingerprint_tokenizer
from anchor_rl.anchors.store import TeacherTrajectory
from anchor_rl.anchors.teachers import (
    HFTeacher,
    OpenAITeacher,
    OracleTeacher,
    TokenizerMismatchError,
    make_teacher,
    teacher_batch,
    teacher_key,
)
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks import get_task
from anchor_rl.tasks.base import Record
from anchor_rl.tools.parsing import format_result


def manual_logprobs(
    model, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) at ``temperature``, one unpadded forward pass."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return (
        torch.log_softmax(logits.float() / temperature, -1)
        .gather(-1, torch.tensor(response)[:, None])
        .squeeze(-1)
    )


def other_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>")


# -- oracle ----------------------------------------------------------------------------


def test_oracle_trajectories_are_policy_tokens_written_with_probability_one(tokenizer):
    task = EchoTask(n=3, bad_trace=frozenset({"p1"}))
    recs = task.records("train")
    teacher = OracleTeacher(task, tokenizer)
    out = teacher.solve(recs)
    assert out[1] is None  # the verifier rejects p1's trace
    for i in (0, 2):
        t = out[i]
        expected = tokenizer.encode(task.trace(recs[i]), add_special_tokens=False)
        assert t.token_ids.tolist() == expected and t.token_ids.dtype == torch.long
        assert t.logprobs.shape == t.loss_mask.shape == (len(expected),)
        assert torch.equal(t.loss_mask, torch.ones(len(expected)))
        assert torch.equal(t.logprobs, torch.zeros(len(expected)))  # log pi_gt = log 1
        assert (t.text, t.reward, t.teacher, t.tries) == (task.trace(recs[i]), 1.0, "oracle", 1)
    key = teacher_key(teacher, "echo")
    assert key.tag == "teacher/oracle" and key.tokenizer == fingerprint_tokenizer(tokenizer)
    assert key.model == "oracle" and key.sampling == {"logprobs": "deterministic"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_scored_oracle_uses_the_rollout_temperature(tokenizer, tiny_model, temperature):
    task = EchoTask(n=2)
    recs = task.records("train")
    params = SamplingParams(temperature=temperature)
    teacher = make_teacher("oracle:reference", task, tokenizer, tiny_model, params,
                           load_model=None, tries=1)  # fmt: skip
    for rec, t in zip(recs, teacher.solve(recs), strict=True):
        prompt = encode_prompt(tokenizer, rec.prompt, task.instruction)
        ids = t.token_ids.tolist()
        expected = manual_logprobs(tiny_model, prompt, ids, temperature)
        torch.testing.assert_close(t.logprobs, expected, atol=1e-4, rtol=0)
        if temperature != 1.0:  # not the model's own distribution
            assert not torch.allclose(
                t.logprobs, manual_logprobs(tiny_model, prompt, ids), atol=1e-3
            )
    key = teacher_key(teacher, "echo")
    assert key.sampling["temperature"] == temperature and key.model.startswith("oracle:")
    other = make_teacher("oracle:reference", task, tokenizer, tiny_model,
                         SamplingParams(temperature=temperature + 0.1), load_model=None, tries=1)  # fmt: skip
    assert teacher_key(other, "echo").digest != key.digest  # settings are part of the key


def test_teacher_specs_are_checked(tokenizer, tiny_model, task):
    with pytest.raises(ValueError, match="unknown teacher 'gpt'"):
        make_teacher("gpt", task, tokenizer, None, SamplingParams(), load_model=None, tries=1)
    with pytest.raises(ValueError, match="needs the reference"):
        make_teacher("oracle:reference", task, tokenizer, None, SamplingParams(),
                     load_model=None, tries=1)  # fmt: skip
    with pytest.raises(ValueError, match="served model"):
        make_teacher("http:http://127.0.0.1:9/v1", task, tokenizer, None, SamplingParams(),
                     load_model=None, tries=1)  # fmt: skip


def test_an_http_teacher_is_seeded_by_the_spec_seed(tokenizer, task):
    """Its samples are reproducible, as an hf: teacher's are (the trainer passes its seed)."""
    teacher = make_teacher("http:http://127.0.0.1:9/v1", task, tokenizer, None, SamplingParams(),
                           load_model=None, tries=1, seed=7, teacher_model="m")  # fmt: skip
    assert isinstance(teacher, OpenAITeacher) and teacher.seed == 7


def test_oracle_masks_tool_results_of_a_multihop_trace(tokenizer, tiny_model):
    task = get_task("multihop")
    rec = task.records("train")[0]
    (t,) = OracleTeacher(task, tokenizer, tiny_model).solve([rec])  # scored by a model
    trace = task.trace(rec)
    assert trace.count("<result>") == 4 and t.text == trace
    expected_ids, expected_mask = [], []
    for piece in re.split(r"(<result>.*?</result>)", trace):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        expected_ids += ids
        expected_mask += [0.0 if piece.startswith("<result>") else 1.0] * len(ids)
    assert t.token_ids.tolist() == expected_ids and t.loss_mask.tolist() == expected_mask
    assert (t.logprobs[t.loss_mask == 0] == 0).all() and (t.logprobs[t.loss_mask == 1] < 0).all()
    prompt = encode_prompt(tokenizer, rec.prompt, task.instruction)
    full = manual_logprobs(tiny_model, prompt, expected_ids) * t.loss_mask
    torch.testing.assert_close(t.logprobs, full, atol=1e-4, rtol=0)
    batch = teacher_batch([t], [prompt], [0], tokenizer.pad_token_id)
    assert batch.tool_calls.tolist() == [4] and batch.lengths.tolist() == [int(t.loss_mask.sum())]


def test_scorer_with_another_vocabulary_is_refused(tokenizer, tiny_model, task):
    with pytest.raises(
        TokenizerMismatchError,
        match=r"scoring tokenizer .*4 tokens.* policy tokenizer .*111 tokens",
    ):
        OracleTeacher(task, tokenizer, tiny_model, scorer_tokenizer=other_tokenizer())


def test_teacher_batch_pads_and_counts_tool_blocks():
    t1 = TeacherTrajectory(
        "a",
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([-1.0, 0.0, 0.0, -2.0]),
        torch.tensor([1.0, 0, 0, 1]),
        "x",
        1.0,
        "oracle",
    )
    t2 = TeacherTrajectory(
        "b", torch.tensor([9, 9]), torch.tensor([-0.5, -0.5]), torch.ones(2), "y", 0.5, "oracle"
    )
    b = teacher_batch([t1, t2], [[1, 2], [3]], [0, 1], pad_id=0)
    assert b.response_ids.tolist() == [[5, 6, 7, 8], [9, 9, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert b.logprobs.tolist() == [[-1.0, 0.0, 0.0, -2.0], [-0.5, -0.5, 0.0, 0.0]]
    assert b.tool_calls.tolist() == [1, 0] and b.group.tolist() == [0, 1] and b.texts == ["x", "y"]
    assert b.prompt_ids == [[1, 2], [3]] and not b.truncated.any()


# -- HF teacher ------------------------------------------------------------------------


class ParityTask(EchoTask):
    """Correct iff the completion has an even number of characters (about half of random samples)."""

    def reward(self, completion: str, record: Record) -> float:
        return float(len(completion) > 0 and len(completion) % 2 == 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_teacher_keeps_a_verified_sample_with_its_sampling_logprobs(
    tokenizer, tiny_model, temperature
):
    task = ParityTask(n=4)
    recs = task.records("train")
    params = SamplingParams(max_new_tokens=5, temperature=temperature)
    teacher = HFTeacher(tiny_model, tokenizer, task, tokenizer, params, tries=6, per_round=2)
    out = teacher.solve(recs)
    solved = [t for t in out if t is not None]
    assert solved, "with 6 tries at ~1/2 each, some prompt must be solved"
    for rec, t in zip(recs, out, strict=True):
        if t is None:
            continue
        assert t.prompt_id == rec.id and task.correct(t.text, rec) and 1 <= t.tries <= 6
        assert tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=True) == t.text
        prompt = encode_prompt(tokenizer, rec.prompt, task.instruction)
        ids = t.token_ids.tolist()
        # pi_gt of the distribution the teacher sampled from: its own at that temperature
        expected = manual_logprobs(tiny_model, prompt, ids, temperature)
        torch.testing.assert_close(t.logprobs, expected, atol=1e-4, rtol=0)
    key = teacher_key(teacher, "parity")
    assert key.model.startswith("hf:") and key.sampling["sampling"]["temperature"] == temperature


def test_hf_teacher_skips_an_empty_answer_a_lenient_verifier_accepts(tokenizer, tiny_model):
    """An empty response cannot be a trajectory (nothing to train on): the teacher tries on,
    as the HTTP teacher does, instead of failing the whole filter."""
    task = ParityTask(n=2)
    task.correct = lambda text, record: True  # accepts anything, the empty answer too
    params = SamplingParams(max_new_tokens=3)
    teacher = HFTeacher(tiny_model, tokenizer, task, tokenizer, params, tries=4, per_round=2)
    sample = teacher.engine.rollout

    def first_empty(*args, **kwargs):
        batch = sample(*args, **kwargs)
        batch.attention_mask[0] = 0  # the first try of the first prompt: no token
        batch.loss_mask[0] = 0
        return batch

    teacher.engine.rollout = first_empty
    out = teacher.solve(task.records("train"))
    assert [t.tries for t in out] == [2, 1]  # its second try, the other prompt's first


def test_hf_teacher_with_another_vocabulary_is_refused(tokenizer, tiny_model, task):
    with pytest.raises(TokenizerMismatchError, match="teacher tokenizer .* policy tokenizer"):
        HFTeacher(tiny_model, other_tokenizer(), task, tokenizer, SamplingParams())


# -- HTTP teacher ----------------------------------------------------------------------


class FakeCompletions(BaseHTTPRequestHandler):
    """An OpenAI-style /v1/completions endpoint that answers ``say wK`` prompts.

    The first request per word answers wrongly, later ones rightly. ``server.mode`` picks
    the token format: ``chars`` (the policy's tokens as strings), ``ids`` (``token_id:N``),
    ``pairs`` (two characters per token: another tokenizer), ``trimmed`` (stop string
    missing from the tokens). With ``server.tool``, answers search first.
    """

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.requests.append(body)
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        prompt = body["prompt"]  # the client sends token ids
        prompt = server.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        word = re.search(r"say (\w+)", prompt).group(1)
        if server.tool and "<result>" not in prompt:
            text = f"<search>{word}</search>"
        else:
            server.seen[word] += 1
            text = f"<think>ok</think><answer>{word if server.seen[word] > 1 else 'wrong'}</answer>"
        ids = server.tokenizer.encode(text, add_special_tokens=False)
        if server.mode == "ids":
            tokens = [f"token_id:{i}" for i in ids]
        elif server.mode == "pairs":
            tokens = [text[i : i + 2] for i in range(0, len(text), 2)]
        else:
            tokens = [server.tokenizer.decode([i]) for i in ids]
            if server.mode == "trimmed":
                tokens = tokens[:-1]
        payload = {
            "choices": [
                {
                    "text": text,
                    "finish_reason": "stop",
                    "logprobs": {
                        "tokens": tokens,
                        "token_logprobs": [-0.01 * (k + 1) for k in range(len(tokens))],
                    },
                }
            ]
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server(tokenizer):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    server.tokenizer, server.mode, server.tool = tokenizer, "chars", False
    server.requests, server.seen = [], Counter()
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def http_teacher(server, task, tokenizer, **kwargs):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    return OpenAITeacher(
        url,
        "big-teacher",
        task,
        tokenizer,
        SamplingParams(max_new_tokens=64),
        timeout=5.0,
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["chars", "ids"])
def test_http_teacher_returns_policy_tokens_with_server_logprobs(
    fake_server, tokenizer, task, mode
):
    fake_server.mode = mode
    recs = task.records("train")[:3]
    out = http_teacher(fake_server, task, tokenizer, tries=2).solve(recs)
    for rec, t in zip(recs, out, strict=True):
        text = f"<think>ok</think><answer>{rec.answer}</answer>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert t.text == text and t.token_ids.tolist() == ids and t.tries == 2
        assert t.teacher == "http:big-teacher"
        torch.testing.assert_close(
            t.logprobs, torch.tensor([-0.01 * (k + 1) for k in range(len(ids))])
        )
        assert torch.equal(t.loss_mask, torch.ones(len(ids)))
    body = fake_server.requests[0]
    assert body["model"] == "big-teacher" and body["logprobs"] == 1 and body["max_tokens"] == 64
    assert "</answer>" in body["stop"] and body["include_stop_str_in_output"] is True
    prompt_ids = encode_prompt(tokenizer, "say w0", task.instruction)
    assert any(b["prompt"] == prompt_ids for b in fake_server.requests)  # the policy's own ids
    assert len(fake_server.requests) == 6  # a wrong and a right answer per prompt


def test_http_teacher_gives_up_after_its_tries(fake_server, tokenizer, task):
    (out,) = http_teacher(fake_server, task, tokenizer, tries=1).solve(task.records("train")[:1])
    assert out is None and len(fake_server.requests) == 1


def test_http_teacher_refuses_a_foreign_tokenisation(fake_server, tokenizer, task):
    fake_server.mode = "pairs"
    with pytest.raises(
        TokenizerMismatchError,
        match=r"big-teacher.*policy tokenizer .*111 tokens.*first difference at token 0",
    ):
        http_teacher(fake_server, task, tokenizer).solve(task.records("train")[:1])


def test_http_teacher_refuses_tokens_that_do_not_spell_the_text(fake_server, tokenizer, task):
    fake_server.mode = "trimmed"
    with pytest.raises(RuntimeError, match="include_stop_str_in_output"):
        http_teacher(fake_server, task, tokenizer).solve(task.records("train")[:1])


def test_http_teacher_unreachable_endpoint_is_a_clear_error(tokenizer, task):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    teacher = OpenAITeacher(
        f"http://127.0.0.1:{port}/v1", "m", task, tokenizer, SamplingParams(), timeout=2.0,
        retries=1,
    )  # fmt: skip
    with pytest.raises(ConnectionError, match="cannot reach the teacher endpoint.*2 attempts"):
        teacher.solve(task.records("train")[:1])


class SearchEchoTask(EchoTask):
    def __init__(self) -> None:
        super().__init__(n=2)
        self.tools = {"search": lambda query: f"found {query}"}


def test_http_teacher_runs_tools_between_turns_with_masked_results(fake_server, tokenizer):
    fake_server.tool = True
    task = SearchEchoTask()
    (t,) = http_teacher(fake_server, task, tokenizer, tries=2).solve(task.records("train")[:1])
    call, result = "<search>w0</search>", format_result("found w0")
    answer = "<think>ok</think><answer>w0</answer>"
    n_call, n_result = (len(tokenizer.encode(s, add_special_tokens=False)) for s in (call, result))
    assert t.text == tokenizer.decode(
        tokenizer.encode(call + result + answer, add_special_tokens=False), skip_special_tokens=True
    )
    expected_mask = (
        [1.0] * n_call
        + [0.0] * n_result
        + [1.0] * len(tokenizer.encode(answer, add_special_tokens=False))
    )
    assert t.loss_mask.tolist() == expected_mask
    assert (t.logprobs[t.loss_mask == 0] == 0).all()
    assert "</search>" in fake_server.requests[0]["stop"]
    assert tokenizer.decode(fake_server.requests[1]["prompt"]).endswith(call + result)
