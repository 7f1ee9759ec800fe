"""Per-pass values (throughput or latency) of two arms: their ratio with an interval, its TOST
equivalence within declared margins, the pass-to-pass CV and the engine-start block effect (pure:
no I/O, no clock, no printing). The intervals and tests come from scipy and statsmodels; the
arguments are validated once (:mod:`bistat.core.validation`) and each result records its method
(:mod:`bistat.core.stat_results`).

Contents
--------
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
from collections.abc import Sequence

import numpy as np

from bistat.core.lazy import lazy_function, lazy_module
from bistat.core.stat_results import BlockEffect, CVResult, Interval, RatioResult, TostResult
from bistat.core.validation import _confidence_level, _positive_sample


_sps = lazy_module("scipy.stats")


_sm_ttost_ind = lazy_function("statsmodels.stats.weightstats", "ttost_ind")


_sm_ols = lazy_function("statsmodels.regression.linear_model", "OLS")


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
