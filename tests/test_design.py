"""bistat.core.design against brute force (scans with wilson_interval) and seeded simulation."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from scipy import stats as sps

import bistat.core.design as bd
from bistat.core.design import (
    POWER_DRAWS,
    expected_ratio_halfwidth,
    expected_ratio_interval_factor,
    log_sd_from_cv,
    max_mismatches_tolerated,
    min_passes_for_power,
    min_prompts_for_threshold,
    power_ratio_interval_above,
    power_ratio_interval_below,
    power_ratio_point_at_least,
    power_ratio_point_below,
    power_tost,
    prob_lower_bound_at_least,
)
from bistat.core.stats import throughput_ratio, wilson_interval


def test_docstring_examples():
    """Every example of the design analysis's parts (bistat.core.design names them)."""
    from bistat.core import design_coverage, design_match, design_ratio, design_rho

    results = [doctest.testmod(m) for m in (design_match, design_ratio, design_rho,
                                            design_coverage)]
    assert sum(r.attempted for r in results) >= 15
    assert [r.failed for r in results] == [0, 0, 0, 0]


# ------------------------------------------------------------------------------------------
# Match-rate design against brute force
# ------------------------------------------------------------------------------------------


def _brute_min_prompts(threshold, confidence_level, alternative):
    n = 1
    while wilson_interval(n, n, confidence_level, alternative).low < threshold:
        n += 1
    return n


@pytest.mark.parametrize(
    "threshold, confidence_level, alternative",
    [
        (0.5, 0.95, "two-sided"),
        (0.9, 0.95, "two-sided"),
        (0.95, 0.95, "greater"),
        (0.99, 0.95, "two-sided"),
        (0.99, 0.95, "greater"),
        (0.99, 0.99, "two-sided"),
        (0.995, 0.90, "two-sided"),
    ],
)
def test_min_prompts_against_scan(threshold, confidence_level, alternative):
    got = min_prompts_for_threshold(threshold, confidence_level, alternative)
    assert got == _brute_min_prompts(threshold, confidence_level, alternative)


def test_min_prompts_published_rule():
    # 95 % two-sided Wilson lower bound >= 0.99: 381 perfect matches suffice, 380 do not; the
    # published protocol's 541 prompts clear it only with zero mismatches.
    assert min_prompts_for_threshold(0.99) == 381
    assert wilson_interval(381, 381).low >= 0.99 > wilson_interval(380, 380).low
    assert max_mismatches_tolerated(541, 0.99) == 0


@pytest.mark.parametrize("n", [1, 50, 381, 541, 1000, 2500])
@pytest.mark.parametrize("threshold, alternative", [(0.99, "two-sided"), (0.95, "greater"), (0.8, "two-sided")])
def test_max_mismatches_against_scan(n, threshold, alternative):
    expected = -1
    for m in range(n + 1):
        if wilson_interval(n - m, n, 0.95, alternative).low >= threshold:
            expected = m
        else:
            break
    assert max_mismatches_tolerated(n, threshold, alternative=alternative) == expected


def test_prob_lower_bound_exact_and_simulated():
    n, rate, threshold = 1000, 0.998, 0.99
    m = max_mismatches_tolerated(n, threshold)
    exact = sum(sps.binom.pmf(j, n, 1 - rate) for j in range(m + 1))
    got = prob_lower_bound_at_least(n, rate, threshold)
    assert got == pytest.approx(exact, rel=1e-12)
    # Simulation with the real interval: draw match counts, compute the lower bound, count.
    rng = np.random.default_rng(31)
    reps = 20_000
    k = rng.binomial(n, rate, size=reps)
    lows = {int(v): wilson_interval(int(v), n).low for v in np.unique(k)}
    hits = sum(lows[int(v)] >= threshold for v in k)
    lo, hi = sps.binom.interval(0.999, reps, got)
    assert lo <= hits <= hi


