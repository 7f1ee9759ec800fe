"""bistat.core.stats against published values, libraries' reference values, and its error messages."""

from __future__ import annotations

import dataclasses
import doctest
import math

import numpy as np
import pytest
from scipy import stats as sps

import bistat.core.stats as bs
from bistat.core.stats import (
    Interval,
    intervals_overlap,
    match_fraction,
    mcnemar_test,
    newcombe_difference,
    pooled_cv,
    throughput_ratio,
    tost_ratio,
    wilson_interval,
)


def test_docstring_examples():
    """Every example of the statistics core's parts (bistat.core.stats names them)."""
    from bistat.core import proportions, stat_results, throughput

    results = [doctest.testmod(m, optionflags=doctest.NORMALIZE_WHITESPACE)
               for m in (proportions, throughput, stat_results)]
    assert sum(r.attempted for r in results) >= 10
    assert [r.failed for r in results] == [0, 0, 0]


# ------------------------------------------------------------------------------------------
# Wilson
# ------------------------------------------------------------------------------------------


def test_wilson_published_protocol_values():
    # The published rule's figures: 541/541 -> 99.3-100 %, 78/541 -> 11.7-17.6 %.
    ci = wilson_interval(541, 541)
    assert (round(ci.low * 100, 1), round(ci.high * 100, 1)) == (99.3, 100.0)
    assert ci.high == 1.0
    ci = wilson_interval(78, 541)
    assert (round(ci.low * 100, 1), round(ci.high * 100, 1)) == (11.7, 17.6)
    assert ci == Interval(ci.low, ci.high, 0.95, "wilson", "two-sided")


# Expected values from R's binom package, as committed in statsmodels
# (statsmodels/stats/tests/results/results_proportion.py, the "wilson" column):
#   > bci = binom.confint(x = c(18), n = 20, tol = 1e-8)   (and x = 4, n = 20; x = 4, n = 200;
#   x = 190, n = 200; x = 1, n = 30)
@pytest.mark.parametrize(
    "k, n, low, high",
    [
        (18, 20, 0.6989663547715128, 0.972133518786232),
        (4, 20, 0.0806576625797981, 0.4160174322518935),
        (4, 200, 0.00780442641634947, 0.05028708690582643),
        (190, 200, 0.910421851861224, 0.972617354399236),
        (1, 30, 5.908590e-03, 0.16670391),
    ],
)
def test_wilson_matches_r_binom_confint(k, n, low, high):
    ci = wilson_interval(k, n)
    assert ci.low == pytest.approx(low, rel=1e-6)
    assert ci.high == pytest.approx(high, rel=1e-6)


# Expected values from R 3.6.2, prop.test(k, 10, alternative=ALT, conf.level=CL, correct=FALSE)
# $conf.int, as committed in scipy (scipy/stats/tests/test_morestats.py,
# TestBinomTest.test_ci_wilson_method). Covers k = 0, k = n and both one-sided forms.
@pytest.mark.parametrize(
    "k, alternative, cl, low, high",
    [
        (3, "two-sided", 0.95, 0.1077913, 0.6032219),
        (3, "two-sided", 0.99, 0.07956632, 0.6799753),
        (3, "less", 0.95, 0.0, 0.5583002),
        (3, "less", 0.99, 0.0, 0.6507187),
        (3, "greater", 0.95, 0.1268766, 1.0),
        (3, "greater", 0.99, 0.08974147, 1.0),
        (0, "two-sided", 0.95, 0.0, 0.2775328),
        (0, "less", 0.95, 0.0, 0.212942),
        (0, "greater", 0.95, 0.0, 1.0),
        (10, "two-sided", 0.95, 0.7224672, 1.0),
        (10, "less", 0.95, 0.0, 1.0),
        (10, "greater", 0.95, 0.787058, 1.0),
    ],
)
def test_wilson_matches_r_prop_test(k, alternative, cl, low, high):
    ci = wilson_interval(k, 10, confidence_level=cl, alternative=alternative)
    assert ci.low == pytest.approx(low, rel=1e-6, abs=1e-12)
    assert ci.high == pytest.approx(high, rel=1e-6, abs=1e-12)
    assert ci.alternative == alternative
    assert ci.confidence_level == cl


def test_wilson_all_n_lower_bound_closed_form():
    # For k = n the lower end is n / (n + z**2) (Wilson 1927).
    z = sps.norm.ppf(0.975)
    for n in (1, 7, 381, 541, 10_000):
        ci = wilson_interval(n, n)
        assert ci.low == pytest.approx(n / (n + z * z), rel=1e-12)
        assert ci.high == 1.0
        assert wilson_interval(0, n).low == 0.0


