"""The design analysis plans the cost for the interval a declaration actually declares, checks the
earlier run's serial correlation against what that interval assumes, and prices engine starts per
engine where the engines start one at a time; on the committed runs.

- ``interval = "hac"`` is planned as the HAC interval (its cosine terms, at the earlier run's
  pairs' lag-1 autocorrelation, bias-corrected), no longer as Welch's;
- every ``bistat.core.design.check_interval_assumptions`` message becomes a warning when the
  earlier run (``design.cv_from``) contradicts the declared interval or puts it at risk;
- vLLM engines start one at a time: h200-v034-match-smollm2's five engines took 569 s to start,
  where the 0.33.0 run's four (its ``design.cv_from``) had taken 492 s.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bistat.cli import cmd_register
from bistat.core import design
from bistat.core.serial import HacSpec
from bistat.declare.design_report import (analyse_design, estimate_duration, format_design,
                                          paired_cv_from_run, timing_from_run)
from bistat.declare.design_cv import pairs_from_run, serial_from_run
from bistat.declare.experiment import load_experiment, validate_experiment

ROOT = Path(__file__).resolve().parents[1]
V034 = ROOT / "data" / "h200-v034"
PAIRED_RUN = V034 / "h200-v034-i23-throughput-qwen3-8b-paired"
PILOT = V034 / "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled"
PAIRED_TOML = ROOT / "experiments" / "h200-v034-i23-throughput-qwen3-8b-paired.toml"


def _declared(interval: str, cv_from: Path, passes: int = 32) -> dict:
    """The paired workload-(i) declaration with another cost interval, earlier run and passes."""
    data = tomllib.loads(PAIRED_TOML.read_text(encoding="utf-8"))
    data["name"] = "t"
    data["rule"]["cost"]["interval"] = interval
    data["design"]["cv_from"] = str(cv_from)
    data["workload"]["passes"] = passes
    return data


def _report(data: dict):
    return analyse_design(validate_experiment(data, source="t.toml"), base_dir=ROOT)


def test_the_earlier_runs_pairs_and_their_serial_correlation():
    """The registered paired run's 32 pairs (docs/COST-INTERVALS.md): 0.30 over the pairs, 0.36
    bias-corrected, the control 0.47; the concurrent pilot's 54: their differences uncorrelated
    (-0.07) while both arms drifted (0.57 and 0.40, Ljung-Box p < 1e-11)."""
    pairs = pairs_from_run(PAIRED_RUN)
    (comparison,) = pairs.comparisons
    assert (comparison.treatment, comparison.control) == ("bi-tuned-gemm-compiled", "default")
    assert comparison.pairs.rounds == tuple(range(32))
    assert comparison.pairs.control_passes == comparison.pairs.treatment_passes == tuple(
        range(1, 33))
    est, _ = serial_from_run(PAIRED_RUN)
    assert (est.pairs, round(est.diagnostics.differences.lag1, 4), round(est.rho, 4)) == (
        32, 0.2976, 0.3629)
    assert round(est.diagnostics.control.lag1, 2) == 0.47   # "default", the second arm
    assert est.cv == pytest.approx(paired_cv_from_run(PAIRED_RUN)[0], rel=1e-12)
    pilot, _ = serial_from_run(PILOT)
    assert (pilot.pairs, round(pilot.diagnostics.differences.lag1, 2), pilot.rho) == (54, -0.07,
                                                                                      0.0)
    assert [round(s.lag1, 2) for s in (pilot.diagnostics.treatment,
                                       pilot.diagnostics.control)] == [0.57, 0.40]
    assert max(pilot.diagnostics.treatment.pvalue, pilot.diagnostics.control.pvalue) < 1e-11


def test_a_hac_rule_is_planned_as_hac_at_the_earlier_runs_correlation():
    """A "hac" cost rule planned from the paired run: 4 cosine terms at 32 pairs, at the pairs'
    bias-corrected 0.36; what core.design gives for that interval, not Welch's figures. It
    keeps 94.4 % there: no warning about its assumptions."""
    report = _report(_declared("hac", PAIRED_RUN))
    cost = report.cost
    est, _ = serial_from_run(PAIRED_RUN)
    cv = paired_cv_from_run(PAIRED_RUN)[0]
    assert (cost.interval, cost.hac_terms, cost.passes_per_arm) == ("hac", 4, 32)
    assert cost.cv == pytest.approx(cv) and cost.rho == est.rho
    for ratio, probs in cost.outcomes:
        assert probs == design.cost_outcome_probabilities(0.05, ratio, 32, cv, hac=HacSpec(),
                                                          rho=est.rho)
    assert dict(cost.outcomes)[1.0] != design.cost_outcome_probabilities(0.05, 1.0, 32, cv)
    assert dict(cost.passes_to_decide)[1.0] == design.passes_to_decide(
        0.05, 1.0, cv, hac=HacSpec(), rho=est.rho)
    assert cost.interval_factor == design.expected_ratio_interval_factor(32, cv, hac=HacSpec())
    assert (cost.check.interval, round(cost.check.coverage, 3), cost.check.at_risk) == (
        "hac", 0.944, False)
    assert not [w for w in report.warnings if w.startswith("rule.cost (")
                and "serially correlated" in w]
    assert report.cv_source.endswith(", at their lag-1 autocorrelation 0.36 (bias-corrected; "
                                     "0.30 over 32 pairs)")
    text = format_design(report)
    assert ("  interval: HAC, equal-weighted cosine, 4 cosine terms at 32 pairs (t with 4 "
            "degrees of freedom), planned at the pairs' lag-1 autocorrelation 0.36\n") in text
    assert ("  the declared hac interval's coverage at 0.36: 94.4 % of its stated 95 % (within "
            "its tolerance)\n") in text


def test_a_hac_rule_with_too_few_pairs_for_the_correlation_is_warned_about():
    report = _report(_declared("hac", PAIRED_RUN, passes=8))
    assert report.cost.hac_terms == 2 and report.cost.check.pairs_to_hold == 9
    (warning,) = [w for w in report.warnings if "serially correlated" in w]
    assert warning.endswith(
        "the earlier run's pairs of passes are serially correlated (lag-1 autocorrelation of "
        "their log differences 0.30, planned at 0.36): at 8 pairs the HAC interval's stated "
        "95 % covers about 93 %; about 9 pairs would keep it within 1.5 points")
    assert warning.startswith("rule.cost (throughput ratio (treatment ÷ control, output "
                              "tokens/s per pass), 95 % HAC interval")


def test_a_paired_rule_planned_from_correlated_pairs_is_at_risk():
    """The paired interval is planned as before (independent pairs), and the paired run's pairs
    put it at risk: 82 % at 0.36, not significant (Ljung-Box p = 0.329)."""
    report = _report(_declared("paired", PAIRED_RUN))
    cost = report.cost
    assert (cost.interval, cost.rho, cost.hac_terms) == ("paired", 0.0, None)
    cv = paired_cv_from_run(PAIRED_RUN)[0]
    assert dict(cost.outcomes)[1.0] == design.cost_outcome_probabilities(0.05, 1.0, 32, cv,
                                                                         paired=True)
    assert (cost.check.contradicted, cost.check.at_risk, round(cost.check.coverage, 3)) == (
        False, True, 0.824)
    (warning,) = [w for w in report.warnings if "interval assumes" in w]
    assert warning == (
        "rule.cost (throughput ratio (treatment ÷ control, output tokens/s per pass), 95 % "
        "paired interval against [0.95, 1.05]): the paired interval assumes the pairs of passes "
        "independent; the earlier run's lag-1 autocorrelation: pair differences 0.30 (Ljung-Box "
        "p = 0.329 over 6 lags), not significant at 0.05, but if that is the correlation: at "
        "0.36 (bias-corrected) and 32 pairs its stated 95 % covers about 82 %; [rule.cost] "
        "interval = \"hac\" allows for it")


def test_a_welch_rule_planned_from_drifting_arms_is_contradicted():
    """Welch's interval from the concurrent pilot, whose arms drifted over the run: contradicted
    (Ljung-Box p < 1e-11 where it assumes independent passes); the same pilot leaves the paired
    interval alone, its pairs' differences being uncorrelated."""
    report = _report(_declared("welch", PILOT))
    check = report.cost.check
    assert check.interval == "welch" and check.contradicted and check.at_risk
    assert round(check.rho, 2) == 0.62 and check.coverage < 0.7
    (warning,) = [w for w in report.warnings if "interval assumes" in w]
    assert "the welch interval assumes each arm's passes independent" in warning
    assert ", significant: at 0.62 (bias-corrected) and 32 passes per arm its stated 95 % " \
        "covers about" in warning
    paired = analyse_design(load_experiment(PAIRED_TOML), base_dir=ROOT)
    assert paired.warnings == ()
    assert (paired.cost.check.interval, paired.cost.check.at_risk) == ("paired", False)
    assert ("  serial correlation of 54 pairs of passes of "
            f"{ROOT}/data/h200-v034/h200-v034-i23-throughput-qwen3-8b-concurrent-compiled, lag-1 "
            "autocorrelation: pair "
            "differences -0.07 (Ljung-Box p = 0.942 over 10 lags), bias-corrected 0.00; "
            "bi-tuned-gemm-compiled 0.57 (Ljung-Box p = 4.86e-21 over 10 lags); default 0.40 "
            "(Ljung-Box p = 3.32e-12 over 10 lags)\n") in format_design(paired)


