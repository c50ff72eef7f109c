"""TRL ``GRPOTrainer`` subclasses whose advantages come from anchor-rl's methods.

Shapes: N completions in a generation batch over all processes (``n`` on this process),
G = N / k groups of ``k = num_generations`` completions of one prompt (TRL's
``RepeatSampler`` puts a group's rows next to each other), T completion tokens.

Where each piece enters TRL's step (``_prepare_inputs`` generates once per
``steps_per_generation * num_iterations`` micro-steps and buffers the batch):

    _generate_and_score_completions   (ours, around super())
        before       PVPO: the anchor refresh when due (``pvpo.refresh_every`` optimizer
                     steps, ``state.global_step``, have passed since the last one), then
                     presample the reference on prompts seen for the first time
        super()      TRL: generate (our ``_generate`` below), rewards (our
                     ``_calculate_rewards`` keeps them), old/ref log-probs, its own advantages
        after        the method's advantages replace TRL's, from the same rewards:
                     PVPO ``algos.advantages.pvpo(r, V_sta)``, V0.5 ``algos.advantages.v05(r, b)``
                     with ``b`` the prior fused with the group (``methods.v05.fuse_groups``);
                     the completions table's logged advantages are replaced too; teacher
                     rows get their behaviour log-probs (below)
    _generate        (PVPO, training) super() samples; then the last completion of a group
                     whose prompt has a teacher trajectory is replaced by it (its tokens,
                     its text for the reward functions, its log-probs when the backend
                     returns sampling log-probs), before any reward is computed
    _compute_loss    the teacher rows' ratio is pi_theta / pi_gt in every setting:
                     - TRL computed old log-probs (num_iterations > 1 with misaligned
                       accumulation, or vLLM's importance-sampling correction): the teacher
                       rows' old log-probs are overwritten with log pi_gt, and vLLM's
                       importance-sampling factor is 1 on them (the correction is for the
                       policy's own sampler, not the teacher's);
                     - TRL keeps none (it then uses the loss pass's own log-probs,
                       detached): the batch carries log pi_gt and a teacher-row mask, and the
                       first log-prob pass of ``_compute_loss`` sets ``old_per_token_logps``
                       to its own detached log-probs on policy rows and log pi_gt on teacher
                       rows, before TRL reads it; it is removed after the loss.

Evaluation (``eval_dataset``) is TRL's own: its completions get TRL's group advantages and
no teacher rows.

Every hook overridden here is private TRL API; ``anchor_rl.integrations.trl.version``
pins the TRL releases they are tested against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate.utils import gather_object
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from anchor_rl.anchors.keys import task_identity
from anchor_rl.anchors.presample import task_params
from anchor_rl.anchors.store import AnchorStore, TeacherTrajectory
from anchor_rl.errors import ConfigError
from anchor_rl.integrations.trl.checks import (
    check_columns,
    check_grpo_args,
    check_layout,
    eval_parts,
    eval_records,
)
from anchor_rl.integrations.trl.data import (
    ID_COLUMN,
    resolve_task,
    stop_token_ids,
    task_dataset,
    task_reward_function,
)
from anchor_rl.methods.pvpo import AnchorSet, anchor_seed, presample_set
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.models.lora import inert_lora_base, lora_base, merged_copy
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.paths import store_path
from anchor_rl.rollout.spec import frozen
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task

__all__ = ["AnchoredGRPOTrainer", "fresh_copy"]

STATE_FILE = "anchor_rl_trl.pt"
"""The plug-in's state in each TRL checkpoint (rollout counts; PVPO's anchors in use and last
refresh; V0.5's prior)."""
BEHAVIOUR_KEY = "anchor_rl_behaviour_logps"
"""Batch key of the teacher rows' log pi_gt ``[n, T]`` when TRL keeps no old log-probs."""
TEACHER_KEY = "anchor_rl_teacher_rows"
"""Batch key of the teacher-row mask ``[n]`` (bool) that goes with :data:`BEHAVIOUR_KEY`."""