def test_wilson_one_sided_is_two_sided_at_double_alpha():
    two = wilson_interval(530, 541, confidence_level=0.90)
    one = wilson_interval(530, 541, confidence_level=0.95, alternative="greater")
    assert one.low == two.low
    assert one.high == 1.0
    up = wilson_interval(530, 541, confidence_level=0.95, alternative="less")
    assert (up.low, up.high) == (0.0, two.high)


def test_wilson_is_not_statsmodels_default_method():
    # statsmodels' default method is "normal" (Wald); ours must differ from it.
    from statsmodels.stats.proportion import proportion_confint

    wald = proportion_confint(78, 541, alpha=0.05)
    ci = wilson_interval(78, 541)
    assert abs(ci.low - wald[0]) > 1e-3


def test_wilson_accepts_numpy_integers():
    assert wilson_interval(np.int64(78), np.int32(541)) == wilson_interval(78, 541)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 0), {}, "n must be >= 1 (no prompts means no match rate), got 0"),
        ((5, 4), {}, "k must be <= n, got k=5 > n=4"),
        ((-1, 4), {}, "k must be >= 0, got -1"),
        ((1.0, 4), {}, "k must be an integer count, got 1.0"),
        ((True, 4), {}, "k must be an integer count, got the boolean True"),
        ((1, 4), {"confidence_level": 95}, "confidence_level must be strictly between 0 and 1 (e.g. 0.95), got 95"),
        ((1, 4), {"alternative": "upper"},
         "alternative must be one of 'two-sided', 'greater', 'less'; got 'upper'"),
    ],
)
def test_wilson_errors(args, kwargs, message):
    with pytest.raises(ValueError) as exc:
        wilson_interval(*args, **kwargs)
    assert str(exc.value) == message


def test_match_fraction():
    assert match_fraction(78, 541) == 78 / 541
    assert match_fraction(0, 3) == 0.0
    with pytest.raises(ValueError, match=r"^n must be >= 1"):
        match_fraction(0, 0)


def test_interval_is_frozen_and_contains():
    ci = wilson_interval(78, 541)
    assert ci.contains(0.15) and not ci.contains(0.2)
    assert ci.contains(ci.low) and ci.contains(ci.high)
    assert ci.width == pytest.approx(ci.high - ci.low)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ci.low = 0.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------------
# Newcombe
# ------------------------------------------------------------------------------------------


# Newcombe RG (1998), "Interval estimation for the difference between independent proportions:
# comparison of eleven methods", Statistics in Medicine 17:873-890, Table II, method 10 (score,
# no continuity correction), examples (a), (b), (d)-(h); four decimals as published.
@pytest.mark.parametrize(
    "k1, n1, k2, n2, low, high",
    [
        (56, 70, 48, 80, 0.0524, 0.3339),
        (9, 10, 3, 10, 0.1705, 0.8090),
        (5, 56, 0, 29, -0.0381, 0.1926),
        (0, 10, 0, 20, -0.1611, 0.2775),
        (0, 10, 0, 10, -0.2775, 0.2775),
        (10, 10, 0, 20, 0.6791, 1.0000),
        (10, 10, 0, 10, 0.6075, 1.0000),
    ],
)
def test_newcombe_table_ii(k1, n1, k2, n2, low, high):
    ci = newcombe_difference(k1, n1, k2, n2)
    assert (round(ci.low, 4), round(ci.high, 4)) == (low, high)
    assert ci.method == "newcombe-hybrid-score"


def test_newcombe_fagerland_example():
    # Fagerland, Lydersen and Laake (2015), Stat Methods Med Res 24:224-254, Table for 7/34 vs
    # 1/34: "Newcombe hybrid score 0.019 0.34" (as committed in statsmodels'
    # test_proportion.py::test_confint_2indep).
    ci = newcombe_difference(7, 34, 1, 34)
    assert (round(ci.low, 3), round(ci.high, 2)) == (0.019, 0.34)


