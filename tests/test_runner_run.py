"""The runner on the fake engine: what a complete run records."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import bistat
import fakes
import helpers_runner as h
from bistat.engines.base import MetricsSample
from bistat.store.format import logprob_sha256, token_sha256
from bistat.store.readers import read_jsonl, read_table
from bistat.declare.concurrency import resolve_engines_concurrent
from bistat.run.batching import batching_summary
from bistat.run.runner import GpuBusyError, PlainReporter, new_run_dir, start_run

REG = {"path": "preregistrations/fakerun.json", "sha256": "ab" * 32, "registered_utc": "2026-01-01T00:00:00Z",
       "name": "fakerun"}
ARMS_DIVERGING = [{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.6}}},
                  {"name": "invariant", "role": "treatment"}]


def _run(tmp_path, script=None, **sections):
    script = script or fakes.FakeScript()
    exp = h.experiment(**sections)
    outcome = start_run(exp, REG, tmp_path / "run", engine_factory=script.factory, command=["bistat", "run", "x"])
    return exp, script, outcome


def test_complete_run_records_every_table(tmp_path):
    exp, script, outcome = _run(tmp_path, arms=ARMS_DIVERGING)
    d = tmp_path / "run"
    assert (outcome.status, outcome.passes_run, outcome.failed_requests) == ("complete", 10, 0)
    header = json.loads((d / "run.json").read_text())
    assert header["registration"] == REG
    assert header["command"] == ["bistat", "run", "x"]
    assert (header["schema"], header["engine_kind"], header["engines_concurrent"]) == ("bistat.run/1", "fake", True)
    assert header["run_id"] == "run"

    schedule, gaps = read_jsonl(d / "schedule.jsonl")
    assert gaps == []
    starts = [r for r in schedule if r["event"] == "start"]
    ends = [r for r in schedule if r["event"] == "end"]
    assert [r["seq"] for r in starts] == [r["seq"] for r in ends] == list(range(10))
    assert [(r["arm"], r["kind"]) for r in starts] == [
        ("blas", "warmup"), ("invariant", "warmup"),
        ("blas", "counted"), ("invariant", "counted"), ("invariant", "counted"), ("blas", "counted"),
        ("blas", "counted"), ("invariant", "counted"), ("invariant", "counted"), ("blas", "counted")]
    assert {(r["status"], r["n_failed"], r["block"]) for r in ends} == {("complete", 0, 0)}

    responses, _ = read_jsonl(d / "responses.jsonl")
    assert len(responses) == 10 * 12
    for r in responses:
        assert r["token_sha256"] == token_sha256(r["token_ids"])
        assert r["logprob_sha256"] == logprob_sha256(r["logprobs"])
        assert r["prompt_id"] == f"chat-{r['prompt_index']:04d}"
        assert r["error"] is None and r["attempts"] == 1
    counted = [r for r in responses if r["kind"] == "counted"]
    distinct = {arm: Counter() for arm in ("blas", "invariant")}
    for arm in distinct:
        by_prompt: dict[str, set] = {}
        for r in counted:
            if r["arm"] == arm:
                by_prompt.setdefault(r["prompt_id"], set()).add(r["token_sha256"])
        distinct[arm] = Counter(len(v) for v in by_prompt.values())
    assert distinct["invariant"] == {1: 12}
    assert sum(n for k, n in distinct["blas"].items() if k > 1) >= 6

    passes, _ = read_jsonl(d / "passes.jsonl")
    assert len(passes) == 10
    for p in passes:
        assert p["n_requests"] == 12 and p["n_failed"] == 0 and p["status"] == "complete"
        assert p["output_tokens"] == sum(len(r["token_ids"]) for r in responses if r["seq"] == p["seq"])
        assert p["output_tokens_per_s"] == pytest.approx(p["output_tokens"] / p["wall_s"])
        assert p["batching"]["max_running"] == 4.0 and p["batching"]["preemptions"] == 0.0
        assert set(p["batching"]["running_hist"]) == {"0", "4"}
        # the host's load over the pass (bistat.run.hostload): counters, not guesses
        host = p["host"]
        assert host["n_cpus"] >= 1 and host["busy_s"] >= 0.0 and host["steal_s"] >= 0.0
        assert 0.0 <= host["own_cpu_s"] <= host["n_cpus"] * p["wall_s"] + 0.05
    import jsonschema
    schema = json.loads((Path(bistat.__file__).parent / "schemas" / "passes.schema.json").read_text())
    for p in passes:
        jsonschema.validate(p, schema)

    metrics, _ = read_jsonl(d / "metrics.jsonl")
    assert Counter(m["seq"] for m in metrics) == {s: 4 for s in range(10)}  # 3 batches + the final sample
    env, _ = read_jsonl(d / "environment.jsonl")
    assert [(e["arm"], e["block"], e["engine"]["version"]) for e in env] == [("blas", 0, "fake-1.0"),
                                                                             ("invariant", 0, "fake-1.0")]
    assert env[0]["fingerprint"]["host"] == "fake-host"
    events, _ = read_jsonl(d / "events.jsonl")
    assert [(e["arm"], e["event"]) for e in events] == [("blas", "started"), ("invariant", "started"),
                                                        ("blas", "stopped"), ("invariant", "stopped")]
    assert sorted(p.name for p in d.glob("*.parquet")) == sorted(
        f"{t}.parquet" for t in ("schedule", "responses", "passes", "metrics", "environment", "events"))
    assert len(read_table(d, "responses")) == 120


def test_every_pass_submits_a_different_order(tmp_path):
    _, script, _ = _run(tmp_path)
    orders = [order for _, order in script.passes]
    assert len(orders) == 10 and len(set(orders)) == 10
    assert all(sorted(o) == sorted(orders[0]) for o in orders)


def test_engines_stay_up_together_or_restart_per_block(tmp_path):
    _, script, _ = _run(tmp_path)
    assert script.max_running_engines == 2 and script.starts == ["blas", "invariant"]


def test_restart_mode_when_memory_does_not_allow(tmp_path, monkeypatch):
    exp = h.experiment(engine={"kind": "vllm-server", "model": "m"})
    assert resolve_engines_concurrent(exp) == (
        False, "auto: arms' GPU memory fractions sum to 1.8, + 2 × 0.03 headroom = 1.86 > 1; one engine at a time")
    exp = h.experiment(engine={"kind": "vllm-server", "model": "m", "args": {"gpu_memory_utilization": 0.4}})
    assert resolve_engines_concurrent(exp) == (
        True, "auto: arms' GPU memory fractions sum to 0.8, + 2 × 0.03 headroom = 0.86 <= 1")
    assert resolve_engines_concurrent(h.experiment())[0] is True

    script = fakes.FakeScript()
    monkeypatch.setattr("bistat.run.runner.resolve_engines_concurrent", lambda e: (False, "declared"))
    outcome = start_run(h.experiment(), REG, tmp_path / "r2", engine_factory=script.factory)
    assert outcome.status == "complete"
    assert script.max_running_engines == 1
    assert script.starts == ["blas", "invariant", "blas", "invariant", "blas"]
    schedule, _ = read_jsonl(tmp_path / "r2" / "schedule.jsonl")
    ends = [r for r in schedule if r["event"] == "end"]
    assert Counter((r["arm"], r["kind"]) for r in ends) == {("blas", "warmup"): 3, ("blas", "counted"): 4,
                                                            ("invariant", "warmup"): 2, ("invariant", "counted"): 4}
    assert json.loads((tmp_path / "r2" / "run.json").read_text())["engines_concurrent"] is False


def test_batching_summary_is_time_weighted():
    s = lambda t, run, wait, pre: MetricsSample(t, run, wait, pre, 0.0, 0.0, "x")
    got = batching_summary([s(0.0, 4, 2, 1), s(1.0, 2, 0, 1), s(4.0, 0, 0, 3)], wall_s=5.0)
    assert got == {"mean_running": (4 * 1 + 2 * 3 + 0 * 1) / 5, "max_running": 4, "mean_waiting": 2 / 5,
                   "preemptions": 2.0, "running_hist": {"0": 1.0, "2": 3.0, "4": 1.0}}
    assert batching_summary([], 1.0) == {"mean_running": None, "max_running": None, "mean_waiting": None,
                                         "preemptions": None, "running_hist": {}}


def test_new_run_dir_never_reuses_a_name(tmp_path):
    import datetime as dt

    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    first = new_run_dir(tmp_path, "quickstart", now)
    assert first == tmp_path / "quickstart-20260102T030405Z"
    first.mkdir()
    assert new_run_dir(tmp_path, "quickstart", now) == tmp_path / "quickstart-20260102T030405Z-2"


def test_engines_without_a_machine_fingerprint_get_this_machines(tmp_path, monkeypatch):
    monkeypatch.setattr(fakes.FakeEngine, "fingerprint", lambda self: {"kind": "fake", "url": "http://127.0.0.1:1"})
    _, _, outcome = _run(tmp_path)
    assert outcome.status == "complete"
    env, _ = read_jsonl(tmp_path / "run" / "environment.jsonl")
    fp = env[0]["fingerprint"]
    assert fp["source"] == "runner" and fp["gpus"] == []
    assert fp["engine_reported"] == {"kind": "fake", "url": "http://127.0.0.1:1"}
    assert set(fp) >= {"gpus", "cpu", "os", "versions", "git", "host"}


def test_rich_progress_reports_each_pass(tmp_path):
    import io

    from rich.console import Console

    from bistat.run.runner import RichReporter

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    script = fakes.FakeScript()
    start_run(h.experiment(), REG, tmp_path / "run", engine_factory=script.factory, reporter=RichReporter(console))
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    bars = [part for part in text.split("\r") if "━" in part]
    assert bars and "12/12" in bars[-1] and "tok/s" in bars[-1]  # the live bar: done/total and tokens/s
    lines = [line for line in text.replace("\r", "\n").splitlines() if re.match(r"pass \d+/10 .*\(seq", line)]
    assert len(lines) == 10
    assert lines[0].startswith("pass 1/10 blas warmup (seq 0): 12 requests, 0 failed, ")
    assert lines[0].endswith(" tok/s")


def test_every_request_asks_for_the_declared_top_logprobs(tmp_path):
    seen = []
    script = fakes.FakeScript()

    class Spy(fakes.FakeEngine):
        def run_pass(self, requests, **kw):
            seen.extend(r.logprobs for r in requests)
            super().run_pass(requests, **kw)

    exp = h.experiment(workload={"top_logprobs": 3})
    outcome = start_run(exp, REG, tmp_path / "run", engine_factory=lambda e, a: Spy(e, a, script=script))
    assert outcome.status == "complete"
    assert len(seen) == 10 * 12 and set(seen) == {3}
    responses, _ = read_jsonl(tmp_path / "run" / "responses.jsonl")
    assert all(r["top_logprobs"] is not None for r in responses)


def test_engine_server_logs_are_kept_in_the_run_dir(tmp_path, monkeypatch):
    """An engine with a server log (vLLM's) gets it copied, gzipped, into engine-logs/ at stop."""
    import gzip

    def log_path(self):
        p = tmp_path / f"server-{self.arm_name if hasattr(self, 'arm_name') else id(self)}.log"
        if not p.exists():
            p.write_text(f"INFO vLLM log of engine {id(self)}\n")
        return p

    monkeypatch.setattr(fakes.FakeEngine, "log_path", property(log_path), raising=False)
    _, _, outcome = _run(tmp_path, arms=ARMS_DIVERGING)
    assert outcome.status == "complete"
    logs = sorted(p.name for p in (tmp_path / "run" / "engine-logs").iterdir())
    assert logs == ["blas-1.log.gz", "invariant-1.log.gz"]
    text = gzip.decompress((tmp_path / "run" / "engine-logs" / "blas-1.log.gz").read_bytes()).decode()
    assert text.startswith("INFO vLLM log of engine ")


def test_a_busy_gpu_the_caller_allowed_is_recorded_as_an_event(tmp_path):
    script = fakes.FakeScript()
    outcome = start_run(h.experiment(), REG, tmp_path / "run", engine_factory=script.factory,
                        gpu_busy="pid 7 python3 (100 MiB on GPU-x)")
    assert outcome.status == "complete"
    events, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert events[0]["arm"] == "*" and events[0]["event"] == "gpu_busy"
    assert events[0]["detail"] == "pid 7 python3 (100 MiB on GPU-x)"
    assert [e for e in events if e["event"] == "gpu_busy"] == events[:1]


def test_bistat_run_refuses_a_vllm_run_on_a_busy_gpu_unless_allowed(monkeypatch):
    import click

    from bistat.cli import cmd_run

    procs = [{"gpu_uuid": "GPU-x", "pid": 1105, "name": "VLLM::EngineCore",
              "used_memory_mib": 28930}]
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: procs)
    served = h.experiment(engine={"kind": "vllm-server", "model": "/tmp/m"})
    with pytest.raises(click.ClickException, match=r"other processes hold the GPU: pid 1105 "
                       r"VLLM::EngineCore \(28930 MiB on GPU-x\)\..*--allow-busy-gpu"):
        cmd_run._gpu_busy(served, allow=False)
    assert cmd_run._gpu_busy(served, allow=True) == "pid 1105 VLLM::EngineCore (28930 MiB on GPU-x)"
    # the embedded engine and a remote server start nothing on this GPU: not checked
    assert cmd_run._gpu_busy(h.experiment(), allow=False) is None
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: None)  # no nvidia-smi
    assert cmd_run._gpu_busy(served, allow=False) is None


