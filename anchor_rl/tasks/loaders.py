"""Datasets from JSONL / JSON / parquet files, with a field mapping and named presets.

A :class:`Format` says which column holds the question, the answer, an optional id and
optional answer aliases; column names may be dotted paths into nested records
(``reward_model.ground_truth``). A question stored as a list of chat messages
(``[{"role": "user", "content": ...}]``) becomes the content of its last user message (a
content given as a list of OpenAI-style parts, ``[{"type": "text", "text": ...}]``, is the
concatenation of its text parts).

Presets (``PRESETS``) for the usual files:

========================  ================================================  ======
preset                    fields                                            kind
========================  ================================================  ======
``gsm8k``                 question / answer after the last ``####``          math
``math500``               problem / answer, id unique_id, level              math
``dapo_math``             prompt (chat, DAPO boilerplate removed) /          math
                          reward_model.ground_truth, id extra_info.index
``hotpotqa``              question / answer, id ``_id`` or ``id``            qa
``musique``               question / answer + answer_aliases, id             qa
``2wikimultihopqa``       question / answer, id ``_id``                      qa
``bamboogle``             Question / Answer                                  qa
========================  ================================================  ======
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from anchor_rl.errors import DatasetError
from anchor_rl.rewards import pvpo, qa
from anchor_rl.rewards.extract import extract_answer
from anchor_rl.rewards.math import math_equal
from anchor_rl.tasks.base import GuardedTask, Record, Split

_log = logging.getLogger(__name__)

Kind = Literal["math", "qa"]
QAReward = Literal["em", "f1", "cem", "pvpo"]

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


@dataclass(frozen=True)
class Format:
    """How the columns of a file map onto records.

    Attributes:
        question: column of the question (dotted path; a chat-message list is allowed).
        answer: column of the gold answer (cast to str); a list column gives the gold
            answer first and further accepted answers after it (added to the aliases).
        kind: ``"math"`` (math-verify equivalence) or ``"qa"`` (normalised string match).
        id: column(s) of the record id, the first one present wins; rows without one get
            ``{file stem}-{row}`` (``{file stem}-{split}-{row}`` for ``train_path`` /
            ``test_path`` files). Ids must be unique (DatasetError otherwise).
        aliases: column with a list of extra accepted answers, or one string (one alias);
            kept in meta["aliases"].
        answer_after: keep only the text after the last occurrence of this marker.
        strip_prefix, strip_suffix: removed from the question when present.
        meta: columns copied into ``Record.meta`` (missing ones are skipped).
        difficulty: column copied into ``meta["difficulty"]`` when present.
    """

    question: str
    answer: str
    kind: Kind = "qa"
    id: tuple[str, ...] = ()
    aliases: str | None = None
    answer_after: str | None = None
    strip_prefix: str = ""
    strip_suffix: str = ""
    meta: tuple[str, ...] = field(default_factory=tuple)
    difficulty: str | None = None


PRESETS: dict[str, Format] = {
    "gsm8k": Format("question", "answer", "math", answer_after="####"),
    "math500": Format(
        "problem",
        "answer",
        "math",
        id=("unique_id",),
        meta=("subject",),
        difficulty="level",
    ),
    "dapo_math": Format(
        "prompt",
        "reward_model.ground_truth",
        "math",
        id=("extra_info.index",),
        strip_prefix=DAPO_PREFIX,
        strip_suffix=DAPO_SUFFIX,
        meta=("data_source",),
    ),
    "hotpotqa": Format("question", "answer", id=("_id", "id"), meta=("type", "level")),
    "musique": Format("question", "answer", id=("id",), aliases="answer_aliases"),
    "2wikimultihopqa": Format("question", "answer", id=("_id", "id"), meta=("type",)),
    "bamboogle": Format("Question", "Answer"),
}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``, ``.json`` (an array of objects, or JSON lines) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such dataset file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix not in (".jsonl", ".json"):
        raise DatasetError(
            f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet"
        )
    text = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is dropped
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    else:
        rows = []
        # JSON lines end in "\n" (or "\r\n") only: str.splitlines() would also split on
        # U+2028, U+2029 and U+0085, which JSON allows raw inside a string.
        for n, line in enumerate(text.split("\n"), 1):
            line = line.removesuffix("\r")
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path}: every row must be a JSON object")
    return rows


_MISSING = object()


def _get(row: dict[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _present(value: Any) -> bool:
    return value is not _MISSING and value is not None


def _content_text(content: Any) -> str:
    """A chat message's content: a string, or the text of a list of OpenAI-style parts."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "".join(p["text"] for p in content)
    raise DatasetError(
        "the user message's content must be a string or a list of text parts "
        f'([{{"type": "text", "text": ...}}]), got {content!r:.80}'
    )


