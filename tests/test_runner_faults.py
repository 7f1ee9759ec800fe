"""The runner under failures: failed and dropped requests, refused engines, crashes, Ctrl-C."""

from __future__ import annotations

from collections import Counter

import fakes
import helpers_runner as h

from bistat.store.readers import read_jsonl
from bistat.run.runner import start_run

REG = {"path": "p.json", "sha256": "0" * 64, "registered_utc": "2026-01-01T00:00:00Z", "name": "fakerun"}


def _arms(control=None, treatment=None):
    return [{"name": "blas", "role": "control", "args": {"fake": control or {}}},
            {"name": "invariant", "role": "treatment", "args": {"fake": treatment or {}}}]


def _run(tmp_path, control=None, treatment=None, **workload):
    script = fakes.FakeScript()
    exp = h.experiment(arms=_arms(control, treatment), workload=workload)
    outcome = start_run(exp, REG, tmp_path / "run", engine_factory=script.factory)
    tables = {t: read_jsonl(tmp_path / "run" / f"{t}.jsonl")[0]
              for t in ("schedule", "responses", "passes", "events", "environment")}
    return outcome, script, tables


def test_failed_requests_are_recorded_counted_and_flag_the_pass(tmp_path):
    outcome, _, t = _run(tmp_path, treatment={"fail_prompts": ["chat-0003", "chat-0007"]})
    assert outcome.status == "complete"
    assert (outcome.failed_requests, outcome.failed_passes) == (2 * 5, 5)
    failed = [r for r in t["responses"] if r["error"] is not None]
    assert len(failed) == 10
    assert {(r["arm"], r["prompt_id"], r["error"], r["attempts"], r["token_sha256"]) for r in failed} == {
        ("invariant", "chat-0003", "HTTP 500: Internal Server Error", 3, None),
        ("invariant", "chat-0007", "HTTP 500: Internal Server Error", 3, None)}
    ends = [r for r in t["schedule"] if r["event"] == "end"]
    assert {(r["arm"], r["status"], r["n_failed"]) for r in ends} == {("blas", "complete", 0),
                                                                      ("invariant", "failed", 2)}
    assert {(p["arm"], p["n_failed"], p["status"]) for p in t["passes"]} == {("blas", 0, "complete"),
                                                                            ("invariant", 2, "failed")}


def test_transient_failures_within_the_declared_retries_succeed(tmp_path):
    outcome, _, t = _run(tmp_path, control={"transient_failures": 2}, retries=2)
    assert outcome.failed_requests == 0
    assert Counter((r["arm"], r["attempts"]) for r in t["responses"]) == {("blas", 3): 60, ("invariant", 1): 60}


def test_transient_failures_beyond_the_retries_fail(tmp_path):
    """Every request of the control fails past its retries: its first pass (a warm-up) fails
    whole, so the run stops there, the pass recorded failed and the engines stopped."""
    outcome, script, t = _run(tmp_path, control={"transient_failures": 2}, retries=1)
    assert (outcome.status, outcome.failed_requests, outcome.passes_run) == ("stopped", 12, 1)
    assert {(r["error"], r["attempts"]) for r in t["responses"] if r["arm"] == "blas"} == {
        ("HTTP 500: Internal Server Error", 2)}
    assert outcome.detail == (
        "every request of pass 0 of arm 'blas' (warmup, schedule position 0) failed: the pass is "
        "recorded failed and the engines are stopped. 12 of 12 requests failed with this error "
        "(numbers aside): HTTP 500: Internal Server Error")
    assert [(r["event"], r.get("status"), r.get("stopped")) for r in t["schedule"]] == [
        ("start", None, None), ("end", "failed", "every request failed")]
    assert script.running == set()


