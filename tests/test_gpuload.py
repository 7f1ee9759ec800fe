"""The GPU sampled per pass (bistat.run.gpuload): recorded by the runner, summarised by the
analysis, stated in the finding. On 2026-12-03 the workload-(i) pilot slowed from 7.9 s to 9.1 s
a pass in both arms and nothing in the run said whether the GPU's clock had dropped.

``nvidia-smi`` is a script here (``FAKE_SMI``): it answers the fingerprint's, the busy-GPU
check's and the sampler's queries the way the driver does, with two GPUs whose SM clock falls
by 10 MHz a query, and it refuses fields the way ``nvidia-smi`` refuses a field it does not know.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import bistat
import fakes
import helpers_runner as h
from bistat.analysis.summary import analyze_run, gpu_clocks, summary_to_dict
from bistat.report.finding import render_markdown
from bistat.run import gpuload
from bistat.run.gpuload import (GpuMonitor, GpuSample, GpuSamplingError, gpu_pass_record,
                                parse_samples, sample_interval_s)
from bistat.store.readers import read_jsonl, read_table
from helpers_analysis import declaration, make_run, register_tiny, within_arm_spearman

FAKE_SMI = r'''#!{python}
import os, sys
args = sys.argv[1:]
query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
if any(a.startswith("--query-compute-apps=") for a in args):
    sys.exit(0)                                   # no other process on the GPUs
if query is None:
    sys.exit(0)
fields = query.split(",")
known = {{"new": "clocks_event_reasons.active", "old": "clocks_throttle_reasons.active"}}
mode = os.environ.get("FAKE_SMI_MODE", "new")
for f in fields:
    if f.startswith("clocks_") and f != known.get(mode):
        print(f'Field "{{f}}" is not a valid field to query.', file=sys.stderr)
        sys.exit(2)
if fields[0] == "name":
    print("NVIDIA H200, GPU-aaa, [N/A], 580.159.04")
    print("NVIDIA H200, GPU-bbb, [N/A], 580.159.04")
    sys.exit(0)
state = os.environ["FAKE_SMI_STATE"]
k = int(open(state).read()) if os.path.exists(state) else 0
tmp = f"{{state}}.{{os.getpid()}}"                   # two queries at once each write their own
open(tmp, "w").write(str(k + 1))
os.replace(tmp, state)                            # readers never see a half-written count
reason = ", 0x0000000000000004" if k % 2 else ", 0x0000000000000001"
tail = reason if len(fields) == 7 else ""
print(f"GPU-aaa, {{1980 - 10 * k}}, 3201, {{40 + k}}, {{300.5 + k}}, 99{{tail}}")
print(f"GPU-bbb, 1000, 3201, 30, [N/A], 0{{tail}}")
'''


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A fake ``nvidia-smi`` first on PATH; returns its query counter file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(FAKE_SMI.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    state = tmp_path / "smi-queries"
    monkeypatch.setenv("FAKE_SMI_STATE", str(state))
    monkeypatch.delenv(gpuload.INTERVAL_ENV, raising=False)
    return state


def _queries(state: Path) -> int:
    return int(state.read_text()) if state.exists() else 0


# ---- parsing and the pass record ----------------------------------------------------------


def test_a_pass_record_summarises_its_samples_of_the_arms_gpus():
    samples = [GpuSample(float(t), "GPU-aaa", 1980.0 - 100 * t, 3201.0, 40.0 + t, 300.0 + 50 * t,
                         99.0, [0x1, 0x4, 0x4 | 0x40, 0x0][t]) for t in range(4)]
    samples.append(GpuSample(1.5, "GPU-bbb", 1000.0, None, 30.0, None, 0.0, 0x20))
    rec = gpu_pass_record(samples, 0.5, ["GPU-aaa"])
    assert rec == {"n_samples": 4, "interval_s": 0.5, "sm_clock_mhz_mean": 1830.0,
                   "sm_clock_mhz_min": 1680.0, "mem_clock_mhz_mean": 3201.0,
                   "temperature_c_max": 43.0, "power_w_mean": 375.0, "power_w_max": 450.0,
                   "utilization_pct_mean": 99.0, "slowdown_share": 0.5,
                   "slowdown_reasons": {"hw_thermal_slowdown": 1, "sw_power_cap": 2},
                   "gpus": ["GPU-aaa"]}
    both = gpu_pass_record(samples, 0.5)   # no UUIDs known: every GPU sampled
    assert both["n_samples"] == 5 and both["gpus"] == ["GPU-aaa", "GPU-bbb"]
    assert both["power_w_mean"] == 375.0   # the GPU without a power reading is left out
    assert both["slowdown_reasons"]["sw_thermal_slowdown"] == 1
    assert gpu_pass_record([], 1.0) == {"n_samples": 0, "interval_s": 1.0}
    # no reasons queried (an old driver): no share rather than a share of 0
    plain = [GpuSample(0.0, "GPU-aaa", 1980.0, None, None, None, None, None)]
    assert gpu_pass_record(plain, 1.0)["slowdown_share"] is None


def test_parse_samples_reads_what_nvidia_smi_prints():
    text = ("GPU-aaa, 1980, 3201, 41, 312.50, 98, 0x0000000000000044\n"
            "GPU-bbb, [N/A], [Not Supported], 30, [N/A], 0, 0x0000000000000000\n"
            "garbage line\n")
    a, b = parse_samples(text, 7.0, True)
    assert (a.t, a.uuid, a.sm_clock_mhz, a.mem_clock_mhz, a.temperature_c, a.power_w,
            a.utilization_pct, a.reasons) == (7.0, "GPU-aaa", 1980.0, 3201.0, 41.0, 312.5, 98.0,
                                              0x44)
    assert (b.sm_clock_mhz, b.mem_clock_mhz, b.power_w, b.reasons) == (None, None, None, 0)
    assert parse_samples("GPU-aaa, 1980, 3201, 41, 312.50, 98\n", 0.0, True) == []   # too short


@pytest.mark.parametrize("raw, want", [(None, 1.0), ("", 1.0), ("0.25", 0.25), ("0", 0.0)])
def test_the_sampling_interval_comes_from_the_environment(raw, want):
    env = {} if raw is None else {"BISTAT_GPU_SAMPLE_S": raw}
    assert sample_interval_s(env) == want


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf"])
def test_a_bad_sampling_interval_names_the_variable_and_the_fix(raw):
    with pytest.raises(GpuSamplingError) as info:
        sample_interval_s({"BISTAT_GPU_SAMPLE_S": raw})
    assert str(info.value) == (
        f"BISTAT_GPU_SAMPLE_S={raw!r}: not a number of seconds >= 0; set it to the GPU sampling "
        "interval (e.g. 1) or 0 to turn sampling off")


# ---- the monitor against nvidia-smi ------------------------------------------------------


def test_the_monitor_samples_every_interval_and_records_a_pass_window(smi):
    monitor = GpuMonitor(0.05)
    assert monitor.start() and monitor.running
    probes = _queries(smi)   # the field probe is a query too
    t0 = time.time()
    _wait_for_queries(smi, 6)
    t1 = time.time()
    rec = monitor.record(t0, t1, ["GPU-aaa"])
    monitor.stop()
    assert not monitor.running
    n = rec["n_samples"]
    assert 4 <= n <= 7, rec
    # the samples' clocks are the script's 1980 - 10 k for the queries k made in the window
    ks = range(_queries(smi))
    clocks = [1980 - 10 * k for k in ks][-n - 5:]
    assert min(clocks) <= rec["sm_clock_mhz_min"] <= max(clocks)
    assert rec["sm_clock_mhz_min"] == rec["sm_clock_mhz_mean"] - 10 * (n - 1) / 2
    assert rec["temperature_c_max"] - 40 == (1980 - rec["sm_clock_mhz_min"]) / 10
    assert rec["gpus"] == ["GPU-aaa"] and probes >= 1
    # every other query names the software power cap (0x4); idle (0x1) is not a slowdown
    assert abs(rec["slowdown_share"] - 0.5) <= 0.5 / n + 1e-9
    assert rec["slowdown_reasons"] == {"sw_power_cap": round(rec["slowdown_share"] * n)}
    # a second window: only the samples taken in it, none before
    again = monitor.record(t1, time.time())
    assert again["n_samples"] <= 2
    stopped = _queries(smi)
    time.sleep(0.2)
    assert _queries(smi) == stopped   # stop() ended the thread


@pytest.mark.parametrize("mode, reasons", [("old", True), ("none", False)])
def test_the_monitor_falls_back_to_what_an_older_driver_answers(smi, monkeypatch, mode, reasons):
    """Drivers before 535 call the reasons clocks_throttle_reasons; one that answers neither
    name is sampled without them."""
    monkeypatch.setenv("FAKE_SMI_MODE", mode)
    monitor = GpuMonitor(60.0)          # no second sample: the probe and the first are enough
    assert monitor.start()
    got = monitor.sample_once()
    monitor.stop()
    assert [s.uuid for s in got] == ["GPU-aaa", "GPU-bbb"]
    assert (got[0].reasons is not None) == reasons


def test_no_nvidia_smi_or_an_interval_of_0_samples_nothing(smi, monkeypatch, tmp_path):
    assert not GpuMonitor(0.0).start()
    assert _queries(smi) == 0
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monitor = GpuMonitor(0.05)
    assert not monitor.start() and not monitor.running
    assert monitor.sample_once() == []
    monitor.stop()   # harmless


# ---- the runner -------------------------------------------------------------------------


def _wait_for_queries(state: Path, more: int, limit_s: float = 20.0) -> None:
    """Until ``more`` further queries have reached the script. The queries run one after
    another, so with 3 more at least one began and ended in the wait, however slow the machine."""
    start = _queries(state)
    deadline = time.monotonic() + limit_s
    while _queries(state) < start + more and time.monotonic() < deadline:
        time.sleep(0.01)


class _SlowEngine(fakes.FakeEngine):
    """The fake, with passes long enough for the sampler to see them."""

    def run_pass(self, requests, **kw):
        _wait_for_queries(Path(os.environ["FAKE_SMI_STATE"]), 3)
        super().run_pass(requests, **kw)


def test_a_run_on_this_machines_gpu_records_each_pass_gpu(smi, tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_GPU_SAMPLE_S", "0.05")
    script = fakes.FakeScript(arms={"blas": fakes.FakeArm(gpu_uuid="GPU-aaa"),
                                    "invariant": fakes.FakeArm(gpu_uuid="GPU-aaa")})
    served = h.experiment(engine={"kind": "vllm-server", "model": "/tmp/m"})
    from bistat.run.runner import start_run
    outcome = start_run(served, {"path": "p.json", "sha256": "ab" * 32, "name": "fakerun",
                                 "registered_utc": "2026-01-01T00:00:00Z"}, tmp_path / "run",
                        engine_factory=lambda e, a: _SlowEngine(e, a, script=script))
    assert outcome.status == "complete"
    passes, _ = read_jsonl(tmp_path / "run" / "passes.jsonl")
    assert len(passes) >= 10   # the served kind's schedule: warm-ups at each engine start
    import jsonschema
    schema = json.loads((Path(bistat.__file__).parent / "schemas" / "passes.schema.json")
                        .read_text())
    for p in passes:
        jsonschema.validate(p, schema)
        g = p["gpu"]
        assert g["interval_s"] == 0.05 and 1 <= g["n_samples"] <= 4, g
        assert g["gpus"] == ["GPU-aaa"]            # the arm's GPU only, not GPU-bbb
        assert 0 < g["sm_clock_mhz_min"] <= g["sm_clock_mhz_mean"] <= 1980
    # the clock falls with every query: each pass's mean below the one before
    means = [p["gpu"]["sm_clock_mhz_mean"] for p in passes]
    assert means == sorted(means, reverse=True) and len(set(means)) == len(passes)
    stopped = _queries(smi)
    time.sleep(0.2)
    assert _queries(smi) == stopped                # the sampler ended with the run
    # compacted to Parquet at the end, the records keep the samples for the analysis
    assert sorted(p.name for p in (tmp_path / "run").glob("passes.*")) == [
        "passes.jsonl", "passes.parquet"]
    (tmp_path / "run" / "passes.jsonl").unlink()    # what is read now is the Parquet table
    table = read_table(tmp_path / "run", "passes")
    assert [r["gpu"] for r in table.to_dict("records")] == [p["gpu"] for p in passes]


def test_engines_off_this_machines_gpu_and_bistat_gpu_sample_s_0_record_no_gpu(
        smi, tmp_path, monkeypatch):
    from bistat.run.runner import start_run
    reg = {"path": "p.json", "sha256": "ab" * 32, "name": "fakerun",
           "registered_utc": "2026-01-01T00:00:00Z"}
    script = fakes.FakeScript()
    # the fake engine (like the embedded one, or a server elsewhere) is not on this GPU
    start_run(h.experiment(), reg, tmp_path / "fake", engine_factory=script.factory)
    monkeypatch.setenv("BISTAT_GPU_SAMPLE_S", "0")
    start_run(h.experiment(engine={"kind": "vllm-server", "model": "/tmp/m"}), reg,
              tmp_path / "off", engine_factory=script.factory)
    for run in ("fake", "off"):
        passes, _ = read_jsonl(tmp_path / run / "passes.jsonl")
        assert passes and not any("gpu" in p for p in passes)
    monkeypatch.setenv("BISTAT_GPU_SAMPLE_S", "soon")
    with pytest.raises(GpuSamplingError, match="BISTAT_GPU_SAMPLE_S='soon'"):
        start_run(h.experiment(), reg, tmp_path / "bad", engine_factory=script.factory)
    assert not (tmp_path / "bad").exists()


def test_bistat_run_refuses_a_bad_sampling_interval_before_writing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from bistat.cli import cli
    from bistat.declare.prereg import register
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    (tmp_path / "experiments").mkdir()
    decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml", h.declaration())
    register(decl, registrations_dir=tmp_path / "preregistrations")
    monkeypatch.setenv("BISTAT_GPU_SAMPLE_S", "-2")
    result = CliRunner().invoke(cli, ["run", "preregistrations/fakerun.json"], prog_name="bistat")
    assert result.exit_code == 1
    assert result.output == ("Error: BISTAT_GPU_SAMPLE_S='-2': not a number of seconds >= 0; set "
                             "it to the GPU sampling interval (e.g. 1) or 0 to turn sampling "
                             "off\n")
    assert not (tmp_path / "runs").exists()


# ---- the analysis and the finding -----------------------------------------------------------


def _gpu(arm: str, p: int, slow: set) -> dict:
    """A pass's record: 1,980 MHz, or 1,650 MHz under a power cap in the slow passes."""
    capped = (arm, p) in slow
    return {"n_samples": 8, "interval_s": 1.0,
            "sm_clock_mhz_mean": (1650.0 if capped else 1980.0) - p - (arm == "trt"),
            "sm_clock_mhz_min": 1500.0 if capped else 1970.0, "mem_clock_mhz_mean": 3201.0,
            "temperature_c_max": 60.0 + p, "power_w_mean": 690.0 if capped else 450.0 + p,
            "power_w_max": 700.0, "utilization_pct_mean": 99.0,
            "slowdown_share": 0.75 if capped else 0.0,
            "slowdown_reasons": {"sw_power_cap": 6} if capped else {}, "gpus": ["GPU-aaa"]}


