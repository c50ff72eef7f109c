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
                     with ``b`` the prior fused with the group (``trainer.v05.fuse_groups``);
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

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import datasets
import torch
from accelerate.utils import gather_object
from pydantic import BaseModel, ValidationError
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from anchor_rl.algos.registry import compute_advantage
from anchor_rl.anchors.filter import FilterResult
from anchor_rl.anchors.keys import AnchorKey, fingerprint_model, task_identity
from anchor_rl.anchors.presample import RolloutSampler, refresh_anchors, refresh_key, task_params
from anchor_rl.anchors.presample import presample as presample_prompts
from anchor_rl.anchors.priors import HistoryPrior, prompt_embeddings
from anchor_rl.anchors.store import AnchorStat, AnchorStore, TeacherTrajectory, anchor_values
from anchor_rl.bench.trl_compare import stop_token_ids
from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.integrations.trl.data import (
    ID_COLUMN,
    resolve_task,
    task_dataset,
    task_reward_function,
)
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.methods.v05_config import V05Config
from anchor_rl.models.tokenizer import encode_prompt
from anchor_rl.rollout.engine import close_engine, make_engine
from anchor_rl.rollout.spec import frozen, load_spec
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task
from anchor_rl.trainer.pvpo import (
    FILTER_FILE,
    PRESAMPLE_SEED,
    AnchorSet,
    group_sampling,
    presample_set,
    pvpo_teacher,
    store_path,
)
from anchor_rl.trainer.v05 import (
    build_prior,
    check_rewards,
    extra_counts,
    fuse_groups,
    fusion_metrics,
    uses_anchors,
    uses_embeddings,
)

__all__ = [
    "AnchoredGRPOTrainer",
    "PVPOGRPOTrainer",
    "UnsupportedFeatureError",
    "V05GRPOTrainer",
]

STATE_FILE = "anchor_rl_trl.pt"
"""The plug-in's state in each TRL checkpoint (rollout counts; PVPO's anchors in use and last
refresh; V0.5's prior)."""
BEHAVIOUR_KEY = "anchor_rl_behaviour_logps"
"""Batch key of the teacher rows' log pi_gt ``[n, T]`` when TRL keeps no old log-probs."""
TEACHER_KEY = "anchor_rl_teacher_rows"
"""Batch key of the teacher-row mask ``[n]`` (bool) that goes with :data:`BEHAVIOUR_KEY`."""
NEUTRAL_GENERATION_KWARGS = frozenset(
    {"use_cache", "cache_implementation", "cache_config", "stop_token_ids"}
)
"""The ``generation_kwargs`` keys the plug-in accepts: cache and implementation options, which
change neither the sampled distribution nor the lengths, and vLLM's ``stop_token_ids`` (the
task's stop ids, needed with ``use_vllm``; checked). Every other key (temperature, length
caps, n-gram bans, logits processors, token biases, ...) may change what is sampled away from
what the anchors were sampled under, and is refused."""

Section = TypeVar("Section", bound=BaseModel)
_log = logging.getLogger(__name__)


class UnsupportedFeatureError(AnchorRLError, NotImplementedError):
    """A method's feature the TRL plug-in does not offer; the message says why and what to use."""


def section(cls: type[Section], value: Section | Mapping[str, Any] | None, name: str) -> Section:
    """``value`` as the config section ``cls`` (a section, a mapping of its fields, or None for
    its defaults); ConfigError naming ``name.FIELD`` for a bad value."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: a {cls.__name__} or a mapping, got {type(value).__name__}")
    try:
        return cls(**value)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join([name, *map(str, err["loc"])])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: unknown key" if err["type"] == "extra_forbidden" else
                         f"{where}: {msg} (got {err['input']!r})")  # fmt: skip
        raise ConfigError("; ".join(lines)) from None


def _non_default(cfg: BaseModel, fields: Sequence[str]) -> list[str]:
    """The ``fields`` of ``cfg`` whose value differs from the section's default."""
    default = type(cfg)()
    return [f for f in fields if getattr(cfg, f) != getattr(default, f)]


