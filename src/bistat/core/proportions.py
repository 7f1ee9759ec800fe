"""Match rates: one arm's (Wilson score interval), two arms' difference (Newcombe's hybrid score),
and the paired, prompt-level comparison of two arms (McNemar's test) (pure: no I/O, no clock, no
printing). The intervals come from statsmodels; the arguments are validated once
(:mod:`bistat.core.validation`) and each result records its method
(:mod:`bistat.core.stat_results`).

Contents
--------
- :func:`match_fraction`, :func:`wilson_interval` -- one arm's match rate (Wilson score interval).
- :func:`newcombe_difference` -- difference of two arms' match rates (Newcombe's hybrid score).
- :func:`intervals_overlap` -- whether two intervals share a point.
- :func:`mcnemar_test` -- paired, prompt-level comparison of two arms.
"""

from __future__ import annotations

import math

from bistat.core.lazy import lazy_function
from bistat.core.stat_results import Interval, McNemarResult
from bistat.core.validation import _alternative, _confidence_level, _count, _counts


_sm_mcnemar = lazy_function("statsmodels.stats.contingency_tables", "mcnemar")


_sm_confint_2indep = lazy_function("statsmodels.stats.proportion", "confint_proportions_2indep")


_sm_proportion_confint = lazy_function("statsmodels.stats.proportion", "proportion_confint")


# Below this many discordant pairs McNemar's test is exact by default (statsmodels' advice,
# `statsmodels.stats.contingency_tables.mcnemar`: "exact ... should be used for small samples";
# 25 is the usual rule of thumb, e.g. Fagerland, Lydersen and Laake (2013)).
MCNEMAR_EXACT_BELOW = 25


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
