"""Multi-step integer arithmetic with a worked trace.

Prompt ``12+7*3-4``; trace ``<think>7*3=21 12+21=33 33-4=29</think><answer>29</answer>``:
products first (left to right), then the sums and differences left to right, one step
per operator, so the trace follows the usual precedence.

Shape of an expression with ``n`` operands of ``d`` digits: terms joined by ``+`` or
``-``, where a term is a ``d``-digit number or a product ``a*k`` of a ``d``-digit number
and one digit ``k`` in 2..9 (no chained products). A ``-`` is used only where the
running value stays non-negative, so every intermediate value is a non-negative
integer below 10,000 x n.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter
from collections.abc import Sequence

from anchor_rl.rewards.extract import extract_answer
from anchor_rl.tasks._generate import Draw, check_counts, mix, unique_splits
from anchor_rl.tasks.base import GuardedTask, Record, Split

Level = tuple[int, int]
"""(number of operands, digits per operand): operands 2..5, digits 1..3."""

_log = logging.getLogger(__name__)

# The default testbed is calibrated for the built-in tiny reference (docs/testbed.md): one-digit
# operands, whose steps (a 1-2 digit number plus or times a digit) recur across prompts, so
# 30,000 training prompts teach a procedure rather than answers; the reference solves held-out
# prompts as often as training ones. Multi-digit levels stay available through ``levels``.
DEFAULT_LEVELS: tuple[Level, ...] = ((3, 1), (4, 1), (5, 1))
DEFAULT_N_TRAIN = 30_000
DEFAULT_N_TEST = 1_000


def difficulty(level: Level) -> int:
    """``(operands - 1) * digits``: 1 for ``3+4``, 12 for five 3-digit operands."""
    n, d = level
    return (n - 1) * d


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_expression(rng: random.Random, level: Level, mul_prob: float = 1 / 3) -> Draw:
    """One random expression of ``level`` as ``(prompt, answer, meta)``; meta holds the steps."""
    n, digits = level
    ops: list[str] = []
    for _ in range(n - 1):
        ops.append("*" if ops[-1:] != ["*"] and rng.random() < mul_prob else "+")
    numbers = [_number(rng, digits)]
    for op in ops:
        numbers.append(rng.randint(2, 9) if op == "*" else _number(rng, digits))

    steps: list[str] = []
    terms: list[int] = []
    i = 0
    while i < n:
        if i + 1 < n and ops[i] == "*":
            a, k = numbers[i], numbers[i + 1]
            steps.append(f"{a}*{k}={a * k}")
            terms.append(a * k)
            i += 2
        else:
            terms.append(numbers[i])
            i += 1
    additive = [op for op in ops if op != "*"]
    value = terms[0]
    for j, term in enumerate(terms[1:]):
        op = "-" if value >= term and rng.random() < 0.5 else "+"
        additive[j] = op
        new = value - term if op == "-" else value + term
        steps.append(f"{value}{op}{term}={new}")
        value = new

    signs = iter(additive)
    expr = str(numbers[0]) + "".join(
        ("*" if op == "*" else next(signs)) + str(x) for op, x in zip(ops, numbers[1:], strict=True)
    )
    meta = {
        "difficulty": difficulty(level),
        "operands": n,
        "digits": digits,
        "steps": steps,
    }
    return expr, str(value), meta


MAX_INT_DIGITS = 64
"""The most significant digits :func:`parse_int` reads. Every arithmetic answer is below
10**6, so a longer number cannot be right; the cap also keeps parsing linear (Python
refuses to convert a string of more than 4,300 digits, and the conversion is quadratic
below that)."""


_THOUSANDS = re.compile(r"[+-]?(?!0)\d{1,3}(?:,\d{3})+")
"""A number with thousands commas: 1 to 3 digits (no leading zero), then groups of three."""


def parse_int(text: str | None, max_digits: int = MAX_INT_DIGITS) -> int | None:
    """An integer answer written as plain digits (optionally signed), else None.

    Commas are allowed only as thousands separators (``1,234``, ``-12,345,678``); ``4,3``,
    ``1,2345``, ``0,123`` or ``,29`` are no integer. Digits are ASCII or any other Unicode
    decimal digit (``int`` reads them); ``²`` or ``1.0`` are no integer. A number with more
    than ``max_digits`` significant digits (leading zeros not counted) is None too, without
    being converted; linear time.
    """
    if text is None:
        return None
    text = text.strip()
    if "," in text:
        if not _THOUSANDS.fullmatch(text):  # linear: the groups cannot overlap
            return None
        text = text.replace(",", "")
    sign, body = (text[0], text[1:]) if text[:1] in ("+", "-") else ("", text)
    if not body.isdecimal():
        return None
    digits = body.lstrip("0") or "0"  # int() counts leading zeros against its limit
    return None if len(digits) > max_digits else int(sign + digits)


class ArithmeticTask(GuardedTask):
    """Integer expressions of mixed difficulty; reward 1.0 for the exact value in <answer>.

    Args:
        n_train, n_test: records per split (prompts are distinct across both).
        seed: the generator seed; same arguments give the same records.
        levels: the ``(operands, digits)`` levels to mix; default 3, 4 and 5 one-digit operands.
        weights: sampling weight per level (default uniform). A level whose distinct
            expressions run out (three one-digit operands: about 3,700) holds fewer records
            than its weight asks for and the other levels fill the split; ``level_counts``
            has the realized mix.
        mul_prob: probability that an operator is ``*`` (where a product is allowed).
    """

    name = "arithmetic"
    instruction = (
        "Compute step by step inside <think></think> (products first), "
        "then give the integer result inside <answer></answer>."
    )

    def __init__(
        self,
        n_train: int = DEFAULT_N_TRAIN,
        n_test: int = DEFAULT_N_TEST,
        seed: int = 0,
        levels: Sequence[Sequence[int]] = DEFAULT_LEVELS,
        weights: Sequence[float] | None = None,
        mul_prob: float = 1 / 3,
    ) -> None:
        super().__init__()
        check_counts(n_train, n_test)
        self.levels: list[Level] = [(int(lv[0]), int(lv[1])) for lv in levels]
        for n, d in self.levels:
            if not (2 <= n <= 5 and 1 <= d <= 3):
                raise ValueError(f"level ({n}, {d}) outside operands 2..5, digits 1..3")
        self.weights = mix(self.levels, weights, "level")
        if not 0.0 <= mul_prob <= 1.0:
            raise ValueError(f"mul_prob must be in [0, 1], got {mul_prob}")

        def draw(rng: random.Random) -> Draw:
            level = rng.choices(self.levels, self.weights)[0]
            return make_expression(rng, level, mul_prob)

        self._splits = unique_splits(self.name, seed, n_train, n_test, draw)
        self.level_counts = _level_counts(self._splits["test"] + self._splits["train"])
        default = (tuple(self.levels), weights, n_train, n_test) == (
            DEFAULT_LEVELS,
            None,
            DEFAULT_N_TRAIN,
            DEFAULT_N_TEST,
        )  # the default's realized mix is documented (docs/testbed.md): no warning each run
        for level, short in exhausted_levels(self.levels, self.weights, self.level_counts):
            (_log.info if default else _log.warning)(
                "arithmetic level %s gave %d distinct prompts, not the %d its weight asks "
                "for: its distinct expressions run short (repeats are rejected), so the "
                "other levels fill the rest; task.level_counts has the mix",
                level, self.level_counts.get(level, 0), short,
            )  # fmt: skip

    def records(self, split: Split) -> list[Record]:
        return list(self._splits[split])

    def score(self, completion: str, record: Record) -> float:
        """1.0 if the extracted answer is the integer ``record.answer``, else 0.0."""
        pred = parse_int(extract_answer(completion))
        return float(pred is not None and pred == int(record.answer))

    def trace(self, record: Record) -> str:
        steps = " ".join(record.meta["steps"])
        return f"<think>{steps}</think><answer>{record.answer}</answer>"


def _level_counts(records: Sequence[Record]) -> dict[Level, int]:
    counts = Counter((r.meta["operands"], r.meta["digits"]) for r in records)
    return {level: counts[level] for level in sorted(counts)}


def exhausted_levels(
    levels: Sequence[Level], weights: Sequence[float], counts: dict[Level, int]
) -> list[tuple[Level, int]]:
    """The levels that hold clearly fewer records than their weight asks for, with that number.

    A level has finitely many distinct expressions (two 1-digit operands: a few hundred).
    Records are distinct, so once a level's expressions run out its draws are rejected and
    the other levels fill the split: the mix moves away from ``weights`` (say so, rather
    than silently). "Clearly": under 90% of the expected count and more than 4 binomial
    standard deviations below it, so sampling noise in a small task is not reported.
    """
    total, mass = sum(counts.values()), sum(weights)
    short = []
    for level, weight in zip(levels, weights, strict=True):
        share = weight / mass
        expected, sd = total * share, math.sqrt(total * share * (1 - share))
        if counts.get(level, 0) < min(0.9 * expected, expected - 4 * sd):
            short.append((level, round(expected)))
    return short
