"""An anchor-rl task as TRL data: the dataset (prompt text and prompt id) and the reward.

The dataset's ``prompt`` is the record's prompt in the form TRL renders into exactly the
ids anchor-rl's engine samples from (the chat template, the task's instruction as the
system message), so TRL samples from the prompt the anchors were presampled on. ``prompt_id`` is the record's id: it names the prompt's anchor, its
group-sampling class and its teacher trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from anchor_rl.errors import ConfigError
from anchor_rl.tasks import get_task
from anchor_rl.tasks.base import Record, Task

ID_COLUMN = "prompt_id"
"""The dataset column holding each row's record id."""


def resolve_task(
    task: Task | str, task_args: Mapping[str, Any] | None = None
) -> tuple[str, Task, dict[str, Any]]:
    """``(name, task, kwargs)`` of a registered task name (built with ``task_args``) or a task
    object (its ``name``; ``task_args`` are the constructor arguments it was built with, part
    of the anchors' key). ConfigError for a task with tools (TRL runs its own tool loop)."""
    kwargs = dict(task_args or {})
    if isinstance(task, str):
        name, task = task, get_task(task, **kwargs)
    elif isinstance(task, Task):
        name = task.name
    else:
        raise ConfigError(f"task: a task name or an anchor_rl Task, got {type(task).__name__}")
    if task.tools:
        raise ConfigError(
            f"task {name!r} uses tools ({', '.join(sorted(task.tools))}); the TRL plug-in covers "
            "single-turn tasks (TRL's tool loop is not anchor-rl's, so anchors would not match)"
        )
    return name, task, kwargs


def task_dataset(
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[Record] | None = None,
) -> datasets.Dataset:
    """A TRL training dataset of ``records`` (default: the task's train split): one row
    ``{"prompt", "prompt_id": record id}`` per record, in order.

    ``prompt`` is what TRL turns into the ids anchor-rl's engine samples from
    (``models.tokenizer.encode_prompt``): with a chat template, the conversation
    ``[system: instruction], user: prompt`` (TRL applies the template with the generation
    prompt); without one, the text ``instruction + "\n\n" + prompt`` (TRL adds the
    tokenizer's special tokens, as the engine does).
    """
    records = list(task.records("train") if records is None else records)
    return datasets.Dataset.from_list(
        [{"prompt": prompt_of(tokenizer, task, r), ID_COLUMN: r.id} for r in records]
    )


def prompt_of(tokenizer: PreTrainedTokenizerBase, task: Task, record: Record) -> Any:
    """The ``prompt`` column of ``record`` (see :func:`task_dataset`)."""
    instruction = task.instruction
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": record.prompt}]
        return [{"role": "system", "content": instruction}, *messages] if instruction else messages
    return f"{instruction}\n\n{record.prompt}" if instruction else record.prompt


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> list[int]:
    """The single token id of each stop string (TRL ends a completion only on eos ids).
    ConfigError for a stop string of more than one token."""
    ids = []
    for stop in stops:
        encoded = tokenizer.encode(stop, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(
                f"stop string {stop!r} is {len(encoded)} tokens; the TRL side can stop only on "
                "single-token stops (passed to it as eos ids)"
            )
        ids.append(encoded[0])
    return ids


def task_reward_function(
    task: Task, records: Sequence[Record] | Mapping[str, Record]
) -> Callable[..., list[float]]:
    """The task's reward in TRL's signature ``fn(prompts, completions, prompt_id, **columns)``:
    ``task.reward(completion, record)`` of each row's record (looked up by ``str(prompt_id)``,
    as the trainers read the column, so a dataset of integer ids finds its records). Its
    name (TRL's ``rewards/NAME/*`` metrics) is ``TASK_reward``."""
    by_id = dict(records) if isinstance(records, Mapping) else {r.id: r for r in records}

    def reward(
        prompts: list[Any], completions: list[Any], prompt_id: list[str], **_: Any
    ) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [task.reward(t, by_id[str(i)]) for t, i in zip(texts, prompt_id, strict=True)]

    reward.__name__ = f"{task.name}_reward"
    return reward
