"""Fault injection for OpenAIHTTPEngine: a scripted loopback server that misbehaves on purpose.

Each prompt's first token id selects the behaviour; every pass must end (no hang) with one
result per request and the right failure count.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bistat.engines.base import EngineError, GenerationRequest
from bistat.engines.openai_http import OpenAIHTTPEngine
from bistat.engines.serve.server import BackgroundServer

OK, ALWAYS_500, FLAKY, SLOW, TRUNCATED, MALFORMED, BAD_REQUEST, NO_IDS = range(1, 9)


def _answer(ids):
    return {"choices": [{"index": 0, "text": "x" * len(ids), "finish_reason": "length",
                         "token_ids": ids, "prompt_token_ids": [OK],
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                      "token_logprobs": [-0.5] * len(ids), "text_offset": [0] * len(ids),
                                      "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 1 + len(ids)}}


def scripted_app(calls: collections.Counter, release: threading.Event) -> Starlette:
    """``release``: set when the test ends; until then a SLOW request is never answered."""
    async def completions(request: Request) -> Response:
        body = await request.json()
        key = body["prompt"][0]
        calls[key] += 1
        if key == ALWAYS_500 or (key == FLAKY and calls[key] <= 2):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if key == SLOW:
            while not release.is_set():
                await asyncio.sleep(0.05)
        if key == TRUNCATED:
            return Response(b'{"choices": [{"index": 0, "te', media_type="application/json")
        if key == MALFORMED:
            return JSONResponse({"choices": []})
        if key == BAD_REQUEST:
            return JSONResponse({"error": {"message": "bad"}}, status_code=400)
        if key == NO_IDS:
            return JSONResponse({"choices": [{"text": "abc", "finish_reason": "stop"}]})
        return JSONResponse(_answer([10, 11, 12]))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def metrics(request: Request) -> Response:
        return Response("this is { not prometheus\n")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/metrics", metrics)])


@pytest.fixture
def scripted():
    calls: collections.Counter = collections.Counter()
    release = threading.Event()
    with BackgroundServer(scripted_app(calls, release)) as srv:
        yield srv, calls
        release.set()       # the SLOW requests end, and the server stops at once


def _pass(eng, kinds, concurrency=4):
    results, samples = [], []
    reqs = [GenerationRequest(prompt_id=f"{k}-{i}", prompt=[k], max_tokens=3)
            for i, k in enumerate(kinds)]
    t0 = time.monotonic()
    eng.run_pass(reqs, concurrency=concurrency, on_result=results.append, on_metrics=samples.append)
    return {r.prompt_id: r for r in results}, samples, time.monotonic() - t0


def test_each_fault_gives_the_right_outcome_and_attempt_count(scripted):
    srv, calls = scripted
    eng = OpenAIHTTPEngine(srv.url, retries=2, backoff_s=0.01, request_timeout_s=2,
                           metrics_interval_s=0.1)
    eng.start()
    kinds = [OK, ALWAYS_500, FLAKY, SLOW, TRUNCATED, MALFORMED, BAD_REQUEST, NO_IDS]
    by_id, samples, wall = _pass(eng, kinds, concurrency=8)
    assert len(by_id) == len(kinds)
    outcome = {int(pid.split("-")[0]): (r.error is None, r.attempts) for pid, r in by_id.items()}
    assert outcome == {OK: (True, 1), ALWAYS_500: (False, 3), FLAKY: (True, 3), SLOW: (False, 3),
                       TRUNCATED: (False, 3), MALFORMED: (False, 3), BAD_REQUEST: (False, 1),
                       NO_IDS: (False, 3)}
    assert by_id["1-0"].token_ids == [10, 11, 12] and by_id["1-0"].logprobs == [-0.5] * 3
    assert by_id["1-0"].top_logprobs == [[(10, -0.5)], [(11, -0.5)], [(12, -0.5)]]
    assert by_id["2-1"].error.startswith('after 3 attempt(s): HTTP 500: {"error":{"message":"boom"}}')
    assert by_id["4-3"].error.startswith("after 3 attempt(s): ReadTimeout")
    assert by_id["5-4"].error.startswith("after 3 attempt(s): malformed answer (JSONDecodeError")
    assert by_id["6-5"].error.startswith("after 3 attempt(s): malformed answer (IndexError")
    assert by_id["7-6"].error == 'after 1 attempt(s): HTTP 400: {"error":{"message":"bad"}}'
    assert by_id["8-7"].error.startswith(
        "after 3 attempt(s): malformed answer (ValueError: the answer has neither token_ids nor "
        "logprobs tokens")
    assert all(r.token_ids == [] and r.logprobs is None for r in by_id.values() if r.error)
    assert calls[ALWAYS_500] == 3 and calls[BAD_REQUEST] == 1
    assert samples == [] and eng.metrics_errors >= 1  # unparsable /metrics is skipped, not fatal
    assert wall < 60    # the SLOW request's three attempts time out (2 s each); it is never answered


def test_unreachable_server_mid_pass_fails_every_request_then_interrupts_the_pass(scripted):
    """Every request fails (each result delivered), then the pass raises EngineError because
    the endpoint is dead: the runner ends it *interrupted*, resumable."""
    srv, _ = scripted
    eng = OpenAIHTTPEngine(srv.url, retries=1, backoff_s=0.01, request_timeout_s=1)
    eng.start()
    srv.stop()
    results = []
    reqs = [GenerationRequest(prompt_id=f"{OK}-{i}", prompt=[OK], max_tokens=3) for i in range(6)]
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"stopped answering: 6 request\(s\) of this pass failed "
                                          r"at the endpoint and /v1/models fails \(ConnectError"):
        eng.run_pass(reqs, concurrency=4, on_result=results.append, on_metrics=lambda s: None)
    assert time.monotonic() - t0 < 60     # refused connections: no attempt waits its timeout out
    assert [r.attempts for r in results] == [2] * 6
    assert all(r.error.startswith("after 2 attempt(s): ConnectError") for r in results)


HELPER = Path(__file__).with_name("helpers_serve.py")


def test_server_killed_mid_pass_keeps_finished_results_fails_the_rest_and_interrupts(tmp_path):
    pidfile = tmp_path / "pid"
    env = {**os.environ, "FAKE_VLLM_PIDFILE": str(pidfile)}
    from bistat.engines.vllm_server import _free_port

    port = _free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, str(HELPER), "serve", "m", "--port", str(port)],
                            env=env, cwd=HELPER.parent, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        eng = OpenAIHTTPEngine(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.05,
                               request_timeout_s=5, start_timeout_s=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                eng.start()
                break
            except Exception:
                assert time.monotonic() < deadline, "the helper server did not start"
                time.sleep(0.2)
        results = []

        def on_result(r):
            results.append(r)
            if len(results) == 5:
                os.killpg(proc.pid, signal.SIGKILL)

        # 5 short requests finish first; the long ones are in flight when the server dies
        reqs = [GenerationRequest(prompt_id=f"s{i}", prompt=[40, i], max_tokens=2) for i in range(5)]
        reqs += [GenerationRequest(prompt_id=f"l{i}", prompt=[41, i], max_tokens=400)
                 for i in range(6)]
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="stopped answering: 6 request"):
            eng.run_pass(reqs, concurrency=11, on_result=on_result, on_metrics=lambda s: None)
        assert time.monotonic() - t0 < 60   # a reset connection: nothing waits for 400 tokens
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert len(results) == 11
    ok = sorted(r.prompt_id for r in results if r.error is None)
    failed = [r for r in results if r.error is not None]
    assert ok == [f"s{i}" for i in range(5)]
    assert len(failed) == 6 and all(r.attempts == 2 for r in failed)


# --- prompt logprobs and the prefix-cache reset, against a scripted vLLM-like server ----------

def vllm_like_app(seen: list) -> Starlette:
    """``/tokenize``, ``prompt_logprobs`` answers shaped like vLLM's, ``/reset_prefix_cache``."""

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        seen.append(("tokenize", body))
        text = body.get("prompt") or body["messages"][0]["content"]
        return JSONResponse({"tokens": [ord(c) for c in text], "count": len(text)})

    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append(("completions", body))
        ids = body["prompt"]
        plp = [None] + [{str(t): {"logprob": -t / 100.0, "rank": 1, "decoded_token": "x"},
                         "99999": {"logprob": -9.0, "rank": 2, "decoded_token": "y"}}
                        for t in ids[1:]]
        if ids[0] == 1:   # a broken answer: a position without its token
            plp[-1] = {"99999": {"logprob": -9.0}}
        answer = _answer([10])
        answer["choices"][0]["prompt_logprobs"] = plp
        return JSONResponse(answer)

    async def reset(request: Request) -> Response:
        seen.append(("reset", None))
        return JSONResponse({})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"]),
                             Route("/reset_prefix_cache", reset, methods=["POST"]),
                             Route("/v1/models", models)])