def fresh_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of ``model``'s weights in a new instance of its class (not a deepcopy:
    TRL patches the policy's ``forward`` with a closure over the original model). A PEFT
    model (``peft_config=``) gives a plain copy with its adapters merged
    (:func:`~anchor_rl.models.lora.merged_copy`)."""
    if hasattr(model, "peft_config"):
        return _without_patched_forward(merged_copy(_peft_base(model)))
    clone = type(model)(model.config).to(dtype=model.dtype)
    clone.load_state_dict(model.state_dict())
    return frozen(clone.to(model.device))


def initial_peft_policy(model: PreTrainedModel) -> PreTrainedModel:
    """A PEFT policy as it is now, frozen: its base model with the adapters taken out,
    sharing the policy's base tensors (:func:`~anchor_rl.models.lora.lora_base`, no copy of
    the weights) while the adapters add nothing (a fresh LoRA: every B zero), else a merged
    copy (:func:`fresh_copy`). The PEFT layers keep the base tensors frozen, so the first
    stays the initial policy as the adapters train."""
    if inert_lora_base(model) is None:
        return fresh_copy(model)
    return _without_patched_forward(lora_base(_peft_base(model)))


def _peft_base(model: PreTrainedModel) -> PreTrainedModel:
    """The model a PEFT wrapper holds (the adapters injected in it); ``model`` itself else."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _without_patched_forward(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` (a module-tree copy of the policy's) without the ``forward`` TRL set on the
    instance (its fused LM head, a closure over the policy: the copy would run the policy),
    frozen."""
    vars(model).pop("forward", None)
    return frozen(model)


@dataclass
class _GenerationBatch:
    """What TRL's hooks learn of one training generation batch while
    ``_generate_and_score_completions`` runs: ``ids[n]`` (this process's prompt id of each
    row), ``rewards [N, F]`` (TRL's, all processes' rows, F reward functions) and
    ``teacher_rows`` (this process's row -> the teacher trajectory that replaced it)."""

    ids: list[str]
    rewards: Tensor | None = None
    teacher_rows: dict[int, TeacherTrajectory] = field(default_factory=dict)


class AnchoredGRPOTrainer(GRPOTrainer):
    """A ``GRPOTrainer`` on an anchor-rl task whose advantages a method computes.

    Subclasses implement :meth:`_advantages` (and may use :meth:`_before_batch`). Takes
    ``GRPOTrainer``'s arguments, except ``reward_funcs`` (the task's reward is the reward:
    anchors and priors are in its units; fold TRL-style reward functions into the task
    with ``anchor_rl.tasks.reward_set.with_rewards``), plus:

    task: a registered task name or an anchor-rl ``Task`` (single-turn); ``task_args`` its
        constructor arguments (part of the anchors' key).
    records: the records the dataset's ``prompt_id`` column names (default: the task's
        train split).
    train_dataset: rows ``{"prompt", "prompt_id"}`` (:func:`~.data.task_dataset`); default:
        every record, built with ``processing_class``. Each prompt must tokenise to the ids
        anchor-rl renders for its record (checked), and the rows must fill at least one
        generation batch (checked: TRL's ``RepeatSampler`` drops a partial one).
    eval_dataset: TRL's, rows ``{"prompt", "prompt_id"}`` too (a dataset or a dict of them),
        e.g. ``task_dataset(task, tokenizer, task.records("test"))``: its ``prompt_id`` names
        a record of ``records`` or of the task's splits, whose reward the task gives (checked
        as ``train_dataset`` is).
    reference_model: the reference the anchors are presampled with; default TRL's
        reference model (``beta > 0``, no ``sync_ref_model``), else the initial policy.
    progress: progress bars and the presampling summary on the console.

    The task's stop strings (``</answer>``) end TRL's completions, as they end anchor-rl's:
    their token ids are added to the eos ids (with vLLM, pass them as
    ``generation_kwargs={"stop_token_ids": [...]}``).
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        *,
        task: Task | str,
        task_args: Mapping[str, Any] | None = None,
        records: Sequence[Record] | None = None,
        reference_model: PreTrainedModel | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        if reward_funcs is not None:
            raise ConfigError(
                "reward_funcs: the trainer's reward is the task's (its anchors and priors are in "
                "its units); fold reward functions into the task with "
                "anchor_rl.tasks.reward_set.with_rewards(task, functions, weights, task_weight), "
                "functions being module-level functions, built-in names or 'module:function'"
            )
        taken = [k for k in ("tools", "rollout_func", "environment_factory") if kwargs.get(k)]
        if taken:
            raise ConfigError(
                f"{', '.join(taken)}: the TRL plug-in covers single-turn generation by the trainer "
                "(teacher rows and anchors are per completion of a prompt); drop them"
            )
        name, task_obj, kwargs_of_task = resolve_task(task, task_args)
        listed = list(task_obj.records("train") if records is None else records)
        by_id = {r.id: r for r in listed}
        # the reward's records: the training ones and those evaluation names
        scored = by_id | eval_records(eval_dataset, task_obj, by_id)
        if train_dataset is None:
            if processing_class is None:
                raise ConfigError(
                    "processing_class: needed to build the dataset of the task's prompts (or pass "
                    "train_dataset=task_dataset(task, tokenizer))"
                )
            train_dataset = task_dataset(task_obj, processing_class, listed)
        super().__init__(
            model, task_reward_function(task_obj, scored), args, train_dataset, eval_dataset,
            processing_class, **kwargs,
        )  # fmt: skip
        self.task, self.task_name, self.task_args = task_obj, name, kwargs_of_task
        self.records_by_id = by_id
        self.progress = progress
        self._explicit_reference = reference_model
        stops = stop_token_ids(self._tokenizer, task_obj.stop)
        check_grpo_args(
            self.args, multimodal=self._is_vlm, stop_strings=task_obj.stop, stops=stops,
            eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        self._add_stops(stops)
        self.dataset_ids = self._check_dataset(self.train_dataset)
        self._check_fills_a_batch("train_dataset has")
        for what, dataset in eval_parts(eval_dataset):
            self._check_dataset(dataset, what, scored)
        self.sampling = task_params(
            SamplingParams(
                temperature=self.args.temperature,
                top_p=self.args.top_p,
                max_new_tokens=self.args.max_completion_length,
            ),
            task_obj,
        )
        self.task_id = task_identity(name, task_obj, kwargs_of_task)
        self.counts = {"policy": 0, "presample": 0, "presample_now": 0, "teacher": 0}
        self.trajectories: dict[str, TeacherTrajectory] = {}
        # TRL calls _generate and _calculate_rewards inside _generate_and_score_completions,
        # and the log-prob pass inside _compute_loss, without the method's state: the batch
        # being generated (None outside), and the loss batch whose old log-probs the first
        # log-prob pass completes (None outside)
        self._batch: _GenerationBatch | None = None
        self._behaviour_pending: dict[str, Any] | None = None

    # --- set-up checks ------------------------------------------------------------------

    def _add_stops(self, stops: Sequence[int]) -> None:
        """End completions at the task's stop tokens (TRL stops on eos ids only)."""
        self.eos_token_ids = [
            *self.eos_token_ids,
            *(s for s in stops if s not in self.eos_token_ids),
        ]
        if not self.use_vllm:
            self.generation_config.eos_token_id = list(self.eos_token_ids)
            self.generation_kwargs["eos_token_id"] = list(self.eos_token_ids)

    def _check_dataset(
        self,
        dataset: Any,
        what: str = "train_dataset",
        records: Mapping[str, Record] | None = None,
    ) -> list[str]:
        """The ``prompt_id`` of every row (as ``str``); ConfigError naming the first row that is
        not one of ``records`` (default: the training records) or whose prompt tokenises to
        other ids than anchor-rl renders for it. ``what`` names the dataset in the errors."""
        by_id = self.records_by_id if records is None else records
        check_columns(dataset, what)
        ids = [str(i) for i in dataset[ID_COLUMN]]
        unknown = [(row, i) for row, i in enumerate(ids) if i not in by_id]
        if unknown:
            row, pid = unknown[0]
            raise ConfigError(
                f"{what} row {row}: prompt_id {pid!r} is not a record of task "
                f"{self.task.name!r} ({len(unknown)} such rows); pass records= the dataset's records"
            )
        prompts, wanted = dataset["prompt"], {}
        for start in range(0, len(prompts), 256):
            got, _, _ = self._tokenize_prompts(prompts[start : start + 256])
            for row, ids_of_row in enumerate(got, start):
                pid = ids[row]
                if pid not in wanted:
                    record = by_id[pid]
                    wanted[pid] = encode_prompt(
                        self._tokenizer, record.prompt, self.task.instruction
                    )
                if list(ids_of_row) != wanted[pid]:
                    raise ConfigError(
                        f"{what} row {row} (prompt_id {pid!r}): its prompt tokenises to other "
                        "ids than anchor-rl renders for the record, so the anchors would be another "
                        "prompt's; build the dataset with anchor_rl.integrations.trl.task_dataset"
                    )
        return ids

    def _check_fills_a_batch(self, what: str) -> None:
        """ConfigError unless ``train_dataset`` has the rows of one generation batch: TRL's
        ``RepeatSampler`` drops a partial batch, so fewer rows would train 0 steps, silently.
        ``what`` says whose rows they are."""
        needed = self.args.generation_batch_size // self.num_generations
        rows = len(self.train_dataset)
        if rows < needed:
            raise ConfigError(
                f"{what} {rows} prompt rows, fewer than the {needed} one generation batch needs "
                f"(generation_batch_size {self.args.generation_batch_size} // num_generations "
                f"{self.num_generations}), and TRL's RepeatSampler drops a partial batch, so "
                "training would do 0 steps; lower per_device_train_batch_size or "
                "steps_per_generation, or train on more prompts"
            )

    def _reference(self, kept_for: tuple[str, str] | None = None) -> PreTrainedModel:
        """The model the anchors are presampled with: ``reference_model``, else TRL's reference
        (when it does not move), else the initial policy: itself when only presampling at
        start uses it, a frozen copy of it made now when ``kept_for = (what, fix)`` names a
        use after training has moved the policy (first-use presampling, reference refreshes;
        for a PEFT model :func:`initial_peft_policy`: a fresh adapter's base model, no copy)."""
        if self._explicit_reference is not None:
            return self._explicit_reference
        if self.ref_model is not None and not self.args.sync_ref_model:
            return self.accelerator.unwrap_model(self.ref_model)
        policy = self.accelerator.unwrap_model(self.model)
        if kept_for is None:
            return policy
        if hasattr(policy, "peft_config"):
            return initial_peft_policy(policy)
        return fresh_copy(policy)

    def _presample_start(
        self, reference: PreTrainedModel, records: Sequence[Record], pvpo: PVPOConfig
    ) -> AnchorSet:
        """Presample ``records`` (rows of the store under the key are reused) and count them."""
        anchor_set = presample_set(
            reference, self._tokenizer, self.task, self.task_id, self.sampling, records,
            AnchorStore(store_path(pvpo.store)), pvpo, progress=self.progress and bool(records),
            seed=anchor_seed(pvpo),
        )  # fmt: skip
        self.counts["presample"] = anchor_set.rollouts
        self.counts["presample_now"] = anchor_set.result.rollouts
        return anchor_set

    def _unique_records(self) -> list[Record]:
        """The dataset's records, each once, in order of first appearance."""
        return [self.records_by_id[i] for i in dict.fromkeys(self.dataset_ids)]

    # --- what a method supplies ---------------------------------------------------------

    def _before_batch(self, ids: Sequence[str]) -> dict[str, float]:
        """Work before a training generation batch of this process's prompt ``ids``; metrics."""
        return {}

    def _advantages(
        self, rewards: Tensor, ids: Sequence[str], k: int
    ) -> tuple[Tensor, dict[str, float]]:
        """``(advantages[N], metrics)`` of the whole generation batch: ``rewards[N]`` (float32 on
        the CPU, NaN where no reward function scored the row), ``ids[N]`` the prompt id of each
        row, groups of ``k`` consecutive rows."""
        raise NotImplementedError

    def _plugin_state(self) -> dict[str, Any]:
        return {"counts": dict(self.counts)}

    def _load_plugin_state(self, state: Mapping[str, Any]) -> None:
        self.counts.update({k: int(v) for k, v in state["counts"].items()})

    def rollout_counts(self) -> dict[str, int]:
        """Rollouts this trainer rests on: ``policy`` (completions generated in training,
        those a teacher row replaced included), ``presample`` (reference rollouts the
        presampled anchors rest on, rows found in the store included), ``presample_now``
        (those the run sampled), ``teacher`` (teacher samples the trajectories rest on),
        PVPO's ``refresh`` and ``refresh_now`` (the same for its anchor refreshes) and
        ``total`` (policy + presample + refresh + teacher)."""
        counts = dict(self.counts)
        counts["total"] = (
            counts["policy"] + counts["presample"] + counts.get("refresh", 0) + counts["teacher"]
        )
        return counts

    # --- TRL's hooks ----------------------------------------------------------------------

    def _calculate_rewards(
        self,
        inputs: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids_list: list[list[int]],
    ) -> Tensor:
        """TRL's rewards ``[N, F]`` (N rows of all processes, F reward functions), kept for the
        method's advantages."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._batch is not None:
            self._batch.rewards = rewards
        return rewards

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        """TRL's generation; then, in training, the last completion of each group whose prompt
        has a teacher trajectory becomes that trajectory (before any reward is computed)."""
        result = super()._generate(prompts)
        batch = self._batch
        if not self.model.training or not self.trajectories or batch is None:
            return result
        ids = batch.ids
        if len(ids) != len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts generated for {len(ids)} batch rows")
        prompt_ids, completion_ids, tool_mask, completions, logprobs, *rest = result
        k, first = self.num_generations, self.accelerator.process_index * len(prompts)
        for row, pid in enumerate(ids):
            traj = self.trajectories.get(pid)
            if traj is None or (first + row) % k != k - 1:
                continue
            tokens = traj.token_ids.tolist()
            text = self._tokenizer.decode(tokens, skip_special_tokens=True)
            completion_ids[row] = tokens
            completions[row] = (
                text
                if isinstance(completions[row], str)
                else [{"role": "assistant", "content": text}]
            )
            if logprobs is not None:
                logprobs[row] = traj.logprobs.tolist()
            batch.teacher_rows[row] = traj
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs, *rest)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation batch with the method's advantages (see the module docstring)."""
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        ids = [str(row[ID_COLUMN]) for row in inputs]
        batch = _GenerationBatch(ids)
        metrics = self._before_batch(ids)
        self._batch = batch
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._batch = None
        every = [str(i) for i in gather_object(ids)]
        k = self.num_generations
        check_layout(every, k)
        per_func = batch.rewards
        if per_func is None or len(per_func) != len(every):
            raise RuntimeError("TRL computed no rewards for the whole generation batch")
        rewards = per_func.nansum(dim=1)  # reward_weights are all 1 (check_grpo_args)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        advantages, method_metrics = self._advantages(rewards.detach().float().cpu(), every, k)
        advantages = torch.nan_to_num(advantages.float(), nan=0.0)
        first = self.accelerator.process_index * len(ids)
        local = advantages[first : first + len(ids)]
        output["advantages"] = local.to(output["advantages"].device, output["advantages"].dtype)
        logged = self._logs["advantages"]
        for _ in range(min(len(every), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())
        scored = advantages[~torch.isnan(rewards.cpu())]
        metrics |= method_metrics | {
            "advantages/mean": scored.mean().item() if len(scored) else 0.0,
            "advantages/std": scored.std().item() if len(scored) > 1 else 0.0,
        }
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))
        self.counts["policy"] += len(every)
        if batch.teacher_rows:
            self._behaviour(output, batch.teacher_rows)
        return output

    def _behaviour(
        self, output: dict[str, Any], teacher_rows: Mapping[int, TeacherTrajectory]
    ) -> None:
        """Put log pi_gt of ``teacher_rows`` (row of ``output`` -> its trajectory) where the
        teacher rows' old log-probs are read (see the module docstring)."""
        completion_ids = output["completion_ids"]
        n, t = completion_ids.shape
        behaviour = torch.zeros(n, t, device=completion_ids.device)
        rows = torch.zeros(n, dtype=torch.bool, device=completion_ids.device)
        for row, traj in teacher_rows.items():
            behaviour[row, : len(traj)] = traj.logprobs.to(behaviour)
            rows[row] = True
        if output.get("old_per_token_logps") is None:
            output[BEHAVIOUR_KEY], output[TEACHER_KEY] = behaviour, rows
        for key in ("old_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio"):
            if (kept := output.get(key)) is not None:
                ones = key == "importance_sampling_ratio"  # vLLM's correction: 1 on teacher rows
                teacher = torch.ones_like(kept) if ones else behaviour.to(kept)
                output[key] = torch.where(rows[:, None], teacher, kept)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        """TRL's loss; a batch with teacher rows and no old log-probs gets them from the first
        log-prob pass (:meth:`_get_per_token_logps_and_entropies`)."""
        if BEHAVIOUR_KEY not in inputs:
            return super()._compute_loss(model, inputs)
        self._behaviour_pending = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._behaviour_pending = None
            inputs.pop("old_per_token_logps", None)  # the batch may be used again (accumulation)

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """TRL's log-prob pass; inside :meth:`_compute_loss` of a batch with teacher rows and no
        old log-probs, its own detached log-probs become the policy rows' old log-probs and log
        pi_gt the teacher rows' (TRL reads ``old_per_token_logps`` after this pass)."""
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._behaviour_pending = self._behaviour_pending, None
        if inputs is not None:
            own = out[0].detach()
            inputs["old_per_token_logps"] = torch.where(
                inputs[TEACHER_KEY][:, None], inputs[BEHAVIOUR_KEY].to(own), own
            )
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            path = Path(self._get_output_dir(trial=trial)) / folder / STATE_FILE
            torch.save(self._plugin_state(), path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and (Path(checkpoint) / STATE_FILE).is_file():
            self._load_plugin_state(torch.load(Path(checkpoint) / STATE_FILE, weights_only=True))