def test_newcombe_sign_convention_and_square_and_add():
    # The interval is for p1 - p2: swapping the samples negates it.
    a = newcombe_difference(56, 70, 48, 80)
    b = newcombe_difference(48, 80, 56, 70)
    assert (b.low, b.high) == pytest.approx((-a.high, -a.low), abs=1e-12)
    # Method 10 written out (Newcombe 1998, eq. for method 10) from our own Wilson intervals.
    w1, w2 = wilson_interval(56, 70), wilson_interval(48, 80)
    p1, p2 = 56 / 70, 48 / 80
    low = p1 - p2 - math.hypot(p1 - w1.low, w2.high - p2)
    high = p1 - p2 + math.hypot(w1.high - p1, p2 - w2.low)
    assert (a.low, a.high) == pytest.approx((low, high), abs=1e-12)


def test_newcombe_errors():
    with pytest.raises(ValueError) as exc:
        newcombe_difference(3, 2, 1, 2)
    assert str(exc.value) == "k1 must be <= n1, got k1=3 > n1=2"
    with pytest.raises(ValueError) as exc:
        newcombe_difference(1, 2, 0, 0)
    assert str(exc.value) == "n2 must be >= 1 (no prompts means no match rate), got 0"


# ------------------------------------------------------------------------------------------
# Overlap
# ------------------------------------------------------------------------------------------


def test_intervals_overlap():
    a = Interval(0.1, 0.2, 0.95, "wilson")
    assert intervals_overlap(a, Interval(0.15, 0.3, 0.95, "wilson"))
    assert intervals_overlap(a, Interval(0.2, 0.3, 0.95, "wilson"))  # touching counts
    assert not intervals_overlap(a, Interval(0.2000001, 0.3, 0.95, "wilson"))
    assert intervals_overlap(a, Interval(0.0, 1.0, 0.95, "wilson"))  # containment
    assert not intervals_overlap(Interval(0.5, 0.6, 0.95, "wilson"), a)
    # The published protocol's two arms (541/541 vs 78/541) do not overlap.
    assert not intervals_overlap(wilson_interval(541, 541), wilson_interval(78, 541))


def test_intervals_overlap_rejects_mixed_levels():
    with pytest.raises(ValueError) as exc:
        intervals_overlap(wilson_interval(5, 10), wilson_interval(5, 10, confidence_level=0.99))
    assert str(exc.value) == (
        "intervals_overlap compares intervals at one confidence level, got 0.95 and 0.99"
    )


# ------------------------------------------------------------------------------------------
# McNemar
# ------------------------------------------------------------------------------------------


def test_mcnemar_exact_matches_binomial_test():
    # Exact McNemar is a two-sided binomial test of b out of b + c at 1/2.
    res = mcnemar_test(3, 10)
    assert res.method == "exact-binomial"
    assert res.statistic == 3.0
    assert res.pvalue == pytest.approx(sps.binomtest(3, 13, 0.5).pvalue, rel=1e-12)
    # 2 * P(X <= 3), X ~ Bin(13, 1/2) = 2 * 378 / 8192
    assert res.pvalue == pytest.approx(2 * 378 / 8192, rel=1e-12)


def test_mcnemar_asymptotic_by_default_from_25():
    res = mcnemar_test(5, 20)
    assert res.method == "chi2-continuity-corrected"
    assert res.statistic == pytest.approx((abs(5 - 20) - 1) ** 2 / 25)  # 7.84
    assert res.pvalue == pytest.approx(sps.chi2.sf(7.84, 1), rel=1e-12)
    assert mcnemar_test(5, 19).method == "exact-binomial"
    assert mcnemar_test(5, 19, exact=False).method == "chi2-continuity-corrected"
    assert mcnemar_test(5, 20, exact=True).method == "exact-binomial"


def test_mcnemar_no_discordant_pairs():
    res = mcnemar_test(0, 0)
    assert (res.pvalue, res.b, res.c) == (1.0, 0, 0)
    with pytest.raises(ValueError) as exc:
        mcnemar_test(0, 0, exact=False)
    assert "b + c == 0" in str(exc.value)


def test_mcnemar_published_example():
    # Agresti (2013), Categorical Data Analysis, 3rd ed., Table 11.1 (presidential approval,
    # 1600 people, b = 150, c = 86): uncorrected z**2 = 17.36. With Edwards' continuity
    # correction the statistic is (|150 - 86| - 1)**2 / 236 = 16.818.
    res = mcnemar_test(150, 86)
    assert res.statistic == pytest.approx(63**2 / 236, rel=1e-12)
    assert round(res.statistic, 3) == 16.818


def test_mcnemar_errors():
    with pytest.raises(ValueError) as exc:
        mcnemar_test(-1, 3)
    assert str(exc.value) == "b must be >= 0, got -1"