def _question_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        users = [m for m in value if m.get("role") == "user"]
        if not users:
            raise DatasetError("the chat-message question has no user message")
        return _content_text(users[-1].get("content"))
    raise DatasetError(f"question must be a string or a list of chat messages, got {value!r:.80}")


def _check_gold(text: str, kind: Kind, what: str = "answer") -> str:
    """``text`` itself; DatasetError when it is empty (or, for QA, normalises to nothing),
    since such a gold would accept an empty answer, or none."""
    if not text:
        raise DatasetError(f"empty {what}")
    if kind == "qa" and not qa.normalize_answer(text):
        raise DatasetError(
            f"{what} {text!r:.80} is empty once normalised (articles and punctuation dropped)"
        )
    return text


def _golds(value: Any, fmt: Format) -> list[str]:
    """The gold answer first, then any further accepted answers the answer column lists."""
    values = value if isinstance(value, list) else [value]  # a list: ["72"], golden_answers
    if not values:
        raise DatasetError("empty list of answers")
    golds = []
    for v in values:
        text = str(v)
        if fmt.answer_after is not None:
            if fmt.answer_after not in text:
                raise DatasetError(f"answer has no {fmt.answer_after!r} marker: {text[-80:]!r}")
            text = text.rsplit(fmt.answer_after, 1)[1]
        golds.append(_check_gold(text.strip(), fmt.kind))
    return golds


def _aliases(value: Any, kind: Kind) -> list[str]:
    """The aliases column's value: a list of accepted answers, or one string."""
    if isinstance(value, str):
        values = [value]
    elif isinstance(value, list):
        values = [str(a) for a in value]
    else:
        raise DatasetError(
            f"aliases must be a list of strings or a string, got {type(value).__name__}: "
            f"{value!r:.80}"
        )
    return [_check_gold(a.strip(), kind, "alias") for a in values]


def _check_limit(limit: Any) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(
            f"limit must be a whole number >= 1 (or None for all rows), got {limit!r}"
        )


def load_records(
    path: str | Path, fmt: Format, limit: int | None = None, split: Split | None = None
) -> list[Record]:
    """Records of one file under ``fmt`` (the first ``limit`` rows when given; ``limit`` >= 1).

    A row without an id gets ``{file stem}-{row}``, or ``{file stem}-{split}-{row}`` when
    ``split`` is given (the file is one split of a pair, so ids stay distinct across the
    two even when both files have the same name). A repeated id is a DatasetError.
    """
    _check_limit(limit)
    path = Path(path)
    rows = read_rows(path)[:limit]
    stem = path.stem if split is None else f"{path.stem}-{split}"
    records = []
    first_row: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"{path.name} row {i}"
        values = {name: _get(row, name) for name in (fmt.question, fmt.answer)}
        for name, value in values.items():
            if not _present(value):
                raise DatasetError(f"{where}: no field {name!r} (fields: {', '.join(sorted(row))})")
        try:
            question = _question_text(values[fmt.question])
            answer, *more = _golds(values[fmt.answer], fmt)
            if fmt.aliases is not None and _present(aliases := _get(row, fmt.aliases)):
                more += _aliases(aliases, fmt.kind)
        except DatasetError as exc:
            raise DatasetError(f"{where}: {exc}") from None
        question = question.removeprefix(fmt.strip_prefix).removesuffix(fmt.strip_suffix).strip()
        ids = [v for v in (_get(row, c) for c in fmt.id) if _present(v)]
        meta = {c: v for c in fmt.meta if _present(v := _get(row, c))}
        if more or fmt.aliases is not None:
            meta["aliases"] = more
        if fmt.difficulty is not None and _present(level := _get(row, fmt.difficulty)):
            meta["difficulty"] = level
        rid = str(ids[0]) if ids else f"{stem}-{i}"
        if rid in first_row:
            raise DatasetError(
                f"{where}: id {rid!r} repeats row {first_row[rid]}; ids must be unique"
            )
        first_row[rid] = i
        records.append(Record(rid, question, answer, meta))
    return records


