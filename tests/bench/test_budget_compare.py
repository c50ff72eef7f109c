"""Readings at fractions of a budget, the area under the held-out curve, and the cost
model, on hand-worked curves."""

from __future__ import annotations

import pytest

from anchor_rl.bench.budget import Point, area_weights, compare_at_budget, read_at
from anchor_rl.bench.costs import (
    MODELLED,
    Costs,
    cost_figures,
    fit_costs,
    with_modelled_seconds,
)


def _points(xs: list[float], per_prompt: list[dict[str, float]]) -> list[Point]:
    return [
        Point(i, x, x / 10, x, sum(p.values()) / len(p), p)
        for i, (x, p) in enumerate(zip(xs, per_prompt, strict=True))
    ]


def test_area_by_hand() -> None:
    # points at 0, 50, 100 on a budget of 100: trapezoids 25 * (y0 + y1) + 25 * (y1 + y2)
    assert area_weights([0, 50, 100], 100) == pytest.approx([0.25, 0.5, 0.25])
    # a first point at 40 (presampling paid first): y0 held over [0, 40]
    assert area_weights([40, 100], 100) == pytest.approx([0.4 + 0.3, 0.3])
    # cut at the budget: the segment 50 -> 150 contributes up to 100 (its midpoint value)
    w = area_weights([0, 50, 150], 100)
    ys = [0.0, 0.4, 0.8]
    assert sum(a * b for a, b in zip(w, ys, strict=True)) == pytest.approx(
        (25 * 0.4 + 25 * (0.4 + 0.6)) / 100
    )
    # a run ending within 2% below is held to the budget; further below, no area
    assert area_weights([0, 99], 100) is not None
    assert area_weights([0, 90], 100) is None


def test_read_at_takes_the_first_evaluation_at_or_past_the_point() -> None:
    points = _points([0, 30, 60, 99], [{"p": v} for v in (0.0, 0.5, 0.6, 0.7)])
    assert read_at(points, 25).step == 1
    assert read_at(points, 60).step == 2
    assert read_at(points, 100).step == 3  # 99 is within 2% of 100
    assert read_at(points, 120) is None


def test_compare_at_budget_reads_every_label_and_leaves_short_runs_out() -> None:
    a = [{"p": 0.0, "q": 0.0}, {"p": 1.0, "q": 0.0}, {"p": 1.0, "q": 1.0}]
    full = _points([0, 50, 100], a)
    short = _points([0, 50], a[:2])
    out = compare_at_budget({"x": [(0, full), (1, full)], "y": [(0, full), (1, short)]}, 100, "x")
    x = out["labels"]["x"]
    assert x["at"][0.5]["mean"] == pytest.approx(0.5) and x["at"][1.0]["mean"] == 1.0
    assert x["area"]["mean"] == pytest.approx(0.25 * 0 + 0.5 * 0.5 + 0.25 * 1.0)
    y = out["labels"]["y"]
    assert y["at"][1.0] is None and y["reached"][1.0] == 1 and y["area"] is None
    assert out["vs_baseline"]["y"]["at"][0.5]["mean"] == pytest.approx(0.0)
    assert out["vs_baseline"]["y"]["at"][1.0] is None


def _step(step: int, gen: float, rollouts: float, scored: float, updated: float) -> dict:
    return {
        "step": step, "tokens/step": gen, "rollouts/step": rollouts, "tokens/scored": scored,
        "tokens/updated": updated, "time/generate": 0.01 * gen, "time/score": 0.1 * rollouts,
        "time/update": 0.001 * (scored + 3 * updated), "time/sync": 0.5,
        "rollouts/cumulative": rollouts * step, "tokens/cumulative": gen * step,
        "rollouts/total": rollouts * step + 100,
    }  # fmt: skip


def test_costs_fit_back_the_rates_and_model_presampling_as_generation() -> None:
    records = [{"step": 0, "rollouts/cumulative": 0.0, "rollouts/total": 100.0}]
    records += [_step(i, 200.0, 10.0, 400.0, 400.0) for i in (1, 2)]
    costs = fit_costs([records])
    assert costs.generate_per_token == pytest.approx(0.01)
    assert costs.score_per_rollout == pytest.approx(0.1)
    assert costs.forward_per_token == pytest.approx(0.001)
    assert costs.sync_per_step == pytest.approx(0.5)
    assert Costs.from_dict(costs.to_dict()) == costs
    modelled = with_modelled_seconds(records, costs)
    # 100 presampled rollouts x 20 tokens each (the policy's mean) x 0.01 s
    assert modelled[0][MODELLED] == pytest.approx(20.0)
    step = 0.01 * 200 + 0.1 * 10 + 0.001 * (400 + 3 * 400) + 0.5
    assert modelled[2][MODELLED] == pytest.approx(20.0 + 2 * step)
    assert cost_figures(records, costs)["updated_tokens"] == 800.0
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_costs([[{"step": 1, "time/generate": 1.0}]])
