"""What a finding says about the serial correlation of its passes, from the committed runs.

The analysis measures it on the values the cost rule reads (``bistat.analysis.serial``: each arm's
per-pass metric in pass order, the pairs' log differences), with the lag-1 autocorrelation and
the Ljung-Box test of ``bistat.core.serial``, and puts a number on the coverage of the rule's
interval at it (``bistat.core.design.check_interval_assumptions``); the finding's throughput
section formats those fields and draws the passes in pass order. The numbers are the committed
runs' own, checked against statsmodels and the records directly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.figure import Figure

from bistat.analysis.serial import serial_passes
from bistat.analysis.summary import analyze_run, summary_to_dict
from bistat.cli import cli
from bistat.core import design
from bistat.core.classify import ArmStats
from bistat.core.rule import Rule
from bistat.report.finding import render_markdown
from bistat.report.plots import passes_in_order

ROOT = Path(__file__).resolve().parents[1]
V034 = ROOT / "data" / "h200-v034"
PAIRED = V034 / "h200-v034-i23-throughput-qwen3-8b-paired"
LATENCY_17B = V034 / "h200-v034-i23-latency-qwen3-17b-b8-compiled"
V033_SMOL = ROOT / "data" / "h200-v033" / "h200-v033-match-smollm2"


@pytest.fixture(scope="module")
def paired():
    return analyze_run(PAIRED)


def _counted(run: Path) -> dict[str, dict[int, float]]:
    """Arm -> pass index -> output tokens/s of the counted passes, read from passes.jsonl."""
    out: dict[str, dict[int, float]] = {}
    for line in (run / "passes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "counted" and rec["status"] == "complete":
            out.setdefault(rec["arm"], {})[rec["pass_index"]] = rec["output_tokens_per_s"]
    return out


def test_the_paired_run_is_measured_on_its_pairs_in_pass_order(paired):
    """docs/COST-INTERVALS.md's numbers for the registered run: control 0.47 (Ljung-Box p =
    0.108 over 6 lags), treatment -0.08, the pairs 0.30 (0.36 bias-corrected, p = 0.33); the
    paired interval's stated 95 % covers about 82 % there: at risk, not contradicted."""
    from statsmodels.stats.diagnostic import acorr_ljungbox
    from statsmodels.tsa.stattools import acf

    sp = paired.serial
    assert (sp.metric, sp.interval, sp.cost_rule, sp.confidence_level, sp.alpha) == (
        "throughput", "paired", True, 0.95, 0.05)
    recorded = _counted(PAIRED)
    control, treatment = sp.arms
    assert [(a.arm, a.role, a.n) for a in sp.arms] == [
        ("default", "control", 32), ("bi-tuned-gemm-compiled", "treatment", 32)]
    for a in sp.arms:
        assert a.passes == tuple(sorted(recorded[a.arm]))
        assert a.values == pytest.approx([recorded[a.arm][k] for k in a.passes], rel=1e-9)
    assert (round(control.correlation.lag1, 4), round(control.correlation.pvalue, 3),
            control.correlation.lags) == (0.4691, 0.108, 6)
    assert round(treatment.correlation.lag1, 2) == -0.08
    (pair,) = sp.pairs
    assert pair.passes == tuple(range(1, 33)) and pair.n_pairs == 32
    d = np.array([math.log(recorded["bi-tuned-gemm-compiled"][k])
                  - math.log(recorded["default"][k]) for k in pair.passes])
    assert np.allclose(pair.log_differences, d, rtol=0, atol=1e-9)
    # statsmodels on the differences themselves
    assert pair.differences.lag1 == pytest.approx(acf(d, nlags=1, fft=False)[1], abs=1e-12)
    lb = acorr_ljungbox(d, lags=[6], return_df=True)
    assert pair.differences.pvalue == pytest.approx(float(lb["lb_pvalue"].iloc[0]), abs=1e-12)
    assert (round(pair.differences.lag1, 4), round(pair.differences.lag1_corrected, 4),
            round(pair.differences.pvalue, 2)) == (0.2976, 0.3629, 0.33)
    check = pair.check
    assert (check.interval, check.passes, check.contradicted, check.at_risk) == (
        "paired", 32, False, True)
    assert check.rho == pair.differences.lag1_corrected
    assert check.coverage == design.interval_coverage("paired", 32, check.rho)
    assert round(check.coverage, 3) == 0.824
    assert pair.hac is None and sp.significant == ()


