"""Statistics of `sat report`: t-intervals over seeds and paired comparisons.

* ``t_interval(values)`` — mean and the half-width ``t_{0.975, n-1} * s / sqrt(n)`` of the 95 %
  confidence interval of the mean (Student t, sample standard deviation ``s`` with ddof = 1);
  ``None`` half-width for a single value.
* ``paired(a, b)`` — for two cells keyed by seed, on the seeds they share: the differences
  ``d = a - b``, their mean and t-interval, the paired t test (``t = mean / (s / sqrt(n))``,
  two-sided p with ``n - 1`` degrees of freedom) and the Wilcoxon signed-rank test (two-sided;
  zero differences dropped, scipy's default; exact null distribution for small samples without
  ties), plus how many seeds have ``a > b`` and ``a < b``.

scipy (already installed with mlflow, a dependency of this project, and declared in
pyproject.toml) supplies the t quantiles and the two tests; it is imported inside the functions
so ``sat --help`` stays fast. Everything returns plain floats; ``nan`` where a quantity is
undefined (fewer than two pairs, zero variance).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

CONFIDENCE = 0.95


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided Student-t critical value ``t_{(1 + confidence) / 2, df}``."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, df))


def t_interval(values: list[float]) -> tuple[float, float | None, int]:
    """``(mean, half-width of the 95 % t-interval or None for n = 1, n)``."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval of no values")
    mean = sum(values) / n
    if n == 1:
        return mean, None, 1
    s = statistics.stdev(values)
    return mean, t_quantile(n - 1) * s / math.sqrt(n), n


@dataclass
class Paired:
    """A paired comparison ``a - b`` over shared seeds."""

    n: int
    mean: float
    lo: float
    hi: float
    t: float
    p_t: float
    w: float  # Wilcoxon statistic (scipy: the smaller of the signed-rank sums)
    p_w: float
    a_wins: int  # seeds with a > b
    b_wins: int  # seeds with a < b
    seeds: list[str]


def paired(a: dict[str, float], b: dict[str, float]) -> Paired | None:
    """Paired comparison on the seeds in both ``a`` and ``b`` (``None`` if they share none)."""
    seeds = sorted(set(a) & set(b), key=_seed_key)
    if not seeds:
        return None
    d = [a[s] - b[s] for s in seeds]
    n = len(d)
    mean = sum(d) / n
    nan = math.nan
    lo = hi = t = p_t = w = p_w = nan
    if n >= 2:
        s = statistics.stdev(d)
        h = t_quantile(n - 1) * s / math.sqrt(n)
        lo, hi = mean - h, mean + h
        if s > 0:
            from scipy import stats

            t = mean / (s / math.sqrt(n))
            p_t = float(2 * stats.t.sf(abs(t), n - 1))
    if any(x != 0 for x in d):
        w, p_w = _wilcoxon(d)
    return Paired(
        n=n,
        mean=mean,
        lo=lo,
        hi=hi,
        t=t,
        p_t=p_t,
        w=w,
        p_w=p_w,
        a_wins=sum(x > 0 for x in d),
        b_wins=sum(x < 0 for x in d),
        seeds=seeds,
    )


def _wilcoxon(d: list[float]) -> tuple[float, float]:
    import warnings

    from scipy import stats

    with warnings.catch_warnings():  # small-sample notes (exact vs normal approximation)
        warnings.simplefilter("ignore")
        res = stats.wilcoxon(d, alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


def _seed_key(s: str):
    try:
        return (0, int(s), s)
    except ValueError:
        return (1, 0, s)
