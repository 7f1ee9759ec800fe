"""Passes in pass order: their serial correlation, and a cost interval that keeps its coverage
under it (pure: no I/O, no clock, no printing).

Passes on one resident engine are not independent: the allocator, caches, clocks and host state
carry over from one pass to the next. The Welch interval (:func:`bistat.core.stats.throughput_ratio`)
and the paired t interval (:func:`bistat.core.stats.paired_ratio`) both assume they are, and their
stated coverage fails when they are not (``docs/COST-INTERVALS.md`` tabulates by how much). This
module measures the correlation and gives the interval that allows for it.

Contents
--------
- :func:`serial_correlation` -- lag-1 autocorrelation and the Ljung-Box portmanteau test of one
  series in pass order; :func:`ljung_box_lags` -- the number of lags it tests.
- :func:`log_serial_correlation` -- the same for one arm's per-pass values, on their logs.
- :func:`paired_serial_correlation` -- the same for the pairs' log differences.
- :func:`serial_diagnostics` -- all three for two arms paired pass by pass.
- :func:`lag1_bias_corrected` -- the lag-1 autocorrelation with its small-sample bias removed.
- :func:`hac_ratio` -- treatment / control from passes paired across the arms, with the
  equal-weighted cosine (EWC) interval on the log differences: robust to serial correlation.
- :func:`cosine_terms` -- how many cosine terms that interval uses for ``n`` pairs (the
  bandwidth rule, :class:`HacSpec`).

Every value is given in pass order: ``values[i]`` is the ``i``-th counted pass (for pairs, the
``i``-th pair of passes the ABBA schedule ran side by side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bistat.core.lazy import lazy_function, lazy_module
from bistat.core.rule import BANDWIDTH_RULES, HAC_KERNELS, HacSpec
from bistat.core.stat_results import Interval, RatioResult
from bistat.core.validation import _confidence_level, _int_at_least, _positive_sample

_sps = lazy_module("scipy.stats")
_dct = lazy_function("scipy.fft", "dct")
_sm_acf = lazy_function("statsmodels.tsa.stattools", "acf")
_sm_ljungbox = lazy_function("statsmodels.stats.diagnostic", "acorr_ljungbox")

__all__ = [
    "BANDWIDTH_RULES",
    "HAC_KERNELS",
    "HacRatioResult",
    "HacSpec",
    "SerialCorrelation",
    "SerialDiagnostics",
    "cosine_terms",
    "hac_ratio",
    "lag1_bias_corrected",
    "ljung_box_lags",
    "log_serial_correlation",
    "paired_serial_correlation",
    "serial_correlation",
    "serial_diagnostics",
]


# --------------------------------------------------------------------------------------------
# Result objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SerialCorrelation:
    """Result of :func:`serial_correlation`: how much one series in pass order carries over.

    Attributes
    ----------
    n : int
        Values in the series.
    lag1 : float or None
        Sample lag-1 autocorrelation, ``sum((x_t - m)(x_{t+1} - m)) / sum((x_t - m)**2)``; None
        when every value is the same (no variation to correlate).
    lag1_corrected : float or None
        ``lag1`` with its small-sample bias removed (:func:`lag1_bias_corrected`); None as
        ``lag1`` is, or with fewer than four values.
    statistic : float or None
        The Ljung-Box statistic ``Q`` over ``lags`` lags; None as ``lag1`` is.
    pvalue : float or None
        Its upper-tail p-value on ``lags`` degrees of freedom (chi-square); None as ``lag1`` is.
    lags : int
        Lags the portmanteau test sums over (:func:`ljung_box_lags`).
    method : str
        ``"ljung-box"``.
    """

    n: int
    lag1: float | None
    lag1_corrected: float | None
    statistic: float | None
    pvalue: float | None
    lags: int
    method: str = "ljung-box"

    def significant(self, alpha: float = 0.05) -> bool:
        """Whether the Ljung-Box test rejects "no serial correlation" at ``alpha``."""
        return self.pvalue is not None and self.pvalue < alpha


@dataclass(frozen=True)
class SerialDiagnostics:
    """Result of :func:`serial_diagnostics`: two arms paired pass by pass.

    Attributes
    ----------
    treatment, control : SerialCorrelation
        Each arm's log values in pass order.
    differences : SerialCorrelation
        The pairs' log differences, ``log treatment[i] - log control[i]``, in pass order: what the
        paired and the HAC interval read.
    alpha : float
        The level at which :attr:`significant` calls a Ljung-Box test significant.
    """

    treatment: SerialCorrelation
    control: SerialCorrelation
    differences: SerialCorrelation
    alpha: float = 0.05

    @property
    def significant(self) -> tuple[str, ...]:
        """The series whose Ljung-Box test rejects at ``alpha``, of ``"treatment"``,
        ``"control"``, ``"differences"``, in that order."""
        return tuple(name for name in ("treatment", "control", "differences")
                     if getattr(self, name).significant(self.alpha))


@dataclass(frozen=True)
class HacRatioResult(RatioResult):
    """Result of :func:`hac_ratio`: a :class:`~bistat.core.stats.RatioResult` (``df`` is the
    number of cosine terms ``B``, ``se`` the HAC standard error of the mean log difference,
    ``method = "hac-cosine-log"``) with the numbers that make it.

    Attributes
    ----------
    terms : int
        ``B``, the cosine terms averaged: the t distribution's degrees of freedom.
    critical_value : float
        ``t_B`` quantile at ``1 - (1 - confidence_level) / 2``.
    sd_log_diff : float
        The pairs' log differences' standard deviation (``ddof=1``): what the paired t interval
        would use.
    variance_ratio : float
        The long-run variance estimate over the plain variance of the log differences: above 1
        when the pairs are positively correlated from one to the next (the HAC standard error is
        ``sqrt(variance_ratio)`` times the paired one); nan when the differences do not vary.
    kernel : str
    bandwidth : str or int
        The declared rule (:class:`HacSpec`).
    """

    terms: int = 0
    critical_value: float = math.nan
    sd_log_diff: float = math.nan
    variance_ratio: float = math.nan
    kernel: str = "cosine"
    bandwidth: str | int = "llsw"


# --------------------------------------------------------------------------------------------
# Serial correlation
# --------------------------------------------------------------------------------------------


def ljung_box_lags(n: int) -> int:
    """Lags the Ljung-Box test of :func:`serial_correlation` sums over, for ``n`` values.

    ``min(10, n // 5)``, at least 1: ten lags for a series long enough, but no more than a fifth
    of its length, where the test loses its size and power (Hyndman and Athanasopoulos 2021,
    section 5.4). Short series -- 8 to 64 pairs of passes -- get 1 to 10 lags: 8 pairs 1, 16
    pairs 3, 32 pairs 6, 64 pairs 10.

    References
    ----------
    .. [1] R. J. Hyndman and G. Athanasopoulos, Forecasting: Principles and Practice, 3rd ed.,
           OTexts, Melbourne (2021), section 5.4, "Residual diagnostics".

    Examples
    --------
    >>> [ljung_box_lags(n) for n in (3, 8, 16, 32, 64, 200)]
    [1, 1, 3, 6, 10, 10]
    """
    n_i = _int_at_least(n, "n", 3)
    return max(1, min(10, n_i // 5))


def lag1_bias_corrected(lag1: float, n: int) -> float:
    """The sample lag-1 autocorrelation with its first-order bias removed.

    Parameters
    ----------
    lag1 : float
        The sample lag-1 autocorrelation of ``n`` values about their own mean.
    n : int
        Values, ``>= 4``.

    Returns
    -------
    float
        ``(n * lag1 + 1) / (n - 3)``, clipped to ``[-1, 1]``.

    Notes
    -----
    For a stationary AR(1) series with autocorrelation ``rho`` and unknown mean, the sample lag-1
    autocorrelation has expectation ``rho - (1 + 3 rho) / n`` to order ``1 / n`` (Kendall 1954;
    Marriott and Pope 1954): at 32 values and ``rho = 0.5`` it is about 0.42 on average. Solving
    for ``rho`` gives the correction. The design analysis plans at it
    (:func:`bistat.core.design.estimate_serial_correlation`).

    References
    ----------
    .. [1] M. G. Kendall, "Note on bias in the estimation of autocorrelation", Biometrika,
           41(3/4), pp 403-404 (1954).
    .. [2] F. H. C. Marriott and J. A. Pope, "Bias in the estimation of autocorrelations",
           Biometrika, 41(3/4), pp 390-402 (1954).

    Examples
    --------
    >>> round(lag1_bias_corrected(0.2976, 32), 4)
    0.3629
    """
    n_i = _int_at_least(n, "n", 4)
    r = float(lag1)
    if not -1.0 <= r <= 1.0:
        raise ValueError(f"lag1 must be an autocorrelation in [-1, 1], got {lag1!r}")
    return min(1.0, max(-1.0, (n_i * r + 1.0) / (n_i - 3)))


def serial_correlation(values: Sequence[float]) -> SerialCorrelation:
    """Lag-1 autocorrelation and the Ljung-Box test of one series in pass order.

    Parameters
    ----------
    values : sequence of float
        The series in pass order (finite), at least three values.

    Returns
    -------
    SerialCorrelation
        ``lag1`` from statsmodels' ``acf(values, nlags=1, fft=False)``; ``statistic`` and
        ``pvalue`` from ``acorr_ljungbox(values, lags=[ljung_box_lags(n)])``. All three None when
        every value is the same.

    Raises
    ------
    ValueError
        Fewer than three values, or a value that is not finite.

    Notes
    -----
    The lag-1 autocorrelation is the usual estimator about the series' own mean (Box and Jenkins),
    biased towards ``-1 / n`` in short series (:func:`lag1_bias_corrected`). The Ljung-Box
    statistic ``Q = n (n + 2) sum_k r_k**2 / (n - k)`` over ``k = 1 .. h`` is referred to
    chi-square with ``h`` degrees of freedom (Ljung and Box 1978); ``h`` is
    :func:`ljung_box_lags`. A small p-value says the passes are not independent: an interval that
    assumes they are (Welch's, the paired t) states a coverage it does not have.

    References
    ----------
    .. [1] G. M. Ljung and G. E. P. Box, "On a measure of lack of fit in time series models",
           Biometrika, 65(2), pp 297-303 (1978).
    .. [2] G. E. P. Box, G. M. Jenkins, G. C. Reinsel and G. M. Ljung, Time Series Analysis:
           Forecasting and Control, 5th ed., Wiley (2015), section 2.1.5.

    Examples
    --------
    >>> res = serial_correlation([1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 3.0, 2.0, 1.0, 2.0])
    >>> round(res.lag1, 4), res.lags, round(res.pvalue, 4)
    (0.6155, 2, 0.0788)
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError("values must be a one-dimensional sequence in pass order")
    if x.size < 3:
        raise ValueError(f"serial correlation needs at least 3 values in pass order, got "
                         f"{x.size}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"values must be finite, got {[float(v) for v in x[~np.isfinite(x)]]}")
    lags = ljung_box_lags(x.size)
    if np.all(x == x[0]):
        return SerialCorrelation(n=int(x.size), lag1=None, lag1_corrected=None, statistic=None,
                                 pvalue=None, lags=lags)
    lag1 = float(_sm_acf(x, nlags=1, fft=False)[1])
    lb = _sm_ljungbox(x, lags=[lags], return_df=True)
    corrected = lag1_bias_corrected(lag1, x.size) if x.size >= 4 else None
    return SerialCorrelation(n=int(x.size), lag1=lag1, lag1_corrected=corrected,
                             statistic=float(lb["lb_stat"].iloc[0]),
                             pvalue=float(lb["lb_pvalue"].iloc[0]), lags=lags)


def log_serial_correlation(values: Sequence[float]) -> SerialCorrelation:
    """:func:`serial_correlation` of one arm's per-pass values (throughput or latency, all
    ``> 0``), on their logs: the scale every cost interval works on.

    Examples
    --------
    >>> round(log_serial_correlation([100.0, 101.0, 102.0, 101.0, 100.0, 99.0]).lag1, 3)
    0.318
    """
    return serial_correlation(np.log(_positive_sample(values, "values", min_size=3)))


def _log_differences(treatment: Sequence[float], control: Sequence[float],
                     min_pairs: int) -> np.ndarray:
    if len(treatment) != len(control):
        raise ValueError(f"the arms must pair pass for pass, got {len(treatment)} (treatment) "
                         f"and {len(control)} (control) values")
    t = np.log(_positive_sample(treatment, "treatment", min_size=min_pairs))
    c = np.log(_positive_sample(control, "control", min_size=min_pairs))
    return t - c


def paired_serial_correlation(treatment: Sequence[float],
                              control: Sequence[float]) -> SerialCorrelation:
    """:func:`serial_correlation` of the pairs' log differences ``log t[i] - log c[i]``.

    ``treatment[i]`` and ``control[i]`` are the ``i``-th pair of passes (by pass index), values
    all ``> 0``, at least three pairs. A drift common to both arms cancels in the differences;
    what remains correlated is what the paired interval wrongly takes as independent.

    Examples
    --------
    >>> res = paired_serial_correlation([99.0, 98.0, 97.5, 98.5, 99.5, 99.0],
    ...                                 [100.0, 100.0, 100.0, 100.0, 100.0, 100.0])
    >>> round(res.lag1, 3)
    0.29
    """
    return serial_correlation(_log_differences(treatment, control, 3))


def serial_diagnostics(treatment: Sequence[float], control: Sequence[float],
                       alpha: float = 0.05) -> SerialDiagnostics:
    """Serial correlation of each arm's log values and of the pairs' log differences.

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass values (throughput or latency), all ``> 0``, in pass order and paired by
        position (pass ``i`` of each arm), at least three pairs.
    alpha : float, default 0.05
        Level at which a Ljung-Box test counts as significant
        (:attr:`SerialDiagnostics.significant`).

    Returns
    -------
    SerialDiagnostics

    Examples
    --------
    >>> d = serial_diagnostics([99.0, 98.0, 97.5, 98.5, 99.5, 99.0],
    ...                        [100.0, 101.0, 102.0, 101.0, 100.0, 99.0])
    >>> round(d.control.lag1, 3), d.significant
    (0.318, ())
    """
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValueError(f"alpha must be strictly between 0 and 1 (e.g. 0.05), got {alpha!r}")
    d = _log_differences(treatment, control, 3)
    return SerialDiagnostics(treatment=log_serial_correlation(treatment),
                             control=log_serial_correlation(control),
                             differences=serial_correlation(d), alpha=a)


# --------------------------------------------------------------------------------------------
# The robust interval
# --------------------------------------------------------------------------------------------


def cosine_terms(pairs: int, bandwidth: str | int = "llsw") -> int:
    """Cosine terms ``B`` the equal-weighted cosine interval averages at ``pairs`` pairs.

    Parameters
    ----------
    pairs : int
        Pairs of passes, ``>= 2``.
    bandwidth : "llsw" or int
        ``"llsw"``: ``B = max(2, floor(0.4 * pairs**(2/3)))``; an integer: that ``B``. Either is
        capped at ``pairs - 1``, where the interval is the paired t interval.

    Returns
    -------
    int

    Notes
    -----
    ``0.4 T**(2/3)`` is the rule Lazarus, Lewis, Stock and Watson (2018) recommend for the EWC
    estimator, chosen to trade size distortion against power. bistat rounds it *down* and keeps
    at least 2 terms: rounding down keeps the coverage within 1.5 points of 95 % up to a lag-1
    autocorrelation of about 0.5 from 16 pairs on, where rounding to nearest (3 terms at 16 pairs) does
    not; 1 term (t with 1 degree of freedom, critical value 12.7) gives intervals about five
    times as wide as needed. The simulation that chose this is ``docs/COST-INTERVALS.md``'s.
    Computed in integers (``1000 B**3 <= 64 pairs**2``), so no rounding error moves ``B`` at
    a cube.

    References
    ----------
    .. [1] E. Lazarus, D. J. Lewis, J. H. Stock and M. W. Watson, "HAR inference:
           recommendations for practice", Journal of Business & Economic Statistics, 36(4),
           pp 541-559 (2018).

    Examples
    --------
    >>> [cosine_terms(n) for n in (2, 3, 8, 16, 24, 32, 48, 64, 125)]
    [1, 2, 2, 2, 3, 4, 5, 6, 10]
    >>> cosine_terms(32, 3)
    3
    """
    n = _int_at_least(pairs, "pairs", 2)
    if bandwidth == "llsw":
        b = int(round(0.4 * n ** (2.0 / 3.0))) + 1
        while 1000 * b**3 > 64 * n * n:   # largest b with b <= 0.4 n^(2/3), exactly
            b -= 1
        terms = max(2, b)
    else:
        terms = HacSpec(bandwidth=bandwidth).bandwidth   # validates
    return int(min(terms, n - 1))   # type: ignore[call-overload]


def hac_ratio(treatment: Sequence[float], control: Sequence[float],
              confidence_level: float = 0.95, hac: HacSpec | None = None) -> HacRatioResult:
    """Ratio treatment / control from passes paired across the arms, with an interval robust to
    serial correlation of the pairs (equal-weighted cosine, EWC).

    Parameters
    ----------
    treatment, control : sequence of float
        Per-pass values (e.g. output tokens/s), all ``> 0``, paired by position and *in pass
        order*: ``treatment[i]`` and ``control[i]`` are the ``i``-th pair the ABBA schedule ran
        side by side. At least two pairs.
    confidence_level : float, default 0.95
        Nominal two-sided coverage.
    hac : HacSpec, optional
        Kernel and bandwidth rule; default ``HacSpec()`` (cosine, ``"llsw"``).

    Returns
    -------
    HacRatioResult
        ``ratio = exp(mean(log t - log c))`` (the paired point estimate) and the interval
        ``exp(mean +- t_B se)``.

    Raises
    ------
    ValueError
        If the arms differ in length, there are fewer than two pairs, or a value is not finite
        and positive.

    Notes
    -----
    With ``d_t`` the ``n`` log differences in pass order, the orthonormal cosine transforms
    ``L_j = sqrt(2 / n) sum_t d_t cos(pi j (t - 1/2) / n)``, ``j = 1 .. B``, are computed by
    scipy's type-II DCT (``norm="ortho"``); ``B`` is :func:`cosine_terms`. The long-run variance
    estimate is their mean square, ``Omega = sum_j L_j**2 / B``, the standard error
    ``se = sqrt(Omega / n)``, and ``(mean(d) - mu) / se`` has Student's t distribution with ``B``
    degrees of freedom (Mueller 2007; Lazarus, Lewis, Stock and Watson 2018).

    Each ``L_j`` with ``j >= 1`` is orthogonal to a constant, so the mean does not enter it. For
    independent normal differences the ``L_j`` are independent normal with the differences'
    variance, and the interval is *exact* at any ``n``. For correlated differences each ``L_j``
    estimates the spectral density at frequency ``pi j / n``; the low frequencies the interval
    averages are close to the long-run variance at frequency 0 that the mean's variance needs,
    which the paired t's ``(n - 1)`` terms, spread over all frequencies, are not. It keeps its
    coverage while the spectral density is flat over ``[0, pi B / n]``; for AR(1) differences
    with lag-1 autocorrelation ``rho`` that holds to within 1.5 points of 95 % for ``rho`` up to
    about 0.5 from 16 pairs on (``docs/COST-INTERVALS.md`` gives the table, and where it fails).

    With ``B = n - 1`` (every cosine term) ``Omega`` is the sample variance (Parseval) and the
    interval is the paired t interval of :func:`bistat.core.stats.paired_ratio`: that interval is
    this family's member that assumes no serial correlation at all.

    The same numbers are statsmodels' OLS of the transformed differences ``(L_0, .., L_B)`` on the
    transformed constant ``(sqrt(n), 0, .., 0)``: its coefficient is the mean, its standard error
    ``se``, its residual degrees of freedom ``B`` (``tests/test_serial.py`` checks both to 1e-9).

    References
    ----------
    .. [1] U. K. Mueller, "A theory of robust long-run variance estimation", Journal of
           Econometrics, 141(2), pp 1331-1352 (2007).
    .. [2] E. Lazarus, D. J. Lewis, J. H. Stock and M. W. Watson, "HAR inference:
           recommendations for practice", Journal of Business & Economic Statistics, 36(4),
           pp 541-559 (2018).
    .. [3] Y. Sun, "Heteroscedasticity and autocorrelation robust F test using orthonormal series
           variance estimator", The Econometrics Journal, 16(1), pp 1-26 (2013).

    Examples
    --------
    Eight pairs whose difference drifts slowly over the run (the treatment 2 % ahead of its ratio
    early, 2 % behind late): the long-run variance is three times the plain one, and the interval
    is wider than the paired t's 0.9556-0.9822, which takes the pairs as independent:

    >>> t = [989.6, 982.7, 987.6, 971.0, 959.4, 952.7, 957.5, 950.8]
    >>> c = [1000.0, 1003.0, 998.0, 1001.0, 999.0, 1002.0, 997.0, 1000.0]
    >>> res = hac_ratio(t, c)
    >>> res.terms, round(res.variance_ratio, 2), round(res.ratio, 4)
    (2, 3.01, 0.9688)
    >>> round(res.interval.low, 4), round(res.interval.high, 4)
    (0.9277, 1.0117)
    """
    cl = _confidence_level(confidence_level)
    spec = HacSpec() if hac is None else hac
    d = _log_differences(treatment, control, 2)
    n = int(d.size)
    terms = cosine_terms(n, spec.bandwidth)
    transformed = _dct(d, type=2, norm="ortho")          # [n]: L_0 = sqrt(n) mean, L_1 .. L_{n-1}
    omega = float(np.mean(transformed[1:terms + 1] ** 2))
    log_diff = float(d.mean())
    se = math.sqrt(omega / n)
    sd = float(d.std(ddof=1))
    q = float(_sps.t.ppf(1.0 - (1.0 - cl) / 2.0, terms))
    low, high = log_diff - q * se, log_diff + q * se
    interval = Interval(low=math.exp(low), high=math.exp(high), confidence_level=cl,
                        method="hac-cosine-log", alternative="two-sided")
    return HacRatioResult(
        ratio=math.exp(log_diff), interval=interval, df=float(terms), log_diff=log_diff, se=se,
        n_treatment=n, n_control=n, method="hac-cosine-log", terms=terms, critical_value=q,
        sd_log_diff=sd, variance_ratio=omega / sd**2 if sd > 0 else math.nan,
        kernel=spec.kernel, bandwidth=spec.bandwidth)