def test_prompt_logprobs_and_prefix_cache_reset_on_a_vllm_like_server():
    from bistat.engines.base import EngineError

    seen: list = []
    with BackgroundServer(vllm_like_app(seen)) as srv:
        eng = OpenAIHTTPEngine(srv.url, model="m")
        eng.start()
        # token-id prompt: no tokenize call; the continuation's logprobs at their positions
        assert eng.prompt_logprobs(GenerationRequest("a", [7, 8], 3, seed=4), [20, 30]) == [-0.2, -0.3]
        kind, body = seen[-1]
        assert kind == "completions" and body["prompt"] == [7, 8, 20, 30]
        assert (body["prompt_logprobs"], body["max_tokens"], body["temperature"], body["seed"]) == (1, 1, 0.0, 4)
        assert "echo" not in body
        # text and chat prompts are tokenized by the server first
        assert eng.prompt_logprobs(GenerationRequest("t", "AB", 3), [50]) == [-0.5]
        assert seen[-2] == ("tokenize", {"model": "m", "prompt": "AB"})
        assert seen[-1][1]["prompt"] == [65, 66, 50]
        eng.prompt_logprobs(GenerationRequest("c", "hi", 3, chat=True), [50])
        assert seen[-2] == ("tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "add_generation_prompt": True})
        with pytest.raises(EngineError, match="prompt_logprobs at position 3 lacks token 30"):
            eng.prompt_logprobs(GenerationRequest("b", [1, 8], 3), [20, 30])
        assert eng.reset_prefix_cache() is True and seen[-1] == ("reset", None)