def resolve_format(format: str | Format | None, **overrides: Any) -> Format:
    """A preset by name (or a given Format), with non-None ``overrides`` applied.

    Without a preset, ``question`` and ``answer`` overrides are required. ``id`` may be a
    single column name.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(overrides.get("id"), str):
        overrides["id"] = (overrides["id"],)
    if isinstance(format, Format):
        return replace(format, **overrides)
    if format is None:
        if "question" not in overrides or "answer" not in overrides:
            raise DatasetError(
                "give a preset (format=...) or the field names (question=..., answer=...); "
                f"presets: {', '.join(PRESETS)}"
            )
        return Format(**overrides)
    if format not in PRESETS:
        raise DatasetError(f"unknown dataset format {format!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[format], **overrides)


def _check_test_size(test_size: Any) -> None:
    """0 (no test split), a fraction strictly between 0 and 1, or a whole count >= 1."""
    if isinstance(test_size, bool) or not isinstance(test_size, int | float):
        raise DatasetError(f"test_size must be a number, got {test_size!r}")
    if test_size == 0:
        return
    if isinstance(test_size, float) and not 0 < test_size < 1:
        raise DatasetError(
            f"test_size must be 0, a fraction strictly between 0 and 1, or a whole count >= 1 "
            f"(an int), got {test_size!r}"
        )
    if isinstance(test_size, int) and test_size < 1:
        raise DatasetError(f"test_size must be 0 or a count >= 1, got {test_size!r}")


def _split_by_prompt(
    records: list[Record], test_size: float, seed: int
) -> tuple[list[Record], list[Record]]:
    """Train and test records, split by distinct prompt (``test_size`` as
    :func:`_check_test_size` accepts it, checked by the caller before the file is read);
    DatasetError when a test split is asked for (``test_size`` > 0) and train or test would
    be empty."""
    prompts = sorted({r.prompt for r in records})
    random.Random(seed).shuffle(prompts)
    n_test = round(test_size * len(prompts)) if isinstance(test_size, float) else test_size
    if test_size and prompts and not 0 < n_test < len(prompts):
        raise DatasetError(
            f"test_size={test_size!r} of {len(prompts)} distinct prompts leaves "
            f"{'no test' if n_test == 0 else 'no train'} prompt; give a test_size that "
            "keeps both splits non-empty, test_size=0 for no test split, or test_path"
        )
    test_prompts = set(prompts[:n_test])
    return (
        [r for r in records if r.prompt not in test_prompts],
        [r for r in records if r.prompt in test_prompts],
    )


class FileTask(GuardedTask):
    """A dataset from files, verified as math (math-verify) or QA (normalised match).

    Either ``path`` (one file, split by prompt into train and test with ``test_size``: a
    float strictly between 0 and 1 is a fraction of the distinct prompts, an int >= 1 a
    count, 0 no test split; a split that leaves train or test empty is refused) or
    ``train_path`` / ``test_path`` (one file per split; prompts of the test file are
    dropped from train, with a warning). ``limit`` (>= 1) keeps the first rows of each
    file. Record ids must be unique across both splits. Fields come from
    ``format`` (a preset name or a :class:`Format`), overridden by ``question``,
    ``answer``, ``id``, ``aliases`` and ``kind``.

    ``reward`` applies to QA data: ``"em"`` (default), ``"f1"``, ``"cem"`` or ``"pvpo"``;
    math data is 1.0 / 0.0 by ``math_equal``. ``correct`` is exact match for QA and the
    reward for math. Both are guarded (:class:`~anchor_rl.tasks.base.GuardedTask`): an
    error or a timeout scores 0.0 / not solved and is counted in :meth:`verifier_stats`
    (``self.verifier`` is the reward's guard, kept for its ``stats()``).
    Datasets give no reasoning traces, so ``trace`` raises.
    """

    name = "file"

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        train_path: str | Path | None = None,
        test_path: str | Path | None = None,
        format: str | Format | None = None,
        question: str | None = None,
        answer: str | None = None,
        id: str | Sequence[str] | None = None,
        aliases: str | None = None,
        kind: Kind | None = None,
        reward: QAReward = "em",
        test_size: float = 0.1,
        seed: int = 0,
        limit: int | None = None,
        instruction: str | None = None,
    ) -> None:
        super().__init__()
        self.format = resolve_format(
            format,
            question=question,
            answer=answer,
            id=tuple(id) if isinstance(id, list | tuple) else id,
            aliases=aliases,
            kind=kind,
        )
        if self.format.kind not in ("math", "qa"):
            raise DatasetError(f"kind must be 'math' or 'qa', got {self.format.kind!r}")
        if reward not in ("em", "f1", "cem", "pvpo"):
            raise DatasetError(f"reward must be 'em', 'f1', 'cem' or 'pvpo', got {reward!r}")
        self.reward_kind = reward
        self.label = format if isinstance(format, str) else "custom"
        if path is not None and (train_path is not None or test_path is not None):
            raise DatasetError("give either path or train_path/test_path, not both")
        self._source = ", ".join(str(p) for p in (path, train_path, test_path) if p)
        if path is not None:
            _check_test_size(test_size)
            train, test = _split_by_prompt(load_records(path, self.format, limit), test_size, seed)
        elif train_path is not None or test_path is not None:
            train = load_records(train_path, self.format, limit, "train") if train_path else []
            test = load_records(test_path, self.format, limit, "test") if test_path else []
            test_prompts = {r.prompt for r in test}
            overlap = sum(r.prompt in test_prompts for r in train)
            if overlap:
                _log.warning("%d train records share a prompt with the test file; dropped", overlap)
                train = [r for r in train if r.prompt not in test_prompts]
            test_ids = {r.id for r in test}
            if shared := sorted({r.id for r in train if r.id in test_ids}):
                raise DatasetError(
                    f"{len(shared)} record id(s) appear in both the train file ({train_path}) "
                    f"and the test file ({test_path}), e.g. {shared[0]!r}; ids must be unique"
                )
        else:
            raise DatasetError("FileTask needs path=... or train_path=... / test_path=...")
        self._splits: dict[Split, list[Record]] = {"train": train, "test": test}
        if instruction is not None:
            self.instruction = instruction
        elif self.format.kind == "math":
            self.instruction = (
                "Reason step by step inside <think></think>, "
                "then give the final answer inside <answer></answer>."
            )
        self.verifier = self.reward_guard

    def records(self, split: Split) -> list[Record]:
        if not self._splits[split]:
            raise DatasetError(
                f"file task {self.label!r} has no {split} records ({self._source}); "
                "check the file has rows, or give test_size / test_path"
            )
        return list(self._splits[split])

    @staticmethod
    def golds(record: Record) -> list[str]:
        """The gold answer and its aliases."""
        return [record.answer, *record.meta.get("aliases", [])]

    def score(self, completion: str, record: Record) -> float:
        """The reward described above, unguarded (``reward`` guards it)."""
        if self.format.kind == "qa" and self.reward_kind == "pvpo":
            return pvpo.reward(completion, self.golds(record))
        pred = extract_answer(completion)
        if pred is None:
            return 0.0
        if self.format.kind == "math":
            return float(any(math_equal(pred, g) for g in self.golds(record)))
        metric = {"em": qa.exact_match, "f1": qa.f1, "cem": qa.cover_exact_match}[self.reward_kind]
        return metric(pred, self.golds(record))

    def verdict(self, completion: str, record: Record) -> bool:
        """Math: the reward is 1.0; QA: exact match against the gold or an alias."""
        if self.format.kind == "math":
            return self.score(completion, record) >= 1.0
        pred = extract_answer(completion)
        return pred is not None and qa.exact_match(pred, self.golds(record)) == 1.0

    def trace(self, record: Record) -> str:
        raise NotImplementedError(
            f"file task {self.label!r} has no reference traces (the dataset gives answers only); "
            "SFT warm starts need a task with traces, e.g. arithmetic, countdown or multihop"
        )