def test_prob_lower_bound_edges():
    assert prob_lower_bound_at_least(100, 1.0, 0.99) == 0.0  # 100 prompts can never clear 0.99
    assert prob_lower_bound_at_least(541, 1.0, 0.99) == 1.0
    assert prob_lower_bound_at_least(541, 0.0, 0.99) == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: min_prompts_for_threshold(1.0),
         "threshold must be strictly between 0 and 1 (a match rate such as 0.99), got 1.0"),
        (lambda: min_prompts_for_threshold(0.99, alternative="less"),
         "a threshold on the Wilson lower bound needs alternative 'two-sided' or 'greater' "
         "(a lower bound); got 'less'"),
        (lambda: max_mismatches_tolerated(0, 0.99), "n must be >= 1, got 0"),
        (lambda: prob_lower_bound_at_least(10, 1.5, 0.9), "true_rate must be between 0 and 1, got 1.5"),
        (lambda: expected_ratio_halfwidth(1, 0.1), "passes_per_arm must be >= 2, got 1"),
        (lambda: expected_ratio_halfwidth(3, 0.0), "cv must be a finite number > 0, got 0.0"),
        (lambda: power_ratio_interval_below(0.0, 0.9, 3, 0.1), "bound must be a finite number > 0, got 0.0"),
        (lambda: power_tost(1.05, 0.95, 1.0, 3, 0.1),
         "equivalence margins must satisfy low < high, got low=1.05, high=0.95"),
    ],
)
def test_design_errors(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value) == message


# ------------------------------------------------------------------------------------------
# Ratio interval width
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, cv", [(2, 0.10), (3, 0.05), (5, 0.10), (10, 0.20)])
def test_expected_halfwidth_is_the_interval_at_sd_sigma(n, cv):
    # Build passes whose log-scale sample sd is exactly sigma in both arms: then
    # throughput_ratio's interval has log half-width expected_ratio_halfwidth.
    sigma = log_sd_from_cv(cv)
    base = np.arange(n) - (n - 1) / 2
    base = base / base.std(ddof=1) * sigma
    t = np.exp(math.log(90.0) + base)
    c = np.exp(math.log(100.0) + base[::-1])
    res = throughput_ratio(t, c)
    half = math.log(res.interval.high / res.interval.low) / 2
    assert res.df == pytest.approx(2 * (n - 1), rel=1e-12)
    assert expected_ratio_halfwidth(n, cv) == pytest.approx(half, rel=1e-10)
    assert expected_ratio_interval_factor(n, cv) == pytest.approx(res.interval.high / res.ratio, rel=1e-10)


def test_log_sd_from_cv_inverts_pooled_cv_convention():
    for cv in (0.01, 0.1, 0.5):
        s = log_sd_from_cv(cv)
        assert math.sqrt(math.expm1(s * s)) == pytest.approx(cv, rel=1e-12)


# ------------------------------------------------------------------------------------------
# Power against seeded simulation of whole experiments
# ------------------------------------------------------------------------------------------

SIM_REPS = 20_000


def _simulate(true_ratio, n, cv, seed, level):
    """Lognormal per-pass throughput for both arms; Welch interval on logs, vectorised (the
    scipy call that bistat.core.stats.throughput_ratio makes, checked against it replicate by
    replicate in tests/test_stats_coverage.py)."""
    rng = np.random.default_rng(seed)
    sigma = log_sd_from_cv(cv)
    t = rng.normal(math.log(100.0 * true_ratio), sigma, size=(SIM_REPS, n))
    c = rng.normal(math.log(100.0), sigma, size=(SIM_REPS, n))
    res = sps.ttest_ind(t, c, axis=1, equal_var=False)
    ci = res.confidence_interval(confidence_level=level)
    point = t.mean(axis=1) - c.mean(axis=1)
    # spot-check: the same numbers as bistat.core.stats.throughput_ratio
    one = throughput_ratio(np.exp(t[0]), np.exp(c[0]), confidence_level=level)
    assert one.interval.low == pytest.approx(math.exp(ci.low[0]), rel=1e-12)
    return point, ci.low, ci.high


# Each case: design value vs the simulated frequency; the band allows the simulation's binomial
# error and the design's own Monte Carlo error (both at most 0.5 / sqrt(draws)), at a
# family-wise 0.1 % over the cases.
CASES = [
    # (criterion, bound(s), true_ratio, passes, cv, seed)
    ("interval_below", 1.0, 0.90, 2, 0.10, 1),
    ("interval_below", 1.0, 0.90, 5, 0.10, 2),
    ("interval_below", 0.95, 0.85, 10, 0.05, 3),
    ("interval_below", 1.0, 1.0, 3, 0.10, 4),
    ("interval_above", 0.90, 1.0, 5, 0.05, 5),
    ("interval_above", 0.95, 1.0, 3, 0.02, 6),
    ("point_below", 0.90, 0.88, 3, 0.05, 7),
    ("point_at_least", 0.95, 0.97, 4, 0.05, 8),
    ("tost", (0.95, 1.05), 1.0, 10, 0.05, 9),
    ("tost", (0.90, 1.10), 0.97, 5, 0.05, 10),
    ("tost", (0.95, 1.05), 1.06, 10, 0.03, 11),
]


