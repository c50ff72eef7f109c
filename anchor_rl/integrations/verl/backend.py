"""A verl rollout backend backed by anchor-rl's sampler: ``actor_rollout_ref.rollout.name=anchor_rl``.

verl 0.9.1 samples through a rollout *replica* (``RolloutReplicaRegistry``: vllm, sglang,
trtllm) that starts server actors answering token-in/token-out ``generate`` calls, and a
*server adapter* (``_ROLLOUT_REGISTRY``, a ``BaseRollout`` inside each actor worker) that
pushes the trainer's weights to them. This module registers a third backend under
``anchor_rl``:

    AnchorRLServer    the server: a Hugging Face causal LM generating with anchor-rl's
                      :func:`~anchor_rl.rollout.sampling.generate_turn` (token ids and the
                      log-probs of the sampled tokens under the distribution they were drawn
                      from), one seeded stream per ``request_id``; ``sleep`` / ``wake_up``
                      / ``abort_all_requests`` / ``resume_generation`` as verl calls them; it
                      refuses to generate while asleep
    AnchorRLReplica   the replica: one server Ray actor per replica, named
                      ``anchor_rl_server_<replica rank>``
    ServerAdapter     the worker side: ``update_weights`` hands the actor's full weights to its
                      replica's server, ``resume`` / ``release`` wake and sleep it

It runs where vLLM does not: on a CPU (with the plug-in's CPU mode, :mod:`.cpu`), or on a
GPU without vLLM (the model then runs on ``cuda``). Not reproduced: vLLM's batching across
requests (each request is generated on its own), ``top_k`` (refused unless -1 or 0), and
vLLM's own log-prob numerics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from anchor_rl.rollout.engine import request_seed
from anchor_rl.rollout.sampling import EOS, StopSet, eos_ids, generate_turn

__all__ = [
    "BACKEND", "AnchorRLReplica", "AnchorRLServer", "RolloutAsleepError", "ServerAdapter",
    "register", "server_name",
]  # fmt: skip

BACKEND = "anchor_rl"
"""``actor_rollout_ref.rollout.name`` of this backend."""


class RolloutAsleepError(RuntimeError):
    """A ``generate`` call reached a server verl has put to sleep (weights being replaced)."""


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server."""
    return f"anchor_rl_server_{replica_rank}"


