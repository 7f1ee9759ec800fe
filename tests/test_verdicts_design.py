"""The design analysis of the default rule: the activation criteria's power and the cost rule's
outcomes against brute force and seeded simulation, and its warnings about false verdicts -- seed
003's 29.6 % reproduced from its pass-to-pass spread.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from scipy import stats as sps

from bistat.core import design, design_ratio, stats
from bistat.core.classify import ArmStats, CostOutcome, classify_cost
from bistat.declare.design_report import analyse_design, format_design
from bistat.declare.experiment import load_experiment, validate_experiment
from bistat.core.rule import CostRule, Rule, speed_as_evidence_warnings
from bistat.declare.template import declaration_template

ROOT = Path(__file__).resolve().parents[1]


def _band(reps: int, p: float) -> tuple[float, float]:
    """The central 99.8 % acceptance band of Binomial(reps, p), as a rate."""
    return sps.binom.ppf(0.001, reps, p) / reps, sps.binom.ppf(0.999, reps, p) / reps


# ---- activation criteria against brute force -------------------------------------------------


@pytest.mark.parametrize("n, threshold, alternative", [(541, 0.99, "two-sided"),
                                                       (256, 0.99, "less"), (100, 0.9, "less"),
                                                       (30, 0.5, "two-sided")])
def test_max_matches_below_upper_against_a_scan(n, threshold, alternative):
    expected = max((k for k in range(n + 1)
                    if stats.wilson_interval(k, n, 0.95, alternative).high <= threshold),
                   default=-1)
    assert design.max_matches_below_upper(n, threshold, 0.95, alternative) == expected
    rate = 0.93
    assert design.prob_upper_bound_at_most(n, rate, threshold, 0.95, alternative) == \
        pytest.approx(sps.binom.cdf(expected, n, rate) if expected >= 0 else 0.0)


@pytest.mark.parametrize("n, pt, pc, d", [(30, 0.9, 0.6, 0.0), (40, 0.8, 0.8, 0.0),
                                          (25, 1.0, 0.7, 0.1)])
def test_power_newcombe_equals_the_exact_sum_over_statsmodels_intervals(n, pt, pc, d):
    """Every (k_t, k_c) through bistat.core.stats.newcombe_difference (statsmodels), weighted by the
    binomial pmfs."""
    exact = sum(sps.binom.pmf(kt, n, pt) * sps.binom.pmf(kc, n, pc)
                for kt in range(n + 1) for kc in range(n + 1)
                if stats.newcombe_difference(kt, n, kc, n).low >= d)
    assert design.power_newcombe(n, pt, pc, d) == pytest.approx(exact, abs=1e-9)


@pytest.mark.parametrize("n, pt, pc", [(60, 1.0, 0.9), (200, 0.95, 0.9), (100, 0.9, 0.9)])
def test_power_mcnemar_against_seeded_simulation_through_stats(n, pt, pc):
    """Prompts matching independently per arm, tested by bistat.core.stats.mcnemar_test; the
    simulated rate must fall in the binomial acceptance band of the exact figure."""
    rng = np.random.default_rng(20261202)
    reps = 3000
    hits = 0
    for _ in range(reps):
        t = rng.random(n) < pt
        c = rng.random(n) < pc
        b, cc = int((c & ~t).sum()), int((t & ~c).sum())
        res = stats.mcnemar_test(b, cc)
        hits += res.pvalue < 0.05 and cc > b
    exact = design.power_mcnemar(n, pt, pc, 0.05)
    low, high = _band(reps, exact)
    assert low <= hits / reps <= high, (hits / reps, exact)


def test_mcnemar_under_a_a_is_at_most_half_its_level():
    for n in (50, 288, 541):
        for p in (0.5, 0.9, 0.99):
            assert design.power_mcnemar(n, p, p, 0.05) <= 0.025 + 1e-12


# ---- the cost rule's outcomes ---------------------------------------------------------------


@pytest.mark.parametrize("metric, true_ratio", [("throughput", 1.0), ("throughput", 0.8),
                                                ("throughput", 0.93), ("throughput", 1.08),
                                                ("latency", 0.92), ("latency", 1.07)])
def test_cost_outcome_probabilities_against_the_classifier(metric, true_ratio):
    """2,000 seeded lognormal draws classified by bistat.core.classify.classify_cost: each
    outcome's rate inside the acceptance band of the design's figure. The ratios beyond a margin
    on the faster side (1.08 throughput, 0.92 latency) are where the cost rule's non-inferiority
    differs from equivalence."""
    rng = np.random.default_rng(7)
    reps, n, cv = 2000, 5, 0.06
    sigma = design.log_sd_from_cv(cv)
    rule = CostRule(metric=metric, margin=0.10)
    def arm(name, role, values):   # the values as the metric's per-pass values
        if metric == "throughput":
            return ArmStats(name, role, 0, 0, tuple(values))
        return ArmStats(name, role, 0, 0, (), pass_latencies=tuple(values))

    want = design.cost_outcome_probabilities(0.10, true_ratio, n, cv, metric=metric)
    counts = {o: 0 for o in want}
    # the classifier's outcome is all this test reads: its (slow) search for the passes that
    # would decide an undecidable cost is skipped
    with mock.patch.object(design_ratio, "passes_to_decide", return_value=None) as skipped:
        for _ in range(reps):
            c = 100.0 * np.exp(sigma * rng.standard_normal(n))
            t = 100.0 * true_ratio * np.exp(sigma * rng.standard_normal(n))
            got = classify_cost(rule, arm("c", "control", c), arm("t", "treatment", t))
            counts[got.outcome.value] += 1
    # the search is skipped where the classifier looks it up (else this test takes minutes)
    assert skipped.called == (counts["undecidable"] > 0)
    for outcome, p in want.items():
        low, high = _band(reps, p)
        assert low <= counts[outcome] / reps <= high, (outcome, counts, want)


@pytest.mark.parametrize("true_ratio", [1.0, 0.97, 0.9])
def test_paired_cost_outcome_probabilities_against_the_classifier(true_ratio):
    """The paired plan (``[rule.cost] interval = "paired"``) against 2,000 seeded runs of 8 pass
    pairs classified by classify_cost: each pass shares a drift across the arms (SD four times
    the arms' own noise), which pairing removes; the plan takes the per-arm CV that gives the
    pairs' log differences their spread. Welch's plan at that CV is wrong by more than the band
    at a true ratio of 1 (its ~14 degrees of freedom against the paired t's 7)."""
    rng = np.random.default_rng(11)
    reps, n, noise = 2000, 8, 0.035
    cv = math.sqrt(math.expm1(noise ** 2))   # the CV whose log SD is the arms' own noise
    rule = CostRule(metric="throughput", margin=0.05, interval="paired")
    want = design.cost_outcome_probabilities(0.05, true_ratio, n, cv, paired=True)
    counts = {o: 0 for o in want}
    with mock.patch.object(design_ratio, "passes_to_decide", return_value=None) as skipped:
        for _ in range(reps):
            drift = 4 * noise * rng.standard_normal(n)
            c = 100.0 * np.exp(drift + noise * rng.standard_normal(n))
            t = 100.0 * true_ratio * np.exp(drift + noise * rng.standard_normal(n))
            got = classify_cost(rule, ArmStats("c", "control", 0, 0, tuple(c)),
                                ArmStats("t", "treatment", 0, 0, tuple(t)))
            assert got.n_pairs == n
            counts[got.outcome.value] += 1
    assert skipped.called == (counts["undecidable"] > 0)
    for outcome, p in want.items():
        low, high = _band(reps, p)
        assert low <= counts[outcome] / reps <= high, (outcome, counts, want)
    if true_ratio == 1.0:
        welch = design.cost_outcome_probabilities(0.05, 1.0, n, cv)["no measurable cost"]
        low, high = _band(reps, welch)
        assert not low <= counts["no measurable cost"] / reps <= high, (welch, counts)


def test_paired_plan_has_the_paired_t_degrees_of_freedom():
    """The paired interval's planned half-width is t(n - 1) where Welch's is t(2n - 2), the same
    standard error; the paired plan never needs fewer passes than Welch's at the same CV."""
    for n, cv in ((3, 0.05), (10, 0.05), (32, 0.0515)):
        sigma = design.log_sd_from_cv(cv)
        se = sigma * math.sqrt(2 / n)
        assert design.expected_ratio_halfwidth(n, cv, paired=True) == pytest.approx(
            sps.t.ppf(0.975, n - 1) * se, rel=1e-12)
        assert design.expected_ratio_halfwidth(n, cv) == pytest.approx(
            sps.t.ppf(0.975, 2 * n - 2) * se, rel=1e-12)
    for margin, cv in ((0.10, 0.05), (0.05, 0.0515), (0.05, 0.03)):
        assert (design.passes_to_decide(margin, 1.0, cv, paired=True)
                >= design.passes_to_decide(margin, 1.0, cv))


@pytest.mark.parametrize("metric", ["throughput", "latency"])
def test_cost_outcome_probabilities_are_the_one_sided_test_on_the_slower_side(metric):
    """No measurable cost or faster is the one-sided test on the slower margin: on that margin
    at most (1 - level) / 2 (the test's size); one true ratio faster than another is never less
    likely to get it, nor more likely to cost."""
    slower = 0.9 if metric == "throughput" else 1.1
    on = design.cost_outcome_probabilities(0.10, slower, 6, 0.08, metric=metric)
    assert on["no measurable cost"] + on["faster"] <= 0.025 + 0.003   # Monte Carlo error
    ratios = [0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2]
    if metric == "latency":
        ratios = ratios[::-1]                                          # slowest first
    probs = [design.cost_outcome_probabilities(0.10, r, 6, 0.08, metric=metric) for r in ratios]
    good = [p["no measurable cost"] + p["faster"] for p in probs]
    assert good == sorted(good) and good[-1] > 0.99
    assert [p["costs"] for p in probs] == sorted((p["costs"] for p in probs), reverse=True)
    assert all(abs(sum(p.values()) - 1.0) < 1e-12 for p in probs)


def test_passes_to_decide_is_the_smallest_that_reaches_the_target():
    """Decided: costs beyond the slower margin, no measurable cost or faster on the other side of
    it (a faster true ratio decides no later)."""
    probs = design.cost_outcome_probabilities
    for margin, r, cv, metric in ((0.10, 1.0, 0.05, "throughput"), (0.10, 0.97, 0.08, "throughput"),
                                  (0.10, 0.7, 0.1, "throughput"), (0.10, 1.1, 0.05, "throughput"),
                                  (0.05, 0.92, 0.12, "latency"), (0.05, 1.08, 0.05, "latency")):
        n = design.passes_to_decide(margin, r, cv, metric=metric)

        def decided(k):
            p = probs(margin, r, k, cv, metric=metric)
            slower_side = r < 1 - margin if metric == "throughput" else r > 1 + margin
            return p["costs"] if slower_side else p["no measurable cost"] + p["faster"]
        assert decided(n) >= 0.8
        if n > 2:
            assert decided(n - 1) < 0.8
    assert design.passes_to_decide(0.10, 0.9, 0.05) is None   # on the slower margin: never decided
    assert design.passes_to_decide(0.10, 1.1, 0.05, metric="latency") is None
    # on the faster margin the decision is no measurable cost or faster, soon
    assert design.passes_to_decide(0.10, 1.1, 0.05) <= design.passes_to_decide(0.10, 1.0, 0.05)
    # the real case: latency 0.92 against 5 %, CV 0.12 -- decided long before 200 passes
    assert design.passes_to_decide(0.05, 0.92, 0.12, metric="latency") < 90


def test_a_start_guess_gives_the_same_answer():
    fn = lambda n: design.power_ratio_point_below(0.95, 0.90, n, 0.10)   # noqa: E731
    plain = design.min_passes_for_power(fn)
    assert plain == 5
    for start in (2, 3, 5, 9, 60, 200):
        assert design.min_passes_for_power(fn, start=start) == plain
    assert design.min_passes_for_power(lambda n: 0.0, start=7) is None


# ---- false verdicts ---------------------------------------------------------------------------


def _published(passes: int, cv: float):
    data = tomllib.loads((ROOT / "experiments" / "published-protocol.toml").read_text())
    data["workload"]["passes"] = passes
    data["design"]["expected_cv"] = cv
    return validate_experiment(data, source="published-protocol")


def test_seed_003s_two_passes_fire_the_published_slowdown_296_times_in_1000():
    """Seed 003's two passes took 177 s and 134 s: pooled CV 0.199. With two passes per arm the
    published "ratio < 0.90" criterion is met with probability Phi(log 0.9 / (sd_log sqrt(2/2)))
    = 0.296 at a true ratio of 1 -- a false "working" -- and the design analysis warns, naming
    the 19 passes per arm that bring it under alpha 0.05."""
    cv = stats.pooled_cv([[177.0, 134.0]])
    assert round(cv.cv, 2) == 0.20
    expected = sps.norm.cdf(math.log(0.9) / cv.sd_log)
    assert round(expected, 3) == 0.296
    report = analyse_design(_published(2, cv.cv))
    (no_slowdown, aa) = report.false_positives
    assert (no_slowdown.label, no_slowdown.scenario) == ("working", "no slowdown")
    assert no_slowdown.prob == pytest.approx(expected, rel=1e-9)
    assert no_slowdown.fix == "19 passes per arm bring it under alpha (set workload.passes >= 19)"
    assert sps.norm.cdf(math.log(0.9) / (cv.sd_log * math.sqrt(2 / 19))) <= 0.05 < \
        sps.norm.cdf(math.log(0.9) / (cv.sd_log * math.sqrt(2 / 18)))
    assert ("rule label 'working' is met when there is no slowdown at all (true ratio 1) with "
            "probability 0.296, above the rule's alpha 0.05: a false 'working'; 19 passes per arm "
            "bring it under alpha (set workload.passes >= 19)") in report.warnings
    assert (aa.scenario, aa.match_rate) == ("A/A", 1.0)
    assert aa.prob == pytest.approx(expected, rel=1e-9) and aa.exceeds
    assert "add control_diverges and treatment_beats_control" in aa.fix
    assert "False verdicts" in format_design(report)


def test_at_the_default_cv_the_two_pass_plan_gets_no_throughput_warning():
    report = analyse_design(_published(2, 0.05))
    assert all(not fp.exceeds for fp in report.false_positives)
    assert report.false_positives[0].prob == pytest.approx(
        sps.norm.cdf(math.log(0.9) / design.log_sd_from_cv(0.05)))
    assert not [w for w in report.warnings if ("throughput" in w or "'working'" in w)
                and "as evidence" not in w]  # speed-as-evidence: test_speed_as_evidence_...


def test_the_default_rule_keeps_a_false_working_under_alpha():
    data = tomllib.loads(declaration_template("t"))
    report = analyse_design(validate_experiment(data))
    (aa,) = report.false_positives
    assert aa.label == "working" and aa.scenario == "A/A" and not aa.exceeds
    assert aa.prob <= 0.025
    # the bound is McNemar's directional false-positive rate at the worst A/A match rate
    assert aa.prob == pytest.approx(max(min(
        design.prob_lower_bound_at_least(288, p, 0.99, alternative="greater")
        * design.prob_upper_bound_at_most(288, p, 0.99, alternative="less"),
        design.power_mcnemar(288, p, p, 0.05))
        for p in sorted({0.5, 0.9, 0.95, 0.96, 0.98, 0.99, 0.995, 0.999, 1.0})))


def test_activation_and_cost_design_figures_at_the_declared_plan():
    data = tomllib.loads(declaration_template("t"))
    report = analyse_design(validate_experiment(data))
    diverges, beats = report.activation
    assert diverges.criterion == "control_diverges"
    assert diverges.prob_met == pytest.approx(
        design.prob_upper_bound_at_most(288, 0.96, 0.99, 0.95, "less"))
    assert beats.tests == (("mcnemar", design.power_mcnemar(288, 1.0, 0.96, 0.05)),)
    cost = report.cost
    assert cost.passes_per_arm == 3 and cost.cv == 0.05
    # the template's cost interval is "hac" (bistat new's default), and it is planned as one: at
    # 3 pairs its 2 cosine terms are the paired t's, not Welch's 4 degrees of freedom
    from bistat.core.serial import HacSpec
    assert (cost.interval, cost.hac_terms, cost.rho) == ("hac", 2, 0.0)
    hac = design.cost_outcome_probabilities(0.10, 1.0, 3, 0.05, hac=HacSpec())
    assert dict(cost.outcomes)[1.0] == hac
    assert hac != design.cost_outcome_probabilities(0.10, 1.0, 3, 0.05)
    assert dict(cost.passes_to_decide)[1.0] == design.passes_to_decide(0.10, 1.0, 0.05,
                                                                       hac=HacSpec())
    text = format_design(report)
    assert "Activation criteria (288 prompts; assumed match rates 1 treatment, 0.96 control):" \
        in text
    assert "Cost rule (throughput ratio" in text


def test_a_working_label_whose_activation_thresholds_overlap_is_warned_about():
    """Treatment lower bound >= 0.99 and control upper bound <= 0.9995 overlap: in an A/A
    experiment at a match rate of 0.999 both hold together ever more surely as prompts grow."""
    data = tomllib.loads(declaration_template("t"))
    data["rule"]["labels"][0]["all"] = [
        {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
        {"criterion": "control_diverges", "at_most": 0.9995}]
    (aa,) = analyse_design(validate_experiment(data)).false_positives
    assert aa.exceeds and aa.match_rate == 0.999
    assert aa.prob == pytest.approx(
        design.prob_lower_bound_at_least(288, 0.999, 0.99, alternative="greater")
        * design.prob_upper_bound_at_most(288, 0.999, 0.9995, alternative="less"))
    assert aa.fix == ("no number of prompts up to 100000 brings it under alpha; tighten the "
                      "activation criteria's thresholds")


def test_speed_as_evidence_is_warned_where_a_faster_kernel_gets_a_worse_label():
    """The published rule: 'working' needs a point ratio below 0.90 and 'doubtful' one at least
    0.95, so the same outputs from a faster kernel move the verdict from working towards
    doubtful. The default rule reads no speed; a cost-goal rule whose 'working' needs the
    treatment NOT to be slower rewards speed and is not warned about."""
    published = analyse_design(_published(2, 0.05)).warnings
    speed = [w for w in published if "as evidence" in w]
    assert [w.split(") takes")[0] for w in speed] == [
        "rule.labels[0].all[1] ('working': throughput ratio (treatment ÷ control), point "
        "estimate < 0.9",
        "rule.labels[1].all[1] ('doubtful': throughput ratio (treatment ÷ control), point "
        "estimate >= 0.95"]
    assert "can lose 'working'" in speed[0] and "can become 'doubtful'" in speed[1]
    default = analyse_design(validate_experiment(tomllib.loads(declaration_template("t"))))
    assert not [w for w in default.warnings if "as evidence" in w]
    rule = Rule.model_validate({"labels": [
        {"label": "working", "all": [{"criterion": "throughput_not_slower",
                                      "lower_at_least": 0.98}]},
        {"label": "doubtful", "all": [{"criterion": "throughput_slower", "bound": 0.9}]}]})
    assert speed_as_evidence_warnings(rule) == []
    improved = Rule.model_validate({"labels": [
        {"label": "working", "all": [{"criterion": "throughput_slower", "bound": 1.0}]},
        {"label": "doubtful", "all": [{"criterion": "throughput_not_slower",
                                       "margin_low": 0.95, "margin_high": 1.05}]}]})
    assert [w[:37] for w in speed_as_evidence_warnings(improved)] == [
        "rule.labels[0].all[0] ('working': thr", "rule.labels[1].all[0] ('doubtful': th"]


def test_a_paired_cost_rule_is_planned_from_the_pairs_of_the_earlier_run(tmp_path):
    """design.cv_from with ``[rule.cost] interval = "paired"``: the cost is planned at the SD of
    the earlier run's pass-pair log differences over sqrt(2), not at its pooled CV. The committed
    workload-(i) pilot of 2026-12-03 (54 pairs; both arms slowed over the run): pooled CV 0.094,
    paired 0.0515."""
    from bistat.declare.design_report import paired_cv_from_run
    pilot = ROOT / "data" / "h200-v034" / "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled"
    cv, where = paired_cv_from_run(pilot)
    recs = [json.loads(x) for x in (pilot / "passes.jsonl").read_text().splitlines()]
    by = {}
    for r in recs:
        if r["kind"] == "counted" and r["status"] == "complete":
            by.setdefault(r["arm"], {})[r["pass_index"]] = r["output_tokens_per_s"]
    keys = sorted(set(by["default"]) & set(by["bi-tuned-gemm-compiled"]))
    d = [math.log(by["bi-tuned-gemm-compiled"][k]) - math.log(by["default"][k]) for k in keys]
    s = float(np.std(d, ddof=1)) / math.sqrt(2)
    assert len(keys) == 54 and cv == pytest.approx(math.sqrt(math.expm1(s ** 2)))
    assert design.log_sd_from_cv(cv) == pytest.approx(s)   # the CV whose log SD is s
    assert round(s, 4) == 0.0515 and round(cv, 4) == 0.0516 and "54 pairs of passes" in where
    # three arms with no registration to say which is the control: no pairing to plan from
    three = tmp_path / "three"
    three.mkdir()
    (three / "passes.jsonl").write_text("".join(
        json.dumps({"schema": "bistat.passes/1", "arm": a, "seq": 3 * p + i, "pass_index": p,
                    "kind": "counted", "status": "complete", "output_tokens_per_s": 100.0 + p})
        + "\n" for p in range(4) for i, a in enumerate("abc")))
    (three / "schedule.jsonl").write_text("".join(
        json.dumps({"schema": "bistat.schedule/1", "event": "end", "seq": 3 * p + i, "arm": a,
                    "pass_index": p, "kind": "counted", "status": "complete"})
        + "\n" for p in range(4) for i, a in enumerate("abc")))
    assert paired_cv_from_run(three) is None
    rep = analyse_design(load_experiment(
        ROOT / "experiments" / "h200-v034-i23-throughput-qwen3-8b-paired.toml"), base_dir=ROOT)
    assert rep.cost.cv == pytest.approx(cv)
    assert rep.duration.seconds == pytest.approx(798, abs=1)
    assert rep.cost.passes_per_arm == 32
