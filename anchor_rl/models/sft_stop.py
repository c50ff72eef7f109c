"""SFT's class stop: end SFT where the reference leaves prompts in all three accuracy
classes of a validation slice (acc = 0, 0 < acc < 1, acc = 1 over k samples), keeping the
evaluated step whose thinnest class is largest. :func:`~anchor_rl.models.sft.run_sft`
drives it; docs/testbed.md has the calibration.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from anchor_rl.tasks.base import Record, Task


@dataclass(frozen=True)
class ClassStop:
    """Stop SFT where the reference leaves prompts in all three accuracy classes.

    A fixed step count lands each SFT seed at a different point of a steep learning curve
    (docs/testbed.md), so the reference's accuracy classes move with the seed. With a
    ``ClassStop``, ``val_prompts`` training records are held out of the SFT data as a
    validation slice mixed like the test split (:func:`validation_slice`); every ``every`` steps from ``start`` on (and at the last step)
    ``k`` samples at T = 1 are drawn per validation prompt and the shares of prompts with
    acc = 0, 0 < acc < 1 and acc = 1 measured; while the latest thinnest share is under
    half of ``min_share`` (far from the window) the next evaluation comes ``coarse`` times
    ``every`` steps later instead (:func:`next_evaluation`). The run stops once the acc = 0 share falls
    below ``min_share`` (it only falls from there) or at ``SFTConfig.steps``, and keeps
    the evaluated weights whose thinnest class is largest (:func:`choose_stop`). The test
    split is never looked at.
    """

    min_share: float = 0.15
    val_prompts: int = 512
    every: int = 50
    start: int = 0
    k: int = 8
    coarse: int = 4

    def __post_init__(self) -> None:
        if not 0.0 < self.min_share < 1 / 3 + 1e-9:
            raise ValueError(f"min_share must be in (0, 1/3], got {self.min_share}")
        for name in ("val_prompts", "every", "k", "coarse"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 2:
            raise ValueError(f"k must be >= 2 to tell the three classes apart, got {self.k}")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")

    @classmethod
    def parse(cls, value: ClassStop | dict[str, Any] | bool | None) -> ClassStop | None:
        """A ``ClassStop`` from itself, a dict of its fields, ``True`` (the defaults) or
        ``False`` / ``None`` (no early stop)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"unknown class_stop keys: {', '.join(sorted(unknown))}")
            return cls(**value)
        raise TypeError(f"class_stop must be a dict, bool or None, got {type(value).__name__}")


CLASSES = ("acc=0", "0<acc<1", "acc=1")

Validator = Callable[
    [PreTrainedModel, PreTrainedTokenizerBase, "Task", list["Record"], int], dict[str, float]
]
"""``(model, tokenizer, task, records, k) -> {"avg@k", "acc=0", "0<acc<1", "acc=1"}``: a class
stop's evaluation of the live model on its validation records (the model may be in training
mode; leave it as it was). ``anchor_rl.rollout.evaluate.class_shares`` is the built-in one."""


def thinnest_class(shares: dict[str, float]) -> float:
    """The smallest of the three accuracy-class shares in ``shares``."""
    return min(shares[c] for c in CLASSES)


def next_evaluation(step: int, shares: dict[str, float], stop: ClassStop) -> int:
    """The step of the evaluation after one at ``step`` with class ``shares``: ``every``
    steps on, or ``coarse * every`` while the thinnest class is under ``min_share / 2``
    (evaluations dominate the cost of a slow seed's long approach to the window)."""
    far = thinnest_class(shares) < stop.min_share / 2
    return step + stop.every * (stop.coarse if far else 1)


def choose_stop(evals: list[dict[str, Any]], min_share: float) -> tuple[bool, int]:
    """``(stop, best)`` after the validation evaluations so far (oldest first).

    ``best`` indexes the evaluation whose thinnest class share is largest (ties: the larger
    second-thinnest share, then the earliest); ``stop`` is whether the latest has fewer
    than ``min_share`` of its prompts at acc = 0. Training only moves prompts out of acc = 0, so from there the window where all
    three classes hold ``min_share`` lies behind the run, and ``best`` is the point in it
    (or the nearest one) that leaves most prompts in the thinnest class.
    """
    if not evals:
        raise ValueError("no evaluations to choose from")
    scores = [sorted(e[c] for c in CLASSES)[:2] for e in evals]
    best = max(range(len(evals)), key=lambda i: (*scores[i], -i))
    return evals[-1]["acc=0"] < min_share, best


