"""The rule vocabulary and its classifier: activation criteria, the cost rule, the default
rule, published summaries, one rounding, and the refusal of criteria a run could never evaluate.

Expected values are computed here from their definitions (scipy's binomial, chi-square and
one-sided Welch t test), never copied from the classifier.
"""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from bistat.core import design, design_ratio, stats
from bistat.core.classify import (
    COST_SENTENCES,
    ActivationEvidence,
    ArmStats,
    CostOutcome,
    PairedCounts,
    RatioSummary,
    RunTestable,
    ValidityCheck,
    classify,
    classify_cost,
    format_decided,
)
from bistat.declare.experiment import DeclarationError, load_experiment, validate_experiment
from bistat.core.rule import CostRule, Label, Rule
from bistat.declare.template import DEFAULT_RULE_TOML, declaration_template, default_rule

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = default_rule()
PUBLISHED = load_experiment(ROOT / "experiments" / "published-protocol.toml").rule
Z95 = sps.norm.ppf(0.95)


def arm(name, role, k, n, passes=(100.0, 101.0, 99.0, 100.5), latencies=()):
    return ArmStats(name, role, n, k, tuple(float(x) for x in passes),
                    pass_latencies=tuple(float(x) for x in latencies))


def rule(*criteria, **kw):
    return Rule.model_validate({"labels": [{"label": "working", "all": list(criteria)}], **kw})


# ---- the default rule ---------------------------------------------------------------------