# ------------------------------------------------------------------------------------------
# Throughput ratio, TOST, pooled CV
# ------------------------------------------------------------------------------------------


def test_throughput_ratio_against_hand_welch():
    t = [88.0, 91.5, 90.2, 89.1]
    c = [100.3, 98.7, 101.9]
    res = throughput_ratio(t, c)
    lt, lc = np.log(t), np.log(c)
    vt, vc = lt.var(ddof=1) / 4, lc.var(ddof=1) / 3
    df = (vt + vc) ** 2 / (vt**2 / 3 + vc**2 / 2)  # Welch (1947), Satterthwaite (1946)
    d = lt.mean() - lc.mean()
    half = sps.t.ppf(0.975, df) * math.sqrt(vt + vc)
    assert res.df == pytest.approx(df, rel=1e-12)
    assert res.se == pytest.approx(math.sqrt(vt + vc), rel=1e-12)
    assert res.log_diff == pytest.approx(d, rel=1e-12)
    assert res.ratio == pytest.approx(math.exp(d), rel=1e-12)
    assert res.interval.low == pytest.approx(math.exp(d - half), rel=1e-12)
    assert res.interval.high == pytest.approx(math.exp(d + half), rel=1e-12)
    assert (res.n_treatment, res.n_control, res.method) == (4, 3, "welch-log")
    assert res.interval.method == "welch-log"


def test_throughput_ratio_identical_passes():
    res = throughput_ratio([50.0, 50.0], [100.0, 100.0])
    assert res.ratio == pytest.approx(0.5)
    assert (res.interval.low, res.interval.high) == pytest.approx((0.5, 0.5))
    assert res.se == 0.0


@pytest.mark.parametrize(
    "t, c, message",
    [
        ([1.0], [1.0, 2.0],
         "treatment needs at least 2 counted passes to estimate pass-to-pass variation, got 1; "
         "declare workload.passes >= 2"),
        ([1.0, 2.0], [], "control needs at least 2 counted passes to estimate pass-to-pass "
         "variation, got 0; declare workload.passes >= 2"),
        ([1.0, 0.0], [1.0, 2.0], "treatment must hold finite throughputs > 0, got [0.0]"),
        ([1.0, 2.0], [1.0, float("nan")], "control must hold finite throughputs > 0, got [nan]"),
    ],
)
def test_throughput_ratio_errors(t, c, message):
    with pytest.raises(ValueError) as exc:
        throughput_ratio(t, c)
    assert str(exc.value) == message


def test_tost_equals_interval_inclusion():
    rng = np.random.default_rng(7)
    agree = 0
    for _ in range(200):
        t = rng.lognormal(np.log(100), 0.04, size=5)
        c = rng.lognormal(np.log(100), 0.04, size=5)
        tost = tost_ratio(t, c, 0.95, 1.05, alpha=0.05)
        ci = throughput_ratio(t, c, confidence_level=0.90).interval
        inside = 0.95 < ci.low and ci.high < 1.05
        assert tost.equivalent == inside
        agree += inside
    assert 20 < agree < 180  # both outcomes occur, so the comparison has teeth


def test_tost_against_statsmodels_direct():
    from statsmodels.stats.weightstats import ttost_ind

    t = [99.0, 101.0, 100.0, 102.0]
    c = [100.0, 100.5, 99.5]
    res = tost_ratio(t, c, 0.9, 1.1)
    p, lo, hi = ttost_ind(np.log(t), np.log(c), np.log(0.9), np.log(1.1), usevar="unequal")
    assert res.pvalue == p
    assert (res.statistic_low, res.pvalue_low) == (lo[0], lo[1])
    assert (res.statistic_high, res.pvalue_high) == (hi[0], hi[1])
    assert res.df == pytest.approx(throughput_ratio(t, c).df, rel=1e-12)
    assert res.equivalent and res.alpha == 0.05


def test_tost_not_equivalent_when_slower():
    res = tost_ratio([80.0, 82.0, 81.0], [100.0, 101.0, 99.0], 0.95, 1.05)
    assert not res.equivalent
    assert res.pvalue > 0.5


def test_tost_errors():
    with pytest.raises(ValueError) as exc:
        tost_ratio([1.0, 2.0], [1.0, 2.0], 1.05, 0.95)
    assert str(exc.value) == (
        "equivalence margins must satisfy 0 < low < high on the ratio scale, got low=1.05, "
        "high=0.95 (e.g. low=0.95, high=1.05)"
    )
    with pytest.raises(ValueError, match=r"^alpha must be strictly between 0 and 0.5"):
        tost_ratio([1.0, 2.0], [1.0, 2.0], 0.95, 1.05, alpha=0.5)


