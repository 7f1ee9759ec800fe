"""A killed run loses nothing, and --resume completes the schedule exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import fakes
import helpers_runner as h
from bistat.store.readers import read_jsonl
from bistat.run.runner import GpuBusyError, ResumeError, read_resume_state, resume_run, start_run

REG = {"path": "p.json", "sha256": "0" * 64, "registered_utc": "2026-01-01T00:00:00Z", "name": "fakerun"}
TESTS = Path(__file__).resolve().parent
# every prompt but the last fails in the treatment: a pass in which all fail would stop the run
ALL = [f"chat-{i:04d}" for i in range(11)]


def _tables(d):
    return {t: read_jsonl(d / f"{t}.jsonl")[0] for t in ("schedule", "responses", "passes", "events")}


def _check_completed_exactly_once(d, passes=4, n_prompts=12):
    t = _tables(d)
    ends = [r for r in t["schedule"] if r["event"] == "end"]
    done = Counter(r["arm"] for r in ends if r["kind"] == "counted" and r["status"] in ("complete", "failed"))
    assert done == {"blas": passes, "invariant": passes}
    seqs = [r["seq"] for r in t["schedule"] if r["event"] == "start"]
    assert len(seqs) == len(set(seqs))  # no seq reused
    assert sorted(seqs) == sorted(r["seq"] for r in ends)  # every pass closed
    for arm in ("blas", "invariant"):
        idx = [r["pass_index"] for r in t["schedule"] if r["event"] == "start" and r["arm"] == arm]
        assert len(idx) == len(set(idx))
    good = {r["seq"] for r in ends if r["status"] != "interrupted"}
    per_seq = Counter(r["seq"] for r in t["responses"] if r["seq"] in good)
    assert set(per_seq.values()) == {n_prompts}
    return t


def test_resume_after_an_engine_death_completes_the_schedule_once(tmp_path):
    script = fakes.FakeScript()
    arms = [{"name": "blas", "role": "control"},
            {"name": "invariant", "role": "treatment",
             "args": {"fake": {"crash_on_call": 3, "crash_after": 4, "fail_prompts": ["chat-0000"]}}}]
    exp = h.experiment(arms=arms)
    d = tmp_path / "run"
    first = start_run(exp, REG, d, engine_factory=script.factory)
    assert first.status == "incomplete"
    before = _tables(d)["responses"]
    crashed_seq = max(r["seq"] for r in before)
    assert len([r for r in before if r["seq"] == crashed_seq]) == 4

    state = read_resume_state(d)
    assert state.open_passes == ()
    second = resume_run(exp, d, engine_factory=script.factory)
    assert second.status == "complete"
    t = _check_completed_exactly_once(d)
    # every record received before the crash is still there, unchanged
    assert t["responses"][:len(before)] == before
    end = [r for r in t["schedule"] if r["event"] == "end" and r["seq"] == crashed_seq]
    assert [(r["status"], r["n_failed"]) for r in end] == [("interrupted", 1)]
    # the resumed part restarted both engines in a new block, with warm-ups again
    blocks = {r["block"] for r in t["schedule"] if r["seq"] > crashed_seq}
    assert blocks == {1}
    assert [(r["arm"], r["kind"]) for r in t["schedule"] if r["event"] == "start" and r["seq"] > crashed_seq][:2] == [
        ("blas", "warmup"), ("invariant", "warmup")]
    assert second.failed_requests == sum(1 for r in t["responses"]
                                         if r["seq"] > crashed_seq and r["error"] is not None)
    assert (d / "responses.parquet").exists()


def test_resume_of_a_complete_run_runs_nothing(tmp_path):
    script = fakes.FakeScript()
    exp = h.experiment()
    d = tmp_path / "run"
    start_run(exp, REG, d, engine_factory=script.factory)
    n = len(script.passes)
    outcome = resume_run(exp, d, engine_factory=script.factory)
    assert (outcome.status, outcome.passes_run, outcome.detail) == (
        "complete", 0, "nothing left to run: the schedule is complete")
    assert len(script.passes) == n


def test_resume_refuses_a_changed_workload(tmp_path):
    script = fakes.FakeScript()
    d = tmp_path / "run"
    start_run(h.experiment(), REG, d, engine_factory=script.factory)
    other = h.experiment(workload={"source": "builtin:token-ids"})
    with pytest.raises(ResumeError, match="the workload's prompts differ"):
        resume_run(other, d, engine_factory=script.factory)


KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import fakes, helpers_runner as h
from bistat.run.runner import start_run
ALL = ["chat-%04d" % i for i in range(11)]
arms = [{{"name": "blas", "role": "control"}},
        {{"name": "invariant", "role": "treatment", "args": {{"fake": {{"exit_on_call": 2, "crash_after": 6,
                                                                     "fail_prompts": ALL}}}}}}]
exp = h.experiment(arms=arms)
start_run(exp, {reg!r}, {run_dir!r}, engine_factory=fakes.FakeScript().factory)
print("not killed")
"""