def test_a_hac_rule_without_an_earlier_run_is_planned_for_independent_pairs():
    data = _declared("hac", PAIRED_RUN)
    del data["design"]["cv_from"], data["design"]["time_budget_s"]
    data["design"]["expected_cv"] = 0.03
    report = _report(data)
    assert (report.cost.rho, report.cost.check, report.cost.hac_terms) == (0.0, None, 4)
    assert dict(report.cost.outcomes)[1.0] == design.cost_outcome_probabilities(
        0.05, 1.0, 32, 0.03, hac=HacSpec())
    assert "as independent pairs (no serial correlation estimated" in report.cv_source


def test_bistat_design_json_carries_the_check(tmp_path, monkeypatch):
    text = PAIRED_TOML.read_text(encoding="utf-8").replace(
        'interval = "paired"', 'interval = "hac"').replace(
        f'cv_from = "data/h200-v034/{PILOT.name}"', f'cv_from = "{PAIRED_RUN}"')
    (tmp_path / PAIRED_TOML.name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    group = click.Group("bistat")
    cmd_register.register(group)
    result = CliRunner().invoke(group, ["design", PAIRED_TOML.name, "--json"])
    assert result.exit_code == 0, result.output
    cost = json.loads(result.output)["cost"]
    assert (cost["interval"], cost["hac_terms"], round(cost["rho"], 4)) == ("hac", 4, 0.3629)
    assert (cost["check"]["interval"], round(cost["check"]["coverage"], 3)) == ("hac", 0.944)
    assert cost["serial_arms"] == ["bi-tuned-gemm-compiled", "default"]


# ---- the run time: vLLM engines start one at a time ------------------------------------------


def test_vllm_engines_started_together_are_priced_per_engine():
    """h200-v034-match-smollm2 (five vllm-server engines up together) was planned from the 0.33.0
    run's four: their start, 492 s as a whole, priced the five at 492 s; they took 569 s
    (events.jsonl). vLLM starts its engines one at a time, so the start is priced per engine:
    492 / 4 = 123.0 s each, 615 s for five (8 % over the measured start, against 14 % under)."""
    v033 = timing_from_run(ROOT / "data" / "h200-v033" / "h200-v033-match-smollm2")
    v034 = timing_from_run(V034 / "h200-v034-match-smollm2")
    assert (round(v033.first_starts[0], 1), v033.first_start_engines) == (492.1, (4,))
    assert (round(v034.first_starts[0], 1), v034.first_start_engines) == (569.0, (5,))
    exp = load_experiment(ROOT / "experiments" / "h200-v034-match-smollm2.toml")
    d = estimate_duration(exp, v033)
    assert (d.engines_concurrent, d.engine_starts, d.engines_per_start) == (True, 1, 5)
    assert d.first_start_s == pytest.approx(v033.first_starts[0] / 4)
    start = d.engines_per_start * d.first_start_s
    assert round(start) == 615
    measured = v034.first_starts[0]
    assert abs(start - measured) / measured < 0.09 < abs(v033.first_starts[0] - measured) / measured
    # one warm-up and 8 counted passes per arm, each at its arm's median
    assert d.passes == 45
    assert d.seconds == pytest.approx(start + 9 * sum(s for _, s in d.pass_s_by_arm), rel=1e-12)
    assert round(d.seconds) == 1260
    assert d.start_basis == (
        "vllm-server engines start one at a time (each sizes its KV cache from the GPU memory "
        "free when it starts): the earlier run's start of 4 engines, 492 s, is 123.0 s per "
        "engine")
    text = format_design(analyse_design(exp, base_dir=ROOT))
    assert ("  engine start: 5 x 123.0 s (all the arms' engines, one engine's first start each: "
            "vllm-server engines start one at a time (each sizes its KV cache from the GPU memory "
            "free when it starts): the earlier run's start of 4 engines, 492 s, is 123.0 s per "
            "engine)\n") in text
    # the other way round: the 0.33.0 study of four engines, timed from the 0.34.0 run of five
    back = estimate_duration(load_experiment(ROOT / "experiments" /
                                             "h200-v033-match-smollm2.toml"), v034)
    assert back.engines_per_start == 4
    assert back.first_start_s == pytest.approx(measured / 5)
    assert abs(4 * back.first_start_s - v033.first_starts[0]) < abs(measured -
                                                                     v033.first_starts[0])


def test_engines_that_start_in_parallel_keep_one_price_per_start(tmp_path):
    """The embedded engine starts its engines in parallel threads: a start of them all is priced
    as the earlier run's start of them all, whatever their number (tests/test_design_duration.py
    has the one-at-a-time plans)."""
    from test_design_duration import _declaration, _write_run

    run = _write_run(tmp_path / "old", [(("blas", "invariant"), (30.0, 40.0),
                                         [("blas", 10.0), ("invariant", 12.0)] * 3)],
                     together=True)
    data = _declaration(run)
    data["engine"]["engines_concurrent"] = True
    d = analyse_design(validate_experiment(data)).duration
    assert (d.engines_per_start, d.first_start_s, d.start_basis) == (1, pytest.approx(40.0), None)
