"""The design analysis plans a paired or HAC cost interval from the earlier run's pairs of passes
as the classifier forms them: each treatment against the control, one pair per round of the
schedule, on the metric the cost rule decides on.

Synthetic earlier runs (recorded through the real writer, registered) with a drift common to the
arms -- which pairing removes -- give known pairs: the planned CV is the pooled standard deviation
of the pairs' log differences over sqrt(2), the planned autocorrelation the most conservative
comparison's bias-corrected lag-1, each computed here by hand. The committed three-arm runs are
planned paired, and a HAC plan's outcome probabilities are checked against a Monte Carlo of the
classifier's decision.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from scipy import stats as sps

from bistat.analysis.summary import analyze_run
from bistat.core import design, design_ratio, design_rho
from bistat.core.classify import ArmStats, classify_cost
from bistat.core.rule import CostRule
from bistat.core.serial import HacSpec
from bistat.declare.design_cv import pairs_from_run, paired_cv_from_run, serial_from_run
from bistat.declare.design_report import analyse_design, format_design
from bistat.declare.experiment import load_experiment, validate_experiment
from helpers_analysis import declaration, make_run, register_tiny
from helpers_serial import correlated_arms

ROOT = Path(__file__).resolve().parents[1]
V034 = ROOT / "data" / "h200-v034"
LATENCY_B8 = V034 / "h200-v034-i23-latency-qwen3-8b-b8-compiled"
SERIAL_PILOT = V034 / "h200-v034-i23-throughput-qwen3-8b-serial-compiled"

#: counted passes per arm of the synthetic earlier runs
N = 16
ARMS = ("ctl", "trt", "t2")


def _own_noise(seed: int = 2) -> dict[str, np.ndarray]:
    """Each arm's own log noise: the control none, ``trt`` AR(1) at 0.5 (its pairs serially
    correlated), ``t2`` independent."""
    e = np.random.default_rng(seed).normal(0.0, 0.02, (3, N))
    ar = np.empty(N)
    ar[0] = e[1, 0]
    for i in range(1, N):
        ar[i] = 0.5 * ar[i - 1] + e[1, i]
    return {"ctl": np.zeros(N), "trt": ar, "t2": e[2]}


OWN = _own_noise()
#: the drift every arm shares, pass by pass (large: a per-arm CV of about 0.11)
DRIFT = 0.15 * np.sin(np.arange(N) / 3.0)
RATIO = {"ctl": 1.0, "trt": 0.95, "t2": 1.02}


def _throughput(arm: str, p: int) -> float:
    return 1000.0 * RATIO[arm] * math.exp(DRIFT[p] + OWN[arm][p])


def _earlier(tmp: Path, *, arms=ARMS, cost: str = "", **run) -> Path:
    """A registered, recorded earlier run of ``arms`` (the first the control), N counted passes
    per arm in ABBA order, at :func:`_throughput`."""
    text = declaration("earlier", passes=N, extra_treatments=arms[2:]) + cost
    tmp.mkdir(parents=True, exist_ok=True)
    reg = register_tiny(tmp, text, name="earlier")
    return make_run(tmp, reg, lambda a, p, i: [1, 2], passes=N, arms=arms,
                    throughput=run.pop("throughput", _throughput), **run)


def _later(run: Path, interval: str = "hac", metric: str = "throughput", passes: int = 12,
           margin: float = 0.05, true_ratios: tuple[float, ...] = (0.8, 0.9, 1.0)):
    """A later declaration planned from ``run``: its cost rule on ``metric``, decided on
    ``interval``."""
    data = tomllib.loads(declaration("later", passes=passes))
    data["design"] = {"cv_from": str(run), "true_ratios": list(true_ratios)}
    data["rule"]["cost"] = {"metric": metric, "margin": margin, "interval": interval}
    return analyse_design(validate_experiment(data))


def _by_hand(diffs: list[np.ndarray]) -> tuple[float, list[float]]:
    """The pooled SD of the log differences (each comparison about its own mean) as the per-arm
    CV it plans at, and each comparison's bias-corrected lag-1 autocorrelation, clipped to
    [0, 0.95]: ``r = sum (x_t - m)(x_t+1 - m) / sum (x_t - m)**2``, ``(n r + 1) / (n - 3)``."""
    ss = sum(float(((d - d.mean()) ** 2).sum()) for d in diffs)
    sd = math.sqrt(ss / sum(len(d) - 1 for d in diffs))
    rhos = []
    for d in diffs:
        x = d - d.mean()
        r = float((x[:-1] * x[1:]).sum() / (x * x).sum())
        rhos.append(min(0.95, max(0.0, (len(d) * r + 1) / (len(d) - 3))))
    return math.sqrt(math.expm1(sd ** 2 / 2)), rhos


def _classifier_pairs(run: Path, registration: Path | None = None):
    """The classifier's pairs of the run (``bistat analyze``'s serial phase): per comparison
    (treatment, control's passes, treatment's passes, log differences)."""
    s = analyze_run(run, registration, list_runs=False, run_ledger=False)
    return [(p.treatment, p.passes, p.treatment_passes, p.log_differences)
            for p in s.serial.pairs]


def _same_pairs(pairs, classifier) -> None:
    assert [(c.treatment, c.pairs.control_passes, c.pairs.treatment_passes)
            for c in pairs.comparisons] == [k[:3] for k in classifier]
    for c, k in zip(pairs.comparisons, classifier):
        assert [math.log(r) for r in c.ratios] == pytest.approx(k[3], abs=1e-12)


# ---- a synthetic three-arm run --------------------------------------------------------------


def test_a_three_arm_run_is_paired_control_against_each_treatment(tmp_path):
    """Both treatments against the control, 16 pairs each (one per round); the drift cancels:
    per-arm CV 0.115, pairs' CV 0.0141 (the SD of the log differences pooled over the two
    comparisons, 30 degrees of freedom, over sqrt(2)); the HAC interval planned at trt's
    bias-corrected 0.47 (t2's 0.01 is less conservative)."""
    run = _earlier(tmp_path)
    report = _later(run)
    diffs = [np.log([_throughput(t, p) / _throughput("ctl", p) for p in range(N)])
             for t in ("trt", "t2")]
    cv, rhos = _by_hand(diffs)
    assert round(rhos[1], 2) == 0.01 and rhos[0] > rhos[1]
    cost = report.cost
    assert cost.pairs == (("trt", "ctl", 16), ("t2", "ctl", 16))
    assert cost.cv == pytest.approx(cv, rel=1e-9) and round(cost.cv, 4) == 0.0141
    assert cost.rho == pytest.approx(rhos[0], rel=1e-9) and round(cost.rho, 2) == 0.47
    assert cost.serial_arms == ("trt", "ctl") and cost.serial.pairs == 16
    assert round(report.cv, 3) == 0.115 and report.cv > 8 * cost.cv   # unpaired: the drift
    assert cost.outcomes == tuple(
        (r, design.cost_outcome_probabilities(0.05, r, 12, cv, hac=HacSpec(), rho=cost.rho))
        for r, _ in cost.outcomes)
    assert ("the cost's HAC interval: 32 pairs of passes of " f"{run} (output tokens/s per "
            "pass, one pair per round of its schedule: each treatment against the control ctl, "
            "trt 16, t2 16), the SD of their log differences pooled over the 2 comparisons "
            "(each about its own mean, 30 degrees of freedom) 0.0200 over sqrt(2), as a CV: "
            "0.0141, at their lag-1 autocorrelation 0.47 (bias-corrected; 0.32 over the 16 "
            "pairs of trt ÷ ctl, the largest of 2 comparisons: the most conservative)") \
        in report.cv_source
    assert "as if unpaired" not in report.cv_source
    text = format_design(report)
    assert ("  CV from the earlier run's pairs of passes: trt ÷ ctl 16, t2 ÷ ctl 16; the "
            "spread of their log differences pooled over the comparisons\n") in text
    assert f"  serial correlation of 16 pairs of passes of {run} (trt ÷ ctl, the most " \
        "conservative of 2 comparisons), lag-1 autocorrelation: pair differences 0.32" in text
    # the paired interval: the same pooled CV, its pairs taken as independent
    paired = _later(run, "paired").cost
    assert (paired.cv, paired.rho, paired.pairs) == (cost.cv, 0.0, cost.pairs)
    # the pairs are the classifier's own
    _same_pairs(pairs_from_run(run), _classifier_pairs(run))


def test_a_resumed_runs_passes_pair_by_round_as_the_classifier_pairs_them(tmp_path):
    """The control's pass 3 was interrupted (not counted): its later passes run one round behind
    their pass index, so from round 3 on round k pairs the control's pass k + 1 with the
    treatments' pass k; pairing by pass index would pair other passes."""
    status = lambda arm, p: "interrupted" if (arm, p) == ("ctl", 3) else "complete"  # noqa: E731
    run = _earlier(tmp_path, status=status)
    pairs = pairs_from_run(run)
    trt = pairs.comparisons[0]
    assert [c.n for c in pairs.comparisons] == [15, 15]
    assert trt.pairs.rounds == tuple(range(15))
    assert trt.pairs.treatment_passes == tuple(range(15))
    assert trt.pairs.control_passes == (0, 1, 2, *range(4, 16))
    _same_pairs(pairs, _classifier_pairs(run))
    diffs = [np.log([_throughput(t, p) / _throughput("ctl", q)
                     for p, q in zip(c.pairs.treatment_passes, c.pairs.control_passes)])
             for t, c in zip(("trt", "t2"), pairs.comparisons)]
    assert paired_cv_from_run(run)[0] == pytest.approx(_by_hand(diffs)[0], rel=1e-9)


def test_a_latency_rule_pairs_the_mean_request_latency_of_each_pass(tmp_path):
    """``metric = "latency"``: the pairs are of each pass's mean request latency (answered
    requests, ``t_done - t_submit``), as the classifier reads it -- here a drift of its own, so
    the throughput's pairs would plan another CV."""
    lat_own = {a: np.random.default_rng(9 + i).normal(0.0, 0.03, N) for i, a in enumerate(ARMS)}

    def latency(arm, p, i):   # prompt i of 10: the pass's mean is 0.2 * exp(drift + own)
        return 0.2 * math.exp(0.1 * math.cos(p) + lat_own[arm][p]) * (1 + 0.01 * (i - 4.5))

    cost = ('[rule.cost]\nmetric = "latency"\nmargin = 0.05\ninterval = "hac"\n')
    run = _earlier(tmp_path, cost=cost, latency=latency)
    report = _later(run, metric="latency")
    diffs = [np.array([lat_own[t][p] - lat_own["ctl"][p] for p in range(N)])
             for t in ("trt", "t2")]
    cv, rhos = _by_hand(diffs)
    assert report.cost.cv == pytest.approx(cv, rel=1e-9)
    assert report.cost.rho == pytest.approx(max(rhos), rel=1e-9)
    assert report.cost.cv != pytest.approx(_later(run).cost.cv, rel=0.1)
    assert "(mean request latency per pass, one pair per round of its schedule" in \
        report.cv_source
    _same_pairs(pairs_from_run(run, "latency"), _classifier_pairs(run))
    # Welch's interval on latency: the pooled per-arm CV of the passes' mean latencies
    welch = _later(run, "welch", metric="latency")
    logs = [np.array([0.1 * math.cos(p) + lat_own[a][p] for p in range(N)]) for a in ARMS]
    pooled = math.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in logs) / (3 * (N - 1)))
    assert welch.cost.cv == pytest.approx(math.sqrt(math.expm1(pooled ** 2)), rel=1e-9)
    assert "; the cost's Welch interval: the pooled CV of its mean request latency per pass " \
        "(48 counted passes in 3 arms, 45 degrees of freedom)" in welch.cv_source


