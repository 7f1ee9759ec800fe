"""Design analysis of the match-rate and activation criteria: how many prompts a threshold on the
Wilson lower bound needs, how many mismatches it tolerates, the probability that it is met, and
the power of the criteria that compare the arms (Newcombe's difference, McNemar's test) (pure, no
I/O).

These are exact: they call :func:`bistat.core.proportions.wilson_interval` itself and sum over
the binomial (or multinomial) support, under the planning model that prompts match
independently, with the declared rate per arm, and the two arms independently. The throughput
ratio's design is :mod:`bistat.core.design_ratio`; :mod:`bistat.core.design` names both.
"""

from __future__ import annotations

import math

import numpy as np

from bistat.core.lazy import lazy_module
from bistat.core.proportions import MCNEMAR_EXACT_BELOW, wilson_interval
from bistat.core.validation import _confidence_level, _int_at_least, _probability

_sps = lazy_module("scipy.stats")


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
