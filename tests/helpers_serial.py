"""Serially correlated passes for the cost intervals' coverage checks (tests/test_serial*.py and
benchmarks/bench_cost_interval_coverage.py), and their exact coverage, computed independently.

The data model (docs/COST-INTERVALS.md, "Coverage by simulation"): each arm's log throughput in
pass order is a drift shared by both arms -- a Gaussian random walk, step SD ``drift_sd`` -- plus
the arm's own noise, stationary AR(1) with lag-1 autocorrelation ``rho`` and innovation SD
``noise_sd`` (independent from pass to pass at ``rho = 0``); the treatment adds ``log(ratio)``.
Pass ``i`` of each arm is pair ``i``. At ``noise_sd = 0.02``, ``drift_sd = 0.01`` and 32 pairs
this reproduces the reference Welch coverage (0.993 independent, 0.867 at ``rho = 0.5``) within
its simulation error.

The drift cancels in the pairs' log differences, which are AR(1) with the same ``rho`` and
variance ``2 noise_sd**2 / (1 - rho**2)``. So the coverage of any interval of the form ``|mean|
<= q sqrt(sum_j L_j**2 / B)`` over the cosine transforms ``L_j`` (the HAC interval; the paired t
is ``B = n - 1``) is ``P(Q >= 0)`` for the Gaussian quadratic form ``Q = (q**2 / B) sum_j L_j**2 -
L_0**2``, which Imhof's (1961) formula gives by one numerical integral -- no simulation, and no
code shared with :mod:`bistat.core.design`'s Monte Carlo of the same quantity.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import fft, integrate, linalg
from scipy import stats as sps


def correlated_arms(rng: np.random.Generator, reps: int, pairs: int, rho: float,
                    ratio: float = 0.95, noise_sd: float = 0.02, drift_sd: float = 0.01
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``reps`` runs of ``pairs`` passes per arm: (treatment, control) per-pass throughputs,
    each ``[reps, pairs]``, pass order along the last axis."""
    e = rng.standard_normal((2, reps, pairs))
    own = np.empty_like(e)
    own[..., 0] = e[..., 0] * noise_sd / math.sqrt(1.0 - rho**2)   # stationary start
    for i in range(1, pairs):
        own[..., i] = rho * own[..., i - 1] + noise_sd * e[..., i]
    drift = np.cumsum(drift_sd * rng.standard_normal((reps, pairs)), axis=1)
    return (1000.0 * np.exp(math.log(ratio) + drift + own[0]),
            1000.0 * np.exp(drift + own[1]))


def imhof_upper(weights: np.ndarray) -> float:
    """``P(sum_i w_i chi2_1 > 0)`` for independent chi-square(1) variables (Imhof 1961, eq. 3.2,
    central case, at x = 0): ``1/2 + (1/pi) int_0^inf sin(theta(u)) / (u rho(u)) du`` with
    ``theta(u) = sum_i arctan(w_i u) / 2`` and ``rho(u) = prod_i (1 + w_i**2 u**2)**(1/4)``."""
    w = np.asarray(weights, dtype=float)

    def integrand(u: float) -> float:
        if u == 0.0:
            return float(np.sum(w)) / 2.0   # the limit of sin(theta) / u
        theta = 0.5 * np.sum(np.arctan(w * u))
        return math.sin(theta) / (u * math.exp(0.25 * np.sum(np.log1p((w * u) ** 2))))

    val, _ = integrate.quad(integrand, 0.0, np.inf, limit=500, epsabs=1e-10)
    return 0.5 + val / math.pi


def exact_cosine_coverage(pairs: int, rho: float, terms: int,
                          confidence_level: float = 0.95) -> float:
    """Exact coverage of the cosine interval with ``terms`` terms (``pairs - 1``: the paired t)
    for AR(1) pair differences with lag-1 autocorrelation ``rho`` (Imhof's formula)."""
    idx = np.arange(pairs)
    corr = rho ** np.abs(idx[:, None] - idx[None, :])
    basis = fft.dct(np.eye(pairs), type=2, norm="ortho", axis=0)[: terms + 1]
    cov = basis @ corr @ basis.T                          # of (L_0, .., L_B)
    q = sps.t.ppf(1.0 - (1.0 - confidence_level) / 2.0, terms)
    form = np.diag([-1.0] + [q * q / terms] * terms)      # Q = L' form L
    root = linalg.sqrtm(cov).real
    return imhof_upper(np.linalg.eigvalsh(root @ form @ root))
