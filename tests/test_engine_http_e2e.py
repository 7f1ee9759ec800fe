"""OpenAIHTTPEngine end to end against ``bistat serve``'s app (fake engine) on loopback."""

from __future__ import annotations

import math
import socket

import pytest

from bistat.engines.base import Engine, EngineStartError, GenerationRequest
from bistat.engines.metrics import parse_vllm_metrics
from bistat.engines.openai_http import OpenAIHTTPEngine
from bistat.engines.serve.server import BackgroundServer
from helpers_serve import ByteTokenizer, expected_logprob, expected_token, fake_app

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    app, engine = fake_app(max_batch_size=8, step_s=0.005)
    with BackgroundServer(app) as srv:
        yield srv, engine


def _run(engine, requests, concurrency):
    results, samples = [], []
    engine.run_pass(requests, concurrency=concurrency, on_result=results.append,
                    on_metrics=samples.append)
    return results, samples


def test_engine_satisfies_protocol_and_reports_start_info(server):
    srv, _ = server
    eng = OpenAIHTTPEngine(srv.url + "/v1/")
    assert isinstance(eng, Engine)
    info = eng.start()
    assert (info.kind, info.version) == ("openai", "0.1.0")
    # what the server declares about itself: its GET /version and its /v1/models entry
    reported = {"version": {"gemm": "fake", "max_model_len": 512, "model": "fake-model",
                            "server": "bistat serve", "version": "0.1.0"},
                "model": {"id": "fake-model", "max_model_len": 512, "owned_by": "bistat",
                          "root": "fake-model"}}
    assert info.args == {"url": srv.url, "model": "fake-model", "retries": 3,
                         "server_reported": reported}
    assert eng.fingerprint() == {"kind": "openai", "url": srv.url, "model": "fake-model",
                                 "server_version": "0.1.0", "server_reported": reported}


def test_pass_returns_token_ids_logprobs_and_top_k(server):
    srv, _ = server
    eng = OpenAIHTTPEngine(srv.url, model="fake-model")
    eng.start()
    reqs = [GenerationRequest(prompt_id=f"p{i}", prompt=[60 + i, 61], max_tokens=5, logprobs=3)
            for i in range(12)] + [GenerationRequest(prompt_id="text", prompt="hello", max_tokens=4)]
    results, _ = _run(eng, reqs, concurrency=4)
    assert sorted(r.prompt_id for r in results) == sorted(r.prompt_id for r in reqs)
    by_id = {r.prompt_id: r for r in results}
    for i in range(12):
        r = by_id[f"p{i}"]
        ids = [expected_token([60 + i, 61], k, None, 0.0) for k in range(5)]
        assert r.error is None and r.attempts == 1
        assert r.token_ids == ids
        assert r.logprobs == [expected_logprob(t, k) for k, t in enumerate(ids)]
        assert [len(t) for t in r.top_logprobs] == [3] * 5
        assert r.top_logprobs[0][0] == (ids[0], expected_logprob(ids[0], 0))
        assert r.finish_reason == "length" and r.n_prompt_tokens == 2
        assert 0 <= r.t_submit <= r.t_done
    assert by_id["text"].text == TOK.decode(by_id["text"].token_ids)
    assert by_id["text"].n_prompt_tokens == len("hello")


def test_chat_requests_go_through_chat_completions(server):
    srv, _ = server
    eng = OpenAIHTTPEngine(srv.url)
    eng.start()
    results, _ = _run(eng, [GenerationRequest(prompt_id="c", prompt="hi", max_tokens=3,
                                              chat=True)], 1)
    prompt_ids = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert results[0].error is None
    assert results[0].token_ids == [expected_token(prompt_ids, k, None, 0.0) for k in range(3)]