def test_bistat_analyze_json_carries_the_serial_correlation(paired, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reg = ROOT / "preregistrations" / f"{PAIRED.name}.json"
    res = CliRunner().invoke(cli, ["analyze", str(PAIRED), "--registration", str(reg),
                                   "--out", "out", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)["serial"]
    assert data == summary_to_dict(paired)["serial"]
    (pair,) = data["pairs"]
    assert (pair["treatment"], pair["control"], len(pair["passes"])) == (
        "bi-tuned-gemm-compiled", "default", 32)
    assert round(pair["differences"]["lag1"], 4) == 0.2976
    assert (pair["check"]["interval"], round(pair["check"]["coverage"], 3),
            pair["check"]["at_risk"]) == ("paired", 0.824, True)
    assert [a["arm"] for a in data["arms"]] == ["default", "bi-tuned-gemm-compiled"]
    assert (tmp_path / "out" / f"{PAIRED.name}-serial.png").is_file()


def test_the_finding_states_it_in_the_throughput_section(paired):
    text = render_markdown(paired)
    section = text[text.index("## Throughput"):text.index("## First divergences")]
    assert ("| default (control) | 32 | 0.47 | 0.55 | 10.42 | 6 | 0.108 |" in section)
    assert ("| bi-tuned-gemm-compiled (treatment) | 32 | -0.08 | -0.06 | 1.67 | 6 | 0.948 |"
            in section)
    assert ("| bi-tuned-gemm-compiled ÷ default, pair differences | 32 | 0.30 | 0.36 | 6.92 | 6 "
            "| 0.329 |") in section
    assert ("The cost rule decides on the paired interval (`interval = \"paired\"`): it takes "
            "the pairs of passes as independent.") in section
    assert ("| bi-tuned-gemm-compiled ÷ default | 0.36 | 32 | 82.4 % | at risk: no significant "
            "correlation (Ljung–Box p = 0.329), but at this estimate it covers more than 1.5 "
            "points less than stated |") in section
    assert "**Warning: significant serial correlation**" not in section
    assert f"![Passes in pass order]({PAIRED.name}-serial.png)" in section


def test_significant_serial_correlation_is_warned_about_with_its_coverage():
    """The batch-8 latency study on the Qwen3-1.7B shape (vLLM 0.34.0, 90 passes per arm): the
    tuned breakable arm's latencies carry over (Ljung-Box p = 0.0003), so does its pairs'
    difference; the Welch interval its cost rule decides on covers about 79 % there."""
    s = analyze_run(LATENCY_17B)
    sp = s.serial
    assert (sp.metric, sp.interval) == ("latency", "welch")
    assert sp.significant == ("bi-tuned-gemm", "bi-tuned-gemm ÷ default")
    breakable = next(p for p in sp.pairs if p.treatment == "bi-tuned-gemm")
    assert breakable.check.contradicted and round(breakable.check.coverage, 3) == 0.790
    arms = {a.arm: a for a in sp.arms}
    assert breakable.check.rho == max(arms["bi-tuned-gemm"].correlation.lag1_corrected,
                                      arms["default"].correlation.lag1_corrected)
    text = render_markdown(s)
    assert ("Each arm's log mean request latency per counted pass in pass order" in text)
    assert ("| bi-tuned-gemm ÷ default | 0.42 | 90 | 79.0 % | contradicted: significant serial "
            "correlation (Ljung–Box p = 0.000287) where it assumes none |") in text
    assert ("**Warning: significant serial correlation** (Ljung–Box p < 0.05) in bi-tuned-gemm, "
            "bi-tuned-gemm ÷ default. Welch's interval takes each arm's passes as independent: "
            "at the correlation this run shows its stated 95 % covers about 79 % (the least of "
            "the table above), so the cost verdict rests on an interval narrower than stated. "
            "`[rule.cost] interval = \"hac\"` allows for serial correlation "
            "(docs/COST-INTERVALS.md).") in text


def test_a_few_pairs_are_diagnosed_but_not_planned_at():
    """Four passes per arm (Study 1(a) on vLLM 0.33.0): the lag-1 autocorrelations and their
    Ljung-Box tests are stated, not their bias correction nor a coverage: at 4 pairs the
    correction takes r = 0 to 1."""
    s = analyze_run(V033_SMOL)
    sp = s.serial
    assert all(p.n_pairs == 4 and p.check is None for p in sp.pairs)
    assert sp.significant == ("bi-triton-attn ÷ default",)
    text = render_markdown(s)
    assert "| bi-triton-attn ÷ default, pair differences | 4 | -0.80 | — | 5.11 | 1 | 0.0237 |" \
        in text
    assert ("Too few pairs of passes (fewer than 8) to put a number on its coverage at this "
            "run's correlation") in text
    assert ("in bi-triton-attn ÷ default. With fewer than 8 pairs, what it does to the coverage "
            "of Welch's interval cannot be put in numbers.") in text


def test_a_hac_rule_keeps_its_interval_make_up(paired):
    """Under ``interval = "hac"`` the same pairs give docs/COST-INTERVALS.md's HAC interval
    (4 cosine terms, t_4, long-run variance 1.66 times the plain one: 0.904-1.007), and the HAC
    interval's coverage at the pairs' correlation (94.4 % at 0.36 and 32 pairs)."""
    c, t = (paired.arm(n) for n in ("default", "bi-tuned-gemm-compiled"))
    recorded = _counted(PAIRED)

    def stats(a, role):
        passes = tuple(sorted(recorded[a.name]))
        return ArmStats(a.name, role, 0, 0, tuple(recorded[a.name][k] for k in passes),
                        throughput_passes=passes)
    rule = Rule.model_validate({"labels": [{"label": "working", "all": [
        {"criterion": "match_lower_bound", "at_least": 0.99}]}],
        "cost": {"margin": 0.05, "interval": "hac"}})
    sp = serial_passes(rule, [(stats(c, "control"), stats(t, "treatment"))])
    (pair,) = sp.pairs
    hac = pair.hac
    assert (hac.terms, round(hac.critical_value, 3), round(hac.variance_ratio, 2)) == (4, 2.776,
                                                                                       1.66)
    assert (round(hac.interval.low, 3), round(hac.interval.high, 3)) == (0.904, 1.007)
    assert pair.check.interval == "hac" and not pair.check.at_risk
    assert round(pair.check.coverage, 3) == 0.944


def test_the_plot_draws_the_series_the_finding_states(paired, tmp_path):
    sp = paired.serial
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    passes_in_order(paired, fig)
    left, right = fig.axes
    assert left.get_ylabel() == "output tokens/s"
    assert left.get_xlabel() == right.get_xlabel() == "pass index (pass order)"
    for line, a in zip(left.get_lines(), sp.arms):
        assert tuple(line.get_xdata()) == a.passes and tuple(line.get_ydata()) == a.values
    (pair,) = sp.pairs
    diffs = right.get_lines()[0]
    assert tuple(diffs.get_ydata()) == pair.log_differences
    assert [t.get_text() for t in left.get_legend().get_texts()] == [
        "default (r₁ 0.47)", "bi-tuned-gemm-compiled (r₁ -0.08)"]
