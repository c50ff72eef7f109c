"""Set-up checks of the TRL plug-in that need no trainer: its config sections, the
``GRPOConfig`` fields it cannot work with, the datasets' columns and the generation batch's
group layout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import datasets
from pydantic import BaseModel, ValidationError

from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.integrations.trl.data import ID_COLUMN
from anchor_rl.tasks.base import Record, Task

__all__ = [
    "NEUTRAL_GENERATION_KWARGS",
    "UnsupportedFeatureError",
    "check_columns",
    "check_grpo_args",
    "check_layout",
    "eval_parts",
    "eval_records",
    "section",
]

NEUTRAL_GENERATION_KWARGS = frozenset(
    {"use_cache", "cache_implementation", "cache_config", "stop_token_ids"}
)
"""The ``generation_kwargs`` keys the plug-in accepts: cache and implementation options, which
change neither the sampled distribution nor the lengths, and vLLM's ``stop_token_ids`` (the
task's stop ids, needed with ``use_vllm``; checked). Every other key (temperature, length
caps, n-gram bans, logits processors, token biases, ...) may change what is sampled away from
what the anchors were sampled under, and is refused."""

Section = TypeVar("Section", bound=BaseModel)


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


def check_grpo_args(
    args: Any,
    *,
    multimodal: bool,
    stop_strings: Sequence[str],
    stops: Sequence[int],
    eos_token_ids: Sequence[int],
) -> None:
    """ConfigError naming every ``GRPOConfig`` field of ``args`` that cannot work with the
    plug-in. ``multimodal``: the processing class is a multimodal processor; ``stops``: the
    token ids of the task's ``stop_strings``; ``eos_token_ids``: TRL's, without the stops."""
    a, problems = args, []
    if a.remove_unused_columns:
        problems.append(
            "remove_unused_columns=True drops the prompt_id column the methods look prompts "
            "up by; set remove_unused_columns=False"
        )
    for name, off, what in (("top_k", (0, -1, None), "top-k"), ("min_p", (None,), "min-p"),
                            ("repetition_penalty", (1.0,), "it")):  # fmt: skip
        if (value := getattr(a, name)) not in off:
            problems.append(
                f"{name}={value}: anchors are sampled without {what}; set {name}={off[0]}"
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
    if multimodal:
        problems.append("processing_class: a multimodal processor; the plug-in is text-only")
    stops = list(stops)
    given = set(kw.get("stop_token_ids") or [])
    if a.use_vllm and not set(stops) <= given:
        problems.append(
            f"use_vllm=True: the task's stops {stop_strings} must end vLLM's completions "
            f'as they end the anchors\'; set generation_kwargs={{"stop_token_ids": {stops}}}'
        )
    # the ids that end the anchors' rollouts: the task's stops and the eos ids
    if extra := sorted(given - {*stops, *eos_token_ids}):
        problems.append(
            f"generation_kwargs stop_token_ids {extra}: ids other than the task's stops and "
            "eos end completions where the anchors' rollouts did not stop; drop them"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def check_columns(dataset: Any, what: str) -> None:
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


def eval_parts(eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(name in errors, dataset)`` of each evaluation dataset TRL is given (one, or a dict)."""
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, Mapping):
        return [(f"eval_dataset[{key!r}]", part) for key, part in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def eval_records(eval_dataset: Any, task: Task, known: Mapping[str, Record]) -> dict[str, Record]:
    """The records the evaluation rows name beyond ``known``, from the task's splits: the
    reward function looks every scored row's record up (ids found nowhere are left for
    ``AnchoredGRPOTrainer._check_dataset`` to name)."""
    wanted: set[str] = set()
    for what, dataset in eval_parts(eval_dataset):
        check_columns(dataset, what)
        wanted |= {str(i) for i in dataset[ID_COLUMN]} - set(known)
    found: dict[str, Record] = {}
    for split in ("test", "train"):
        if wanted - set(found):
            found |= {r.id: r for r in task.records(split) if r.id in wanted}
    return found


def check_layout(ids: Sequence[str], k: int) -> None:
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