def test_pooled_cv():
    groups = [[100.0, 110.0, 105.0], [200.0, 190.0], [50.0]]
    res = pooled_cv(groups)
    l1, l2 = np.log(groups[0]), np.log(groups[1])
    ss = ((l1 - l1.mean()) ** 2).sum() + ((l2 - l2.mean()) ** 2).sum()
    assert res.df == 3 and res.n_groups == 2
    assert res.sd_log == pytest.approx(math.sqrt(ss / 3), rel=1e-12)
    assert res.cv == pytest.approx(math.sqrt(math.exp(res.sd_log**2) - 1), rel=1e-12)
    # A shift of one group's level (a treatment effect) does not change the pooled CV.
    shifted = pooled_cv([[v * 3 for v in groups[0]], groups[1]])
    assert shifted.sd_log == pytest.approx(res.sd_log, rel=1e-12)


def test_pooled_cv_recovers_lognormal_cv():
    rng = np.random.default_rng(11)
    sigma = math.sqrt(math.log1p(0.10**2))  # CV 10 %
    groups = rng.lognormal(np.log(100.0), sigma, size=(400, 5))
    res = pooled_cv(groups.tolist())
    # sd_log**2 * df / sigma**2 ~ chi2(df); accept the central 99.9 %.
    lo, hi = sps.chi2.ppf([0.0005, 0.9995], res.df)
    assert lo <= res.sd_log**2 * res.df / sigma**2 <= hi
    assert abs(res.cv - 0.10) < 0.005


def test_pooled_cv_errors():
    with pytest.raises(ValueError) as exc:
        pooled_cv([[1.0], [2.0]])
    assert str(exc.value) == (
        "pooled_cv needs at least one group with two or more passes to estimate pass-to-pass variation"
    )
    with pytest.raises(ValueError) as exc:
        pooled_cv([[1.0, 2.0], [3.0, -1.0]])
    assert str(exc.value) == "groups[1] must hold finite throughputs > 0, got [-1.0]"


# Student's sleep data (Cushny and Peebles via "Student" 1908): R's
# t.test(extra ~ group, data = sleep, paired = TRUE) gives mean difference -1.58, t = -4.0621,
# df = 9, 95 % interval -2.4598858 to -0.7001142.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_ratio_reproduces_students_sleep_data():
    res = bs.paired_ratio([math.exp(x) for x in SLEEP_1], [math.exp(x) for x in SLEEP_2])
    assert res.log_diff == pytest.approx(-1.58, abs=1e-12)
    assert math.log(res.interval.low) == pytest.approx(-2.4598858, abs=1e-7)
    assert math.log(res.interval.high) == pytest.approx(-0.7001142, abs=1e-7)
    assert res.log_diff / res.se == pytest.approx(-4.0621, abs=1e-4)
    assert (res.df, res.n_treatment, res.n_control, res.method) == (9.0, 10, 10, "paired-log")
    assert res.ratio == pytest.approx(math.exp(-1.58))
    # the pairing matters: the same values unpaired give Welch's much wider interval
    welch = bs.throughput_ratio([math.exp(x) for x in SLEEP_1], [math.exp(x) for x in SLEEP_2])
    assert welch.ratio == pytest.approx(res.ratio)
    assert math.log(welch.interval.low) == pytest.approx(-3.3654832, abs=1e-6)   # R, Welch


def test_paired_ratio_identical_differences_and_errors():
    same = bs.paired_ratio([100.0, 110.0, 120.0], [100.0, 110.0, 120.0])
    assert same.ratio == 1.0 and same.se == 0.0
    assert same.interval.low == same.interval.high == 1.0      # scipy would give nan
    near = bs.paired_ratio([90.0, 99.0, 108.0], [100.0, 110.0, 120.0])  # 0.9 up to rounding
    assert near.ratio == pytest.approx(0.9) and near.interval.width < 1e-12
    with pytest.raises(ValueError, match="must pair pass for pass, got 3 .treatment. and 2"):
        bs.paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="treatment"):
        bs.paired_ratio([1.0], [1.0])
    with pytest.raises(ValueError, match="control"):
        bs.paired_ratio([1.0, 2.0], [1.0, -2.0])