def test_the_default_rule_is_what_its_docstring_says():
    assert DEFAULT.confidence_level == 0.95 and DEFAULT.alternative == "greater"
    assert DEFAULT.otherwise == "reported as observed"
    working, doubtful = DEFAULT.labels
    assert working.label == "working"
    assert [c.model_dump(by_alias=True) for c in working.criteria] == [
        {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
        {"criterion": "control_diverges", "at_most": 0.99},
        {"criterion": "treatment_beats_control", "newcombe_at_least": None,
         "mcnemar_below": 0.05, "require": "both"}]
    assert doubtful.label == "doubtful"
    assert [c.model_dump(by_alias=True) for c in doubtful.criteria] == [
        {"criterion": "match_upper_bound", "arm": "treatment", "below": 0.99}]
    assert DEFAULT.cost == CostRule(metric="throughput", margin=0.10, confidence_level=0.95,
                                    interval="hac", hac_kernel="cosine", hac_bandwidth="llsw")
    assert DEFAULT_RULE_TOML.startswith("# The default decision rule")


def test_study_1b_is_working_by_the_default_rule_with_its_cost_stated():
    """Study 1(b)'s counts (default 0/541, batch-invariant 541/541, every prompt discordant in
    the treatment's favour): working; McNemar's p is the chi-square with continuity correction
    on 1 degree of freedom, (541 - 1)^2 / 541."""
    c = arm("default", "control", 0, 541)
    t = arm("batch-invariant", "treatment", 541, 541, (97.0, 98.0, 96.5, 97.5))
    v = classify(DEFAULT, c, t, paired=PairedCounts(541, 0, 541))
    assert v.label is Label.WORKING
    lb, diverges, beats = v.labels[0].criteria
    assert lb.observed == pytest.approx(541 / (541 + Z95 ** 2))   # one-sided bound at k = n
    assert diverges.description == ("control diverges under the same load: control's one-sided "
                                    "95 % Wilson upper bound")
    assert diverges.observed == pytest.approx(Z95 ** 2 / (541 + Z95 ** 2))   # k = 0
    assert diverges.met is True and diverges.threshold == "<= 0.99"
    p = sps.chi2.sf((541 - 1) ** 2 / 541, 1)
    assert beats.observed == pytest.approx(p, rel=1e-9)
    assert beats.observed_text == (f"{p:.4g} (McNemar: 0 control only / 541 treatment only, "
                                   "chi2-continuity-corrected; treatment ahead)")
    assert v.cost.outcome is CostOutcome.NO_MEASURABLE_COST
    # the default cost interval: the 4 passes paired, the HAC (cosine) interval with 2 terms
    assert v.cost.interval.method == "hac-cosine-log" and v.cost.n_pairs == 4
    assert v.headline == "working — no measurable cost (ratio 0.97, 95 % interval 0.97–0.98)"


def test_a_control_that_does_not_diverge_leaves_the_question_open():
    """Both arms 541/541 (the cost studies' degenerate outputs): the load revealed nothing."""
    v = classify(DEFAULT, arm("c", "control", 541, 541), arm("t", "treatment", 541, 541),
                 paired=PairedCounts(541, 0, 0))
    assert v.label is Label.REPORTED_AS_OBSERVED
    assert [c.met for c in v.labels[0].criteria] == [True, False, False]
    assert v.basis == (
        "no declared label had all its criteria met ('working': control diverges under the same "
        "load: control's one-sided 95 % Wilson upper bound 1.0000 (needs <= 0.99) and "
        "treatment beats control: McNemar p, paired by prompt, treatment ahead 1 (needs < "
        "0.05); "
        "'doubtful': treatment's one-sided 95 % Wilson upper bound 1.0000 (needs < 0.99)); the "
        "rule's 'otherwise' label applies")


def test_a_treatment_that_diverges_is_doubtful():
    """Study 1(a)'s FlashAttention-3 arm: 84/541 against the default's 83/541."""
    v = classify(DEFAULT, arm("c", "control", 83, 541), arm("t", "treatment", 84, 541),
                 paired=PairedCounts(541, 0, 1))
    assert v.label is Label.DOUBTFUL
    (ub,) = v.labels[1].criteria
    assert ub.observed == pytest.approx(stats.wilson_interval(84, 541, 0.95, "less").high)


def test_mcnemar_needs_the_treatment_ahead():
    """A small p with the control ahead is not the treatment beating it."""
    crit = {"criterion": "treatment_beats_control", "mcnemar_below": 0.05}
    v = classify(rule(crit), arm("c", "control", 500, 541), arm("t", "treatment", 480, 541),
                 paired=PairedCounts(541, 30, 10))
    (beats,) = v.labels[0].criteria
    # exact below 25 discordant prompts does not apply (40): chi-square, (|30 - 10| - 1)^2 / 40
    assert beats.observed == pytest.approx(sps.chi2.sf(19 ** 2 / 40, 1))
    assert beats.observed < 0.05 and beats.met is False
    assert beats.observed_text.endswith("treatment not ahead)")
    v = classify(rule(crit), arm("c", "control", 480, 541), arm("t", "treatment", 500, 541),
                 paired=PairedCounts(541, 3, 10))
    (beats,) = v.labels[0].criteria
    assert beats.observed == pytest.approx(2 * sps.binom.cdf(3, 13, 0.5))   # exact, 13 < 25
    assert beats.met is False   # 0.092 is not below 0.05
    assert classify(rule(crit), arm("c", "control", 480, 541), arm("t", "treatment", 500, 541)
                    ).labels[0].criteria[0].reason == ("no paired counts: the arms were not "
                                                       "compared prompt by prompt")


def test_newcombe_and_require_both_or_either():
    """Newcombe (1998) Table II example (a): 56/70 vs 48/80 -> [0.0524, 0.3339]."""
    newcombe = {"criterion": "treatment_beats_control", "newcombe_at_least": 0.06}
    both = {**newcombe, "mcnemar_below": 0.05}
    c, t = arm("c", "control", 48, 80), arm("t", "treatment", 56, 70)
    v = classify(rule(newcombe), c, t)
    (crit,) = v.labels[0].criteria
    assert crit.observed == pytest.approx(0.0524, abs=5e-5) and crit.met is False
    assert crit.threshold == ">= 0.06"
    paired = PairedCounts(70, 0, 20)   # McNemar p far below 0.05, treatment ahead
    v = classify(rule(both), c, t, paired=paired)
    (crit,) = v.labels[0].criteria
    assert crit.observed is False and crit.met is False
    assert crit.description == ("treatment beats control: Newcombe 95 % interval of treatment − "
                                "control match rate, lower end and McNemar p, paired by prompt, "
                                "treatment ahead")
    assert crit.threshold == ">= 0.06 and < 0.05"
    assert crit.observed_text.startswith("no (Newcombe lower end 0.0524 (Newcombe interval "
                                         "[+0.0524, +0.3339]); McNemar p 1.907e-06 (McNemar:")
    v = classify(rule({**both, "require": "either"}), c, t, paired=paired)
    assert v.labels[0].criteria[0].met is True and v.label is Label.WORKING
    # either: one test not evaluable does not stop the other from meeting it
    v = classify(rule({**both, "require": "either", "newcombe_at_least": 0.0}), c, t)
    assert v.labels[0].criteria[0].met is True
    # both: one test failing decides it even when the other is not evaluable
    v = classify(rule(both), c, t)
    assert v.labels[0].criteria[0].met is False


def test_probe_confirmed_reads_the_arms_outcome_and_no_power_is_not_met():
    r = rule({"criterion": "match_lower_bound", "at_least": 0.99},
             {"criterion": "probe_confirmed"})
    c, t = arm("c", "control", 0, 541), arm("t", "treatment", 541, 541)
    ok = classify(r, c, t, evidence=ActivationEvidence(probe="confirmed", probe_recorded=True))
    assert ok.label is Label.WORKING
    assert ok.labels[0].criteria[1].observed_text == ("confirmed (bitwise invariant; the negative "
                                                      "control differed)")
    for outcome in ("no_power", "violated", "vacuous", "untested"):
        v = classify(r, c, t, evidence=ActivationEvidence(probe=outcome, probe_recorded=True))
        assert v.labels[0].criteria[1].met is False, outcome
        assert v.label is Label.REPORTED_AS_OBSERVED, outcome


def test_missing_activation_evidence_makes_the_comparison_untested_never_working():
    r = Rule.model_validate({"labels": [
        {"label": "working", "all": [{"criterion": "match_lower_bound", "at_least": 0.99},
                                     {"criterion": "probe_confirmed"}]},
        {"label": "doubtful", "all": [{"criterion": "match_lower_bound", "at_least": 0.5}]}]})
    c, t = arm("c", "control", 0, 541), arm("t", "treatment", 541, 541)
    v = classify(r, c, t)
    assert v.label is Label.UNTESTED
    assert v.untested_reasons == (
        "'working' could not be decided: the probe confirmed the treatment (bitwise, with a "
        "negative control that showed power) is not evaluable (no probe report in the run "
        "directory; record one with `bistat probe REGISTRATION --output RUN_DIR/probe.json`, "
        "then analyse again)",)
    v = classify(r, c, t, evidence=ActivationEvidence(probe=None, probe_recorded=True))
    assert v.label is Label.UNTESTED
    assert "the probe report does not probe arm 't'" in v.untested_reasons[0]
    # a label already ruled out by another criterion needs no evidence: the next label decides
    v = classify(r, c, arm("t", "treatment", 300, 541))
    assert v.label is Label.DOUBTFUL
    # the old criteria keep their meaning: not evaluable -> not met, the next label is tried
    old = Rule.model_validate({"labels": [
        {"label": "working", "all": [{"criterion": "throughput_slower", "bound": 0.9}]},
        {"label": "doubtful", "all": [{"criterion": "match_lower_bound", "at_least": 0.5}]}]})
    v = classify(old, arm("c", "control", 0, 541, (1.0,)), arm("t", "treatment", 541, 541, (1.0,)))
    assert v.label is Label.DOUBTFUL


def test_engine_log_is_reported_but_never_sufficient_alone():
    with pytest.raises(ValueError, match="engine_log is circumstantial evidence, never "
                                         "sufficient alone"):
        rule({"criterion": "match_lower_bound", "at_least": 0.99},
             {"criterion": "engine_log", "marker": "batch_invariant_kernels"})
    r = rule({"criterion": "control_diverges", "at_most": 0.99},
             {"criterion": "engine_log", "marker": "batch_invariant_kernels"})
    c, t = arm("c", "control", 0, 541), arm("t", "treatment", 541, 541)
    seen = ActivationEvidence(log_markers={"batch_invariant_kernels": True, "tuned_gemm": False})
    v = classify(r, c, t, evidence=seen)
    assert v.label is Label.WORKING and v.labels[0].criteria[1].observed_text == "yes"
    assert v.labels[0].criteria[1].description == ("engine log shows the batch-invariant "
                                                   "kernels registering (circumstantial)")
    v = classify(r, c, t, evidence=ActivationEvidence(log_markers={}))
    assert v.label is Label.REPORTED_AS_OBSERVED
    v = classify(r, c, t)
    assert v.label is Label.UNTESTED
    assert v.untested_reasons[0].endswith("(no engine log was kept for the treatment arm 't')")


def test_validity_failures_still_come_first():
    v = classify(DEFAULT, arm("c", "control", 0, 541), arm("t", "treatment", 541, 541),
                 [ValidityCheck("same GPU", False, "a; b", "same", "")],
                 paired=PairedCounts(541, 0, 541))
    assert v.label is Label.UNTESTED
    assert v.cost.outcome is CostOutcome.UNTESTED
    assert v.cost.statement == "cost not assessed (untested)"
    assert v.headline == "untested — cost not assessed (untested)"


# ---- the cost rule ------------------------------------------------------------------------

COST = CostRule(margin=0.10)


def test_cost_outcomes_and_their_fixed_sentences():
    c = arm("c", "control", 0, 0, (100.0, 101.0, 99.0, 100.5))
    costs = classify_cost(COST, c, arm("t", "treatment", 0, 0, (70.0, 71.0, 69.5, 70.5)))
    assert costs.outcome is CostOutcome.COSTS
    rr = stats.throughput_ratio((70.0, 71.0, 69.5, 70.5), c.pass_throughputs)
    low, high = rr.interval.low, rr.interval.high
    assert costs.interval == rr.interval
    assert costs.statement == (f"costs {(1 - high) * 100:.0f} %–{(1 - low) * 100:.0f} % of "
                               f"throughput (ratio 0.70, 95 % interval {low:.2f}–{high:.2f})")
    faster = classify_cost(COST, c, arm("t", "treatment", 0, 0, (130.0, 131.0, 129.0, 130.5)))
    assert faster.outcome is CostOutcome.FASTER
    assert faster.statement.startswith("faster: throughput 1.28×–1.32× the control's (ratio 1.30")
    assert set(COST_SENTENCES) == set(CostOutcome)
    assert len(set(COST_SENTENCES.values())) == len(CostOutcome)
    assert costs.sentence == COST_SENTENCES[CostOutcome.COSTS]


def test_undecidable_says_how_many_passes_would_decide_it():
    c = arm("c", "control", 0, 0, (100.0, 110.0, 92.0))
    t = arm("t", "treatment", 0, 0, (95.0, 99.0, 90.0))
    v = classify_cost(COST, c, t)
    assert v.outcome is CostOutcome.UNDECIDABLE
    point = stats.ratio_of_geometric_means(t.pass_throughputs, c.pass_throughputs)
    cv = stats.pooled_cv([t.pass_throughputs, c.pass_throughputs]).cv
    need = design.passes_to_decide(0.10, point, cv, 0.95, "throughput")
    assert v.passes_to_decide == need and need is not None and need > 3
    assert v.cv == pytest.approx(cv)
    iv = stats.throughput_ratio(t.pass_throughputs, c.pass_throughputs).interval
    assert v.statement.startswith(f"cost undecidable at 3 passes (ratio {point:.2f}, 95 % "
                                  f"interval {iv.low:.2f}–{iv.high:.2f}")
    assert v.statement.endswith(f"; about {need} passes per arm would decide it)")
    one = classify_cost(COST, arm("c", "control", 0, 0, (100.0,)),
                        arm("t", "treatment", 0, 0, (90.0,)))
    assert one.outcome is CostOutcome.UNDECIDABLE and one.ratio == 0.9
    assert one.statement == ("cost undecidable at 1 pass (needs at least 2 counted passes per "
                             "arm for an interval)")


def test_latency_cost_is_a_ratio_above_one():
    c = arm("c", "control", 0, 0, (1.0,), latencies=(0.75, 0.76, 0.74, 0.755))
    t = arm("t", "treatment", 0, 0, (1.0,), latencies=(2.48, 2.49, 2.47, 2.50))
    v = classify_cost(CostRule(metric="latency", margin=0.10), c, t)
    assert v.outcome is CostOutcome.COSTS
    rr = stats.throughput_ratio(t.pass_latencies, c.pass_latencies)
    point = stats.ratio_of_geometric_means(t.pass_latencies, c.pass_latencies)
    lo, hi = rr.interval.low, rr.interval.high
    assert v.statement == (f"costs {lo:.2f}×–{hi:.2f}× the control's latency (ratio {point:.2f}, "
                           f"95 % interval {lo:.2f}–{hi:.2f})")
    quick = classify_cost(CostRule(metric="latency", margin=0.10), c,
                          arm("t", "treatment", 0, 0, (1.0,), latencies=(0.30, 0.31, 0.29, 0.3)))
    assert quick.outcome is CostOutcome.FASTER
    missing = classify_cost(CostRule(metric="latency", margin=0.10),
                            arm("c", "control", 0, 0, (1.0, 2.0)), arm("t", "treatment", 0, 0,
                                                                       (1.0, 2.0)))
    assert missing.outcome is CostOutcome.UNDECIDABLE
    assert missing.reason == ("needs at least 2 counted passes per arm with a latency, got 0 "
                              "(treatment) and 0 (control)")


#: The cost outcomes from worst to best: a faster treatment may only move up this order.
COST_ORDER = (CostOutcome.COSTS, CostOutcome.UNDECIDABLE, CostOutcome.NO_MEASURABLE_COST,
              CostOutcome.FASTER)


def _cost_arms(metric, c, t):
    key = "passes" if metric == "throughput" else "latencies"
    return (arm("c", "control", 0, 0, **{key: c}), arm("t", "treatment", 0, 0, **{key: t}))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(80.0, 120.0), min_size=2, max_size=8),
       st.lists(st.floats(80.0, 120.0), min_size=2, max_size=8),
       st.sampled_from(["throughput", "latency"]))
