"""One rollout worker: the code that runs inside a Ray actor's process.

The worker builds its own copy of the driver's model from its class and config (random
weights, dropped by the first ``sync``), wraps it in the in-process ``hf`` engine and
answers ``sync`` and ``rollout`` calls. It samples only from weights it was sent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from anchor_rl.allocator import keep_freed_memory
from anchor_rl.batch import RolloutBatch
from anchor_rl.rollout.decoders import DecodeMode
from anchor_rl.rollout.engine import Precision, Request, cast_parameters, make_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool


class RolloutWorker:
    """A model copy and an ``hf`` engine in a worker process (wrapped by ``ray.remote``).

    model_class: the driver model's class (e.g. ``LlamaForCausalLM``), built from ``config``.
    generation_config: the driver model's (its eos ids end responses).
    dtype, device: of the copy's parameters (``cuda`` on a worker given a GPU).
    threads: torch intra-op threads of this process.
    max_batch, decode, precision: the ``hf`` engine's options (responses generated
        together; the forward pass of generation; ``bf16``: the copy's parameters are cast
        to bfloat16 here, so the engine samples from them without a second copy).
    """

    def __init__(
        self,
        model_class: type,
        config: PretrainedConfig,
        generation_config: GenerationConfig | None,
        tokenizer: PreTrainedTokenizerBase,
        dtype: torch.dtype,
        device: str,
        threads: int,
        max_batch: int,
        decode: DecodeMode = "auto",
        precision: Precision = "model",
    ) -> None:
        torch.set_num_threads(threads)
        keep_freed_memory()
        model = model_class(config)
        if generation_config is not None:
            model.generation_config = generation_config
        model = model.to(device=device, dtype=dtype).eval()
        if precision == "bf16":
            cast_parameters(model, torch.bfloat16)
        self.engine = make_engine(
            "hf", model, tokenizer, max_batch=max_batch, decode=decode, precision=precision
        )
        self.synced = False

    def pid(self) -> int:
        """This worker's process id (to watch it, or to kill it in a fault test)."""
        return os.getpid()

    def sync(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the learner's ``state_dict`` (CPU tensors from the object store)."""
        self.engine.sync_weights(state)
        self.synced = True

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None,
        instruction: str | None,
    ) -> RolloutBatch:
        """The ``hf`` engine's rollout of this shard (rows in the shard's order)."""
        if not self.synced:
            raise RuntimeError("rollout worker asked to sample before it received any weights")
        return self.engine.rollout(requests, params, tools, instruction)