def validation_slice(
    train: list[Record], test: list[Record], n: int
) -> tuple[list[Record], list[Record]]:
    """``(rest, validation)``: ``n`` training records held out, mixed like the test split.

    When every record has a ``meta["difficulty"]``, the slice takes each difficulty in its
    test-split share (largest remainders; the last training records of that difficulty,
    so the choice is deterministic), because a training split can be mixed differently
    from the test split (arithmetic's three-operand prompts run out while the training
    split is drawn) and a harder validation slice would stop SFT late. A difficulty with
    too few training records, or records without difficulties, fall back to the last
    training records. ``rest`` keeps the training order.
    """
    if not 0 < n < len(train):
        raise ValueError(
            f"cannot hold out {n} of {len(train)} training records as a validation slice"
        )
    chosen: list[int] = []
    if test and all("difficulty" in r.meta for r in (*train, *test)):
        levels = Counter(r.meta["difficulty"] for r in test)
        exact = {d: n * c / len(test) for d, c in levels.items()}
        quota = {d: math.floor(x) for d, x in exact.items()}
        for d in sorted(exact, key=lambda d: quota[d] - exact[d])[: n - sum(quota.values())]:
            quota[d] += 1
        for i in reversed(range(len(train))):
            d = train[i].meta["difficulty"]
            if quota.get(d, 0) > 0:
                chosen.append(i)
                quota[d] -= 1
    taken = set(chosen)
    chosen += [i for i in reversed(range(len(train))) if i not in taken][: n - len(chosen)]
    held = set(chosen)
    rest = [r for i, r in enumerate(train) if i not in held]
    return rest, [train[i] for i in sorted(held)]


class ValidationStop:
    """The bookkeeping of a :class:`ClassStop` run: evaluations, the best weights so far."""

    def __init__(
        self,
        stop: ClassStop,
        validate: Validator,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        records: list[Record],
    ) -> None:
        self.stop, self.validate, self.model, self.task = stop, validate, model, task
        self.tokenizer, self.records = tokenizer, records
        self.evals: list[dict[str, Any]] = []
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best = -1
        self.next = 0  # the first step an evaluation may run at

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after optimiser step ``step`` (1-based) of ``last``."""
        scheduled = step >= self.stop.start and step % self.stop.every == 0
        return step == last or (scheduled and step >= self.next)

    def evaluate(self, step: int) -> bool:
        """Evaluate the live model on the validation slice; True when the run should stop."""
        shares = self.validate(self.model, self.tokenizer, self.task, self.records, self.stop.k)
        keep = (f"avg@{self.stop.k}", *CLASSES)
        self.evals.append({"step": step, **{name: shares[name] for name in keep}})
        self.next = next_evaluation(step, self.evals[-1], self.stop)
        stop, best = choose_stop(self.evals, self.stop.min_share)
        if best != self.best:
            self.best = best
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return stop

    def describe(self) -> str:
        """The latest evaluation, for the progress line."""
        last = self.evals[-1]
        shares = " / ".join(f"{last[c]:.2f}" for c in CLASSES)
        avg = last[f"avg@{self.stop.k}"]
        return f"val at step {last['step']}: avg@{self.stop.k} {avg:.3f}, classes {shares}"

    def restore(self) -> None:
        """Load the kept weights into the model."""
        if self.best_state is None:
            raise RuntimeError("class_stop ran no validation evaluation")
        self.model.load_state_dict(self.best_state)

    def summary(self) -> dict[str, Any]:
        """What ``class_stop.json`` holds: the settings, every evaluation and the step kept."""
        return {
            "class_stop": asdict(self.stop),
            "kept_step": self.evals[self.best]["step"],
            "kept": self.evals[self.best],
            "met_target": thinnest_class(self.evals[self.best]) >= self.stop.min_share,
            "evaluations": self.evals,
        }