BUSY = [{"gpu_uuid": "GPU-x", "pid": 1105, "name": "VLLM::EngineCore", "used_memory_mib": 28930}]


def test_start_run_refuses_a_vllm_run_on_a_busy_gpu_unless_allowed(tmp_path, monkeypatch):
    """The refusal is the runner's, not only the CLI's: a library caller gets it too."""
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: BUSY)
    served = h.experiment(engine={"kind": "vllm-server", "model": "/tmp/m"})
    script = fakes.FakeScript()
    with pytest.raises(GpuBusyError, match=r"^other processes hold the GPU: pid 1105 "
                       r"VLLM::EngineCore \(28930 MiB on GPU-x\)\..*allow_busy_gpu=True") as info:
        start_run(served, REG, tmp_path / "refused", engine_factory=script.factory)
    assert info.value.detail == "pid 1105 VLLM::EngineCore (28930 MiB on GPU-x)"
    # the CLI's words (bistat run): the same refusal, naming its flag
    assert info.value.explain("--allow-busy-gpu") == (
        "other processes hold the GPU: pid 1105 VLLM::EngineCore (28930 MiB on GPU-x). They would "
        "share its memory and time with the engines this run starts (and a leftover run's engines "
        "are among them). Stop them, or record the run anyway with --allow-busy-gpu (its finding "
        "will list this as a deviation)")
    assert not (tmp_path / "refused").exists() and script.starts == []   # nothing started

    lines: list[str] = []
    outcome = start_run(served, REG, tmp_path / "allowed", engine_factory=script.factory,
                        reporter=PlainReporter(lines.append), allow_busy_gpu=True)
    assert outcome.status == "complete"
    assert lines[0] == ("warning: other processes hold the GPU: pid 1105 VLLM::EngineCore "
                        "(28930 MiB on GPU-x); recorded (allowed)")
    events, _ = read_jsonl(tmp_path / "allowed" / "events.jsonl")
    assert [(e["arm"], e["event"], e["detail"]) for e in events if e["event"] == "gpu_busy"] == [
        ("*", "gpu_busy", "pid 1105 VLLM::EngineCore (28930 MiB on GPU-x)")]


