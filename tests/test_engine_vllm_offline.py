"""VLLMOfflineEngine and its worker against a stand-in ``vllm`` package (no GPU here).

The stand-in implements the slice of vLLM the worker uses (``LLM``, ``SamplingParams``,
``llm_engine.add_request/step``, ``RequestOutput``-shaped results with ``Logprob`` objects) and
prints to stdout on import, to prove the protocol stream is kept clean.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from bistat.engines.base import EngineRefused, EngineStartError, GenerationRequest
from bistat.engines.vllm_offline import VLLMOfflineEngine

FAKE_VLLM = textwrap.dedent('''
    import os, types
    print("vLLM banner on stdout")
    __version__ = "0.25.0"
    __commit__ = "deadbeef"

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _Logprob:
        def __init__(self, logprob):
            self.logprob = logprob

    class _Engine:
        def __init__(self, max_num_seqs):
            self.reqs, self.max_num_seqs, self.finished = {}, max_num_seqs, 0
            self.max_running = 0

        def add_request(self, request_id, prompt, params):
            ids = prompt.get("prompt_token_ids") or [ord(c) for c in prompt["prompt"]]
            self.reqs[request_id] = (ids, params, [])

        def step(self):
            running = list(self.reqs.items())[: self.max_num_seqs]
            self.max_running = max(self.max_running, len(running))
            print(f"step batch={len(running)}")
            outs = []
            for rid, (ids, params, out) in running:
                out.append((sum(ids) + len(out)) % 50 + 10)
                done = len(out) >= params.max_tokens
                lps = [{t: _Logprob(-0.25 * (k + 1)), t + 1: _Logprob(-2.0 - k)} for k, t in enumerate(out)]
                comp = types.SimpleNamespace(token_ids=list(out), text="x" * len(out), logprobs=lps,
                                             finish_reason="length" if done else None)
                outs.append(types.SimpleNamespace(request_id=rid, prompt_token_ids=ids, outputs=[comp],
                                                  finished=done))
                if done:
                    del self.reqs[rid]
                    self.finished += 1
                    if self.finished == int(os.environ.get("FAKE_CRASH_AFTER", "0")):
                        os._exit(3)
            return outs

    class LLM:
        def __init__(self, model, **kw):
            if kw.get("enable_prefix_caching") is not False:
                raise AssertionError("prefix caching must be off by default")
            if os.environ.get("FAKE_REFUSE"):
                raise ValueError("VLLM_BATCH_INVARIANT is not supported on this GPU")
            if os.environ.get("FAKE_BROKEN"):
                raise RuntimeError("CUDA out of memory")
            self.llm_engine = _Engine(kw.get("max_num_seqs", 256))
''')


@pytest.fixture
def fake_site(tmp_path: Path) -> str:
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return str(tmp_path / "site")


def _engine(site, tmp_path, **env):
    return VLLMOfflineEngine("smol", args={"max_num_seqs": 4}, log_path=tmp_path / "log",
                             start_timeout_s=60, pass_idle_timeout_s=30,
                             env={"PYTHONPATH": site, **env})


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
    assert max(s.num_requests_running for s in samples) <= 3
    assert samples[-1].generation_tokens_total == sum(3 + i for i in range(6)) + 2
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
