"""``bistat serve``'s bounds and cancellation over the real embedded engine (a tiny random model):
a disconnected client's requests leave the engine, the prompts in flight are bounded (429),
bodies and prompts per request are bounded (413), deep JSON is a 400, an unknown field is a 400
naming the closest field it knows, SIGTERM ends the server with status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from bistat.engines.base import GenerationRequest
from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.serve.server import BackgroundServer, Limits, create_app
from bistat.model.testing import tiny_random_model

MAX_LEN = 512


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(0, tokenizer="byte", max_position_embeddings=MAX_LEN)


def _engine(model, max_batch_size=2):
    return EmbeddedEngine(model, max_batch_size=max_batch_size, max_model_len=MAX_LEN)


def _app(model, engine, **limits):
    return create_app(engine, model.tokenizer, model_name="tiny", max_model_len=MAX_LEN,
                      vocab_size=int(model.config.vocab_size), limits=Limits(**limits))


def _long(i: int, max_tokens: int = 400) -> GenerationRequest:
    return GenerationRequest(prompt_id=f"p{i}", prompt=f"story {i}", max_tokens=max_tokens,
                             ignore_eos=True)


def _wait(pred, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _idle(engine) -> bool:
    m = engine.metrics()
    return m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


def test_engine_drops_a_cancelled_request_and_finishes_the_others(model):
    engine = _engine(model)
    engine.start()
    try:
        doomed = [engine.submit(_long(i)) for i in range(3)]      # 2 running, 1 waiting
        kept = engine.submit(_long(9, max_tokens=20))
        assert _wait(lambda: engine.metrics()["generation_tokens_total"] >= 4, 60)
        for f in doomed:
            assert f.cancel()
        result = kept.result(timeout=30)
        assert result.error is None and len(result.token_ids) == 20
        assert _wait(lambda: _idle(engine), 30)
        total = engine.metrics()["generation_tokens_total"]
        time.sleep(0.3)
        assert engine.metrics()["generation_tokens_total"] == total
        # 3 x 400 tokens were asked for; far fewer were generated
        assert total < 3 * 400
    finally:
        engine.stop()


def test_a_disconnected_client_s_requests_stop_generating(model):
    engine = _engine(model, max_batch_size=1)
    with BackgroundServer(_app(model, engine)) as srv:
        # 64 x 400 tokens one at a time: far longer than the client waits
        body = {"prompt": [f"story {i}" for i in range(64)], "max_tokens": 400, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
        assert _wait(lambda: _idle(engine), 30), engine.metrics()
        total = engine.metrics()["generation_tokens_total"]
        time.sleep(0.3)
        assert engine.metrics()["generation_tokens_total"] == total
        assert total < 64 * 400
        # the server still answers after the cancellation
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_prompts_in_flight_are_bounded_with_429_and_retry_after(model):
    engine = _engine(model)
    app = _app(model, engine, max_queued_prompts=4, max_prompts_per_request=8, retry_after_s=2)
    with BackgroundServer(app) as srv:
        peak = [0.0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                m = engine.metrics()
                peak[0] = max(peak[0], m["num_requests_running"] + m["num_requests_waiting"])
                time.sleep(0.005)

        def busy():
            httpx.post(srv.url + "/v1/completions", timeout=600, json={
                "prompt": ["a", "b", "c"], "max_tokens": 500, "ignore_eos": True})

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        client = threading.Thread(target=busy, daemon=True)
        client.start()
        assert _wait(lambda: engine.metrics()["generation_tokens_total"] > 0, 60)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["d", "e"], "max_tokens": 1},
                       timeout=10)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error"
        assert "3 prompts are in flight" in err["message"] and "bound of 4" in err["message"]
        # one more prompt fits exactly
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "f", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200
        # more prompts than one request may carry: 413, whatever is in flight
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": [str(i) for i in range(9)], "max_tokens": 1}, timeout=10)
        assert r.status_code == 413
        assert "at most 8 per request" in r.json()["error"]["message"]
        client.join(timeout=600)
        stop.set()
        watcher.join()
        assert peak[0] <= 4     # the queue never held more than the bound
        assert _idle(engine)


def test_body_bound_413_with_and_without_content_length(model):
    engine = _engine(model)
    with BackgroundServer(_app(model, engine, max_body_bytes=1000)) as srv:
        # whitespace pads the body (a prompt this long would not fit the context)
        small = b'{"prompt": "hi", "max_tokens": 1' + b" " * 900 + b'}'
        assert len(small) <= 1000
        r = httpx.post(srv.url + "/v1/completions", content=small, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200
        big = b'{"prompt": "hi", "max_tokens": 1' + b" " * 1000 + b'}'
        r = httpx.post(srv.url + "/v1/completions", content=big, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert f"{len(big)} bytes" in r.json()["error"]["message"]
        assert "at most 1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: chunked transfer, counted while read
            for _ in range(20):
                yield b"x" * 100

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert "more than 1000 bytes" in r.json()["error"]["message"]
        assert engine.metrics()["prompt_tokens_total"] == len(model.tokenizer.encode("hi"))


@pytest.mark.parametrize("depth", [100_000, 200])
def test_deeply_nested_json_is_a_400(model, depth):
    engine = _engine(model)
    with BackgroundServer(_app(model, engine)) as srv:
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(srv.url + "/v1/completions", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_field_is_refused_naming_the_closest_field(model):
    """A misspelt field is not ignored (``"temprature": 0`` would sample at temperature 1): a 400
    names it and the closest field the server knows; nothing reaches the engine."""
    engine = _engine(model)
    with BackgroundServer(_app(model, engine)) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"prompt": "hi", "max_tokens": 1, "temprature": 0})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "temprature",
                                                            400)
        assert err["message"].startswith(
            "unknown field 'temprature': neither bistat serve nor vLLM's or SGLang's OpenAI "
            "servers know it, and ignoring it would change what is measured; did you mean "
            "'temperature'? the fields bistat serve implements: ")
        assert "echo, ignore_eos, logprobs, max_tokens, model" in err["message"]
        # a field vLLM knows, at a value that changes the output: refused, naming what it does
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                             "presence_penalty": 1.0})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "presence_penalty = 1.0 penalises tokens already present, which bistat serve does "
            "not implement; send 0 or leave it out")
        assert engine.metrics()["prompt_tokens_total"] == 0


def test_a_request_that_could_never_fit_the_queue_is_413_not_429(model):
    """More prompts in one request than the server ever holds in flight is 413 (sending it again
    can never help), not 429 with Retry-After."""
    engine = _engine(model)
    app = _app(model, engine, max_queued_prompts=4, max_prompts_per_request=8)
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"prompt": [str(i) for i in range(5)], "max_tokens": 1})
        assert r.status_code == 413
        assert "retry-after" not in r.headers
        assert r.json()["error"]["message"] == (
            "the request has 5 prompts, more than this server ever holds in flight (4, bistat "
            "serve --max-queued-prompts): it can never be admitted; send fewer prompts per "
            "request")


SERVE_SCRIPT = textwrap.dedent("""
    import sys
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.engines.serve.server import create_app, serve
    from bistat.model.testing import tiny_random_model
    model = tiny_random_model(0, tokenizer="byte", max_position_embeddings=512)
    engine = EmbeddedEngine(model, max_batch_size=1, max_model_len=512)
    app = create_app(engine, model.tokenizer, model_name="tiny", max_model_len=512,
                     vocab_size=int(model.config.vocab_size))
    serve(app, port=0, shutdown_timeout_s=1.0,
          on_bound=lambda port: print(f"PORT {port}", flush=True))
    print("RETURNED", flush=True)
""")


def test_sigterm_with_a_request_in_flight_exits_0_within_the_deadline(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line + proc.stdout.read()
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        assert int(line.split()[1]) > 0
        assert _wait(lambda: _healthy(url), 30)
        statuses = []

        def client():
            try:
                # 256 x 500 tokens one at a time: about a minute on an idle machine
                statuses.append(httpx.post(url + "/v1/completions", timeout=600, json={
                    "prompt": [f"s{i}" for i in range(256)], "max_tokens": 500,
                    "ignore_eos": True}).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)

        t = threading.Thread(target=client, daemon=True)
        t.start()
        assert _wait(lambda: _metric(url, "vllm:num_requests_running") > 0, 60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t0
        out = proc.stdout.read()
        assert rc == 0, out
        assert "RETURNED" in out
        # the shutdown timeout (1 s), one engine step and the exit; finishing the request would
        # take a minute (several on a busy machine)
        assert took < 30
        t.join(timeout=10)
        assert statuses and statuses[0] != 200   # cancelled, not completed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