def test_a_counted_pass_in_which_every_request_failed_is_run_again_on_resume(tmp_path):
    """The run stops on a counted pass of only failures (recorded failed, first error named);
    the resume supersedes it (a second end line, interrupted) and runs it again in full, so the
    analysis counts the declared passes, none of them empty."""
    from bistat.run.runner import resume_run

    script = fakes.FakeScript()
    exp = h.experiment(arms=_arms(treatment={"fail_prompts": [f"chat-{i:04d}" for i in range(12)]}),
                       workload={"warmup_passes": 0})
    outcome = start_run(exp, REG, tmp_path / "run", engine_factory=script.factory)
    assert outcome.status == "stopped"
    assert [(g.count, g.first) for g in outcome.errors] == [(12, "HTTP 500: Internal Server Error")]
    sched = read_jsonl(tmp_path / "run" / "schedule.jsonl")[0]
    stopped = [r for r in sched if r.get("stopped")]
    assert [(r["arm"], r["kind"], r["status"], r["n_failed"]) for r in stopped] == [
        ("invariant", "counted", "failed", 12)]
    healed = h.experiment(arms=_arms(), workload={"warmup_passes": 0})
    resumed = resume_run(healed, tmp_path / "run", engine_factory=fakes.FakeScript().factory)
    assert resumed.status == "complete"
    sched = read_jsonl(tmp_path / "run" / "schedule.jsonl")[0]
    again = [(r["status"], r.get("detail")) for r in sched
             if r["event"] == "end" and r["seq"] == stopped[0]["seq"]]
    assert again == [("failed", None), ("interrupted", "superseded on resume: every request of "
                                                       "this pass failed and the run stopped on "
                                                       "it; it is run again in full")]
    from bistat.store.passes import counted_passes

    assert {a: len(p) for a, p in counted_passes(tmp_path / "run").items()} == {
        "blas": 4, "invariant": 4}


def test_a_request_the_engine_never_answers_is_recorded_as_failed(tmp_path):
    outcome, _, t = _run(tmp_path, control={"drop_prompts": ["chat-0005"]})
    assert outcome.failed_requests == 5
    dropped = [r for r in t["responses"] if r["error"] is not None]
    assert {(r["prompt_id"], r["prompt_index"], r["error"], r["attempts"]) for r in dropped} == {
        ("chat-0005", 5, "engine returned no result", 0)}
    assert len(t["responses"]) == 120


def test_refused_engine_makes_the_run_untested_and_stops_the_started_one(tmp_path):
    outcome, script, t = _run(tmp_path, treatment={"refuse": "VLLM_BATCH_INVARIANT needs compute capability 9.0"})
    assert outcome.status == "untested"
    assert outcome.detail == ("engine for arm 'invariant' refused the setting: "
                              "VLLM_BATCH_INVARIANT needs compute capability 9.0")
    assert [(e["arm"], e["event"], e["detail"]) for e in t["events"]][1:] == [
        ("invariant", "refused", "VLLM_BATCH_INVARIANT needs compute capability 9.0"),
        ("blas", "stopped", None)]
    assert script.running == set()
    assert t["schedule"] == [] and t["responses"] == []
    assert (tmp_path / "run" / "events.parquet").exists()


def test_engine_start_failure_is_untested(tmp_path):
    outcome, _, t = _run(tmp_path, control={"start_error": "server never became healthy (900 s)"})
    assert outcome.status == "untested"
    assert [(e["arm"], e["event"], e["detail"]) for e in t["events"]] == [
        ("blas", "start_failed", "EngineStartError: server never became healthy (900 s)")]


def test_engine_death_mid_pass_keeps_every_received_record(tmp_path):
    # 11 of 12 prompts fail (a pass in which every one failed would stop the run first)
    outcome, script, t = _run(tmp_path, treatment={"crash_on_call": 2, "crash_after": 5,
                                                   "fail_prompts": ["chat-0000", "chat-0001", "chat-0002",
                                                                    "chat-0003", "chat-0004", "chat-0005",
                                                                    "chat-0006", "chat-0007", "chat-0008",
                                                                    "chat-0009", "chat-0010"]})
    assert outcome.status == "incomplete"
    assert outcome.detail.startswith("engine for arm 'invariant' failed during pass seq 4: ")
    crashed = [r for r in t["responses"] if r["seq"] == 4]
    n_failed = sum(r["error"] is not None for r in crashed)
    assert len(crashed) == 5 and n_failed >= 4
    end = [r for r in t["schedule"] if r["event"] == "end" and r["seq"] == 4]
    assert [(r["status"], r["n_failed"]) for r in end] == [("interrupted", n_failed)]
    assert [e["event"] for e in t["events"] if e["arm"] == "invariant"][-1] == "exited"
    assert script.running == set()
    assert not (tmp_path / "run" / "responses.parquet").exists()


