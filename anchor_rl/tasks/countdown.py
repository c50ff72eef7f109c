"""Countdown: reach a target from given numbers with + - * /.

Prompt ``Use 3 7 9 to make 30``; trace
``<think>7+3=10 10*9=90</think><answer>(7+3)*9</answer>`` style (steps of a
constructive solution, then its expression).

Rule (documented choice): each given number may be used **at most once** (TinyZero
demands exactly once; pass ``use_all=True`` for that). Only ``+ - * /``, parentheses and
non-negative integer literals are allowed; division is exact (rational arithmetic), so
``(3+5)/2`` is 4 and ``7/2*2`` is 7. The answer block holds the expression only (no
``= 30``). Verification parses the expression with :mod:`ast` and walks the tree;
nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from anchor_rl.rewards.extract import extract_answer
from anchor_rl.tasks._generate import Draw, check_counts, mix, unique_splits
from anchor_rl.tasks.base import GuardedTask, Record, Split

MAX_EXPRESSION_CHARS = 200
"""The longest answer expression :func:`evaluate` parses. A solution uses at most six
given numbers, five operators and four pairs of parentheses: under 140 characters even
with 20-digit numbers, so a longer expression cannot be right. The cap keeps
``ast.parse`` and the tree walk small (no deep nesting, no huge literals)."""

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses.

    Accepts integer literals, ``+ - * /`` and parentheses. Raises ValueError for
    anything else (names, calls, unary minus, floats, powers, ...), for a syntax error
    (NUL and lone surrogates included), for division by zero and for expressions over
    ``MAX_EXPRESSION_CHARS`` characters (checked first, so parsing is bounded).
    """
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an expression: {expr[:60]!r}") from exc
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ValueError("division by zero")
            return left / right
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            literals.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"{type(node).__name__} is not allowed in a countdown expression")

    return walk(tree.body), literals


def check(expr: str, numbers: Sequence[int], target: int, use_all: bool = False) -> bool:
    """Whether ``expr`` equals ``target`` using each of ``numbers`` at most once.

    With ``use_all`` every number must be used exactly once. Invalid expressions
    (see :func:`evaluate`) are False, never an exception.
    """
    try:
        value, used = evaluate(expr)
    except ValueError:
        return False
    have, need = Counter(numbers), Counter(used)
    if use_all and have != need:
        return False
    if any(need[x] > have[x] for x in need):
        return False
    return value == target


@dataclass(frozen=True)
class _Node:
    value: int
    text: str
    op: str | None = None  # None for a given number


def _wrap(node: _Node, parent: str, right: bool) -> str:
    if node.op is None:
        return node.text
    tighter = _PRECEDENCE[node.op] < _PRECEDENCE[parent]
    same_level_right = right and _PRECEDENCE[node.op] == _PRECEDENCE[parent] and parent in "-/"
    return f"({node.text})" if tighter or same_level_right else node.text


def make_puzzle(
    rng: random.Random, size: int, max_number: int, max_target: int, tries: int = 100
) -> Draw:
    """A puzzle with ``size`` numbers in 1..max_number and a target in 2..max_target.

    Built by combining random pairs with a random valid operation (subtraction only to a
    positive result, division only when exact and by more than 1, intermediate values at
    most ``10 * max_target``) until one value remains; targets equal to a given number
    are redrawn. Returns ``(prompt, answer=target, meta)``.
    """
    for _ in range(tries):
        numbers = [rng.randint(1, max_number) for _ in range(size)]
        pool = [_Node(x, str(x)) for x in numbers]
        steps: list[str] = []
        while len(pool) > 1:
            a, b = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            if a.value < b.value:
                a, b = b, a
            options = ["+"]
            if a.value > b.value:
                options.append("-")
            if a.value * b.value <= 10 * max_target and b.value > 1:
                options.append("*")
            if b.value > 1 and a.value % b.value == 0:
                options.append("/")
            op = rng.choice(options)
            value = {"+": a.value + b.value, "-": a.value - b.value, "*": a.value * b.value}.get(
                op, a.value // b.value
            )
            steps.append(f"{a.value}{op}{b.value}={value}")
            text = f"{_wrap(a, op, False)}{op}{_wrap(b, op, True)}"
            pool.append(_Node(value, text, op))
        target = pool[0].value
        if 2 <= target <= max_target and target not in numbers:
            numbers.sort()
            prompt = f"Use {' '.join(map(str, numbers))} to make {target}"
            meta = {
                "difficulty": size,
                "numbers": numbers,
                "target": target,
                "steps": steps,
                "solution": pool[0].text,
            }
            return prompt, str(target), meta
    raise ValueError(f"no puzzle of size {size} found in {tries} tries (max_target={max_target})")


class CountdownTask(GuardedTask):
    """Countdown puzzles of 2..4 numbers; reward 1.0 for a valid expression hitting the target.

    Args:
        n_train, n_test: records per split (prompts are distinct across both).
        seed: the generator seed.
        sizes: how many numbers a puzzle gives (each 2..6); default 2, 3, 4.
        weights: sampling weight per size (default uniform).
        max_number: the given numbers are drawn from 1..max_number.
        max_target: targets lie in 2..max_target.
        use_all: require every number exactly once instead of at most once.
    """

    name = "countdown"
    instruction = (
        "Reach the target with + - * / using each number at most once; "
        "write the expression inside <answer></answer>."
    )

    def __init__(
        self,
        n_train: int = 2000,
        n_test: int = 200,
        seed: int = 0,
        sizes: Sequence[int] = (2, 3, 4),
        weights: Sequence[float] | None = None,
        max_number: int = 20,
        max_target: int = 100,
        use_all: bool = False,
    ) -> None:
        super().__init__()
        check_counts(n_train, n_test)
        self.sizes = [int(s) for s in sizes]
        if any(not 2 <= s <= 6 for s in self.sizes):
            raise ValueError(f"sizes must lie in 2..6, got {self.sizes}")
        if max_number < 2 or max_target < 2:
            raise ValueError(
                f"max_number and max_target must be >= 2, got {max_number}, {max_target}"
            )
        self.weights = mix(self.sizes, weights, "size")
        self.use_all = use_all
        if use_all:
            self.instruction = self.instruction.replace("at most once", "exactly once")

        def draw(rng: random.Random) -> Draw:
            size = rng.choices(self.sizes, self.weights)[0]
            return make_puzzle(rng, size, max_number, max_target)

        self._splits = unique_splits(self.name, seed, n_train, n_test, draw)

    def records(self, split: Split) -> list[Record]:
        return list(self._splits[split])

    def score(self, completion: str, record: Record) -> float:
        """1.0 if the answer expression is valid and equals the target, else 0.0."""
        expr = extract_answer(completion)
        if expr is None:
            return 0.0
        return float(check(expr, record.meta["numbers"], int(record.answer), self.use_all))

    def trace(self, record: Record) -> str:
        steps = " ".join(record.meta["steps"])
        return f"<think>{steps}</think><answer>{record.meta['solution']}</answer>"
