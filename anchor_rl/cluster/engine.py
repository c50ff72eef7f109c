"""The ``ray`` engine: rollouts sampled by N worker processes (Ray actors), on one machine or many.

Each worker holds its own copy of the model and an in-process ``hf`` engine
(:mod:`anchor_rl.cluster.worker`). :meth:`RayEngine.rollout` shards the requests by group
-- every rollout of one prompt group goes to one worker, so a group's samples (and a V0.5
top-up of it) stay together -- balances the shards, samples them in parallel and puts the
rows back in request order. Per-request seeds make the result independent of the
sharding: the same requests give the same responses as the ``hf`` engine in this process
(up to the floating-point caveat of :mod:`anchor_rl.rollout.sampling`).

Weights flow driver -> workers in one of two ways (``weight_sync``). ``object_store``:
:meth:`RayEngine.sync_weights` puts the learner's ``state_dict`` (as CPU tensors) into Ray's
object store once and every worker loads it. ``collective``: the driver and the workers
form a torch.distributed group of their own and the driver broadcasts the tensors in
buckets, gloo on the CPU, NCCL between GPUs, as verl and OpenRLHF do
(:mod:`anchor_rl.cluster.broadcast`).

A worker that dies (killed, out of memory, its node lost) is replaced by a new actor
given the last synced weights (with ``collective``: the tensors last synced, put in the
object store for it once; the group is rebuilt at the next sync), and the work it had is
sent again; per-request seeding makes the re-sampled responses the same. The engine logs a warning and counts it in
:attr:`RayEngine.restarts`, once per death: each call sent remembers the actor it went to,
and a call whose actor was already replaced (by another call that met the death first) is
sent again to the replacement, without a second restart.

The re-sent work is sampled with the weights the replacement holds: the last synced ones.
A rollout sent before a :meth:`RayEngine.sync_weights` (:meth:`RayEngine.submit`,
asynchronous rollouts) whose worker died before sampling it is therefore re-sampled with
the newer weights: those rows are other responses than the lost ones, their log-probs
(``batch.logprobs``) are the newer weights', which the asynchronous update divides by
(:mod:`anchor_rl.cluster.asynchronous`), and they are fresher than the batch's reported
staleness, a maximum over its rows. The warning says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from pydantic import PositiveInt
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.broadcast import (
    SYNC_TIMEOUT_S,
    DriverGroup,
    WeightSync,
    WeightSyncError,
    check_collective,
    plan_buckets,
)
from anchor_rl.cluster.connect import connect, import_ray
from anchor_rl.cluster.worker import RolloutWorker
from anchor_rl.models.lora import sampling_state
from anchor_rl.rollout.decoders import DecodeMode, decoder_for
from anchor_rl.rollout.engine import PRECISIONS, Precision, Request, register_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool

logger = logging.getLogger(__name__)

MAX_RESTARTS_PER_CALL = 3
"""Restarts of one worker within one engine call before the call gives up."""


def shard_by_group(groups: Sequence[int], workers: int) -> list[list[int]]:
    """Row indices for each of ``workers`` workers: all rows of a group on one worker.

    groups: the group id of each request, in request order.
    Groups are placed largest first on the least loaded worker (load: rows; ties go to
    the lower worker, and to the group seen first), so the shards' sizes differ by at most
    the largest group. Each shard lists its rows in request order; a shard may be empty
    (fewer groups than workers). Deterministic: the same groups give the same shards.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        rows_of.setdefault(int(g), []).append(i)
    loads = [0] * workers
    shards: list[list[int]] = [[] for _ in range(workers)]
    for rows in sorted(rows_of.values(), key=lambda rows: (-len(rows), rows[0])):
        w = min(range(workers), key=lambda k: (loads[k], k))
        shards[w] += rows
        loads[w] += len(rows)
    return [sorted(s) for s in shards]


