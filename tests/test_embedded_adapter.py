"""The ``embedded`` engine kind through the Engine protocol (bistat.engines.embedded.adapter)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bistat.engines.base import Engine, EngineRefused, EngineStartError, GenerationRequest
from bistat.engines.embedded.adapter import EmbeddedEngineAdapter
from bistat.engines.registry import adapter_class
from helpers_embedded import tiny


def _decl(model="tiny", engine_args=None, arm_args=None, env=None):
    experiment = SimpleNamespace(engine=SimpleNamespace(kind="embedded", model=model, args=engine_args or {}))
    arm = SimpleNamespace(name="a", args=arm_args or {}, env=env or {})
    return experiment, arm


@pytest.fixture(scope="module")
def model():
    return tiny(0)


def test_registry_resolves_the_embedded_kind():
    assert adapter_class("embedded") is EmbeddedEngineAdapter


def test_run_pass_bounded_concurrency_results_and_metrics(model):
    exp, arm = _decl(engine_args={"max_batch_size": 32}, arm_args={"gemm": "invariant"})
    eng = EmbeddedEngineAdapter(exp, arm, loader=lambda name: model)
    assert isinstance(eng, Engine)
    info = eng.start()
    try:
        assert info.kind == "embedded" and info.args["gemm"] == "invariant"
        assert info.args["max_batch_size"] == 32 and info.args["model"] == "tiny"
        assert info.log_findings[0] == "embedded gemm mode: invariant"
        reqs = [GenerationRequest(f"p{i}", f"prompt {i}", 5 + i % 4, ignore_eos=True) for i in range(12)]
        results, samples = [], []
        eng.run_pass(reqs, concurrency=3, on_result=results.append, on_metrics=samples.append)
        assert sorted(r.prompt_id for r in results) == sorted(r.prompt_id for r in reqs)
        assert all(r.error is None for r in results)
        for r in results:
            assert 0 <= r.t_submit <= r.t_first_token <= r.t_done
        sizes = [b for _, b in eng.pass_step_log]
        assert max(sizes) == 3  # the engine could take 32; the pass kept 3 in flight
        assert all(t >= 0 for t, _ in eng.pass_step_log)
        per_second = [s for s in samples if s.source == "embedded"]
        steps = [s for s in samples if s.source == "embedded-step"]
        assert len(samples) == len(per_second) + len(steps) and len(per_second) >= 2
        # one step sample per engine step of the pass, in order, with its exact batch size
        assert [(s.t, s.step_batch_size) for s in steps] == [(t, float(b)) for t, b in eng.pass_step_log]
        assert all(math.isnan(s.num_requests_running) for s in steps)
        assert all(s.step_batch_size is None for s in per_second)
        last = per_second[-1]
        assert last.generation_tokens_total >= sum(len(r.token_ids) for r in results)
        assert last.num_preemptions_total == 0 and last.num_requests_waiting == 0
        assert all(0 <= s.num_requests_running <= 3 for s in per_second)
        assert eng.fingerprint() == {}
    finally:
        eng.stop()
    assert eng.engine is None


def test_failed_request_is_a_result_not_an_exception(model):
    eng = EmbeddedEngineAdapter(*_decl(engine_args={"max_model_len": 32}), loader=lambda name: model)
    eng.start()
    try:
        results = []
        eng.run_pass([GenerationRequest("ok", "hi", 3), GenerationRequest("bad", "hi", 100)],
                     concurrency=2, on_result=results.append, on_metrics=lambda s: None)
    finally:
        eng.stop()
    by_id = {r.prompt_id: r for r in results}
    assert by_id["ok"].error is None
    assert "exceeds max_model_len=32" in by_id["bad"].error


@pytest.mark.parametrize("decl,exc,message", [
    (_decl(arm_args={"gem": "blas"}), EngineRefused,
     "arms[a].args: ['gem']: unknown embedded-engine argument(s); expected some of ['gemm', "),
    (_decl(engine_args={"enforce_eager": True}, arm_args={"gem": "blas"}), EngineRefused,
     "engine.args: ['enforce_eager'] and arms[a].args: ['gem']: unknown embedded-engine "
     "argument(s); expected some of ['gemm', "),
    (_decl(env={"OPENBLAS_CORETYPE": "Haswell"}), EngineRefused,
     "arms[a].env: the embedded engine runs inside the bistat process, so environment variables "
     "['OPENBLAS_CORETYPE'] cannot apply to it"),
    (_decl(arm_args={"gemm": "fast"}), EngineRefused, "embedded engine: arguments "),
])
def test_refused_settings(model, decl, exc, message):
    eng = EmbeddedEngineAdapter(*decl, loader=lambda name: model)
    with pytest.raises(exc) as info:
        eng.start()
    assert str(info.value).startswith(message), str(info.value)


def test_model_load_failure_is_a_start_error():
    def loader(name):
        raise FileNotFoundError(f"no model {name}")

    eng = EmbeddedEngineAdapter(*_decl(model="nope"), loader=loader)
    with pytest.raises(EngineStartError, match="embedded engine: cannot load model 'nope': no model nope"):
        eng.start()


def test_default_loader_reads_a_saved_model_folder(model, tmp_path):
    from bistat.model import save_model

    save_model(model, tmp_path / "m")
    eng = EmbeddedEngineAdapter(*_decl(model=str(tmp_path / "m")))
    info = eng.start()
    try:
        assert info.args["model_sha256"] == model.sha256
        results = []
        eng.run_pass([GenerationRequest("x", "hello", 4, ignore_eos=True)], concurrency=1,
                     on_result=results.append, on_metrics=lambda s: None)
    finally:
        eng.stop()
    assert len(results[0].token_ids) == 4


@pytest.mark.parametrize("gemm", ["invariant", "blas"])
def test_prompt_logprobs_prefill_each_prefix(model, gemm):
    exp, arm = _decl(arm_args={"gemm": gemm})
    eng = EmbeddedEngineAdapter(exp, arm, loader=lambda name: model)
    eng.start()
    try:
        req = GenerationRequest("p", "prompt for prefill", 6, ignore_eos=True)
        got = []
        eng.run_pass([req], concurrency=1, on_result=got.append, on_metrics=lambda s: None)
        (res,) = got
        pre = eng.prompt_logprobs(req, res.token_ids)
        assert len(pre) == len(res.token_ids)
        # invariant mode: row-invariant GEMMs and attention computed row by row as a decode
        # step would, so a prefill gives every position a decode step's bits; blas mode: the
        # same numbers up to float32 rounding only (BLAS over more rows groups terms
        # differently) -- the probe's prefill-decode mode measures exactly that
        if gemm == "invariant":
            assert pre == res.logprobs
        else:
            assert pre == pytest.approx(res.logprobs, abs=1e-4)
        assert eng.prompt_logprobs(req, []) == []
    finally:
        eng.stop()
    with pytest.raises(EngineStartError, match="prompt_logprobs\\(\\) before start\\(\\)"):
        eng.prompt_logprobs(req, [1])