def test_no_cost_or_faster_is_the_one_sided_welch_test_at_half_the_level(t, c, metric):
    """No measurable cost or faster <=> scipy's one-sided Welch t test on the logs rejects
    "slower by more than the margin" at alpha = (1 - 0.95) / 2: for throughput H0 ratio <= 0.9
    (log t - log 0.9 against log c, alternative "greater"), for latency H0 ratio >= 1.1
    (log t - log 1.1, alternative "less"). Non-inferiority at the two-sided interval's slower
    end, not TOST equivalence."""
    got = classify_cost(CostRule(metric=metric, margin=0.10), *_cost_arms(metric, c, t))
    slower = 0.9 if metric == "throughput" else 1.1
    alternative = "greater" if metric == "throughput" else "less"
    res = sps.ttest_ind(np.log(t) - math.log(slower), np.log(c), equal_var=False,
                        alternative=alternative)
    if math.isnan(res.pvalue):
        return
    iv = stats.throughput_ratio(t, c, 0.95).interval
    near = min(abs(end - bound) for end in (iv.low, iv.high) for bound in (0.9, 1.1))
    if near > 1e-9:
        assert (got.outcome in (CostOutcome.NO_MEASURABLE_COST, CostOutcome.FASTER)) == \
            (res.pvalue < 0.025), (got.statement, res.pvalue)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.05, 500.0), st.floats(0.3, 3.0),
       st.lists(st.floats(-0.4, 0.4), min_size=2, max_size=12),
       st.lists(st.floats(-0.4, 0.4), min_size=2, max_size=12),
       st.floats(1e-3, 1.0 - 1e-6), st.floats(0.01, 0.5), st.sampled_from([0.8, 0.9, 0.95, 0.99]),
       st.sampled_from(["throughput", "latency"]))
