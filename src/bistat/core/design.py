"""Design analysis: what a declared experiment can and cannot conclude (pure, no I/O).

Two halves, matching the two kinds of criteria in a decision rule:

- **Match rate** (Wilson lower bound against a threshold): :func:`min_prompts_for_threshold`,
  :func:`max_mismatches_tolerated`, :func:`prob_lower_bound_at_least`. These are exact: they
  call :func:`bistat.core.stats.wilson_interval` itself and the binomial distribution.
- **Throughput ratio** (Welch interval on log per-pass throughput, see
  :func:`bistat.core.stats.throughput_ratio`): :func:`expected_ratio_halfwidth`,
  :func:`expected_ratio_interval_factor` and the power functions ``power_*``.

Planning model for throughput: per-pass throughput of each arm is lognormal with the same
coefficient of variation ``cv`` in both arms, i.e. normal on the log scale with standard
deviation ``sigma = sqrt(log(1 + cv**2))`` (:func:`log_sd_from_cv`), the same convention as
:func:`bistat.core.stats.pooled_cv`. Both arms have ``passes_per_arm`` counted passes.

Activation criteria (:func:`prob_upper_bound_at_most` for ``control_diverges``,
:func:`power_mcnemar` and :func:`power_newcombe` for ``treatment_beats_control``) are computed
exactly by summing over the binomial (or multinomial) support, under the planning model that
prompts match independently, with the declared rate per arm, and the two arms independently.
The cost rule's outcomes (:func:`cost_outcome_probabilities`, :func:`passes_to_decide`) use the
Welch draws below, or, for a paired interval, the paired t's: the same mean log difference
and one ``chi2(n - 1)`` variance, ``n - 1`` degrees of freedom.

Serial correlation (the last section): passes on one engine carry over from one to the next.
:func:`estimate_serial_correlation` reads it from an earlier run's per-pass values in pass order;
a paired or HAC cost interval is planned under AR(1) pairs with that lag-1 autocorrelation
(``rho``) from the exact normal distribution of the mean and the cosine transforms the interval
uses (:func:`_cosine_draws`); :func:`interval_coverage` gives each interval's coverage there and
:func:`check_interval_assumptions` says when the earlier run contradicts the declared interval
(``docs/COST-INTERVALS.md``).

Power of the point-estimate criteria is exact (normal distribution). Power of the interval
criteria and of TOST is computed by Monte Carlo from the exact sampling distribution of the
Welch procedure's sufficient statistics -- the difference of log means
``D ~ N(log r, 2 sigma**2 / n)`` and the two sample variances ``s_i**2 ~ sigma**2 chi2(n-1) /
(n-1)``, all independent -- because the Welch interval uses an *estimated*
(Welch-Satterthwaite) degrees of freedom; a noncentral t with the nominal ``2 (n - 1)`` degrees
of freedom is badly optimistic at two or three passes per arm. The draws use a fixed seed
(:data:`POWER_SEED`) and :data:`POWER_DRAWS` replicates, so results are deterministic; the
Monte Carlo standard error is at most ``0.5 / sqrt(POWER_DRAWS)`` = 0.0011.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from bistat.core.lazy import lazy_function, lazy_module

_sps = lazy_module("scipy.stats")
_dct = lazy_function("scipy.fft", "dct")

from bistat.core.serial import HacSpec, SerialDiagnostics, cosine_terms, serial_diagnostics
from bistat.core.stats import (  # one validation for both modules
    MCNEMAR_EXACT_BELOW,
    _confidence_level,
    _int_at_least,
    _positive_sample,
    wilson_interval,
)

__all__ = [
    "COST_OUTCOMES",
    "POWER_DRAWS",
    "POWER_SEED",
    "cost_outcome_probabilities",
    "passes_to_decide",
    "power_mcnemar",
    "power_newcombe",
    "prob_upper_bound_at_most",
    "expected_ratio_halfwidth",
    "expected_ratio_interval_factor",
    "log_sd_from_cv",
    "max_mismatches_tolerated",
    "min_passes_for_power",
    "min_prompts_for_threshold",
    "power_ratio_interval_above",
    "power_ratio_interval_below",
    "power_ratio_point_at_least",
    "power_ratio_point_below",
    "power_tost",
    "prob_lower_bound_at_least",
    "welch_df_equal_variances",
]

#: Monte Carlo replicates for the interval and TOST power functions.
POWER_DRAWS = 200_000
#: Seed of the Monte Carlo draws (``numpy.random.default_rng(POWER_SEED)``).
POWER_SEED = 20_240_917


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _threshold(threshold: float) -> float:
    th = float(threshold)
    if not 0.0 < th < 1.0:
        raise ValueError(
            f"threshold must be strictly between 0 and 1 (a match rate such as 0.99), got {threshold!r}"
        )
    return th


def _lower_bound_alternative(alternative: str) -> str:
    if alternative not in ("two-sided", "greater"):
        raise ValueError(
            "a threshold on the Wilson lower bound needs alternative 'two-sided' or 'greater' "
            f"(a lower bound); got {alternative!r}"
        )
    return alternative


def _positive(value: float, name: str) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _probability(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
    return v


# --------------------------------------------------------------------------------------------
# Match rate
# --------------------------------------------------------------------------------------------


def _clears(k: int, n: int, threshold: float, confidence_level: float, alternative: str) -> bool:
    return wilson_interval(k, n, confidence_level, alternative).low >= threshold


def min_prompts_for_threshold(
    threshold: float, confidence_level: float = 0.95, alternative: str = "two-sided"
) -> int:
    """Smallest number of prompts for which a perfect match clears a Wilson lower-bound threshold.

    Parameters
    ----------
    threshold : float
        Required lower end of the Wilson interval for the match rate, ``0 < threshold < 1``.
    confidence_level : float, default 0.95
        Confidence level of the interval.
    alternative : {"two-sided", "greater"}
        Sidedness of the interval whose lower end is compared (``"greater"``: one-sided lower
        bound).

    Returns
    -------
    int
        The smallest ``n`` with ``wilson_interval(n, n).low >= threshold``.

    Notes
    -----
    For ``k = n`` the Wilson lower bound is ``n / (n + z**2)`` (``z`` the normal quantile at
    ``1 - alpha/2``, or ``1 - alpha`` one-sided), so ``n >= threshold z**2 / (1 - threshold)``
    (Wilson 1927). That closed form gives the starting point; the answer is then confirmed
    against :func:`bistat.core.stats.wilson_interval` itself so it agrees with the analysis to the
    last bit.

    References
    ----------
    .. [1] E. B. Wilson, "Probable inference, the law of succession, and statistical
           inference", Journal of the American Statistical Association, 22, pp 209-212 (1927).

    Examples
    --------
    >>> min_prompts_for_threshold(0.99)
    381
    >>> min_prompts_for_threshold(0.99, alternative="greater")
    268
    """
    th = _threshold(threshold)
    cl = _confidence_level(confidence_level)
    alt = _lower_bound_alternative(alternative)
    alpha = 1.0 - cl
    z = _sps.norm.ppf(1.0 - alpha / 2.0 if alt == "two-sided" else 1.0 - alpha)
    n = max(1, math.ceil(th * z * z / (1.0 - th)))
    while not _clears(n, n, th, cl, alt):
        n += 1
    while n > 1 and _clears(n - 1, n - 1, th, cl, alt):
        n -= 1
    return n


def max_mismatches_tolerated(
    n: int, threshold: float, confidence_level: float = 0.95, alternative: str = "two-sided"
) -> int:
    """Largest number of mismatching prompts out of ``n`` that still clears the threshold.

    Parameters
    ----------
    n : int
        Number of prompts, ``n >= 1``.
    threshold : float
        Required lower end of the Wilson interval, ``0 < threshold < 1``.
    confidence_level : float, default 0.95
    alternative : {"two-sided", "greater"}

    Returns
    -------
    int
        The largest ``m`` with ``wilson_interval(n - m, n).low >= threshold``, or ``-1`` if
        even ``n`` matches out of ``n`` do not clear it.

    Notes
    -----
    The Wilson lower bound increases with the number of successes ``k`` at fixed ``n``, so the
    answer is found by bisection over ``m`` with :func:`bistat.core.stats.wilson_interval`.

    Examples
    --------
    >>> max_mismatches_tolerated(541, 0.99)
    0
    >>> max_mismatches_tolerated(1000, 0.99)
    3
    >>> max_mismatches_tolerated(100, 0.99)
    -1
    """
    n_i = _int_at_least(n, "n", 1)
    th = _threshold(threshold)
    cl = _confidence_level(confidence_level)
    alt = _lower_bound_alternative(alternative)
    if not _clears(n_i, n_i, th, cl, alt):
        return -1
    # Invariant: m = lo mismatches clear the threshold, m = hi do not. m = n (k = 0) never
    # clears, since its lower bound is 0 < threshold.
    lo, hi = 0, n_i
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _clears(n_i - mid, n_i, th, cl, alt):
            lo = mid
        else:
            hi = mid
    return lo


def prob_lower_bound_at_least(
    n: int,
    true_rate: float,
    threshold: float,
    confidence_level: float = 0.95,
    alternative: str = "two-sided",
) -> float:
    """Probability that the Wilson lower bound clears the threshold, at a true match rate.

    Parameters
    ----------
    n : int
        Number of prompts.
    true_rate : float
        Assumed true probability that a prompt matches, ``0 <= true_rate <= 1``.
    threshold : float
        Required lower end of the Wilson interval.
    confidence_level : float, default 0.95
    alternative : {"two-sided", "greater"}

    Returns
    -------
    float
        ``P(Binomial(n, 1 - true_rate) <= max_mismatches_tolerated(n, threshold, ...))``, exactly
        (``scipy.stats.binom.cdf``); 0 if no number of mismatches is tolerated.

    Notes
    -----
    Prompts are treated as independent with a common match probability. This is the
    probability of meeting the match criterion alone; a label that also needs a throughput
    criterion has at most this probability.

    Examples
    --------
    >>> round(prob_lower_bound_at_least(541, 0.999, 0.99), 4)
    0.582
    """
    n_i = _int_at_least(n, "n", 1)
    p = _probability(true_rate, "true_rate")
    m = max_mismatches_tolerated(n_i, threshold, confidence_level, alternative)
    if m < 0:
        return 0.0
    return float(_sps.binom.cdf(m, n_i, 1.0 - p))


def _upper_alternative(alternative: str) -> str:
    if alternative not in ("two-sided", "less"):
        raise ValueError("a threshold on the Wilson upper bound needs alternative 'two-sided' or "
                         f"'less' (an upper bound); got {alternative!r}")
    return alternative


def max_matches_below_upper(n: int, threshold: float, confidence_level: float = 0.95,
                            alternative: str = "two-sided") -> int:
    """Largest number of matching prompts out of ``n`` whose Wilson upper bound is at most
    ``threshold``; ``-1`` if even 0 matches do not bring it that low.

    The upper bound increases with the matches ``k``, so the answer is found by bisection with
    :func:`bistat.core.stats.wilson_interval` itself (the analysis's own bound, to the last bit).

    Examples
    --------
    >>> max_matches_below_upper(541, 0.99)
    531
    >>> max_matches_below_upper(256, 0.99, alternative="less")
    250
    """
    n_i = _int_at_least(n, "n", 1)
    th = _probability(threshold, "threshold")
    cl = _confidence_level(confidence_level)
    alt = _upper_alternative(alternative)

    def ok(k: int) -> bool:
        return wilson_interval(k, n_i, cl, alt).high <= th

    if not ok(0):
        return -1
    if ok(n_i):
        return n_i
    lo, hi = 0, n_i            # ok(lo), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def prob_upper_bound_at_most(n: int, true_rate: float, threshold: float,
                             confidence_level: float = 0.95,
                             alternative: str = "two-sided") -> float:
    """Probability that an arm's Wilson upper bound is at most ``threshold`` (``control_diverges``).

    Parameters
    ----------
    n : int
        Prompts compared.
    true_rate : float
        The arm's assumed true match rate.
    threshold : float
        The criterion's ``at_most``.
    confidence_level : float, default 0.95
    alternative : {"two-sided", "less"}
        ``"less"``: the one-sided upper bound (a rule with ``alternative = "greater"``).

    Returns
    -------
    float
        ``P(Binomial(n, true_rate) <= max_matches_below_upper(n, threshold, ...))``, exactly.

    Examples
    --------
    >>> round(prob_upper_bound_at_most(541, 0.97, 0.99), 4)
    0.9634
    """
    n_i = _int_at_least(n, "n", 1)
    p = _probability(true_rate, "true_rate")
    k = max_matches_below_upper(n_i, threshold, confidence_level, alternative)
    if k < 0:
        return 0.0
    return float(_sps.binom.cdf(k, n_i, p))


#: Probability mass left out of the exact sums over a binomial support (both tails together).
SUPPORT_TAIL = 1e-12


def _support(n: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """The values of Binomial(n, p) outside a total tail mass of SUPPORT_TAIL, and their pmf."""
    lo = int(_sps.binom.ppf(SUPPORT_TAIL / 2, n, p)) if 0.0 < p < 1.0 else int(round(n * p))
    hi = int(_sps.binom.isf(SUPPORT_TAIL / 2, n, p)) if 0.0 < p < 1.0 else int(round(n * p))
    k = np.arange(max(lo - 1, 0), min(hi + 1, n) + 1)
    return k, _sps.binom.pmf(k, n, p)


def _wilson_bounds(k: np.ndarray, n: int, z: float) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided Wilson bounds for arrays of ``k`` (Wilson 1927), as :func:`bistat.core.stats.
    wilson_interval` computes them through statsmodels (the tests compare the two)."""
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = np.where(k == 0, 0.0, np.clip(centre - half, 0.0, 1.0))
    high = np.where(k == n, 1.0, np.clip(centre + half, 0.0, 1.0))
    return low, high


def power_newcombe(n: int, p_treatment: float, p_control: float, at_least: float,
                   confidence_level: float = 0.95) -> float:
    """Probability that Newcombe's interval of treatment - control has its lower end at least
    ``at_least`` (``treatment_beats_control`` with ``newcombe_at_least``).

    Parameters
    ----------
    n : int
        Prompts per arm.
    p_treatment, p_control : float
        The arms' assumed true match rates.
    at_least : float
        The criterion's bound on the lower end.
    confidence_level : float, default 0.95

    Returns
    -------
    float
        ``P(low >= at_least)`` with ``k_t ~ Binomial(n, p_treatment)`` and ``k_c ~
        Binomial(n, p_control)`` independent, summed exactly over their supports (up to
        :data:`SUPPORT_TAIL` of mass), with the hybrid score interval of
        :func:`bistat.core.stats.newcombe_difference` (Newcombe 1998, method 10).

    Examples
    --------
    >>> round(power_newcombe(256, 1.0, 0.965, 0.0), 3)
    0.947
    """
    n_i = _int_at_least(n, "n", 1)
    pt = _probability(p_treatment, "p_treatment")
    pc = _probability(p_control, "p_control")
    cl = _confidence_level(confidence_level)
    z = float(_sps.norm.ppf(1.0 - (1.0 - cl) / 2.0))
    kt, wt = _support(n_i, pt)
    kc, wc = _support(n_i, pc)
    lt, ut = _wilson_bounds(kt, n_i, z)
    lc, uc = _wilson_bounds(kc, n_i, z)
    p1, p2 = (kt / n_i)[:, None], (kc / n_i)[None, :]
    low = (p1 - p2) - np.sqrt((p1 - lt[:, None]) ** 2 + (uc[None, :] - p2) ** 2)
    # the same tolerance statsmodels' rounding needs: the criterion compares a float
    return float(np.sum(np.outer(wt, wc)[low >= float(at_least) - 1e-12]))


def _mcnemar_pvalues(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Two-sided McNemar p-values as :func:`bistat.core.stats.mcnemar_test` gives them: exact below
    ``MCNEMAR_EXACT_BELOW`` discordant prompts, chi-square with continuity correction above."""
    total = b + c
    exact = np.minimum(1.0, 2.0 * _sps.binom.cdf(np.minimum(b, c), total, 0.5))
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = (np.abs(b - c) - 1.0) ** 2 / total
    asym = _sps.chi2.sf(stat, 1)
    return np.where(total < MCNEMAR_EXACT_BELOW, exact, asym)


def power_mcnemar(n: int, p_treatment: float, p_control: float, alpha: float = 0.05) -> float:
    """Probability that McNemar's paired test puts the treatment ahead at ``p < alpha``
    (``treatment_beats_control`` with ``mcnemar_below``).

    Parameters
    ----------
    n : int
        Prompts paired (compared in both arms).
    p_treatment, p_control : float
        The arms' assumed true match rates.
    alpha : float, default 0.05

    Returns
    -------
    float
        ``P(p < alpha and c > b)``, ``b`` the prompts matching only in the control and ``c``
        only in the treatment, summed exactly over the multinomial support when the arms match
        independently: ``P(b) = p_c (1 - p_t)``, ``P(c) = p_t (1 - p_c)`` per prompt.

    Notes
    -----
    Real prompts are not independent across arms (a fragile prompt may diverge in both), which
    changes the discordant counts; at the rates that matter here (a treatment near 1) ``b`` is
    near 0 either way. Under ``p_t = p_c`` (an A/A experiment) this is the directional
    false-positive rate, at most about ``alpha / 2`` (exact test: conservative).

    Examples
    --------
    >>> round(power_mcnemar(256, 1.0, 0.965), 3)
    0.886
    >>> power_mcnemar(541, 0.9, 0.9) < 0.025
    True
    """
    n_i = _int_at_least(n, "n", 1)
    pt = _probability(p_treatment, "p_treatment")
    pc = _probability(p_control, "p_control")
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValueError(f"alpha must be strictly between 0 and 1, got {alpha!r}")
    qb, qc = pc * (1.0 - pt), pt * (1.0 - pc)
    if qb + qc <= 0.0:
        return 0.0   # no prompt can be discordant: p = 1
    # discordant total d ~ Binomial(n, qb + qc); given d, c ~ Binomial(d, qc / (qb + qc))
    d, wd = _support(n_i, qb + qc)
    share = qc / (qb + qc)
    total = 0.0
    for dd, w in zip(d.tolist(), wd.tolist()):
        if dd == 0 or w == 0.0:
            continue
        c = np.arange(dd + 1)
        pv = _mcnemar_pvalues(dd - c, c)
        hit = (pv < a) & (c > dd - c)
        total += w * float(np.sum(_sps.binom.pmf(c[hit], dd, share)))
    return total


# --------------------------------------------------------------------------------------------
# Throughput ratio
# --------------------------------------------------------------------------------------------


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
        interval: e.g. :attr:`SerialEstimate.rho` of an earlier run. The draws are then of the
        declared interval under that correlation (:func:`interval_coverage` gives its coverage).

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


# --------------------------------------------------------------------------------------------
# Serial correlation: estimate it from an earlier run, plan for it, check what the declared
# interval assumes
# --------------------------------------------------------------------------------------------

#: Largest lag-1 autocorrelation planned at: beyond it an AR(1) series is near a random walk,
#: whose mean no number of passes pins down.
RHO_MAX = 0.95
#: How far below nominal a declared interval's coverage may fall before the design analysis
#: says its assumptions are contradicted: bistat's coverage goal, +-1.5 points.
COVERAGE_TOLERANCE = 0.015
#: Fewest pairs of passes whose serial correlation a check of an interval's coverage is made at
#: (:func:`check_interval_assumptions`, as the design analysis and the finding call it). Below
#: it the estimate says nothing: the lag-1 autocorrelation of ``n`` values has a standard error
#: of about ``1 / sqrt(n)``, and its bias correction ``(n r + 1) / (n - 3)`` takes ``r = 0`` to
#: 1 at 4 pairs, 0.25 at 7; at 8 pairs it takes it to 0.2.
MIN_PAIRS_TO_CHECK = 8
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


def _welch_ar1_coverage(passes: int, rho: float, level: float) -> float:
    """Coverage of Welch's interval (``level`` its upper quantile) when each arm's ``passes``
    log values are AR(1) with lag-1 autocorrelation ``rho``, independent across arms; seeded
    Monte Carlo of the series themselves, :data:`POWER_DRAWS` per arm."""
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
        (:data:`POWER_DRAWS` draws, standard error about 0.0005 near 0.95).

    Notes
    -----
    The planning model: log values normal, AR(1) in pass order with lag-1 autocorrelation
    ``rho`` (stationary); for ``"paired"`` and ``"hac"`` the pairs' differences are (a drift
    common to both arms cancels in them), for ``"welch"`` each arm's values are, the arms
    independent (a common drift would widen Welch's interval further, making it conservative
    where there is drift). The coverage depends neither on the true ratio nor on the spread.
    Paired and HAC are computed exactly from the normal distribution of the mean and the cosine
    transforms (:func:`_cosine_draws`; the paired t is the cosine interval with all ``n - 1``
    terms); Welch's by drawing the series. At ``rho = 0`` the paired and the HAC interval are
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


def planning_rho(treatment, control) -> float:
    """The lag-1 autocorrelation of the pairs' log differences to plan at: bias-corrected
    (:func:`bistat.core.serial.lag1_bias_corrected`), at least 0 and at most :data:`RHO_MAX`.

    ``treatment[i]``, ``control[i]``: the ``i``-th pair in pass order, values ``> 0``. Fewer than
    four pairs, or differences that do not vary, give 0 (nothing to estimate it from). A negative
    autocorrelation narrows the mean's variance, so planning at 0 there is conservative.

    Examples
    --------
    >>> planning_rho([99.0, 98.0, 97.5], [100.0, 100.0, 100.0])
    0.0
    """
    if len(treatment) < 4:
        return 0.0
    diffs = serial_diagnostics(treatment, control).differences
    corrected = diffs.lag1_corrected
    return 0.0 if corrected is None else min(RHO_MAX, max(0.0, corrected))


@dataclass(frozen=True)
class SerialEstimate:
    """Result of :func:`estimate_serial_correlation`: an earlier run's serial correlation, as
    the design analysis plans with it.

    Attributes
    ----------
    pairs : int
        Pairs of passes (both arms' pass ``i``) it is estimated from.
    diagnostics : bistat.core.serial.SerialDiagnostics
        Lag-1 autocorrelation and Ljung-Box test of each arm's log values and of the pairs' log
        differences.
    sd_log_diff : float
        Standard deviation of the pairs' log differences.
    cv : float
        The per-arm CV that gives the pairs' log differences that spread (``sd_log_diff /
        sqrt(2)`` as a log-scale SD, :func:`log_sd_from_cv`'s convention): what
        :func:`cost_outcome_probabilities` takes for a paired or HAC interval.
    rho : float
        Lag-1 autocorrelation of the differences to plan a paired or HAC interval at
        (:func:`planning_rho`).
    rho_arms : float
        The larger of the two arms' bias-corrected lag-1 autocorrelations, within ``[0,
        RHO_MAX]``: what Welch's interval is checked at.
    """

    pairs: int
    diagnostics: SerialDiagnostics
    sd_log_diff: float
    cv: float
    rho: float
    rho_arms: float


def estimate_serial_correlation(treatment, control, alpha: float = 0.05) -> SerialEstimate:
    """Serial correlation of an earlier run's passes, for planning (``design.cv_from``).

    Parameters
    ----------
    treatment, control : sequence of float
        The earlier run's per-pass values of the metric (throughput or latency), all ``> 0``, in
        pass order and paired by pass index (``treatment[i]``, ``control[i]``: pass ``i`` of
        each arm), at least four pairs.
    alpha : float, default 0.05
        The Ljung-Box tests' level (:class:`bistat.core.serial.SerialDiagnostics`).

    Returns
    -------
    SerialEstimate

    Notes
    -----
    The sample lag-1 autocorrelation of a short series is biased low (by ``(1 + 3 rho) / n``),
    so the design plans at the corrected value: 0.30 over 32 pairs is planned as 0.36. It is
    still an estimate from one run -- at 32 pairs its standard error is about 0.15 -- so a design
    that holds only at the estimate holds with little to spare.

    Examples
    --------
    >>> est = estimate_serial_correlation([97, 98, 96, 97, 99, 96, 97, 98],
    ...                                   [100, 101, 99.5, 100.5, 101.5, 99, 100, 100.5])
    >>> est.pairs, round(est.diagnostics.differences.lag1, 3), round(est.rho, 3)
    (8, -0.035, 0.144)
    """
    if len(treatment) != len(control):
        raise ValueError(f"the arms must pair pass for pass, got {len(treatment)} (treatment) "
                         f"and {len(control)} (control) values")
    if len(treatment) < 4:
        raise ValueError(f"estimating serial correlation needs at least 4 pairs of passes, got "
                         f"{len(treatment)}")
    diag = serial_diagnostics(treatment, control, alpha)
    d = np.log(_positive_sample(treatment, "treatment")) - np.log(
        _positive_sample(control, "control"))
    sd = float(d.std(ddof=1))
    sigma = sd / math.sqrt(2.0)
    arms = [s.lag1_corrected for s in (diag.treatment, diag.control) if s.lag1_corrected is not None]
    return SerialEstimate(
        pairs=len(treatment), diagnostics=diag, sd_log_diff=sd,
        cv=math.sqrt(math.expm1(sigma**2)), rho=planning_rho(treatment, control),
        rho_arms=min(RHO_MAX, max([0.0, *arms])))


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
        larger of the arms' (Welch), bias-corrected, from :class:`SerialEstimate`.
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
    number up to ``max_pairs`` is. Found by :func:`min_passes_for_power` (the coverage rises
    with the pairs, up to the steps where the bandwidth rule adds a cosine term).

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
        The earlier run's serial correlation (:func:`estimate_serial_correlation`).
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
