"""Design analysis of the throughput (or latency) ratio: the expected width of its interval, the
power of the criteria on it, the probabilities of the cost rule's outcomes and the passes that
decide it (pure, no I/O).

Planning model: per-pass throughput of each arm is lognormal with the same coefficient of
variation ``cv`` in both arms, i.e. normal on the log scale with standard deviation ``sigma =
sqrt(log(1 + cv**2))`` (:func:`log_sd_from_cv`), the same convention as
:func:`bistat.core.throughput.pooled_cv`. Both arms have ``passes_per_arm`` counted passes.

Power of the point-estimate criteria is exact (normal distribution). Power of the interval
criteria and of TOST is computed by Monte Carlo from the exact sampling distribution of the
Welch procedure's sufficient statistics -- the difference of log means
``D ~ N(log r, 2 sigma**2 / n)`` and the two sample variances ``s_i**2 ~ sigma**2 chi2(n-1) /
(n-1)``, all independent -- because the Welch interval uses an *estimated*
(Welch-Satterthwaite) degrees of freedom; a noncentral t with the nominal ``2 (n - 1)`` degrees
of freedom is badly optimistic at two or three passes per arm. A paired interval draws the same
mean log difference and one ``chi2(n - 1)`` variance, ``n - 1`` degrees of freedom; a paired or
HAC interval under AR(1) pairs with lag-1 autocorrelation ``rho`` draws the exact normal
distribution of the mean and the cosine transforms the interval uses (:func:`_cosine_draws`).
The draws use a fixed seed (:data:`POWER_SEED`) and :data:`POWER_DRAWS` replicates, so results
are deterministic; the Monte Carlo standard error is at most ``0.5 / sqrt(POWER_DRAWS)`` =
0.0011.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from bistat.core.lazy import lazy_function, lazy_module
from bistat.core.serial import HacSpec, cosine_terms
from bistat.core.validation import _confidence_level, _int_at_least, _positive, _probability

_sps = lazy_module("scipy.stats")
_dct = lazy_function("scipy.fft", "dct")


#: Monte Carlo replicates for the interval and TOST power functions.
POWER_DRAWS = 200_000


#: Seed of the Monte Carlo draws (``numpy.random.default_rng(POWER_SEED)``).
POWER_SEED = 20_240_917


def log_sd_from_cv(cv: float) -> float:
    """Log-scale standard deviation of a lognormal with coefficient of variation ``cv``.

    ``sigma = sqrt(log(1 + cv**2))``, the inverse of ``cv = sqrt(exp(sigma**2) - 1)`` used by
    :func:`bistat.core.stats.pooled_cv` (Aitchison and Brown 1957).

    Examples
    --------
    >>> round(log_sd_from_cv(0.10), 5)
    0.09975
    """
    return math.sqrt(math.log1p(_positive(cv, "cv") ** 2))


def welch_df_equal_variances(passes_per_arm: int) -> float:
    """Welch-Satterthwaite degrees of freedom when both arms have equal variance and size.

    With ``n`` passes per arm and equal sample variances the formula gives ``2 (n - 1)``.

    Examples
    --------
    >>> welch_df_equal_variances(5)
    8.0
    """
    n = _int_at_least(passes_per_arm, "passes_per_arm", 2)
    return float(2 * (n - 1))


def expected_ratio_halfwidth(
    passes_per_arm: int, cv: float, confidence_level: float = 0.95, paired: bool = False,
    *, hac: HacSpec | None = None
) -> float:
    """Planned half-width of the throughput-ratio interval on the log scale.

    Parameters
    ----------
    passes_per_arm : int
        Counted passes per arm, ``>= 2``.
    cv : float
        Expected pass-to-pass coefficient of variation of throughput (same in both arms).
    confidence_level : float, default 0.95

    Returns
    -------
    float
        ``t_{1 - alpha/2, 2(n-1)} * sigma * sqrt(2 / n)`` with ``sigma = log_sd_from_cv(cv)``:
        the half-width of the Welch interval of :func:`bistat.core.stats.throughput_ratio` on the
        log scale when both sample standard deviations equal ``sigma`` (then the Welch
        degrees of freedom are ``2 (n - 1)``). The interval on the ratio scale is
        ``ratio / f .. ratio * f`` with ``f = exp(halfwidth)``
        (:func:`expected_ratio_interval_factor`). With ``paired`` (``n`` passes of each arm
        paired, :func:`bistat.core.stats.paired_ratio`, the log differences' SD
        ``sigma sqrt(2)``) the same with the paired t's ``n - 1`` degrees of freedom; with
        ``hac`` (the serial-correlation-robust interval of :func:`bistat.core.serial.hac_ratio`)
        with its ``B`` degrees of freedom (:func:`bistat.core.serial.cosine_terms`), for
        independent pairs.

    Examples
    --------
    >>> round(expected_ratio_halfwidth(2, 0.10), 4)
    0.4292
    >>> round(expected_ratio_halfwidth(10, 0.05), 4)
    0.0469
    >>> round(expected_ratio_halfwidth(10, 0.05, paired=True), 4)
    0.0506
    >>> round(expected_ratio_halfwidth(10, 0.05, hac=HacSpec()), 4)
    0.0962
    """
    n = _int_at_least(passes_per_arm, "passes_per_arm", 2)
    cl = _confidence_level(confidence_level)
    sigma = log_sd_from_cv(cv)
    if hac is not None:
        df = cosine_terms(n, hac.bandwidth)
    else:
        df = n - 1 if paired else welch_df_equal_variances(n)
    tq = _sps.t.ppf(1.0 - (1.0 - cl) / 2.0, df)
    return float(tq * sigma * math.sqrt(2.0 / n))


def expected_ratio_interval_factor(
    passes_per_arm: int, cv: float, confidence_level: float = 0.95, paired: bool = False,
    *, hac: HacSpec | None = None
) -> float:
    """Multiplicative half-width of the planned ratio interval: ``exp(expected_ratio_halfwidth)``.

    A ratio estimate ``r`` then has the interval ``r / factor .. r * factor``.

    Examples
    --------
    >>> round(expected_ratio_interval_factor(2, 0.10), 3)
    1.536
    """
    return math.exp(expected_ratio_halfwidth(passes_per_arm, cv, confidence_level, paired,
                                             hac=hac))


def _point_z(bound: float, true_ratio: float, passes_per_arm: int, cv: float) -> float:
    n = _int_at_least(passes_per_arm, "passes_per_arm", 2)
    b = _positive(bound, "bound")
    r = _positive(true_ratio, "true_ratio")
    sigma = log_sd_from_cv(cv)
    return (math.log(b) - math.log(r)) / (sigma * math.sqrt(2.0 / n))


def power_ratio_point_below(
    bound: float, true_ratio: float, passes_per_arm: int, cv: float
) -> float:
    """Probability that the ratio's point estimate falls below ``bound``.

    Parameters
    ----------
    bound : float
        The criterion's bound on the ratio (e.g. 0.90 for "throughput below 0.90").
    true_ratio : float
        Assumed true treatment / control throughput ratio.
    passes_per_arm : int
        Counted passes per arm, ``>= 2``.
    cv : float
        Pass-to-pass coefficient of variation (both arms).

    Returns
    -------
    float
        ``Phi((log bound - log true_ratio) / (sigma sqrt(2 / n)))``: exact, since the log of the
        estimated ratio is normal with mean ``log true_ratio`` and variance ``2 sigma**2 / n``.

    Examples
    --------
    >>> round(power_ratio_point_below(0.90, 0.90, 5, 0.10), 3)
    0.5
    """
    return float(_sps.norm.cdf(_point_z(bound, true_ratio, passes_per_arm, cv)))


def power_ratio_point_at_least(
    bound: float, true_ratio: float, passes_per_arm: int, cv: float
) -> float:
    """Probability that the ratio's point estimate is at least ``bound``.

    ``1 - power_ratio_point_below(bound, ...)``; exact (see :func:`power_ratio_point_below`).

    Examples
    --------
    >>> round(power_ratio_point_at_least(0.95, 1.0, 3, 0.05), 3)
    0.896
    """
    return float(_sps.norm.sf(_point_z(bound, true_ratio, passes_per_arm, cv)))


def _welch_draws(
    true_ratio: float, passes_per_arm: int, cv: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded draws of (log-ratio estimate, its Welch standard error, Welch df)."""
    n = _int_at_least(passes_per_arm, "passes_per_arm", 2)
    r = _positive(true_ratio, "true_ratio")
    sigma = log_sd_from_cv(cv)
    rng = np.random.default_rng(POWER_SEED)
    z = rng.standard_normal(POWER_DRAWS)
    q = rng.chisquare(n - 1, size=(2, POWER_DRAWS)) / (n - 1)  # s_i**2 / sigma**2
    d = math.log(r) + sigma * math.sqrt(2.0 / n) * z
    w = sigma**2 * q / n  # s_i**2 / n per arm
    se = np.sqrt(w[0] + w[1])
    df = (w[0] + w[1]) ** 2 / ((w[0] ** 2 + w[1] ** 2) / (n - 1))
    return d, se, df