def test_ctrl_c_stops_engines_and_keeps_the_data(tmp_path):
    outcome, script, t = _run(tmp_path, control={"interrupt_on_call": 1, "crash_after": 7})
    assert (outcome.status, outcome.detail) == ("interrupted", "interrupted by SIGINT (Ctrl-C)")
    assert outcome.passes_run == 2
    assert len([r for r in t["responses"] if r["seq"] == 2]) == 7
    assert [(r["event"], r.get("status")) for r in t["schedule"] if r["seq"] == 2] == [("start", None),
                                                                                        ("end", "interrupted")]
    assert script.running == set() and sorted(script.stops) == ["blas", "invariant"]


def test_a_vllm_offline_worker_dying_mid_pass_interrupts_the_run_and_resume_finishes_it(tmp_path):
    """The H200 lesson, end to end with the real adapter and worker on the stand-in vLLM: the
    batch-invariant arm's worker dies (torch.OutOfMemoryError) in its second counted pass. The
    pass ends interrupted with the results received kept, the engines are stopped, the run is
    incomplete (not 8 more passes of '12 failed'), and a resume completes the schedule."""
    from bistat.engines.vllm_offline import VLLMOfflineEngine
    from bistat.run.runner import resume_run

    site = fakes.fake_vllm_site(tmp_path)
    flag = tmp_path / "crash-once"
    flag.write_text("")
    env = {"PYTHONPATH": site}
    exp = h.experiment(
        engine={"kind": "vllm-offline", "model": "smol",
                "args": {"max_num_seqs": 4, "start_timeout_s": 60, "pass_idle_timeout_s": 30}},
        arms=[{"name": "default", "role": "control", "env": env},
              {"name": "batch-invariant", "role": "treatment",
               # warm-up (12) + first counted pass (12) + 7: dies in the second, while its
               # second batch of 4 finishes (the first batch's 4 results were sent)
               "env": {**env, "FAKE_CRASH_AFTER": "31", "FAKE_CRASH_FLAG": str(flag)}}],
        workload={"source": "builtin:token-ids?length=3&vocab=900", "passes": 2,
                  "warmup_passes": 1, "order": "abba"})
    factory = VLLMOfflineEngine.from_experiment
    outcome = start_run(exp, REG, tmp_path / "run", engine_factory=factory)
    schedule = read_jsonl(tmp_path / "run" / "schedule.jsonl")[0]
    responses = read_jsonl(tmp_path / "run" / "responses.jsonl")[0]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")[0]
    assert outcome.status == "incomplete" and not flag.exists()
    crashed = [r for r in schedule if r["event"] == "end" and r["status"] == "interrupted"]
    assert [(r["arm"], r["kind"], r["pass_index"], r["n_failed"]) for r in crashed] == [
        ("batch-invariant", "counted", 2, 0)]
    seq = crashed[0]["seq"]
    kept = [r for r in responses if r["seq"] == seq]
    assert len(kept) == 4 and all(r["error"] is None for r in kept)
    assert outcome.detail.startswith(f"engine for arm 'batch-invariant' failed during pass seq {seq}: "
                                     "the vLLM worker exited mid-pass with code 3: ")
    assert "torch.OutOfMemoryError: CUDA out of memory." in outcome.detail
    assert [e["event"] for e in events if e["arm"] == "batch-invariant"][-1] == "exited"
    assert not any(r["error"] for r in responses)  # no pass of "failed" requests
    assert max(r["seq"] for r in schedule) == seq  # nothing ran after the crash

    resumed = resume_run(exp, tmp_path / "run", engine_factory=factory)
    assert resumed.status == "complete" and resumed.failed_requests == 0
    schedule = read_jsonl(tmp_path / "run" / "schedule.jsonl")[0]
    done = Counter((r["arm"], r["status"]) for r in schedule
                   if r["event"] == "end" and r["kind"] == "counted")
    assert done == {("default", "complete"): 2, ("batch-invariant", "complete"): 2,
                    ("batch-invariant", "interrupted"): 1}


