"""The serial correlation a design plans at, estimated from an earlier run's passes in pass order
(``design.cv_from``): the bias-corrected lag-1 autocorrelation of the pairs' log differences, and
the per-arm CV their spread implies (pure, no I/O). Passes on one engine carry over from one to
the next; :mod:`bistat.core.design_coverage` says what that does to each cost interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bistat.core.serial import SerialDiagnostics, serial_diagnostics
from bistat.core.validation import _positive_sample


#: Largest lag-1 autocorrelation planned at: beyond it an AR(1) series is near a random walk,
#: whose mean no number of passes pins down.
RHO_MAX = 0.95
#: Fewest pairs of passes whose serial correlation a check of an interval's coverage is made at
#: (:func:`bistat.core.design_coverage.check_interval_assumptions`, as the design analysis and
#: the finding call it). Below it the estimate says nothing: the lag-1 autocorrelation of ``n``
#: values has a standard error of about ``1 / sqrt(n)``, and its bias correction ``(n r + 1) /
#: (n - 3)`` takes ``r = 0`` to 1 at 4 pairs, 0.25 at 7; at 8 pairs it takes it to 0.2.
MIN_PAIRS_TO_CHECK = 8


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
        sqrt(2)`` as a log-scale SD, :func:`bistat.core.design_ratio.log_sd_from_cv`'s
        convention): what :func:`bistat.core.design_ratio.cost_outcome_probabilities` takes for a
        paired or HAC interval.
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
        schedule order and paired as the classifier pairs them (``treatment[i]``,
        ``control[i]``: the ``i``-th pair, :func:`bistat.core.pairing.pass_pairs`), at least four
        pairs.
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
