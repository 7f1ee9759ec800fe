"""VLLMOfflineEngine and its worker against a stand-in ``vllm`` package (no GPU here).

The stand-in (``fakes.FAKE_VLLM``) implements the slice of vLLM the worker uses (``LLM``,
``SamplingParams``, ``llm_engine.add_request/step``, ``RequestOutput``-shaped results with
``Logprob`` objects, the stale stats-only output a pass leaves behind) and prints to stdout on
import, to prove the protocol stream is kept clean.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from fakes import failing_passes, fake_vllm_site

from bistat.engines.base import (
    EngineError,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
)
from bistat.engines.vllm_offline import VLLMOfflineEngine
from bistat.run.probe import shared_step_evidence

OOM = ("(EngineCore_DP0 pid=1) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to "
       "allocate 544.00 MiB. 231.94 MiB is free.")


@pytest.fixture
def fake_site(tmp_path: Path) -> str:
    return fake_vllm_site(tmp_path)


def _engine(site, tmp_path, args=None, **env):
    return VLLMOfflineEngine("smol", args={"max_num_seqs": 4, **(args or {})},
                             log_path=tmp_path / "log", start_timeout_s=60, pass_idle_timeout_s=30,
                             env={"PYTHONPATH": site, **env})


def _run(eng, reqs, concurrency):
    results, samples = [], []
    try:
        eng.start()
        eng.run_pass(reqs, concurrency=concurrency, on_result=results.append,
                     on_metrics=samples.append)
    finally:
        eng.stop()
    return {r.prompt_id: r for r in results}, samples


def test_pass_through_the_worker(fake_site, tmp_path):
    eng = _engine(fake_site, tmp_path, VLLM_BATCH_INVARIANT="1")
    try:
        info = eng.start()
        assert (info.kind, info.version, info.commit) == ("vllm-offline", "0.25.0", "deadbeef")
        assert info.env["VLLM_BATCH_INVARIANT"] == "1" and info.env["NVSHMEM_DISABLE_NVLS"] == "1"
        results, samples = [], []
        reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i, 1], max_tokens=3 + i)
                for i in range(6)] + [GenerationRequest(prompt_id="t", prompt="ab", max_tokens=2)]
        eng.run_pass(reqs, concurrency=3, on_result=results.append, on_metrics=samples.append)
    finally:
        eng.stop()
    by_id = {r.prompt_id: r for r in results}
    assert sorted(by_id) == sorted(r.prompt_id for r in reqs)
    r0 = by_id["r0"]
    assert r0.token_ids == [11, 12, 13] and r0.logprobs == [-0.25, -0.5, -0.75]
    assert r0.top_logprobs[0] == [(11, -0.25), (12, -2.0)]
    assert (r0.finish_reason, r0.n_prompt_tokens, r0.error) == ("length", 2, None)
    assert by_id["t"].token_ids == [(97 + 98) % 50 + 10, (97 + 98 + 1) % 50 + 10]
    assert {s.source for s in samples} == {"engine-stats"}  # disable_log_stats=False by default
    assert max(s.num_requests_running for s in samples) == 3
    assert (samples[-1].num_requests_running, samples[-1].num_requests_waiting) == (0.0, 0.0)
    assert samples[-1].num_preemptions_total == 0.0
    assert samples[-1].generation_tokens_total == sum(3 + i for i in range(6)) + 2
    assert samples[-1].prompt_tokens_total == 6 * 2 + 2
    log = (tmp_path / "log").read_text()
    assert "vLLM banner on stdout" in log and "step batch=3" in log
    assert "step batch=4" not in log  # concurrency 3 < max_num_seqs 4


def test_refusal_and_start_failure_are_classified(fake_site, tmp_path):
    with pytest.raises(EngineRefused) as exc:
        _engine(fake_site, tmp_path, FAKE_REFUSE="1").start()
    assert str(exc.value) == ("vLLM refused the setting: ValueError: VLLM_BATCH_INVARIANT is not "
                              f"supported on this GPU (log: {tmp_path / 'log'})")
    with pytest.raises(EngineStartError) as exc:
        _engine(fake_site, tmp_path, FAKE_BROKEN="1").start()
    assert str(exc.value) == ("vllm.LLM('smol') failed to start: RuntimeError: CUDA out of memory "
                              f"(log: {tmp_path / 'log'})")


def test_worker_dying_mid_pass_is_an_engine_error_after_the_results_received(fake_site, tmp_path):
    """The H200 lesson: an engine core killed by torch.OutOfMemoryError is not 'every request
    failed' (pass after pass); the results received are delivered, then EngineError names the
    exit code, the root-cause line of the log (not vLLM's EngineDeadError wrapper) and the log."""
    reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i], max_tokens=2 + i) for i in range(5)]
    (exc,), results, pid = failing_passes(_engine(fake_site, tmp_path, FAKE_CRASH_AFTER="2"), reqs,
                                          concurrency=2)
    assert str(exc) == (f"the vLLM worker exited mid-pass with code 3: {OOM} "
                        f"(log: {tmp_path / 'log'})")
    assert [(r.prompt_id, r.error) for r in results] == [("r0", None)]  # the 2nd died unsent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_pass_on_a_dead_worker_raises_at_once_instead_of_failing_every_request(fake_site, tmp_path):
    reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i + 1], max_tokens=2) for i in range(3)]
    (_, exc), results, _ = failing_passes(_engine(fake_site, tmp_path, FAKE_CRASH_AFTER="1"), reqs,
                                          concurrency=3, times=2)
    assert str(exc) == (f"the vLLM worker had exited before the pass with code 3: {OOM} "
                        f"(log: {tmp_path / 'log'})")
    assert results == []


