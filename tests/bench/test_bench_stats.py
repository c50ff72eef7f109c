"""The 95% t-interval and the t quantile on hand-worked numbers; the paired bootstrap and the
paired comparisons over prompts."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anchor_rl.bench.stats import Interval, paired_bootstrap, t_cdf, t_interval, t_quantile
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