def test_request_body_states_every_sampling_parameter():
    eng = OpenAIHTTPEngine("http://127.0.0.1:1", model="m")
    body = eng.request_body(GenerationRequest(prompt_id="x", prompt=[1, 2], max_tokens=7))
    assert body == {"model": "m", "max_tokens": 7, "temperature": 0.0, "top_p": 1.0,
                    "top_k": -1, "seed": None, "ignore_eos": False, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "stream": False, "prompt": [1, 2],
                    "logprobs": 1}


def test_concurrency_limits_in_flight_requests_and_metrics_are_sampled(server):
    srv, fake = server
    fake.step_log.clear()
    eng = OpenAIHTTPEngine(srv.url, metrics_interval_s=0.05)
    eng.start()
    reqs = [GenerationRequest(prompt_id=str(i), prompt=[70, i], max_tokens=30) for i in range(12)]
    results, samples = _run(eng, reqs, concurrency=3)
    assert all(r.error is None for r in results) and len(results) == 12
    assert max(size for _, size in fake.step_log) == 3  # never more than `concurrency` running
    assert len(samples) >= 3 and all(s.source == "prometheus" for s in samples)
    assert max(s.num_requests_running for s in samples) <= 3
    assert samples[-1].num_requests_running == 0
    assert samples[-1].generation_tokens_total - samples[0].generation_tokens_total <= 12 * 30
    assert [s.t for s in samples] == sorted(s.t for s in samples)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_start_errors_name_the_url_and_the_fix(server):
    srv, _ = server
    port = _free_port()
    with pytest.raises(EngineStartError) as exc:
        OpenAIHTTPEngine(f"http://127.0.0.1:{port}", start_timeout_s=2).start()
    assert str(exc.value).startswith(f"cannot reach the server at http://127.0.0.1:{port} (ConnectError")
    assert str(exc.value).endswith("start it (e.g. `bistat serve` or `vllm serve MODEL`) or fix the URL")
    with pytest.raises(EngineStartError) as exc:
        OpenAIHTTPEngine("localhost:8000").start()
    assert str(exc.value) == ("bad server URL 'localhost:8000': expected http://HOST:PORT or "
                              "https://HOST:PORT")
    with pytest.raises(EngineStartError) as exc:
        OpenAIHTTPEngine(srv.url, model="llama").start()
    assert str(exc.value) == (f"{srv.url} does not serve model 'llama'; it serves ['fake-model']. "
                              f"Fix the declaration's engine.model")


def test_metrics_parser_sums_label_sets_and_filters_by_model():
    text = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="a"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="a"} 3.0\n'
            'vllm:num_requests_running{engine="0",model_name="b"} 7.0\n'
            '# TYPE vllm:num_preemptions counter\n'
            'vllm:num_preemptions_total{model_name="a"} 4.0\n')
    s = parse_vllm_metrics(text, t=1.5, model_name="a")
    assert (s.t, s.num_requests_running, s.num_preemptions_total) == (1.5, 5.0, 4.0)
    assert math.isnan(s.num_requests_waiting) and math.isnan(s.generation_tokens_total)
    assert parse_vllm_metrics(text, t=0.0).num_requests_running == 12.0


def test_bistat_serve_offers_no_prompt_logprobs_and_no_cache_reset(server):
    """Optional capabilities are reported missing, never faked (bistat serve has neither)."""
    from bistat.engines.base import EngineUnsupported

    srv, _ = server
    eng = OpenAIHTTPEngine(srv.url)
    eng.start()
    req = GenerationRequest("p", [5, 6, 7], 3)
    # bistat serve refuses the field it does not implement (a 400 naming it): unsupported
    with pytest.raises(EngineUnsupported, match=f"^{srv.url} refuses prompt_logprobs: .*"
                                                "prompt_logprobs = 1 asks for the prompt.+s "
                                                "logprobs, which bistat serve does not implement"):
        eng.prompt_logprobs(req, [1, 2])
    assert eng.prompt_logprobs(req, []) == []
    assert eng.reset_prefix_cache() is False
    with pytest.raises(EngineUnsupported, match="has no /tokenize endpoint"):
        eng.prompt_logprobs(GenerationRequest("t", "a text prompt", 3), [1])
