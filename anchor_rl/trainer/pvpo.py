"""PVPO in the trainer (arXiv 2508.21104): static anchors, group sampling, teacher rows, refresh.

The data side lives in :mod:`anchor_rl.anchors` (docs/pvpo.md); this module wires it into
a run. Shapes: P prompts, B responses, T response tokens.

    run start   setup_pvpo       presample the reference M times per training prompt into the
                                 anchor store (rows under the same key are reused), then, with
                                 filter.kind = "group", group sampling: drop acc = 1, keep
                                 0 < acc < 1, ask the teacher for acc = 0
    each step   PVPO.step        every pvpo.refresh_every steps re-estimate the anchors; a
                                 prompt's cached teacher trajectory replaces one of its N
                                 rollouts and is scored by the task's verifier like any rollout
                batch_anchors    V_sta of each response's prompt, for ``advantages.pvpo``

The reference is ``ref_model`` or the initial policy (``model`` loaded again), the same
frozen model the KL term uses. Presampling uses the training rollout settings.

Rollout accounting (``TrainState``): ``presample_rollouts`` and ``refresh_rollouts`` count
the rollouts the anchors in use rest on (the sum of ``n`` over their prompts), whether this
process sampled them or found them in the store, so a run's totals do not depend on the
cache and a resumed run counts exactly what an uninterrupted one does. What this process
really sampled is in ``RUN_DIR/pvpo.json`` and the ``pvpo/refresh_sampled`` metric. Teacher
samples are rollouts of neither the policy nor the reference and are reported apart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.anchors.filter import FilterResult, group_filter
from anchor_rl.anchors.keys import AnchorKey, fingerprint_model, task_identity
from anchor_rl.anchors.presample import (
    PresampleResult,
    RolloutSampler,
    Sampler,
    presample,
    presample_key,
    refresh_anchors,
    task_params,
)
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory, anchor_values
from anchor_rl.anchors.teachers import (
    HFTeacher,
    OpenAITeacher,
    OracleTeacher,
    Teacher,
    teacher_batch,
    teacher_key,
)
from anchor_rl.models.sft import cache_root
from anchor_rl.models.spec import frozen, load_spec
from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.types import RolloutBatch, SamplingParams
from anchor_rl.tasks.base import Record, Task
from anchor_rl.trainer.checkpoint import TrainState
from anchor_rl.trainer.collect import Scored, sampling_params, score
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.pvpo_config import PVPOConfig

PRESAMPLE_SEED = 0
"""Base seed of presampling, refresh and HF teachers. Fixed, so the anchors are a function of
their key alone: every seed of a sweep trains against the same anchors, as it starts from
the same SFT reference."""
STORE_FILE = "anchors.db"
RUN_FILE = "pvpo.json"
FILTER_FILE = "pvpo_filter.json"


def uses_pvpo(cfg: TrainConfig) -> bool:
    """Whether a run needs presampled anchors: the PVPO advantage or group sampling."""
    return cfg.advantage.estimator == "pvpo" or cfg.filter.kind == "group"


def store_path(cfg: PVPOConfig) -> Path:
    """``pvpo.store``, or the shared ``$ANCHOR_RL_CACHE/anchors.db``."""
    return Path(cfg.store) if cfg.store else cache_root() / STORE_FILE


def presample_params(cfg: TrainConfig, task: Task) -> SamplingParams:
    """The sampling settings of presampling and refreshes: the training rollout's."""
    return task_params(sampling_params(cfg, task), task)


def reference_key(
    cfg: TrainConfig, task: Task, tokenizer: PreTrainedTokenizerBase, reference: PreTrainedModel
) -> AnchorKey:
    """The store key of a run's presampled anchors: reference weights, tokenizer, settings, task."""
    task_id = task_identity(cfg.task, task, cfg.task_args)
    return presample_key(reference, tokenizer, presample_params(cfg, task), task_id)


def batch_anchors(anchors: Mapping[str, AnchorStat], scored: Scored) -> Tensor:
    """FloatTensor[B]: the anchor ``V_sta`` of each response's prompt (``scored.records[group]``)."""
    return anchor_values(anchors, [r.id for r in scored.records])[scored.batch.group]


def anchor_rollouts(anchors: Mapping[str, AnchorStat], records: Sequence[Record]) -> int:
    """Rollouts the anchors of ``records`` rest on: the sum of their ``n``."""
    return sum(anchors[r.id].n for r in records)


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
    groups = [g for g, r in enumerate(scored.records) if r.id in trajectories]
    if not groups:
        return scored
    batch = scored.batch
    rows = [int((batch.group == g).nonzero()[-1]) for g in groups]
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
        rewards=torch.cat([scored.rewards, graded.rewards])[order],
        task_rewards=torch.cat([scored.task_rewards, graded.task_rewards])[order],
        correct=torch.cat([scored.correct, graded.correct])[order],
        off_policy=torch.cat([scored.off_policy, torch.ones(len(rows), dtype=torch.bool)])[order],
    )