def test_a_silent_worker_is_stopped_and_is_an_engine_error(fake_site, tmp_path):
    eng = _engine(fake_site, tmp_path, FAKE_HANG_AT_STEP="2")
    eng.pass_idle_timeout_s, eng.stop_grace_s = 1, 2
    reqs = [GenerationRequest(prompt_id="a", prompt=[1], max_tokens=4)]
    try:
        eng.start()
        pid = eng.proc.pid
        with pytest.raises(EngineError) as exc:
            eng.run_pass(reqs, concurrency=1, on_result=lambda r: None, on_metrics=lambda s: None)
        assert eng.proc is None  # stopped
    finally:
        eng.stop()
    assert str(exc.value) == ("the vLLM worker was silent for 1 s during a pass and was stopped "
                              f"(log: {tmp_path / 'log'})")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_engine_stats_carry_preemptions_and_waiting(fake_site, tmp_path):
    """vLLM's counters (named without _total by get_metrics) reach MetricsSample; the scheduler's
    waiting queue shows when more requests are in flight than max_num_seqs."""
    reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i + 1], max_tokens=4) for i in range(6)]
    by_id, samples = _run(_engine(fake_site, tmp_path, FAKE_PREEMPT_AT_STEP="2"), reqs, 6)
    assert all(r.error is None and len(r.token_ids) == 4 for r in by_id.values())
    assert samples[-1].num_preemptions_total == 1.0
    assert max(s.num_requests_waiting for s in samples) == 2.0  # 6 in flight, max_num_seqs 4
    assert max(s.num_requests_running for s in samples) == 4.0


def test_without_engine_stats_preemptions_are_unknown_not_zero(fake_site, tmp_path):
    reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i + 1], max_tokens=2) for i in range(3)]
    _, samples = _run(_engine(fake_site, tmp_path, args={"disable_log_stats": True}), reqs, 3)
    assert {s.source for s in samples} == {"inflight"}
    assert all(math.isnan(s.num_preemptions_total) and math.isnan(s.num_requests_waiting)
               for s in samples)
    assert samples[-1].generation_tokens_total == 6.0


def test_rejected_requests_never_leave_the_worker_waiting_on_an_idle_engine(fake_site, tmp_path):
    """LLMEngine.step() blocks when nothing is unfinished (vllm/v1/engine/core_client.py:853); a
    pass whose last request vLLM rejects after the others finished must end with pass_done,
    not by the idle timeout (which kills the worker). The stand-in's step() then sleeps."""
    reqs = [GenerationRequest(prompt_id="ok", prompt=[1], max_tokens=2),
            GenerationRequest(prompt_id="bad", prompt=[1000], max_tokens=2)]
    eng = _engine(fake_site, tmp_path)
    eng.pass_idle_timeout_s = eng.stop_grace_s = 5
    results = []
    try:
        eng.start()
        eng.run_pass(reqs, concurrency=1, on_result=results.append, on_metrics=lambda s: None)
        alive = eng.proc is not None and eng.proc.poll() is None
    finally:
        eng.stop()
    by_id = {r.prompt_id: r for r in results}
    assert alive
    assert by_id["ok"].error is None and by_id["ok"].token_ids == [11, 12]
    assert by_id["bad"].error == "ValueError: Token id 1000 is out of vocabulary"
    assert by_id["bad"].token_ids == [] and by_id["bad"].finish_reason is None


