"""The decision rule and the classifier: the published rule's examples, the improved form,
*untested*, not-evaluable criteria, property tests and the false-*working* rate at the boundary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from bistat.core.classify import SENTENCES, ArmStats, RunTestable, ValidityCheck, classify
from bistat.declare.experiment import load_experiment
from bistat.core.rule import Label, Rule

ROOT = Path(__file__).resolve().parents[1]

# The published rule, loaded from the committed declaration (nothing hard-coded here either).
PUBLISHED = load_experiment(ROOT / "experiments" / "published-protocol.toml").rule
# The improved form: ratio interval from repeat passes.
IMPROVED = Rule.model_validate({
    "labels": [
        {"label": "working", "all": [
            {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
            {"criterion": "throughput_slower", "bound": 0.90}]},
        {"label": "doubtful", "all": [
            {"criterion": "match_intervals_overlap"},
            {"criterion": "throughput_not_slower", "margin_low": 0.95, "margin_high": 1.05}]},
    ]})


def arm(name, role, k, n, passes, drifts=None):
    return ArmStats(name, role, n, k, tuple(float(x) for x in passes), drifts)


# ---- the published rule's examples (541 prompts; Wilson 541/541 -> [0.993, 1], 78/541 ->
# [0.117, 0.176], the published values)

def test_published_working():
    v = classify(PUBLISHED, arm("off", "control", 78, 541, [100.0]),
                 arm("on", "treatment", 541, 541, [60.0]))
    assert v.label is Label.WORKING
    assert v.sentence == "Batch invariance is working by the registered rule."
    assert v.basis == "every criterion declared for 'working' was met"
    assert (v.treatment, v.control) == ("on", "off")
    working, doubtful = v.labels
    lb, ratio = working.criteria
    assert lb.description == "treatment's 95 % Wilson match interval, lower end"
    assert lb.threshold == ">= 0.99"
    assert lb.observed == pytest.approx(0.99295, abs=5e-5)
    assert lb.observed_text == "0.9929 (541 of 541 matched; two-sided interval [0.9929, 1.0000])"
    assert lb.met is True
    assert ratio.description == "throughput ratio (treatment ÷ control), point estimate"
    assert ratio.threshold == "< 0.9"
    assert ratio.observed == pytest.approx(0.6)
    assert ratio.observed_text == "0.6000 (1 vs 1 counted passes)"
    assert ratio.met is True
    overlap, ratio2 = doubtful.criteria
    assert overlap.observed is False
    assert overlap.observed_text == ("no (treatment [0.9929, 1.0000], control [0.1171, "
                                     "0.1763])")
    assert overlap.met is False and ratio2.met is False
    assert v.untested_reasons == () and v.notes == ()


def test_published_doubtful():
    v = classify(PUBLISHED, arm("off", "control", 80, 541, [100.0, 101.0]),
                 arm("on", "treatment", 78, 541, [99.0, 100.0]))
    assert v.label is Label.DOUBTFUL
    assert v.sentence == "Batch invariance is doubtful by the registered rule."
    assert [c.met for c in v.labels[0].criteria] == [False, False]
    assert [c.met for c in v.labels[1].criteria] == [True, True]


def test_published_reported_as_observed():
    # perfect match but no slowdown, and intervals that do not overlap: neither label
    v = classify(PUBLISHED, arm("off", "control", 78, 541, [100.0]),
                 arm("on", "treatment", 541, 541, [97.0]))
    assert v.label is Label.REPORTED_AS_OBSERVED
    assert v.basis == ("no declared label had all its criteria met ('working': throughput ratio "
                       "(treatment ÷ control), point estimate 0.9700 (needs < 0.9); 'doubtful': "
                       "treatment's and control's 95 % Wilson match intervals overlap: no (needs "
                       "yes)); the rule's 'otherwise' label applies")
    assert v.sentence == SENTENCES[Label.REPORTED_AS_OBSERVED]
    # a slowdown between 0.90 and 0.95 with overlapping intervals: neither label either
    v = classify(PUBLISHED, arm("off", "control", 80, 541, [100.0]),
                 arm("on", "treatment", 78, 541, [92.0]))
    assert v.label is Label.REPORTED_AS_OBSERVED
    # the threshold is a lower bound of 0.99: 540 of 541 gives 0.9896, not enough
    v = classify(PUBLISHED, arm("off", "control", 78, 541, [100.0]),
                 arm("on", "treatment", 540, 541, [50.0]))
    assert v.labels[0].criteria[0].observed == pytest.approx(0.98960, abs=1e-5)
    assert v.label is Label.REPORTED_AS_OBSERVED


def test_boundaries_are_as_declared():
    # below 0.90 is strict; at least 0.95 includes 0.95
    at_090 = classify(PUBLISHED, arm("c", "control", 78, 541, [100.0]),
                      arm("t", "treatment", 541, 541, [90.0]))
    assert at_090.labels[0].criteria[1].met is False
    at_095 = classify(PUBLISHED, arm("c", "control", 78, 541, [100.0]),
                      arm("t", "treatment", 80, 541, [95.0]))
    assert at_095.labels[1].criteria[1].observed == pytest.approx(0.95)
    assert at_095.labels[1].criteria[1].met is True


# ---- the improved form

def test_improved_working_with_interval():
    v = classify(IMPROVED, arm("c", "control", 78, 541, [100.0, 101.0, 99.0]),
                 arm("t", "treatment", 541, 541, [90.0, 92.0, 88.0]))
    slower = v.labels[0].criteria[1]
    assert slower.threshold == "< 0.9"
    # stats.throughput_ratio([90, 92, 88], [100, 101, 99]) = 0.8999, interval [0.8587, 0.9431]
    assert slower.observed == pytest.approx(0.9431, abs=1e-4)
    assert slower.met is False
    assert v.label is Label.REPORTED_AS_OBSERVED
    v = classify(IMPROVED, arm("c", "control", 78, 541, [100.0, 101.0, 99.0]),
                 arm("t", "treatment", 541, 541, [70.0, 72.0, 71.0]))
    assert v.label is Label.WORKING


def test_improved_doubtful_by_tost():
    v = classify(IMPROVED, arm("c", "control", 100, 541, [100.0, 100.5, 99.5]),
                 arm("t", "treatment", 101, 541, [99.0, 101.0, 100.0]))
    tost = v.labels[1].criteria[1]
    assert tost.threshold == "within [0.95, 1.05]"
    assert tost.observed == pytest.approx(0.0026, abs=1e-4)  # stats.tost_ratio docstring
    assert tost.met is True
    assert v.label is Label.DOUBTFUL


def test_not_slower_lower_bound_and_interval_statistics():
    rule = Rule.model_validate({"otherwise": "doubtful", "labels": [
        {"label": "working", "all": [
            {"criterion": "throughput_not_slower", "lower_at_least": 0.85},
            {"criterion": "throughput_ratio", "statistic": "interval_high", "below": 0.95},
            {"criterion": "throughput_ratio", "statistic": "interval_low", "at_least": 0.85},
        ]}]})
    v = classify(rule, arm("c", "control", 5, 5, [100.0, 101.0, 99.0]),
                 arm("t", "treatment", 5, 5, [90.0, 92.0, 88.0]))
    assert [c.observed for c in v.labels[0].criteria] == pytest.approx([0.8587, 0.9431, 0.8587],
                                                                      abs=1e-4)
    assert [c.met for c in v.labels[0].criteria] == [True, True, True]
    assert v.label is Label.WORKING
    v = classify(rule, arm("c", "control", 5, 5, [100.0, 101.0, 99.0]),
                 arm("t", "treatment", 5, 5, [80.0, 92.0, 88.0]))
    assert v.label is Label.DOUBTFUL  # the rule's own fallback


def test_match_upper_bound_and_large_drifts():
    rule = Rule.model_validate({"labels": [
        {"label": "doubtful", "all": [
            {"criterion": "match_upper_bound", "arm": "control", "below": 0.5},
            {"criterion": "large_drifts_at_most", "count": 2}]}]})
    v = classify(rule, arm("c", "control", 78, 541, [1.0]),
                 arm("t", "treatment", 78, 541, [1.0], drifts=2))
    ub, drift = v.labels[0].criteria
    assert ub.observed == pytest.approx(0.1763, abs=1e-4) and ub.met is True
    assert ub.description == "control's 95 % Wilson match interval, upper end"
    assert drift.observed == 2 and drift.met is True and drift.threshold == "<= 2"
    assert v.label is Label.DOUBTFUL
    v = classify(rule, arm("c", "control", 78, 541, [1.0]),
                 arm("t", "treatment", 78, 541, [1.0], drifts=None))
    assert v.labels[0].criteria[1].met is None
    assert v.label is Label.REPORTED_AS_OBSERVED
    assert v.notes == ("'doubtful' cannot be met: treatment's large-drift divergences is not "
                       "evaluable (the summary has no large-drift count for treatment arm 't')",)


def test_one_sided_alternative_uses_one_sided_bounds():
    rule = Rule.model_validate({"alternative": "greater", "labels": [
        {"label": "working", "all": [
            {"criterion": "match_lower_bound", "at_least": 0.99}]}]})
    v = classify(rule, arm("c", "control", 0, 300, [1.0]), arm("t", "treatment", 300, 300, [1.0]))
    # one-sided 95 % Wilson lower bound for 300/300: n / (n + z_0.95^2)
    z = sps.norm.ppf(0.95)
    assert v.labels[0].criteria[0].observed == pytest.approx(300 / (300 + z * z))
    assert v.label is Label.WORKING
    two_sided = classify(PUBLISHED, arm("c", "control", 0, 300, [1.0]),
                         arm("t", "treatment", 300, 300, [1.0]))
    assert two_sided.labels[0].criteria[0].met is False


# ---- untested and not evaluable

def test_untested_when_run_not_testable():
    v = classify(PUBLISHED, arm("c", "control", 78, 541, [100.0]),
                 arm("t", "treatment", 541, 541, [50.0]),
                 status=RunTestable(False, "engine refused VLLM_BATCH_INVARIANT=1"))
    assert v.label is Label.UNTESTED
    assert v.sentence == ("The hypothesis was not tested: the run could not test it, so its "
                          "results are evidence neither way.")
    assert v.untested_reasons == ("engine refused VLLM_BATCH_INVARIANT=1",)
    assert v.basis == "untested: engine refused VLLM_BATCH_INVARIANT=1"
    # the criteria are still shown
    assert v.labels[0].met is True


def test_untested_when_a_validity_check_fails_and_noted_when_unknown():
    checks = [ValidityCheck("min_mean_running", False, 1.1, 1.5, "arm 't' mean 1.1"),
              ValidityCheck("same_gpu", None, None, True, "no GPU UUID recorded"),
              ValidityCheck("max_preemptions", True, 0, 0, "")]
    v = classify(PUBLISHED, arm("c", "control", 78, 541, [100.0]),
                 arm("t", "treatment", 541, 541, [50.0]), checks)
    assert v.label is Label.UNTESTED
    assert v.untested_reasons == ("validity check min_mean_running failed: observed 1.1, "
                                  "limit 1.5 (arm 't' mean 1.1)",)
    assert v.notes == ("validity check same_gpu could not be evaluated: no GPU UUID recorded",)
    v = classify(PUBLISHED, arm("c", "control", 78, 541, [100.0]),
                 arm("t", "treatment", 541, 541, [50.0]), checks[1:])
    assert v.label is Label.WORKING


def test_every_request_failed_gives_not_evaluable_criteria():
    v = classify(PUBLISHED, arm("c", "control", 0, 0, []), arm("t", "treatment", 0, 0, []),
                 status=RunTestable(False, "every request failed"))
    assert v.label is Label.UNTESTED
    assert all(c.met is None for lr in v.labels for c in lr.criteria)
    assert v.labels[0].criteria[0].reason == "treatment arm 't' compared no prompts"
    assert v.labels[0].criteria[1].reason == "an arm has no counted pass"


def test_interval_criteria_need_repeat_passes():
    v = classify(IMPROVED, arm("c", "control", 78, 541, [100.0]),
                 arm("t", "treatment", 541, 541, [50.0]))
    assert v.label is Label.REPORTED_AS_OBSERVED
    slower = v.labels[0].criteria[1]
    assert slower.met is None and slower.observed_text == "not evaluable"
    assert slower.reason == ("needs at least 2 counted passes per arm, got 1 (treatment) and 1 "
                             "(control)")
    assert v.notes[0] == (
        "'working' cannot be met: throughput ratio 95 % interval, upper end (treatment slower) "
        "is not evaluable (needs at least 2 counted passes per arm, got 1 (treatment) and 1 "
        "(control))")


def test_verdict_to_dict_is_json_ready():
    import json
    v = classify(IMPROVED, arm("c", "control", 78, 541, [100.0, 101.0]),
                 arm("t", "treatment", 541, 541, [50.0, 51.0]))
    d = json.loads(json.dumps(v.to_dict()))
    assert d["label"] == "working"
    assert d["labels"][0]["criteria"][1]["declared"] == {"criterion": "throughput_slower",
                                                         "bound": 0.9}
    assert d["labels"][1]["met"] is False


# ---- property tests

throughput = st.floats(min_value=10.0, max_value=1000.0, allow_nan=False)
passes = st.lists(throughput, min_size=1, max_size=6)


@st.composite
def run_pairs(draw):
    n = draw(st.integers(min_value=1, max_value=3000))
    k = draw(st.integers(min_value=0, max_value=n))
    kc = draw(st.integers(min_value=0, max_value=n))
    return n, k, kc, draw(passes), draw(passes)


@settings(max_examples=200, deadline=None)
@given(run_pairs(), st.sampled_from([PUBLISHED, IMPROVED]), st.integers(1, 50))
def test_more_matches_never_leave_working(pair, rule, extra):
    n, k, kc, t_passes, c_passes = pair
    control = arm("c", "control", kc, n, c_passes)
    v = classify(rule, control, arm("t", "treatment", k, n, t_passes))
    more = classify(rule, control, arm("t", "treatment", min(n, k + extra), n, t_passes))
    if v.label is Label.WORKING:
        assert more.label is Label.WORKING


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.data(), passes, st.sampled_from([PUBLISHED, IMPROVED]))
def test_a_versus_itself_is_never_working_when_rule_requires_slowdown(n, data, p, rule):
    k = data.draw(st.integers(0, n))
    a = arm("a", "control", k, n, p)
    v = classify(rule, a, arm("a", "treatment", k, n, p))
    assert v.label is not Label.WORKING


@settings(max_examples=150, deadline=None)
@given(run_pairs(), st.sampled_from([PUBLISHED, IMPROVED]), st.booleans(),
       st.lists(st.sampled_from([True, False, None]), max_size=4))
def test_untested_whenever_not_testable_or_a_check_failed(pair, rule, testable, passed):
    n, k, kc, t_passes, c_passes = pair
    checks = [ValidityCheck(f"check{i}", p, 0, 0, "") for i, p in enumerate(passed)]
    v = classify(rule, arm("c", "control", kc, n, c_passes), arm("t", "treatment", k, n, t_passes),
                 checks, RunTestable(testable, None if testable else "engine failed to start"))
    if not testable or False in passed:
        assert v.label is Label.UNTESTED
        assert v.untested_reasons
    else:
        assert v.label is not Label.UNTESTED
        assert v.untested_reasons == ()


@settings(max_examples=200, deadline=None)
@given(run_pairs(), st.sampled_from([PUBLISHED, IMPROVED]))
def test_label_is_the_first_whose_criteria_all_hold(pair, rule):
    n, k, kc, t_passes, c_passes = pair
    v = classify(rule, arm("c", "control", kc, n, c_passes), arm("t", "treatment", k, n, t_passes))
    met = [lr.label for lr in v.labels if lr.met]
    assert v.label.value == (met[0] if met else rule.otherwise)
    for lr in v.labels:
        for c in lr.criteria:
            # not evaluable (met None) exactly when the data gave no observation, and then the
            # criterion says why; an evaluated criterion gives no such reason
            assert (c.met is None) == (c.observed is None) == (c.reason is not None), c


# ---- the false-"working" rate at the boundary, by simulation

def test_false_working_rate_at_the_throughput_boundary():
    """True ratio exactly at the slowdown bound, a perfect match: 'throughput_slower' holds
    with probability at most (1 - 0.95) / 2 = 0.025 (one side of a 95 % Welch interval)."""
    rng = np.random.default_rng(20261129)
    reps, n_passes, sigma, bound = 1000, 5, 0.05, 0.90
    control_k = arm("c", "control", 78, 541, [1.0])
    working = 0
    for _ in range(reps):
        c = 100.0 * np.exp(sigma * rng.standard_normal(n_passes))
        t = 100.0 * bound * np.exp(sigma * rng.standard_normal(n_passes))
        v = classify(IMPROVED, arm("c", "control", 78, 541, c),
                     arm("t", "treatment", 541, 541, t))
        working += v.label is Label.WORKING
    # acceptance band: the 99.9th percentile of Binomial(reps, 0.025)
    assert working <= sps.binom.ppf(0.999, reps, 0.025)
    # and the rate is not zero: the test has power to see the nominal rate
    assert working >= sps.binom.ppf(0.001, reps, 0.025)
    assert control_k.n_prompts == 541


def test_rule_sentences_are_fixed():
    assert set(SENTENCES) == set(Label)
    assert len(set(SENTENCES.values())) == len(Label)
    assert math.isclose(PUBLISHED.confidence_level, 0.95)


def test_the_classifiers_docstring_examples():
    """Every example of the classifier and its parts (bistat.core.classify names them)."""
    import doctest

    from bistat.core import classify as classify_module
    from bistat.core import classify_inputs, cost, criteria, decided, pairing, verdicts

    modules = (classify_module, classify_inputs, criteria, cost, pairing, verdicts, decided)
    results = [doctest.testmod(m) for m in modules]
    assert sum(r.attempted for r in results) >= 18
    assert [r.failed for r in results] == [0] * len(modules)
