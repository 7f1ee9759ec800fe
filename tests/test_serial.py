"""Serial correlation of passes and the cost interval robust to it (bistat.core.serial), declared as
``[rule.cost] interval = "hac"``, decided on by classify_cost and planned by bistat.core.design.

- The statistics against statsmodels and against their published formulas, on fixed data, to 1e-9.
- The registered paired workload-(i) run on vLLM 0.34.0 (32 pairs): the numbers its finding reports.
- The rule: the HAC parameters sealed with ``interval = "hac"``, refused without it, and absent
  from every rule that does not use them (an existing registration verifies and resolves to its
  sealed declaration byte for byte).
- The classifier and the design analysis on the HAC interval.

Coverage by simulation is tests/test_serial_coverage.py's.
"""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import numpy as np
import pytest
import statsmodels.api as sm
from click.testing import CliRunner
from scipy import fft
from scipy import stats as sps
from statsmodels.stats.diagnostic import acorr_ljungbox

from bistat.core import design, serial, stats
from bistat.core.classify import ArmStats, CostOutcome, classify_cost
from bistat.core.rule import CostRule, Rule
from bistat.core.serial import HacSpec, cosine_terms, hac_ratio, serial_correlation

ROOT = Path(__file__).resolve().parents[1]
PAIRED_RUN = ROOT / "data" / "h200-v034" / "h200-v034-i23-throughput-qwen3-8b-paired"
PAIRED_REG = ROOT / "preregistrations" / "h200-v034-i23-throughput-qwen3-8b-paired.json"

#: Fixed data: 12 pairs of per-pass throughputs, correlated from pass to pass (a slow wave in the
#: treatment's own noise).
T12 = [951.0, 957.5, 962.0, 958.5, 949.0, 941.5, 938.0, 944.5, 953.0, 960.5, 956.0, 947.0]
C12 = [1000.0, 1003.0, 998.5, 1001.5, 999.0, 997.0, 1002.5, 1000.5, 998.0, 1003.5, 1001.0, 999.5]


def test_module_doctests():
    assert doctest.testmod(serial).failed == 0


# ------------------------------------------------------------------------------------------
# Against statsmodels and the published formulas, on fixed data
# ------------------------------------------------------------------------------------------


def _cosine_sum_interval(d: np.ndarray, terms: int, level: float) -> tuple[float, float, float]:
    """Mueller (2007) / Lazarus, Lewis, Stock and Watson (2018, eq. 10), written out: the cosine
    transforms ``sqrt(2/n) sum_t cos(pi j (t - 1/2) / n) d_t`` by a loop, ``Omega`` their mean
    square, the t_B interval."""
    n = d.size
    lam = [math.sqrt(2.0 / n) * sum(math.cos(math.pi * j * (t + 0.5) / n) * d[t] for t in range(n))
           for j in range(1, terms + 1)]
    se = math.sqrt(sum(x * x for x in lam) / terms / n)
    q = sps.t.ppf(1 - (1 - level) / 2, terms)
    return se, d.mean() - q * se, d.mean() + q * se


@pytest.mark.parametrize("bandwidth, level", [("llsw", 0.95), (3, 0.95), (5, 0.90), (11, 0.99)])
def test_hac_interval_is_statsmodels_ols_of_the_cosine_transforms_and_the_formula(bandwidth, level):
    d = np.log(T12) - np.log(C12)
    res = hac_ratio(T12, C12, level, HacSpec(bandwidth=bandwidth))
    terms = cosine_terms(12, bandwidth)
    assert res.terms == terms == int(res.df) == (2 if bandwidth == "llsw" else bandwidth)
    # statsmodels: OLS of (L_0, .., L_B) on the transformed constant (sqrt(n), 0, .., 0)
    y = fft.dct(d, type=2, norm="ortho")[: terms + 1]
    x = np.zeros(terms + 1)
    x[0] = math.sqrt(12)
    ols = sm.OLS(y, x).fit()
    assert ols.df_resid == terms
    low, high = ols.conf_int(alpha=1 - level)[0]
    assert res.log_diff == pytest.approx(ols.params[0], abs=1e-12)
    assert res.se == pytest.approx(ols.bse[0], abs=1e-12)
    assert math.log(res.interval.low) == pytest.approx(low, abs=1e-9)
    assert math.log(res.interval.high) == pytest.approx(high, abs=1e-9)
    se, low_f, high_f = _cosine_sum_interval(d, terms, level)
    assert res.se == pytest.approx(se, abs=1e-12)
    assert (math.log(res.interval.low), math.log(res.interval.high)) == pytest.approx(
        (low_f, high_f), abs=1e-9)
    assert res.critical_value == pytest.approx(sps.t.ppf(1 - (1 - level) / 2, terms), abs=1e-12)
    assert res.sd_log_diff == pytest.approx(d.std(ddof=1), abs=1e-15)
    assert res.variance_ratio == pytest.approx(res.se**2 * 12 / d.var(ddof=1), rel=1e-12)
    assert res.method == res.interval.method == "hac-cosine-log"
    assert res.ratio == pytest.approx(stats.paired_ratio(T12, C12).ratio, rel=1e-15)


