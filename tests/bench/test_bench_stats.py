"""The 95% t-interval and the t quantile on hand-worked numbers; the paired bootstrap and the
paired comparisons over prompts."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anchor_rl.bench.stats import (
    Interval,
    paired_bootstrap,
    t_cdf,
    t_interval,
    t_quantile,
    two_level_bootstrap,
)
from anchor_rl.bench.summary import paired, prompt_accuracy


@pytest.mark.parametrize(
    ("df", "expected"),
    # two-sided 95% critical values from any t table
    [
        (1, 12.7062),
        (2, 4.3027),
        (3, 3.1824),
        (4, 2.7764),
        (9, 2.2622),
        (29, 2.0452),
        (1000, 1.9623),
    ],
)
def test_t_quantile_matches_the_table(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_closed_forms() -> None:
    # df = 1 is Cauchy: q(p) = tan(pi (p - 1/2)); df = 2: q(p) = (2p - 1) / sqrt(2 p (1 - p))
    assert t_quantile(0.9, 1) == pytest.approx(math.tan(math.pi * 0.4), rel=1e-9)
    assert t_quantile(0.8, 2) == pytest.approx(0.6 / math.sqrt(2 * 0.8 * 0.2), rel=1e-9)
    assert t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)
    assert t_cdf(0.0, 7) == pytest.approx(0.5)


def test_interval_of_three_seeds_by_hand() -> None:
    # mean 2, sample std 1, half-width t_{.975,2} * 1 / sqrt(3) = 4.3027 / 1.7321 = 2.4841
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half_width == pytest.approx(2.4841, abs=1e-4)
    assert (iv.low, iv.high) == pytest.approx((2.0 - 2.4841, 2.0 + 2.4841), abs=1e-4)
    assert iv.fmt(2) == "2.00 ± 2.48"


def test_interval_of_two_values() -> None:
    # mean 0.5, s = sqrt(0.02) = 0.141421, half-width 12.7062 * 0.141421 / sqrt(2) = 1.27062
    iv = t_interval([0.4, 0.6])
    assert iv.mean == pytest.approx(0.5)
    assert iv.half_width == pytest.approx(1.27062, abs=1e-4)


def test_one_value_has_no_interval() -> None:
    assert t_interval([0.7]) == Interval(0.7, None, 1)
    assert t_interval([0.7]).fmt() == "0.700"


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        t_interval([])
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1.0, 2.0], confidence=1.5)


@given(st.floats(min_value=0.51, max_value=0.999), st.integers(min_value=1, max_value=200))
def test_quantile_inverts_the_cdf(p: float, df: int) -> None:
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


@given(st.lists(st.floats(min_value=-100, max_value=100), min_size=2, max_size=20))
def test_interval_contains_the_mean_and_is_nonnegative(values: list[float]) -> None:
    iv = t_interval(values)
    assert iv.half_width is not None and iv.half_width >= 0
    assert iv.low <= iv.mean <= iv.high


def test_paired_bootstrap_brackets_the_mean_and_narrows_with_more_prompts() -> None:
    rng = random.Random(0)
    small = [rng.gauss(0.05, 0.3) for _ in range(100)]
    large = [rng.gauss(0.05, 0.3) for _ in range(2000)]
    a, b = paired_bootstrap(small), paired_bootstrap(large)
    assert a.low < a.mean < a.high and b.low < b.mean < b.high
    assert a.mean == pytest.approx(sum(small) / 100)
    # the percentile interval is close to the normal one: 1.96 * sd / sqrt(n)
    sd = statistics.stdev(large)
    assert (b.high - b.low) / 2 == pytest.approx(1.96 * sd / math.sqrt(2000), rel=0.1)
    assert (b.high - b.low) < (a.high - a.low) / 3
    assert paired_bootstrap([0.5] * 10).fmt() == "+0.500 [+0.500, +0.500]"
    assert paired_bootstrap(small, seed=1) != a  # seeded: another seed, other resamples
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap([])


def test_paired_comparisons_by_hand() -> None:
    evals = [
        {"step": 0, "test": {"k": 2, "correct": {"a": 0, "b": 1, "c": 2}}},
        {"step": 5, "test": {"k": 2, "correct": {"a": 2, "b": 1, "c": 2}}},
    ]
    start, final = prompt_accuracy(evals)
    assert start == {"a": 0.0, "b": 0.5, "c": 1.0} and final == {"a": 1.0, "b": 0.5, "c": 1.0}
    assert prompt_accuracy(evals[:1]) is None  # no evaluation after the reference's
    other = ({"a": 0.0, "b": 0.5, "c": 1.0}, {"a": 0.0, "b": 0.0, "c": 1.0})
    out = paired({"pvpo": [(start, final)], "grpo": [other, other]}, "grpo")
    assert out["gain"]["pvpo"]["mean"] == pytest.approx(1 / 3)  # (1 + 0 + 0) / 3
    assert out["gain"]["grpo"]["mean"] == pytest.approx(-0.5 / 3)
    assert out["vs_baseline"]["pvpo"]["mean"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert "grpo" not in out["vs_baseline"] and out["gain"]["pvpo"]["prompts"] == 3


def _runs(seed_effects: list[float], prompts: int = 200, seed: int = 0) -> list[list[float]]:
    """Per-prompt accuracies of one method's runs: a shared prompt difficulty plus a per-run
    shift (the seed's effect), clipped to [0, 1]."""
    rng = random.Random(seed)
    base = [rng.random() for _ in range(prompts)]
    return [[min(1.0, max(0.0, b + e)) for b in base] for e in seed_effects]


def test_two_level_interval_is_wider_when_seeds_disagree() -> None:
    disagree = _runs([-0.1, 0.0, 0.1])
    two = two_level_bootstrap(disagree)
    only = paired_bootstrap([sum(col) / 3 for col in zip(*disagree, strict=True)])
    assert two.mean == pytest.approx(only.mean)
    assert two.low <= two.mean <= two.high
    assert (two.high - two.low) > 1.5 * (only.high - only.low)


def test_two_level_interval_is_the_prompt_only_one_when_seeds_agree() -> None:
    agree = _runs([0.0, 0.0, 0.0])
    two = two_level_bootstrap(agree)
    only = paired_bootstrap(agree[0])
    assert two.mean == pytest.approx(only.mean)
    assert (two.high - two.low) == pytest.approx(only.high - only.low, rel=0.1)
    assert two_level_bootstrap(agree, seed=3) == two_level_bootstrap(agree, seed=3)  # seeded


def test_two_level_difference_pairs_prompts_and_optionally_runs() -> None:
    ours, theirs = _runs([0.05, 0.10, 0.15]), _runs([-0.05, 0.0, 0.05])
    diff = two_level_bootstrap(ours, theirs)
    assert diff.mean == pytest.approx(0.1, abs=0.02)
    assert diff.low < diff.mean < diff.high
    # the same seeds in the same order (each seed's shift shared): pairing the runs removes
    # the seed effect from the difference
    shift = [-0.1, 0.0, 0.1]
    a = _runs([s + 0.05 for s in shift], seed=1)
    b = _runs(shift, seed=1)
    narrow = two_level_bootstrap(a, b, paired_runs=True)
    wide = two_level_bootstrap(a, b, paired_runs=False)
    assert (narrow.high - narrow.low) < 0.5 * (wide.high - wide.low)
    with pytest.raises(ValueError, match="same prompts"):
        two_level_bootstrap(a, [row[:-1] for row in b])
    with pytest.raises(ValueError, match="paired_runs"):
        two_level_bootstrap(a, b[:2], paired_runs=True)


def test_paired_comparisons_carry_both_intervals() -> None:
    start = {p: 0.0 for p in "abcdef"}
    runs = {
        "grpo": [(start, {p: v for p, v in zip("abcdef", [1, 0, 1, 0, 1, 0], strict=True)})] * 2,
        "pvpo": [
            (start, {p: 1.0 for p in "abcdef"}),
            (start, {p: 0.0 for p in "abcdef"}),
        ],
    }
    out = paired(runs, "grpo", seeds={"grpo": [0, 1], "pvpo": [0, 1]})
    acc = out["accuracy"]["pvpo"]
    assert acc["mean"] == pytest.approx(0.5) and acc["interval"] == "two-level"
    assert acc["runs"] == 2 and acc["prompt_only"]["low"] == acc["prompt_only"]["high"] == 0.5
    assert acc["low"] < 0.5 < acc["high"]  # the two seeds disagree on every prompt
    assert out["vs_baseline"]["pvpo"]["mean"] == pytest.approx(0.0)


def test_two_level_with_one_run_a_side_is_the_prompt_only_interval() -> None:
    (ours,), (theirs,) = _runs([0.05]), _runs([0.0], seed=2)
    diffs = [a - b for a, b in zip(ours, theirs, strict=True)]
    assert two_level_bootstrap([ours], [theirs]) == paired_bootstrap(diffs)
