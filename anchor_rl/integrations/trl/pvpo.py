"""PVPO as a TRL ``GRPOTrainer``: advantages ``r - V_sta(prompt)`` from the anchor store,
group sampling of the training prompts, teacher rows and the anchor refresh
(:class:`PVPOGRPOTrainer`). Where each piece enters TRL's step:
:mod:`anchor_rl.integrations.trl.base`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.algos.registry import compute_advantage
from anchor_rl.anchors.filter import FilterResult
from anchor_rl.anchors.keys import AnchorKey, fingerprint_model
from anchor_rl.anchors.presample import RolloutSampler, refresh_key
from anchor_rl.anchors.presample import presample as presample_prompts
from anchor_rl.anchors.records import AnchorStat, TeacherTrajectory, anchor_values
from anchor_rl.anchors.teachers import teacher_key
from anchor_rl.errors import ConfigError
from anchor_rl.integrations.trl.base import AnchoredGRPOTrainer, fresh_copy
from anchor_rl.integrations.trl.checks import section
from anchor_rl.methods.knobs import in_host_terms
from anchor_rl.methods.pvpo import (
    FILTER_FILE,
    anchor_seed,
    due_refresh,
    group_sampling,
    pvpo_teacher,
)
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.rollout.engine import close_engine, make_engine
from anchor_rl.rollout.spec import frozen, load_spec

__all__ = ["PVPOGRPOTrainer"]

_log = logging.getLogger(__name__)

TRL_NAMES = {
    "filter.kind=group": "group_sampling=True",
    "rollout.n": "num_generations",
    "rollout.top_p": "top_p",
}
"""The run settings :meth:`PVPOConfig.errors` names -> the plug-in's names of them."""


