"""One rollout worker: the code that runs inside a Ray actor's process.

The worker builds its own copy of the driver's model from its class and config (random
weights, dropped by the first ``sync``), wraps it in the in-process ``hf`` engine and
answers ``sync`` and ``rollout`` calls. It samples only from weights it was sent: through the
object store (``sync``), or, with ``weight_sync="collective"``, broadcast by the driver in a
process group the worker joins (``join_group``, then ``prepare_receive`` and ``receive`` per
sync: :mod:`anchor_rl.cluster.broadcast`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from anchor_rl.allocator import keep_freed_memory
from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.broadcast import Bucket, SyncGroup
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
        self.version: int | None = None  # the last collective sync received
        self._group: SyncGroup | None = None
        self._pending: tuple[list[Bucket], int] | None = None

    def pid(self) -> int:
        """This worker's process id (to watch it, or to kill it in a fault test)."""
        return os.getpid()

    def sync(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load the learner's ``state_dict`` (CPU tensors from the object store); ``version``:
        the collective sync these weights are (a replacement worker's start)."""
        self.engine.sync_weights(state)
        self.synced = True
        self.version = version

    def where(self) -> tuple[str, set[str]]:
        """This worker's Ray node id and the ids of the GPUs Ray gave it."""
        import ray

        return ray.get_runtime_context().get_node_id(), {str(g) for g in ray.get_gpu_ids()}

    def join_group(
        self, host: str, port: int, rank: int, world: int, device: str, timeout: float
    ) -> None:
        """Join the driver's weight-sync group as ``rank`` (``device``: the learner's device
        type, which picks the backend); leaves the group it was in."""
        if self._group is not None:
            self._group.abort()
        self._group = SyncGroup.join(host, port, rank, world, device, timeout)

    def prepare_receive(self, buckets: list[Bucket], version: int) -> None:
        """The plan of the next collective sync; RuntimeError if it is neither the last one
        this worker received (sent again after a failed broadcast) nor the one after it (this
        worker missed one)."""
        if self.version is not None and version not in (self.version, self.version + 1):
            raise RuntimeError(
                f"rollout worker at weight version {self.version} was sent version {version}: "
                "it missed a sync"
            )
        self._pending = (buckets, version)

    def receive(self) -> None:
        """Receive the prepared sync's weights from the driver's broadcast and load them."""
        if self._group is None or self._pending is None:
            raise RuntimeError("rollout worker asked to receive weights before it was prepared")
        (buckets, version), self._pending = self._pending, None
        self.engine.sync_weights(self._group.receive(buckets, version))
        self.synced = True
        self.version = version

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
