"""PVPO's lazy presampling in the trainer: the prompt stream that presamples as it draws, and
the engine that serves a prompt's first group from its presampled rollouts.

:class:`LazyPrompts` replaces the run's ``PromptSampler`` (``Component.prompt_stream``);
:class:`ReusingEngine` wraps the run's engine when ``pvpo.reuse_presample`` is on. The
decisions (the walk, group sampling, which rollouts are kept) live in
:class:`anchor_rl.methods.pvpo.LazyWalk`. Shapes: B responses.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from anchor_rl.anchors.filter import FilterResult, group_filter
from anchor_rl.anchors.keys import task_identity
from anchor_rl.anchors.presample import presample_key
from anchor_rl.anchors.store import AnchorStat, AnchorStore
from anchor_rl.anchors.teachers import Teacher, teacher_key
from anchor_rl.batch import RolloutBatch
from anchor_rl.errors import ConfigError
from anchor_rl.methods.pvpo import LazyWalk, reference_sampler, walk_order
from anchor_rl.paths import store_path
from anchor_rl.rollout.engine import Engine, Request
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.component import Setup
from anchor_rl.trainer.data import PromptSampler


def lazy_walk(
    setup: Setup,
    target: int | None,
    seed: int,
    params: SamplingParams,
    build_teacher: Callable[[PreTrainedModel | None], Teacher | None],
) -> LazyWalk:
    """The walk of a lazy-presampling run (nothing sampled yet): the run's prompts in
    :func:`walk_order` to ``target`` (None: all), presampled with ``params`` and the anchor
    ``seed``; group sampling with ``build_teacher(reference or None)``'s teacher (the
    reference passed for ``oracle:reference``) on each new prompt."""
    cfg, task = setup.cfg, setup.task
    if "v05" in cfg.methods:
        raise ConfigError(
            "pvpo.presample=lazy with V0.5 (not built): V0.5's prior and prompt set are made "
            "from the anchors at run start; use pvpo.presample=upfront"
        )
    reference = setup.get_reference()
    task_id = task_identity(cfg.task, task, cfg.task_args)
    key = presample_key(reference, setup.tokenizer, params, task_id, seed=seed)
    store = AnchorStore(store_path(cfg.pvpo.store))
    decide = None
    if cfg.filter.kind == "group":
        ref = reference if cfg.pvpo.teacher == "oracle:reference" else None
        teacher = build_teacher(ref)
        tkey = None if teacher is None else teacher_key(teacher, task_id)

        def decide(records: Sequence[Record], stats: Mapping[str, AnchorStat]) -> FilterResult:
            return group_filter(
                records, stats, teacher=teacher, store=store if teacher else None, key=tkey,
                keep_unsolved=cfg.pvpo.keep_unsolved, progress=False,
            )  # fmt: skip

    reuse = cfg.pvpo.reuse_presample
    sampler = reference_sampler(reference, setup.tokenizer, task, params, cfg.engine, keep=reuse)
    return LazyWalk(
        store, key, params, sampler, walk_order(setup.records, seed), cfg.pvpo, target,
        decide or (lambda records, stats: None), seed=seed, keep_rollouts=reuse,
    )  # fmt: skip


class LazyPrompts(PromptSampler):
    """The prompt stream of a lazy-presampling run (``PromptSampler``'s ``take``, ``peek`` and
    ``consumed``).

    Position ``i`` of the stream is the ``i``-th prompt of the walk's pool (prompts are
    presampled when first reached, :meth:`LazyWalk.extend`); once the pool is final (the
    walk's target reached or its prompts run out), later positions go through it again, a
    permutation seeded by ``(seed, epoch)`` each epoch. A stream built at cursor
    ``consumed`` (a resumed run) re-walks to it, reading every row from the store.
    """

    def __init__(
        self,
        walk: LazyWalk,
        seed: int,
        consumed: int = 0,
        on_take: Callable[[int, list[Record], list[bool]], None] | None = None,
    ) -> None:
        self.walk, self.seed, self.consumed, self.on_take = walk, seed, consumed, on_take
        self._records(0, consumed)

    @property
    def records(self) -> list[Record]:  # type: ignore[override]
        """The pool so far, in walk order."""
        return self.walk.kept

    def _records(self, start: int, k: int) -> list[Record]:
        self.walk.extend(start + k)
        pool = self.walk.kept
        if k and not pool:
            raise ValueError(
                f"group sampling kept none of the {self.walk.walked} prompts walked: the "
                "reference solves them all, or never and no teacher covers them "
                "(pvpo.keep_unsolved=true keeps those)"
            )
        out = []
        for i in range(start, start + k):
            if i < len(pool):
                out.append(pool[i])
                continue
            epoch, pos = divmod(i - len(pool), len(pool))
            perm = np.random.default_rng((self.seed, epoch + 1)).permutation(len(pool))
            out.append(pool[int(perm[pos])])
        return out

    def peek(self, k: int) -> list[Record]:
        return self._records(self.consumed, k)

    def take(self, k: int) -> list[Record]:
        """The next ``k`` prompts; ``on_take(first position, prompts, first draw of each)``
        is told which ones the run draws for the first time (first epoch)."""
        start = self.consumed
        out = self._records(start, k)
        self.consumed += k
        if self.on_take is not None:
            first = [start + i < len(self.walk.kept) for i in range(k)]
            self.on_take(start, out, first)
        return out


class ReusingEngine:
    """The run's engine, except that the groups named in :attr:`plan` (group index -> a
    prompt's kept presampled rollouts, one group of ``rollout.n`` rows) are served from
    those rows instead of being sampled, for the next ``rollout`` call only. Every other
    attribute is the wrapped engine's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.plan: dict[int, RolloutBatch] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Any] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """The wrapped engine's rollouts of the requests not in the plan, and the planned
        groups' kept rows, in request order (group-major)."""
        plan, self.plan = self.plan, {}
        if not plan:
            return self.engine.rollout(requests, params, tools, instruction)
        fresh = [r for r in requests if r.group not in plan]
        parts = [self.engine.rollout(fresh, params, tools, instruction)] if fresh else []
        asked = Counter(r.group for r in requests)
        for g, rows in plan.items():
            if asked[g] != len(rows):
                raise RuntimeError(
                    f"group {g}: {asked[g]} rollouts requested, {len(rows)} presampled planned"
                )
            parts.append(dataclasses.replace(rows, group=torch.full_like(rows.group, g)))
        out = RolloutBatch.cat(parts)
        return out.select(torch.argsort(out.group, stable=True))