@pytest.mark.parametrize("criterion, bound, true_ratio, n, cv, seed", CASES)
def test_power_against_simulation(criterion, bound, true_ratio, n, cv, seed):
    if criterion == "tost":
        low, high = bound
        design = power_tost(low, high, true_ratio, n, cv, alpha=0.05)
        # TOST at alpha = the 1 - 2 alpha Welch interval inside the margins (Schuirmann 1987;
        # checked against tost_ratio in tests/test_stats.py).
        point, lo, hi = _simulate(true_ratio, n, cv, seed, level=0.90)
        hits = np.mean((lo > math.log(low)) & (hi < math.log(high)))
    else:
        point, lo, hi = _simulate(true_ratio, n, cv, seed, level=0.95)
        if criterion == "interval_below":
            design = power_ratio_interval_below(bound, true_ratio, n, cv)
            hits = np.mean(hi < math.log(bound))
        elif criterion == "interval_above":
            design = power_ratio_interval_above(bound, true_ratio, n, cv)
            hits = np.mean(lo >= math.log(bound))
        elif criterion == "point_below":
            design = power_ratio_point_below(bound, true_ratio, n, cv)
            hits = np.mean(point < math.log(bound))
        else:
            design = power_ratio_point_at_least(bound, true_ratio, n, cv)
            hits = np.mean(point >= math.log(bound))
    z = sps.norm.isf(0.001 / len(CASES) / 2)
    se = math.sqrt(max(design * (1 - design), 1e-4) * (1 / SIM_REPS + 1 / POWER_DRAWS))
    assert abs(hits - design) <= z * se, (design, hits)


def test_two_passes_at_ten_percent_cv_cannot_tell_090_from_100():
    # Two passes per arm at 10 % CV cannot tell 0.90 from 1.00.
    slower = power_ratio_interval_below(1.0, 0.90, passes_per_arm=2, cv=0.10)
    assert slower < 0.10
    # The interval is enormous: 0.90 would be reported as about 0.59 .. 1.38.
    assert expected_ratio_interval_factor(2, 0.10) > 1.5
    # Enough passes do tell them apart; the false-positive rate at a true 1.00 stays <= 2.5 %.
    n80 = min_passes_for_power(lambda n: power_ratio_interval_below(1.0, 0.90, n, 0.10))
    assert n80 is not None and 10 < n80 <= 40
    assert power_ratio_interval_below(1.0, 0.90, n80, 0.10) >= 0.80
    assert power_ratio_interval_below(1.0, 0.90, n80 - 1, 0.10) < 0.80
    assert power_ratio_interval_below(1.0, 1.0, n80, 0.10) <= 0.025 + 0.004


def test_power_is_deterministic():
    a = power_tost(0.95, 1.05, 1.0, 6, 0.05)
    assert a == power_tost(0.95, 1.05, 1.0, 6, 0.05)
    assert power_ratio_interval_above(0.9, 1.0, 4, 0.1) == power_ratio_interval_above(0.9, 1.0, 4, 0.1)


def test_point_power_closed_form():
    sigma = log_sd_from_cv(0.08)
    z = (math.log(0.9) - math.log(0.85)) / (sigma * math.sqrt(2 / 6))
    assert power_ratio_point_below(0.9, 0.85, 6, 0.08) == pytest.approx(sps.norm.cdf(z), rel=1e-12)
    assert power_ratio_point_at_least(0.9, 0.85, 6, 0.08) == pytest.approx(sps.norm.sf(z), rel=1e-12)


def test_min_passes_for_power_scan():
    def power(n):
        return power_ratio_point_below(0.95, 0.90, n, 0.10)

    got = min_passes_for_power(power, target=0.9)
    expected = next(n for n in range(2, 200) if power(n) >= 0.9)
    assert got == expected
    assert min_passes_for_power(lambda n: 0.0, max_passes=20) is None
    assert min_passes_for_power(lambda n: 1.0) == 2