def test_the_analysis_relates_slow_passes_to_a_lower_sm_clock(tmp_path):
    slow = {("ctl", 2), ("trt", 3), ("ctl", 5)}

    def tp(arm: str, p: int) -> float:   # a capped pass takes 1.2x its arm's usual time
        return (40.0 if arm == "ctl" else 36.0) / (1.2 if (arm, p) in slow else 1.0 + 0.01 * p)

    reg = register_tiny(tmp_path, declaration(passes=6))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], passes=6, throughput=tp,
                             gpu=lambda arm, p: _gpu(arm, p, slow)))
    clocks = gpu_clocks(s)
    assert clocks is not None and clocks.n == 12
    p2 = next(p for p in s.passes if (p.arm, p.pass_index) == ("ctl", 2))
    assert (p2.gpu_sm_clock_mhz, p2.gpu_sm_clock_min_mhz, p2.gpu_temperature_max_c,
            p2.gpu_power_w, p2.gpu_slowdown_share) == (1648.0, 1500.0, 62.0, 690.0, 0.75)
    expected = within_arm_spearman(s, "gpu_sm_clock_mhz")
    assert clocks.rho == pytest.approx(expected.statistic) and clocks.rho < -0.6
    assert clocks.p_value == pytest.approx(expected.pvalue) and clocks.slow_at_lower_clock
    # per arm: passes, median SM clock, lowest, hottest, median power, passes slowed
    ctl = [_gpu("ctl", q.pass_index, slow) for q in s.passes if q.arm == "ctl" and q.counted]
    assert clocks.arms[0] == ("ctl", 6, float(np.median([g["sm_clock_mhz_mean"] for g in ctl])),
                              1500.0, 60.0 + max(q.pass_index for q in s.passes),
                              float(np.median([g["power_w_mean"] for g in ctl])), 2)
    assert clocks.arms[1][0] == "trt" and clocks.arms[1][6] == 1
    text = render_markdown(s)
    assert "**GPU clocks.**" in text
    assert "| ctl | 6 | 1,976 MHz | 1,500 MHz | 65 °C | 454 W | 2 |" in text
    assert "the slower passes ran at lower SM clocks" in text
    data = summary_to_dict(s)
    assert data["gpu_clocks"]["slow_at_lower_clock"] is True and data["gpu_clocks"]["n"] == 12
    assert data["gpu_clocks"]["arms"][0]["passes_slowed"] == 2


def test_a_steady_clock_is_no_sign_and_a_run_without_samples_says_nothing(tmp_path):
    reg = register_tiny(tmp_path, declaration(passes=6))

    def tp(arm, p):
        return 40.0 / (1.0 + 0.05 * ((p * 7) % 5))

    steady = make_run(tmp_path, reg, lambda arm, p, i: [i], passes=6, throughput=tp,
                      gpu=lambda arm, p: {**_gpu(arm, p, set()),
                                          "sm_clock_mhz_mean": 1980.0 - (p * 3) % 4},
                      run_name="steady")
    clocks = gpu_clocks(analyze_run(steady))
    assert clocks is not None and not clocks.slow_at_lower_clock
    assert "no sign that the SM clock set the pass times" in render_markdown(analyze_run(steady))
    plain = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], run_name="plain"))
    assert gpu_clocks(plain) is None and "GPU clocks" not in render_markdown(plain)
    assert summary_to_dict(plain)["gpu_clocks"] is None
    # a pass the sampler saw no sample of (shorter than its interval) is not a pass at 0 MHz
    empty = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], run_name="empty",
                                 gpu=lambda arm, p: {"n_samples": 0, "interval_s": 1.0}))
    assert gpu_clocks(empty) is None