def _paired_draws(true_ratio: float, pairs: int, cv: float) -> tuple[np.ndarray, np.ndarray]:
    """Seeded draws of (mean log difference, its standard error) for ``pairs`` passes paired
    across the arms, at the per-arm ``cv`` that gives the pairs' log differences the standard
    deviation ``sigma sqrt(2)`` (as :func:`bistat.core.stats.paired_ratio` sees them; the
    paired t has ``pairs - 1`` degrees of freedom). The mean is the Welch draws' (the same
    seed and ``N(log r, 2 sigma**2 / n)``); the variance is one ``chi2(n - 1)`` instead of
    two."""
    n = _int_at_least(pairs, "pairs", 2)
    r = _positive(true_ratio, "true_ratio")
    sigma = log_sd_from_cv(cv)
    rng = np.random.default_rng(POWER_SEED)
    z = rng.standard_normal(POWER_DRAWS)
    q = rng.chisquare(n - 1, size=POWER_DRAWS) / (n - 1)   # s_d**2 / (2 sigma**2)
    d = math.log(r) + sigma * math.sqrt(2.0 / n) * z
    se = sigma * math.sqrt(2.0 / n) * np.sqrt(q)
    return d, se


@functools.lru_cache(maxsize=64)
def _t_quantiles(passes_per_arm: int, cv: float, level: float) -> np.ndarray:
    """``t.ppf(level, df)`` for the Welch draws' degrees of freedom at these passes and CV.

    The degrees of freedom do not depend on the true ratio, and scipy's t quantile over
    :data:`POWER_DRAWS` values is most of a power evaluation's time, so the quantiles are kept
    for the searches over ratios and passes (the same draws, hence the same numbers as
    computing them again)."""
    _, _, df = _welch_draws(1.0, passes_per_arm, cv)
    out = _sps.t.ppf(level, df)
    out.setflags(write=False)
    return out