def test_a_faster_treatment_never_gets_a_worse_cost_outcome(base, ratio, c_log, t_log, f, margin,
                                                            level, metric):
    """The product's standing rule: scaling the treatment's per-pass values in the faster
    direction (latency x f, throughput / f, 0 < f < 1) never moves its outcome down the order
    costs < undecidable < no measurable cost < faster, for any margin and level. Per-pass values
    ``base * exp(noise)`` (control) and ``base * ratio * exp(noise)`` (treatment), the noise
    random per pass, so every outcome is reached."""
    c = [base * math.exp(e) for e in c_log]
    t = [base * ratio * math.exp(e) for e in t_log]
    rule_ = CostRule(metric=metric, margin=margin, confidence_level=level)
    quicker = [x * f for x in t] if metric == "latency" else [x / f for x in t]
    assume(len(set(quicker)) == len(set(t)))   # values a rounding apart may not merge
    # the outcome is all this test reads: the undecidable branch's (slow) search for the passes
    # that would decide it is skipped
    with mock.patch.object(design_ratio, "passes_to_decide", return_value=None):
        before = classify_cost(rule_, *_cost_arms(metric, c, t))
        after = classify_cost(rule_, *_cost_arms(metric, c, quicker))
    if before.interval is None:    # no pass-to-pass variation: no interval either way
        assert after.outcome is before.outcome is CostOutcome.UNDECIDABLE
        return
    assert COST_ORDER.index(after.outcome) >= COST_ORDER.index(before.outcome), \
        (before.statement, after.statement)


