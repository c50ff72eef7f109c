"""The rollout budget of a run: the ``budget`` config section and the loop's stop rule.

A run's budget is its total rollouts, ``rollouts/total``: the policy's (filtered ones and
top-ups included) plus every rollout its method costs (PVPO's or V0.5's presampling,
refreshes, a model teacher's generations, VAPO's value pretraining, asynchronous
prefetches never used). With ``budget.rollouts = B`` the loop ends after the first step
whose total reaches B; ``steps`` is then a cap (whichever comes first ends the run), and
``time_limit`` a second one. Held-out evaluations are added after the first step past each
``budget.eval_fractions`` share of B and at the end; which fractions are due follows from
the totals before and after a step alone, so a resumed run evaluates exactly where an
uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator, model_validator

from anchor_rl.section import Section

DEFAULT_FRACTIONS = (0.25, 0.5, 1.0)
"""The shares of ``budget.rollouts`` evaluated at when ``budget.eval_fractions`` is unset."""


class BudgetConfig(Section):
    """Run to a number of total rollouts instead of a number of steps (docs/training.md)."""

    rollouts: int | None = Field(None, gt=0)
    """End the run after the first step whose `rollouts/total` (policy, presampling, refreshes,
    teacher, value pretraining, discarded prefetches) reaches this many; `steps` becomes a cap
    (the run ends at whichever comes first; a run stopped by the cap short of the budget says
    so in run.log and summary.json). None: run `steps`."""
    eval_fractions: list[float] | None = None
    """Shares of `rollouts` (increasing, in (0, 1]) after which a held-out evaluation runs: at
    the first step whose total reaches each share, and at the end. None: [0.25, 0.5, 1.0]
    with `rollouts`; set only with `rollouts`. These evaluations run even with `eval.every =
    0` (which then turns only the periodic ones off), step 0's too."""

    @field_validator("eval_fractions")
    @classmethod
    def _fractions(cls, value: list[float] | None) -> list[float] | None:
        if value is None:
            return None
        if any(not 0 < f <= 1 for f in value):
            raise ValueError(f"every fraction must be in (0, 1], got {value}")
        if any(b <= a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError(f"fractions must increase, got {value}")
        return value

    @model_validator(mode="after")
    def _fractions_need_budget(self) -> BudgetConfig:
        if self.eval_fractions is not None and self.rollouts is None:
            raise ValueError(
                "budget.eval_fractions is set without budget.rollouts: the fractions are "
                "shares of the rollout budget; set budget.rollouts=N too"
            )
        return self

    @property
    def fractions(self) -> tuple[float, ...]:
        """The shares of the budget evaluated at (none without a budget)."""
        if self.rollouts is None:
            return ()
        return tuple(self.eval_fractions if self.eval_fractions is not None else DEFAULT_FRACTIONS)


def spent(budget: BudgetConfig, total: float) -> bool:
    """Whether ``total`` rollouts reach the budget (never without one)."""
    return budget.rollouts is not None and total >= budget.rollouts


def crossed(budget: BudgetConfig, before: float, after: float) -> list[float]:
    """The fractions of the budget a step moved past: ``before < f * B <= after``."""
    if budget.rollouts is None:
        return []
    return [f for f in budget.fractions if before < f * budget.rollouts <= after]


def check_start(budget: BudgetConfig, total: float, step: int) -> None:
    """ValueError when a run that has not trained yet (``step`` 0) has already spent its whole
    budget before its first step (presampling, value pretraining): it could not train."""
    if step == 0 and spent(budget, total):
        raise ValueError(
            f"budget.rollouts={budget.rollouts} is spent before the first step: the run's "
            f"set-up already cost {total:.0f} rollouts (presampling, value pretraining); "
            "raise budget.rollouts or lower the set-up's cost"
        )


def stop_reason(
    budget: BudgetConfig, total: float, step: int, steps: int, out_of_time: bool
) -> str:
    """Why a finished run ended: ``budget``, ``steps``, ``time_limit`` (or ``signal``)."""
    if spent(budget, total):
        return "budget"
    if step >= steps:
        return "steps"
    return "time_limit" if out_of_time else "signal"


def budget_metrics(budget: BudgetConfig, total: float, fractions: Sequence[float]) -> dict:
    """``budget/spent`` (total / B) on every line of a budgeted run; ``budget/fraction`` (the
    largest share passed) on the evaluation a step past a fraction adds."""
    if budget.rollouts is None:
        return {}
    out = {"budget/spent": total / budget.rollouts}
    if fractions:
        out["budget/fraction"] = max(fractions)
    return out


def token_counts(batch: Any, rescored: bool, with_ref: bool, epochs: int) -> dict[str, float]:
    """A step's token work beyond generation, for the cost model (anchor_rl.bench.costs):
    ``tokens/scored``, prompt + response tokens of the batch times the log-prob passes before
    the update (the policy's re-scoring unless the update's own forward gives it, and the
    reference's), and ``tokens/updated``, those tokens times the update's epochs (each a
    forward and a backward pass). ``batch``: the step's RolloutBatch."""
    tokens = float(sum(len(p) for p in batch.prompt_ids) + batch.attention_mask.sum().item())
    return {
        "tokens/scored": tokens * (int(rescored) + int(with_ref)),
        "tokens/updated": tokens * epochs,
    }