class PVPOGRPOTrainer(AnchoredGRPOTrainer):
    """TRL's GRPO with PVPO: advantages ``r - V_sta(prompt)``, group sampling, teacher rows.

    pvpo: PVPO's knobs (``anchor_rl.methods.pvpo_config.PVPOConfig`` or a mapping of its
        fields): ``m`` reference rollouts per prompt, the anchor ``store`` (default
        ``$ANCHOR_RL_CACHE/anchors.db``, shared with ``anchor-rl presample`` and ``anchor-rl
        train``), the anchor seed ``presample_seed`` (part of the store key; None: 0, the
        default of ``anchor-rl presample``; set the seed of an ``anchor-rl train --preset
        pvpo`` run to reuse its anchors), the ``teacher`` and its settings, and the refresh
        (``refresh_every``, ``refresh_mode``: below). A number of ``prompts`` is not offered
        (every prompt of the dataset is presampled).
    group_sampling: drop the prompts the reference always solves from ``train_dataset``
        before training, and give the ones it never solves a teacher trajectory (dropping
        those the teacher cannot solve unless ``pvpo.keep_unsolved``). It needs every
        prompt's anchor, so every prompt is presampled at start.
    presample: without group sampling, ``first_use`` presamples a prompt's anchor when it
        first enters a generation batch (keeping a frozen copy of the initial policy when TRL
        has no fixed reference model), ``start`` presamples every prompt before training.

    Refresh (``pvpo.refresh_every = K > 0``), as in ``anchor-rl train --preset pvpo_paper``: the
    anchors of the training prompts are re-estimated by ``anchors.presample.refresh_anchors``
    once K, 2K, ... optimizer steps (``state.global_step``) have passed, at the start of the
    next generation batch (never within one), and serve every advantage from then on. The
    refresh is keyed by the step it was due at, K, 2K, ..., whichever batch makes it (the
    one starting there, as with TRL's default ``steps_per_generation =
    gradient_accumulation_steps`` and ``num_iterations = 1``; else the first generation
    batch after it), so a run resumed mid-generation-batch, whose batches start at other
    steps, makes it under the same key and finds its rows.
    ``refresh_mode="reference"`` samples the reference again (with no fixed reference model,
    a frozen copy of the initial policy is kept for it); ``"policy"`` samples a frozen copy of
    the current policy's weights, made for the refresh and dropped after it, and its store
    key carries that copy's weight fingerprint. The training prompts are those of
    ``train_dataset`` after group sampling (which is not redone; the teacher trajectories
    stay); with ``presample="first_use"`` those used so far, a prompt first used after a
    refresh being presampled from the reference under that refresh's key (``policy`` mode
    is refused there: the snapshot such a prompt needs is gone). The rollouts count as
    ``refresh`` (what the refreshed anchors rest on, rows found in the store included) and
    ``refresh_now`` (what was sampled). Each checkpoint keeps the key of the anchors in use
    and the last refresh: a resumed run continues with them, and a refresh it repeats (a
    checkpoint saved before the refresh) finds its rows in the store and samples nothing
    (in ``policy`` mode, when the snapshot's weights are the same: a resume from the step
    the refresh was made at).

    Teacher rows are the trajectories as TRL completions (:meth:`_fit`): cut at
    ``max_completion_length``, and the ``oracle``'s ended with eos.

    The rest as :class:`AnchoredGRPOTrainer`. After set-up: ``anchor_set`` (what presampling
    at start did), ``filter_result`` (group sampling's ``FilterResult`` or None; its
    statistics are also written to ``OUTPUT_DIR/pvpo_filter.json``), ``trajectories``
    (prompt id -> teacher trajectory), ``anchors`` and ``anchor_key`` (the anchors in use and
    their store key: the presample key, or the last refresh's), ``last_refresh`` (its
    ``step``, ``mode`` and snapshot ``fingerprint``; None before the first).
    """

    def __init__(
        self,
        *args: Any,
        pvpo: PVPOConfig | Mapping[str, Any] | None = None,
        group_sampling: bool = True,
        presample: Literal["first_use", "start"] = "first_use",
        **kwargs: Any,
    ) -> None:
        pc = section(PVPOConfig, pvpo, "pvpo")
        _check_pvpo(pc, group_sampling, presample)
        super().__init__(*args, **kwargs)
        errors = pc.errors(group=group_sampling, n=self.num_generations, top_p=self.args.top_p)
        if errors := in_host_terms(errors, TRL_NAMES):
            raise ConfigError(errors)
        self.pvpo, self.group_sampling = pc, group_sampling
        at_start = group_sampling or presample == "start"
        kept_for = None
        if not at_start:
            kept_for = ("presample='first_use'", "pass reference_model=, or presample='start'")
        elif pc.refresh_every and pc.refresh_mode == "reference":
            kept_for = (
                "pvpo.refresh_mode='reference'",
                "pass reference_model=, or refresh_mode='policy'",
            )
        reference = self._reference(kept_for)
        self.anchor_set = self._presample_start(
            reference, self._unique_records() if at_start else [], pc
        )
        self.anchors: dict[str, AnchorStat] = dict(self.anchor_set.stats)
        self.anchor_key: AnchorKey = self.anchor_set.key
        # the last refresh ({"step", "mode", "fingerprint"}; None: none yet)
        self.last_refresh: dict[str, Any] | None = None
        self.counts |= {"refresh": 0, "refresh_now": 0}
        self._late_reference = None if at_start else reference
        self.filter_result: FilterResult | None = None
        if group_sampling:
            self._group_sampling(reference)
        if self.progress:
            kept = len(dict.fromkeys(self.dataset_ids))
            Console().print(
                f"PVPO (TRL): {len(self.anchors)} prompts x M={pc.m} presampled "
                f"({self.anchor_set.result.rollouts} rollouts sampled now) -> {kept} training "
                f"prompts, {len(self.trajectories)} with a teacher trajectory; store "
                f"{self.anchor_set.store.path}"
                + ("" if at_start else "; the others are presampled on first use")
            )

    def _group_sampling(self, reference: PreTrainedModel) -> None:
        """Filter ``train_dataset`` to group sampling's prompts; keep the teacher trajectories."""
        pc = self.pvpo

        def load_model(spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
            model, tokenizer = load_spec(
                spec, self.task_name, self.task_args, self.args.seed,
                str(self.accelerator.device), self.progress,
            )  # fmt: skip
            return frozen(model), tokenizer

        scorer = reference if pc.teacher == "oracle:reference" else None
        teacher = pvpo_teacher(pc, self.task, self._tokenizer, scorer, self.sampling, load_model)
        tkey = None if teacher is None else teacher_key(teacher, self.task_id)
        anchor_set = self.anchor_set
        result = group_sampling(
            anchor_set.records, anchor_set.stats, teacher, anchor_set.store, tkey,
            pc.keep_unsolved, pc.teacher, self.progress,
        )  # fmt: skip
        keep = {r.id for r in result.records}
        rows = [row for row, pid in enumerate(self.dataset_ids) if pid in keep]
        self.train_dataset = self.train_dataset.select(rows)
        self.dataset_ids = [self.dataset_ids[row] for row in rows]
        self._check_fills_a_batch("group sampling kept")
        self.filter_result, self.trajectories = result, self._fit(result.trajectories)
        failed = result.stats.acc_zero - len(result.trajectories)
        tries = teacher.tries if teacher is not None else 0
        self.counts["teacher"] = sum(t.tries for t in result.trajectories.values()) + tries * failed
        if self.progress:
            result.print()
        if self.args.should_save:
            result.stats.save(Path(self.args.output_dir) / FILTER_FILE)

    def _fit(self, trajectories: Mapping[str, TeacherTrajectory]) -> dict[str, TeacherTrajectory]:
        """The teacher trajectories as TRL completions of at most ``max_completion_length``
        tokens, ending where a completion ends.

        - One longer than ``max_completion_length`` is cut there, tokens, log-probs and text
          (its reward is then the cut text's, as with the verl plug-in's ``response_length``):
          it is a truncated completion, as one TRL cuts there.
        - One that does not end in an eos or stop id, with room left, gets the tokenizer's eos
          appended when the teacher is the deterministic ``oracle``: it writes its trace and
          ends with probability 1, so the eos's log pi_gt is 0 like its other tokens' (as the
          verl plug-in's ``field:`` teacher). Another teacher's log-prob of that eos is not
          known, and its trajectory is left as it is.

        ConfigError under ``mask_truncated_completions``, which would mask a trajectory left
        without an end out of the loss (TRL masks every row whose last id is no eos).
        """
        limit, teacher = self.args.max_completion_length, self.pvpo.teacher
        ends, eos = set(self.eos_token_ids), self._tokenizer.eos_token_id
        fitted: dict[str, TeacherTrajectory] = {}
        full, open_ends, longest = 0, 0, 0
        for pid, traj in trajectories.items():
            n = len(traj)
            longest = max(longest, n)
            if n > limit:
                tokens = traj.token_ids[:limit]
                text = self._tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
                traj = replace(
                    traj, token_ids=tokens, logprobs=traj.logprobs[:limit],
                    loss_mask=traj.loss_mask[:limit], text=text,
                    reward=self.task.reward(text, self.records_by_id[pid]),
                )  # fmt: skip
                _log.warning(
                    "teacher trajectory of %s: %d tokens cut at max_completion_length=%d",
                    pid,
                    n,
                    limit,
                )
            if int(traj.token_ids[-1]) in ends:
                pass
            elif len(traj) >= limit:
                full += 1
            elif teacher == "oracle" and eos is not None:
                traj = replace(
                    traj, token_ids=torch.cat([traj.token_ids, traj.token_ids.new_tensor([eos])]),
                    logprobs=torch.cat([traj.logprobs, traj.logprobs.new_zeros(1)]),
                    loss_mask=torch.cat([traj.loss_mask, traj.loss_mask.new_ones(1)]),
                )  # fmt: skip
            else:
                open_ends += 1
            fitted[pid] = traj
        if self.args.mask_truncated_completions and (full or open_ends):
            why = []
            if full:
                why.append(
                    f"{full} fill max_completion_length={limit} (the longest has {longest} "
                    f"tokens; raise max_completion_length to {longest + 1})"
                )
            if open_ends:
                why.append(
                    f"{open_ends} come from pvpo.teacher={teacher!r}, whose log-prob of an "
                    "appended eos is unknown (use pvpo.teacher='oracle')"
                )
            raise ConfigError(
                f"mask_truncated_completions=True would mask {full + open_ends} teacher "
                f"trajectories out of the loss, as they end in no eos or stop id: "
                f"{'; '.join(why)}; or set mask_truncated_completions=False"
            )
        return fitted

    def _before_batch(self, ids: Sequence[str]) -> dict[str, float]:
        """The refresh when due (:meth:`refresh`), then first-use presampling of the batch's
        new prompts under the key of the anchors in use (the presample key, or the last
        refresh's)."""
        metrics = self._refresh_if_due()
        if self._late_reference is None:
            return metrics
        new = [self.records_by_id[i] for i in dict.fromkeys(ids) if i not in self.anchors]
        sampled = 0
        if new:
            pc, anchor_set = self.pvpo, self.anchor_set
            result = presample_prompts(
                new, anchor_set.sampler, anchor_set.store, self.anchor_key, pc.m,
                pc.presample_batch, anchor_seed(pc), self.progress,
            )  # fmt: skip
            sampled = result.rollouts
            self._add_anchors(anchor_set.store.get_anchors(self.anchor_key, [r.id for r in new]))
            self.counts["refresh_now" if self.last_refresh else "presample_now"] += sampled
        return metrics | {"pvpo/presampled_now": float(sampled)}

    def _add_anchors(self, stats: Mapping[str, AnchorStat]) -> None:
        """Use ``stats`` (prompts first used, under :attr:`anchor_key`) and count the rollouts
        they rest on: presampling's before the first refresh, the refreshes' after it."""
        self.anchors |= stats
        self.counts["refresh" if self.last_refresh else "presample"] += sum(
            stat.n for stat in stats.values()
        )

    def _refresh_if_due(self) -> dict[str, float]:
        """:meth:`refresh` when a multiple of ``pvpo.refresh_every`` optimizer steps lies between
        the last refresh (0: none) and ``state.global_step``, keyed by the last such multiple,
        the step it was due at (not the batch's step, which a resume mid-generation-batch
        moves); its metrics, else none."""
        last = self.last_refresh["step"] if self.last_refresh else 0
        due = due_refresh(self.pvpo.refresh_every, last, self.state.global_step)
        return {} if due is None else self.refresh(due)

    def refresh(self, step: int) -> dict[str, float]:
        """Re-estimate the anchors of the training prompts for the refresh due after ``step``
        optimizer steps (``pvpo.refresh_mode``; ``step`` keys it) with
        :meth:`~anchor_rl.methods.pvpo.AnchorSet.refresh`; they serve from now on. ``policy`` mode samples
        a frozen copy of the current policy, keyed by its weight fingerprint; rows already
        stored under the refresh key (a refresh repeated by a resumed run) are reused, nothing
        sampled. Metrics ``pvpo/refresh_sampled`` and ``pvpo/refresh_seconds``."""
        pc, started = self.pvpo, time.perf_counter()
        records = [r for r in self._unique_records() if r.id in self.anchors]
        sampler, engine, fingerprint = None, None, None
        if pc.refresh_mode == "policy":  # the snapshot goes with its engine
            snapshot = fresh_copy(self.accelerator.unwrap_model(self.model))
            fingerprint = fingerprint_model(snapshot)
            engine = make_engine("hf", snapshot, self._tokenizer)
            sampler = RolloutSampler(engine, self.task, self.sampling)
        try:
            result = self.anchor_set.refresh(records, pc, step, sampler, fingerprint, self.progress)
        finally:
            close_engine(engine)  # the snapshot's (None in reference mode: nothing to close)
        self.last_refresh = {"step": step, "mode": pc.refresh_mode, "fingerprint": fingerprint}
        self.anchor_key, self.anchors = result.key, dict(result.anchors)
        self.counts["refresh"] += sum(stat.n for stat in result.anchors.values())
        self.counts["refresh_now"] += result.rollouts
        return {
            "pvpo/refresh_sampled": float(result.rollouts),
            "pvpo/refresh_seconds": time.perf_counter() - started,
        }

    def _advantages(
        self, rewards: Tensor, ids: Sequence[str], k: int
    ) -> tuple[Tensor, dict[str, float]]:
        """``algos.advantages.pvpo``: ``r - V_sta(prompt)`` for every row, ``[N]``."""
        absent = [i for i in dict.fromkeys(ids) if i not in self.anchors]
        if absent:  # presampled by another process on first use
            self._add_anchors(self.anchor_set.store.get_anchors(self.anchor_key, absent))
        anchor = anchor_values(self.anchors, ids)
        advantages = compute_advantage("pvpo", rewards=rewards, anchor=anchor)
        teacher_rows = sum(
            1 for row, pid in enumerate(ids) if row % k == k - 1 and pid in self.trajectories
        )
        return advantages, {
            "pvpo/anchor_mean": anchor.mean().item(),
            "pvpo/teacher_rows": teacher_rows,
        }

    def _plugin_state(self) -> dict[str, Any]:
        """The counts, and the anchors in use: their key's digest, their prompts and the last
        refresh (what rebuilds the key)."""
        pvpo = {
            "anchor_key": self.anchor_key.digest,
            "anchor_ids": list(self.anchors),
            "last_refresh": None if self.last_refresh is None else dict(self.last_refresh),
        }
        return super()._plugin_state() | {"pvpo": pvpo}

    def _load_plugin_state(self, state: Mapping[str, Any]) -> None:
        """Continue with the anchors the run was using (those of its last refresh, if any),
        read from the store; from a checkpoint without a ``pvpo`` entry, the counts only."""
        super()._load_plugin_state(state)
        saved = state.get("pvpo")
        if saved is None:
            return
        last, key = saved["last_refresh"], self.anchor_set.key
        if last is not None:
            last = {**last, "step": int(last["step"])}  # {"step", "mode", "fingerprint"}
            key = refresh_key(key, last["mode"], last["step"], last["fingerprint"])
        store = self.anchor_set.store
        if key.digest != saved["anchor_key"]:
            raise ConfigError(
                f"the checkpoint's anchors are stored under {saved['anchor_key']} in {store.path}, "
                f"but this trainer's settings give {key.digest} for them (the reference, sampling "
                "settings, task and anchor seed make the key); resume with the initial model and "
                "settings the run started with"
            )
        ids = [str(i) for i in saved["anchor_ids"]]
        anchors = store.get_anchors(key, ids)
        if len(anchors) < len(ids):
            raise RuntimeError(
                f"{len(ids) - len(anchors)} training prompts have no anchors under {key.digest} "
                f"in {store.path}, the anchors this run was using; it cannot continue without them"
            )
        self.anchor_key, self.anchors, self.last_refresh = key, anchors, last


def _check_pvpo(pc: PVPOConfig, group_sampling: bool, presample: str) -> None:
    if refused := pc.native_only("the TRL plug-in"):
        raise ConfigError(refused)
    if presample not in ("first_use", "start"):
        raise ConfigError(f"presample={presample!r}: choose 'first_use' or 'start'")
    if pc.prompts not in ("auto", "all"):
        raise ConfigError(
            f"pvpo.prompts={pc.prompts}: the TRL plug-in presamples every prompt of "
            "train_dataset (or each on its first use), it does not walk a subset; pass a "
            "train_dataset (or records=) of the prompts to train on and drop pvpo.prompts"
        )
    first_use = presample == "first_use" and not group_sampling
    if pc.refresh_every and pc.refresh_mode == "policy" and first_use:
        raise ConfigError(
            "pvpo.refresh_mode='policy' with presample='first_use': a policy refresh samples a "
            "snapshot of the policy at the refresh step, and a prompt first used after the "
            "refresh would need that snapshot for its anchor, which is gone once training moves "
            "on (and after a resume); use presample='start' (every prompt is then refreshed at "
            "each refresh) or refresh_mode='reference' (a prompt first used after a refresh is "
            "presampled from the reference under that refresh's key)"
        )