def test_with_every_cosine_term_the_hac_interval_is_the_paired_t_interval():
    """Parseval: the n - 1 cosine transforms beyond L_0 carry the sample variance."""
    res = hac_ratio(T12, C12, hac=HacSpec(bandwidth=11))
    paired = stats.paired_ratio(T12, C12)
    assert res.terms == 11
    assert res.se == pytest.approx(paired.se, rel=1e-12)
    assert res.interval.low == pytest.approx(paired.interval.low, rel=1e-12)
    assert res.interval.high == pytest.approx(paired.interval.high, rel=1e-12)
    assert res.variance_ratio == pytest.approx(1.0, abs=1e-12)
    assert hac_ratio(T12, C12, hac=HacSpec(bandwidth=50)).terms == 11   # capped at n - 1


def test_the_bandwidth_rule_counts_cosine_terms_in_integers():
    # B = max(2, floor(0.4 n^(2/3))), at most n - 1
    expected = {2: 1, 3: 2, 7: 2, 8: 2, 20: 2, 21: 3, 42: 4, 43: 4, 64: 6, 124: 9, 125: 10,
                200: 13}
    assert {n: cosine_terms(n) for n in expected} == expected
    for n in range(2, 400):
        b = cosine_terms(n)
        exact = math.floor(0.4 * n ** (2 / 3) + 1e-12)
        assert b == min(n - 1, max(2, exact))
    with pytest.raises(ValueError, match="pairs must be >= 2"):
        cosine_terms(1)
    with pytest.raises(ValueError, match="a number of cosine terms >= 1, got 0"):
        cosine_terms(10, 0)
    with pytest.raises(ValueError, match="kernel must be one of 'cosine', got 'bartlett'"):
        HacSpec(kernel="bartlett")


def test_lag1_and_ljung_box_against_their_formulas_and_statsmodels():
    x = np.log(C12)
    res = serial_correlation(x)
    u = x - x.mean()
    r = [float(np.sum(u[k:] * u[:-k]) / np.sum(u * u)) for k in (1, 2)]
    assert res.lag1 == pytest.approx(r[0], abs=1e-12)
    assert res.lags == 2 == serial.ljung_box_lags(12)
    q = 12 * 14 * sum(rk**2 / (12 - k) for k, rk in enumerate(r, start=1))   # Ljung and Box (1978)
    assert res.statistic == pytest.approx(q, abs=1e-9)
    assert res.pvalue == pytest.approx(sps.chi2.sf(q, 2), abs=1e-12)
    lb = acorr_ljungbox(x, lags=[2], return_df=True)
    assert res.pvalue == pytest.approx(float(lb["lb_pvalue"].iloc[0]), abs=1e-12)
    assert res.lag1_corrected == pytest.approx((12 * r[0] + 1) / 9, abs=1e-12)