def test_auto_concurrency_leaves_headroom_per_gpu_engine():
    """h200-cost-qwen3-8b-throughput: three vLLM engines at 0.32 (0.96 <= 1) were kept up
    together and one ran out of GPU memory; each held 1.0-3.0 GiB over its fraction."""
    from bistat.declare.concurrency import ENGINE_HEADROOM_FRACTION, resolve_engines_concurrent

    def exp(kind, fraction, n=3):
        return h.experiment(engine={"kind": kind, "model": "m",
                                    "args": {"gpu_memory_utilization": fraction}},
                            arms=[{"name": f"a{i}", "role": "control" if i == 0 else "treatment"}
                                  for i in range(n)])

    assert ENGINE_HEADROOM_FRACTION == 0.03
    assert resolve_engines_concurrent(exp("vllm-offline", 0.32)) == (
        False, ("auto: arms' GPU memory fractions sum to 0.96, + 3 × 0.03 headroom = 1.05 > 1; "
                "one engine at a time"))
    assert resolve_engines_concurrent(exp("vllm-offline", 0.30)) == (
        True, "auto: arms' GPU memory fractions sum to 0.9, + 3 × 0.03 headroom = 0.99 <= 1")
    assert resolve_engines_concurrent(exp("vllm-server", 0.22, n=4)) == (  # 1.0000000000000002
        True, "auto: arms' GPU memory fractions sum to 0.88, + 4 × 0.03 headroom = 1 <= 1")
    assert resolve_engines_concurrent(h.experiment()) == (  # engines holding no GPU memory
        True, "auto: arms' GPU memory fractions sum to 0 <= 1")


def test_sigint_and_sigterm_stop_a_run_like_ctrl_c_even_when_sigint_started_ignored():
    # 2026-12-03: a run started by the device's run_bg.sh (a background job of a non-interactive
    # shell) had SIGINT ignored, so a SIGINT to it did nothing; a SIGTERM would have ended it
    # without stopping its engines. Within cmd_run.stoppable both raise KeyboardInterrupt, which
    # the runner turns into an interrupted run with its engines stopped (the test above).
    import os
    import signal

    import pytest

    from bistat.cli.cmd_run import stoppable
    from bistat.run.runner import SignalInterrupt

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        raised = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(KeyboardInterrupt) as exc:
                with stoppable():
                    os.kill(os.getpid(), sig)   # the handler runs before the next bytecode
                    raise AssertionError(f"{sig.name} did not interrupt")
            raised[sig] = exc.value
        # SIGTERM says which signal it was (the run then says "interrupted by SIGTERM", not
        # "Ctrl-C"); SIGINT is Ctrl-C's
        assert type(raised[signal.SIGINT]) is KeyboardInterrupt
        assert isinstance(raised[signal.SIGTERM], SignalInterrupt)
        assert raised[signal.SIGTERM].signal_name == "SIGTERM"
        # afterwards the process's own dispositions are back
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_run_stopped_by_sigterm_says_sigterm_not_ctrl_c(tmp_path, monkeypatch):
    """``bistat run`` turns SIGTERM into :class:`SignalInterrupt` (the test above); the run ends
    interrupted "by SIGTERM", not "by the user (Ctrl-C)"."""
    from bistat.run.runner import SignalInterrupt

    class _Term(SignalInterrupt):
        def __init__(self) -> None:
            super().__init__("SIGTERM")

    monkeypatch.setattr(fakes, "KeyboardInterrupt", _Term, raising=False)  # the fake's raise
    outcome, script, _ = _run(tmp_path, control={"interrupt_on_call": 1, "crash_after": 7})
    assert (outcome.status, outcome.detail) == ("interrupted", "interrupted by SIGTERM")
    assert script.running == set()