def _field(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get"):
        value = config.get(name, None)
    return default if value is None else value


class AnchorRLServer:
    """One replica's sampler: a causal LM from ``model_config.local_path`` (fp32) on ``cuda``
    when available, else the CPU.

    ``config`` is verl's rollout config (``prompt_length``, ``response_length``,
    ``ignore_eos``, ``seed``); ``model_config`` verl's ``HFModelConfig`` (or anything with a
    ``local_path``, and ``tokenizer`` or else the tokenizer files there). A server starts
    awake.
    """

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, **_: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config, self.replica_rank = config, replica_rank
        path = _field(model_config, "local_path") or _field(model_config, "path")
        self.tokenizer = _field(model_config, "tokenizer") or AutoTokenizer.from_pretrained(path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.to(device).eval()
        self.awake = True
        self.global_steps: int | None = None
        """The trainer step of the weights in use (verl's ``set_global_steps``); reported with
        every response as verl's ``extra_fields["global_steps"]``."""
        self.generated = 0
        """Requests answered (for tests and metrics)."""
        self._lock = asyncio.Lock()

    # -- generation -------------------------------------------------------------------------

    def _budget(self, prompt_ids: list[int], params: dict[str, Any]) -> int:
        if "max_tokens" in params:
            budget = int(params["max_tokens"])
        elif "max_new_tokens" in params:
            budget = int(params["max_new_tokens"])
        else:
            response = int(_field(self.config, "response_length", 512))
            prompt = int(_field(self.config, "prompt_length", 512))
            budget = min(response, prompt + response - len(prompt_ids))
        return max(1, budget)

    def generate_now(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str
    ) -> tuple[list[int], list[float], str | None]:
        """``(token ids, log-probs, stop)`` of one response to ``prompt_ids`` (synchronous)."""
        if not self.awake:
            raise RolloutAsleepError(
                f"anchor_rl rollout server {self.replica_rank} is asleep (verl is replacing its "
                "weights): generate only between wake_up and sleep"
            )
        params = dict(sampling_params)
        top_k = params.get("top_k", -1)
        if top_k not in (None, -1, 0):
            raise ValueError(f"the anchor_rl rollout backend samples without top_k, got {top_k}")
        if float(params.get("repetition_penalty", 1.0)) != 1.0:
            raise ValueError("the anchor_rl rollout backend has no repetition_penalty")
        ignore_eos = bool(params.get("ignore_eos", _field(self.config, "ignore_eos", False)))
        stops = StopSet.build(
            self.tokenizer, list(params.get("stop") or []),
            [] if ignore_eos else eos_ids(self.model, self.tokenizer),
        )  # fmt: skip
        seed = request_seed(_field(self.config, "seed", 0), self.replica_rank, request_id)
        with torch.no_grad():
            (turn,) = generate_turn(
                self.model, self.tokenizer, [list(prompt_ids)], [self._budget(prompt_ids, params)],
                float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)), stops,
                [seed], [0],
            )  # fmt: skip
        self.generated += 1
        return turn.tokens, turn.logprobs, turn.stop

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any
    ) -> Any:
        """verl's token-in/token-out call: a ``TokenOutput`` (response ids, their log-probs)."""
        async with self._lock:
            tokens, logprobs, stop = await asyncio.to_thread(
                self.generate_now, prompt_ids, sampling_params, request_id
            )
        return TokenOutput(
            token_ids=tokens, log_probs=logprobs, stop_reason="completed",
            extra_fields={"global_steps": self.global_steps,
                          "anchor_rl_stop": "eos" if stop == EOS else stop},
        )  # fmt: skip

    # -- verl's control calls -----------------------------------------------------------------

    async def sleep(self) -> None:
        self.awake = False

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            self.awake = True

    async def update_weights(
        self, state: dict[str, torch.Tensor], global_steps: int | None = None
    ) -> None:
        """Load the actor's weights (full tensors by parameter name; tied ones may be absent)
        of trainer step ``global_steps``."""
        async with self._lock:
            if global_steps is not None:
                self.global_steps = global_steps
            device = next(self.model.parameters()).device
            state = {k: v.to(device=device, dtype=torch.float32) for k, v in state.items()}
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise KeyError(f"weights the rollout model does not have: {unexpected[:5]}")

    async def abort_all_requests(self, reject_request: bool = False, **_: Any) -> dict:
        return {}  # requests run one at a time to completion: nothing is in flight to abort

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    release_kv_cache = resume_kv_cache = clear_kv_cache

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps


class AnchorRLReplica(RolloutReplica):
    """One :class:`AnchorRLServer` Ray actor per replica (module docstring)."""

    async def launch_servers(self) -> None:
        server = (
            ray.remote(AnchorRLServer)
            .options(name=server_name(self.replica_rank), max_concurrency=self.max_concurrency)
            .remote(
                config=self.config, model_config=self.model_config, replica_rank=self.replica_rank
            )
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()


class ServerAdapter(BaseRollout):
    """The actor worker's side of the ``anchor_rl`` backend: weights and sleep/wake go to its
    replica's server (rank 0 of each replica sends)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kw: Any):
        super().__init__(config, model_config, device_mesh)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank, self.leader = rank // size, rank % size == 0
        self._server = None

    def server(self) -> Any:
        """The replica's server actor (looked up by name on first use)."""
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.leader:
            await self.server().wake_up.remote(tags)

    async def release(self) -> None:
        if self.leader:
            await self.server().sleep.remote()

    async def update_weights(
        self, weights: Iterable, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"the anchor_rl backend takes named_tensors, got {wire_format}")
        state = {name: tensor.detach().to("cpu").clone() for name, tensor in weights}
        if self.leader:
            await self.server().update_weights.remote(state, kwargs.get("global_steps"))


def register() -> None:
    """Register the backend in verl's replica and server-adapter registries."""
    RolloutReplicaRegistry.register(BACKEND, lambda: AnchorRLReplica)
    _ROLLOUT_REGISTRY[(BACKEND, "async")] = f"{__name__}.ServerAdapter"