def _interval_draws(true_ratio: float, passes_per_arm: int, cv: float, level: float,
                    paired: bool, hac: HacSpec | None = None, rho: float = 0.0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, half-width) draws of the two-sided interval whose upper quantile is
    ``level``: Welch's (estimated degrees of freedom per draw) or, ``paired``, the paired t's
    (``passes_per_arm - 1`` degrees of freedom); with ``hac`` the equal-weighted cosine
    interval's, and with ``rho`` either paired interval's when the pairs' log differences are
    AR(1) with that lag-1 autocorrelation (:func:`_cosine_draws`)."""
    rho = _rho(rho)
    if hac is not None or (paired and rho != 0.0):
        n = _int_at_least(passes_per_arm, "passes_per_arm", 2)
        r = _positive(true_ratio, "true_ratio")
        terms = n - 1 if hac is None else cosine_terms(n, hac.bandwidth)
        z0, ms = _cosine_draws(n, rho, terms)
        scale = log_sd_from_cv(cv) * math.sqrt(2.0 / n)   # the pairs' SD over sqrt(n)
        return (math.log(r) + scale * z0,
                float(_sps.t.ppf(level, terms)) * scale * np.sqrt(ms))
    if rho != 0.0:
        raise ValueError("rho plans a paired or HAC interval (the pairs' lag-1 "
                         "autocorrelation); Welch's is planned for independent passes")
    if paired:
        d, se = _paired_draws(true_ratio, passes_per_arm, cv)
        return d, float(_sps.t.ppf(level, passes_per_arm - 1)) * se
    d, se, _ = _welch_draws(true_ratio, passes_per_arm, cv)
    return d, _t_quantiles(passes_per_arm, cv, level) * se


def power_ratio_interval_below(
    bound: float,
    true_ratio: float,
    passes_per_arm: int,
    cv: float,
    confidence_level: float = 0.95,
) -> float:
    """Probability that the whole ratio interval lies below ``bound`` ("slower").

    Parameters
    ----------
    bound : float
        The criterion's bound (e.g. 1.0: "the treatment is slower").
    true_ratio : float
        Assumed true treatment / control throughput ratio.
    passes_per_arm : int
        Counted passes per arm, ``>= 2``.
    cv : float
        Pass-to-pass coefficient of variation (both arms).
    confidence_level : float, default 0.95
        Level of the two-sided Welch interval of :func:`bistat.core.stats.throughput_ratio`.

    Returns
    -------
    float
        ``P(upper end of the interval < bound)``, by seeded Monte Carlo (see the module notes:
        :data:`POWER_DRAWS` draws, standard error <= 0.0011).

    Notes
    -----
    At ``true_ratio == bound`` this is the one-sided false-positive rate, at most
    ``(1 - confidence_level) / 2``. Two passes per arm at 10 % CV cannot tell 0.90 from 1.00:

    Examples
    --------
    >>> round(power_ratio_interval_below(1.0, 0.90, 2, 0.10), 2)
    0.05
    >>> round(power_ratio_interval_below(1.0, 0.90, 10, 0.10), 2)
    0.6
    """
    cl = _confidence_level(confidence_level)
    b = _positive(bound, "bound")
    d, se, df = _welch_draws(true_ratio, passes_per_arm, cv)
    tq = _t_quantiles(passes_per_arm, cv, 1.0 - (1.0 - cl) / 2.0)
    return float(np.mean(d + tq * se < math.log(b)))


def power_ratio_interval_above(
    bound: float,
    true_ratio: float,
    passes_per_arm: int,
    cv: float,
    confidence_level: float = 0.95,
) -> float:
    """Probability that the ratio interval's lower end is at least ``bound`` ("not slower").

    Same parameters and method as :func:`power_ratio_interval_below`; returns
    ``P(lower end of the interval >= bound)``.

    Examples
    --------
    >>> round(power_ratio_interval_above(0.90, 1.0, 5, 0.05), 2)
    0.81
    """
    cl = _confidence_level(confidence_level)
    b = _positive(bound, "bound")
    d, se, df = _welch_draws(true_ratio, passes_per_arm, cv)
    tq = _t_quantiles(passes_per_arm, cv, 1.0 - (1.0 - cl) / 2.0)
    return float(np.mean(d - tq * se >= math.log(b)))


def power_tost(
    low: float,
    high: float,
    true_ratio: float,
    passes_per_arm: int,
    cv: float,
    alpha: float = 0.05,
) -> float:
    """Probability that TOST shows equivalence of the ratio within ``(low, high)``.

    Parameters
    ----------
    low, high : float
        Equivalence margins on the ratio scale, ``0 < low < high``.
    true_ratio : float
        Assumed true ratio.
    passes_per_arm : int
        Counted passes per arm, ``>= 2``.
    cv : float
        Pass-to-pass coefficient of variation (both arms).
    alpha : float, default 0.05
        Level of each one-sided test, as in :func:`bistat.core.stats.tost_ratio`.

    Returns
    -------
    float
        ``P(both one-sided Welch tests reject)``, i.e. the ``1 - 2 alpha`` Welch interval lies
        inside ``(log low, log high)``; seeded Monte Carlo (see the module notes).

    Examples
    --------
    >>> round(power_tost(0.95, 1.05, 1.0, 10, 0.05), 2)
    0.39
    """
    a = float(alpha)
    if not 0.0 < a < 0.5:
        raise ValueError(f"alpha must be strictly between 0 and 0.5 (e.g. 0.05), got {alpha!r}")
    lo = _positive(low, "low")
    hi = _positive(high, "high")
    if not lo < hi:
        raise ValueError(f"equivalence margins must satisfy low < high, got low={low!r}, high={high!r}")
    d, se, df = _welch_draws(true_ratio, passes_per_arm, cv)
    tq = _t_quantiles(passes_per_arm, cv, 1.0 - a)
    return float(np.mean((d - tq * se > math.log(lo)) & (d + tq * se < math.log(hi))))


#: The cost rule's outcomes, as :func:`cost_outcome_probabilities` names them.
COST_OUTCOMES = ("no measurable cost", "costs", "faster", "undecidable")


def cost_outcome_probabilities(margin: float, true_ratio: float, passes_per_arm: int, cv: float,
                               confidence_level: float = 0.95, metric: str = "throughput",
                               paired: bool = False, *, hac: HacSpec | None = None,
                               rho: float = 0.0) -> dict[str, float]:
    """Probability of each outcome of a cost rule (``[rule.cost]``) at a true ratio.

    Parameters
    ----------
    margin : float
        The rule's margin ``m``: no measurable cost when the interval's slower end lies within
        ``[1 - m, 1 + m]``.
    true_ratio : float
        Assumed true ratio treatment / control of the metric.
    passes_per_arm : int
        Counted passes per arm, ``>= 2``.
    cv : float
        Pass-to-pass coefficient of variation of the metric (both arms).
    confidence_level : float, default 0.95
        The level of the two-sided Welch interval the rule decides on.
    metric : {"throughput", "latency"}
        Which side is "slower": a throughput ratio below 1, a latency ratio above 1.
    paired : bool, default False
        The rule's interval is the paired one (``[rule.cost] interval = "paired"``): the
        ``passes_per_arm`` passes of each arm paired, the paired t's ``n - 1`` degrees of
        freedom, ``cv`` the per-arm CV that gives the pairs' log differences their spread
        (:func:`bistat.declare.design_report.paired_cv_from_run`).
    hac : bistat.core.serial.HacSpec, optional
        The rule's interval is the serial-correlation-robust one (``interval = "hac"``) with these
        parameters: the passes paired as for ``paired``, the equal-weighted cosine interval of
        :func:`bistat.core.serial.hac_ratio`.
    rho : float, default 0.0
        Lag-1 autocorrelation of the pairs' log differences (AR(1)), for a paired or HAC
        interval: e.g. :attr:`bistat.core.design_rho.SerialEstimate.rho` of an earlier run. The
        draws are then of the declared interval under that correlation
        (:func:`bistat.core.design_coverage.interval_coverage` gives its coverage).

    Returns
    -------
    dict
        ``{"no measurable cost", "costs", "faster", "undecidable"} -> probability`` (summing to
        1), by the seeded Monte Carlo of the module notes.

    Notes
    -----
    The decision is :func:`bistat.core.classify.classify_cost`'s, on each draw's interval
    ``[L, U]``: *costs* wholly beyond the margin on the slower side, *faster* wholly beyond it
    on the faster side, else *no measurable cost* when the slower end (``L`` for throughput,
    ``U`` for latency) lies within the margin -- the one-sided (non-inferiority) Welch test at
    ``(1 - confidence_level) / 2`` -- else *undecidable*. So at a true ratio on the slower
    margin *no measurable cost* (or *faster*) has probability at most
    ``(1 - confidence_level) / 2``, and so has *costs* at a true ratio of 1.

    Examples
    --------
    >>> p = cost_outcome_probabilities(0.10, 1.0, 8, 0.05)
    >>> round(p["no measurable cost"], 2), round(p["costs"], 4)
    (0.97, 0.0)
    >>> round(cost_outcome_probabilities(0.10, 1.0, 8, 0.05, paired=True)["no measurable cost"], 2)
    0.95
    """
    m = _positive(margin, "margin")
    if not m < 1.0:
        raise ValueError(f"margin must be below 1, got {margin!r}")
    if metric not in ("throughput", "latency"):
        raise ValueError(f"metric must be 'throughput' or 'latency', got {metric!r}")
    cl = _confidence_level(confidence_level)
    d, half = _interval_draws(true_ratio, passes_per_arm, cv, 1.0 - (1.0 - cl) / 2.0, paired,
                              hac, rho)
    low, high = d - half, d + half
    lo, hi = math.log(1.0 - m), math.log(1.0 + m)
    below = high < lo
    above = low > hi
    if metric == "throughput":
        costs, faster, slower_end_within = below, above, low >= lo
    else:
        costs, faster, slower_end_within = above, below, high <= hi
    no_cost = slower_end_within & ~faster
    out = {"no measurable cost": float(np.mean(no_cost)), "costs": float(np.mean(costs)),
           "faster": float(np.mean(faster))}
    out["undecidable"] = float(np.mean(~(no_cost | costs | faster)))
    return out


def passes_to_decide(margin: float, true_ratio: float, cv: float, confidence_level: float = 0.95,
                     metric: str = "throughput", target: float = 0.80,
                     max_passes: int = 200, paired: bool = False, *,
                     hac: HacSpec | None = None, rho: float = 0.0) -> int | None:
    """Passes per arm at which the cost rule decides with probability ``target`` at a true ratio.

    Beyond the margin on the slower side "decided" is *costs*; on the other side of that margin
    it is *no measurable cost* or *faster* (the interval's slower end within the margin: the
    one-sided test of :func:`cost_outcome_probabilities`), whichever it is -- so a faster true
    ratio is decided no later than a slower one on the same side. None when no number up to
    ``max_passes`` gets there (a true ratio on the slower margin is decided either way with
    probability at most ``(1 - confidence_level) / 2``). ``paired`` plans the paired interval,
    ``hac`` the serial-correlation-robust one, ``rho`` either under that lag-1 autocorrelation of
    the pairs (:func:`cost_outcome_probabilities`).

    Examples
    --------
    >>> passes_to_decide(0.10, 1.0, 0.05)
    5
    >>> passes_to_decide(0.10, 0.97, 0.10)
    29
    """
    m = _positive(margin, "margin")
    r = _positive(true_ratio, "true_ratio")
    if metric not in ("throughput", "latency"):
        raise ValueError(f"metric must be 'throughput' or 'latency', got {metric!r}")
    slower = 1.0 - m if metric == "throughput" else 1.0 + m   # the margin on the slower side
    if r == slower:
        return None
    beyond = r < slower if metric == "throughput" else r > slower
    outcomes = ("costs",) if beyond else ("no measurable cost", "faster")
    # a start from the normal approximation: the slower margin at (z_cl + z_target) standard
    # errors of the log ratio, sigma sqrt(2 / n)
    # (AR(1) pairs: the mean's variance is about (1 + rho) / (1 - rho) times the independent one)
    sigma = log_sd_from_cv(cv) * math.sqrt((1.0 + _rho(rho)) / (1.0 - _rho(rho)))
    gap = abs(math.log(slower) - math.log(r))
    zq = _sps.norm.ppf(1.0 - (1.0 - _confidence_level(confidence_level)) / 2.0)
    zt = _sps.norm.ppf(_probability(target, "target"))
    guess = math.ceil(2.0 * (sigma * (zq + zt) / gap) ** 2)

    def power(n: int) -> float:
        probs = cost_outcome_probabilities(m, r, n, cv, confidence_level, metric, paired,
                                           hac=hac, rho=rho)
        return sum(probs[o] for o in outcomes)

    return min_passes_for_power(power, target, max_passes, start=min(max(guess, 2), max_passes))


def min_passes_for_power(
    power: Callable[[int], float], target: float = 0.80, max_passes: int = 200,
    start: int | None = None,
) -> int | None:
    """Smallest passes per arm at which ``power(passes)`` reaches ``target``.

    Parameters
    ----------
    power : callable
        ``passes_per_arm -> power``, e.g.
        ``lambda n: power_ratio_interval_below(1.0, 0.9, n, 0.1)``; assumed non-decreasing in
        ``passes_per_arm``.
    target : float, default 0.80
    max_passes : int, default 200
        Largest number of passes considered.
    start : int, optional
        A guess near the answer (e.g. from a normal approximation): the search steps from it,
        one pass at a time, then doubles, so a good guess costs two or three evaluations. The
        answer is the same as without it (``power`` being non-decreasing).

    Returns
    -------
    int or None
        The smallest ``n`` in ``2 .. max_passes`` with ``power(n) >= target``, or ``None`` if
        even ``max_passes`` does not reach it. Found by doubling and bisection (about
        ``2 log2(max_passes)`` evaluations).

    Examples
    --------
    >>> min_passes_for_power(lambda n: power_ratio_point_below(0.95, 0.90, n, 0.10))
    5
    """
    tgt = _probability(target, "target")
    top = _int_at_least(max_passes, "max_passes", 2)
    if start is not None:
        n = min(max(int(start), 2), top)
        if power(n) >= tgt:
            while n > 2 and power(n - 1) >= tgt:
                n -= 1
            return n
        if n == top:
            return None
        lo, hi = n, min(n + 1, top)   # power(lo) < target
        while power(hi) < tgt:
            if hi == top:
                return None
            lo, hi = hi, min(top, hi + max(1, hi - n))
        return bisect_power(power, tgt, lo, hi)
    if power(2) >= tgt:
        return 2
    lo = 2  # power(lo) < target
    hi = 4
    while hi < top and power(hi) < tgt:
        lo, hi = hi, hi * 2
    hi = min(hi, top)
    if power(hi) < tgt:
        return None
    return bisect_power(power, tgt, lo, hi)


def bisect_power(power: Callable[[int], float], target: float, lo: int, hi: int,
                 divisor: int | None = None) -> int:
    """Narrow ``lo < n <= hi`` (``power(lo) < target <= power(hi)``) by bisection; return
    ``hi``, the smallest ``n`` found that reaches ``target``.

    Exact (down to ``hi - lo == 1``) by default; with ``divisor`` it stops once
    ``hi - lo <= max(1, lo // divisor)``, a relative tolerance for searches over large ``n``.

    >>> bisect_power(lambda n: n / 100, 0.37, 1, 64)
    37
    >>> bisect_power(lambda n: n / 10**6, 0.3712, 1024, 1 << 20, divisor=100)  # within 1 %
    371350
    """
    while hi - lo > (1 if divisor is None else max(1, lo // divisor)):
        mid = (lo + hi) // 2
        if power(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


#: Rows per block of the Monte Carlo draws of a whole series (bounds the memory at 200 pairs).
_DRAW_BLOCK = 20_000


def _rho(rho: float) -> float:
    r = float(rho)
    if not (math.isfinite(r) and -1.0 < r < 1.0):
        raise ValueError(f"rho must be a lag-1 autocorrelation strictly between -1 and 1, got "
                         f"{rho!r}")
    return r


def _ar1_cov(n: int, rho: float) -> np.ndarray:
    """Correlation matrix of ``n`` consecutive values of a stationary AR(1): ``rho**|i - j|``."""
    i = np.arange(n)
    return rho ** np.abs(i[:, None] - i[None, :])


@functools.lru_cache(maxsize=32)
def _cosine_draws(pairs: int, rho: float, terms: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded draws of the equal-weighted cosine interval's two ingredients for ``pairs``
    unit-variance AR(1) differences with lag-1 autocorrelation ``rho``: ``z0 = sqrt(n) *
    mean`` and ``ms`` = the mean square of the cosine transforms ``1 .. terms``
    (:func:`bistat.core.serial.hac_ratio`'s ``Omega``).

    Exact, not simulated series: the transforms are linear in the series, so ``(L_0, .., L_B)``
    is normal with covariance ``A R A'`` (``A`` the first ``B + 1`` rows of the orthonormal
    DCT-II, ``R`` the AR(1) correlation matrix), and :data:`POWER_DRAWS` draws of that
    ``B + 1``-vector are the interval's exact sampling distribution. With ``terms = pairs - 1``
    it is the paired t's. Kept (read-only) for the searches over ratios and pairs."""
    a = _dct(np.eye(pairs), type=2, norm="ortho", axis=0)[: terms + 1]   # [B+1, n]
    chol = np.linalg.cholesky(a @ _ar1_cov(pairs, rho) @ a.T)           # [B+1, B+1]
    rng = np.random.default_rng(POWER_SEED)
    z0, ms = np.empty(POWER_DRAWS), np.empty(POWER_DRAWS)
    for start in range(0, POWER_DRAWS, _DRAW_BLOCK):
        stop = min(start + _DRAW_BLOCK, POWER_DRAWS)
        x = rng.standard_normal((stop - start, terms + 1)) @ chol.T        # [D, B+1]
        z0[start:stop] = x[:, 0]
        ms[start:stop] = np.mean(x[:, 1:] ** 2, axis=1)
    z0.setflags(write=False)
    ms.setflags(write=False)
    return z0, ms