def _fresh_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of ``model``'s weights in a new instance of its class (not a deepcopy:
    TRL patches the policy's ``forward`` with a closure over the original model)."""
    clone = type(model)(model.config).to(dtype=model.dtype)
    clone.load_state_dict(model.state_dict())
    return frozen(clone.to(model.device))


def _check_columns(dataset: Any, what: str) -> None:
    """ConfigError unless ``dataset`` is a map-style dataset with ``prompt`` and ``prompt_id``."""
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(
            f"{what}: a datasets.Dataset (map-style: its rows are checked before training, and "
            f"the training rows filtered by group sampling), got {type(dataset).__name__}"
        )
    missing = sorted({"prompt", ID_COLUMN} - set(dataset.column_names))
    if missing:
        raise ConfigError(
            f"{what} lacks the column(s) {missing}; build it with "
            "anchor_rl.integrations.trl.task_dataset(task, tokenizer)"
        )


def _eval_parts(eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(name in errors, dataset)`` of each evaluation dataset TRL is given (one, or a dict)."""
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, Mapping):
        return [(f"eval_dataset[{key!r}]", part) for key, part in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def _eval_records(eval_dataset: Any, task: Task, known: Mapping[str, Record]) -> dict[str, Record]:
    """The records the evaluation rows name beyond ``known``, from the task's splits: the
    reward function looks every scored row's record up (ids found nowhere are left for
    :meth:`AnchoredGRPOTrainer._check_dataset` to name)."""
    wanted: set[str] = set()
    for what, dataset in _eval_parts(eval_dataset):
        _check_columns(dataset, what)
        wanted |= {str(i) for i in dataset[ID_COLUMN]} - set(known)
    found: dict[str, Record] = {}
    for split in ("test", "train"):
        if wanted - set(found):
            found |= {r.id: r for r in task.records(split) if r.id in wanted}
    return found


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
        scored = by_id | _eval_records(eval_dataset, task_obj, by_id)
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
        self._check_settings()
        self._add_stops(stop_token_ids(self._tokenizer, task_obj.stop))
        self.dataset_ids = self._check_dataset(self.train_dataset)
        self._check_fills_a_batch("train_dataset has")
        for what, dataset in _eval_parts(eval_dataset):
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
        # per generation batch (this process): its prompt ids, the rewards TRL computed, the
        # rows a teacher trajectory replaced; during one loss call: the batch to complete
        self._local_ids: list[str] | None = None
        self._rewards_per_func: Tensor | None = None
        self._teacher_rows: dict[int, TeacherTrajectory] = {}
        self._behaviour_pending: dict[str, Any] | None = None

    # --- set-up checks ------------------------------------------------------------------

    def _check_settings(self) -> None:
        """ConfigError naming every GRPOConfig field that cannot work with the plug-in."""
        a, problems = self.args, []
        if a.remove_unused_columns:
            problems.append(
                "remove_unused_columns=True drops the prompt_id column the methods look prompts "
                "up by; set remove_unused_columns=False"
            )
        if a.top_k not in (0, -1, None):
            problems.append(f"top_k={a.top_k}: anchors are sampled without top-k; set top_k=0")
        if a.min_p is not None:
            problems.append(f"min_p={a.min_p}: anchors are sampled without min-p; set min_p=None")
        if a.repetition_penalty != 1.0:
            problems.append(
                f"repetition_penalty={a.repetition_penalty}: anchors are sampled without it; set 1.0"
            )
        weights = list(a.reward_weights or [])
        if any(float(w) != 1.0 for w in weights):
            problems.append(
                f"reward_weights={weights}: the trainer's reward is the task's (its anchors and "
                "priors are in its units, unweighted); drop reward_weights and fold weights into "
                "the task with anchor_rl.tasks.reward_set.with_rewards(task, functions, weights, "
                "task_weight)"
            )
        kw = a.generation_kwargs or {}
        if bad := sorted(set(kw) - NEUTRAL_GENERATION_KWARGS):
            problems.append(
                f"generation_kwargs {bad}: they may change what is sampled (its distribution or "
                "lengths) away from the anchors' sampling; the plug-in accepts only "
                f"{sorted(NEUTRAL_GENERATION_KWARGS)} there (set temperature, top_p and "
                "max_completion_length on GRPOConfig)"
            )
        if getattr(a, "vllm_structured_outputs_regex", None):
            problems.append(
                "vllm_structured_outputs_regex: it constrains what vLLM samples, and the anchors "
                "are sampled without it; drop it"
            )
        if self._is_vlm:
            problems.append("processing_class: a multimodal processor; the plug-in is text-only")
        stops = stop_token_ids(self._tokenizer, self.task.stop)
        given = set(kw.get("stop_token_ids") or [])
        if a.use_vllm and not set(stops) <= given:
            problems.append(
                f"use_vllm=True: the task's stops {self.task.stop} must end vLLM's completions "
                f'as they end the anchors\'; set generation_kwargs={{"stop_token_ids": {stops}}}'
            )
        # the ids that end the anchors' rollouts: the task's stops and the eos ids
        if extra := sorted(given - {*stops, *self.eos_token_ids}):
            problems.append(
                f"generation_kwargs stop_token_ids {extra}: ids other than the task's stops and "
                "eos end completions where the anchors' rollouts did not stop; drop them"
            )
        if problems:
            raise ConfigError("; ".join(problems))

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
        _check_columns(dataset, what)
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
        ConfigError naming ``what`` and ``fix`` for a PEFT model, which cannot be copied so)."""
        if self._explicit_reference is not None:
            return self._explicit_reference
        if self.ref_model is not None and not self.args.sync_ref_model:
            return self.accelerator.unwrap_model(self.ref_model)
        policy = self.accelerator.unwrap_model(self.model)
        if kept_for is None:
            return policy
        if hasattr(policy, "peft_config"):
            what, fix = kept_for
            raise ConfigError(f"{what} with a PEFT model and no fixed reference: {fix}")
        return _fresh_copy(policy)

    def _presample_start(
        self, reference: PreTrainedModel, records: Sequence[Record], pvpo: PVPOConfig
    ) -> AnchorSet:
        """Presample ``records`` (rows of the store under the key are reused) and count them."""
        anchor_set = presample_set(
            reference, self._tokenizer, self.task, self.task_id, self.sampling, records,
            AnchorStore(store_path(pvpo)), pvpo, progress=self.progress and bool(records),
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
        self._rewards_per_func = rewards
        return rewards

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        """TRL's generation; then, in training, the last completion of each group whose prompt
        has a teacher trajectory becomes that trajectory (before any reward is computed)."""
        result = super()._generate(prompts)
        ids = self._local_ids
        if not self.model.training or not self.trajectories or ids is None:
            return result
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
            self._teacher_rows[row] = traj
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs, *rest)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation batch with the method's advantages (see the module docstring)."""
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        ids = [str(row[ID_COLUMN]) for row in inputs]
        self._local_ids, self._teacher_rows, self._rewards_per_func = ids, {}, None
        metrics = self._before_batch(ids)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._local_ids = None
        every = [str(i) for i in gather_object(ids)]
        k = self.num_generations
        _check_layout(every, k)
        per_func = self._rewards_per_func
        if per_func is None or len(per_func) != len(every):
            raise RuntimeError("TRL computed no rewards for the whole generation batch")
        rewards = per_func.nansum(dim=1)  # reward_weights are all 1 (_check_settings)
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
        if self._teacher_rows:
            self._behaviour(output)
        return output

    def _behaviour(self, output: dict[str, Any]) -> None:
        """Put log pi_gt where the teacher rows' old log-probs are read (see the module docstring)."""
        completion_ids = output["completion_ids"]
        n, t = completion_ids.shape
        behaviour = torch.zeros(n, t, device=completion_ids.device)
        rows = torch.zeros(n, dtype=torch.bool, device=completion_ids.device)
        for row, traj in self._teacher_rows.items():
            behaviour[row, : len(traj)] = traj.logprobs.to(behaviour)
            rows[row] = True
        old = output.get("old_per_token_logps")
        if old is not None:
            output["old_per_token_logps"] = torch.where(rows[:, None], behaviour.to(old), old)
        else:
            output[BEHAVIOUR_KEY], output[TEACHER_KEY] = behaviour, rows
        sampled = output.get("sampling_per_token_logps")
        if sampled is not None:
            output["sampling_per_token_logps"] = torch.where(
                rows[:, None], behaviour.to(sampled), sampled
            )
        ratio = output.get("importance_sampling_ratio")
        if ratio is not None:
            output["importance_sampling_ratio"] = torch.where(
                rows[:, None], torch.ones_like(ratio), ratio
            )

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