def test_without_its_registration_two_arms_pair_and_three_do_not(tmp_path):
    """Which arm is the control is in the run's registration: without it (moved away) two arms
    are still paired -- a log difference's spread and correlation do not depend on its sign --
    but three are planned as if unpaired, saying why."""
    two = _earlier(tmp_path / "two", arms=("ctl", "trt"))
    three = _earlier(tmp_path / "three")
    for d in (tmp_path / "two", tmp_path / "three"):
        (d / "preregistrations" / "earlier.json").rename(d / "earlier.json.away")
    pairs = pairs_from_run(two)
    assert pairs.roles_from.endswith("does not exist here (a relative path is tried from the "
                                     "working directory, then from the run directory); run "
                                     "from where it is found, or pass --registration PATH")
    # in name order, the second as the control
    assert [(c.treatment, c.control, c.n) for c in pairs.comparisons] == [("ctl", "trt", 16)]
    assert "which arm is the control is not known here" in _later(two).cv_source
    report = _later(three)
    assert pairs_from_run(three).comparisons == () and report.cost.pairs == ()
    assert "the cost's HAC interval planned at this CV, as if unpaired (" f"{three} gives no " \
        "pairs of passes: its 3 arms cannot be paired without knowing which is the control, " \
        "and its registration is not found (" in report.cv_source
    assert report.cost.cv == report.cv and report.cost.rho == 0.0


