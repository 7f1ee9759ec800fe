"""VLLMOfflineEngine and its worker against a stand-in ``vllm`` package (no GPU here).

The stand-in implements the slice of vLLM the worker uses (``LLM``, ``SamplingParams``,
``llm_engine.add_request/step``, ``RequestOutput``-shaped results with ``Logprob`` objects) and
prints to stdout on import, to prove the protocol stream is kept clean.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest

from bistat.engines.base import EngineRefused, EngineStartError, GenerationRequest
from bistat.engines.vllm_offline import VLLMOfflineEngine

FAKE_VLLM = textwrap.dedent('''
    # The slice of vLLM 0.25.0 the worker uses, with the real signatures and behaviour
    # (paths are in the wheel vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl).
    import multiprocessing, os, time, types
    print("vLLM banner on stdout")
    __version__ = "0.25.0"
    __commit__ = "deadbeef"

    # vllm/sampling_params.py:199-301: a msgspec Struct; an unknown keyword is a TypeError;
    # output_kind defaults to CUMULATIVE; top_k -1 is accepted as "off" (:560-564); greedy
    # sets top_k = 0 (:490-493).
    _FIELDS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None,
               "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
               "detokenize": True, "output_kind": 0}

    class RequestOutputKind:  # vllm/sampling_params.py (an IntEnum)
        CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2

    sampling_params = types.SimpleNamespace(RequestOutputKind=RequestOutputKind)

    class SamplingParams:
        def __init__(self, **kw):
            for k in kw:
                if k not in _FIELDS:
                    raise TypeError(f"Unexpected keyword argument {k!r}")
            self.__dict__.update(_FIELDS, **kw)
            if self.top_k < -1:
                raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
            if self.max_tokens is not None and self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
            if self.temperature < 1e-5:
                self.top_p, self.top_k = 1.0, 0

    class _Logprob:  # vllm/logprobs.py:13-24
        def __init__(self, logprob):
            self.logprob, self.rank, self.decoded_token = logprob, None, None

    class _Metric:  # vllm/v1/metrics/reader.py:11-67 (counters are named without _total)
        def __init__(self, name, **kw):
            self.name, self.labels = name, {"model_name": "smol", "engine": "0"}
            self.__dict__.update(kw)

    class _Engine:  # vllm/v1/engine/llm_engine.py (V1 LLMEngine)
        def __init__(self, max_num_seqs, log_stats):
            self.reqs, self.max_num_seqs, self.finished = {}, max_num_seqs, 0
            self.log_stats, self.steps = log_stats, 0
            self.running = self.waiting = self.preemptions = self.gen = self.prompt = 0

        def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                        tokenization_kwargs=None, trace_headers=None, priority=0, prompt_text=None):
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a string, got {type(request_id)}")
            if not isinstance(params, SamplingParams):
                raise TypeError("params must be SamplingParams")
            ids = prompt.get("prompt_token_ids") or [ord(c) for c in prompt["prompt"]]
            if max(ids) >= 1000:  # vllm/v1/engine/input_processor.py:483-484
                raise ValueError(f"Token id {max(ids)} is out of vocabulary")
            self.reqs[request_id] = (ids, params, [])
            return request_id

        def has_unfinished_requests(self):
            return bool(self.reqs)

        def step(self):
            if not self.reqs:  # the real one waits on the engine core's output queue for ever
                time.sleep(3600)
            self.steps += 1
            running = list(self.reqs.items())[: self.max_num_seqs]
            print(f"step batch={len(running)}")
            if self.steps == int(os.environ.get("FAKE_PREEMPT_AT_STEP", "0")):
                self.preemptions += 1
            outs = []
            for rid, (ids, params, out) in running:
                if not out:
                    self.prompt += len(ids)
                out.append((sum(ids) + len(out)) % 50 + 10)
                self.gen += 1
                done = len(out) >= params.max_tokens
                lps = [{t: _Logprob(-0.25 * (k + 1)), t + 1: _Logprob(-2.0 - k)} for k, t in enumerate(out)]
                comp = types.SimpleNamespace(index=0, token_ids=out, text="", logprobs=lps,
                                             cumulative_logprob=None,
                                             finish_reason="length" if done else None)
                if done or params.output_kind != RequestOutputKind.FINAL_ONLY:
                    outs.append(types.SimpleNamespace(request_id=rid, prompt_token_ids=ids,
                                                      outputs=[comp], finished=done))
                if done:
                    del self.reqs[rid]
                    self.finished += 1
                    if self.finished == int(os.environ.get("FAKE_CRASH_AFTER", "0")):
                        os._exit(3)
            self.running = min(len(self.reqs), self.max_num_seqs)
            self.waiting = len(self.reqs) - self.running
            return outs

        def get_metrics(self):  # llm_engine.py:378-380
            assert self.log_stats, "Stat logging disabled"
            return [_Metric("vllm:num_requests_running", value=float(self.running)),
                    _Metric("vllm:num_requests_waiting", value=float(self.waiting)),
                    _Metric("vllm:num_preemptions", value=self.preemptions),
                    _Metric("vllm:generation_tokens", value=self.gen),
                    _Metric("vllm:prompt_tokens", value=self.prompt),
                    _Metric("vllm:request_prompt_tokens", count=1, sum=2.0, buckets={})]

    class LLM:  # vllm/entrypoints/llm.py:176-330
        def __init__(self, model, *, skip_tokenizer_init=False, seed=0, **kw):
            if kw.get("enable_prefix_caching") is not False:
                raise AssertionError("prefix caching must be off by default")
            kw.setdefault("disable_log_stats", True)  # llm.py:235-236
            if os.environ.get("FAKE_REFUSE"):
                raise ValueError("VLLM_BATCH_INVARIANT is not supported on this GPU")
            if os.environ.get("FAKE_BROKEN"):
                raise RuntimeError("CUDA out of memory")
            # The engine core is a forked process (VLLM_WORKER_MULTIPROC_METHOD=fork).
            self._core = multiprocessing.get_context("fork").Process(
                target=time.sleep, args=(600,), daemon=True)
            self._core.start()
            self.skip_tokenizer_init = skip_tokenizer_init
            self.llm_engine = _Engine(kw.get("max_num_seqs", 256), not kw["disable_log_stats"])

        def get_metrics(self):
            return self.llm_engine.get_metrics()

        def get_tokenizer(self):  # vllm/renderers/base.py:159
            if self.skip_tokenizer_init:
                raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
            raise ValueError("the stand-in has no tokenizer")
''')


@pytest.fixture
def fake_site(tmp_path: Path) -> str:
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return str(tmp_path / "site")


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


def test_worker_dying_mid_pass_fails_the_rest(fake_site, tmp_path):
    eng = _engine(fake_site, tmp_path, FAKE_CRASH_AFTER="2")
    results = []
    try:
        eng.start()
        pid = eng.proc.pid
        reqs = [GenerationRequest(prompt_id=f"r{i}", prompt=[i], max_tokens=2 + i) for i in range(5)]
        eng.run_pass(reqs, concurrency=2, on_result=results.append, on_metrics=lambda s: None)
    finally:
        eng.stop()
    ok = [r.prompt_id for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    assert len(results) == 5 and len(ok) == 1  # the second finisher died before it was sent
    assert all(r.error == f"the vLLM worker exited mid-pass (log: {tmp_path / 'log'})" for r in failed)
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