def test_a_latency_ratio_of_092_within_its_slower_margin_is_no_measurable_cost():
    """The real run that showed the defect: latency ratio 0.92, 95 % interval 0.89-0.955 against
    a 5 % margin, 90 passes per arm, was "cost undecidable ... no number of passes up to 200
    would decide it", while an interval of 0.96-1.04 was "no measurable cost". Its slower end
    (0.955) is within 1.05: no measurable cost, possibly faster."""
    z = sps.norm.ppf((np.arange(90) + 0.5) / 90)             # mean 0: geometric mean 1
    sigma = math.log(0.9548 / 0.92) / (sps.t.ppf(0.975, 178) * np.std(z, ddof=1)
                                       * math.sqrt(2 / 90))
    control = 0.8 * np.exp(sigma * z)
    treatment = 0.8 * 0.92 * np.exp(sigma * z[::-1])
    rule_ = CostRule(metric="latency", margin=0.05)
    v = classify_cost(rule_, *_cost_arms("latency", control, treatment))
    assert v.ratio == pytest.approx(0.92)
    assert v.interval.low == pytest.approx(0.8865, abs=5e-4)
    assert v.interval.high == pytest.approx(0.9548, abs=1e-4)
    assert v.outcome is CostOutcome.NO_MEASURABLE_COST
    assert v.statement == ("no measurable cost (ratio 0.92, 95 % interval 0.89–0.955; "
                           "possibly faster)")
    assert v.sentence == COST_SENTENCES[CostOutcome.NO_MEASURABLE_COST]
    assert v.passes_to_decide is None
    # as fast as the control with the same spread: no measurable cost, nothing more to say
    same = classify_cost(rule_, *_cost_arms("latency", control, 0.8 * np.exp(sigma * z[::-1])))
    assert same.outcome is CostOutcome.NO_MEASURABLE_COST
    assert same.statement.endswith(" 0.96–1.04)")
    # wholly beyond the faster margin: faster
    quick = classify_cost(rule_, *_cost_arms("latency", control, 0.7 * 0.8 * np.exp(sigma * z)))
    assert quick.outcome is CostOutcome.FASTER
    # the same run as throughput (1 / latency): the mirror image, the same outcome
    v = classify_cost(CostRule(metric="throughput", margin=0.05),
                      *_cost_arms("throughput", 1 / control, 1 / treatment))
    assert v.outcome is CostOutcome.NO_MEASURABLE_COST
    assert v.statement == ("no measurable cost (ratio 1.09, 95 % interval 1.047–1.13; "
                           "possibly faster)")