def refresh_due(cfg: PVPOConfig, step: int) -> bool:
    """Whether the anchors are re-estimated after ``step`` completed steps."""
    return cfg.refresh_every > 0 and step > 0 and step % cfg.refresh_every == 0


@dataclass
class PVPO:
    """A run's PVPO state.

    key: the presample key (the reference, tokenizer, sampling settings and task).
    sampler: the reference's sampler (presampling and ``reference``-mode refreshes).
    records: the training prompts (after group sampling).
    anchors: prompt id -> statistics of the anchors in use (presampled or last refreshed).
    trajectories: prompt id -> teacher trajectory, for group sampling's accuracy-0 prompts.
    """

    cfg: TrainConfig
    task: Task
    tokenizer: PreTrainedTokenizerBase
    store: AnchorStore
    key: AnchorKey
    params: SamplingParams
    sampler: Sampler
    records: list[Record]
    anchors: dict[str, AnchorStat]
    trajectories: dict[str, TeacherTrajectory]

    def batch_anchors(self, scored: Scored) -> Tensor:
        """FloatTensor[B]: the anchor of each response's prompt."""
        return batch_anchors(self.anchors, scored)

    def step(
        self, scored: Scored, state: TrainState, policy: PreTrainedModel
    ) -> tuple[Scored, dict[str, float]]:
        """The step's PVPO work on its scored rollouts: the refresh when due, teacher rows.

        ``state.step`` is the number of completed steps; the refreshed anchors serve this
        step onwards. Returns the batch with teacher rows and the ``pvpo/*`` metrics.
        """
        metrics = self.refresh(state, policy) if refresh_due(self.cfg.pvpo, state.step) else {}
        scored = inject_teachers(scored, self.trajectories, self.task, self.cfg)
        metrics["pvpo/teacher_rows"] = float(scored.off_policy.sum())
        if len(scored):
            metrics["pvpo/anchor_mean"] = self.batch_anchors(scored).mean().item()
        return scored, metrics

    def refresh(self, state: TrainState, policy: PreTrainedModel) -> dict[str, float]:
        """Re-estimate the anchors of the training prompts at ``state.step`` (``pvpo.refresh_mode``).

        ``policy`` mode samples the current policy; the refresh key carries its weight
        fingerprint, so a resumed run finds the rows it stored before and samples nothing.
        """
        pc = self.cfg.pvpo
        started = time.perf_counter()
        if pc.refresh_mode == "policy":
            sampler: Sampler = RolloutSampler(
                HFEngine(policy, self.tokenizer), self.task, self.params
            )
            fingerprint = fingerprint_model(policy)
        else:
            sampler, fingerprint = self.sampler, None
        result = refresh_anchors(
            self.records, sampler, self.store, self.key, pc.refresh_mode, state.step, pc.m,
            model_fingerprint=fingerprint, batch_size=pc.presample_batch, seed=PRESAMPLE_SEED,
        )  # fmt: skip
        self.anchors = result.anchors
        state.anchor_key = result.key.digest
        state.refresh_rollouts += anchor_rollouts(result.anchors, self.records)
        return {
            "pvpo/refresh_sampled": float(result.rollouts),
            "pvpo/refresh_seconds": time.perf_counter() - started,
        }


def load_reference(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The frozen initial policy (``ref_model`` or ``model`` loaded again), as the KL term's."""
    model, ref_tokenizer = load_spec(
        cfg.ref_model or cfg.model, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
    )
    if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "the reference's tokenizer differs from the policy's; PVPO anchors need the same vocabulary"
        )
    return frozen(model)


def build_teacher(
    cfg: TrainConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel,
    params: SamplingParams,
) -> Teacher | None:
    """The teacher ``pvpo.teacher`` names, or None; see ``PVPOConfig.teacher``."""
    pc = cfg.pvpo
    if pc.teacher is None:
        return None
    if pc.teacher == "oracle":
        return OracleTeacher(task, tokenizer, reference)
    kind, _, target = pc.teacher.partition(":")
    if kind == "hf":
        model, teacher_tokenizer = load_spec(
            target, cfg.task, cfg.task_args, cfg.seed, cfg.device, cfg.log.progress
        )
        return HFTeacher(
            frozen(model), teacher_tokenizer, task, tokenizer, params,
            tries=pc.teacher_tries, seed=PRESAMPLE_SEED,
        )  # fmt: skip
    assert pc.teacher_model is not None  # PVPOConfig requires it for http teachers
    return OpenAITeacher(target, pc.teacher_model, task, tokenizer, params, tries=pc.teacher_tries)


