"""Presampling: roll a reference policy out M times per prompt and store the statistics.

The core, :func:`presample`, is generic over a *sampler*, any function
``sampler(records, n, first, seed) -> (rewards[P, n], correct[P, n])``.
:class:`RolloutSampler` is the real one (a rollout engine plus the task's verifier); tests
use fakes. Presampling is resumable and its statistics do not depend on the batching
(:func:`presample`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from anchor_rl.anchors.keys import (
    AnchorKey,
    fingerprint_model,
    fingerprint_tokenizer,
    sampling_settings,
)
from anchor_rl.anchors.store import AnchorStat, AnchorStore
from anchor_rl.batch import RolloutBatch
from anchor_rl.progress import Progress
from anchor_rl.rollout.engine import Engine, group_requests
from anchor_rl.tasks.base import Record, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from anchor_rl.rollout.types import SamplingParams

Sampler = Callable[[Sequence[Record], int, Sequence[int], Hashable], tuple[Tensor, Tensor]]
"""``sampler(records, n, first, seed) -> (rewards[P, n] float, correct[P, n] bool)``: n rollouts
of each of the P records, scored by the task. Rollout ``j`` of record ``i`` is that prompt's
rollout number ``first[i] + j``, seeded by ``(seed, record id, first[i] + j)``."""

RefreshMode = Literal["reference", "policy"]


@dataclass(frozen=True)
class PresampleResult:
    """What one :func:`presample` call did.

    rollouts: responses sampled by this call (what it cost).
    prompts_sampled: prompts that got new rollouts.
    prompts_reused: prompts that already had M rollouts under the key.
    prompts_discarded: sampled prompts whose rollouts were not stored because another
        process stored rollouts for them meanwhile (their cost is still in ``rollouts``).
    """

    key: str
    rollouts: int
    prompts_sampled: int
    prompts_reused: int
    prompts_discarded: int = 0


def presample(
    records: Sequence[Record],
    sampler: Sampler,
    store: AnchorStore,
    key: AnchorKey,
    m: int,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    keep_rollouts: bool = False,
) -> PresampleResult:
    """Make sure every record has at least ``m`` rollouts stored under ``key``.

    keep_rollouts: also keep the rollouts themselves (``AnchorStore.put_rollouts``, in the
    transaction of their statistics); needs a sampler with ``last`` (:class:`RolloutSampler`
    made with ``keep=True``).

    Records are sampled ``batch_size`` prompts per sampler call (``batch_size * need``
    responses); each call's statistics are stored in one transaction. Records that
    already have ``n >= m`` rollouts are skipped; records with ``0 < n < m`` get ``m - n``
    more, numbered from ``n``: rollout ``j`` of a prompt is seeded by ``(seed, key, prompt
    id, j)``, so a top-up never replays the samples it is added to and the result does not
    depend on ``batch_size``. Two processes presampling the same key take turns: the second
    says which process holds the key, waits for it, and then samples only what is still
    missing (nothing, when the first finished). Even without that lock, a prompt another
    writer stored first is never merged twice.
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dupes = sorted(i for i, c in Counter(ids).items() if c > 1)
        raise ValueError(f"duplicate record ids: {dupes[:5]}")
    with _exclusive(store, key):
        return _presample(
            records, sampler, store, key, m, batch_size, seed, progress, keep_rollouts
        )


