"""PVPO (arXiv 2508.21104), written once for every host: the anchor seed, the presampling
walk, group sampling, teacher rows and anchor refreshes.

Shapes: G prompts (groups) of a step, B responses, ``group[B]`` each response's prompt.

The data side lives in :mod:`anchor_rl.anchors` (the store, presampling, the filter, the
teachers); this module holds the decisions every host makes the same way: the native
:class:`~anchor_rl.trainer.pvpo.PVPO` component, the TRL plug-in and the verl trainer each
call these functions and keep only how their loop samples and where the rows go.

    set-up      presample_set     presample the reference M times per prompt into the anchor
                                  store (rows stored under the same key are reused), walking
                                  a seeded order until enough prompts pass ``trainable``
                group_sampling    drop acc = 1, keep 0 < acc < 1, ask the teacher for acc = 0
    each step   refresh_due       whether the anchors are re-estimated (``refresh``)
                teacher_rows      which rows a prompt's teacher trajectory replaces
                anchor_values     ``V_sta`` of each response's prompt (advantage ``r - V_sta``)

The anchor seed is ``pvpo.presample_seed``, 0 unless set (:func:`anchor_seed`): anchors
are a property of the reference and the sampling settings, not of a run, so one store
serves every run of a study whatever its seed and host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.anchors.filter import FilterResult, group_filter
from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.presample import (
    PresampleResult,
    RefreshResult,
    RolloutSampler,
    Sampler,
    presample,
    presample_key,
    refresh_anchors,
)
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory
from anchor_rl.anchors.teachers import TEACHER_SEED, Teacher, make_teacher
from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.groups import last_rows
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task

FILTER_FILE = "pvpo_filter.json"
"""Group sampling's statistics in a run's output directory."""
PRESAMPLE_SEED = 0
"""The anchor seed when ``pvpo.presample_seed`` is not set (also ``anchor-rl presample``'s)."""


def anchor_seed(pc: PVPOConfig) -> int:
    """The seed of the anchor draw (presampling, refreshes, the walk order; part of the store
    key): ``pvpo.presample_seed``, else :data:`PRESAMPLE_SEED`."""
    return PRESAMPLE_SEED if pc.presample_seed is None else pc.presample_seed


def anchor_rollouts(anchors: Mapping[str, AnchorStat], records: Sequence[Record]) -> int:
    """Rollouts the anchors of ``records`` rest on: the sum of their ``n``."""
    return sum(anchors[r.id].n for r in records)


def teacher_rows(
    group: Tensor, ids: Sequence[str], trajectories: Mapping[str, TeacherTrajectory]
) -> tuple[list[int], list[int]]:
    """``(groups, rows)``: the groups whose prompt (``ids[G]``) has a teacher trajectory, and
    the row each trajectory replaces, the group's last of ``group[B]``."""
    groups = [g for g, pid in enumerate(ids) if pid in trajectories]
    return groups, last_rows(group, groups)


def refresh_due(cfg: PVPOConfig, step: int) -> bool:
    """Whether the anchors are re-estimated after ``step`` completed steps."""
    return cfg.refresh_every > 0 and step > 0 and step % cfg.refresh_every == 0


def due_refresh(every: int, last: int, step: int) -> int | None:
    """The step a refresh is due at when ``step`` optimizer steps are done and the last
    refresh was due at ``last`` (0: none): the latest multiple of ``every`` past ``last``,
    or None. A host whose steps can jump several at once (TRL's generation batches) keys
    the refresh by this step, so a resumed run repeats the same refresh."""
    if not every or step // every <= last // every:
        return None
    return every * (step // every)


@dataclass
class AnchorSet:
    """The reference's presampled anchors on a run's training prompts.

    key: the presample key (the reference, tokenizer, sampling settings and task).
    sampler: the reference's sampler (presampling and ``reference``-mode refreshes).
    records: the prompts presampled (a walk's prompts, in walk order).
    stats: prompt id -> statistics of every presampled prompt.
    result: what the presampling call did (rollouts sampled now, prompts reused).
    target: the walk's target (:func:`presample_set`); None when every prompt was presampled.
    """

    store: AnchorStore
    key: AnchorKey
    params: SamplingParams
    sampler: Sampler
    records: list[Record]
    stats: dict[str, AnchorStat]
    result: PresampleResult
    seconds: float
    target: int | None = None

    @property
    def rollouts(self) -> int:
        """Reference rollouts the anchors rest on (the cost, cached rows included)."""
        return anchor_rollouts(self.stats, self.records)

    def pool(self, kept: Sequence[Record]) -> list[Record]:
        """The training prompts among ``kept`` (the records, or those group sampling kept, in
        walk order): the first ``target`` of them, all without a target."""
        return list(kept) if self.target is None else list(kept[: self.target])

    def refresh(
        self,
        records: Sequence[Record],
        pc: PVPOConfig,
        step: int,
        sampler: Sampler | None = None,
        fingerprint: str | None = None,
        progress: bool = False,
    ) -> RefreshResult:
        """Re-estimate the anchors of ``records`` for the refresh due after ``step`` steps
        (``pc.refresh_mode``): ``reference`` samples :attr:`sampler`, ``policy`` the given
        ``sampler`` of the current policy, whose weight ``fingerprint`` joins the key. Rows
        already stored under the refresh key (a resumed run's) are reused."""
        return refresh_anchors(
            records, sampler or self.sampler, self.store, self.key, pc.refresh_mode, step,
            pc.m, model_fingerprint=fingerprint, batch_size=pc.presample_batch,
            seed=anchor_seed(pc), progress=progress,
        )  # fmt: skip

    def means(self) -> dict[str, float]:
        """Prompt id -> the anchor ``V_sta`` (mean reward of the reference's rollouts)."""
        return {pid: stat.mean for pid, stat in self.stats.items()}


def presample_cost_note(prompts: int, m: int, draws: int, run_rollouts: int) -> str | None:
    """A warning when presampling ``prompts`` x ``m`` reference rollouts covers prompts the
    run never draws (more than its ``draws``) and costs more than its ``run_rollouts``
    policy rollouts (None otherwise)."""
    cost = prompts * m
    if prompts <= draws or cost <= run_rollouts:
        return None
    return (
        f"PVPO presamples {prompts:,} training prompts x M={m} = {cost:,} reference rollouts, "
        f"{cost / max(run_rollouts, 1):.1f}x the {run_rollouts:,} policy rollouts of the run, "
        f"which draws at most {draws:,} prompts (rows already in the store are reused); "
        "pvpo.prompts=auto presamples only the prompts the run draws"
    )


def pool_target(pc: PVPOConfig, draws: int, available: int) -> int | None:
    """How many training prompts a presampling walk stops at (``pvpo.prompts``; ``auto``:
    the ``draws`` prompts the run draws), or None to presample all ``available`` ones."""
    wanted = pc.prompts
    if wanted == "all":
        return None
    if wanted == "auto":
        wanted = draws
    return wanted if wanted < available else None


def trainable(pc: PVPOConfig, group_sampling: bool) -> Callable[[AnchorStat], bool]:
    """Whether group sampling may keep a prompt, judged on its presampled statistics alone:
    every prompt without group sampling; otherwise not the accuracy-1 ones, and accuracy-0
    ones only with a teacher or ``pvpo.keep_unsolved`` (a teacher that then fails a prompt
    leaves the walk's pool one prompt short)."""
    if not group_sampling:
        return lambda stat: True
    rescued = pc.teacher is not None or pc.keep_unsolved
    return lambda stat: not stat.all_correct and (rescued or not stat.none_correct)


def walk_order(records: Sequence[Record], seed: int) -> list[Record]:
    """``records`` in the seeded order a presampling walk takes them."""
    order = np.random.default_rng([seed, _WALK_STREAM]).permutation(len(records))
    return [records[int(i)] for i in order]


def presample_set(
    reference: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    task_id: str,
    params: SamplingParams,
    records: Sequence[Record],
    store: AnchorStore,
    pc: PVPOConfig,
    engine: tuple[str, Mapping[str, Any]] = ("hf", {}),
    progress: bool = True,
    seed: int = PRESAMPLE_SEED,
    target: int | None = None,
    keep: Callable[[AnchorStat], bool] = lambda stat: True,
) -> AnchorSet:
    """Presample ``reference`` ``pc.m`` times on ``records`` into ``store`` (rows already stored
    under the same key are reused), with ``params`` (:func:`presample_params`) and the anchor
    ``seed`` through the engine ``engine = (name, options)``. Needs no run: an integration
    holds the result.

    target: None presamples every record. Otherwise the records are walked in order, in
    chunks sized from the share that passed ``keep`` so far, until ``target`` of them pass
    it or they run out; the set holds the records walked (its cost) and
    :attr:`AnchorSet.pool` the first ``target`` that pass. The walk depends only on the
    stored statistics, so a resumed run walks the same prompts and samples nothing.
    """
    started = time.perf_counter()
    key = presample_key(reference, tokenizer, params, task_id, seed=seed)
    sampler = reference_sampler(reference, tokenizer, task, params, engine)
    records = list(records)
    walked, passed, results = 0, 0, []
    stats: dict[str, AnchorStat] = {}
    while walked < len(records) and (target is None or passed < target):
        size = len(records) if target is None else _chunk(target - passed, passed, walked, pc)
        chunk = records[walked : walked + size]
        results.append(presample_rounds(chunk, sampler, store, key, pc, seed, progress))
        new = store.get_anchors(key, [r.id for r in chunk])
        stats |= new
        passed += sum(keep(new[r.id]) for r in chunk)
        walked += len(chunk)
    records = records[:walked]
    return AnchorSet(
        store, key, params, sampler, records, stats, _merged(key, results),
        time.perf_counter() - started, target=target,
    )  # fmt: skip


def reference_sampler(
    reference: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    params: SamplingParams,
    engine: tuple[str, Mapping[str, Any]] = ("hf", {}),
    keep: bool = False,
) -> RolloutSampler:
    """The reference's presampling sampler through the engine ``engine = (name, options)``;
    ``keep``: it keeps its last call's rollouts (``pvpo.reuse_presample``)."""
    name, options = engine
    engine_ = make_engine(name, reference, tokenizer, **options)
    return RolloutSampler(engine_, task, params, keep=keep)


Decide = Callable[[Sequence[Record], Mapping[str, AnchorStat]], FilterResult | None]
"""``decide(records, stats)``: group sampling of freshly presampled ``records``
(:func:`group_filter` with the run's teacher), or None to keep every record."""


@dataclass
class LazyWalk:
    """Presampling as a run draws (``pvpo.presample = "lazy"``): the walk's prompts are
    presampled when the run first needs them, and group sampling decides on them then.

    The training pool is the walk's prompts that group sampling keeps, in walk order, up to
    ``target`` (None: every one). :meth:`extend` walks exactly as many new prompts as are
    missing (a dropped prompt is replaced by the next of the walk), presampling them in one
    sampler call per round (:func:`presample_rounds`), each call's rows stored in one
    transaction. The pool after
    ``extend(k)`` is a function of the walk and the stored statistics alone, so a resumed
    run that extends to its cursor re-reads every row and samples nothing; a run killed
    after presampling a step's prompts finds them in the store on resume.

    kept: the pool so far; stats: prompt id -> statistics of every walked prompt;
    walked: prompts of ``walk`` walked so far; trajectories: teacher trajectories of kept
    accuracy-0 prompts; teacher_rollouts: a model teacher's generations behind the walked
    prompts' outcomes (cached ones included); sampled_now: reference rollouts this process
    sampled.
    """

    store: AnchorStore
    key: AnchorKey
    params: SamplingParams
    sampler: Sampler
    walk: list[Record]
    pc: PVPOConfig
    """``pvpo.m``, the rounds (``m_min``, ``round_size``, ``se_max``), ``presample_batch``."""
    target: int | None
    decide: Decide
    seed: int = PRESAMPLE_SEED
    keep_rollouts: bool = False
    """Keep the presampled rollouts themselves in the store (``pvpo.reuse_presample``)."""

    def __post_init__(self) -> None:
        self.kept: list[Record] = []
        self.stats: dict[str, AnchorStat] = {}
        self.trajectories: dict[str, TeacherTrajectory] = {}
        self.walked = self.teacher_rollouts = self.sampled_now = 0

    @property
    def done(self) -> bool:
        """Whether the pool is final: the target is reached or the walk ran out."""
        full = self.target is not None and len(self.kept) >= self.target
        return full or self.walked >= len(self.walk)

    @property
    def rollouts(self) -> int:
        """Reference rollouts the walked prompts' anchors rest on (kept or not)."""
        return sum(stat.n for stat in self.stats.values())

    def extend(self, size: int) -> int:
        """Walk until the pool holds ``size`` prompts (or is final); returns the reference
        rollouts sampled now (0 when the store held every walked prompt)."""
        before = self.sampled_now
        while len(self.kept) < size and not self.done:
            want = size - len(self.kept)
            if self.target is not None:
                want = min(want, self.target - len(self.kept))
            chunk = self.walk[self.walked : self.walked + want]
            self.walked += len(chunk)
            self._take(chunk)
        return self.sampled_now - before

    def _take(self, chunk: Sequence[Record]) -> None:
        """Presample ``chunk`` (one sampler call) and let group sampling decide on it."""
        batch = max(self.pc.presample_batch, len(chunk))
        result = presample_rounds(
            chunk, self.sampler, self.store, self.key, self.pc, self.seed,
            keep_rollouts=self.keep_rollouts, batch_size=batch,
        )  # fmt: skip
        self.sampled_now += result.rollouts
        new = self.store.get_anchors(self.key, [r.id for r in chunk])
        self.stats |= new
        decided = self.decide(chunk, new)
        if decided is None:
            self.kept += chunk
            return
        self.kept += decided.records
        self.trajectories |= decided.trajectories
        self.teacher_rollouts += decided.stats.teacher_rollouts

    def first_group(self, record: Record, n: int) -> tuple[RolloutBatch, Tensor] | None:
        """The first ``n`` presampled rollouts of ``record`` kept in the store (one group,
        rows ``0 .. n-1``) and their rewards ``[n]``; None when they are not kept (rows
        presampled by a run that did not keep them)."""
        return self.store.get_rollouts(self.key, record.id, n)


def leave_one_out_anchor(stat: AnchorStat, rewards: Tensor) -> Tensor:
    """FloatTensor[k]: the anchor of each of ``k`` rows that are themselves presampled
    rollouts of the prompt (rewards ``[k]``, part of ``stat``): the mean reward of the
    prompt's other ``stat.n - 1`` presampled rollouts, so a row's own reward is not in its
    baseline (with the full mean ``V_sta`` the advantage ``r - V_sta`` of such a row would be
    shrunk by ``1 - 1/n`` in expectation)."""
    if stat.n < 2:
        raise ValueError(f"prompt {stat.prompt_id}: a leave-one-out anchor needs n >= 2")
    return ((stat.reward_sum - rewards.double()) / (stat.n - 1)).float()


@dataclass
class PooledAnchors:
    """``pvpo.anchor_update = "pooled"``: a prompt's baseline pools its presampled rollouts
    with the policy's rollouts of every draw of it so far, leave-one-out.

    For a group of prompt x, row i's baseline is ``(S - r_i) / (N - 1)`` over the pool of the
    reference's ``stat.n`` rewards, the policy's rewards of x's earlier draws and this group's
    own policy rows (``fresh``), the row itself left out when it is in the pool (a policy row,
    or a reused presampled row, which is one of ``stat.n``); a teacher row, in no pool, gets
    ``S / N``. After the step, the group's fresh rewards join x's pool (:meth:`add`).

    sums: prompt id -> (count, reward sum) of the policy's rewards of its earlier draws.
    """

    sums: dict[str, tuple[int, float]] = field(default_factory=dict)

    def baselines(
        self,
        stats: Mapping[str, AnchorStat],
        ids: Sequence[str],
        group: Tensor,
        rewards: Tensor,
        fresh: Tensor,
        reused: Tensor,
    ) -> Tensor:
        """FloatTensor[B]: the baseline of each row. ids[G]: the groups' prompts; group[B],
        rewards[B] (task rewards); fresh[B]: the policy's rows sampled now; reused[B]: rows
        that are presampled rollouts (part of ``stats``)."""
        out = torch.empty(len(group), dtype=torch.float64)
        r = rewards.double()
        for g, pid in enumerate(ids):
            rows = group == g
            n_prev, s_prev = self.sums.get(pid, (0, 0.0))
            mine = rows & fresh
            n = stats[pid].n + n_prev + int(mine.sum())
            total = stats[pid].reward_sum + s_prev + float(r[mine].sum())
            out[rows] = total / n
            own = rows & (fresh | reused)
            out[own] = (total - r[own]) / (n - 1)
        return out.float()

    def add(self, ids: Sequence[str], group: Tensor, rewards: Tensor, fresh: Tensor) -> None:
        """Pool the ``fresh`` rows' rewards (``[B]``) into their prompts' sums."""
        for g, pid in enumerate(ids):
            mine = (group == g) & fresh
            n_prev, s_prev = self.sums.get(pid, (0, 0.0))
            self.sums[pid] = (
                n_prev + int(mine.sum()),
                s_prev + float(rewards[mine].double().sum()),
            )

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        ids = sorted(self.sums)
        return {
            "ids": ids,
            "n": torch.tensor([self.sums[i][0] for i in ids], dtype=torch.long),
            "sum": torch.tensor([self.sums[i][1] for i in ids], dtype=torch.float64),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.sums = {
            pid: (int(n), float(total))
            for pid, n, total in zip(
                state["ids"], state["n"].tolist(), state["sum"].tolist(), strict=True
            )
        }


def anchor_se(stat: AnchorStat) -> float:
    """The standard error of the anchor ``stat.mean``: ``sqrt(s^2 / n)``, ``s^2`` the
    unbiased variance of the ``n`` rewards (inf for n < 2)."""
    if stat.n < 2:
        return math.inf
    var = max(0.0, stat.reward_sq_sum - stat.n * stat.mean**2) / (stat.n - 1)
    return math.sqrt(var / stat.n)


def default_se_max(m: int) -> float:
    """``pvpo.se_max`` when unset: ``sqrt(0.25 / M)``, the standard error M rollouts give
    the anchor of a prompt solved half the time (the worst case of a 0/1 reward)."""
    return math.sqrt(0.25 / m)


def settled(stat: AnchorStat, m: int, m_min: int, se_max: float) -> bool:
    """Whether sequential presampling stops on a prompt: at ``m`` rollouts; before, once it
    has ``m_min`` and either all its rollouts agree (class always or never solved, as far as
    ``m_min`` tells) or it is sometimes solved (class certain) with an anchor standard error
    (:func:`anchor_se`) at most ``se_max``."""
    if stat.n >= m:
        return True
    if stat.n < m_min:
        return False
    return stat.all_correct or stat.none_correct or anchor_se(stat) <= se_max


def presample_rounds(
    records: Sequence[Record],
    sampler: Sampler,
    store: AnchorStore,
    key: AnchorKey,
    pc: PVPOConfig,
    seed: int,
    progress: bool = False,
    keep_rollouts: bool = False,
    batch_size: int | None = None,
) -> PresampleResult:
    """Presample ``records`` to ``pc.m`` rollouts each, or with ``pc.m_min`` set in rounds:
    ``m_min`` first, then ``pc.round_size`` more per round on the prompts not yet
    :func:`settled` (``pc.se_max``, default :func:`default_se_max`), up to ``pc.m``. Every
    draw is stored (a later run asking for more tops up), so the rounds depend only on the
    stored statistics: a rerun samples nothing, a run killed between rounds continues."""
    batch = batch_size or pc.presample_batch
    if pc.m_min is None:
        return presample(
            records, sampler, store, key, pc.m, batch, seed, progress, keep_rollouts=keep_rollouts
        )
    se_max = pc.se_max if pc.se_max is not None else default_se_max(pc.m)
    results = [
        presample(records, sampler, store, key, pc.m_min, batch, seed, progress, keep_rollouts)
    ]
    while True:
        stats = store.get_anchors(key, [r.id for r in records])
        targets: dict[int, list[Record]] = {}
        for r in records:
            stat = stats[r.id]
            if not settled(stat, pc.m, pc.m_min, se_max):
                targets.setdefault(min(stat.n + pc.round_size, pc.m), []).append(r)
        if not targets:
            return _merged(key, results)
        for target, pending in sorted(targets.items()):
            results.append(
                presample(pending, sampler, store, key, target, batch, seed, False, keep_rollouts)
            )


_WALK_STREAM = 7
"""Second entry of the walk order's seed, apart from the other streams of the run's seed."""


def _chunk(missing: int, passed: int, walked: int, pc: PVPOConfig) -> int:
    """Prompts to presample next so that about ``missing`` more pass, at the pass rate so far
    (at least a presampling batch; a rate under 5% counts as 5%)."""
    rate = passed / walked if walked else 1.0
    return max(pc.presample_batch, math.ceil(missing / max(rate, 0.05)))


def _merged(key: AnchorKey, results: Sequence[PresampleResult]) -> PresampleResult:
    """One :class:`PresampleResult` for a walk's presampling calls."""
    return PresampleResult(
        key=key.digest,
        rollouts=sum(r.rollouts for r in results),
        prompts_sampled=sum(r.prompts_sampled for r in results),
        prompts_reused=sum(r.prompts_reused for r in results),
        prompts_discarded=sum(r.prompts_discarded for r in results),
    )


def pvpo_teacher(
    pc: PVPOConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel | None,
    params: SamplingParams,
    load_model: Callable[[str], tuple[PreTrainedModel, PreTrainedTokenizerBase]],
) -> Teacher | None:
    """The teacher ``pc.teacher`` names (None for none); ``load_model(spec)`` loads an ``hf:``
    teacher. Needs no run."""
    if pc.teacher is None:
        return None
    return make_teacher(
        pc.teacher, task, tokenizer, reference, params, load_model=load_model,
        tries=pc.teacher_tries, seed=TEACHER_SEED, teacher_model=pc.teacher_model,
    )  # fmt: skip


def group_sampling(
    records: Sequence[Record],
    stats: Mapping[str, AnchorStat],
    teacher: Teacher | None,
    store: AnchorStore,
    teacher_key: AnchorKey | None,
    keep_unsolved: bool,
    teacher_setting: str | None,
    progress: bool = True,
) -> FilterResult:
    """Group sampling of ``records`` on their presampled ``stats``: the teacher's outcomes
    cached in ``store`` under ``teacher_key``; ValueError naming the ``pvpo.teacher`` setting
    (``teacher_setting``) when no prompt is left."""
    result = group_filter(
        records, stats, teacher=teacher, store=store if teacher else None, key=teacher_key,
        keep_unsolved=keep_unsolved, progress=progress,
    )  # fmt: skip
    if not result.records:
        raise ValueError(
            f"group sampling left no training prompt of {len(records)}: the reference solves "
            f"{result.stats.acc_one} every time and no teacher trajectory covers the "
            f"{result.stats.dropped_unsolved} it never solves (pvpo.teacher={teacher_setting!r}; "
            "pvpo.keep_unsolved=true keeps those)"
        )
    return result