def test_a_ratio_reaching_across_the_slower_margin_stays_undecidable():
    """Undecidable is left only for an interval across the slower margin; one across the faster
    margin alone is no measurable cost."""
    c = arm("c", "control", 0, 0, (100.0, 110.0, 92.0))
    across_slower = classify_cost(COST, c, arm("t", "treatment", 0, 0, (95.0, 99.0, 90.0)))
    assert across_slower.outcome is CostOutcome.UNDECIDABLE
    assert across_slower.interval.low < 0.9 <= across_slower.interval.high
    across_faster = classify_cost(COST, c, arm("t", "treatment", 0, 0, (120.0, 132.0, 110.4)))
    assert across_faster.interval.low >= 0.9 and across_faster.interval.high > 1.1
    assert across_faster.outcome is CostOutcome.NO_MEASURABLE_COST
    assert across_faster.statement.endswith("; possibly faster)")


# ---- published summaries, one rounding ----------------------------------------------------


def test_seed_003_from_its_summary_numbers_is_reported_as_observed():
    """The published protocol's seed 003: 78/541 without the mode, 541/541 with it, throughput
    ratio 0.979 -> "reported as observed" (the slowdown criterion is not met; the intervals do
    not overlap)."""
    v = classify(PUBLISHED, arm("default", "control", 78, 541, ()),
                 arm("batch-invariant", "treatment", 541, 541, ()),
                 ratio=RatioSummary(0.979))
    assert v.label is Label.REPORTED_AS_OBSERVED
    lb, point = v.labels[0].criteria
    assert lb.met is True and point.observed == 0.979 and point.met is False
    assert point.observed_text == "0.9790 (published point estimate)"
    overlap = v.labels[1].criteria[0]
    assert overlap.observed is False


def test_one_rounding_shows_the_side_of_the_bound_that_decided():
    # a one-pass ratio of 90 to 100 is 0.9 exactly: shown 0.9000 and not below 0.90
    v = classify(PUBLISHED, arm("c", "control", 78, 541, (100.0,)),
                 arm("t", "treatment", 541, 541, (90.0,)))
    point = v.labels[0].criteria[1]
    assert point.observed == 0.9 and point.met is False
    assert point.observed_text == "0.9000 (1 vs 1 counted passes)"
    assert format_decided(0.98996, [0.99]) == "0.98996"
    assert format_decided(0.899996, [0.9], digits=2) == "0.899996"
    assert format_decided(0.5, [0.9]) == "0.5000"


# ---- registration: criteria a run could never evaluate are refused --------------------------


def _declaration(name="t", **changes):
    import tomllib
    data = tomllib.loads(declaration_template(name))
    for path, value in changes.items():
        *head, last = path.split(".")
        node = data
        for key in head:
            node = node[key]
        node[last] = value
    return data


