"""The engine seam: what samples rollouts, and the built-in Hugging Face engine.

An :class:`Engine` turns :class:`Request` objects (a prompt, a seed, a group id) into a
:class:`~anchor_rl.batch.RolloutBatch` -- the agent loop with tool calls, loss masks and the
log-probs of the sampled tokens under the distribution they were drawn from -- and takes
the learner's weights through :meth:`Engine.sync_weights`. Each request carries its own
seed, so a response depends on its prompt and seed only, not on its batch-mates or on the
process that samples it (:mod:`anchor_rl.rollout.sampling`). Seeds come from
:func:`request_seed`, e.g. ``(run seed, "train", draw, sample index)``.

Engines register by name (:func:`register_engine`; the config's ``rollout.engine``) and are
built with :func:`make_engine`; nothing outside this package constructs a concrete engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import PositiveInt
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl import threads
from anchor_rl.batch import RolloutBatch
from anchor_rl.models.lora import merged_copy, sampling_state
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.registry import Registry
from anchor_rl.rollout.agent import Response, run_agent
from anchor_rl.rollout.decoders import DecodeMode, decoder_for
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool


@dataclass(frozen=True)
class Request:
    """One response to sample.

    prompt: the user's question as plain text (the engine applies the instruction and the
        chat template).
    seed: seeds this response's sampling (:func:`request_seed`).
    group: the group id of its row in the returned batch.
    """

    prompt: str
    seed: int
    group: int = 0


def request_seed(*parts: Hashable) -> int:
    """A 63-bit seed that is a function of ``parts`` alone (their ``str``), e.g.
    ``request_seed(run_seed, "train", draw, sample_index)``."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def group_requests(
    prompts: Sequence[str],
    keys: Sequence[Hashable],
    n: int,
    *stream: Hashable,
    first: Sequence[int] | int = 0,
) -> list[Request]:
    """``n`` requests per prompt, group ``i`` for ``prompts[i]``, in that order.

    Sample ``j`` of prompt ``i`` is seeded by ``request_seed(*stream, keys[i], first_i + j)``:
    ``keys[i]`` names the prompt within the stream (a prompt id, a draw index), ``first``
    (one per prompt, or one for all) numbers the samples, so a later top-up continues the
    numbering instead of replaying the samples it is added to.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    starts = [first] * len(prompts) if isinstance(first, int) else list(first)
    return [
        Request(prompt, request_seed(*stream, key, start + j), group)
        for group, (prompt, key, start) in enumerate(zip(prompts, keys, starts, strict=True))
        for j in range(n)
    ]


@runtime_checkable
class Engine(Protocol):
    """What samples rollouts for the trainer, presampling, evaluation and teachers. An engine
    holding processes or connections may also have ``close()`` (:func:`close_engine`)."""

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """One response per request, rows in request order, ``batch.group[i] =
        requests[i].group``, with the agent loop (``tools``), loss masks and the sampled
        tokens' log-probs under the distribution they were drawn from."""
        ...

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Sample from these weights from now on: ``state`` is the learner's
        ``state_dict()`` (names to tensors, on any device). An engine in another process
        may receive it as a saved checkpoint instead."""
        ...


EngineFactory = Callable[..., Engine]
ENGINES: Registry[EngineFactory] = Registry("engine")
"""Registered engine factories by name: ``factory(model, tokenizer, **options) -> Engine``,
given the live model it samples for (the learner's policy, or a reference to presample;
an engine in another process copies its config and weights) and the engine's own options
(the config's ``rollout.engine_args``)."""


def close_engine(engine: object) -> None:
    """Call ``engine.close()`` where the engine has one (the protocol does not require it:
    an in-process engine holds nothing to release; a Ray or HTTP engine does)."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Register the decorated factory as engine ``name`` (returned unchanged)."""
    return ENGINES.register(name)


def make_engine(
    name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **options: Any
) -> Engine:
    """The engine registered as ``name``, built on ``model`` with its ``options``; KeyError
    listing the registered names."""
    return ENGINES.lookup(name)(model, tokenizer, **options)


def pack(
    responses: Sequence[Response],
    prompt_ids: list[list[int]],
    group: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
) -> RolloutBatch:
    """Right-pad built responses into a ``RolloutBatch`` (T = longest response, at least 1)."""
    b, t = len(responses), max(1, *(len(r.tokens) for r in responses))
    pad_id = tokenizer.pad_token_id
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention, loss, logprobs = (torch.zeros((b, t)) for _ in range(3))
    for i, r in enumerate(responses):
        n = len(r.tokens)
        ids[i, :n] = torch.as_tensor(r.tokens, dtype=torch.long)
        attention[i, :n] = 1.0
        loss[i, :n] = torch.as_tensor(r.policy, dtype=torch.float32)
        logprobs[i, :n] = torch.as_tensor(r.logprobs, dtype=torch.float32)
    return RolloutBatch(
        group=group,
        prompt_ids=prompt_ids,
        response_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        logprobs=logprobs * loss,
        texts=tokenizer.batch_decode([r.tokens for r in responses], skip_special_tokens=True),
        tool_calls=torch.as_tensor([r.tool_calls for r in responses], dtype=torch.long),
        truncated=torch.as_tensor([r.truncated for r in responses], dtype=torch.bool),
        pad_id=pad_id,
    )


Precision = Literal["model", "bf16"]
PRECISIONS: tuple[str, ...] = ("model", "bf16")
"""An engine's ``precision`` option. Engine factories annotate their options with the values
they take (``Precision``, ``DecodeMode``, ``PositiveInt``): the config checks
``rollout.engine_args`` against these annotations before anything is loaded."""


def cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` with its floating-point parameters cast to ``dtype`` in place and returned.

    Buffers keep their dtype: the rotary frequencies of a Llama-architecture model stay
    float32, as inference servers keep them (``model.to(dtype)`` would round them too).
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def sampling_model(model: PreTrainedModel, precision: Precision) -> PreTrainedModel:
    """The model an engine samples from: ``model`` itself (``"model"``, or ``"bf16"`` when
    its parameters are bfloat16 already), else a copy with bfloat16 parameters that takes
    no gradient."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if precision == "model" or all(p.dtype == torch.bfloat16 for p in floating):
        return model
    twin = cast_parameters(merged_copy(model, torch.bfloat16), torch.bfloat16)  # LoRA: merged
    return twin.requires_grad_(False).eval()


class HFEngine:
    """Batched sampling with a ``transformers`` causal LM and a KV cache, in this process.

    Built on the learner's live model it shares its weights: ``sync_weights`` with that
    model's own tensors is free, and any other state dict is copied in.

    max_batch: most responses generated together (rows beyond it run in further chunks;
    the KV cache of one chunk is the memory peak).
    decode: the forward pass of generation (:mod:`anchor_rl.rollout.decoders`): ``auto``
    (a static KV cache for Llama-architecture models, its steps replayed as CUDA graphs on
    a GPU; the model's own forward for others), ``static``, ``graph`` or ``hf``.
    precision: ``model`` samples with the model's own parameters; ``bf16`` from a copy
    whose parameters are bfloat16 (as inference servers hold them; buffers such as the
    rotary frequencies stay float32, and the sampler's softmax runs in float32). The copy
    is refreshed by every ``sync_weights``, which then always copies.

    Between rollouts the engine holds that copy (nothing else: the static decoder's key/value
    buffers and its CUDA graphs live for one generation turn). :meth:`release_memory` frees it
    while the learner updates (``rollout.release_memory``), and returns the cached blocks of
    PyTorch's CUDA allocator to the device; the next ``sync_weights`` (or rollout) fills it again.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch: PositiveInt = 256,
        decode: DecodeMode = "auto",
        precision: Precision = "model",
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        decoder_for(model, decode)  # fails now on an unknown mode or an unsupported model
        self.source = model
        self.model = sampling_model(model, precision)
        self._released: dict[str, torch.Size] = {}  # parameters freed by release_memory
        self.tokenizer, self.max_batch = tokenizer, max_batch
        self.decode, self.precision = decode, precision

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """One response per request (see :class:`Engine`); with ``tools`` the agent loop
        runs (:func:`~anchor_rl.rollout.agent.run_agent`)."""
        if not requests:
            raise ValueError("rollout needs at least one request")
        encoded = {
            p: encode_prompt(self.tokenizer, p, instruction) for p in {r.prompt for r in requests}
        }
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in encoded.values())
        if limit is not None and longest + params.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={params.max_new_tokens} "
                f"exceeds the model's {limit} positions"
            )
        rows = [encoded[r.prompt] for r in requests]
        seeds = [r.seed for r in requests]
        if self._released:  # released without a sync since: the source model's weights again
            self.sync_weights(sampling_state(self.source))
        responses: list[Response] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), threads.phase("generate", self.model):
                for start in range(0, len(rows), self.max_batch):
                    end = start + self.max_batch
                    responses += run_agent(
                        self.model, self.tokenizer, rows[start:end], params, seeds[start:end],
                        tools, self.decode,
                    )  # fmt: skip
        finally:
            self.model.train(was_training)
        group = torch.as_tensor([r.group for r in requests], dtype=torch.long)
        return pack(responses, rows, group, self.tokenizer)

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the model, unless it is the model's own tensors already (a LoRA
        policy's merged weights, ``models.lora.MergedState``, of this very model included:
        its adapters apply as it samples)."""
        if getattr(state, "source", None) is self.model:
            return
        self._restore()
        if callable(getattr(state, "copy_into", None)):  # merged weights: one at a time
            state.copy_into(self.model)
            return
        own = self.model.state_dict()
        if all(k in own and own[k].data_ptr() == v.data_ptr() for k, v in state.items()):
            return
        self.model.load_state_dict(state)

    def release_memory(self) -> int:
        """Free what the engine holds between rollouts, until the next ``sync_weights`` or
        rollout fills it again: the parameters of its own sampling copy (``precision=bf16``
        on a float32 policy; nothing when it samples the policy itself), and, on CUDA, the
        allocator's cached blocks (``torch.cuda.empty_cache``: the last turn's key/value
        buffers and CUDA graph pools, kept reserved after they were freed). Returns the bytes
        of parameters freed."""
        freed = 0
        if self.model is not self.source and not self._released:
            for name, param in self.model.named_parameters():
                self._released[name] = param.shape
                freed += param.numel() * param.element_size()
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def _restore(self) -> None:
        """Give the released parameters storage again (uninitialised: the caller fills every
        one of them)."""
        if not self._released:
            return
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._released[name], dtype=param.dtype, device=param.device)
        self._released = {}


def release_memory(engine: object) -> int:
    """``engine.release_memory()`` where the engine has one (the in-process ``hf`` engine):
    the bytes it freed; 0 for an engine without one."""
    release = getattr(engine, "release_memory", None)
    return int(release()) if callable(release) else 0


@register_engine("hf")
def _hf_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_batch: PositiveInt = 256,
    decode: DecodeMode = "auto",
    precision: Precision = "model",
) -> Engine:
    """The in-process engine on the learner's own model (no copy: updates are seen at once,
    unless ``precision="bf16"`` samples from a bfloat16 copy); options ``max_batch``,
    ``decode`` and ``precision``."""
    return HFEngine(model, tokenizer, max_batch=max_batch, decode=decode, precision=precision)