# ---- the committed runs ---------------------------------------------------------------------


def test_the_committed_three_arm_latency_run_plans_the_tax_study_paired():
    """h200-v034-tax-qwen3-8b-b8 plans its HAC latency interval from the 0.34.0 batch-8 run's
    three arms: 90 pairs of each treatment with the default (180), the pooled CV 0.0108 and
    bi-tuned-gemm's bias-corrected 0.13 (bi-tuned-gemm-compiled's differences are negatively
    correlated) -- no longer as if unpaired at 0.00. The pairs are the classifier's."""
    report = analyse_design(load_experiment(ROOT / "experiments" /
                                            "h200-v034-tax-qwen3-8b-b8.toml"), base_dir=ROOT)
    cost = report.cost
    assert (cost.metric, cost.interval) == ("latency", "hac")
    assert cost.pairs == (("bi-tuned-gemm", "default", 90),
                          ("bi-tuned-gemm-compiled", "default", 90))
    assert (round(cost.cv, 4), round(cost.rho, 2)) == (0.0108, 0.13)
    assert cost.serial_arms == ("bi-tuned-gemm", "default")
    assert "as if unpaired" not in report.cv_source
    assert (f"the cost's HAC interval: 180 pairs of passes of {LATENCY_B8} (mean request "
            "latency per pass, one pair per round of its schedule: each treatment against the "
            "control default, bi-tuned-gemm 90, bi-tuned-gemm-compiled 90)") in report.cv_source
    registration = ROOT / "preregistrations" / f"{LATENCY_B8.name}-hac.json"
    _same_pairs(pairs_from_run(LATENCY_B8, "latency"), _classifier_pairs(LATENCY_B8,
                                                                          registration))


