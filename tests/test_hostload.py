"""The host's load per pass (bistat.run.hostload): recorded by the runner, summarised by the
analysis, stated in the finding. On 2026-12-03 the quickstart's blas passes took 110 s against
37 s alone while a test suite shared the machine, and nothing in the run said so."""

from __future__ import annotations

import time

import pytest

from bistat.analysis.summary import analyze_run, host_load, summary_to_dict
from bistat.report.finding import render_markdown
from bistat.run.hostload import host_record, host_sample
from helpers_analysis import declaration, make_run, register_tiny, within_arm_spearman

psutil = pytest.importorskip("psutil")


def test_a_busy_loop_shows_as_bistats_own_cpu_time_and_machine_busy_time():
    before = host_sample()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:   # 0.3 s of this process's CPU
        pass
    rec = host_record(before, host_sample())
    assert rec is not None and rec["n_cpus"] == psutil.cpu_count()
    assert 0.25 <= rec["own_cpu_s"] <= 1.0
    # the machine was at least as busy as this process (the counters tick in 10 ms jiffies)
    assert rec["busy_s"] >= rec["own_cpu_s"] - 0.05
    assert rec["steal_s"] >= 0.0 and (rec["load_1m"] is None or rec["load_1m"] >= 0.0)
    assert host_record(None, before) is None and host_record(before, None) is None


def test_the_analysis_relates_slow_passes_to_the_hosts_other_load(tmp_path):
    slow = {("ctl", 1), ("trt", 3), ("ctl", 4)}

    def tp(arm: str, p: int) -> float:   # a slow pass takes 1.5x its arm's usual time
        return (40.0 if arm == "ctl" else 36.0) / (1.5 if (arm, p) in slow else 1.0 + 0.01 * p)

    def host(arm: str, p: int) -> dict:  # beside another job using 0.7 of 2 CPUs, else 0.1
        wall, other = 40.0 / tp(arm, p), 0.7 if (arm, p) in slow else 0.1 + 0.01 * p
        return {"n_cpus": 2, "busy_s": (other + 0.2) * 2 * wall, "steal_s": 0.01 * wall,
                "own_cpu_s": 0.2 * 2 * wall, "load_1m": 1.0}

    reg = register_tiny(tmp_path, declaration(passes=6))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], passes=6, throughput=tp,
                             host=host))
    load = host_load(s)
    assert load is not None and load.n == 12
    p1 = next(p for p in s.passes if (p.arm, p.pass_index) == ("ctl", 1))
    # other = (busy - own) / (n_cpus x wall_s), busy = 0.7 + bistat's own 0.2
    assert (p1.host_other_share, p1.host_busy_share, p1.host_steal_share) == pytest.approx(
        (0.7, 0.9, 0.005))
    # Spearman's rho of the within-arm log wall time residuals against the other share
    expected = within_arm_spearman(s, "host_other_share")
    assert load.rho == pytest.approx(expected.statistic) and load.rho > 0.6
    assert load.p_value == pytest.approx(expected.pvalue) and load.slow_when_busy
    assert [(a, n) for a, n, *_ in load.arms] == [("ctl", 6), ("trt", 6)]
    text = render_markdown(s)
    assert "**Host load.**" in text and "| ctl | 6 |" in text
    assert "the slower passes were the ones with more CPU time taken by other processes" in text
    data = summary_to_dict(s)
    assert data["host_load"]["slow_when_busy"] is True and data["host_load"]["n"] == 12


def test_a_run_without_host_records_says_nothing_about_the_host(tmp_path):
    reg = register_tiny(tmp_path, declaration())
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i]))
    assert host_load(s) is None
    assert all(p.host_busy_share is None for p in s.passes)
    assert "Host load" not in render_markdown(s)


def test_an_even_host_load_is_no_sign(tmp_path):
    reg = register_tiny(tmp_path, declaration(passes=6))
    s = analyze_run(make_run(
        tmp_path, reg, lambda arm, p, i: [i], passes=6,
        throughput=lambda arm, p: 100.0 + (7 * p) % 5,
        host=lambda arm, p: {"n_cpus": 4, "busy_s": 0.4 + 0.01 * ((3 * p) % 4),
                             "steal_s": 0.0, "own_cpu_s": 0.3, "load_1m": None}))
    load = host_load(s)
    assert load is not None and load.rho is not None and not load.slow_when_busy
    assert "no sign that the host's other load set the pass times" in render_markdown(s)