def test_serial_correlation_edge_cases_are_named():
    flat = serial_correlation([5.0, 5.0, 5.0, 5.0])
    assert (flat.lag1, flat.statistic, flat.pvalue, flat.significant()) == (None, None, None,
                                                                           False)
    with pytest.raises(ValueError, match="at least 3 values in pass order, got 2"):
        serial_correlation([1.0, 2.0])
    with pytest.raises(ValueError, match="must be finite"):
        serial_correlation([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match="the arms must pair pass for pass, got 3"):
        serial.serial_diagnostics([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="finite throughputs > 0"):
        serial.paired_serial_correlation([1.0, 2.0, -3.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="at least 2 counted passes"):
        hac_ratio([1.0], [1.0])
    same = hac_ratio([90.0, 90.0, 90.0], [100.0, 100.0, 100.0])
    assert same.interval.low == same.interval.high == pytest.approx(0.9)


def test_the_bias_correction_recovers_rho_on_average():
    """Kendall (1954): E[r_1] = rho - (1 + 3 rho) / n to order 1/n; the corrected estimate's mean
    over seeded AR(1) series is within 0.02 of rho, the raw one is not."""
    rng = np.random.default_rng(20261204)
    n, reps = 32, 4000
    for rho in (0.0, 0.3, 0.5):
        e = rng.standard_normal((reps, n))
        x = np.empty_like(e)
        x[:, 0] = e[:, 0] / math.sqrt(1 - rho**2)
        for i in range(1, n):
            x[:, i] = rho * x[:, i - 1] + e[:, i]
        u = x - x.mean(axis=1, keepdims=True)
        r1 = np.sum(u[:, 1:] * u[:, :-1], axis=1) / np.sum(u * u, axis=1)
        corrected = np.mean([serial.lag1_bias_corrected(r, n) for r in r1])
        assert abs(corrected - rho) < 0.02
        assert abs(r1.mean() - (rho - (1 + 3 * rho) / n)) < 0.02
        assert rho - r1.mean() > 0.025


# ------------------------------------------------------------------------------------------
# The registered paired run
# ------------------------------------------------------------------------------------------


def _paired_run_values() -> tuple[list[float], list[float]]:
    """Output tokens/s of the counted passes (bistat.store.passes' rule), by pass index."""
    from bistat.store.passes import counted_passes

    counted = counted_passes(PAIRED_RUN)
    by_arm: dict[str, dict[int, float]] = {}
    for line in (PAIRED_RUN / "passes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "counted" and rec["pass_index"] in counted.get(rec["arm"], ()):
            by_arm.setdefault(rec["arm"], {})[rec["pass_index"]] = rec["output_tokens_per_s"]
    t, c = by_arm["bi-tuned-gemm-compiled"], by_arm["default"]
    assert sorted(t) == sorted(c) == list(range(1, 33))   # pass 0 is the warm-up
    return [t[k] for k in range(1, 33)], [c[k] for k in range(1, 33)]


def test_the_registered_paired_run_reproduces_the_issue_numbers():
    t, c = _paired_run_values()
    diag = serial.serial_diagnostics(t, c)
    assert round(diag.control.lag1, 2) == 0.47
    assert round(diag.differences.lag1, 2) == 0.30
    assert round(diag.treatment.lag1, 2) == -0.08
    assert diag.differences.lags == 6 and diag.significant == ()   # 6 lags dilute lag 1
    paired = stats.paired_ratio(t, c)
    assert (round(paired.interval.low, 3), round(paired.interval.high, 3)) == (0.926, 0.984)
    # the Newey-West interval (docs/COST-INTERVALS.md): statsmodels' HAC standard error (Bartlett,
    # 3 lags) with the paired t's critical value
    d = np.log(t) - np.log(c)
    nw = sm.OLS(d, np.ones(32)).fit(cov_type="HAC", cov_kwds={"maxlags": 3})
    q = sps.t.ppf(0.975, 31)
    low, high = math.exp(d.mean() - q * nw.bse[0]), math.exp(d.mean() + q * nw.bse[0])
    assert (round(low, 3), round(high, 3)) == (0.919, 0.991)
    assert (high - low) / (paired.interval.high - paired.interval.low) == pytest.approx(1.23,
                                                                                      abs=0.01)
    # bistat's HAC interval: 4 cosine terms, the long-run variance 1.66 times the plain one
    hac = hac_ratio(t, c)
    assert hac.terms == 4 and round(hac.variance_ratio, 2) == 1.66
    assert (round(hac.interval.low, 3), round(hac.interval.high, 3)) == (0.904, 1.007)
    assert hac.ratio == paired.ratio


def test_the_design_reads_the_paired_runs_correlation_and_flags_the_paired_interval():
    t, c = _paired_run_values()
    est = design.estimate_serial_correlation(t, c)
    assert est.pairs == 32 and round(est.rho, 3) == 0.363 and round(est.rho_arms, 3) == 0.552
    assert est.sd_log_diff == pytest.approx(0.08532, abs=1e-5)
    paired = design.check_interval_assumptions("paired", 32, est)
    assert not paired.contradicted and paired.at_risk and round(paired.coverage, 2) == 0.82
    assert paired.message == (
        "the paired interval assumes the pairs of passes independent; the earlier run's lag-1 "
        "autocorrelation: pair differences 0.30 (Ljung-Box p = 0.329 over 6 lags), not "
        "significant at 0.05, but if that is the correlation: at 0.36 (bias-corrected) and 32 "
        "pairs its stated 95 % covers about 82 %; [rule.cost] interval = \"hac\" allows for it")
    welch = design.check_interval_assumptions("welch", 32, est)
    assert not welch.contradicted and welch.at_risk and welch.rho == est.rho_arms
    assert welch.coverage < 0.75 and welch.pvalue == pytest.approx(0.108, abs=0.001)
    hac = design.check_interval_assumptions("hac", 32, est)
    assert not (hac.contradicted or hac.at_risk) and hac.message is None
    assert round(hac.coverage, 3) == 0.944
    short = design.check_interval_assumptions("hac", 8, est)
    assert short.contradicted and short.at_risk and short.pairs_to_hold == 9
    assert short.message == (
        "the earlier run's pairs of passes are serially correlated (lag-1 autocorrelation of "
        "their log differences 0.30, planned at 0.36): at 8 pairs the HAC interval's stated "
        "95 % covers about 93 %; about 9 pairs would keep it within 1.5 points")


# ------------------------------------------------------------------------------------------
# The rule and its seal
# ------------------------------------------------------------------------------------------


def test_hac_parameters_are_sealed_with_the_interval_and_refused_without_it():
    hac = CostRule(margin=0.05, interval="hac")
    assert hac.model_dump() == {"metric": "throughput", "margin": 0.05, "confidence_level": 0.95,
                                "interval": "hac", "hac_kernel": "cosine",
                                "hac_bandwidth": "llsw"}
    assert hac.hac == HacSpec("cosine", "llsw")
    assert CostRule.model_validate(hac.model_dump()) == hac
    assert CostRule(margin=0.05, interval="hac", hac_bandwidth=3).hac == HacSpec("cosine", 3)
    for interval in ("welch", "paired"):
        rule = CostRule(margin=0.05, interval=interval)
        assert rule.hac is None
        assert rule.model_dump() == {"metric": "throughput", "margin": 0.05,
                                     "confidence_level": 0.95, "interval": interval}
    assert hac.describe() == (
        "throughput ratio (treatment ÷ control, output tokens/s per pass), 95 % HAC interval of "
        "the paired passes (equal-weighted cosine, B = max(2, ⌊0.4 n^(2/3)⌋) terms) against "
        "[0.95, 1.05]")


@pytest.mark.parametrize("cost, message", [
    ({"margin": 0.05, "hac_bandwidth": 3},
     "rule.cost.hac_bandwidth: applies only to interval = \"hac\", not 'welch'; remove it or set "
     "interval = \"hac\""),
    ({"margin": 0.05, "interval": "paired", "hac_kernel": "cosine"},
     "rule.cost.hac_kernel: applies only to interval = \"hac\", not 'paired'; remove it or set "
     "interval = \"hac\""),
    ({"margin": 0.05, "interval": "hac", "hac_bandwidth": 0},
     "rule.cost.hac_bandwidth: 0 is not allowed; expected \"llsw\" (B = max(2, floor(0.4 "
     "n^(2/3))) cosine terms for n pairs) or a number of cosine terms >= 1, e.g. 4"),
    ({"margin": 0.05, "interval": "hac", "hac_bandwidth": "auto"},
     "rule.cost.hac_bandwidth: 'auto' is not allowed; expected \"llsw\" (B = max(2, floor(0.4 "
     "n^(2/3))) cosine terms for n pairs) or a number of cosine terms >= 1, e.g. 4"),
    ({"margin": 0.05, "interval": "hac", "hac_bandwidth": True},
     "rule.cost.hac_bandwidth: True is not allowed; expected \"llsw\" (B = max(2, floor(0.4 "
     "n^(2/3))) cosine terms for n pairs) or a number of cosine terms >= 1, e.g. 4"),
    ({"margin": 0.05, "interval": "hac", "hac_kernel": "bartlett"},
     "rule.cost.hac_kernel: 'bartlett' is not allowed; expected one of 'cosine'"),
    ({"margin": 0.05, "interval": "newey-west"},
     "rule.cost.interval: 'newey-west' is not allowed; expected one of 'welch', 'paired', 'hac'"),
])
def test_a_bad_hac_declaration_names_the_field_and_the_fix(cost, message):
    import tomllib

    from bistat.declare.experiment import DeclarationError, validate_experiment
    from bistat.declare.template import declaration_template

    data = tomllib.loads(declaration_template("x"))
    data["rule"]["cost"] = cost
    with pytest.raises(DeclarationError) as err:
        validate_experiment(data, source="experiments/x.toml")
    assert err.value.messages == [f"experiments/x.toml: {message}"]


def test_an_existing_registration_verifies_and_resolves_to_its_sealed_declaration():
    """A rule without the new fields seals and hashes exactly as before."""
    from bistat.cli import cli
    from bistat.declare.prereg import canonical_json, load_registration, sha256_hex

    result = CliRunner().invoke(cli, ["verify", str(PAIRED_REG)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    reg = load_registration(PAIRED_REG)
    sealed = reg.declaration
    assert sealed["rule"]["cost"] == {"confidence_level": 0.95, "interval": "paired",
                                      "margin": 0.05, "metric": "throughput"}
    resolved = reg.experiment().resolved()
    assert canonical_json(resolved) == canonical_json(sealed)
    assert sha256_hex(resolved) == reg.sealed["declaration_sha256"]
    # a registration carries the HAC fields exactly when it is sealed with interval = "hac": the
    # HAC readings of the committed studies (NAME-hac, scripts/hac_declarations.py) and the studies
    # registered on the HAC interval from the start
    hac = set()
    for path in sorted((ROOT / "preregistrations").glob("*.json")):
        cost = json.loads(path.read_text())["sealed"]["declaration"]["rule"].get("cost") or {}
        has = bool({"hac_kernel", "hac_bandwidth"} & set(cost))
        assert has == (cost.get("interval") == "hac"), path.name
        if has:
            hac.add(path.stem)
    readings = {stem for stem in hac if stem.endswith("-hac")}
    assert len(readings) >= 19
    assert {path.stem for path in (ROOT / "preregistrations").glob("*-hac.json")} <= hac


def test_a_hac_declaration_registers_and_verifies(tmp_path, monkeypatch):
    import datetime as dt

    from bistat.declare import prereg
    from bistat.declare.template import declaration_template

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prereg, "_utcnow",
                        lambda: dt.datetime(2026, 12, 5, 9, 0, tzinfo=dt.timezone.utc))
    text = declaration_template("serial")
    text = text[:text.index("\n[rule.cost]") + 1] + ('[rule.cost]\nmetric = "throughput"\n'
                                               'margin = 0.10\ninterval = "hac"\n'
                                               'hac_bandwidth = 3\n')
    decl = tmp_path / "experiments" / "serial.toml"
    decl.parent.mkdir()
    decl.write_text(text.replace("passes = 3 ", "passes = 16"))
    reg, _ = prereg.register(decl, registrations_dir=tmp_path / "preregistrations")
    assert reg.declaration["rule"]["cost"] == {
        "metric": "throughput", "margin": 0.1, "confidence_level": 0.95, "interval": "hac",
        "hac_kernel": "cosine", "hac_bandwidth": 3}
    again = prereg.load_registration(reg.path)
    assert again.experiment().rule.cost.hac == HacSpec("cosine", 3)
    assert again.experiment().resolved() == reg.declaration


# ------------------------------------------------------------------------------------------
# The classifier
# ------------------------------------------------------------------------------------------

HAC = CostRule(margin=0.05, interval="hac")


def _arms(t, c, passes=None):
    keys = tuple(range(len(t))) if passes is None else passes
    return (ArmStats("c", "control", 0, 0, tuple(c), throughput_passes=keys),
            ArmStats("t", "treatment", 0, 0, tuple(t), throughput_passes=keys))


def test_classify_cost_decides_on_the_hac_interval_of_the_pairs_in_pass_order():
    t, c = _paired_run_values()
    control, treatment = _arms(t, c)
    verdict = classify_cost(HAC, control, treatment)
    res = hac_ratio(t, c)
    assert verdict.interval == res.interval and verdict.ratio == res.ratio
    assert verdict.outcome is CostOutcome.UNDECIDABLE and verdict.n_pairs == 32
    # 0.954 sits just beyond the slower margin 0.95: no number of pairs decides it reliably
    assert verdict.passes_to_decide is None
    assert verdict.statement == ("cost undecidable at 32 pairs of passes (ratio 0.954, 95 % "
                                 "interval 0.90–1.01; no number of pairs of passes up to 200 "
                                 "would decide it at this ratio)")
    assert verdict.to_dict()["interval"]["method"] == "hac-cosine-log"
    # pass order is pass index order, whatever order the values come in
    order = list(reversed(range(32)))
    shuffled = _arms([t[k] for k in order], [c[k] for k in order], tuple(order))
    assert classify_cost(HAC, *shuffled).interval == res.interval


def test_classify_cost_on_hac_costs_and_no_measurable_cost_and_one_pair():
    rng = np.random.default_rng(7)
    c = 1000 * np.exp(0.01 * rng.standard_normal(24))
    slow = classify_cost(HAC, *_arms(c * 0.80 * np.exp(0.01 * rng.standard_normal(24)), c))
    assert slow.outcome is CostOutcome.COSTS and slow.interval.high < 0.95
    same = classify_cost(HAC, *_arms(c * np.exp(0.01 * rng.standard_normal(24)), c))
    assert same.outcome is CostOutcome.NO_MEASURABLE_COST and same.interval.low >= 0.95
    # undecidable at 8 pairs drifting apart slowly (the long-run variance 3 times the plain one):
    # the pairs that would decide it, planned for the HAC interval at the pairs' own spread and
    # (bias-corrected) lag-1 autocorrelation
    c8 = np.array([1000.0, 1003.0, 998.0, 1001.0, 999.0, 1002.0, 997.0, 1000.0])
    t8 = c8 * 0.97 * np.exp(0.02 * np.array([1.0, 0.5, 1.0, 0.0, -0.5, -1.0, -0.5, -1.0]))
    few = classify_cost(HAC, *_arms(t8, c8))
    res = hac_ratio(t8, c8)
    need = design.passes_to_decide(0.05, res.ratio, res.sd_log_diff / math.sqrt(2), hac=HAC.hac,
                                   rho=design.planning_rho(t8, c8))
    assert round(res.variance_ratio, 2) == 3.01 and design.planning_rho(t8, c8) > 0.3
    assert few.outcome is CostOutcome.UNDECIDABLE and few.passes_to_decide == need > 8
    assert few.statement.endswith(f"; about {need} pairs would decide it)")
    one = classify_cost(HAC, ArmStats("c", "control", 0, 0, (100.0, 101.0),
                                      throughput_passes=(1, 2)),
                        ArmStats("t", "treatment", 0, 0, (99.0, 98.0), throughput_passes=(2, 3)))
    assert one.outcome is CostOutcome.UNDECIDABLE and one.n_pairs == 1
    assert one.statement == ("cost undecidable at 1 pair of passes (needs at least 2 for a HAC "
                             "interval)")


# ------------------------------------------------------------------------------------------
# The design analysis
# ------------------------------------------------------------------------------------------


def test_hac_planning_at_rho_zero_is_the_exact_t_with_b_degrees_of_freedom():
    """Independent pairs: the cosine draws' t statistic is t_B, so a true ratio on the slower
    margin is called 'no measurable cost' with probability (1 - level) / 2, and at a true ratio
    of 1 'costs' never."""
    spec = HacSpec()
    p = design.cost_outcome_probabilities(0.05, 0.95, 32, 0.03, hac=spec)
    assert p["no measurable cost"] + p["faster"] == pytest.approx(0.025, abs=0.0015)
    assert sum(p.values()) == pytest.approx(1.0, abs=1e-12)
    z0, ms = design._cosine_draws(32, 0.0, 4)
    tstat = z0 / np.sqrt(ms)
    assert np.mean(np.abs(tstat) <= sps.t.ppf(0.975, 4)) == pytest.approx(0.95, abs=0.0015)
    # the paired interval's planning at rho = 0 is unchanged by the new keywords
    assert design.cost_outcome_probabilities(0.05, 0.97, 16, 0.03, paired=True, rho=0.0) == \
        design.cost_outcome_probabilities(0.05, 0.97, 16, 0.03, paired=True)


def test_the_planned_hac_half_width_uses_its_b_degrees_of_freedom():
    sigma = design.log_sd_from_cv(0.05)
    for pairs, terms in ((10, 2), (32, 4), (64, 6)):
        expected = sps.t.ppf(0.975, terms) * sigma * math.sqrt(2 / pairs)
        assert design.expected_ratio_halfwidth(pairs, 0.05, hac=HacSpec()) == pytest.approx(
            expected, rel=1e-12)
    assert design.expected_ratio_interval_factor(32, 0.05, hac=HacSpec(bandwidth=31)) == \
        pytest.approx(design.expected_ratio_interval_factor(32, 0.05, paired=True), rel=1e-12)


def test_hac_needs_more_pairs_than_paired_and_more_still_under_correlation():
    paired = design.passes_to_decide(0.05, 1.0, 0.03, paired=True)
    hac = design.passes_to_decide(0.05, 1.0, 0.03, hac=HacSpec())
    correlated = design.passes_to_decide(0.05, 1.0, 0.03, hac=HacSpec(), rho=0.5)
    assert paired < hac < correlated
    with pytest.raises(ValueError, match="rho plans a paired or HAC interval"):
        design.cost_outcome_probabilities(0.05, 1.0, 8, 0.03, rho=0.3)
    with pytest.raises(ValueError, match="rho must be a lag-1 autocorrelation strictly between"):
        design.interval_coverage("hac", 8, 1.0)


def test_the_design_checks_each_interval_against_runs_with_and_without_correlation():
    from helpers_serial import correlated_arms

    rng = np.random.default_rng(20261205)
    t, c = correlated_arms(rng, 1, 32, 0.0, drift_sd=0.0)
    est = design.estimate_serial_correlation(t[0], c[0])
    assert est.rho < 0.05 and est.rho_arms < 0.05
    for interval in ("welch", "paired", "hac"):
        check = design.check_interval_assumptions(interval, 32, est)
        assert not (check.contradicted or check.at_risk) and check.message is None, check
        assert check.coverage >= 0.935
    t, c = correlated_arms(rng, 1, 32, 0.8, drift_sd=0.0)
    est = design.estimate_serial_correlation(t[0], c[0])
    assert {"treatment", "control"} <= set(est.diagnostics.significant)
    for interval in ("welch", "paired"):
        check = design.check_interval_assumptions(interval, 32, est)
        significant = interval == "welch" or "differences" in est.diagnostics.significant
        assert check.at_risk and check.contradicted is significant
        assert ("significant: at " in check.message) is significant
    hac = design.check_interval_assumptions("hac", 32, est)
    assert hac.contradicted and hac.pairs_to_hold is not None and hac.pairs_to_hold > 32


def test_the_design_module_doctests():
    from bistat.core import design_coverage, design_rho

    assert [doctest.testmod(m).failed for m in (design_rho, design_coverage)] == [0, 0]
