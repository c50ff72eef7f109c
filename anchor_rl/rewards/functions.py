"""Reward functions in the TRL convention, reading the gold answer from the ``answer`` column.

Signature: ``fn(prompts, completions, **columns) -> list[float | None]`` with one entry
per completion. A completion is a string, or a list of chat messages (``{"role",
"content"}``) whose contents are joined. ``answer[i]`` is the gold answer of sample i: a
string, or a list of accepted strings (a gold answer with its aliases); any other scalar
(a number) is read as its ``str``; a None answer gives a None reward (no verdict). Other
columns are ignored.

Every function returns in bounded time on any completion (answer extraction and the QA
scores are linear in its length; a math answer over
:data:`anchor_rl.rewards.math.MAX_ANSWER_CHARS` is not parsed). They raise on a broken
verifier (a math-verify timeout raises TimeoutError); wrap them with
:class:`anchor_rl.rewards.safe.SafeVerifier` (``.map``) to turn that into a counted
failure, as :class:`anchor_rl.tasks.reward_set.RewardedTask` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from anchor_rl.rewards.extract import extract_answer
from anchor_rl.rewards.format import format_score
from anchor_rl.rewards.math import math_equal
from anchor_rl.rewards.pvpo import reward as pvpo_manager
from anchor_rl.rewards.qa import cover_exact_match, exact_match, f1

RewardFunction = Callable[..., list[float | None]]


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and all(isinstance(m, dict) for m in completion):
        return "".join(str(m.get("content", "")) for m in completion)
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def _golds(answer: Any) -> list[str] | None:
    if answer is None:
        return None
    if isinstance(answer, str):
        golds = [answer]
    elif isinstance(answer, Iterable) and not isinstance(answer, Mapping | bytes):
        golds = [str(a) for a in answer]  # a gold answer with its aliases
    else:
        golds = [str(answer)]  # a scalar: 42, 0.5
    if not golds:
        raise ValueError("empty list of gold answers")
    return golds


def _per_sample(
    score: Callable[[str, list[str]], float],
    completions: Sequence[Any],
    answer: Sequence[Any] | None,
) -> list[float | None]:
    if answer is None:
        raise ValueError("this reward function needs an 'answer' column with the gold answers")
    if len(answer) != len(completions):
        raise ValueError(f"{len(answer)} answers for {len(completions)} completions")
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        golds = _golds(gold)
        out.append(None if golds is None else score(_text(completion), golds))
    return out


def _qa(metric: Callable[[str, Sequence[str]], float]) -> Callable[[str, list[str]], float]:
    def score(text: str, golds: list[str]) -> float:
        pred = extract_answer(text)
        return 0.0 if pred is None else metric(pred, golds)

    return score


def qa_em_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """Exact match of the extracted answer (``<answer>`` or ``\\boxed``) against the gold."""
    return _per_sample(_qa(exact_match), completions, answer)


def qa_f1_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """Token F1 of the extracted answer against the gold."""
    return _per_sample(_qa(f1), completions, answer)


def qa_cem_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """Cover exact match: the gold appears in the extracted answer as whole tokens."""
    return _per_sample(_qa(cover_exact_match), completions, answer)


def _math(text: str, golds: list[str]) -> float:
    pred = extract_answer(text)
    return float(any(math_equal(pred, g) for g in golds))


def math_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the extracted answer equals the gold mathematically (math-verify), else 0.0."""
    return _per_sample(_math, completions, answer)


def pvpo_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """PVPO's reward manager (:func:`anchor_rl.rewards.pvpo.reward` with n=3, tool ``search``)."""
    return _per_sample(lambda text, golds: pvpo_manager(text, golds), completions, answer)


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 if the completion is well-formed (:func:`anchor_rl.rewards.format.format_ok`), else 0.0.

    Needs no gold answer; the tool tag recognised is ``search``.
    """
    return [format_score(_text(c)) for c in completions]


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "qa_em": qa_em_reward,
    "qa_f1": qa_f1_reward,
    "qa_cem": qa_cem_reward,
    "math": math_reward,
    "pvpo": pvpo_reward,
    "format": format_reward,
}


def get_reward_function(name: str) -> RewardFunction:
    """A built-in TRL-convention reward function by name (see ``REWARD_FUNCTIONS``)."""
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FUNCTIONS))}"
        ) from None
