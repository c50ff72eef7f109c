"""The batching of ``anchor-rl serve``: jobs that arrive close together become one sampler
call of the :class:`~anchor_rl.serve.model.ModelServer`, run on one model thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from anchor_rl.rollout.sampling import Turn
from anchor_rl.serve.model import ModelServer
from anchor_rl.serve.protocol import Job


class _Batch:
    """The jobs of one sampler call: equal keys, at most ``max_batch`` rows together."""

    def __init__(self, first: Job, max_batch: int) -> None:
        self.jobs, self.rows, self.max_batch = [first], len(first), max_batch

    @property
    def full(self) -> bool:
        return self.rows >= self.max_batch

    def take(self, job: Job) -> bool:
        """Add ``job`` if it fits; True when it is handled (added, or dropped as cancelled)."""
        if job.cancelled:
            return True
        if job.key != self.jobs[0].key or self.rows + len(job) > self.max_batch:
            return False
        self.jobs.append(job)
        self.rows += len(job)
        return True


class Batcher:
    """Merges jobs that arrive within ``wait_s`` of each other into one sampler call.

    The first job waiting opens a batch; for ``wait_s`` seconds (or until ``max_batch`` rows)
    the jobs that arrive join it if their key is equal and they fit, others wait for a later
    batch, in arrival order. A job larger than ``max_batch`` runs alone, in chunks. A job
    whose client went away before its batch started is dropped. All model work (sampling,
    reloads, fingerprints) runs on one thread, one call at a time.
    """

    def __init__(self, server: ModelServer, max_batch: int = 256, wait_s: float = 0.005) -> None:
        if wait_s < 0:
            raise ValueError(f"the batch wait must be >= 0, got {wait_s}")
        self.server, self.max_batch, self.wait_s = server, max_batch, wait_s
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anchor-rl-model")
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop and the model thread (waits for a call in progress)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def submit(self, job: Job) -> list[Turn]:
        """Queue ``job``; its turns, once its batch ran (an exception of the sampler is raised here)."""
        if self._queue is None:
            raise RuntimeError("the batcher is not running")
        job.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(job)
        return await job.future

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        deferred: deque[Job] = deque()
        while True:
            first = deferred.popleft() if deferred else await self._queue.get()
            if first.cancelled:
                continue
            batch = _Batch(first, self.max_batch)
            for job in list(deferred):
                if batch.take(job):
                    deferred.remove(job)
            deadline = loop.time() + self.wait_s
            while not batch.full and (remaining := deadline - loop.time()) > 0:
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
                if not batch.take(job):
                    deferred.append(job)
            live = [j for j in batch.jobs if not j.cancelled]
            if not live:
                continue
            try:
                turns = await loop.run_in_executor(self.executor, self.server.generate, live)
            except Exception as exc:
                for j in live:
                    if j.future is not None and not j.future.done():
                        j.future.set_exception(exc)
                continue
            for j, t in zip(live, turns, strict=True):
                if j.future is not None and not j.future.done():
                    j.future.set_result(t)
