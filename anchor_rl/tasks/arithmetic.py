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

import random
from collections.abc import Sequence

from anchor_rl.rewards.extract import extract_answer
from anchor_rl.tasks._generate import Draw, check_counts, mix, unique_splits
from anchor_rl.tasks.base import GuardedTask, Record, Split

Level = tuple[int, int]
"""(number of operands, digits per operand): operands 2..5, digits 1..3."""

# The default mix is calibrated for the built-in tiny reference (docs/testbed.md): harder levels
# (5 operands, 3 digits) stay available through ``levels``.
DEFAULT_LEVELS: tuple[Level, ...] = tuple((n, d) for n in (2, 3, 4) for d in (1, 2))


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


def parse_int(text: str | None, max_digits: int = MAX_INT_DIGITS) -> int | None:
    """An integer answer written as plain digits (optionally signed, commas allowed), else None.

    Digits are ASCII or any other Unicode decimal digit (``int`` reads them); ``²`` or
    ``1.0`` are no integer. A number with more than ``max_digits`` significant digits
    (leading zeros not counted) is None too, without being converted; linear time.
    """
    if text is None:
        return None
    text = text.strip().replace(",", "")
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
        levels: the ``(operands, digits)`` levels to mix; default operands 2..4 x digits 1..2.
        weights: sampling weight per level (default uniform).
        mul_prob: probability that an operator is ``*`` (where a product is allowed).
    """

    name = "arithmetic"
    instruction = (
        "Compute step by step inside <think></think> (products first), "
        "then give the integer result inside <answer></answer>."
    )

    def __init__(
        self,
        n_train: int = 1000,
        n_test: int = 200,
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

    def records(self, split: Split) -> list[Record]:
        return list(self._splits[split])

    def score(self, completion: str, record: Record) -> float:
        """1.0 if the extracted answer is the integer ``record.answer``, else 0.0."""
        pred = parse_int(extract_answer(completion))
        return float(pred is not None and pred == int(record.answer))

    def trace(self, record: Record) -> str:
        steps = " ".join(record.meta["steps"])
        return f"<think>{steps}</think><answer>{record.answer}</answer>"