def setup_pvpo(
    cfg: TrainConfig,
    run_dir: Path,
    task: Task,
    records: Sequence[Record],
    tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel | None,
    state: TrainState,
) -> PVPO:
    """Presample the reference on ``records`` (the train split) and apply group sampling.

    ``reference`` is the run's frozen KL reference, or None to load it (``ref_model`` or
    ``model`` again) for runs without a KL term.

    A new run (``state.anchor_key`` unset) records the presample cost and the anchors' key
    in ``state`` and writes ``RUN_DIR/pvpo.json`` (and ``pvpo_filter.json`` with group
    sampling, also printed beside the paper's distributions). A resumed run finds every
    row in the store (presampling and the teacher then cost nothing) and continues with
    the anchors ``state.anchor_key`` names, those of its last refresh if any.
    """
    pc, progress = cfg.pvpo, cfg.log.progress
    reference = reference if reference is not None else load_reference(cfg, tokenizer)
    started = time.perf_counter()
    params = presample_params(cfg, task)
    key = reference_key(cfg, task, tokenizer, reference)
    store = AnchorStore(store_path(pc))
    sampler = RolloutSampler(HFEngine(reference, tokenizer), task, params)
    result = presample(
        records, sampler, store, key, pc.m, pc.presample_batch, PRESAMPLE_SEED, progress
    )
    stats = store.get_anchors(key, [r.id for r in records])
    train, trajectories, filtered = list(records), {}, None
    if cfg.filter.kind == "group":
        filtered = _group_sampling(cfg, task, tokenizer, reference, params, store, records, stats)
        train, trajectories = filtered.records, filtered.trajectories
    seconds = time.perf_counter() - started
    new_run = state.anchor_key is None
    if new_run:
        state.anchor_key = key.digest
        state.presample_rollouts = anchor_rollouts(stats, records)
        _write_run_file(run_dir, cfg, store, key, result, stats, records, train, seconds, filtered)
    anchors = store.get_anchors(state.anchor_key, [r.id for r in train])
    if len(anchors) < len(train):
        raise RuntimeError(
            f"{len(train) - len(anchors)} training prompts have no anchors under {state.anchor_key} "
            f"in {store.path}, the anchors this run was using; it cannot continue without them"
        )
    if progress:
        console = Console()
        if filtered is not None and new_run:
            filtered.print(console)
        console.print(
            f"PVPO: {len(records)} prompts x M={pc.m} presampled in {seconds:.1f}s "
            f"({result.rollouts} rollouts sampled now, {result.prompts_reused} prompts reused) "
            f"-> {len(train)} training prompts; store {store.path}"
        )
    return PVPO(cfg, task, tokenizer, store, key, params, sampler, train, anchors, trajectories)


def _group_sampling(
    cfg: TrainConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel,
    params: SamplingParams,
    store: AnchorStore,
    records: Sequence[Record],
    stats: Mapping[str, AnchorStat],
) -> FilterResult:
    teacher = build_teacher(cfg, task, tokenizer, reference, params)
    task_id = task_identity(cfg.task, task, cfg.task_args)
    tkey = None if teacher is None else teacher_key(teacher, task_id)
    result = group_filter(
        records, stats, teacher=teacher, store=store if teacher else None, key=tkey,
        keep_unsolved=cfg.pvpo.keep_unsolved, progress=cfg.log.progress,
    )  # fmt: skip
    if not result.records:
        raise ValueError(
            f"group sampling left no training prompt of {len(records)}: the reference solves "
            f"{result.stats.acc_one} every time and no teacher trajectory covers the "
            f"{result.stats.dropped_unsolved} it never solves (pvpo.teacher={cfg.pvpo.teacher!r}; "
            "pvpo.keep_unsolved=true keeps those)"
        )
    return result


def _write_run_file(
    run_dir: Path,
    cfg: TrainConfig,
    store: AnchorStore,
    key: AnchorKey,
    result: PresampleResult,
    stats: Mapping[str, AnchorStat],
    records: Sequence[Record],
    train: Sequence[Record],
    seconds: float,
    filtered: FilterResult | None,
) -> None:
    """``pvpo.json``: what presampling did and cost; ``pvpo_filter.json``: group sampling's stats."""
    values = [stats[r.id] for r in records]
    summary = {
        "store": str(store.path),
        "key": key.digest,
        "m": cfg.pvpo.m,
        "prompts": len(records),
        "training_prompts": len(train),
        "presample": {
            "rollouts": anchor_rollouts(stats, records),
            "rollouts_sampled_now": result.rollouts,
            "prompts_sampled_now": result.prompts_sampled,
            "prompts_reused": result.prompts_reused,
            "seconds": seconds,
        },
        "reference_accuracy": sum(s.accuracy for s in values) / len(values),
        "anchor_mean": sum(s.mean for s in values) / len(values),
        "teacher": cfg.pvpo.teacher if filtered is not None else None,
        "teacher_trajectories": 0 if filtered is None else len(filtered.trajectories),
        "teacher_samples_now": 0 if filtered is None else filtered.stats.teacher_samples,
    }
    (Path(run_dir) / RUN_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if filtered is not None:
        filtered.stats.save(Path(run_dir) / FILTER_FILE)