def _check_layout(ids: Sequence[str], k: int) -> None:
    """RuntimeError unless ``ids`` are groups of ``k`` consecutive rows of one prompt."""
    if len(ids) % k:
        raise RuntimeError(f"a generation batch of {len(ids)} rows is not groups of {k}")
    for g in range(len(ids) // k):
        if len(set(ids[g * k : (g + 1) * k])) != 1:
            raise RuntimeError(
                f"rows {g * k}..{(g + 1) * k - 1} of the generation batch are not one prompt's "
                f"group ({sorted(set(ids[g * k : (g + 1) * k]))}); the plug-in needs TRL's "
                "RepeatSampler layout (a map-style dataset)"
            )


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

    Refresh (``pvpo.refresh_every = K > 0``), as in ``anchor-rl train --preset pvpo``: the
    anchors of the training prompts are re-estimated by ``anchors.presample.refresh_anchors``
    once K, 2K, ... optimizer steps (``state.global_step``) have passed, at the start of the
    next generation batch (never within one), and serve every advantage from then on. The
    refresh is keyed by the step it was due at, K, 2K, ..., whichever batch makes it (the
    one starting there, as with TRL's default ``steps_per_generation =
    gradient_accumulation_steps`` and ``num_iterations = 1``; else the first generation
    batch after it), so a run resumed mid-generation-batch, whose batches start at other
    steps, makes it under the same key and finds its rows (a checkpoint of an older
    plug-in, which keyed it by the batch's step, keeps its key).
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
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        *,
        task: Task | str,
        pvpo: PVPOConfig | Mapping[str, Any] | None = None,
        group_sampling: bool = True,
        presample: Literal["first_use", "start"] = "first_use",
        task_args: Mapping[str, Any] | None = None,
        records: Sequence[Record] | None = None,
        reference_model: PreTrainedModel | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        pc = section(PVPOConfig, pvpo, "pvpo")
        _check_pvpo(pc, group_sampling, presample)
        super().__init__(
            model, reward_funcs, args, train_dataset, eval_dataset, processing_class, task=task,
            task_args=task_args, records=records, reference_model=reference_model,
            progress=progress, **kwargs,
        )  # fmt: skip
        if pc.teacher == "oracle:reference" and self.args.top_p < 1:
            raise ConfigError(
                "pvpo.teacher='oracle:reference' with top_p < 1: its pi_gt has no nucleus; use "
                "pvpo.teacher='oracle' or top_p=1"
            )
        self.pvpo, self.group_sampling = pc, group_sampling
        at_start = group_sampling or presample == "start"
        policy = self.accelerator.unwrap_model(self.model)
        if pc.refresh_every and pc.refresh_mode == "policy" and hasattr(policy, "peft_config"):
            raise ConfigError(
                "pvpo.refresh_mode='policy' with a PEFT model: a refresh samples a frozen copy of "
                "the policy's weights, which the plug-in cannot make of a PEFT model; use "
                "refresh_mode='reference'"
            )
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
        if progress:
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
        result = group_sampling(self.anchor_set, teacher, self.task_id, pc, self.progress)
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
        every, step = self.pvpo.refresh_every, self.state.global_step
        last = self.last_refresh["step"] if self.last_refresh else 0
        if not every or step // every <= last // every:
            return {}
        return self.refresh(every * (step // every))

    def refresh(self, step: int) -> dict[str, float]:
        """Re-estimate the anchors of the training prompts for the refresh due after ``step``
        optimizer steps (``pvpo.refresh_mode``; ``step`` keys it) with
        ``anchors.presample.refresh_anchors``; they serve from now on. ``policy`` mode samples a frozen copy of the current policy, keyed by its
        weight fingerprint; rows already stored under the refresh key (a refresh repeated by
        a resumed run) are reused, nothing sampled. Metrics ``pvpo/refresh_sampled`` and
        ``pvpo/refresh_seconds``."""
        pc, store, started = self.pvpo, self.anchor_set.store, time.perf_counter()
        records = [r for r in self._unique_records() if r.id in self.anchors]
        sampler, engine, fingerprint = self.anchor_set.sampler, None, None
        if pc.refresh_mode == "policy":  # the snapshot lives as long as its engine, no longer
            snapshot = _fresh_copy(self.accelerator.unwrap_model(self.model))
            fingerprint = fingerprint_model(snapshot)
            engine = make_engine("hf", snapshot, self._tokenizer)
            sampler = RolloutSampler(engine, self.task, self.sampling)
        try:
            result = refresh_anchors(
                records, sampler, store, self.anchor_set.key, pc.refresh_mode, step, pc.m,
                model_fingerprint=fingerprint, batch_size=pc.presample_batch,
                seed=anchor_seed(pc), progress=self.progress,
            )  # fmt: skip
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
        read from the store; a checkpoint without them (an older plug-in) keeps the counts only."""
        super()._load_plugin_state(state)
        saved = state.get("pvpo")
        if saved is None:
            return
        last, key = saved["last_refresh"], self.anchor_set.key
        if last is not None:
            last = {
                "step": int(last["step"]),
                "mode": last["mode"],
                "fingerprint": last["fingerprint"],
            }
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


def anchor_seed(pc: PVPOConfig) -> int:
    """The anchor seed (part of the store key): ``pvpo.presample_seed``, else 0, the default
    of ``anchor-rl presample --seed`` (``anchor-rl train`` falls back to the run's seed)."""
    return PRESAMPLE_SEED if pc.presample_seed is None else pc.presample_seed


def _check_pvpo(pc: PVPOConfig, group_sampling: bool, presample: str) -> None:
    if presample not in ("first_use", "start"):
        raise ConfigError(f"presample={presample!r}: choose 'first_use' or 'start'")
    if pc.prompts not in ("auto", "all"):
        raise ConfigError(
            f"pvpo.prompts={pc.prompts}: the TRL plug-in presamples every prompt of "
            "train_dataset (or each on its first use), it does not walk a subset; pass a "
            "train_dataset (or records=) of the prompts to train on and drop pvpo.prompts"
        )
    if not pc.refresh_every and _non_default(pc, ["refresh_mode"]):
        raise ConfigError(
            "pvpo.refresh_mode has no effect: pvpo.refresh_every=0 never refreshes; drop it or "
            "set pvpo.refresh_every=K"
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
    teacher = _non_default(pc, ["teacher", "teacher_model", "teacher_tries", "keep_unsolved"])
    if teacher and not group_sampling:
        raise ConfigError(
            f"pvpo.{', pvpo.'.join(teacher)} without group sampling: teachers serve group "
            "sampling; set group_sampling=True or drop them"
        )


class V05GRPOTrainer(AnchoredGRPOTrainer):
    """TRL's GRPO with V0.5's baseline: each group's rewards fused with the prompt's prior.

    Per generation batch, for each prompt's group of ``k = num_generations`` rewards: the
    prior ``V`` (``trainer.v05.build_prior``: the anchor, the history posterior or knn, as
    ``v05.prior`` says), the real-time test of the prior and the fusion
    (``trainer.v05.fuse_groups``: positive-part James-Stein, ``algos.v05.fuse``), the
    advantage ``r - b`` (``algos.advantages.v05``), then the prior learns the group's rewards.
    The history prior's forgetting clock counts anchor-rl's steps, the policy versions that
    sampled training rollouts: one per generation batch sampled from new weights, whatever
    ``num_iterations`` and the accumulation; batches sampled from the same weights share one
    (:meth:`_learn`). The prior is saved in every TRL checkpoint and restored on resume.

    v05: V0.5's knobs (``anchor_rl.methods.v05_config.V05Config`` or a mapping of its
        fields). The probe (``v05.probe_*``) and ``v05.top_up_rounds`` are not offered.
    pvpo: presampling of the ``anchor`` prior's anchors (``m``, ``store``,
        ``presample_batch``, ``presample_seed``; every prompt is presampled at start); only
        with an anchor-based prior.
    budget: ``fixed`` (``num_generations`` per prompt). ``adaptive`` (top-up rollouts where
        the prior is rejected) raises :class:`UnsupportedFeatureError`: TRL generates the
        same number of completions for every prompt and reshapes the rewards to
        ``[-1, num_generations]``. What the budget rule would have asked for is logged as
        ``v05/extra_rollouts_wanted``.

    The rest as :class:`AnchoredGRPOTrainer`. After set-up: ``prior`` (its state) and
    ``anchor_set`` (None without an anchor-based prior).
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
        v05: V05Config | Mapping[str, Any] | None = None,
        pvpo: PVPOConfig | Mapping[str, Any] | None = None,
        budget: Literal["fixed", "adaptive"] = "fixed",
        task_args: Mapping[str, Any] | None = None,
        records: Sequence[Record] | None = None,
        reference_model: PreTrainedModel | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        vc = section(V05Config, v05, "v05")
        pc = section(PVPOConfig, pvpo, "pvpo")
        _check_v05(vc, pvpo is not None, pc, budget)
        super().__init__(
            model, reward_funcs, args, train_dataset, eval_dataset, processing_class, task=task,
            task_args=task_args, records=records, reference_model=reference_model,
            progress=progress, **kwargs,
        )  # fmt: skip
        if self.num_generations > vc.k_max:
            raise ConfigError(
                f"num_generations={self.num_generations} above v05.k_max={vc.k_max}: raise v05.k_max"
            )
        self.v05 = vc
        self.anchor_set: AnchorSet | None = None
        anchors = None
        if uses_anchors(vc):
            self.anchor_set = self._presample_start(self._reference(), self._unique_records(), pc)
            anchors = self.anchor_set.means()
        self.prior = build_prior(vc, anchors)
        # state.global_step when the prior last learned (None: not yet in this process)
        self._prior_version: int | None = None

    def _advantages(
        self, rewards: Tensor, ids: Sequence[str], k: int
    ) -> tuple[Tensor, dict[str, float]]:
        """Fuse each group's rewards with its prior; ``algos.advantages.v05``: ``r - b``, ``[N]``."""
        vc = self.v05
        check_rewards(rewards, vc)
        prompts = list(ids[::k])
        group = torch.arange(len(ids)) // k
        emb = self._embed(prompts) if uses_embeddings(vc) else None
        prior = self.prior.predict(prompts, emb)
        fusion = fuse_groups(rewards, group, prior, vc)
        baseline = fusion.baseline.to(rewards.dtype)[group]
        advantages = compute_advantage("v05", rewards=rewards, baseline=baseline)
        self._learn(prompts, [rewards[group == g] for g in range(len(prompts))], emb)
        metrics = fusion_metrics(fusion, fusion, 0)
        metrics["v05/extra_rollouts_wanted"] = float(extra_counts(fusion, vc).sum())
        return advantages, metrics

    def _learn(self, prompts: Sequence[str], groups: Sequence[Tensor], emb: Tensor | None) -> None:
        """The prior learns a generation batch's groups, on anchor-rl's step clock.

        anchor-rl's V0.5 updates the prior once per training step, a step being one batch of
        rollouts sampled from the current weights and then trained on for ``optim.epochs x
        optim.mini_batches`` optimizer steps (``trainer.loop.train_step``); the history
        prior's forgetting clock (``HistoryPrior.step``) thus counts the policy versions that
        sampled training rollouts, neither optimizer steps nor rollout batches. In TRL a
        generation batch is sampled from the weights after ``state.global_step`` optimizer
        steps and trained on by ``steps_per_generation * num_iterations`` micro-steps, so:

        - a generation batch sampled from new weights is one step: it advances the clock by
          one, however many optimizer steps then train on it (``num_iterations``, TRL's
          epochs; ``steps_per_generation / gradient_accumulation_steps``, its mini-batches);
        - generation batches sampled from the same weights (``steps_per_generation <
          gradient_accumulation_steps``: one optimizer step spans several) are one step:
          the first advances the clock and the others join it, their evidence added at the
          same clock value, undiscounted, as anchor-rl's one update with the whole step's
          rollouts would add it. (Each batch is still fused with the prior as it stands
          when the batch is scored, so a later batch of the step sees the earlier ones.)
        """
        version = self.state.global_step
        if isinstance(self.prior, HistoryPrior):
            self.prior.update(prompts, groups, emb, advance=version != self._prior_version)
        else:  # no clock
            self.prior.update(prompts, groups, emb)
        self._prior_version = version

    def _embed(self, prompts: Sequence[str]) -> Tensor:
        """``[G, D]``: each prompt embedded by the policy, on the ids it is sampled from."""
        ids = [
            encode_prompt(self._tokenizer, self.records_by_id[p].prompt, self.task.instruction)
            for p in prompts
        ]
        return prompt_embeddings(self.accelerator.unwrap_model(self.model), None, ids)

    def _plugin_state(self) -> dict[str, Any]:
        return super()._plugin_state() | {"prior": self.prior.state_dict()}

    def _load_plugin_state(self, state: Mapping[str, Any]) -> None:
        super()._load_plugin_state(state)
        self.prior.load_state_dict(state["prior"])


_PROBE_FIELDS = (
    "probe_every",
    "probe_prompts",
    "probe_truth",
    "probe_heldout",
    "probe_heldout_truth",
)


def _check_v05(vc: V05Config, pvpo_given: bool, pc: PVPOConfig, budget: str) -> None:
    if budget == "adaptive":
        raise UnsupportedFeatureError(
            "budget='adaptive': V0.5's top-up rollouts need more completions for some prompts "
            "than others, and TRL's GRPOTrainer generates num_generations per prompt (its "
            "RepeatSampler) and reshapes the rewards to [-1, num_generations] in "
            "_generate_and_score_completions; use budget='fixed' (v05/extra_rollouts_wanted "
            "logs what the rule would add), or anchor-rl train --preset v05"
        )
    if budget != "fixed":
        raise ConfigError(f"budget={budget!r}: choose 'fixed' ('adaptive' is not offered)")
    if probe := _non_default(vc, _PROBE_FIELDS):
        raise ConfigError(
            f"v05.{', v05.'.join(probe)}: the baseline-MSE probe is not offered in the TRL "
            "plug-in; drop them (anchor-rl train --preset v05 v05.probe_every=E runs it)"
        )
    if _non_default(vc, ["top_up_rounds"]):
        raise ConfigError("v05.top_up_rounds sizes top-ups, which the TRL plug-in does not sample")
    if pvpo_given and not uses_anchors(vc):
        raise ConfigError(
            f"pvpo with v05.prior={vc.prior!r}: nothing presamples; drop pvpo, or an anchor prior"
        )
    read = ("m", "store", "presample_batch", "presample_seed")
    extra = _non_default(pc, [f for f in PVPOConfig.model_fields if f not in read])
    if extra:
        raise ConfigError(
            f"pvpo.{', pvpo.'.join(extra)}: V05GRPOTrainer reads pvpo.m, pvpo.store, "
            "pvpo.presample_batch and pvpo.presample_seed only (group sampling is "
            "PVPOGRPOTrainer's)"
        )
