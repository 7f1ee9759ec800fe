"""What serial correlation does to the cost intervals' coverage, and whether an earlier run
contradicts the declared interval (pure, no I/O): :func:`interval_coverage` gives each interval's
coverage under AR(1) passes at a lag-1 autocorrelation, :func:`pairs_to_hold` the pairs the HAC
interval needs there, and :func:`check_interval_assumptions` says when the correlation an earlier
run shows (:func:`bistat.core.design_rho.estimate_serial_correlation`) leaves the declared
interval short of its coverage (``docs/COST-INTERVALS.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bistat.core.design_ratio import (POWER_DRAWS, POWER_SEED, _DRAW_BLOCK, _ar1_cov,
                                      _cosine_draws, _rho, min_passes_for_power)
from bistat.core.design_rho import SerialEstimate
from bistat.core.lazy import lazy_module
from bistat.core.serial import HacSpec, cosine_terms
from bistat.core.validation import _confidence_level, _int_at_least

_sps = lazy_module("scipy.stats")


#: How far below nominal a declared interval's coverage may fall before the design analysis
#: says its assumptions are contradicted: bistat's coverage goal, +-1.5 points.
COVERAGE_TOLERANCE = 0.015


def _welch_ar1_coverage(passes: int, rho: float, level: float) -> float:
    """Coverage of Welch's interval (``level`` its upper quantile) when each arm's ``passes``
    log values are AR(1) with lag-1 autocorrelation ``rho``, independent across arms; seeded
    Monte Carlo of the series themselves, :data:`bistat.core.design_ratio.POWER_DRAWS` per arm."""
    chol = np.linalg.cholesky(_ar1_cov(passes, rho))
    rng = np.random.default_rng(POWER_SEED)
    covered = 0
    for start in range(0, POWER_DRAWS, _DRAW_BLOCK):
        rows = min(_DRAW_BLOCK, POWER_DRAWS - start)
        t = rng.standard_normal((rows, passes)) @ chol.T
        c = rng.standard_normal((rows, passes)) @ chol.T
        vt, vc = t.var(axis=1, ddof=1) / passes, c.var(axis=1, ddof=1) / passes
        df = (vt + vc) ** 2 / ((vt**2 + vc**2) / (passes - 1))
        half = _sps.t.ppf(level, df) * np.sqrt(vt + vc)
        covered += int(np.sum(np.abs(t.mean(axis=1) - c.mean(axis=1)) <= half))
    return covered / POWER_DRAWS


def interval_coverage(interval: str, passes: int, rho: float, confidence_level: float = 0.95,
                      hac: HacSpec | None = None) -> float:
    """Coverage of a cost interval when passes are serially correlated (AR(1) planning model).

    Parameters
    ----------
    interval : {"welch", "paired", "hac"}
        The declared interval (``[rule.cost] interval``).
    passes : int
        Counted passes per arm (paired and HAC: pairs), ``>= 2``.
    rho : float
        Lag-1 autocorrelation: of each arm's log values for ``"welch"``, of the pairs' log
        differences for ``"paired"`` and ``"hac"``.
    confidence_level : float, default 0.95
        The interval's nominal level.
    hac : bistat.core.serial.HacSpec, optional
        The HAC interval's parameters (default ``HacSpec()``); only for ``"hac"``.

    Returns
    -------
    float
        The probability that the interval contains the true ratio, by seeded Monte Carlo
        (:data:`bistat.core.design_ratio.POWER_DRAWS` draws, standard error about 0.0005 near 0.95).

    Notes
    -----
    The planning model: log values normal, AR(1) in pass order with lag-1 autocorrelation
    ``rho`` (stationary); for ``"paired"`` and ``"hac"`` the pairs' differences are (a drift
    common to both arms cancels in them), for ``"welch"`` each arm's values are, the arms
    independent (a common drift would widen Welch's interval further, making it conservative
    where there is drift). The coverage depends neither on the true ratio nor on the spread.
    Paired and HAC are computed exactly from the normal distribution of the mean and the cosine
    transforms (:func:`bistat.core.design_ratio._cosine_draws`; the paired t is the cosine
    interval with all ``n - 1`` terms); Welch's by drawing the series. At ``rho = 0`` the paired and the HAC interval are
    exact (0.95 up to the Monte Carlo error); at ``rho = 0.5`` the paired one covers about
    0.75 whatever the pairs.

    Examples
    --------
    >>> round(interval_coverage("paired", 32, 0.5), 3), round(interval_coverage("hac", 32, 0.5), 3)
    (0.744, 0.938)
    """
    if interval not in ("welch", "paired", "hac"):
        raise ValueError(f"interval must be 'welch', 'paired' or 'hac', got {interval!r}")
    n = _int_at_least(passes, "passes", 2)
    r = _rho(rho)
    level = 1.0 - (1.0 - _confidence_level(confidence_level)) / 2.0
    if interval == "welch":
        return _welch_ar1_coverage(n, r, level)
    terms = n - 1 if interval == "paired" else cosine_terms(n, (hac or HacSpec()).bandwidth)
    z0, ms = _cosine_draws(n, r, terms)
    return float(np.mean(np.abs(z0) <= float(_sps.t.ppf(level, terms)) * np.sqrt(ms)))


@dataclass(frozen=True)
class AssumptionCheck:
    """Result of :func:`check_interval_assumptions`: does the earlier run contradict what the
    declared interval assumes, and what would its coverage be?

    Attributes
    ----------
    interval : str
        ``"welch"``, ``"paired"`` or ``"hac"``.
    passes : int
        The declared counted passes per arm (pairs).
    rho : float
        The lag-1 autocorrelation checked at: of the pairs' differences (paired, HAC) or the
        larger of the arms' (Welch), bias-corrected, from
        :class:`bistat.core.design_rho.SerialEstimate`.
    coverage : float
        The declared interval's coverage at ``rho`` and ``passes`` (:func:`interval_coverage`).
    confidence_level : float
        Its nominal coverage.
    pvalue : float or None
        The earlier run's Ljung-Box p-value for the series the interval assumes independent (the
        smaller of the two arms' for Welch); None for HAC, which does not assume it, or where the
        series does not vary.
    contradicted : bool
        Paired / Welch: that Ljung-Box test rejects at the estimate's ``alpha`` -- significant
        serial correlation where the interval assumes none. HAC: ``at_risk`` (too few pairs for
        the correlation the run shows).
    at_risk : bool
        ``coverage`` is more than ``tolerance`` below nominal: at the run's estimated correlation
        the interval would not keep its stated coverage, significant or not.
    pairs_to_hold : int or None
        HAC only, when at risk: the fewest pairs (up to 200) at which its coverage at ``rho`` is
        within ``tolerance`` of nominal; None when none is (and for Welch and paired).
    tolerance : float
        :data:`COVERAGE_TOLERANCE` unless given.
    message : str or None
        One sentence for the design report when ``contradicted`` or ``at_risk``, else None.
    """

    interval: str
    passes: int
    rho: float
    coverage: float
    confidence_level: float
    pvalue: float | None
    contradicted: bool
    at_risk: bool
    pairs_to_hold: int | None
    tolerance: float
    message: str | None


def pairs_to_hold(rho: float, confidence_level: float = 0.95, hac: HacSpec | None = None,
                  tolerance: float = COVERAGE_TOLERANCE, max_pairs: int = 200,
                  start: int | None = None) -> int | None:
    """Fewest pairs at which the HAC interval's coverage at lag-1 autocorrelation ``rho`` is
    within ``tolerance`` of ``confidence_level`` (:func:`interval_coverage`); None when no
    number up to ``max_pairs`` is. Found by
    :func:`bistat.core.design_ratio.min_passes_for_power` (the coverage rises with the pairs, up
    to the steps where the bandwidth rule adds a cosine term).

    Examples
    --------
    >>> pairs_to_hold(0.5), pairs_to_hold(0.3)
    (14, 7)
    """
    target = _confidence_level(confidence_level) - float(tolerance)
    return min_passes_for_power(
        lambda n: interval_coverage("hac", n, rho, confidence_level, hac), target, max_pairs,
        start=start)


def check_interval_assumptions(interval: str, passes: int, estimate: SerialEstimate,
                               confidence_level: float = 0.95, hac: HacSpec | None = None,
                               tolerance: float = COVERAGE_TOLERANCE) -> AssumptionCheck:
    """Whether an earlier run's passes contradict what the declared cost interval assumes.

    Parameters
    ----------
    interval : {"welch", "paired", "hac"}
        The declared ``[rule.cost] interval``.
    passes : int
        The declared counted passes per arm (``workload.passes``).
    estimate : SerialEstimate
        The earlier run's serial correlation
        (:func:`bistat.core.design_rho.estimate_serial_correlation`).
    confidence_level : float, default 0.95
        The cost rule's level.
    hac : bistat.core.serial.HacSpec, optional
        The declared HAC parameters (``interval = "hac"``).
    tolerance : float, default :data:`COVERAGE_TOLERANCE`

    Returns
    -------
    AssumptionCheck

    Notes
    -----
    Welch's interval assumes each arm's passes independent, the paired one the pairs' log
    differences. Either is *contradicted* when the earlier run's Ljung-Box test of that series
    rejects (:class:`bistat.core.serial.SerialCorrelation`), and *at risk* when its coverage at the
    run's bias-corrected lag-1 autocorrelation falls more than ``tolerance`` below nominal: the
    paired interval does already at a lag-1 autocorrelation of about 0.05, which one run of 32
    pairs cannot tell from 0, so "at risk" without "contradicted" is common and is said as such.
    The HAC interval allows for the correlation, but only up to a point that depends on the pairs
    (``docs/COST-INTERVALS.md``): it is contradicted when its coverage at the run's correlation
    and the declared pairs falls more than ``tolerance`` below nominal, and the check says how
    many pairs would keep it (:func:`pairs_to_hold`). Coverage is the planning model's
    (:func:`interval_coverage`).

    Examples
    --------
    >>> import math
    >>> from bistat.core.design_rho import estimate_serial_correlation
    >>> c = [100 * math.exp(0.02 * math.sin(i / 3)) for i in range(16)]
    >>> t = [0.95 * v * math.exp(0.01 * math.cos(i / 2)) for i, v in enumerate(c)]
    >>> est = estimate_serial_correlation(t, c)
    >>> check = check_interval_assumptions("paired", 16, est)
    >>> check.contradicted, check.at_risk, round(check.coverage, 2)
    (True, True, 0.21)
    """
    n = _int_at_least(passes, "passes", 2)
    cl = _confidence_level(confidence_level)
    diag = estimate.diagnostics
    pct = f"{cl * 100:g} %"
    if interval == "hac":
        spec = HacSpec() if hac is None else hac
        rho = estimate.rho
        coverage = interval_coverage("hac", n, rho, cl, spec)
        at_risk = coverage < cl - tolerance
        hold = pairs_to_hold(rho, cl, spec, tolerance, start=n) if at_risk else None
        more = (f"about {hold} pairs would keep it within {tolerance * 100:g} points"
                if hold is not None else "no number of pairs up to 200 would keep it")
        message = None if not at_risk else (
            f"the earlier run's pairs of passes are serially correlated (lag-1 autocorrelation of "
            f"their log differences {diag.differences.lag1:.2f}, planned at {rho:.2f}): at "
            f"{n} pairs the HAC interval's stated {pct} covers about {coverage * 100:.0f} %; "
            f"{more}")
        return AssumptionCheck("hac", n, rho, coverage, cl, None, at_risk, at_risk, hold,
                               tolerance, message)
    if interval == "paired":
        rho, series = estimate.rho, [("pair differences", diag.differences)]
        assumes, unit = "the pairs of passes", "pairs"
    elif interval == "welch":
        rho, series = estimate.rho_arms, [("treatment", diag.treatment),
                                          ("control", diag.control)]
        assumes, unit = "each arm's passes", "passes per arm"
    else:
        raise ValueError(f"interval must be 'welch', 'paired' or 'hac', got {interval!r}")
    coverage = interval_coverage(interval, n, rho, cl)
    tested = [(name, s) for name, s in series if s.pvalue is not None]
    pvalue = min((s.pvalue for _, s in tested), default=None)
    contradicted = any(s.significant(diag.alpha) for _, s in tested)
    at_risk = coverage < cl - tolerance
    message = None
    if contradicted or at_risk:
        seen = "; ".join(f"{name} {s.lag1:.2f} (Ljung-Box p = {s.pvalue:.3g} over {s.lags} lags)"
                         for name, s in tested)
        verdict = ("significant" if contradicted else
                   f"not significant at {diag.alpha:g}, but if that is the correlation")
        message = (f"the {interval} interval assumes {assumes} independent; the earlier run's "
                   f"lag-1 autocorrelation: {seen}, {verdict}: at {rho:.2f} (bias-corrected) and "
                   f"{n} {unit} its stated {pct} covers about {coverage * 100:.0f} %; "
                   "[rule.cost] interval = \"hac\" allows for it")
    return AssumptionCheck(interval, n, rho, coverage, cl, pvalue, contradicted, at_risk, None,
                           tolerance, message)