def test_the_template_validates_and_uses_the_default_rule():
    exp = validate_experiment(_declaration("demo"))
    assert exp.rule == DEFAULT
    assert exp.workload.n_prompts == 288 and exp.workload.passes == 3


def test_unevaluable_criteria_are_refused_naming_the_criterion_and_the_fix():
    data = _declaration(**{"workload.passes": 1})
    data["rule"]["labels"][0]["all"].append({"criterion": "engine_log", "marker": "tuned_gemm"})
    with pytest.raises(DeclarationError) as err:
        validate_experiment(data, source="experiments/t.toml")
    assert err.value.messages == [
        "experiments/t.toml: rule.labels[0].all[1]: control_diverges needs at least 2 counted "
        "passes per arm, but workload.passes = 1: a single pass always matches itself, so no arm "
        "can diverge; set workload.passes >= 2",
        "experiments/t.toml: rule.labels[0].all[2]: treatment_beats_control needs at least 2 "
        "counted passes per arm, but workload.passes = 1: a single pass always matches itself, "
        "so no arm can diverge; set workload.passes >= 2",
        "experiments/t.toml: rule.labels[0].all[3]: engine_log cannot be evaluated: engine.kind "
        "'embedded' keeps no engine log (only 'vllm-server', 'vllm-offline', 'sglang-server', "
        "'command-server' do); remove the criterion or run on one of those engines",
        "experiments/t.toml: rule.cost: the cost rule needs at least 2 counted passes per arm for "
        "the ratio's interval, but workload.passes = 1; set workload.passes >= 2 or remove "
        "[rule.cost]"]


def test_bad_activation_criteria_fields_are_named():
    data = _declaration()
    data["rule"]["labels"][0]["all"][2] = {"criterion": "treatment_beats_control"}
    data["rule"]["cost"]["margin"] = 1.5
    with pytest.raises(DeclarationError) as err:
        validate_experiment(data, source="experiments/t.toml")
    assert err.value.messages == [
        "experiments/t.toml: rule.labels[0].all[2]: give newcombe_at_least (e.g. 0.0), "
        "mcnemar_below (e.g. 0.05) or both",
        "experiments/t.toml: rule.cost.margin: must be less than 1.0, got 1.5"]


def test_a_sealed_rule_without_the_new_fields_still_resolves():
    """Additive: registrations sealed before the cost rule and the activation criteria existed
    lack rule.cost and the control's assumed rate; the current schema fills in None and the
    default, and verifies them."""
    from bistat.declare.prereg import load_registration
    reg = load_registration(ROOT / "preregistrations" / "quickstart.json")
    assert "cost" not in reg.declaration["rule"]
    exp = reg.experiment()
    assert exp.rule.cost is None and exp.design.assumed_control_match_rate == 0.9


def test_random_passes_never_change_the_working_label_of_the_default_rule():
    """The default rule's working label reads no throughput: the same counts with any passes
    give the same label."""
    rng = np.random.default_rng(20261202)
    c0, t0 = arm("c", "control", 10, 541), arm("t", "treatment", 541, 541)
    base = classify(DEFAULT, c0, t0, paired=PairedCounts(541, 0, 531)).label
    for _ in range(20):
        cp = tuple(100 * np.exp(0.2 * rng.standard_normal(3)))
        tp = tuple(60 * np.exp(0.2 * rng.standard_normal(3)))
        got = classify(DEFAULT, arm("c", "control", 10, 541, cp), arm("t", "treatment", 541, 541,
                                                                      tp),
                       paired=PairedCounts(541, 0, 531)).label
        assert got is base is Label.WORKING


# ---- the cost rule, passes paired (``interval = "paired"``) -----------------------------------

PAIRED = CostRule(margin=0.05, interval="paired")


