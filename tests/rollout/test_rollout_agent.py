"""The agent loop with scripted policies and fake tools: masks, errors, turn and length bounds."""

from __future__ import annotations

import torch
from helpers import requests

from anchor_rl.models.tokenizer import encode_completion
from anchor_rl.rollout.agent import tool_result
from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.parsing import format_result


class Lookup:
    name = "search"

    def __call__(self, query: str) -> str:
        return f"doc:{query}"


class Broken:
    name = "search"

    def __call__(self, query: str) -> str:
        raise RuntimeError("index offline")


def rollout(model, tokenizer, prompts, tools, **params):
    params = {"max_new_tokens": 200, "stop": ["</answer>"], **params}
    return HFEngine(model, tokenizer).rollout(
        requests(prompts), SamplingParams(**params), tools=tools
    )


def test_tool_result_is_appended_attended_and_masked(tokenizer, scripted):
    model = scripted({"q": "<search>abc</search><answer>doc:abc</answer>"})
    b = rollout(model, tokenizer, ["q"], {"search": Lookup()})
    result = format_result("doc:abc")
    assert b.texts == [f"<search>abc</search>{result}<answer>doc:abc</answer>"]
    assert b.tool_calls.tolist() == [1] and b.truncated.tolist() == [False]
    n_call = len(tokenizer.encode("<search>abc</search>"))
    n_result = len(tokenizer.encode(result))
    n_answer = len(tokenizer.encode("<answer>doc:abc</answer>"))
    expected_loss = [1.0] * n_call + [0.0] * n_result + [1.0] * n_answer
    assert b.loss_mask[0].tolist() == expected_loss
    assert b.attention_mask[0].tolist() == [1.0] * len(expected_loss)
    assert (b.logprobs[0, n_call : n_call + n_result] == 0).all()
    assert b.response_ids[0, n_call : n_call + n_result].tolist() == tokenizer.encode(result)


def test_malformed_call_and_tool_error_become_result_text(tokenizer, scripted):
    model = scripted(
        {"bad": "abc</search><answer>x</answer>", "boom": "<search>q</search><answer>y</answer>"}
    )
    bad = rollout(model, tokenizer, ["bad"], {"search": Lookup()})
    opening = format_result("\x00").split("\x00")[0]
    assert bad.texts[0].startswith("abc</search>" + opening + "error: malformed tool call")
    assert bad.texts[0].endswith("<answer>x</answer>")
    boom = rollout(model, tokenizer, ["boom"], {"search": Broken()})
    assert format_result("error: RuntimeError: index offline") in boom.texts[0]
    assert boom.tool_calls.tolist() == [1]


def test_max_turns_bounds_tool_calls(tokenizer, scripted):
    model = scripted(
        {"loop": "".join(f"<search>q{i}</search>" for i in range(6)) + "<answer>z</answer>"}
    )
    b = rollout(model, tokenizer, ["loop"], {"search": Lookup()}, max_turns=2)
    assert b.tool_calls.tolist() == [2]
    assert b.texts[0].endswith("<search>q2</search>")  # the third call ends the response unanswered
    assert b.truncated.tolist() == [False]


def test_budget_cuts_a_result_and_marks_truncated(tokenizer, scripted):
    model = scripted({"q": "<search>abcdef</search><answer>1</answer>"})
    call = len(tokenizer.encode("<search>abcdef</search>"))
    b = rollout(model, tokenizer, ["q"], {"search": Lookup()}, max_new_tokens=call + 4)
    assert b.truncated.tolist() == [True]
    assert b.attention_mask.sum().item() == call + 4
    assert b.loss_mask.sum().item() == call
    assert b.response_ids[0, call:].tolist() == tokenizer.encode(format_result("doc:abcdef"))[:4]


def test_rows_finishing_early_do_not_block_tool_rows(tokenizer, scripted):
    model = scripted(
        {
            "direct": "<answer>7</answer>",
            "one": "<search>a</search><answer>doc:a</answer>",
            "two": "<search>a</search><search>b</search><answer>doc:b</answer>",
        }
    )
    b = rollout(model, tokenizer, ["direct", "one", "two"], {"search": Lookup()})
    assert b.tool_calls.tolist() == [0, 1, 2]
    assert b.texts[0] == "<answer>7</answer>"
    assert b.texts[2].endswith("<answer>doc:b</answer>")
    # turn 1: all rows; turn 2: the two rows that called a tool; turn 3: only "two"
    assert model.prefill_rows == [3, 2, 1]


def test_tool_result_helper_never_raises():
    opening = format_result("\x00").split("\x00")[0]
    assert tool_result("no call here", {"search": Broken()}).startswith(
        opening + "error: malformed"
    )
    assert tool_result("<search>x</search>", {"search": Lookup()}) == format_result("doc:x")


def test_encode_completion_masks_result_blocks(tokenizer):
    text = "<search>a</search>" + format_result("doc") + "<answer>b</answer>"
    ids, policy = encode_completion(tokenizer, text)
    assert tokenizer.decode(ids) == text
    n_call, n_res = (
        len(tokenizer.encode("<search>a</search>")),
        len(tokenizer.encode(format_result("doc"))),
    )
    assert policy == [True] * n_call + [False] * n_res + [True] * len(
        tokenizer.encode("<answer>b</answer>")
    )
    assert torch.tensor(policy).sum().item() == len(ids) - n_res