@register_engine("ray")
class RayEngine:
    """An :class:`~anchor_rl.rollout.engine.Engine` whose rollouts run in Ray actors:
    ``workers`` actors sampling for ``model``, started with its current weights (see the
    module docstring for sharding, weight flow and restarts).

    address: ``local`` (start Ray in this process, or use the Ray it is connected to),
        ``auto`` (join the cluster ``ray start --head`` started) or ``HOST:PORT``.
    num_cpus_per_worker, num_gpus_per_worker: what each actor reserves (a GPU worker
        samples on ``cuda``; fractions share a device).
    threads_per_worker: torch threads in each actor (default: its whole CPUs, at least 1).
    max_batch, decode, precision: each worker's ``hf`` engine options (responses generated
        together; the forward pass of generation, :mod:`anchor_rl.rollout.decoders`;
        ``bf16`` samples from bfloat16 parameters).
    startup_timeout: seconds to wait for the workers to start before a clear error.
    weight_sync: ``object_store`` (the default) or ``collective`` (a broadcast in a process
        group of the driver and the workers; refused on CUDA unless each worker has whole
        GPUs of its own).
    sync_timeout: seconds a collective sync's rendezvous and each broadcast may take.

    restarts: workers replaced after they died, over the engine's life.
    syncs: :meth:`sync_weights` calls (the initial push included).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        workers: PositiveInt = 2,
        address: str = "local",
        num_cpus_per_worker: float = 1.0,
        threads_per_worker: PositiveInt | None = None,
        num_gpus_per_worker: float = 0.0,
        max_batch: PositiveInt = 256,
        decode: DecodeMode = "auto",
        precision: Precision = "model",
        startup_timeout: float = 300.0,
        weight_sync: WeightSync = "object_store",
        sync_timeout: float = SYNC_TIMEOUT_S,
    ) -> None:
        _check_int("workers", workers, 1)
        _check_number("num_cpus_per_worker", num_cpus_per_worker)
        _check_number("num_gpus_per_worker", num_gpus_per_worker)
        if threads_per_worker is None:
            threads_per_worker = max(1, int(num_cpus_per_worker))
        _check_int("threads_per_worker", threads_per_worker, 1)
        _check_int("max_batch", max_batch, 1)
        _check_number("startup_timeout", startup_timeout)
        if startup_timeout <= 0:
            raise ValueError(
                f"rollout.engine_args.startup_timeout must be > 0, got {startup_timeout}"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        decoder_for(model, decode)  # an unknown mode or an unsupported model fails here
        if precision not in PRECISIONS:
            raise ValueError(
                f"rollout.engine_args.precision must be one of {', '.join(PRECISIONS)}, "
                f"got {precision!r}"
            )
        if weight_sync not in ("object_store", "collective"):
            raise ValueError(
                "rollout.engine_args.weight_sync (cluster.weight_sync) must be object_store or "
                f"collective, got {weight_sync!r}"
            )
        _check_number("sync_timeout", sync_timeout)
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if weight_sync == "collective":
            check_collective(device, num_gpus_per_worker)
        self._ray = ray = import_ray()
        connect(address, workers * num_cpus_per_worker)
        _check_resources(ray, workers, num_cpus_per_worker, num_gpus_per_worker)
        self._spec = (
            type(model),
            model.config,
            getattr(model, "generation_config", None),
            tokenizer,
            param.dtype if param is not None else torch.float32,
            "cuda" if num_gpus_per_worker > 0 else "cpu",
            threads_per_worker,
            max_batch,
            decode,
            precision,
        )
        self._options = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
        # max_restarts=0: Ray does not revive a dead worker; this engine replaces it and
        # gives the new one the last synced weights. enable_task_events=False: Ray's GCS keeps
        # no record of each call (it grew ~13 MiB per 1,000 steps in the soak; the calls are
        # then absent from Ray's dashboard and `ray list tasks`)
        self._actor = ray.remote(RolloutWorker).options(
            **self._options, max_restarts=0, enable_task_events=False
        )
        self.startup_timeout = startup_timeout
        self.restarts = self.syncs = 0
        self._weights: Any = None  # ObjectRef of the last synced CPU state dict
        self._state: Mapping[str, torch.Tensor] | None = None  # collective: the last synced
        self._group = (
            DriverGroup(ray, device, sync_timeout) if weight_sync == "collective" else None
        )
        self._workers: list[Any] = []  # the current actor of each worker slot
        self._pids: list[int] = []
        actors = [self._spawn() for _ in range(workers)]
        self._workers, self._pids = actors, self._wait_started(actors)
        # the workers start from the driver's weights (a LoRA policy's merged into plain ones)
        self.sync_weights(sampling_state(model))

    # -- the Engine protocol ----------------------------------------------------------

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """One response per request, rows in request order, ``batch.group[i] =
        requests[i].group`` (see :class:`~anchor_rl.rollout.engine.Engine`); the shards
        (:func:`shard_by_group`) are sampled in parallel, one per worker."""
        return self.submit(requests, params, tools, instruction).result()

    def submit(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> PendingRollout:
        """Send :meth:`rollout`'s work to the workers and return at once; ``.result()``
        waits for the batch. Each worker runs its calls in the order they were sent, so a
        :meth:`sync_weights` sent after this waits for it, and these rollouts are sampled
        with the weights synced before it (asynchronous rollouts, ``cluster.async_steps``)."""
        if not requests:
            raise ValueError("rollout needs at least one request")
        self._check_open()
        shards = shard_by_group([r.group for r in requests], len(self._workers))
        tools_ref = self._ray.put(dict(tools)) if tools else None
        calls = {
            w: ("rollout", ([requests[i] for i in rows], params, tools_ref, instruction))
            for w, rows in enumerate(shards)
            if rows
        }
        return PendingRollout(self, calls, self._dispatch(calls), shards)

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Have every worker load ``state`` (the learner's ``state_dict``, on any device); a
        worker started later (a restart) gets these weights too. ``object_store``: put into
        the object store once, as CPU tensors; ``collective``: broadcast (:meth:`_broadcast`)."""
        self._check_open()
        if self._group is not None:
            self._broadcast(state)
        else:
            cpu = {k: v.detach().to("cpu") for k, v in state.items()}
            self._weights = self._ray.put(cpu)
            self._call({w: ("sync", (self._weights,)) for w in range(len(self._workers))})
        self.syncs += 1

    # -- inspection and shutdown ------------------------------------------------------

    @property
    def workers(self) -> int:
        """Number of rollout workers."""
        return len(self._workers)

    def pids(self) -> list[int]:
        """The process id of each worker, asked of the workers themselves."""
        self._check_open()
        return list(self._ray.get([w.pid.remote() for w in self._workers]))

    def close(self) -> None:
        """Stop the workers (their resources go back to the cluster); idempotent. Ray itself
        keeps running: other engines of this process may use it."""
        workers, self._workers = self._workers, []
        if self._group is not None:
            self._group.close()
        if self._ray.is_initialized():
            for w in workers:
                self._ray.kill(w)

    def __repr__(self) -> str:
        return f"RayEngine(workers={len(self._workers)}, restarts={self.restarts})"

    # -- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._workers:
            raise RuntimeError("this RayEngine was closed")

    def _spawn(self) -> Any:
        return self._actor.remote(*self._spec)

    def _wait_started(self, actors: list[Any]) -> list[int]:
        """The actors' pids once all have started; a clear error if they cannot."""
        ray = self._ray
        refs = [a.pid.remote() for a in actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.startup_timeout)
        if pending:
            for a in actors:
                ray.kill(a)
            raise TimeoutError(
                f"{len(pending)} of {len(actors)} rollout workers did not start within "
                f"{self.startup_timeout:g} s (rollout.engine_args.startup_timeout); the "
                f"cluster has {_resources(ray.available_resources())} free of "
                f"{_resources(ray.cluster_resources())} and each worker asks for "
                f"{self._options['num_cpus']:g} CPU, {self._options['num_gpus']:g} GPU: "
                "lower workers or num_cpus_per_worker, close other engines, or add nodes"
            )
        try:
            return list(ray.get(refs))
        except ray.exceptions.RayActorError as exc:
            for a in actors:
                ray.kill(a)
            raise RuntimeError(f"a rollout worker failed to start: {exc}") from None

    def _restart(self, w: int, during: str, error: Exception, requests: int) -> None:
        """Replace dead worker ``w`` by a new actor loaded with the last synced weights."""
        ray, old_pid = self._ray, self._pids[w]
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self._workers[w])
        actor = self._spawn()
        self._workers[w] = actor
        self._pids[w] = self._wait_started([actor])[0]
        if self._group is not None and self._state is not None:  # one object-store copy
            cpu = {k: v.detach().to("cpu") for k, v in self._state.items()}
            ray.get(actor.sync.remote(ray.put(cpu), self.syncs))
        elif self._weights is not None:
            ray.get(actor.sync.remote(self._weights))
        self.restarts += 1
        logger.warning(
            "rollout worker %d (pid %d) died during %s (%s); restarted it as pid %d with the "
            "last synced weights and re-sent its %s",
            w, old_pid, during, type(error).__name__, self._pids[w],
            f"{requests} requests" if requests else "call",
        )  # fmt: skip

    def _broadcast(self, state: Mapping[str, torch.Tensor]) -> None:
        """A collective sync, version ``syncs + 1``: each worker is sent the bucket plan
        first (which waits out the calls queued before it and restarts a worker found
        dead), then the driver broadcasts. A failed broadcast (a worker died in it) is
        tried once more, the dead worker restarted by the second plan call and the group
        rebuilt; a second failure raises."""
        assert self._group is not None
        version, buckets = self.syncs + 1, plan_buckets(state)
        for attempt in (1, 2):
            self._call({w: ("prepare_receive", (buckets, version)) for w in range(self.workers)})
            try:
                self._group.sync(self._workers, state, buckets, version)
                break
            except WeightSyncError as exc:
                if attempt == 2:
                    raise
                logger.warning("%s; trying once more", exc)
        self._state = state

    def _call(self, calls: dict[int, tuple[str, tuple]]) -> dict[int, Any]:
        """Run ``method(*args)`` on each worker ``w`` of ``calls``, in parallel (see
        :meth:`_gather`)."""
        return self._gather(calls, self._dispatch(calls))

    def _dispatch(self, calls: dict[int, tuple[str, tuple]]) -> dict[Any, _Sent]:
        """Send ``method(*args)`` to each worker ``w`` of ``calls``: object ref -> where it
        went (:class:`_Sent`)."""
        return {self._send(w, method, args): _Sent(w, self._workers[w], self.syncs)
                for w, (method, args) in calls.items()}  # fmt: skip

    def _send(self, w: int, method: str, args: tuple) -> Any:
        return getattr(self._workers[w], method).remote(*args)

    def _gather(
        self, calls: dict[int, tuple[str, tuple]], pending: dict[Any, _Sent]
    ) -> dict[int, Any]:
        """The results of dispatched ``calls`` by worker. A call whose actor died is sent
        again (at most MAX_RESTARTS_PER_CALL times) to the worker's current actor: a new
        one if the dead actor is still the worker's (restarted here), else the replacement
        another call started when it met the death first (one death, one restart). Errors
        raised by the work itself (a bad request) propagate unchanged."""
        ray = self._ray
        pending = dict(pending)
        results: dict[int, Any] = {}
        tries = dict.fromkeys(calls, 0)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            sent = pending.pop(ref)
            w = sent.worker
            method, args = calls[w]
            try:
                results[w] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                tries[w] += 1
                if tries[w] > MAX_RESTARTS_PER_CALL:
                    raise RuntimeError(
                        f"rollout worker {w} died {tries[w]} times during one {method} call; "
                        f"giving up (last error: {exc})"
                    ) from exc
                n = len(args[0]) if method == "rollout" else 0
                if self._workers[w] is sent.actor:
                    self._restart(w, method, exc, n)
                else:
                    logger.warning(
                        "a %s call sent to rollout worker %d before it died and was restarted "
                        "(pid %d now) failed (%s); re-sent its %s to the new worker",
                        method, w, self._pids[w], type(exc).__name__,
                        f"{n} requests" if n else "call",
                    )  # fmt: skip
                if method == "rollout" and self.syncs > sent.syncs:
                    logger.warning(
                        "rollout worker %d samples its %d re-sent requests with the weights "
                        "of %d later sync(s) than the ones they were sent with: other "
                        "responses, with those weights' log-probs, fresher than the "
                        "batch's staleness says",
                        w, n, self.syncs - sent.syncs,
                    )  # fmt: skip
                pending[self._send(w, method, args)] = _Sent(w, self._workers[w], self.syncs)
        return results


