"""Intervals and tests for batch-invariance experiments (pure: no I/O, no clock, no printing).

Every function takes counts or arrays and returns a frozen result object. The intervals
themselves come from scipy and statsmodels; this module validates the arguments once, at this
boundary, translates the literature's names (``confidence_level``, ``alternative``) into
statsmodels' ``alpha``, and records the method beside every number it returns.

Contents
--------
- :func:`match_fraction`, :func:`wilson_interval` -- one arm's match rate (Wilson score interval).
- :func:`newcombe_difference` -- difference of two arms' match rates (Newcombe's hybrid score).
- :func:`intervals_overlap` -- whether two intervals share a point.
- :func:`mcnemar_test` -- paired, prompt-level comparison of two arms.
- :func:`throughput_ratio` -- treatment / control per-pass throughput, Welch interval on logs.
- :func:`paired_ratio` -- the same ratio from passes paired across the arms (paired t on logs).
- :func:`ratio_of_geometric_means` -- the point estimate alone (one pass per arm suffices).
- :func:`tost_ratio` -- TOST equivalence of the throughput ratio within declared margins.
- :func:`pooled_cv` -- pooled pass-to-pass coefficient of variation.
- :func:`block_effect_test` -- whether passes of one engine start are more alike than passes of
  different starts (nested F test on log throughput).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bistat.core.lazy import lazy_function, lazy_module

_sps = lazy_module("scipy.stats")
_sm_mcnemar = lazy_function("statsmodels.stats.contingency_tables", "mcnemar")
_sm_confint_2indep = lazy_function("statsmodels.stats.proportion", "confint_proportions_2indep")
_sm_proportion_confint = lazy_function("statsmodels.stats.proportion", "proportion_confint")
_sm_ttost_ind = lazy_function("statsmodels.stats.weightstats", "ttost_ind")
_sm_ols = lazy_function("statsmodels.regression.linear_model", "OLS")

__all__ = [
    "ALTERNATIVES",
    "BlockEffect",
    "CVResult",
    "Interval",
    "McNemarResult",
    "RatioResult",
    "TostResult",
    "block_effect_test",
    "geometric_mean",
    "intervals_overlap",
    "match_fraction",
    "mcnemar_test",
    "newcombe_difference",
    "pooled_cv",
    "ratio_of_geometric_means",
    "paired_ratio",
    "throughput_ratio",
    "tost_ratio",
    "wilson_interval",
]

#: The accepted values of ``alternative`` (scipy's names). ``"greater"`` gives a lower
#: confidence bound (interval ``[low, upper limit]``), ``"less"`` an upper bound.
ALTERNATIVES = ("two-sided", "greater", "less")

# Below this many discordant pairs McNemar's test is exact by default (statsmodels' advice,
# `statsmodels.stats.contingency_tables.mcnemar`: "exact ... should be used for small samples";
# 25 is the usual rule of thumb, e.g. Fagerland, Lydersen and Laake (2013)).
MCNEMAR_EXACT_BELOW = 25


# --------------------------------------------------------------------------------------------
# Result objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """A confidence interval with its level, method and sidedness.

    Attributes
    ----------
    low, high : float
        The bounds. A one-sided interval has the parameter's natural limit as its open end
        (for a proportion ``high == 1.0`` when ``alternative == "greater"``; for a ratio
        ``high == inf``).
    confidence_level : float
        Nominal coverage, e.g. 0.95.
    method : str
        How it was computed, e.g. ``"wilson"``, ``"newcombe-hybrid-score"``, ``"welch-log"``.
    alternative : str
        ``"two-sided"``, ``"greater"`` (lower bound) or ``"less"`` (upper bound).
    """

    low: float
    high: float
    confidence_level: float
    method: str
    alternative: str = "two-sided"

    def contains(self, x: float) -> bool:
        """Return whether ``low <= x <= high`` (the interval is closed)."""
        return bool(self.low <= x <= self.high)

    @property
    def width(self) -> float:
        """``high - low``."""
        return self.high - self.low


@dataclass(frozen=True)
class McNemarResult:
    """Result of :func:`mcnemar_test`.

    Attributes
    ----------
    statistic : float
        Exact test: ``min(b, c)`` (the binomial count). Asymptotic test: the chi-square
        statistic with continuity correction, ``(|b - c| - 1)**2 / (b + c)``.
    pvalue : float
        Two-sided p-value.
    b, c : int
        The discordant counts (arm 1 matched and arm 2 did not; the reverse).
    method : str
        ``"exact-binomial"`` or ``"chi2-continuity-corrected"``.
    """

    statistic: float
    pvalue: float
    b: int
    c: int
    method: str


@dataclass(frozen=True)
class RatioResult:
    """Result of :func:`throughput_ratio` or :func:`paired_ratio` (treatment / control).

    Attributes
    ----------
    ratio : float
        ``exp(mean(log treatment) - mean(log control))``: the ratio of geometric means.
    interval : Interval
        The Welch interval for ``log_diff``, exponentiated.
    df : float
        Welch-Satterthwaite degrees of freedom (``"welch-log"``), or pairs - 1
        (``"paired-log"``).
    log_diff : float
        ``mean(log treatment) - mean(log control)``.
    se : float
        Standard error of ``log_diff`` on the log scale: ``sqrt(s_t**2 / n_t + s_c**2 / n_c)``
        (Welch), or the pair differences' standard deviation over ``sqrt(pairs)`` (paired).
    n_treatment, n_control : int
        Passes per arm (paired: both the number of pairs).
    method : str
        ``"welch-log"`` or ``"paired-log"``.
    """

    ratio: float
    interval: Interval
    df: float
    log_diff: float
    se: float
    n_treatment: int
    n_control: int
    method: str = "welch-log"


@dataclass(frozen=True)
class TostResult:
    """Result of :func:`tost_ratio`.

    Attributes
    ----------
    pvalue : float
        The TOST p-value, the larger of the two one-sided Welch tests' p-values.
    equivalent : bool
        ``pvalue < alpha``: equivalence within ``(low, high)`` is shown.
    low, high : float
        The equivalence margins on the ratio scale.
    alpha : float
        The level of each one-sided test.
    ratio : float
        The point estimate ``exp(log_diff)``.
    statistic_low, statistic_high : float
        Welch t statistics of the tests ``H0: ratio <= low`` and ``H0: ratio >= high``.
    pvalue_low, pvalue_high : float
        Their p-values.
    df : float
        Welch-Satterthwaite degrees of freedom.
    method : str
        ``"tost-welch-log"``.
    """

    pvalue: float
    equivalent: bool
    low: float
    high: float
    alpha: float
    ratio: float
    statistic_low: float
    statistic_high: float
    pvalue_low: float
    pvalue_high: float
    df: float
    method: str = "tost-welch-log"


@dataclass(frozen=True)
class CVResult:
    """Result of :func:`pooled_cv`.

    Attributes
    ----------
    cv : float
        Coefficient of variation of a lognormal with log-scale sd ``sd_log``:
        ``sqrt(exp(sd_log**2) - 1)``.
    sd_log : float
        Pooled within-group standard deviation of log throughput.
    df : int
        Degrees of freedom of the pooled variance, ``sum(n_i - 1)``.
    n_groups : int
        Number of groups that contributed (groups with one value contribute nothing).
    """

    cv: float
    sd_log: float
    df: int
    n_groups: int


@dataclass(frozen=True)
class BlockEffect:
    """Result of :func:`block_effect_test`.

    Attributes
    ----------
    f_stat, p_value : float
        The F statistic of the blocks within each group and its upper-tail p-value.
    df_blocks, df_resid : int
        Its degrees of freedom: blocks beyond one per group, and values beyond one per block.
    n_values, n_blocks, n_groups : int
        The values, the blocks holding at least one, and the groups holding at least one.
    """

    f_stat: float
    p_value: float
    df_blocks: int
    df_resid: int
    n_values: int
    n_blocks: int
    n_groups: int
    method: str = "nested-f-log"


# --------------------------------------------------------------------------------------------
# Validation at the boundary
# --------------------------------------------------------------------------------------------


def _count(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer count, got the boolean {value!r}")
    try:
        out = operator.index(value)  # accepts int and numpy integers, rejects 3.0 and "3"
    except TypeError:
        raise ValueError(f"{name} must be an integer count, got {value!r}") from None
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def _int_at_least(value: object, name: str, minimum: int) -> int:
    """``value`` as an int of at least ``minimum`` (numpy integers too; never a bool or a float)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got the boolean {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _counts(k: object, n: object, k_name: str = "k", n_name: str = "n") -> tuple[int, int]:
    k_i = _count(k, k_name)
    n_i = _count(n, n_name)
    if n_i == 0:
        raise ValueError(f"{n_name} must be >= 1 (no prompts means no match rate), got 0")
    if k_i > n_i:
        raise ValueError(f"{k_name} must be <= {n_name}, got {k_name}={k_i} > {n_name}={n_i}")
    return k_i, n_i


def _confidence_level(confidence_level: float) -> float:
    cl = float(confidence_level)
    if not 0.0 < cl < 1.0:
        raise ValueError(
            f"confidence_level must be strictly between 0 and 1 (e.g. 0.95), got {confidence_level!r}"
        )
    return cl


def _alternative(alternative: str) -> str:
    if alternative not in ALTERNATIVES:
        allowed = ", ".join(repr(a) for a in ALTERNATIVES)
        raise ValueError(f"alternative must be one of {allowed}; got {alternative!r}")
    return alternative


def _positive_sample(values: Sequence[float], name: str, min_size: int = 2) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a one-dimensional sequence of per-pass throughputs")
    if arr.size < min_size:
        raise ValueError(
            f"{name} needs at least {min_size} counted passes to estimate pass-to-pass variation, "
            f"got {arr.size}; declare workload.passes >= {min_size}"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        bad = [float(v) for v in arr[~(np.isfinite(arr) & (arr > 0))]]
        raise ValueError(f"{name} must hold finite throughputs > 0, got {bad}")
    return arr


# --------------------------------------------------------------------------------------------
# One proportion
# --------------------------------------------------------------------------------------------


def match_fraction(k: int, n: int) -> float:
    """Return the observed match rate ``k / n``.

    Parameters
    ----------
    k : int
        Prompts whose passes matched (by the declared match unit).
    n : int
        Prompts compared, ``n >= 1``.

    Returns
    -------
    float
        ``k / n``.

    Raises
    ------
    ValueError
        If ``k`` or ``n`` is not a non-negative integer, ``n == 0`` or ``k > n``.

    Examples
    --------
    >>> match_fraction(78, 541)
    0.14417744916820702
    """
    k_i, n_i = _counts(k, n)
    return k_i / n_i


def wilson_interval(
    k: int, n: int, confidence_level: float = 0.95, alternative: str = "two-sided"
) -> Interval:
    """Wilson score confidence interval for a binomial proportion (no continuity correction).

    Parameters
    ----------
    k : int
        Number of successes (matching prompts), ``0 <= k <= n``.
    n : int
        Number of trials (prompts), ``n >= 1``.
    confidence_level : float, default 0.95
        Nominal coverage, strictly between 0 and 1.
    alternative : {"two-sided", "greater", "less"}
        ``"two-sided"``: the usual interval. ``"greater"``: a lower confidence bound,
        ``Interval(low, 1.0)``. ``"less"``: an upper bound, ``Interval(0.0, high)``.

    Returns
    -------
    Interval
        ``method="wilson"``.

    Notes
    -----
    The interval inverts the score test (Wilson 1927); it is computed by statsmodels'
    ``proportion_confint(k, n, alpha, method="wilson")`` -- statsmodels' *default* method is
    ``"normal"`` (Wald), so the method is always passed explicitly here.

    statsmodels only computes two-sided intervals. The Wilson bounds solve
    ``|p_hat - p| = z * sqrt(p (1 - p) / n)`` with ``z = Phi^{-1}(1 - alpha / 2)``; a one-sided
    bound at confidence ``1 - alpha`` uses ``z = Phi^{-1}(1 - alpha)`` instead, which is the
    matching end of the two-sided interval at confidence ``1 - 2 alpha``. So the lower bound for
    ``alternative="greater"`` at 95 % is the lower end of the two-sided 90 % interval. This agrees
    with R's ``prop.test(k, n, alternative="greater", correct=FALSE)`` and scipy's
    ``binomtest(...).proportion_ci(method="wilson")``.

    For ``k = n`` the two-sided upper end is exactly 1 and the lower end is ``n / (n + z**2)``;
    for ``k = 0`` the lower end is 0. Coverage is not guaranteed at every ``p`` (it oscillates
    with ``p`` and ``n`` and dips near 0 and 1 for small ``n p (1 - p)``); its average over ``p``
    is close to nominal (Brown, Cai and DasGupta 2001).

    References
    ----------
    .. [1] E. B. Wilson, "Probable inference, the law of succession, and statistical
           inference", Journal of the American Statistical Association, 22, pp 209-212 (1927).
    .. [2] R. G. Newcombe, "Two-sided confidence intervals for the single proportion:
           comparison of seven methods", Statistics in Medicine, 17, pp 857-872 (1998).
    .. [3] L. D. Brown, T. T. Cai and A. DasGupta, "Interval estimation for a binomial
           proportion", Statistical Science, 16(2), pp 101-133 (2001).

    Examples
    --------
    >>> ci = wilson_interval(541, 541)
    >>> round(ci.low, 4), ci.high
    (0.9929, 1.0)
    >>> ci = wilson_interval(78, 541)
    >>> round(ci.low, 4), round(ci.high, 4)
    (0.1171, 0.1763)
    """
    k_i, n_i = _counts(k, n)
    cl = _confidence_level(confidence_level)
    alt = _alternative(alternative)
    alpha = 1.0 - cl
    two_sided_alpha = alpha if alt == "two-sided" else 2.0 * alpha
    low, high = _sm_proportion_confint(k_i, n_i, alpha=two_sided_alpha, method="wilson")
    # statsmodels can return values a rounding error outside [0, 1] at k = 0 or k = n.
    low = min(max(float(low), 0.0), 1.0)
    high = min(max(float(high), 0.0), 1.0)
    if k_i == n_i:
        high = 1.0
    if k_i == 0:
        low = 0.0
    if alt == "greater":
        high = 1.0
    elif alt == "less":
        low = 0.0
    return Interval(low=low, high=high, confidence_level=cl, method="wilson", alternative=alt)


# --------------------------------------------------------------------------------------------
# Two proportions
# --------------------------------------------------------------------------------------------


def newcombe_difference(
    k1: int, n1: int, k2: int, n2: int, confidence_level: float = 0.95
) -> Interval:
    """Newcombe's hybrid score interval for the difference of two independent proportions.

    The interval is for ``p1 - p2`` where ``p1 = k1 / n1`` (e.g. the treatment arm's match
    rate) and ``p2 = k2 / n2`` (the control arm's).

    Parameters
    ----------
    k1, n1 : int
        Successes and trials in sample 1 (``n1 >= 1``).
    k2, n2 : int
        Successes and trials in sample 2 (``n2 >= 1``).
    confidence_level : float, default 0.95
        Nominal two-sided coverage.

    Returns
    -------
    Interval
        Two-sided, ``method="newcombe-hybrid-score"``, within ``[-1, 1]``.

    Notes
    -----
    Method 10 of Newcombe (1998): the square-and-add combination of the two Wilson score
    intervals (no continuity correction),
    ``low = d - sqrt((p1 - l1)**2 + (u2 - p2)**2)``, ``high = d + sqrt((u1 - p1)**2 + (p2 - l2)**2)``.
    Computed by statsmodels' ``confint_proportions_2indep(k1, n1, k2, n2, method="newcomb",
    compare="diff")``, whose difference is ``p1 - p2`` (sample 1 minus sample 2). Newcombe
    reports coverage close to nominal and good behaviour at 0 and 1, where the Wald interval
    fails. It treats the two samples as independent; for two arms run on the *same* prompts
    the paired comparison is :func:`mcnemar_test`.

    References
    ----------
    .. [1] R. G. Newcombe, "Interval estimation for the difference between independent
           proportions: comparison of eleven methods", Statistics in Medicine, 17,
           pp 873-890 (1998).
    .. [2] M. W. Fagerland, S. Lydersen and P. Laake, "Recommended confidence intervals for
           two independent binomial proportions", Statistical Methods in Medical Research,
           24(2), pp 224-254 (2015).

    Examples
    --------
    Newcombe (1998), Table II, example (a):

    >>> ci = newcombe_difference(56, 70, 48, 80)
    >>> round(ci.low, 4), round(ci.high, 4)
    (0.0524, 0.3339)
    """
    k1_i, n1_i = _counts(k1, n1, "k1", "n1")
    k2_i, n2_i = _counts(k2, n2, "k2", "n2")
    cl = _confidence_level(confidence_level)
    low, high = _sm_confint_2indep(
        k1_i, n1_i, k2_i, n2_i, method="newcomb", compare="diff", alpha=1.0 - cl
    )
    low = min(max(float(low), -1.0), 1.0)
    high = min(max(float(high), -1.0), 1.0)
    return Interval(
        low=low, high=high, confidence_level=cl, method="newcombe-hybrid-score",
        alternative="two-sided",
    )


def intervals_overlap(a: Interval, b: Interval) -> bool:
    """Return whether two closed intervals share at least one point.

    Parameters
    ----------
    a, b : Interval
        Intervals at the same confidence level.

    Returns
    -------
    bool
        ``a.low <= b.high and b.low <= a.high`` (touching intervals overlap).

    Raises
    ------
    ValueError
        If the confidence levels differ (comparing a 95 % with a 99 % interval is not what any
        rule means).

    Notes
    -----
    Overlap is a descriptive criterion, not a test: two 95 % intervals can overlap while the
    difference is significant at 5 % (Schenker and Gentleman 2001). Use
    :func:`newcombe_difference` or :func:`mcnemar_test` for a test of the difference.

    References
    ----------
    .. [1] N. Schenker and J. F. Gentleman, "On judging the significance of differences by
           examining the overlap between confidence intervals", The American Statistician,
           55(3), pp 182-186 (2001).

    Examples
    --------
    >>> intervals_overlap(wilson_interval(541, 541), wilson_interval(78, 541))
    False
    """
    if not math.isclose(a.confidence_level, b.confidence_level, rel_tol=0, abs_tol=1e-12):
        raise ValueError(
            "intervals_overlap compares intervals at one confidence level, got "
            f"{a.confidence_level!r} and {b.confidence_level!r}"
        )
    return bool(a.low <= b.high and b.low <= a.high)


def mcnemar_test(b: int, c: int, exact: bool | None = None) -> McNemarResult:
    """McNemar's test for paired binary outcomes (prompt-level match in two arms).

    Each prompt is run in both arms; it either matches (its passes agree) or not in each.
    Only the discordant prompts carry information.

    Parameters
    ----------
    b : int
        Prompts that matched in arm 1 and not in arm 2.
    c : int
        Prompts that matched in arm 2 and not in arm 1.
    exact : bool or None, default None
        ``True``: exact binomial test (``b ~ Binomial(b + c, 1/2)``). ``False``: chi-square
        with continuity correction. ``None``: exact when ``b + c < 25``, otherwise chi-square.

    Returns
    -------
    McNemarResult

    Raises
    ------
    ValueError
        If a count is negative or not an integer, or ``exact=False`` with ``b + c == 0``
        (the chi-square statistic is undefined; the exact test gives p = 1).

    Notes
    -----
    Computed by statsmodels' ``statsmodels.stats.contingency_tables.mcnemar`` on the table
    ``[[0, b], [c, 0]]`` (the concordant cells do not enter the statistic). The exact p-value is
    two-sided, ``min(1, 2 * P(X <= min(b, c)))``; the chi-square version uses
    ``(|b - c| - 1)**2 / (b + c)`` on 1 degree of freedom (Edwards 1948).

    References
    ----------
    .. [1] Q. McNemar, "Note on the sampling error of the difference between correlated
           proportions or percentages", Psychometrika, 12(2), pp 153-157 (1947).
    .. [2] A. L. Edwards, "Note on the 'correction for continuity' in testing the significance
           of the difference between correlated proportions", Psychometrika, 13(3),
           pp 185-187 (1948).
    .. [3] M. W. Fagerland, S. Lydersen and P. Laake, "The McNemar test for binary
           matched-pairs data: mid-p and asymptotic are better than exact conditional",
           BMC Medical Research Methodology, 13, 91 (2013).

    Examples
    --------
    >>> res = mcnemar_test(3, 10)
    >>> res.method, res.statistic, round(res.pvalue, 6)
    ('exact-binomial', 3.0, 0.092285)
    """
    b_i = _count(b, "b")
    c_i = _count(c, "c")
    if exact is None:
        use_exact = (b_i + c_i) < MCNEMAR_EXACT_BELOW
    else:
        use_exact = bool(exact)
    if not use_exact and b_i + c_i == 0:
        raise ValueError(
            "mcnemar_test: the chi-square statistic is undefined with no discordant prompts "
            "(b + c == 0); use exact=True (or None), which gives p = 1"
        )
    res = _sm_mcnemar([[0, b_i], [c_i, 0]], exact=use_exact, correction=True)
    return McNemarResult(
        statistic=float(res.statistic),
        pvalue=float(min(1.0, res.pvalue)),
        b=b_i,
        c=c_i,
        method="exact-binomial" if use_exact else "chi2-continuity-corrected",
    )


# --------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------


def throughput_ratio(
    treatment: Sequence[float], control: Sequence[float], confidence_level: float = 0.95
) -> RatioResult:
    """Ratio of per-pass throughput, treatment / control, with a Welch interval on logs.

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass throughput of each counted pass (e.g. output tokens/s), all ``> 0``, at least
        two passes per arm.
    confidence_level : float, default 0.95
        Nominal two-sided coverage.

    Returns
    -------
    RatioResult
        ``ratio = exp(mean(log t) - mean(log c))`` and its interval.

    Raises
    ------
    ValueError
        If an arm has fewer than two passes, or a throughput is not finite and positive.

    Notes
    -----
    Throughput is modelled as lognormal per pass, so the log throughput of each arm is normal
    and the ratio of geometric means is ``exp`` of a difference of means. The interval is
    Welch's t interval for that difference (unequal variances; Welch-Satterthwaite degrees of
    freedom, reported in ``df``), computed by ``scipy.stats.ttest_ind(log t, log c,
    equal_var=False).confidence_interval(confidence_level)`` and exponentiated, so it is
    asymmetric around the ratio. With two passes per arm the interval has about 2 degrees of
    freedom and is very wide; see :mod:`bistat.core.design` for the planning consequences.

    References
    ----------
    .. [1] B. L. Welch, "The generalization of 'Student's' problem when several different
           population variances are involved", Biometrika, 34(1/2), pp 28-35 (1947).
    .. [2] F. E. Satterthwaite, "An approximate distribution of estimates of variance
           components", Biometrics Bulletin, 2(6), pp 110-114 (1946).
    .. [3] D. G. Altman and J. M. Bland, "Statistics notes: the use of transformation when
           comparing two means", BMJ, 312, p 1153 (1996).

    Examples
    --------
    >>> res = throughput_ratio([90.0, 92.0, 88.0], [100.0, 101.0, 99.0])
    >>> round(res.ratio, 4), round(res.interval.low, 4), round(res.interval.high, 4)
    (0.8999, 0.8587, 0.9431)
    """
    cl = _confidence_level(confidence_level)
    t = np.log(_positive_sample(treatment, "treatment"))
    c = np.log(_positive_sample(control, "control"))
    log_diff = float(t.mean() - c.mean())
    se = float(math.sqrt(t.var(ddof=1) / t.size + c.var(ddof=1) / c.size))
    if se == 0.0:
        # Identical passes within each arm: no variation to estimate; scipy would return nan.
        low = high = log_diff
        df = float(t.size + c.size - 2)
    else:
        res = _sps.ttest_ind(t, c, equal_var=False)
        ci = res.confidence_interval(confidence_level=cl)
        low, high, df = float(ci.low), float(ci.high), float(res.df)
    interval = Interval(
        low=math.exp(low), high=math.exp(high), confidence_level=cl, method="welch-log",
        alternative="two-sided",
    )
    return RatioResult(
        ratio=math.exp(log_diff), interval=interval, df=df, log_diff=log_diff, se=se,
        n_treatment=int(t.size), n_control=int(c.size),
    )


def paired_ratio(
    treatment: Sequence[float], control: Sequence[float], confidence_level: float = 0.95
) -> RatioResult:
    """Ratio of per-pass throughput, treatment / control, from passes paired across the arms.

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass values (e.g. output tokens/s), all ``> 0``, paired by position: ``treatment[i]``
        and ``control[i]`` ran side by side (in bistat's ABBA schedule, pass ``i`` of each arm
        runs in the same block, one after the other). At least two pairs.
    confidence_level : float, default 0.95
        Nominal two-sided coverage.

    Returns
    -------
    RatioResult
        ``ratio = exp(mean(log t - log c))`` (with equal numbers of passes, the ratio of geometric
        means, as :func:`throughput_ratio`), and the paired t interval for that mean difference,
        ``scipy.stats.ttest_rel(log t, log c).confidence_interval(confidence_level)``,
        exponentiated; ``df`` = pairs - 1, ``method = "paired-log"``.

    Raises
    ------
    ValueError
        If the arms differ in length, there are fewer than two pairs, or a value is not finite
        and positive.

    Notes
    -----
    What the two arms share within a pair cancels: a drift of the machine over the run (clocks,
    host load, the GPU warming) that moves both arms' passes alike widens Welch's interval of
    :func:`throughput_ratio`, which treats the passes as independent, but not this one. It
    assumes the pair differences independent with a common mean, i.e. that what drifts does so
    slowly against one pair's span; the ratio estimated is the same. Paired by position, not by
    value: the pairing is fixed by the schedule before any pass runs.

    References
    ----------
    .. [1] "Student", "The probable error of a mean", Biometrika, 6(1), pp 1-25 (1908): the
           paired comparison of the sleep data reproduced in the examples.
    .. [2] D. G. Altman and J. M. Bland, see :func:`throughput_ratio`.

    Examples
    --------
    Student's sleep data (R's ``t.test(extra ~ group, data = sleep, paired = TRUE)``: mean
    difference -1.58, 95 % interval -2.4598858 to -0.7001142), as logs of per-pass values:

    >>> import math
    >>> g1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    >>> g2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    >>> res = paired_ratio([math.exp(x) for x in g1], [math.exp(x) for x in g2])
    >>> low, high = math.log(res.interval.low), math.log(res.interval.high)
    >>> round(res.log_diff, 4), round(low, 4), round(high, 4)
    (-1.58, -2.4599, -0.7001)
    """
    cl = _confidence_level(confidence_level)
    if len(treatment) != len(control):
        raise ValueError(f"paired_ratio: the arms must pair pass for pass, got {len(treatment)} "
                         f"(treatment) and {len(control)} (control) values")
    t = np.log(_positive_sample(treatment, "treatment"))
    c = np.log(_positive_sample(control, "control"))
    d = t - c
    log_diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    df = float(d.size - 1)
    if se == 0.0:
        low = high = log_diff   # every pair differs alike: scipy would return nan
    else:
        ci = _sps.ttest_rel(t, c).confidence_interval(confidence_level=cl)
        low, high = float(ci.low), float(ci.high)
    interval = Interval(low=math.exp(low), high=math.exp(high), confidence_level=cl,
                        method="paired-log", alternative="two-sided")
    return RatioResult(ratio=math.exp(log_diff), interval=interval, df=df, log_diff=log_diff,
                       se=se, n_treatment=int(t.size), n_control=int(c.size), method="paired-log")


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of values all ``> 0``.

    A single value (or identical values) is its own geometric mean, exactly: ``exp(log(x))`` may
    be off by an ulp, which would move a ratio of exactly 0.90 below a bound of 0.90.

    >>> geometric_mean([90.0]), round(geometric_mean([1.0, 4.0]), 12)
    (90.0, 2.0)
    """
    values = _positive_sample(values, "values", min_size=1)
    if np.all(values == values[0]):
        return float(values[0])
    return math.exp(math.fsum(np.log(values).tolist()) / values.size)


def ratio_of_geometric_means(treatment: Sequence[float], control: Sequence[float]) -> float:
    """Point estimate of the ratio treatment / control: the ratio of per-pass geometric means.

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass values (e.g. output tokens/s) of each counted pass, all finite and ``> 0``; one
        pass per arm suffices (the interval of :func:`throughput_ratio` needs two).

    Returns
    -------
    float
        ``geomean(treatment) / geomean(control)``.

    Raises
    ------
    ValueError
        If an arm has no pass, or a value is not finite and positive.

    Notes
    -----
    This is the one point estimate bistat shows and decides on (the classifier's ``point``
    statistic, the findings' ratio column). An arm whose passes are all equal has that value as
    its geometric mean *exactly*, so a ratio of one pass of 90 to one of 100 is 0.9, not
    ``exp(log 90 - log 100) = 0.8999999999999996``, and a bound of 0.90 is decided as declared.
    :func:`throughput_ratio`'s ``ratio`` (``exp`` of the mean log difference) agrees with it to
    within rounding.

    Examples
    --------
    >>> ratio_of_geometric_means([90.0], [100.0])
    0.9
    >>> round(ratio_of_geometric_means([90.0, 92.0, 88.0], [100.0, 101.0, 99.0]), 4)
    0.8999
    """
    t = _positive_sample(treatment, "treatment", min_size=1)
    c = _positive_sample(control, "control", min_size=1)
    return geometric_mean(t) / geometric_mean(c)


def tost_ratio(
    treatment: Sequence[float],
    control: Sequence[float],
    low: float,
    high: float,
    alpha: float = 0.05,
) -> TostResult:
    """Two one-sided tests (TOST) of equivalence for the throughput ratio.

    Shows ``low < treatment / control < high`` (ratio of geometric means).

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass throughput, all ``> 0``, at least two passes per arm.
    low, high : float
        Equivalence margins on the ratio scale, ``0 < low < high`` (e.g. 0.95 and 1.05).
    alpha : float, default 0.05
        Level of each one-sided test.

    Returns
    -------
    TostResult
        ``equivalent`` is ``pvalue < alpha``.

    Notes
    -----
    Computed by statsmodels' ``ttost_ind(log t, log c, log(low), log(high), usevar="unequal")``
    (Welch's t for each one-sided test). Rejecting both one-sided nulls at level ``alpha`` is the
    same as the two-sided ``1 - 2 alpha`` Welch interval of :func:`throughput_ratio` lying
    strictly inside ``(low, high)`` (Schuirmann 1987).

    References
    ----------
    .. [1] D. J. Schuirmann, "A comparison of the two one-sided tests procedure and the power
           approach for assessing the equivalence of average bioavailability", Journal of
           Pharmacokinetics and Biopharmaceutics, 15(6), pp 657-680 (1987).
    .. [2] B. L. Welch (1947), see :func:`throughput_ratio`.

    Examples
    --------
    >>> res = tost_ratio([99.0, 101.0, 100.0], [100.0, 100.5, 99.5], 0.95, 1.05)
    >>> res.equivalent, round(res.pvalue, 4)
    (True, 0.0026)
    """
    a = float(alpha)
    if not 0.0 < a < 0.5:
        raise ValueError(f"alpha must be strictly between 0 and 0.5 (e.g. 0.05), got {alpha!r}")
    lo, hi = float(low), float(high)
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo < hi):
        raise ValueError(
            f"equivalence margins must satisfy 0 < low < high on the ratio scale, got low={low!r}, "
            f"high={high!r} (e.g. low=0.95, high=1.05)"
        )
    t = np.log(_positive_sample(treatment, "treatment"))
    c = np.log(_positive_sample(control, "control"))
    pvalue, (stat_lo, p_lo, df_lo), (stat_hi, p_hi, _df_hi) = _sm_ttost_ind(
        t, c, math.log(lo), math.log(hi), usevar="unequal"
    )
    pvalue = float(pvalue)
    return TostResult(
        pvalue=pvalue, equivalent=bool(pvalue < a), low=lo, high=hi, alpha=a,
        ratio=math.exp(float(t.mean() - c.mean())), statistic_low=float(stat_lo),
        statistic_high=float(stat_hi), pvalue_low=float(p_lo), pvalue_high=float(p_hi),
        df=float(df_lo),
    )


def pooled_cv(groups: Sequence[Sequence[float]]) -> CVResult:
    """Pooled pass-to-pass coefficient of variation of throughput.

    Parameters
    ----------
    groups : sequence of sequences of float
        Per-pass throughputs grouped by condition that should have the same mean (e.g. one
        group per arm, or per arm and engine-start block); all values ``> 0``.

    Returns
    -------
    CVResult
        ``sd_log`` is the pooled within-group standard deviation of log throughput,
        ``cv = sqrt(exp(sd_log**2) - 1)``.

    Raises
    ------
    ValueError
        If no group has two or more values, or a value is not finite and positive.

    Notes
    -----
    The within-group variances of ``log`` throughput are pooled with weights ``n_i - 1``
    (the pooled variance of one-way ANOVA), so differences between group means (e.g. the
    treatment effect) do not inflate it. The result is reported both as the log-scale
    standard deviation ``sd_log`` -- what the Welch interval of :func:`throughput_ratio` uses,
    and what :mod:`bistat.core.design` derives from a declared CV -- and as the CV of a lognormal
    with that ``sd_log``, ``sqrt(exp(sd_log**2) - 1)``. For small CVs the two agree to first
    order (0.10 on the log scale is a CV of 0.1003). Groups with a single value contribute no
    degrees of freedom.

    References
    ----------
    .. [1] D. C. Montgomery, Design and Analysis of Experiments, 8th ed., Wiley (2013),
           section 3.3 (the pooled error mean square).
    .. [2] J. Aitchison and J. A. C. Brown, The Lognormal Distribution, Cambridge
           University Press (1957): the CV of a lognormal is ``sqrt(exp(sigma**2) - 1)``.

    Examples
    --------
    >>> res = pooled_cv([[100.0, 110.0], [200.0, 220.0]])
    >>> round(res.sd_log, 4), round(res.cv, 4), res.df, res.n_groups
    (0.0674, 0.0675, 2, 2)
    """
    ss = 0.0
    df = 0
    n_groups = 0
    for i, group in enumerate(groups):
        arr = _positive_sample(group, f"groups[{i}]", min_size=1)
        if arr.size < 2:
            continue
        logs = np.log(arr)
        ss += float(((logs - logs.mean()) ** 2).sum())
        df += int(arr.size - 1)
        n_groups += 1
    if df == 0:
        raise ValueError(
            "pooled_cv needs at least one group with two or more passes to estimate "
            "pass-to-pass variation"
        )
    sd_log = math.sqrt(ss / df)
    return CVResult(cv=math.sqrt(math.expm1(sd_log**2)), sd_log=sd_log, df=df, n_groups=n_groups)


def block_effect_test(groups: Sequence[Sequence[Sequence[float]]]) -> BlockEffect:
    """Whether values of one block are more alike than values of different blocks of the same
    group: the nested F test on their logs.

    Parameters
    ----------
    groups : sequence of sequences of sequences of float
        ``groups[g][b]`` is block ``b`` of group ``g``, its values all ``> 0``: in bistat a
        group is an arm and a block one start of its engine, each value a pass's throughput.
        Empty blocks are left out.

    Returns
    -------
    BlockEffect

    Raises
    ------
    ValueError
        If no group has two blocks (nothing to test), no block has two values (no
        within-block variation to test against), or a value is not finite and positive.

    Notes
    -----
    The full linear model gives every (group, block) cell its own mean, the reduced one every
    group its own; ``F = ((RSS_r - RSS_f) / (c - g)) / (RSS_f / (n - c))`` for ``n`` values in
    ``c`` cells of ``g`` groups, computed by statsmodels (``OLS.compare_f_test``). With one
    group it is one-way ANOVA's F. A significant F says the blocks differ beyond the values'
    own scatter: the values are then not independent, and an interval that treats them as if
    they were is too narrow; the blocks' means, one observation each, are then the units.

    References
    ----------
    .. [1] D. C. Montgomery, Design and Analysis of Experiments, 8th ed., Wiley (2013),
           chapter 14 (the two-stage nested design).

    Examples
    --------
    >>> r = block_effect_test([[[100.0, 101.0], [110.0, 111.0]], [[90.0, 91.0], [99.0]]])
    >>> round(r.f_stat, 1), r.df_blocks, r.df_resid, r.n_blocks
    (142.3, 2, 3, 4)
    """
    # each value's log, with its cell (a non-empty block) and its group, both numbered densely
    y: list[float] = []
    cell: list[int] = []
    group: list[int] = []
    n_cells = n_groups = most_blocks = 0
    for g, blocks in enumerate(groups):
        kept = [(b, values) for b, values in enumerate(blocks) if len(values)]
        for b, values in kept:
            arr = _positive_sample(values, f"groups[{g}][{b}]", min_size=1)
            y += list(np.log(arr))
            cell += [n_cells] * arr.size
            group += [n_groups] * arr.size
            n_cells += 1
        n_groups += bool(kept)
        most_blocks = max(most_blocks, len(kept))
    if most_blocks < 2:
        raise ValueError("block_effect_test needs a group with two or more blocks")
    if len(y) <= n_cells:
        raise ValueError("block_effect_test needs a block with two or more values")
    full = _sm_ols(np.asarray(y), np.eye(n_cells)[cell]).fit()
    reduced = _sm_ols(np.asarray(y), np.eye(n_groups)[group]).fit()
    f_stat, p_value, df_diff = full.compare_f_test(reduced)
    return BlockEffect(f_stat=float(f_stat), p_value=float(p_value), df_blocks=int(df_diff),
                       df_resid=int(round(full.df_resid)), n_values=len(y), n_blocks=n_cells,
                       n_groups=n_groups)