def test_resume_after_the_process_was_killed_mid_pass(tmp_path):
    d = tmp_path / "run"
    code = KILL_SCRIPT.format(tests=str(TESTS), reg=REG, run_dir=str(d))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 137, proc.stderr
    t = _tables(d)
    open_seq = max(r["seq"] for r in t["schedule"])
    assert [r["event"] for r in t["schedule"] if r["seq"] == open_seq] == ["start"]  # no end: killed
    assert len([r for r in t["responses"] if r["seq"] == open_seq]) == 6

    state = read_resume_state(d)
    assert [r["seq"] for r in state.open_passes] == [open_seq]
    failed_before = sum(1 for r in t["responses"] if r["seq"] == open_seq and r["error"])
    assert failed_before >= 5
    arms = [{"name": "blas", "role": "control"},
            {"name": "invariant", "role": "treatment", "args": {"fake": {"fail_prompts": ALL}}}]
    exp = h.experiment(arms=arms)
    outcome = resume_run(exp, d, engine_factory=fakes.FakeScript().factory)
    assert outcome.status == "complete"
    t = _check_completed_exactly_once(d)
    end = [r for r in t["schedule"] if r["event"] == "end" and r["seq"] == open_seq]
    assert [(r["status"], r["n_failed"], r["detail"]) for r in end] == [
        ("interrupted", failed_before, "closed on resume: the process ended during this pass")]
    header = json.loads((d / "run.json").read_text())
    assert header["registration"] == REG


def test_resume_refuses_a_busy_gpu_before_writing_anything_unless_allowed(tmp_path, monkeypatch):
    """resume_run checks the GPU as start_run does: a library caller gets the refusal too."""
    script = fakes.FakeScript()
    exp = h.experiment(engine={"kind": "vllm-server", "model": "/tmp/m"},
                       arms=[{"name": "blas", "role": "control", "args": {"fake": {"crash_on_call": 1}}},
                             {"name": "invariant", "role": "treatment"}])
    d = tmp_path / "run"
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: [])
    assert start_run(exp, REG, d, engine_factory=script.factory).status == "incomplete"
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    busy = [{"gpu_uuid": "GPU-x", "pid": 1105, "name": "VLLM::EngineCore", "used_memory_mib": 28930}]
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: busy)
    with pytest.raises(GpuBusyError, match=r"^other processes hold the GPU: pid 1105 "
                                           r"VLLM::EngineCore \(28930 MiB on GPU-x\)\. "):
        resume_run(exp, d, engine_factory=script.factory)
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    outcome = resume_run(exp, d, engine_factory=script.factory, allow_busy_gpu=True)
    assert outcome.status == "complete"
    events = _tables(d)["events"]
    assert [e["detail"] for e in events if e["event"] == "gpu_busy"] == [
        "pid 1105 VLLM::EngineCore (28930 MiB on GPU-x)"]
    _check_completed_exactly_once(d)
