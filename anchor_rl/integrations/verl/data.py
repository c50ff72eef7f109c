"""verl's prompts as anchor-rl records: row keys, the presample key, the field teacher.

Anchors are keyed by row *content*: the SHA-256 of the canonical JSON of a row's
``raw_prompt`` (the chat messages verl's dataset yields and its agent loop renders)
together with its ``reward_model.ground_truth`` (the gold answer verl's reward function
scores against) and its ``data_source`` (which picks that reward function: verl's
``default_compute_score(data_source, solution_str, ground_truth, extra_info)``),
:func:`row_key`. The same row therefore finds its anchor whatever its position in the
dataset, its ``uid`` (a fresh uuid per step) or the process that sampled it; two rows with
the same messages, gold and data source share one anchor, and two rows that differ in
their gold (two questions worded alike, or a corrected answer) or in their data source
(the same question scored by another function) get one each, as anchor-rl's own records
(prompt and answer, under a reward-specific store key) do. Prompts must be text: an image
or video part is refused.

No verl import here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anchor_rl.anchors.keys import AnchorKey, canonical_json, fingerprint_tokenizer
from anchor_rl.anchors.store import TeacherTrajectory
from anchor_rl.tasks.base import Record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ROW_KEY",
    "FieldTeacher",
    "as_list",
    "dataset_records",
    "field_value",
    "fingerprint_reference",
    "ground_truth",
    "plain",
    "presample_key",
    "row_key",
    "row_keys",
    "batch_row_keys",
]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def plain(value: Any) -> Any:
    """``value`` as plain Python data: numpy arrays and scalars, tensors and tuples become
    lists and numbers (what verl's non-tensor fields hold), recursively."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        return plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def as_list(values: Any) -> list[Any]:
    """A non-tensor field of verl's batches as a plain list: a ``NonTensorStack``, the
    ``LinkedList`` TransferQueue may return, or a numpy object array; elements unwrapped
    from ``NonTensorData``."""
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    return [x.data if type(x).__name__ == "NonTensorData" else x for x in items]


TEXT_ONLY = (
    "the anchor_rl trainer keys anchors by prompt content and supports text-only prompts "
    "(a string, or chat messages whose content is a string or a list of "
    '{"type": "text", "text": ...} parts)'
)


def _check_text_only(
    value: Any, where: str = "raw_prompt", why: str = TEXT_ONLY, parts_too: bool = True
) -> None:
    """ValueError naming the first part of ``value`` (plain data) that is not text: a message
    content part of another type than ``text`` (an image, a video; checked when
    ``parts_too``), or a value JSON cannot hold (a PIL image, bytes), whose key would not be
    stable from one load of the dataset to the next. ``why`` ends the message."""
    if isinstance(value, Mapping):
        parts = value.get("content") if parts_too else None
        if isinstance(parts, list):
            for i, part in enumerate(parts):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    got = f"a {kind!r} part" if kind else f"a {type(part).__name__}"
                    raise ValueError(f"{where}.content[{i}] is {got}: {why}")
        for k, v in value.items():
            _check_text_only(v, f"{where}.{k}", why, parts_too)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text_only(v, f"{where}[{i}]", why, parts_too)
    elif not (value is None or isinstance(value, str | bool | int | float)):
        raise ValueError(f"{where} holds a {type(value).__name__}: {why}")


GOLD_JSON = (
    "the anchor_rl trainer keys anchors by the gold answer too, which must be JSON data "
    "(a string, number, list or mapping)"
)

SOURCE_JSON = (
    "the anchor_rl trainer keys anchors by the row's data_source too (it picks verl's reward "
    "function), which must be JSON data (a string, as verl's datasets write it)"
)

NO_GOLD = (
    "the anchor_rl trainer keys anchors and the V0.5 prior by raw_prompt, "
    "reward_model.ground_truth and data_source; give every row a reward_model field "
    "(verl's reward managers read reward_model.ground_truth too)"
)

ROW_KEY = "sha256(raw_prompt, reward_model.ground_truth, data_source)"
"""What the anchors' ids are made of (:func:`row_key`), written into the presample key so
anchors stored under another id scheme are never looked up under this one. It names the
``data_source`` since anchor ids include it: anchors stored under the earlier
``sha256(raw_prompt, reward_model.ground_truth)`` ids (no data source) sit under another
presample key and are sampled again, never reused for a row whose data source picks
another reward function."""


def row_key(raw_prompt: Any, gold: Any, data_source: Any) -> str:
    """The key of a verl row's anchor: 32 hex characters of the SHA-256 of the canonical JSON
    of ``{"raw_prompt": raw_prompt, "ground_truth": gold, "data_source": data_source}``
    (``gold`` as :func:`ground_truth` reads it, None for a row without one;
    ``data_source`` the row's top-level ``data_source`` field, None for a row or batch
    without one).

    The same messages with another gold answer are another question for verl's reward (it
    scores against the gold), and the same messages and gold with another data source are
    scored by another function (verl's reward managers pick it by ``data_source``), so
    either gets another anchor; the same messages, gold and data source share one.
    Text-only prompts (a ValueError for an image or video part, or any value JSON cannot
    hold, :func:`_check_text_only`); the gold and the data source must be JSON data
    (a string, number, list, mapping or None), else a ValueError."""
    raw = plain(raw_prompt)
    _check_text_only(raw)
    gold = plain(gold)
    _check_text_only(gold, "reward_model.ground_truth", GOLD_JSON, parts_too=False)
    source = plain(data_source)
    _check_text_only(source, "data_source", SOURCE_JSON, parts_too=False)
    payload = canonical_json({"raw_prompt": raw, "ground_truth": gold, "data_source": source})
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def ground_truth(reward_model: Any) -> Any:
    """The gold answer of a row, as verl's reward managers read it: ``reward_model`` (the
    row's ``reward_model`` field) ``["ground_truth"]`` as plain data; None where the field is
    None or has no ``ground_truth``."""
    node = plain(reward_model)
    if not isinstance(node, Mapping):
        return None
    return node.get("ground_truth")


def row_keys(
    raw_prompts: Sequence[Any],
    reward_models: Sequence[Any] | None,
    data_sources: Sequence[Any] | None,
) -> list[str]:
    """:func:`row_key` of each row of a batch ``[B]``, from its ``raw_prompt[B]``,
    ``reward_model[B]`` and ``data_source[B]`` fields.

    ``reward_models`` None (the batch has no such field) is a KeyError: keying these rows by
    their prompt alone would look up other anchors than the ones presampled.
    ``data_sources`` None (the batch has no such field) keys every row with data source
    None, as :func:`dataset_records` keys a dataset row without one; a length other than
    B is a ValueError."""
    if reward_models is None:
        raise KeyError(f"this batch has no reward_model field: {NO_GOLD}")
    if len(raw_prompts) != len(reward_models):
        raise ValueError(f"{len(raw_prompts)} raw_prompt but {len(reward_models)} reward_model")
    if data_sources is None:
        data_sources = [None] * len(raw_prompts)
    elif len(data_sources) != len(raw_prompts):
        raise ValueError(f"{len(raw_prompts)} raw_prompt but {len(data_sources)} data_source")
    return [
        row_key(raw, ground_truth(rm), source)
        for raw, rm, source in zip(raw_prompts, reward_models, data_sources, strict=True)
    ]


def batch_row_keys(fields: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[str]:
    """:func:`row_keys` of the rows ``rows`` (all when None) of a batch's non-tensor
    ``fields`` (verl's ``non_tensor_batch``, a batch ``TensorDict`` or TransferQueue fields;
    each read by :func:`as_list`): its ``raw_prompt``, ``reward_model`` and, where the batch
    has one, ``data_source``."""
    columns = {
        name: as_list(fields[name])
        for name in ("raw_prompt", "reward_model", "data_source")
        if name in fields
    }
    if rows is not None:
        columns = {name: [column[r] for r in rows] for name, column in columns.items()}
    return row_keys(columns["raw_prompt"], columns.get("reward_model"), columns.get("data_source"))


def field_value(row: Mapping[str, Any], path: str) -> Any:
    """``row[a][b]...`` for ``path = "a.b..."``; None where a level is missing."""
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return plain(node)


def dataset_records(
    rows: Iterable[Mapping[str, Any]], solution_field: str | None = None
) -> tuple[list[Record], dict[str, list[int]]]:
    """One :class:`Record` per distinct (prompt, gold answer, data source) of ``rows`` (verl
    dataset items), and the row indices of each key.

    ``Record.id`` is :func:`row_key` (messages, ``reward_model.ground_truth`` and the row's
    ``data_source``, None where the row has no such field: the key :func:`row_keys` gives
    the same row in a training batch), ``prompt`` the canonical JSON of the messages,
    ``answer`` the gold, ``meta["row"]`` the first row's index and ``meta["data_source"]``
    its data source; ``meta["solution"]`` the value at ``solution_field`` (the field
    teacher's trace) when given. A row without a ``reward_model`` field is a KeyError
    (:func:`row_keys`).
    """
    records: dict[str, Record] = {}
    indices: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        raw = plain(row["raw_prompt"])
        _check_text_only(raw)
        if "reward_model" not in row:
            raise KeyError(f"training row {i} has no reward_model field: {NO_GOLD}")
        gold = ground_truth(row["reward_model"])
        source = plain(row.get("data_source"))
        key = row_key(raw, gold, source)
        indices.setdefault(key, []).append(i)
        if key in records:
            continue
        meta: dict[str, Any] = {"row": i, "data_source": source}
        if solution_field is not None:
            meta["solution"] = field_value(row, solution_field)
        records[key] = Record(id=key, prompt=canonical_json(raw), answer=str(gold), meta=meta)
    return list(records.values()), indices


def _hash_file(h: Any, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)


def fingerprint_reference(model_path: str) -> str:
    """The identity of the reference checkpoint verl loads from ``model_path``.

    A local directory: a hash of its config and weight files' bytes (a fine-tuned checkpoint
    in the same directory gets a new identity). A Hugging Face hub id already in the local
    cache: ``hf:ID@COMMIT`` (the snapshot's commit). Anything else is a ValueError asking for
    ``anchor_rl.pvpo.reference``.
    """
    path = Path(model_path).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model_path, local_files_only=True))
        except Exception as exc:  # not a cached hub id either
            raise ValueError(
                f"cannot fingerprint the reference {model_path!r} (not a local directory nor a "
                "cached Hugging Face model): set anchor_rl.pvpo.reference to a name that "
                "identifies these weights"
            ) from exc
        if path.parent.name == "snapshots":
            return f"hf:{model_path}@{path.name}"
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"no weight files under {path}: set anchor_rl.pvpo.reference")
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(f"|{p.relative_to(path)}|{p.stat().st_size}|".encode())
        _hash_file(h, p)
    return h.hexdigest()


