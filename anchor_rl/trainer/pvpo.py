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
sampled is in ``RUN_DIR/pvpo.json`` and the ``pvpo/refresh_sampled`` metric. A model
teacher's generations behind the trajectories (failed tries included) are
``rollouts/teacher``; the oracle generates nothing and costs none. All three join
``rollouts/total``.
"""

from __future__ import annotations

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
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory, anchor_values
from anchor_rl.anchors.teachers import (
    Teacher,
    teacher_batch,
    teacher_key,
)
from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.pvpo import (
    FILTER_FILE,
    AnchorSet,
    anchor_rollouts,
    anchor_seed,
    group_sampling,
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


def presample_anchors(setup: Setup) -> AnchorSet:
    """Presample the reference ``pvpo.m`` times on the run's training prompts (rows already in
    ``pvpo.store`` under the same key are reused): those ``pvpo.prompts`` names
    (:func:`pool_target`), walked in :func:`walk_order`. A resumed run walks to the target
    it started with (``RUN_DIR/pvpo.json``), so resuming with more ``steps`` draws the same
    prompts for more epochs."""
    cfg, task = setup.cfg, setup.task
    draws = cfg.steps * cfg.rollout.prompts_per_step
    target = pool_target(cfg.pvpo, draws, len(setup.records))
    if setup.resuming:
        target = _started_with(setup.run_dir, target)
    seed = anchor_seed(cfg.pvpo)
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

    def __init__(self, setup: Setup, anchor_set: AnchorSet) -> None:
        """Group sampling on ``anchor_set`` (with ``filter.kind = "group"``), then the anchors
        of the kept prompts. A new run writes ``RUN_DIR/pvpo.json`` (and ``pvpo_filter.json``
        with group sampling, also printed beside the paper's distributions)."""
        cfg = setup.cfg
        self.cfg, self.task, self.tokenizer = cfg, setup.task, setup.tokenizer
        self.policy, self.engine, self.set = setup.policy, setup.engine, anchor_set
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
        self.needs_logp = bool(self.trajectories)  # the teacher-token metrics read step.logp
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
        step.scored = inject_teachers(step.scored, self.trajectories, self.task, self.cfg)
        metrics["pvpo/teacher_rows"] = float(step.scored.off_policy.sum())
        if len(step.scored):
            metrics["pvpo/anchor_mean"] = self.batch_anchors(step.scored).mean().item()
        step.metrics |= metrics

    def batch_anchors(self, scored: Scored) -> Tensor:
        """FloatTensor[B]: the anchor of each response's prompt."""
        return batch_anchors(self.anchors, scored)

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        return {"anchor": self.batch_anchors(step.scored)}

    def on_advantages(self, step: Step) -> None:
        """``pvpo/teacher_logp``: the policy's mean log-prob per teacher token before this
        step's update (how far it has learned the teacher's tokens), and
        ``pvpo/teacher_behaviour_logp``, the mean log pi_gt the ratio is taken against."""
        rows = step.scored.off_policy
        if step.logp is None or step.mask is None or not bool(rows.any()):
            return
        mask = step.mask[rows]
        step.metrics["pvpo/teacher_logp"] = token_mean(step.logp[rows], mask)
        behaviour = step.scored.batch.logprobs[rows]
        step.metrics["pvpo/teacher_behaviour_logp"] = token_mean(behaviour, mask)

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
        return {
            "pvpo/refresh_sampled": float(result.rollouts),
            "pvpo/refresh_seconds": time.perf_counter() - started,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "anchor_key": self.anchor_key,
            "presample_rollouts": self.presample_rollouts,
            "refresh_rollouts": self.refresh_rollouts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the anchors the run was using (those of its last refresh, if any)."""
        self.presample_rollouts = int(state["presample_rollouts"])
        self.refresh_rollouts = int(state["refresh_rollouts"])
        self._use(state["anchor_key"])

    def close(self) -> None:
        """Close the reference's presampling engine (its own, built by :func:`presample_set`)."""
        close_engine(getattr(self.set.sampler, "engine", None))

    def counters(self) -> dict[str, float]:
        return {
            "rollouts/presample": float(self.presample_rollouts),
            "rollouts/refresh": float(self.refresh_rollouts),
            "rollouts/teacher": float(self.teacher_rollouts),
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
