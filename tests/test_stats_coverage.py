"""Simulation coverage of bistat.core.stats' intervals: every interval's coverage within +-1.5
points of nominal over a documented grid (fixed seeds; fast enough for CI).

Each test draws seeded samples at known parameters, computes the intervals with bistat.core.stats
and counts how often they contain the truth. Two assertions per grid:

1. **Against nominal.** Empirical coverage is within +-1.5 percentage points of the nominal level.
   Coverage of the discrete intervals (Wilson, Newcombe) oscillates with ``n`` and ``p`` and
   dips near 1 (Brown, Cai and DasGupta 2001, Statist. Sci. 16:101-133), so for them the
   +-1.5 point check is on the *average* coverage over the documented ``p`` grid, per ``n``
   (the sense in which Wilson "has average coverage equal to 1 - alpha", statsmodels
   ``proportion_confint`` notes). Welch's interval at 3 passes per arm is conservative when the
   two variances are equal (96.5 %, :func:`_welch_coverage_reference`), so for the ratio, too,
   the check is on the average over the grid of variance ratios, per number of passes.
2. **Against the exact coverage, inside a binomial acceptance band.** At every grid point the
   number of covering replicates must lie in the central ``1 - 0.001 / G`` binomial acceptance
   interval (``scipy.stats.binom.interval``, Bonferroni over the ``G`` points) for the
   replication count ``R`` at the point's *exact* coverage -- computed independently: by
   enumerating all outcomes with a closed-form Wilson/Newcombe formula written out here in numpy,
   or for the ratio by integrating over the sampling distribution of the two variances. This
   catches an implementation that is off at any single point, which the average could hide.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from bistat.core.stats import newcombe_difference, paired_ratio, throughput_ratio, wilson_interval

BAND_FALSE_ALARM = 0.001  # family-wise false-alarm rate of the acceptance bands in a test
TOLERANCE = 0.015  # +-1.5 percentage points


def _wilson_closed_form(k: np.ndarray, n: int, z: float) -> tuple[np.ndarray, np.ndarray]:
    """Wilson (1927) score interval, written out: centre +- half-width (no continuity correction)."""
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def _assert_in_binomial_band(covered: np.ndarray, exact: np.ndarray, reps: int, labels: list[str]):
    """Every count of covering replicates lies in the Bonferroni binomial acceptance band."""
    level = 1 - BAND_FALSE_ALARM / len(exact)
    # Summed pmfs can exceed 1 by a rounding error, where binom.interval returns nan.
    lo, hi = sps.binom.interval(level, reps, np.clip(exact, 0.0, 1.0))
    assert np.all(np.isfinite(lo) & np.isfinite(hi))
    bad = [
        f"{lab}: {c} of {reps} covered, band [{int(a)}, {int(b)}] at exact coverage {e:.4f}"
        for lab, c, a, b, e in zip(labels, covered, lo, hi, exact)
        if not a <= c <= b
    ]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------
# Wilson
# ------------------------------------------------------------------------------------------

#: Documented grid: n from 50 to 1000 (the published protocol used 541), p from 0.5 to 0.98 in
#: steps of 0.02 plus the region near 1 that a batch-invariance match rate lives in.
WILSON_N = (50, 100, 200, 541, 1000)
WILSON_P = np.concatenate([np.linspace(0.50, 0.98, 25), [0.99, 0.995, 0.999]])
WILSON_REPS = 2000


@pytest.mark.parametrize(
    "confidence_level, alternative, seed",
    [(0.95, "two-sided", 20240901), (0.95, "greater", 20240902), (0.99, "two-sided", 20240903)],
)
def test_wilson_coverage(confidence_level, alternative, seed):
    rng = np.random.default_rng(seed)
    alpha = 1 - confidence_level
    z = sps.norm.ppf(1 - alpha / 2 if alternative == "two-sided" else 1 - alpha)
    labels, covered, exact, mean_by_n = [], [], [], {}
    for n in WILSON_N:
        ks = np.arange(n + 1)
        cis = [wilson_interval(int(k), n, confidence_level, alternative) for k in ks]
        lows = np.array([ci.low for ci in cis])
        highs = np.array([ci.high for ci in cis])
        ref_low, ref_high = _wilson_closed_form(ks, n, z)
        if alternative == "greater":
            ref_high = np.ones_like(ref_high)
        sim = []
        for p in WILSON_P:
            k = rng.binomial(n, p, size=WILSON_REPS)
            hit = int(((lows[k] <= p) & (p <= highs[k])).sum())
            pmf = sps.binom.pmf(ks, n, p)
            exact.append(pmf[(ref_low <= p) & (p <= ref_high)].sum())
            covered.append(hit)
            sim.append(hit / WILSON_REPS)
            labels.append(f"n={n} p={p:.3f}")
        mean_by_n[n] = float(np.mean(sim))
    _assert_in_binomial_band(np.array(covered), np.array(exact), WILSON_REPS, labels)
    for n, mean in mean_by_n.items():
        assert abs(mean - confidence_level) <= TOLERANCE, (n, mean)


# ------------------------------------------------------------------------------------------
# Newcombe
# ------------------------------------------------------------------------------------------

#: Documented grid: two arms of equal size n in {100, 300}; p1 and p2 each in NEWCOMBE_P (all 25
#: pairs, equal rates included). At n = 30 with both rates near 1 the interval is very
#: conservative (coverage up to 100 %), outside the +-1.5 point goal; not in this grid.
NEWCOMBE_N = (100, 300)
NEWCOMBE_P = (0.5, 0.7, 0.9, 0.95, 0.99)
NEWCOMBE_REPS = 2000


def _newcombe_closed_form(n: int, z: float) -> tuple[np.ndarray, np.ndarray]:
    """Newcombe (1998) method 10 for every (k1, k2) with n1 = n2 = n: arrays [k1, k2]."""
    k = np.arange(n + 1)
    lo, hi = _wilson_closed_form(k, n, z)
    p = k / n
    d = p[:, None] - p[None, :]
    low = d - np.sqrt((p - lo)[:, None] ** 2 + (hi - p)[None, :] ** 2)
    high = d + np.sqrt((hi - p)[:, None] ** 2 + (p - lo)[None, :] ** 2)
    return low, high


def test_newcombe_coverage():
    rng = np.random.default_rng(20240904)
    z = sps.norm.ppf(0.975)
    labels, covered, exact, mean_by_n = [], [], [], {}
    for n in NEWCOMBE_N:
        ks = np.arange(n + 1)
        ref_low, ref_high = _newcombe_closed_form(n, z)
        cache: dict[tuple[int, int], tuple[float, float]] = {}
        sim = []
        for p1 in NEWCOMBE_P:
            for p2 in NEWCOMBE_P:
                k1 = rng.binomial(n, p1, size=NEWCOMBE_REPS)
                k2 = rng.binomial(n, p2, size=NEWCOMBE_REPS)
                pairs, inverse = np.unique(np.stack([k1, k2], axis=1), axis=0, return_inverse=True)
                bounds = np.empty((len(pairs), 2))
                for i, (a, b) in enumerate(pairs):
                    key = (int(a), int(b))
                    if key not in cache:
                        ci = newcombe_difference(key[0], n, key[1], n)
                        cache[key] = (ci.low, ci.high)
                    bounds[i] = cache[key]
                d = p1 - p2
                inv = inverse.reshape(-1)
                hit = int(((bounds[inv, 0] <= d) & (d <= bounds[inv, 1])).sum())
                weights = np.outer(sps.binom.pmf(ks, n, p1), sps.binom.pmf(ks, n, p2))
                exact.append(weights[(ref_low <= d) & (d <= ref_high)].sum())
                covered.append(hit)
                sim.append(hit / NEWCOMBE_REPS)
                labels.append(f"n={n} p1={p1} p2={p2}")
        mean_by_n[n] = float(np.mean(sim))
    _assert_in_binomial_band(np.array(covered), np.array(exact), NEWCOMBE_REPS, labels)
    for n, mean in mean_by_n.items():
        assert abs(mean - 0.95) <= TOLERANCE, (n, mean)


# ------------------------------------------------------------------------------------------
# Throughput ratio (Welch on log per-pass throughput)
# ------------------------------------------------------------------------------------------

#: Documented grid: 3, 5 and 10 passes per arm; per-pass throughput lognormal with true ratio
#: 0.90 (treatment 90 tok/s, control 100 tok/s); control CV 10 %, treatment CV 5 %, 10 % or 20 %.
RATIO_PASSES = (3, 5, 10)
RATIO_TREATMENT_CV = (0.05, 0.10, 0.20)
RATIO_CONTROL_CV = 0.10
RATIO_TRUE = 0.90
RATIO_REPS = 20_000
RATIO_CHECKED_REPS = 150  # replicates also run through throughput_ratio itself


def _sigma(cv: float) -> float:
    return math.sqrt(math.log1p(cv * cv))


def _welch_coverage_reference(n: int, sigma_t: float, sigma_c: float, level: float) -> float:
    """Exact coverage of the two-sided Welch interval for normal data, n per arm.

    Given the two sample variances, the difference of means is normal and independent of them,
    so coverage = E[2 Phi(t_{df} se / sd_D) - 1] over s_t**2, s_c**2 ~ sigma**2 chi2(n-1)/(n-1).
    The expectation is a midpoint rule on a 500 x 500 grid of chi-square quantiles.
    """
    m = 500
    q = sps.chi2.ppf((np.arange(m) + 0.5) / m, n - 1) / (n - 1)
    vt = sigma_t**2 * q[:, None] / n
    vc = sigma_c**2 * q[None, :] / n
    se = np.sqrt(vt + vc)
    df = (vt + vc) ** 2 / ((vt**2 + vc**2) / (n - 1))
    sd_d = math.sqrt((sigma_t**2 + sigma_c**2) / n)
    tq = sps.t.ppf(1 - (1 - level) / 2, df)
    return float(np.mean(2 * sps.norm.cdf(tq * se / sd_d) - 1))


def test_welch_reference_matches_one_dimensional_integral():
    # Equal variances and sizes: T = D / se is t with 2(n-1) df and independent of
    # u = s_t**2 / (s_t**2 + s_c**2) ~ Beta((n-1)/2, (n-1)/2), on which the Welch df depend:
    # df = (n-1) / (u**2 + (1-u)**2). So coverage = E_u[2 F_{2(n-1)}(t_{df(u)}) - 1] exactly.
    from scipy import integrate

    for n in RATIO_PASSES:
        a = (n - 1) / 2

        def integrand(u, n=n, a=a):
            df = (n - 1) / (u * u + (1 - u) ** 2)
            return (2 * sps.t.cdf(sps.t.ppf(0.975, df), 2 * (n - 1)) - 1) * sps.beta.pdf(u, a, a)

        exact, _ = integrate.quad(integrand, 0, 1, limit=200)
        assert _welch_coverage_reference(n, 0.1, 0.1, 0.95) == pytest.approx(exact, abs=5e-4)
    # Welch at 3 passes per arm with equal variances is conservative: 96.5 %.
    assert round(_welch_coverage_reference(3, 0.1, 0.1, 0.95), 3) == 0.965


def test_throughput_ratio_coverage():
    rng = np.random.default_rng(20240905)
    labels, covered, exact, mean_by_passes = [], [], [], {}
    sigma_c = _sigma(RATIO_CONTROL_CV)
    for n in RATIO_PASSES:
        sim = []
        for cv_t in RATIO_TREATMENT_CV:
            sigma_t = _sigma(cv_t)
            # Lognormal per-pass throughput with the given CVs; true ratio of medians (= of
            # geometric means, what the interval estimates) is RATIO_TRUE.
            t = rng.lognormal(math.log(100.0 * RATIO_TRUE), sigma_t, size=(RATIO_REPS, n))
            c = rng.lognormal(math.log(100.0), sigma_c, size=(RATIO_REPS, n))
            # Vectorised Welch interval on logs (scipy, the same call throughput_ratio makes) ...
            res = sps.ttest_ind(np.log(t), np.log(c), axis=1, equal_var=False)
            ci = res.confidence_interval(confidence_level=0.95)
            low, high = np.exp(ci.low), np.exp(ci.high)
            # ... and bistat's function gives the same intervals, replicate for replicate.
            for i in range(RATIO_CHECKED_REPS):
                one = throughput_ratio(t[i], c[i])
                assert (one.interval.low, one.interval.high) == pytest.approx(
                    (low[i], high[i]), rel=1e-12
                )
                assert one.df == pytest.approx(res.df[i], rel=1e-12)
            hit = int(((low <= RATIO_TRUE) & (RATIO_TRUE <= high)).sum())
            covered.append(hit)
            exact.append(_welch_coverage_reference(n, sigma_t, sigma_c, 0.95))
            sim.append(hit / RATIO_REPS)
            labels.append(f"passes={n} cv_t={cv_t} cv_c={RATIO_CONTROL_CV}")
        mean_by_passes[n] = float(np.mean(sim))
    _assert_in_binomial_band(np.array(covered), np.array(exact), RATIO_REPS, labels)
    for n, mean in mean_by_passes.items():
        assert abs(mean - 0.95) <= TOLERANCE, (n, mean)
    # From 5 passes per arm every grid point is within +-1.5 points on its own.
    for lab, c in zip(labels, covered):
        if not lab.startswith("passes=3 "):
            assert abs(c / RATIO_REPS - 0.95) <= TOLERANCE, (lab, c / RATIO_REPS)


def test_paired_ratio_covers_under_a_drift_common_to_both_arms_where_welch_widens():
    """bistat's ABBA schedule runs pass i of each arm side by side. A drift of the machine that
    moves both arms alike (the 2026-12-03 workload-(i) pilot: passes 8.0 s early, 9.1 s late, in
    both arms) is shared within a pair. The paired interval keeps its 95 % coverage and is
    narrower than Welch's, which stays valid but pays for the drift."""
    rng = np.random.default_rng(20261203)
    reps, true = 4000, 0.96
    for pairs, drift_sd, noise_sd in ((8, 0.05, 0.02), (16, 0.05, 0.02), (32, 0.08, 0.03)):
        drift = rng.normal(0.0, drift_sd, size=(reps, pairs))       # shared within a pair
        c = np.exp(math.log(100.0) + drift + rng.normal(0, noise_sd, size=(reps, pairs)))
        t = np.exp(math.log(100.0 * true) + drift + rng.normal(0, noise_sd, size=(reps, pairs)))
        ci = sps.ttest_rel(np.log(t), np.log(c), axis=1).confidence_interval(0.95)
        low, high = np.exp(ci.low), np.exp(ci.high)
        for i in range(50):     # bistat's function gives the same intervals, one by one
            one = paired_ratio(t[i], c[i])
            assert (one.interval.low, one.interval.high) == pytest.approx((low[i], high[i]),
                                                                          rel=1e-12)
            assert one.df == pairs - 1 and one.interval.method == "paired-log"
        cover = float(((low <= true) & (true <= high)).mean())
        assert abs(cover - 0.95) <= TOLERANCE, (pairs, cover)
        w = sps.ttest_ind(np.log(t), np.log(c), axis=1, equal_var=False).confidence_interval(0.95)
        paired_width, welch_width = float(np.mean(ci.high - ci.low)), float(np.mean(w.high - w.low))
        # independent noise sd s, shared drift sd g: the paired width goes with s, Welch's with
        # sqrt(s^2 + g^2); at g = 2.5 s Welch's interval is about 2.5 times as wide
        assert paired_width < 0.5 * welch_width, (pairs, paired_width, welch_width)