def presample_key(
    reference: str,
    tokenizer: PreTrainedTokenizerBase,
    sampling: Mapping[str, Any],
    task: Mapping[str, Any],
) -> AnchorKey:
    """The store key of anchors presampled through verl: the reference's identity
    (:func:`fingerprint_reference`), the tokenizer, the rollout's sampling settings, what
    defines the task (training files, reward function, correctness threshold) and what the
    anchors' ids are made of (:data:`ROW_KEY`: anchors stored under other ids sit under
    another digest and are sampled again, never half-reused)."""
    return AnchorKey(
        model=reference,
        tokenizer=fingerprint_tokenizer(tokenizer),
        sampling=dict(sampling),
        task=canonical_json(plain(dict(task)) | {"anchor_ids": ROW_KEY}),
        tag="verl/presample",
    )


class FieldTeacher:
    """A dataset field's reference solution as PVPO's teacher trajectory (``field:PATH``).

    The solution text (``Record.meta["solution"]``, see :func:`dataset_records`) is tokenized
    by the policy tokenizer, followed by its end-of-sequence token; nothing sampled it, so
    its log-probs are 0 (``log pi_gt`` of a deterministic writer, anchor-rl's ``oracle``)
    and the ratio of its tokens is ``pi_theta``. Its reward is left NaN here: verl's reward
    function scores the trajectory when the teacher agent loop injects it.
    """

    name = "field"
    tries = 1
    generates = False

    def __init__(self, path: str, tokenizer: PreTrainedTokenizerBase) -> None:
        self.path, self.policy_tokenizer = path, tokenizer
        self.fingerprint = f"field:{path}"
        self.settings: dict[str, Any] = {"logprobs": "deterministic", "eos": tokenizer.eos_token}

    def solve(self, records: Sequence[Record]) -> list[TeacherTrajectory | None]:
        """The tokenized solution of each record, or None where the field is empty."""
        out: list[TeacherTrajectory | None] = []
        eos = self.policy_tokenizer.eos_token_id
        for record in records:
            text = record.meta.get("solution")
            if text is None or not str(text).strip():
                out.append(None)
                continue
            ids = list(self.policy_tokenizer.encode(str(text), add_special_tokens=False))
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(int(eos))
            out.append(
                TeacherTrajectory(
                    prompt_id=record.id,
                    token_ids=torch.tensor(ids, dtype=torch.long),
                    logprobs=torch.zeros(len(ids)),
                    loss_mask=torch.ones(len(ids)),
                    text=str(text),
                    reward=math.nan,
                    teacher=f"field:{self.path}",
                )
            )
        return out
