"""The ``anchor_rl`` trainer: verl 0.9.1's synchronous v1 ``PPOTrainer`` running PVPO, V0.5 or
VAPO (``trainer.v1.trainer_mode=anchor_rl``, ``anchor_rl.method=pvpo|v05|vapo``).

verl's v1 loop is kept; the trainer adds, at verl's own seams:

    fit start          presampling of the reference (PVPO, V0.5's anchor prior) through
                       verl's rollout into anchor-rl's anchor store, PVPO's group sampling
                       (the dataloader keeps the prompts it trains on)
    prompt batches     PVPO teacher rows: the ``anchor_rl_teacher`` agent loop writes a
                       prompt's teacher trajectory as its last rollout
    after sampling     V0.5: the prior, the fusion on ``rollout.n`` rollouts, top-up rollouts
                       where the rollouts reject the prior
    old log-probs      teacher rows take the teacher's log-probs (the ratio is pi/pi_gt)
    advantages         :meth:`~.method.MethodState.advantage_step` on the DataProto verl
                       builds (PVPO anchors, V0.5's fused baseline, VAPO's two GAEs)
    actor loss         VAPO: verl's PPO loss + the NLL of correct responses (:mod:`.losses`)
    checkpoints        the V0.5 prior and the anchors' key beside verl's (``anchor_rl.pt``)

verl's mode name is the registered trainer's name, and verl reads the sync/async choice
from it; this trainer sets ``self.trainer_mode = "sync"`` before building its replay buffer,
so everything verl keys on the mode behaves as ``sync`` (colocated, no partial rollout).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from torch.utils.data import Subset
from torchdata.stateful_dataloader import StatefulDataLoader
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.utils import create_rl_sampler
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn
from verl.workers.utils.padding import response_to_nested

import anchor_rl.integrations.verl.estimators  # noqa: F401  (the estimators and policy loss)
from anchor_rl.anchors.filter import FilterResult
from anchor_rl.anchors.presample import PresampleResult, Sampler, presample
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.anchors.teachers import teacher_key
from anchor_rl.integrations.verl import TRAINER
from anchor_rl.integrations.verl.config import MethodConfig, check_verl_config, select
from anchor_rl.integrations.verl.data import (
    FieldTeacher,
    as_list,
    batch_row_keys,
    dataset_records,
    fingerprint_reference,
    plain,
    presample_key,
)
from anchor_rl.integrations.verl.method import NLL_WEIGHT, MethodState, check_resume
from anchor_rl.integrations.verl.registry import check_registered
from anchor_rl.integrations.verl.rollout import (
    TEACHER_FIELD,
    TEACHER_LOGPROBS,
    VerlSampler,
    teacher_payload,
    top_up,
)
from anchor_rl.methods.pvpo import PRESAMPLE_SEED, group_sampling
from anchor_rl.paths import store_path

__all__ = ["AnchorRLTrainer", "Prepared", "prepare_method"]

logger = logging.getLogger(__name__)
STATE_FILE = "anchor_rl.pt"


class Prepared:
    """What :func:`prepare_method` built: the method state, the dataset rows kept (None: all),
    and what presampling and group sampling did."""

    def __init__(
        self,
        state: MethodState,
        rows: list[int] | None,
        presampled: PresampleResult | None,
        filtered: FilterResult | None,
    ) -> None:
        self.state, self.rows, self.presampled, self.filtered = state, rows, presampled, filtered


def prepare_method(
    cfg: MethodConfig,
    rows: list[dict[str, Any]],
    tokenizer: Any = None,
    key: Any = None,
    sampler: Sampler | None = None,
) -> Prepared:
    """The method's state from the training rows (verl dataset items) before the first step.

    With anchors: those under ``anchor_rl.pvpo.anchor_key`` in the store, or else presampled
    with ``sampler`` under ``key`` (rows already stored under it are reused: anchor-rl's
    :func:`~anchor_rl.anchors.presample.presample`); then PVPO's group sampling
    (:func:`~anchor_rl.methods.pvpo.group_sampling`, the field teacher's outcomes cached in
    the store) decides the rows kept. ``tokenizer`` tokenizes the field teacher's traces.
    """
    if not cfg.uses_anchors:
        return Prepared(MethodState(cfg), None, None, None)
    pc = cfg.pvpo
    records, indices = dataset_records(rows, pc.teacher[len("field:") :] if pc.teacher else None)
    ids = [r.id for r in records]
    store = AnchorStore(store_path(cfg.store))
    presampled = None
    if pc.anchor_key is not None:
        digest = pc.anchor_key
    else:
        if key is None or sampler is None:
            raise ValueError("presampling needs the presample key and verl's sampler")
        presampled = presample(
            records, sampler, store, key, pc.m, pc.presample_batch, PRESAMPLE_SEED, progress=False
        )
        digest = key.digest
    stats = store.get_anchors(digest, ids)
    missing = [i for i in ids if i not in stats]
    if missing:
        raise KeyError(
            f"{len(missing)} of {len(ids)} training prompts have no anchor under {digest} in "
            f"{store.path} (anchors are keyed by the prompt's messages, its "
            "reward_model.ground_truth and its data_source; anchors stored by a version that "
            "keyed them by the messages alone, or without the data_source, do not count); "
            "presample them (drop anchor_rl.pvpo.anchor_key) or point it at their key"
        )
    kept, filtered, trajectories = None, None, {}
    if cfg.group_sampling:
        teacher = (
            None if pc.teacher is None else FieldTeacher(pc.teacher[len("field:") :], tokenizer)
        )
        tkey = None if teacher is None else teacher_key(teacher, digest)
        filtered = group_sampling(
            records, stats, teacher, store, tkey, pc.keep_unsolved, pc.teacher, progress=False
        )
        kept = sorted(i for r in filtered.records for i in indices[r.id])
        trajectories = filtered.trajectories
    state = MethodState(cfg, stats, digest, trajectories)
    return Prepared(state, kept, presampled, filtered)


class _SampleHook:
    """verl's replay buffer, with a hook on every training batch it samples (the V0.5 top-ups
    run there, while the rollout replicas are still awake)."""

    def __init__(self, inner: Any, hook: Any) -> None:
        self._inner, self._hook = inner, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, *args: Any, **kwargs: Any) -> tuple[KVBatchMeta, dict]:
        batch, metrics = self._inner.sample(*args, **kwargs)
        partition = kwargs.get("partition_id", args[1] if len(args) > 1 else "train")
        if partition == "train":
            batch = self._hook(batch, metrics)
        return batch, metrics


@register_trainer(TRAINER)
class AnchorRLTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with anchor-rl's PVPO, V0.5 or VAPO (module docstring)."""

    def __init__(self, config: Any) -> None:
        check_registered()  # verl hides a failed plug-in import: refuse a partial install
        self.method_cfg = MethodConfig.from_verl(config)
        check_verl_config(config, self.method_cfg)
        self.state: MethodState | None = None
        self._rows: dict[str, tuple[TensorDict, int]] = {}
        self._resume_folder: str | None = None
        super().__init__(config)

    # -- set-up -------------------------------------------------------------------------

    def _build_replay_buffer(self) -> Any:
        self.trainer_mode = "sync"  # verl reads sync/async from the mode name, ours is TRAINER
        return _SampleHook(super()._build_replay_buffer(), self._on_sampled)

    def on_init_end(self) -> None:
        super().on_init_end()
        vapo = self.method_cfg.vapo
        if self.method_cfg.method == "vapo" and vapo.nll_coef > 0:
            from verl.trainer.distillation import is_distillation_enabled
            from verl.utils.config import omega_conf_to_dataclass

            from anchor_rl.integrations.verl.losses import vapo_actor_loss

            if is_distillation_enabled(self.config.get("distillation")):
                raise ValueError("anchor_rl.vapo.nll_coef > 0 replaces the distillation loss")
            actor = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.actor_rollout_wg.set_loss_fn(
                partial(vapo_actor_loss, config=actor, nll_coef=vapo.nll_coef)
            )

    def fit(self, agent_loop_manager: Any) -> None:
        """Presampling and group sampling (when the method has them), then verl's loop."""
        self.agent_loop_manager = agent_loop_manager
        self.prepare()
        super().fit(agent_loop_manager)

    def training_rows(self) -> list[dict[str, Any]]:
        """Every item of verl's training dataset."""
        return [self.train_dataset[i] for i in range(len(self.train_dataset))]

    def presample_key(self) -> Any:
        """The store key of this run's presampled anchors (see :func:`.data.presample_key`)."""
        pc, rollout = self.method_cfg.pvpo, self.config.actor_rollout_ref.rollout
        reference = pc.reference or fingerprint_reference(
            str(self.config.actor_rollout_ref.model.path)
        )
        names = ("temperature", "top_p", "top_k", "response_length", "prompt_length", "do_sample",
                 "ignore_eos")  # fmt: skip
        sampling = {name: plain(select(rollout, name)) for name in names} | {
            "agent_loop": str(select(rollout, "agent.default_agent_loop")),
            # the agent loop renders the prompts with these (enable_thinking, ...)
            "chat_template_kwargs": plain(
                select(self.config, "data.apply_chat_template_kwargs", {})
            ),
        }
        task = {
            "train_files": plain(select(self.config, "data.train_files")),
            "prompt_key": plain(select(self.config, "data.prompt_key")),
            "reward": plain(select(self.config, "reward.custom_reward_function")),
            "correct_threshold": self.method_cfg.correct_threshold,
        }
        return presample_key(reference, self.tokenizer, sampling, task)

    def _dataset_rows(self, records: Any) -> TensorDict:
        items = [self.train_dataset[r.meta["row"]] for r in records]
        batch = collate_fn(items)
        batch["uid"] = np.array([r.id for r in records], dtype=object)
        return tu.get_tensordict(batch)

    def prepare(self) -> None:
        """Build the method state (module docstring); a resumed run restores its own."""
        mc = self.method_cfg
        if mc.method == "pvpo" and mc.pvpo.teacher is not None:
            loop = select(self.config, "actor_rollout_ref.rollout.agent.default_agent_loop")
            if loop != "single_turn_agent":
                raise ValueError(
                    f"PVPO's teacher rows come from a single-turn agent loop, got {loop!r}: "
                    "set anchor_rl.pvpo.teacher=none"
                )
        sampler = key = None
        if mc.uses_anchors and mc.pvpo.anchor_key is None:
            key = self.presample_key()
            sampler = VerlSampler(self, self._dataset_rows, mc.correct_threshold)
        saved = None
        if self._resume_folder is not None and (Path(self._resume_folder) / STATE_FILE).exists():
            saved = torch.load(Path(self._resume_folder) / STATE_FILE, weights_only=True)
            # before presampling: a changed key would sample anchors the checkpoint never used
            digest = key.digest if key is not None else mc.pvpo.anchor_key
            check_resume(saved, mc.method, digest if mc.uses_anchors else None)
        prepared = prepare_method(mc, self.training_rows(), self.tokenizer, key, sampler)
        self.state = prepared.state
        if prepared.filtered is not None:
            logger.info("anchor_rl group sampling: %s", prepared.filtered.stats.to_dict()["counts"])
        if prepared.rows is not None:
            self._restrict_dataset(prepared.rows)
        if saved is not None:
            self.state.load_state_dict(saved)

    def _restrict_dataset(self, rows: list[int]) -> None:
        """Train on dataset rows ``rows`` only (PVPO's group sampling): a new dataloader over them
        with verl's sampler settings; the epoch length follows."""
        subset = Subset(self.train_dataset, rows)
        old = self.train_dataloader
        self.train_dataloader = StatefulDataLoader(
            dataset=subset, batch_size=old.batch_size, num_workers=old.num_workers, drop_last=True,
            collate_fn=collate_fn, sampler=create_rl_sampler(self.config.data, subset),
        )  # fmt: skip
        self.train_dataloader_it = None
        self.steps_per_epoch = max(1, len(subset) // self.config.data.train_batch_size)
        if self.config.trainer.total_training_steps is None:
            self.total_training_steps = self.steps_per_epoch * self.config.trainer.total_epochs
            logger.warning(
                "anchor_rl group sampling kept %d of %d prompts: %d steps; the optimizers' "
                "schedules were sized for the unfiltered set (set trainer.total_training_steps)",
                len(subset), len(self.train_dataset), self.total_training_steps,
            )  # fmt: skip
        if self._resume_folder is not None:
            path = Path(self._resume_folder) / "data.pt"
            if path.exists():
                self.train_dataloader.load_state_dict(torch.load(path, weights_only=False))

    # -- prompt batches: teacher rows ---------------------------------------------------

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        batch = super()._next_train_batch(num_prompts)
        if self.state is not None and self.state.trajectories:
            n = int(self.config.actor_rollout_ref.rollout.n)
            loop = str(self.config.actor_rollout_ref.rollout.agent.default_agent_loop)
            payloads, names = [], []
            for key in batch_row_keys(batch):
                traj = self.state.trajectories.get(key)
                payloads.append(
                    {}
                    if traj is None
                    else teacher_payload(
                        traj.token_ids.tolist(),
                        traj.logprobs.tolist(),
                        traj.loss_mask.tolist(),
                        n - 1,
                    )
                )
                names.append(loop if traj is None else "anchor_rl_teacher")
            tu.assign_non_tensor_stack(batch, TEACHER_FIELD, payloads)
            tu.assign_non_tensor_stack(batch, "agent_name", names)
        for i, uid in enumerate(as_list(batch["uid"])):
            self._rows[str(uid)] = (batch, i)
        return batch

    def step_rows(self, uids: list[str]) -> TensorDict:
        """The prompt rows (verl's batch layout) of this step's prompts ``uids``."""
        parts = []
        for uid in uids:
            batch, i = self._rows[uid]
            parts.append(tu.index_select_tensor_dict(batch, [i]))
        return parts[0] if len(parts) == 1 else tu.concat_tensordict(parts)

    def on_step_end(self) -> None:
        super().on_step_end()
        self._rows.clear()

    # -- after sampling: V0.5 --------------------------------------------------------------

    def _on_sampled(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if self.method_cfg.method != "v05" or self.state is None:
            return batch
        return top_up(self, batch)

    # -- old log-probs: teacher rows ----------------------------------------------------

    def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_old_log_prob(batch, metrics)
        if self.state is None or not self.state.trajectories:
            return batch
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id,
            select_fields=["extra_fields", "response_mask", "old_log_probs"],
        )  # fmt: skip
        extra = as_list(data["extra_fields"])
        rows = teacher_rows(extra, batch.tags)
        if not rows:
            return batch
        mask = data["response_mask"]
        old = data["old_log_probs"]  # verl's response-only log-probs [B, (R)], nested
        old = old.to_padded_tensor(0.0) if old.is_nested else old.clone()
        for row in rows:
            lp = torch.tensor(plain(extra[row])[TEACHER_LOGPROBS], dtype=old.dtype)
            old[row] = 0
            old[row, : min(len(lp), old.shape[1])] = lp[: old.shape[1]]
        out = TensorDict({"old_log_probs": response_to_nested(old, mask)}, batch_size=len(batch))
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)
        metrics["pvpo/teacher_rows"] = float(len(rows))
        return batch

    # -- advantages -----------------------------------------------------------------------

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage stage (its KL-in-reward and rollout correction included) with the
        method's advantages (:meth:`.method.MethodState.advantage_step`) in place of its
        estimator call; VAPO also writes ``anchor_rl_nll_weight``."""
        if self.state is None:  # fit() builds it; without anchors it needs nothing
            if self.method_cfg.uses_anchors:
                raise RuntimeError("the anchor_rl trainer's advantage stage runs after fit()")
            self.state = MethodState(self.method_cfg)
        method = self.method_cfg.method
        fields = [
            "uid",
            "response_mask",
            "rm_scores",
            "rollout_log_probs",
            "old_log_probs",
            "ref_log_prob",
            "values",
        ]
        if method != "vapo":
            fields += ["raw_prompt", "reward_model", "data_source", "extra_fields"]
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
        )
        response_mask = data["response_mask"]
        non_tensor = {}
        for name in ("uid", "raw_prompt", "reward_model", "data_source", "extra_fields"):
            if name in data:
                non_tensor[name] = object_array([plain(x) for x in as_list(data.pop(name))])
        data = DataProto(batch=data.to_padded_tensor())
        data.non_tensor_batch.update(non_tensor)
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        valid = torch.tensor([not tag.get("is_padding", False) for tag in batch.tags])
        if "extra_fields" in data.non_tensor_batch:
            flags = np.zeros(len(batch), dtype=bool)
            flags[teacher_rows(data.non_tensor_batch.pop("extra_fields"), batch.tags)] = True
            data.non_tensor_batch["anchor_rl_teacher"] = flags
        if self.config.algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(
                data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty
            )
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        corr = self.config.algorithm.get("rollout_correction", None)
        bypass = corr and corr.get("bypass_mode", False)
        correction = corr is not None and "rollout_log_probs" in data.batch and not bypass
        if correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, corr)
            metrics.update(is_metrics)
        metrics.update(
            self.state.advantage_step(
                data, self.config.algorithm, int(self.config.actor_rollout_ref.rollout.n), valid
            )
        )
        names = ["advantages", "returns"]
        if self.config.algorithm.use_kl_in_reward:
            names.append("token_level_rewards")
        if correction:
            names.append("response_mask")
            if "rollout_is_weights" in data.batch:
                names.append("rollout_is_weights")
        out = {name: response_to_nested(data.batch[name], response_mask) for name in names}
        if NLL_WEIGHT in data.batch:
            out[NLL_WEIGHT] = data.batch[NLL_WEIGHT]
        # the handle kv_batch_put returns lists the new fields; the workers get only listed ones
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id,
            fields=TensorDict(out, batch_size=len(batch)),
        )  # fmt: skip

    # -- checkpoints ----------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        super()._save_checkpoint()
        if self.state is not None:
            folder = (
                Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            )
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(self.state.state_dict(), folder / STATE_FILE)

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps > 0:
            trainer = self.config.trainer
            if trainer.resume_mode == "resume_path":
                folder = str(trainer.resume_from_path)
            else:
                folder = os.path.join(
                    str(trainer.default_local_dir), f"global_step_{self.global_steps}"
                )
            self._resume_folder = os.path.abspath(folder)


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array of ``values`` (lists stay elements, never a second axis)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def teacher_rows(extra_fields: Any, tags: list[dict]) -> list[int]:
    """Rows whose trajectory the teacher agent loop injected (padding rows excluded)."""
    rows = []
    for i, (extra, tag) in enumerate(zip(extra_fields, tags, strict=True)):
        if tag.get("is_padding", False):
            continue
        extra = plain(extra)
        if isinstance(extra, dict) and extra.get(TEACHER_FIELD, False):
            rows.append(i)
    return rows