def test_start_run_checks_the_gpu_only_for_engines_it_starts_there(tmp_path, monkeypatch):
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: BUSY)
    # the fake (like the embedded engine and an attached server) starts nothing on this GPU
    assert start_run(h.experiment(), REG, tmp_path / "fake",
                     engine_factory=fakes.FakeScript().factory).status == "complete"
    served = h.experiment(engine={"kind": "vllm-offline", "model": "/tmp/m"})
    for name, procs in (("free", []), ("no-smi", None)):   # nothing there; no nvidia-smi to ask
        monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda procs=procs: procs)
        outcome = start_run(served, REG, tmp_path / name, engine_factory=fakes.FakeScript().factory)
        assert outcome.status == "complete"
        events, _ = read_jsonl(tmp_path / name / "events.jsonl")
        assert "gpu_busy" not in {e["event"] for e in events}
    # a caller that checked the GPU itself and allowed what it found: recorded, not checked again
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: BUSY)
    outcome = start_run(served, REG, tmp_path / "checked", engine_factory=fakes.FakeScript().factory,
                        gpu_busy="pid 7 python3 (100 MiB on GPU-x)")
    events, _ = read_jsonl(tmp_path / "checked" / "events.jsonl")
    assert [e["detail"] for e in events if e["event"] == "gpu_busy"] == [
        "pid 7 python3 (100 MiB on GPU-x)"]
