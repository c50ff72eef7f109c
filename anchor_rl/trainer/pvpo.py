"""PVPO in the trainer: the :class:`PVPO` component over :mod:`anchor_rl.methods.pvpo`.

The method's decisions (anchor seed, presampling walk, group sampling, teacher rows,
refresh) live in :mod:`anchor_rl.methods.pvpo`, shared with the TRL and verl plug-ins; this
module connects them to a run: :func:`presample_anchors` at set-up, then the :class:`PVPO`
component (group sampling, refreshes, teacher rows scored by the task's verifier like any
rollout, ``anchor[B]`` for the advantage). Shapes: P prompts, B responses, T response tokens.

The reference is ``ref_model`` or the initial policy (``model`` loaded again), the same
frozen model the KL term uses. Presampling uses the training rollout settings.

Rollout accounting: ``rollouts/presample`` and ``rollouts/refresh`` count the rollouts the
anchors in use rest on (the sum of ``n`` over their prompts), whether this process sampled
them or found them in the store, so a run's totals do not depend on the cache and a
resumed run counts exactly what an uninterrupted one does. What this process really
sampled is in ``RUN_DIR/pvpo.json``, ``pvpo/refresh_sampled`` and the run's cumulative
``pvpo/anchors_sampled`` (not in ``rollouts/total``; :mod:`anchor_rl.bench.sweep`). A model
teacher's generations behind the trajectories (failed tries included) are
``rollouts/teacher``; the oracle generates nothing and costs none. All three join
``rollouts/total``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.anchors.filter import FilterResult
from anchor_rl.anchors.keys import AnchorKey, fingerprint_model, task_identity
from anchor_rl.anchors.presample import (
    RolloutSampler,
    Sampler,
    presample_key,
    task_params,
)
from anchor_rl.anchors.records import AnchorStat, TeacherTrajectory, anchor_values
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.anchors.teachers import (
    Teacher,
    teacher_batch,
    teacher_key,
)
from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.asynchronous import truncated_is_weights
from anchor_rl.errors import ConfigError
from anchor_rl.methods.pvpo import (
    FILTER_FILE,
    AnchorSet,
    LazyWalk,
    PooledAnchors,
    anchor_rollouts,
    anchor_seed,
    group_sampling,
    leave_one_out_anchor,
    pool_target,
    presample_cost_note,
    presample_set,
    pvpo_teacher,
    refresh_due,
    teacher_rows,
    trainable,
    walk_order,
)
from anchor_rl.paths import store_path
from anchor_rl.rollout.engine import close_engine
from anchor_rl.rollout.spec import frozen, load_spec
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task
from anchor_rl.trainer.collect import Scored, sampling_params, score
from anchor_rl.trainer.component import Component, Setup, Step
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.pvpo_lazy import LazyPrompts, ReusingEngine, lazy_walk
from anchor_rl.trainer.update import token_mean

_log = logging.getLogger(__name__)
RUN_FILE = "pvpo.json"


def presample_params(cfg: TrainConfig, task: Task) -> SamplingParams:
    """The sampling settings of presampling and refreshes: the training rollout's."""
    return task_params(sampling_params(cfg, task), task)


def reference_key(
    cfg: TrainConfig, task: Task, tokenizer: PreTrainedTokenizerBase, reference: PreTrainedModel
) -> AnchorKey:
    """The store key of a run's presampled anchors: reference weights, tokenizer, settings
    (the anchor seed among them), task."""
    task_id = task_identity(cfg.task, task, cfg.task_args)
    params = presample_params(cfg, task)
    return presample_key(reference, tokenizer, params, task_id, seed=anchor_seed(cfg.pvpo))


def batch_anchors(anchors: Mapping[str, AnchorStat], scored: Scored) -> Tensor:
    """FloatTensor[B]: the anchor ``V_sta`` of each response's prompt (``scored.records[group]``)."""
    return anchor_values(anchors, [r.id for r in scored.records])[scored.batch.group]


