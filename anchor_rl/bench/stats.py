"""Mean and Student-t confidence intervals over seeds (no scipy needed), the paired bootstrap
over prompts, and the two-level bootstrap over runs, then prompts.

The t quantile comes from inverting the t CDF, which is a regularised incomplete beta
function; that function is evaluated with its continued fraction (modified Lentz).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and the two-sided interval ``mean ± half_width``.

    ``half_width`` is None when ``n < 2`` (no spread to estimate).
    """

    mean: float
    half_width: float | None
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def fmt(self, digits: int = 3) -> str:
        """``0.512 ± 0.031`` (or just the mean when there is no interval)."""
        if self.half_width is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean and Student-t interval ``mean ± t_{(1+c)/2, n-1} * s / sqrt(n)``, s the sample std."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, None, 1)
    s = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return Interval(mean, t_quantile((1 + confidence) / 2, n - 1) * s / math.sqrt(n), n)


def figure_cell(figure: Mapping[str, Any] | None, digits: int = 3) -> str:
    """A stored figure (``{"mean", "half_width", "n", ...}``) as :meth:`Interval.fmt` writes
    it; "–" for None."""
    if figure is None:
        return "–"
    return Interval(figure["mean"], figure["half_width"], figure["n"]).fmt(digits)


@dataclass(frozen=True)
class Bootstrap:
    """Mean of ``n`` paired differences and its percentile bootstrap interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int
    resamples: int

    def fmt(self, digits: int = 3) -> str:
        """``+0.052 [+0.031, +0.074]``."""
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def paired_bootstrap(
    diffs: Sequence[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Bootstrap:
    """Mean of per-prompt differences ``diffs`` (method A minus B on the same prompts, each
    already averaged over seeds) and its percentile bootstrap interval: prompts resampled
    with replacement ``resamples`` times (seeded, so the report is reproducible).

    The interval speaks to the prompts' spread (would another draw of held-out prompts
    give the same gain?); the seed-level t interval speaks to the runs' spread. Claims
    should say which one they rest on.
    """
    import numpy as np

    n = len(diffs)
    if n == 0:
        raise ValueError("paired_bootstrap needs at least one difference")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate([
        values[rng.integers(0, n, size=(min(1000, resamples - done), n))].mean(axis=1)
        for done in range(0, resamples, 1000)
    ])  # fmt: skip
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Bootstrap(float(values.mean()), float(low), float(high), n, resamples)


def two_level_bootstrap(
    runs: Sequence[Sequence[float]],
    minus: Sequence[Sequence[float]] | None = None,
    paired_runs: bool = False,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> Bootstrap:
    """Mean over runs and prompts of ``runs`` (R x P: one row per run, e.g. a seed, one column
    per held-out prompt), or its difference to ``minus`` (R' x P, another method on the same
    prompts), with a percentile interval from a two-level bootstrap.

    Each resample draws R runs with replacement within each method, then P prompts with
    replacement (one prompt draw for both methods: the prompts are paired), and takes the
    mean of the drawn cells, counted with multiplicity. With ``paired_runs`` (R = R': row i
    of both is the same seed) both methods draw the same runs. The interval then covers
    run-to-run spread (seeds) as well as the prompts' (another draw of held-out prompts);
    with identical runs it is the prompt-only interval (:func:`paired_bootstrap` of the
    per-prompt means), and with one run a side it is that interval exactly (the same
    resamples). ``n`` of the result is P.
    """
    import numpy as np

    a = np.asarray(runs, dtype=np.float64)
    b = None if minus is None else np.asarray(minus, dtype=np.float64)
    if a.ndim != 2 or a.size == 0 or (b is not None and (b.ndim != 2 or b.size == 0)):
        raise ValueError("two_level_bootstrap needs at least one run of at least one prompt")
    if b is not None and b.shape[1] != a.shape[1]:
        raise ValueError(f"both methods need the same prompts: {a.shape[1]} vs {b.shape[1]}")
    if paired_runs and (b is None or b.shape[0] != a.shape[0]):
        raise ValueError("paired_runs needs two methods with the same number of runs")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if a.shape[0] == 1 and (b is None or b.shape[0] == 1):  # one run a side: prompts only
        diffs = a[0] - (0.0 if b is None else b[0])
        return paired_bootstrap(diffs.tolist(), confidence, resamples, seed)
    rng = np.random.default_rng(seed)
    n_prompts = a.shape[1]

    def counts(n: int, size: int) -> np.ndarray:  # size x n multiplicities of n items
        return rng.multinomial(n, np.full(n, 1.0 / n), size=size).astype(np.float64)

    means = []
    for done in range(0, resamples, 1000):
        size = min(1000, resamples - done)
        w = counts(a.shape[0], size)
        v = counts(n_prompts, size)
        stat = ((w @ a) * v).sum(axis=1) / (a.shape[0] * n_prompts)
        if b is not None:
            wb = w if paired_runs else counts(b.shape[0], size)
            stat -= ((wb @ b) * v).sum(axis=1) / (b.shape[0] * n_prompts)
        means.append(stat)
    tail = (1 - confidence) / 2
    low, high = np.quantile(np.concatenate(means), [tail, 1 - tail])
    mean = float(a.mean() - (0.0 if b is None else b.mean()))
    return Bootstrap(mean, float(low), float(high), n_prompts, resamples)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`, to ~1e-12)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use symmetry otherwise.
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1 - math.exp(log_front) * _beta_cf(b, a, 1 - x) / b


def _beta_cf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < eps:
            break
    return h