@contextmanager
def _exclusive(store: AnchorStore, key: AnchorKey) -> Iterator[None]:
    """Hold the presampling of ``key`` in ``store`` (an advisory lock file beside the store);
    wait, saying so, while another process holds it."""
    path = Path(store.path).parent / f".{Path(store.path).name}.{key.digest[:16]}.lock"
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            print(
                f"presample: process {holder} is presampling key {key.digest[:12]} into "
                f"{store.path}; waiting for it, then sampling only what is still missing",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _presample(
    records: Sequence[Record],
    sampler: Sampler,
    store: AnchorStore,
    key: AnchorKey,
    m: int,
    batch_size: int,
    seed: int,
    progress: bool,
    keep_rollouts: bool = False,
) -> PresampleResult:
    ids = [r.id for r in records]
    have = {pid: s.n for pid, s in store.get_anchors(key, ids).items()}
    todo: dict[int, list[Record]] = {}
    for r in records:
        need = m - have.get(r.id, 0)
        if need > 0:
            todo.setdefault(need, []).append(r)
    reused = len(records) - sum(len(v) for v in todo.values())
    rollouts = discarded = 0
    with Progress("presample", len(records), done=reused, enabled=progress) as bar:
        for need, pending in todo.items():
            for start in range(0, len(pending), batch_size):
                batch = pending[start : start + batch_size]
                first = [have.get(r.id, 0) for r in batch]
                rewards, correct = sampler(batch, need, first, (seed, key.digest))
                if tuple(rewards.shape) != (len(batch), need):
                    raise ValueError(
                        f"the sampler returned rewards of shape {tuple(rewards.shape)}, expected {(len(batch), need)}"
                    )
                rollouts += len(batch) * need
                kept = getattr(sampler, "last", None) if keep_rollouts else None
                if keep_rollouts and kept is None:
                    raise ValueError("keep_rollouts needs a sampler that keeps its last batch")
                discarded += _store_unraced(store, key, batch, have, rewards, correct, kept)
                bar.update(advance=len(batch), info=f"{rollouts} rollouts")
    return PresampleResult(
        key=key.digest,
        rollouts=rollouts,
        prompts_sampled=len(records) - reused,
        prompts_reused=reused,
        prompts_discarded=discarded,
    )


def _store_unraced(
    store: AnchorStore,
    key: AnchorKey,
    batch: Sequence[Record],
    have: dict[str, int],
    rewards: Tensor,
    correct: Tensor,
    rollouts: RolloutBatch | None = None,
) -> int:
    """Store a batch's rollouts, except prompts another writer updated meanwhile; returns how many.

    The check and the write are one transaction (which holds the write lock), so two
    processes presampling the same key never merge the same prompt twice. ``rollouts``
    (group i: ``batch[i]``'s rows) are kept too, in the same transaction.
    """
    with store.batch():
        now = {pid: s.n for pid, s in store.get_anchors(key, [r.id for r in batch]).items()}
        fresh = [i for i, r in enumerate(batch) if now.get(r.id, 0) == have.get(r.id, 0)]
        if fresh:
            store.add_rollouts(key, [batch[i].id for i in fresh], rewards[fresh], correct[fresh])
        if fresh and rollouts is not None:
            rows = torch.isin(rollouts.group, torch.tensor(fresh)).nonzero().flatten()
            kept = rollouts.select(rows)
            kept = dataclasses.replace(
                kept, group=torch.searchsorted(torch.tensor(fresh), kept.group)
            )
            store.put_rollouts(
                key, [batch[i].id for i in fresh], [have.get(batch[i].id, 0) for i in fresh],
                kept, rewards[fresh], correct[fresh],
            )  # fmt: skip
    return len(batch) - len(fresh)


def task_params(params: SamplingParams, task: Task) -> SamplingParams:
    """``params`` with the task's stop strings (answer and tool close tags) added to its own."""
    return dataclasses.replace(params, stop=list(dict.fromkeys([*params.stop, *task.stop])))


def seeded_settings(params: SamplingParams, seed: int) -> dict[str, Any]:
    """The sampling settings of a presample key: ``params``' and the presampling ``seed``."""
    return {**sampling_settings(params), "seed": int(seed)}


def presample_key(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
    task_id: str,
    tag: str = "presample",
    seed: int = 0,
) -> AnchorKey:
    """The key of anchors made by ``model`` with ``params`` on the task ``task_id``, drawn
    with the presampling ``seed`` (:func:`presample`'s).

    Hashes the weights (:func:`~anchor_rl.anchors.keys.fingerprint_model`) and the tokenizer.
    Pass the params the sampler really uses (see :func:`task_params`). The seed is part of
    the sampling settings: two seeds are two independent anchor draws, never mixed.
    """
    return AnchorKey(
        model=fingerprint_model(model),
        tokenizer=fingerprint_tokenizer(tokenizer),
        sampling=seeded_settings(params, seed),
        task=task_id,
        tag=tag,
    )


class RolloutSampler:
    """A :data:`Sampler` backed by a rollout engine: n responses per record, scored by the task.

    Samples with ``task_params(params, task)`` (the task's stop strings added), the task's
    tools and instruction; ``reward`` and ``correct`` are the task's verdicts on each text.
    """

    def __init__(
        self, engine: Engine, task: Task, params: SamplingParams, keep: bool = False
    ) -> None:
        self.engine, self.task, self.keep = engine, task, keep
        self.params = task_params(params, task)
        self.last: RolloutBatch | None = None
        """With ``keep``: the rollouts of the last call (group i: ``records[i]``)."""

    def __call__(
        self, records: Sequence[Record], n: int, first: Sequence[int], seed: Hashable
    ) -> tuple[Tensor, Tensor]:
        """(rewards[P, n], correct[P, n]); see :data:`Sampler` for the seeding."""
        requests = group_requests(
            [r.prompt for r in records], [r.id for r in records], n, "presample", seed,
            first=first,
        )  # fmt: skip
        batch = self.engine.rollout(
            requests, self.params, tools=self.task.tools or None, instruction=self.task.instruction
        )
        rewards = torch.zeros(len(records), n, dtype=torch.float64)
        correct = torch.zeros(len(records), n, dtype=torch.bool)
        seen = [0] * len(records)
        for text, g in zip(batch.texts, batch.group.tolist(), strict=True):
            record = records[g]
            rewards[g, seen[g]] = self.task.reward(text, record)
            correct[g, seen[g]] = self.task.correct(text, record)
            seen[g] += 1
        self.last = batch if self.keep else None
        return rewards, correct


def refresh_key(
    key: AnchorKey, mode: RefreshMode, step: int, model_fingerprint: str | None = None
) -> AnchorKey:
    """The key of anchors re-estimated at training step ``step``.

    ``reference``: the original reference resampled; the key keeps its model fingerprint.
    ``policy``: a snapshot of the current policy; ``model_fingerprint``
    (:func:`~anchor_rl.anchors.keys.fingerprint_model` of the snapshot) is required, so
    two runs share refreshed anchors only if their snapshots have identical weights.
    """
    if mode == "reference":
        if model_fingerprint is not None and model_fingerprint != key.model:
            raise ValueError(
                "mode 'reference' resamples the original reference; its fingerprint must match the key's"
            )
        model = key.model
    elif mode == "policy":
        if model_fingerprint is None:
            raise ValueError(
                "mode 'policy' needs the fingerprint of the policy snapshot (fingerprint_model)"
            )
        model = model_fingerprint
    else:
        raise ValueError(f"unknown refresh mode {mode!r}; choose 'reference' or 'policy'")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return key.replace(model=model, tag=f"refresh/{mode}/step={step}")


@dataclass(frozen=True)
class RefreshResult:
    """Refreshed anchors: the key they are stored under, the statistics and the rollouts spent."""

    key: AnchorKey
    anchors: dict[str, AnchorStat]
    rollouts: int


def refresh_anchors(
    records: Sequence[Record],
    sampler: Sampler,
    store: AnchorStore,
    key: AnchorKey,
    mode: RefreshMode,
    step: int,
    m: int,
    model_fingerprint: str | None = None,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> RefreshResult:
    """Re-estimate the anchors of ``records`` at training step ``step`` (PVPO's refresh every K steps).

    ``sampler`` rolls out the original reference (``mode="reference"``) or a snapshot of the
    current policy (``mode="policy"``, with its ``model_fingerprint``). The new statistics
    are stored under :func:`refresh_key` (the original anchors are kept); a rerun of the
    same refresh (e.g. a resumed run) reuses them and spends nothing. ``rollouts`` is what
    this call sampled, for the trainer's rollout count.
    """
    new_key = refresh_key(key, mode, step, model_fingerprint)
    result = presample(
        records, sampler, store, new_key, m, batch_size=batch_size, seed=seed, progress=progress
    )
    anchors = store.get_anchors(new_key, [r.id for r in records])
    return RefreshResult(key=new_key, anchors=anchors, rollouts=result.rollouts)