class _Sent(NamedTuple):
    """Where a dispatched call went: worker slot, the actor it was then, and
    :attr:`RayEngine.syncs` then (the weights a rollout is sampled with)."""

    worker: int
    actor: Any
    syncs: int


class PendingRollout:
    """A rollout sent to the workers by :meth:`RayEngine.submit`, not collected yet."""

    def __init__(
        self,
        engine: RayEngine,
        calls: dict[int, tuple[str, tuple]],
        pending: dict[Any, _Sent],
        shards: list[list[int]],
    ) -> None:
        self._engine, self._calls, self._pending, self._shards = engine, calls, pending, shards
        self._batch: RolloutBatch | None = None

    def result(self) -> RolloutBatch:
        """The batch, rows in request order (waits for the workers the first time)."""
        if self._batch is None:
            results = self._engine._gather(self._calls, self._pending)
            used = sorted(results)
            merged = RolloutBatch.cat([results[w] for w in used])
            order = [i for w in used for i in self._shards[w]]
            position = [0] * len(order)
            for pos, i in enumerate(order):
                position[i] = pos
            self._batch = merged.select(position)
        return self._batch


def _resources(table: Mapping[str, float]) -> str:
    return f"{table.get('CPU', 0):g} CPU, {table.get('GPU', 0):g} GPU"


def _check_resources(ray: Any, workers: int, cpus: float, gpus: float) -> None:
    """Refuse workers the cluster can never hold (its total, not what is free now)."""
    total = ray.cluster_resources()
    for name, each in (("CPU", cpus), ("GPU", gpus)):
        if workers * each > total.get(name, 0):
            option = f"num_{name.lower()}s_per_worker"
            raise ValueError(
                f"{workers} rollout workers x {each:g} {name} (rollout.engine_args.workers, "
                f"{option}) do not fit the Ray cluster: it has {total.get(name, 0):g} {name} "
                "in all"
            )


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"rollout.engine_args.{name} must be an integer >= {least}, got {value!r}")


def _check_number(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"rollout.engine_args.{name} must be a number >= 0, got {value!r}")
