"""The agent loop: generate, run the tool the policy called, append its result, repeat.

Rows advance turn by turn together: each turn generates for every row still active in
one batch; rows that answered, ran out of budget or hit ``max_turns`` drop out, so they
never hold the others back. Tool output tokens are attended to but carry no loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.rollout.decoders import DecodeMode
from anchor_rl.rollout.sampling import StopSet, eos_ids, generate_turn
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool
from anchor_rl.tools.parsing import format_result, parse_tool_call


@dataclass
class Response:
    """One response being built: tokens with per-token log-prob and policy flag."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    tool_calls: int = 0
    truncated: bool = False
    done: bool = False

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Append policy tokens (with their log-probs) or, without log-probs, tool tokens."""
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.policy.extend([logprobs is not None] * len(tokens))

    def add_tool_result(
        self,
        turn: Sequence[int],
        tokenizer: PreTrainedTokenizerBase,
        tools: Mapping[str, Tool],
        max_new_tokens: int,
    ) -> None:
        """Run the tool call that ends the policy tokens ``turn`` and append its result as
        tool tokens, cut at ``max_new_tokens`` in all (then the response is truncated, done)."""
        result = tokenizer.encode(
            tool_result(tokenizer.decode(turn), tools), add_special_tokens=False
        )
        room = max_new_tokens - len(self.tokens)
        self.extend(result[:room])
        self.tool_calls += 1
        if len(result) >= room:
            self.truncated = self.done = True


def tool_result(turn_text: str, tools: Mapping[str, Tool]) -> str:
    """The formatted result block for the tool call that ends ``turn_text``.

    Never raises: a call that does not parse, or a tool that raises, becomes
    ``error: ...`` text inside the result block, for the policy to read.
    """
    call = parse_tool_call(turn_text, list(tools))
    if call is None:
        return format_result("error: malformed tool call (a close tag without its opening tag)")
    tag, query = call
    try:
        output = tools[tag](query)
    except Exception as exc:  # a tool failure is an observation, not a crash
        output = f"error: {type(exc).__name__}: {exc}"
    return format_result(output)


def run_agent(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seeds: Sequence[int],
    tools: Mapping[str, Tool] | None = None,
    decode: DecodeMode = "auto",
) -> list[Response]:
    """Sample one response per prompt (token lists), calling ``tools`` when the policy asks.

    ``seeds[i]`` seeds response i: its t-th token is drawn with ``uniforms(seeds[i], t)``
    (tool-output tokens count in t), so a response depends on its prompt and seed only.

    A turn ends at a stop (eos, ``params.stop``, a tool's close tag) or when the response
    reaches ``params.max_new_tokens`` (then it is truncated). After a tool close tag the
    tool runs and ``<result>...</result>`` is appended (cut to the remaining budget, which
    also truncates), up to ``params.max_turns`` calls; a call beyond that ends the response.
    ``decode`` picks the forward pass (:func:`~anchor_rl.rollout.decoders.decoder_for`).
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    tools = dict(tools or {})
    close_tags = {f"</{tag}>" for tag in tools}
    stops = StopSet.build(tokenizer, [*params.stop, *close_tags], eos_ids(model, tokenizer))
    responses = [Response() for _ in prompts]
    while active := [i for i, r in enumerate(responses) if not r.done]:
        turns = generate_turn(
            model,
            tokenizer,
            [[*prompts[i], *responses[i].tokens] for i in active],
            [params.max_new_tokens - len(responses[i].tokens) for i in active],
            params.temperature,
            params.top_p,
            stops,
            [seeds[i] for i in active],
            [len(responses[i].tokens) for i in active],
            decode,
        )
        for i, turn in zip(active, turns, strict=True):
            r = responses[i]
            r.extend(turn.tokens, turn.logprobs)
            if turn.stop is None:
                r.truncated = r.done = True
            elif turn.stop not in close_tags or r.tool_calls >= params.max_turns:
                r.done = True
            else:
                r.add_tool_result(turn.tokens, tokenizer, tools, params.max_new_tokens)
    return responses