def test_the_serial_pilots_passes_pair_by_round_not_by_pass_index():
    """The serial pilot restarted its engines per block, each start with warm-ups of its own, so
    its arms' pass indices of one round differ: pairing by index found 6 pairs, by round (as the
    classifier) 11."""
    pairs = pairs_from_run(SERIAL_PILOT)
    (c,) = pairs.comparisons
    assert (c.treatment, c.control, c.n) == ("bi-tuned-gemm-compiled", "default", 11)
    assert len(set(c.pairs.treatment_passes) & set(c.pairs.control_passes)) == 6
    assert c.pairs.treatment_passes != c.pairs.control_passes
    est, comp = serial_from_run(SERIAL_PILOT)
    assert comp is c and est.pairs == 11


# ---- the plan against the classifier ---------------------------------------------------------


def _band(reps: int, p: float) -> tuple[float, float]:
    """The central 99.8 % acceptance band of Binomial(reps, p), as a rate."""
    return sps.binom.ppf(0.001, reps, p) / reps, sps.binom.ppf(0.999, reps, p) / reps


@pytest.mark.parametrize("true_ratio", [1.0, 0.97])
def test_a_hac_plan_from_a_three_arm_run_matches_the_classifiers_decisions(tmp_path,
                                                                           true_ratio):
    """The HAC plan (8 pairs, margin 0.05) from the synthetic three-arm run, against 4,000
    seeded runs classified by classify_cost: AR(1) pair differences at the planned CV and
    lag-1 autocorrelation (0.47), under a drift shared by both arms; each outcome's rate inside
    the acceptance band of the planned probability. A plan for independent pairs at that CV
    (P(no measurable cost) 0.93 at 1, 0.38 at 0.97) falls outside it."""
    report = _later(_earlier(tmp_path), passes=8, true_ratios=(0.97, 1.0))
    cv, rho, n = report.cost.cv, report.cost.rho, 8
    want = dict(report.cost.outcomes)[true_ratio]
    assert 0.2 < max(want.values()) < 0.9   # a case the plan does not call either way
    sigma = design.log_sd_from_cv(cv)
    reps = 4000
    t, c = correlated_arms(np.random.default_rng(17), reps, n, rho, ratio=true_ratio,
                           noise_sd=sigma * math.sqrt(1 - rho ** 2), drift_sd=0.05)
    rule = CostRule(metric="throughput", margin=0.05, interval="hac")
    counts = {o: 0 for o in want}
    # the outcome is all this test reads: the pairs that would decide an undecidable cost
    # (a search, and its autocorrelation estimate) are skipped
    with mock.patch.object(design_ratio, "passes_to_decide", return_value=None), \
            mock.patch.object(design_rho, "planning_rho", return_value=0.0):
        for i in range(reps):
            got = classify_cost(rule, ArmStats("c", "control", 0, 0, tuple(c[i])),
                                ArmStats("t", "treatment", 0, 0, tuple(t[i])))
            counts[got.outcome.value] += 1
    for outcome, p in want.items():
        low, high = _band(reps, p)
        assert low <= counts[outcome] / reps <= high, (outcome, counts, want)
    independent = design.cost_outcome_probabilities(0.05, true_ratio, n, cv, hac=HacSpec())
    low, high = _band(reps, independent["no measurable cost"])
    assert not low <= counts["no measurable cost"] / reps <= high, (independent, counts)


def test_the_throughput_criteria_say_they_are_decided_on_welchs_interval(tmp_path):
    """The labels' throughput criteria are Welch's whatever the cost rule declares; the design
    says so, and that the cost rule's interval is another."""
    text = format_design(_later(_earlier(tmp_path)))
    assert ("Throughput criteria (Welch's interval and TOST of the throughput ratio, each arm's "
            "passes unpaired, not the cost rule's HAC interval; 12 counted passes per arm, CV "
            "0.115):\n") in text