def inject_teachers(
    scored: Scored,
    trajectories: Mapping[str, TeacherTrajectory],
    task: Task,
    cfg: TrainConfig,
) -> Scored:
    """Replace the last rollout of every group whose prompt has a teacher trajectory by it.

    The teacher row keeps its position, group and prompt; its ``logprobs`` are log pi_gt and
    it is marked ``off_policy``, so the update takes its ratio against pi_gt. Its reward and
    verdict come from ``collect.score``, the task's verifier, like any rollout's.
    """
    batch = scored.batch
    groups, rows = teacher_rows(batch.group, [r.id for r in scored.records], trajectories)
    if not groups:
        return scored
    teacher = teacher_batch(
        [trajectories[scored.records[g].id] for g in groups],
        [batch.prompt_ids[r] for r in rows],
        groups,
        batch.pad_id,
    )
    graded = score(task, teacher, scored.records, cfg)
    order = torch.arange(len(batch))
    order[rows] = len(batch) + torch.arange(len(rows))
    return Scored(
        batch=RolloutBatch.cat([batch, teacher]).select(order),
        records=scored.records,
        draws=scored.draws,
        rewards=torch.cat([scored.rewards, graded.rewards])[order],
        task_rewards=torch.cat([scored.task_rewards, graded.task_rewards])[order],
        correct=torch.cat([scored.correct, graded.correct])[order],
        off_policy=torch.cat([scored.off_policy, torch.ones(len(rows), dtype=torch.bool)])[order],
    )