def test_greedy_top_k_minus_one_and_sampling_fields_match_vllm(fake_site, tmp_path):
    """The worker's SamplingParams keywords all exist in 0.25.0 (an unknown one is a TypeError
    there, so the request would fail) and top_k=-1 is accepted."""
    reqs = [GenerationRequest(prompt_id="a", prompt=[5, 6], max_tokens=3, top_k=-1, seed=7,
                              logprobs=2, ignore_eos=True)]
    by_id, _ = _run(_engine(fake_site, tmp_path), reqs, 1)
    assert by_id["a"].error is None and len(by_id["a"].token_ids) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_final_only_outputs_by_default_streaming_on_request(fake_site, tmp_path, stream):
    """Default: FINAL_ONLY (as LLM.generate), the same tokens, no first-token time; with
    stream_outputs: CUMULATIVE, and the first token's time is recorded."""
    eng = VLLMOfflineEngine("smol", args={"max_num_seqs": 4}, log_path=tmp_path / "log",
                            start_timeout_s=60, pass_idle_timeout_s=30, stream_outputs=stream,
                            env={"PYTHONPATH": fake_site})
    reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i, 1], max_tokens=4) for i in range(3)]
    by_id, _ = _run(eng, reqs, concurrency=3)
    assert by_id["r0"].token_ids == [11, 12, 13, 14]
    firsts = [by_id[f"r{i}"].t_first_token for i in range(3)]
    if stream:
        assert all(t is not None and 0 <= t <= by_id[f"r{i}"].t_done for i, t in enumerate(firsts))
    else:
        assert firsts == [None, None, None]


def _two_passes(eng, every_step=False):
    """The needle alone, then the needle among 5 fillers (the probe's shape); the second pass's
    results and samples."""
    needle = GenerationRequest(prompt_id="needle", prompt=[7, 1], max_tokens=6)
    fillers = [GenerationRequest(prompt_id=f"f{i}", prompt=[i + 1], max_tokens=6) for i in range(5)]
    results, samples = [], []
    try:
        eng.start()
        eng.run_pass([needle], concurrency=1, on_result=lambda r: None, on_metrics=lambda s: None)
        if every_step:
            with eng.every_step_metrics():
                assert eng.metrics_interval_s == 0.0
                eng.run_pass([needle, *fillers], concurrency=6, on_result=results.append,
                             on_metrics=samples.append)
        else:
            eng.run_pass([needle, *fillers], concurrency=6, on_result=results.append,
                         on_metrics=samples.append)
    finally:
        eng.stop()
    return {r.prompt_id: r for r in results}, samples


def test_stale_gauges_at_the_start_of_a_pass_are_not_reported(fake_site, tmp_path):
    """The probe's 'max 0': the second pass's first step() reads the stats-only output the first
    pass left (gauges: 0 running, 0 waiting, while 6 requests are in flight). That sample is
    dropped and the next step's is sent, so even one sample per second shows the batch."""
    by_id, samples = _two_passes(_engine(fake_site, tmp_path))
    assert samples[0].num_requests_running == 4.0  # max_num_seqs 4 of the 6 in flight
    assert samples[0].num_requests_waiting == 2.0
    assert len(samples) == 2  # the pass is shorter than the 1 s interval: that one, and the last
    shared, evidence = shared_step_evidence(samples, by_id["needle"])
    assert (shared, evidence) == (True, ("running requests from 1 metrics sample(s) around the "
                                         "needle: max 4"))


def test_every_step_metrics_samples_after_every_step(fake_site, tmp_path):
    eng = _engine(fake_site, tmp_path)
    by_id, samples = _two_passes(eng, every_step=True)
    assert eng.metrics_interval_s == 1.0  # restored
    # 6 requests of 6 tokens at 4 a step: 6 + 6 steps (after the stale read), one sample each,
    # plus the pass's last sample
    assert [s.num_requests_running for s in samples] == [4.0] * 5 + [2.0] * 6 + [0.0, 0.0]
    needle = by_id["needle"]
    window = [s for s in samples if needle.t_submit < s.t <= needle.t_done]
    assert len(window) >= 5 and all(s.source == "engine-stats" for s in samples)
    assert shared_step_evidence(samples, needle)[0] is True