def test_a_paired_cost_rule_decides_where_a_drift_common_to_both_arms_leaves_welch_undecided():
    """Both arms slow down over the run alike (as the 2026-12-03 workload-(i) pilot did); the
    treatment is 4 % slower within every pair. Welch, treating passes as independent, cannot
    tell a 4 % cost from the drift; the paired interval can."""
    drift = (100.0, 97.0, 93.0, 90.0, 88.0, 86.0, 85.0, 84.0)
    c = ArmStats("c", "control", 0, 0, drift, throughput_passes=tuple(range(1, 9)))
    t = ArmStats("t", "treatment", 0, 0, tuple(x * 0.96 * (1.002 if i % 2 else 0.998)
                                             for i, x in enumerate(drift)),
                 throughput_passes=tuple(range(1, 9)))
    welch = classify_cost(CostRule(margin=0.05), c, t)
    paired = classify_cost(PAIRED, c, t)
    assert welch.outcome is CostOutcome.UNDECIDABLE and welch.n_pairs is None
    assert "at 8 passes" in welch.statement
    rr = stats.paired_ratio(t.pass_throughputs, c.pass_throughputs)
    assert paired.interval == rr.interval and paired.interval.method == "paired-log"
    assert paired.ratio == pytest.approx(rr.ratio) and paired.n_pairs == 8
    assert paired.outcome is CostOutcome.NO_MEASURABLE_COST     # 0.957-0.963 within [0.95, 1.05]
    assert (round(rr.interval.low, 3), round(rr.interval.high, 3)) == (0.958, 0.962)
    assert paired.statement == "no measurable cost (ratio 0.96, 95 % interval 0.96–0.96)"
    assert paired.to_dict()["n_pairs"] == 8 and "n_pairs" not in welch.to_dict()
    assert PAIRED.describe() == ("throughput ratio (treatment ÷ control, output tokens/s per "
                                 "pass), 95 % paired interval against [0.95, 1.05]")
    assert CostRule(margin=0.05).describe().endswith("95 % interval against [0.95, 1.05]")


def test_a_paired_cost_rule_pairs_by_pass_index_and_needs_two_pairs():
    # pass 2 of the treatment is missing: pass 3 pairs with pass 3, not with the control's pass 2
    c = ArmStats("c", "control", 0, 0, (100.0, 50.0, 100.0, 100.0), throughput_passes=(1, 2, 3, 4))
    t = ArmStats("t", "treatment", 0, 0, (90.0, 91.0, 89.0), throughput_passes=(1, 3, 4))
    v = classify_cost(PAIRED, c, t)
    assert v.n_pairs == 3
    assert v.ratio == pytest.approx(stats.paired_ratio((90.0, 91.0, 89.0), (100.0,) * 3).ratio)
    assert v.outcome is CostOutcome.COSTS
    # no pass indices (a hand-made ArmStats): paired by position
    bare = classify_cost(PAIRED, ArmStats("c", "control", 0, 0, (100.0, 102.0, 98.0)),
                         ArmStats("t", "treatment", 0, 0, (99.0, 101.0, 97.0)))
    assert bare.n_pairs == 3 and bare.ratio == pytest.approx(
        stats.paired_ratio((99.0, 101.0, 97.0), (100.0, 102.0, 98.0)).ratio)
    one = classify_cost(
        PAIRED, ArmStats("c", "control", 0, 0, (100.0, 101.0), throughput_passes=(1, 2)),
        ArmStats("t", "treatment", 0, 0, (99.0, 98.0), throughput_passes=(2, 3)))
    assert one.outcome is CostOutcome.UNDECIDABLE and one.n_pairs == 1
    assert one.statement == ("cost undecidable at 1 pair of passes (needs at least 2 for a "
                             "paired interval)")


def test_a_paired_cost_rule_is_declared_in_rule_cost_and_a_bad_value_is_named():
    assert Rule.model_validate({**default_rule().model_dump(), "cost": {
        "margin": 0.05, "interval": "paired"}}).cost.interval == "paired"
    with pytest.raises(Exception, match="interval"):
        CostRule(margin=0.05, interval="blocked")


def test_an_undecidable_cost_without_an_interval_does_not_speak_of_the_interval():
    """One pair of passes: no interval exists, so its sentence says so instead of "the ratio's
    interval reaches across the margin"; with an interval that does, that sentence."""
    from bistat.core.classify import COST_SENTENCE_NO_INTERVAL, COST_SENTENCES

    one = classify_cost(
        PAIRED, ArmStats("c", "control", 0, 0, (100.0, 101.0), throughput_passes=(1, 2)),
        ArmStats("t", "treatment", 0, 0, (99.0, 98.0), throughput_passes=(2, 3)))
    assert one.outcome is CostOutcome.UNDECIDABLE and one.interval is None
    assert one.sentence == COST_SENTENCE_NO_INTERVAL == (
        "The cost is undecidable at these passes: there is no interval of the ratio to decide it "
        "on.")
    wide = classify_cost(CostRule(margin=0.01),
                         ArmStats("c", "control", 0, 0, (100.0, 80.0, 120.0)),
                         ArmStats("t", "treatment", 0, 0, (90.0, 110.0, 95.0)))
    assert wide.outcome is CostOutcome.UNDECIDABLE and wide.interval is not None
    assert wide.sentence == COST_SENTENCES[CostOutcome.UNDECIDABLE]
    assert "reaches across the margin" in wide.sentence