def presample_anchors(setup: Setup, lazy: bool = False) -> AnchorSet | LazyWalk:
    """Presample the reference ``pvpo.m`` times on the run's training prompts (rows already in
    ``pvpo.store`` under the same key are reused): those ``pvpo.prompts`` names
    (:func:`pool_target`), walked in :func:`walk_order`. A resumed run walks to the target
    it started with (``RUN_DIR/pvpo.json``), so resuming with more ``steps`` draws the same
    prompts for more epochs. With ``pvpo.presample = "lazy"`` nothing is sampled here: the
    returned :class:`LazyWalk` presamples as the run draws (:class:`LazyPrompts`); only
    the PVPO component takes one (``lazy``), other callers get a ConfigError."""
    cfg, task = setup.cfg, setup.task
    draws = cfg.steps * cfg.rollout.prompts_per_step
    target = pool_target(cfg.pvpo, draws, len(setup.records))
    if setup.resuming:
        target = _started_with(setup.run_dir, target)
    seed = anchor_seed(cfg.pvpo)
    if cfg.pvpo.presample == "lazy":
        if not lazy:
            raise ConfigError(
                "pvpo.presample=lazy is built for PVPO's own anchors only; this method reads "
                "the anchors at run start: use pvpo.presample=upfront"
            )
        params = presample_params(cfg, task)

        def teacher(reference: PreTrainedModel | None) -> Teacher | None:
            return build_teacher(cfg, task, setup.tokenizer, reference, params)

        return lazy_walk(setup, target, seed, params, teacher)
    records = setup.records if target is None else walk_order(setup.records, seed)
    if target is None:
        note = presample_cost_note(len(records), cfg.pvpo.m, draws, draws * cfg.rollout.n)
        if note:
            _log.warning(note)
    reference = setup.get_reference()
    return presample_set(
        reference, setup.tokenizer, task, task_identity(cfg.task, task, cfg.task_args),
        presample_params(cfg, task), records, AnchorStore(store_path(cfg.pvpo.store)), cfg.pvpo,
        cfg.engine, cfg.log.progress, seed=seed, target=target,
        keep=trainable(cfg.pvpo, cfg.filter.kind == "group"),
    )  # fmt: skip


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _started_with(run_dir: Path, target: int | None) -> int | None:
    """The walk target a run recorded when it started (``target`` for a run that has none)."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return target
    return json.loads(path.read_text()).get("walk_target", target)


def build_teacher(
    cfg: TrainConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel | None,
    params: SamplingParams,
) -> Teacher | None:
    """The teacher ``pvpo.teacher`` names, or None; see ``PVPOConfig.teacher``."""
    if cfg.pvpo.teacher is None:
        return None

    def load_model(spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        model, teacher_tokenizer = load_spec(
            spec, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
        )
        return frozen(model), teacher_tokenizer

    return pvpo_teacher(cfg.pvpo, task, tokenizer, reference, params, load_model)


class PVPO(Component):
    """PVPO's static anchors, group sampling, teacher rows and refreshes in a run.

    records: the training prompts (after group sampling).
    anchors: prompt id -> statistics of the anchors in use (presampled or last refreshed),
        stored under ``anchor_key``.
    trajectories: prompt id -> teacher trajectory, for group sampling's accuracy-0 prompts.
    """

    name = "pvpo"

    lazy: LazyWalk | None = None
    """The walk of a lazy-presampling run (``pvpo.presample = "lazy"``), else None."""

    def __init__(self, setup: Setup, anchor_set: AnchorSet | LazyWalk) -> None:
        """Group sampling on ``anchor_set`` (with ``filter.kind = "group"``), then the anchors
        of the kept prompts. A new run writes ``RUN_DIR/pvpo.json`` (and ``pvpo_filter.json``
        with group sampling, also printed beside the paper's distributions). A
        :class:`LazyWalk` defers both to the run's draws (:meth:`prompt_stream`)."""
        cfg = setup.cfg
        self.cfg, self.task, self.tokenizer = cfg, setup.task, setup.tokenizer
        self.policy, self.engine, self.run_dir = setup.policy, setup.engine, setup.run_dir
        self.pooled = PooledAnchors() if cfg.pvpo.anchor_update == "pooled" else None
        self.reusing: ReusingEngine | None = None
        self._reused = torch.zeros(0, dtype=torch.bool)  # this step's reused rows [B]
        self.sampled_before = self.refresh_sampled = 0  # see anchors_sampled
        if isinstance(anchor_set, LazyWalk):
            self._start_lazy(setup, anchor_set)
            return
        self.set = anchor_set
        kept, self.trajectories = list(anchor_set.records), {}
        filtered = None
        if cfg.filter.kind == "group":
            filtered = _group_sampling(setup, anchor_set)
            kept = filtered.records
        self.records = anchor_set.pool(kept)
        if filtered is not None:
            ids = {r.id for r in self.records}
            self.trajectories = {k: t for k, t in filtered.trajectories.items() if k in ids}
        self.presample_rollouts, self.refresh_rollouts = anchor_set.rollouts, 0
        self.teacher_rollouts = 0 if filtered is None else filtered.stats.teacher_rollouts
        self._use(anchor_set.key.digest)
        if not setup.resuming:
            write_presample_report(setup.run_dir, cfg, anchor_set, self.records, filtered)
        if cfg.log.progress:
            console = Console()
            if filtered is not None and not setup.resuming:
                filtered.print(console)
            result = anchor_set.result
            walk = "" if anchor_set.target is None else f" (walked for {anchor_set.target})"
            console.print(
                f"PVPO: {len(anchor_set.records)} prompts{walk} x M={cfg.pvpo.m} presampled in "
                f"{anchor_set.seconds:.1f}s ({result.rollouts} rollouts sampled now, "
                f"{result.prompts_reused} prompts reused) -> {len(self.records)} training "
                f"prompts; store {anchor_set.store.path}"
            )

    def _start_lazy(self, setup: Setup, walk: LazyWalk) -> None:
        """A lazy-presampling run: the pool, anchors and trajectories grow with the walk."""
        self.lazy = walk
        self.records, self.anchors, self.trajectories = walk.kept, walk.stats, walk.trajectories
        self.anchor_key, self.refresh_rollouts = walk.key.digest, 0
        self._first_draws: set[int] = set()  # stream positions served from kept rollouts
        if self.cfg.pvpo.reuse_presample:
            if self.cfg.cluster.async_steps:
                raise ConfigError(
                    "pvpo.reuse_presample with cluster.async_steps (not built): a prefetched "
                    "step would sample the groups the presampled rollouts replace"
                )
            self.reusing = setup.engine = ReusingEngine(setup.engine)
        if not setup.resuming:
            self._write_lazy_report()
        if self.cfg.log.progress:
            Console().print(
                f"PVPO: anchors presampled as the run draws (pvpo.presample=lazy, M="
                f"{self.cfg.pvpo.m}, walk target {walk.target}); store {walk.store.path}"
            )

    @property
    def needs_logp(self) -> bool:  # type: ignore[override]
        """The teacher-token metrics read ``step.logp`` when the run has teacher rows, and so
        do the importance weights of reused presampled rows."""
        return bool(self.trajectories) or getattr(self, "reusing", None) is not None

    @property
    def presample_rollouts(self) -> int:
        """Reference rollouts the anchors in use rest on (a lazy walk's walked prompts)."""
        return self.lazy.rollouts if self.lazy is not None else self._presample_rollouts

    @presample_rollouts.setter
    def presample_rollouts(self, value: int) -> None:
        self._presample_rollouts = value

    @property
    def anchors_sampled(self) -> int:
        """Reference rollouts the run sampled itself for its anchors, presampling and refreshes
        over its processes (the rest of presample + refresh rollouts was read from the store)."""
        now = self.lazy.sampled_now if self.lazy is not None else self.set.result.rollouts
        return self.sampled_before + now + self.refresh_sampled

    @property
    def teacher_rollouts(self) -> int:
        """A model teacher's generations behind the walked accuracy-0 prompts' outcomes."""
        return self.lazy.teacher_rollouts if self.lazy is not None else self._teacher_rollouts

    @teacher_rollouts.setter
    def teacher_rollouts(self, value: int) -> None:
        self._teacher_rollouts = value

    def prompt_stream(self, seed: int, consumed: int) -> PromptSampler | None:
        """A lazy run's stream (:class:`LazyPrompts`, re-walked to ``consumed``); else None."""
        if self.lazy is None:
            return None
        on_take = self._plan_reuse if self.reusing is not None else None
        return LazyPrompts(self.lazy, seed, consumed, on_take)

    def _plan_reuse(self, start: int, records: list[Record], first: list[bool]) -> None:
        """Serve each first-drawn prompt's group from its kept presampled rollouts (the next
        engine call's), where the store keeps them."""
        assert self.lazy is not None and self.reusing is not None
        plan = {}
        for i, (record, new) in enumerate(zip(records, first, strict=True)):
            kept = self.lazy.first_group(record, self.cfg.rollout.n) if new else None
            if kept is not None:
                plan[i] = kept[0]
                self._first_draws.add(start + i)
        self.reusing.plan = plan

    def _mark_reused(self, step: Step) -> dict[str, float]:
        """Which of the step's rows are reused presampled rollouts (before teacher rows
        replace any): they were not sampled now, so they leave ``rollouts/step``."""
        scored = step.scored
        draws = scored.draws or []
        groups = [g for g, d in enumerate(draws) if d in self._first_draws]
        self._first_draws.difference_update(draws)
        self._reused = torch.isin(scored.batch.group, torch.tensor(groups, dtype=torch.long))
        count = int(self._reused.sum())
        step.metrics["rollouts/step"] -= count
        return {
            "pvpo/reused_rows": float(count),
            "pvpo/reuse_staleness": float(step.index - 1) if count else 0.0,
        }

    def _write_lazy_report(self) -> None:
        """``pvpo.json`` of a lazy run: the walk so far (rewritten when the run closes)."""
        walk = self.lazy
        assert walk is not None
        summary = {
            "store": str(walk.store.path),
            "key": walk.key.digest,
            "m": self.cfg.pvpo.m,
            "presample_mode": "lazy",
            "prompts": walk.walked,
            "training_prompts": len(walk.kept),
            "presample": {"rollouts": walk.rollouts, "rollouts_sampled_now": walk.sampled_now},
            "reference_accuracy": _mean([stat.accuracy for stat in walk.stats.values()]),
            "anchor_mean": _mean([stat.mean for stat in walk.stats.values()]),
            "teacher": self.cfg.pvpo.teacher if self.cfg.filter.kind == "group" else None,
            "teacher_trajectories": len(walk.trajectories),
            "teacher_rollouts": walk.teacher_rollouts,
            "walk_target": walk.target,
        }
        (Path(self.run_dir) / RUN_FILE).write_text(json.dumps(summary, indent=2) + "\n")

    def _use(self, digest: str) -> None:
        """Train against the anchors stored under ``digest`` (presampled or refreshed)."""
        store = self.set.store
        anchors = store.get_anchors(digest, [r.id for r in self.records])
        if len(anchors) < len(self.records):
            raise RuntimeError(
                f"{len(self.records) - len(anchors)} training prompts have no anchors under "
                f"{digest} in {store.path}, the anchors this run was using; it cannot continue "
                "without them"
            )
        self.anchor_key, self.anchors = digest, anchors
        m = self.cfg.pvpo.m
        if over := [stat.n for stat in anchors.values() if stat.n > m]:
            _log.warning(
                "%d of %d training prompts' anchors rest on more than pvpo.m = %d rollouts "
                "(up to %d) in %s: a run with a larger pvpo.m topped them up, and this run "
                "uses every stored rollout, so its anchors, group sampling and "
                "rollouts/presample differ from a fresh store's (and, on resume, from the "
                "run's own before); give each experiment its own pvpo.store to keep them apart",
                len(over), len(anchors), m, max(over), store.path,
            )  # fmt: skip

    def training_records(self, records: list[Record]) -> list[Record]:
        return self.records

    def on_rollouts(self, step: Step) -> None:
        """The refresh when due (the refreshed anchors serve this step onwards), then teacher
        rows; adds the ``pvpo/*`` metrics."""
        metrics = self.refresh(step.index - 1) if refresh_due(self.cfg.pvpo, step.index - 1) else {}
        if self.reusing is not None:
            metrics |= self._mark_reused(step)
        step.scored = inject_teachers(step.scored, self.trajectories, self.task, self.cfg)
        if self.reusing is not None:
            self._reused = self._reused & ~step.scored.off_policy  # teacher rows are not
            if self.cfg.pvpo.reuse_correction == "none":  # the ratio against pi_reference
                off = step.scored.off_policy | self._reused
                step.scored = dataclasses.replace(step.scored, off_policy=off)
        metrics["pvpo/teacher_rows"] = float(step.scored.off_policy.sum())
        if len(step.scored):
            metrics["pvpo/anchor_mean"] = self.batch_anchors(step.scored).mean().item()
        step.metrics |= metrics

    def batch_anchors(self, scored: Scored) -> Tensor:
        """FloatTensor[B]: the anchor of each response's prompt."""
        return batch_anchors(self.anchors, scored)

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``anchor[B]``; a reused presampled row's is the mean of its prompt's other
        presampled rewards (:func:`leave_one_out_anchor`); with ``pvpo.anchor_update =
        pooled``, each row's leave-one-out mean of its prompt's pool (:class:`PooledAnchors`),
        which the step's policy rows then join."""
        scored = step.scored
        if self.pooled is not None:
            reused = (
                self._reused
                if self.reusing is not None
                else torch.zeros(len(scored), dtype=torch.bool)
            )
            ids, group = [r.id for r in scored.records], scored.batch.group
            fresh = ~scored.off_policy & ~reused
            anchor = self.pooled.baselines(
                self.anchors, ids, group, scored.task_rewards, fresh, reused
            )
            self.pooled.add(ids, group, scored.task_rewards, fresh)
            return {"anchor": anchor}
        anchor = self.batch_anchors(scored)
        if self.reusing is not None and bool(self._reused.any()):
            rows = self._reused.nonzero().flatten()
            stats = [self.anchors[scored.records[g].id] for g in scored.batch.group[rows].tolist()]
            for row, stat in zip(rows.tolist(), stats, strict=True):
                anchor[row] = leave_one_out_anchor(stat, scored.task_rewards[row : row + 1])[0]
        return {"anchor": anchor}

    def on_advantages(self, step: Step) -> None:
        """``pvpo/teacher_logp``: the policy's mean log-prob per teacher token before this
        step's update (how far it has learned the teacher's tokens), and
        ``pvpo/teacher_behaviour_logp``, the mean log pi_gt the ratio is taken against."""
        if self.reusing is not None and self.cfg.pvpo.reuse_correction == "tis":
            self._weigh_reused(step)
        rows = step.scored.off_policy
        if step.logp is None or step.mask is None or not bool(rows.any()):
            return
        mask = step.mask[rows]
        step.metrics["pvpo/teacher_logp"] = token_mean(step.logp[rows], mask)
        behaviour = step.scored.batch.logprobs[rows]
        step.metrics["pvpo/teacher_behaviour_logp"] = token_mean(behaviour, mask)

    def _weigh_reused(self, step: Step) -> None:
        """``pvpo.reuse_correction = tis``: each reused row's token advantages times
        min(pi_current / pi_reference, ``pvpo.reuse_tis_cap``), the asynchronous path's
        truncated importance weights (the ratio's denominator is the current policy's)."""
        if step.logp is None or step.mask is None or step.advantages is None:
            return
        if not bool(self._reused.any()):
            return
        rows = step.mask * self._reused[:, None]
        batch = step.scored.batch
        weights, tis = truncated_is_weights(
            step.logp, batch.logprobs, rows, self.cfg.pvpo.reuse_tis_cap
        )
        step.advantages = step.advantages * (weights + step.mask * ~self._reused[:, None])
        step.metrics["pvpo/reuse_tis_weight_mean"] = tis["async/tis_weight_mean"]
        step.metrics["pvpo/reuse_tis_capped_frac"] = tis["async/tis_capped_frac"]

    def refresh(self, completed: int) -> dict[str, float]:
        """Re-estimate the anchors of the training prompts after ``completed`` steps
        (``pvpo.refresh_mode``).

        ``policy`` mode samples the current policy (through the run's engine, which has its
        weights); the refresh key carries its weight fingerprint, so a resumed run finds the
        rows it stored before and samples nothing.
        """
        pc = self.cfg.pvpo
        started = time.perf_counter()
        if pc.refresh_mode == "policy":
            sampler: Sampler = RolloutSampler(self.engine, self.task, self.set.params)
            fingerprint = fingerprint_model(self.policy)
        else:
            sampler, fingerprint = None, None
        result = self.set.refresh(self.records, pc, completed, sampler, fingerprint)
        self.anchor_key, self.anchors = result.key.digest, result.anchors
        self.refresh_rollouts += anchor_rollouts(result.anchors, self.records)
        self.refresh_sampled += result.rollouts
        return {
            "pvpo/refresh_sampled": float(result.rollouts),
            "pvpo/refresh_seconds": time.perf_counter() - started,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {
            "anchor_key": self.anchor_key,
            "presample_rollouts": self.presample_rollouts,
            "refresh_rollouts": self.refresh_rollouts,
            "anchors_sampled": self.anchors_sampled,
        }
        if self.pooled is not None:
            state["pooled"] = self.pooled.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the anchors the run was using (those of its last refresh, if any).
        A lazy run's walk was re-walked to the checkpoint's cursor (:class:`LazyPrompts`)."""
        if self.pooled is not None and "pooled" in state:
            self.pooled.load_state_dict(state["pooled"])
        self.sampled_before = int(state.get("anchors_sampled", 0))  # earlier processes'
        if self.lazy is not None:
            if state["anchor_key"] != self.anchor_key:
                raise RuntimeError(
                    f"the checkpoint's anchors are under {state['anchor_key']}, this run's "
                    f"lazy walk under {self.anchor_key}"
                )
            return
        self.presample_rollouts = int(state["presample_rollouts"])
        self.refresh_rollouts = int(state["refresh_rollouts"])
        self._use(state["anchor_key"])

    def close(self) -> None:
        """Close the reference's presampling engine (its own, built by :func:`presample_set`);
        a lazy run rewrites ``pvpo.json`` with its walk."""
        if self.lazy is not None:
            self._write_lazy_report()
        source = self.set if self.lazy is None else self.lazy
        close_engine(getattr(source.sampler, "engine", None))

    def counters(self) -> dict[str, float]:
        return {
            "rollouts/presample": float(self.presample_rollouts),
            "rollouts/refresh": float(self.refresh_rollouts),
            "rollouts/teacher": float(self.teacher_rollouts),
            "pvpo/anchors_sampled": float(self.anchors_sampled),
        }


def _group_sampling(setup: Setup, anchor_set: AnchorSet) -> FilterResult:
    cfg, task = setup.cfg, setup.task
    reference = setup.get_reference() if cfg.pvpo.teacher == "oracle:reference" else None
    teacher = build_teacher(cfg, task, setup.tokenizer, reference, anchor_set.params)
    tkey = (
        None
        if teacher is None
        else teacher_key(teacher, task_identity(cfg.task, task, cfg.task_args))
    )
    return group_sampling(
        anchor_set.records, anchor_set.stats, teacher, anchor_set.store, tkey,
        cfg.pvpo.keep_unsolved, cfg.pvpo.teacher, cfg.log.progress,
    )  # fmt: skip


def write_presample_report(
    run_dir: Path,
    cfg: TrainConfig,
    anchor_set: AnchorSet,
    train: Sequence[Record],
    filtered: FilterResult | None,
) -> None:
    """``pvpo.json``: what presampling did and cost; ``pvpo_filter.json``: group sampling's stats."""
    stats, records, result = anchor_set.stats, anchor_set.records, anchor_set.result
    values = [stats[r.id] for r in records]
    summary = {
        "store": str(anchor_set.store.path),
        "key": anchor_set.key.digest,
        "m": cfg.pvpo.m,
        "prompts": len(records),
        "training_prompts": len(train),
        "presample": {
            "rollouts": anchor_set.rollouts,
            "rollouts_sampled_now": result.rollouts,
            "prompts_sampled_now": result.prompts_sampled,
            "prompts_reused": result.prompts_reused,
            "seconds": anchor_set.seconds,
        },
        "reference_accuracy": sum(s.accuracy for s in values) / len(values),
        "anchor_mean": sum(s.mean for s in values) / len(values),
        "teacher": cfg.pvpo.teacher if filtered is not None else None,
        "teacher_trajectories": 0 if filtered is None else len(filtered.trajectories),
        "teacher_samples_now": 0 if filtered is None else filtered.stats.teacher_samples,
        "teacher_rollouts": 0 if filtered is None else filtered.stats.teacher_rollouts,
        "walk_target": anchor_set.target,
    }
    (Path(run_dir) / RUN_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if filtered is not None:
        filtered.stats.save(Path(run_dir) / FILTER_FILE)
