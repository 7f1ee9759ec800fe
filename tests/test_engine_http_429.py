"""Rate limiting (HTTP 429) in the OpenAI-compatible client: ``Retry-After`` honoured (seconds or
HTTP-date), exponential backoff, a bound on the total wait, the retries counted in the records;
past the bound the request fails like any other HTTP error (recorded, the pass flagged). The
synchronous calls (``/v1/models``, ``/version``, ``/tokenize``, prompt logprobs, the prefix-cache
reset) retry under the same policy. The declaration's ``workload.retries`` is the engine's
``retries`` unless its args set them. Against loopback fake servers that answer 429 and then 200."""

from __future__ import annotations

import collections
import datetime as dt
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import helpers_runner as h
from bistat.declare.experiment import validate_experiment
from bistat.declare.prereg import registration_problems
from bistat.engines.base import (EngineError, EngineStartError, EngineUnsupported,
                                 GenerationRequest)
from bistat.engines.openai_http import (OpenAIHTTPEngine, RetryPolicy, answer_time,
                                        retry_after_s)
from bistat.engines.serve.server import BackgroundServer
from bistat.run.runner import resume_run, start_run
from bistat.store.readers import read_jsonl


@pytest.fixture(autouse=True)
def _no_fake_kind_left_behind(monkeypatch):
    """helpers_runner registers the fake engine kind; later test files must not see it."""
    from bistat.engines import registry

    monkeypatch.setitem(vars(registry), "ENGINE_KINDS", dict(registry.ENGINE_KINDS))
    monkeypatch.setitem(vars(registry), "ADAPTERS", dict(registry.ADAPTERS))


NOW = dt.datetime(2015, 10, 21, 7, 27, 30, tzinfo=dt.timezone.utc)


# -- Retry-After and the policy (pure) --------------------------------------------------------

@pytest.mark.parametrize("value,seconds", [
    ("120", 120.0), ("0", 0.0), (" 3 ", 3.0),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 30.0),          # IMF-fixdate
    ("Wednesday, 21-Oct-15 07:28:05 GMT", 35.0),      # obsolete RFC 850
    ("Wed Oct 21 07:28:10 2015", 40.0),               # obsolete asctime
    ("Wed, 21 Oct 2015 07:00:00 GMT", 0.0),           # in the past: now
    ("soon", None), ("-5", None), ("1.5", None), ("", None), (None, None),
])
def test_retry_after_is_seconds_or_an_http_date(value, seconds):
    assert retry_after_s(value, NOW) == seconds


def test_the_policy_honours_retry_after_backs_off_and_bounds_the_total_wait():
    p = RetryPolicy(retries=2, backoff_s=0.5, backoff_max_s=10.0, max_wait_s=30.0)
    kw = dict(failures=0, waited_s=0.0, rate_limited=True)
    assert p.next_wait(attempt=1, retry_after=None, **kw) == (0.5, None)     # backoff
    assert p.next_wait(attempt=1, retry_after=7.0, **kw) == (7.0, None)      # Retry-After
    assert p.next_wait(attempt=4, retry_after=1.0, **kw) == (4.0, None)      # never below backoff
    assert p.next_wait(attempt=9, retry_after=None, **kw) == (10.0, None)    # backoff capped
    assert p.next_wait(attempt=2, retry_after=20.0, **kw) == (20.0, None)    # past the cap: asked
    # 429s do not use up `retries`; the wait bound ends them
    assert p.next_wait(attempt=12, failures=0, waited_s=19.0, rate_limited=True,
                       retry_after=None) == (10.0, None)
    assert p.next_wait(attempt=13, failures=0, waited_s=29.0, rate_limited=True,
                       retry_after=None) == (None, "the next wait (backoff: 10 s) would take the "
                                                   "waits to 39 s, past max_retry_wait_s = 30 s")
    assert p.next_wait(attempt=1, retry_after=31.0, **kw) == (
        None, "the next wait (Retry-After 31 s: 31 s) would take the waits to 31 s, past "
              "max_retry_wait_s = 30 s")
    # other failures stop after `retries` further attempts, as before
    assert p.next_wait(attempt=3, failures=2, waited_s=1.5, rate_limited=False,
                       retry_after=None) == (2.0, None)
    assert p.next_wait(attempt=4, failures=3, waited_s=3.5, rate_limited=False,
                       retry_after=None) == (None, None)


@pytest.mark.parametrize("kw,message", [
    ({"backoff_s": 0}, "backoff_s must be > 0 (the first retry's wait), got 0"),
    ({"max_wait_s": -1}, "max_retry_wait_s must be >= 0, got -1"),
    ({"retries": -1}, "retries must be >= 0, got -1"),
])
def test_a_policy_that_could_retry_forever_is_refused(kw, message):
    with pytest.raises(ValueError) as err:
        RetryPolicy(**kw)
    assert str(err.value) == message


# -- against a fake server --------------------------------------------------------------------

def _answer(ids):
    return {"choices": [{"index": 0, "text": "x" * len(ids), "finish_reason": "length",
                         "token_ids": ids, "prompt_token_ids": [1],
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                      "token_logprobs": [-0.5] * len(ids),
                                      "text_offset": [0] * len(ids),
                                      "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 4}}


def limited_app(calls: collections.Counter, *, limited: int | None,
                retry_after=None, cycle: int | None = None, status: int = 429) -> Starlette:
    """429 for the first ``limited`` attempts of each prompt (every attempt when None), then 200;
    with ``cycle``, the count starts again every ``cycle`` attempts (each pass's request);
    ``retry_after(n)`` gives the header of the n-th 429 (None: no header)."""

    async def completions(request: Request) -> Response:
        body = await request.json()
        key = tuple(body["prompt"])
        calls[key] += 1
        n = calls[key] if cycle is None else (calls[key] - 1) % cycle + 1
        if limited is None or n <= limited:
            headers = {}
            value = retry_after(calls[key]) if retry_after else None
            if value is not None:
                headers["Retry-After"] = value
            return JSONResponse({"error": {"message": "rate limited"}}, status_code=status,
                                headers=headers)
        return JSONResponse(_answer([10, 11, 12]))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models)])


def _pass(url, n=2, **engine):
    eng = OpenAIHTTPEngine(url, metrics_interval_s=0, **engine)
    eng.start()
    results = []
    reqs = [GenerationRequest(prompt_id=f"p{i}", prompt=[1, i], max_tokens=3) for i in range(n)]
    eng.run_pass(reqs, concurrency=n, on_result=results.append, on_metrics=lambda s: None)
    return sorted(results, key=lambda r: r.prompt_id)


def test_a_429_with_retry_after_seconds_is_waited_out_then_answered():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(limited_app(calls, limited=1, retry_after=lambda n: "1")) as srv:
        results = _pass(srv.url, retries=0, backoff_s=0.01)
    for r in results:
        assert (r.error, r.attempts, r.rate_limited, r.retry_wait_s) == (None, 2, 1, 1.0)
        assert r.token_ids == [10, 11, 12]
        assert r.t_done - r.t_submit >= 1.0      # the wait happened, inside the latency
    assert set(calls.values()) == {2}            # retries=0 did not stop the 429's retry


def test_a_retry_after_date_is_waited_out():
    """An HTTP-date 2 s after the request's second, read against the answer's Date header
    (uvicorn's: the same clock, to the second, refreshed about once a second): a wait of 1 to
    3 whole seconds, depending on where in its second the answer fell."""
    import email.utils

    def two_seconds_on(n):
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        return email.utils.format_datetime(now + dt.timedelta(seconds=2), usegmt=True)

    calls: collections.Counter = collections.Counter()
    with BackgroundServer(limited_app(calls, limited=1, retry_after=two_seconds_on)) as srv:
        (r,) = _pass(srv.url, n=1, backoff_s=0.01)
    assert (r.error, r.attempts, r.rate_limited) == (None, 2, 1)
    assert r.retry_wait_s in (1.0, 2.0, 3.0)
    assert r.t_done - r.t_submit >= r.retry_wait_s


def test_the_answer_s_date_is_the_clock_a_retry_after_date_is_read_against():
    """A server whose clock is years off still gets the wait it asked for."""
    sent = answer_time({"date": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert sent == dt.datetime(2015, 10, 21, 7, 28, tzinfo=dt.timezone.utc)
    assert retry_after_s("Wed, 21 Oct 2015 07:28:01 GMT", sent) == 1.0
    for headers in ({}, {"date": "yesterday"}):   # no usable Date: this machine's clock
        assert abs(answer_time(headers) - dt.datetime.now(dt.timezone.utc)) < dt.timedelta(seconds=5)


def test_without_retry_after_the_backoff_doubles():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(limited_app(calls, limited=3)) as srv:
        (r,) = _pass(srv.url, n=1, retries=0, backoff_s=0.05)
    assert (r.error, r.attempts, r.rate_limited) == (None, 4, 3)
    assert r.retry_wait_s == pytest.approx(0.05 + 0.1 + 0.2)


def test_past_the_wait_bound_the_request_fails_with_the_reason():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(limited_app(calls, limited=None, retry_after=lambda n: "0")) as srv:
        t0 = time.monotonic()
        results = _pass(srv.url, backoff_s=0.05, max_retry_wait_s=0.2)
        wall = time.monotonic() - t0
    for r in results:
        # waits 0.05 + 0.1, then 0.2 would pass 0.2 in total: 3 attempts, all 429
        assert (r.attempts, r.rate_limited, r.token_ids) == (3, 3, [])
        assert r.retry_wait_s == pytest.approx(0.15)
        assert r.error == ('after 3 attempt(s): HTTP 429: {"error":{"message":"rate limited"}}; '
                           "gave up: the next wait (Retry-After 0 s: 0.2 s) would take the waits "
                           "to 0.35 s, past max_retry_wait_s = 0.2 s")
    assert wall < 60    # no wait past the bound, however busy the machine


def test_a_retry_after_beyond_the_bound_fails_at_once():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(limited_app(calls, limited=None, retry_after=lambda n: "3600")) as srv:
        (r,) = _pass(srv.url, n=1, max_retry_wait_s=60)
    assert (r.attempts, r.rate_limited, r.retry_wait_s) == (1, 1, 0.0)
    assert r.error.endswith("gave up: the next wait (Retry-After 3600 s: 3600 s) would take the "
                            "waits to 3600 s, past max_retry_wait_s = 60 s")


def test_a_503_s_retry_after_is_honoured_within_the_retries():
    calls: collections.Counter = collections.Counter()
    app = limited_app(calls, limited=2, retry_after=lambda n: "1", status=503)
    with BackgroundServer(app) as srv:
        (ok,) = _pass(srv.url, n=1, retries=2, backoff_s=0.01)
        calls.clear()
        (failed,) = _pass(srv.url, n=1, retries=1, backoff_s=0.01)
    assert (ok.error, ok.attempts, ok.rate_limited, ok.retry_wait_s) == (None, 3, 0, 2.0)
    assert (failed.attempts, failed.rate_limited, failed.retry_wait_s) == (2, 0, 1.0)
    assert failed.error == 'after 2 attempt(s): HTTP 503: {"error":{"message":"rate limited"}}'


# -- what the runner records ------------------------------------------------------------------

def test_the_runner_records_the_429_retries_and_flags_requests_past_the_bound(tmp_path):
    """The control's server rate-limits each prompt's first attempt (Retry-After 0): every
    request succeeds on its second, counted. The treatment's always answers 429: its requests
    fail past the bound like any other HTTP error, recorded with their counts, and its first
    pass, in which every request failed, stops the run (recorded ``failed``). A resume runs that
    pass again, stops on it again, and keeps every record."""
    polite_calls: collections.Counter = collections.Counter()
    hostile_calls: collections.Counter = collections.Counter()
    polite_app = limited_app(polite_calls, limited=1, retry_after=lambda n: "0", cycle=2)
    with BackgroundServer(polite_app) as polite, \
            BackgroundServer(limited_app(hostile_calls, limited=None)) as hostile:
        exp = h.experiment(
            engine={"kind": "openai", "model": "m",
                    "args": {"backoff_s": 0.01, "max_retry_wait_s": 0.05,
                             "metrics_interval_s": 0}},
            arms=[{"name": "blas", "role": "control", "args": {"url": polite.url}},
                  {"name": "invariant", "role": "treatment", "args": {"url": hostile.url}}],
            workload={"source": "builtin:token-ids", "n_prompts": 4, "passes": 2,
                      "warmup_passes": 0, "max_tokens": 3})
        reg = {"path": "p.json", "sha256": "0" * 64, "registered_utc": "2026-01-01T00:00:00Z",
               "name": "fakerun"}
        outcome = start_run(exp, reg, tmp_path / "run", command=["bistat", "run"])
        responses, _ = read_jsonl(tmp_path / "run" / "responses.jsonl")
        assert outcome.status == "stopped"
        assert (outcome.failed_requests, outcome.failed_passes) == (4, 1)
        by_arm = collections.defaultdict(set)
        for r in responses:
            by_arm[r["arm"]].add((r["error"] is None, r["attempts"], r["rate_limited"],
                                  r["retry_wait_s"]))
        assert by_arm["blas"] == {(True, 2, 1, 0.01)}
        # waits 0.01 + 0.02, then 0.04 would pass 0.05: 3 attempts, all 429
        assert {(ok, a, n, round(w, 6)) for ok, a, n, w in by_arm["invariant"]} == {
            (False, 3, 3, 0.03)}
        assert all("gave up: the next wait" in r["error"] for r in responses
                   if r["arm"] == "invariant")
        passes, _ = read_jsonl(tmp_path / "run" / "passes.jsonl")
        assert [(p["arm"], p["n_failed"], p["status"]) for p in passes
                if "n_failed" in p] == [("blas", 0, "complete"), ("invariant", 4, "failed")]
        again = resume_run(exp, tmp_path / "run")
    assert again.status == "stopped"
    after = read_jsonl(tmp_path / "run" / "responses.jsonl")[0]
    assert after[:len(responses)] == responses
    assert [r["arm"] for r in after[len(responses):]] == ["invariant"] * 4


def test_bistat_serve_s_own_429_beyond_its_queue_is_retried_until_answered():
    """``bistat serve`` answers 429 with ``Retry-After: 1`` when a request would pass its queue
    bound (here one prompt): three requests at once, each of 40 steps of 20 ms, so two are
    refused while the first is computed and are answered after waiting."""
    from helpers_serve import VOCAB, ByteTokenizer, FakeEngine

    from bistat.engines.serve.server import Limits, create_app

    tok = ByteTokenizer()
    engine = FakeEngine(tok, step_s=0.02)
    app = create_app(engine, tok, model_name="fake-model", max_model_len=512, vocab_size=VOCAB,
                     limits=Limits(max_queued_prompts=1, retry_after_s=1))
    with BackgroundServer(app) as srv:
        eng = OpenAIHTTPEngine(srv.url, metrics_interval_s=0, retries=0, backoff_s=0.01)
        eng.start()
        results = []
        reqs = [GenerationRequest(prompt_id=f"p{i}", prompt=[65, 66 + i], max_tokens=40,
                                  ignore_eos=True) for i in range(3)]
        eng.run_pass(reqs, concurrency=3, on_result=results.append, on_metrics=lambda s: None)
    assert all(r.error is None and len(r.token_ids) == 40 for r in results), results
    waited = sorted((r.rate_limited, r.retry_wait_s) for r in results)
    assert waited[0] == (0, 0.0)                           # the first one in was computed at once
    assert all(n >= 1 and w == 1.0 * n for n, w in waited[1:]), waited   # Retry-After: 1 each time


# -- the synchronous calls retry under the same policy ----------------------------------------

SYNC_PATHS = ("/v1/models", "/version", "/tokenize", "/v1/completions", "/reset_prefix_cache")


def sync_app(calls: collections.Counter, *, limited: int | None, status: int = 429,
             retry_after: str | None = "0") -> Starlette:
    """``status`` (with ``Retry-After: retry_after``) for the first ``limited`` calls of each of
    :data:`SYNC_PATHS` (every call when None), then answers shaped like vLLM's."""

    async def endpoint(request: Request) -> Response:
        path = request.url.path
        calls[path] += 1
        if limited is None or calls[path] <= limited:
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            return JSONResponse({"error": {"message": "busy"}}, status_code=status,
                                headers=headers)
        if path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})
        if path == "/version":
            return JSONResponse({"version": "9.9"})
        if path == "/reset_prefix_cache":
            return JSONResponse({})
        body = await request.json()
        if path == "/tokenize":
            return JSONResponse({"tokens": [ord(c) for c in body["prompt"]]})
        answer = _answer([10])
        answer["choices"][0]["prompt_logprobs"] = [None] + [
            {str(t): {"logprob": -t / 100.0}} for t in body["prompt"][1:]]
        return JSONResponse(answer)

    gets = ("/v1/models", "/version")
    return Starlette(routes=[Route(p, endpoint, methods=["GET"] if p in gets else ["POST"])
                             for p in SYNC_PATHS])


def test_the_synchronous_calls_wait_out_a_429_s_retry_after():
    """Each call is answered 429 with ``Retry-After: 1`` once, then served: ``retries = 0`` does
    not stop the retry (as for generation requests) and every call waits its second."""
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(sync_app(calls, limited=1, retry_after="1")) as srv:
        eng = OpenAIHTTPEngine(srv.url, retries=0, backoff_s=0.01, metrics_interval_s=0)
        t0 = time.monotonic()
        info = eng.start()
        t_start = time.monotonic() - t0
        assert (info.version, eng.model) == ("9.9", "m")   # /version was retried too
        t0 = time.monotonic()
        assert eng.prompt_logprobs(GenerationRequest("t", "AB", 3), [50]) == [-0.5]
        t_logprobs = time.monotonic() - t0
        t0 = time.monotonic()
        assert eng.reset_prefix_cache() is True
        t_reset = time.monotonic() - t0
    assert calls == {p: 2 for p in SYNC_PATHS}
    assert t_start >= 2.0 and t_logprobs >= 2.0 and t_reset >= 1.0


def test_a_503_on_a_synchronous_call_is_retried_within_the_retries():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(sync_app(calls, limited=1, status=503, retry_after="1")) as srv:
        eng = OpenAIHTTPEngine(srv.url, model="m", retries=1, backoff_s=0.01)
        t0 = time.monotonic()
        assert eng.reset_prefix_cache() is True
        assert time.monotonic() - t0 >= 1.0                # its Retry-After, not the backoff
    assert calls["/reset_prefix_cache"] == 2
    calls.clear()
    with BackgroundServer(sync_app(calls, limited=None, status=503, retry_after=None)) as srv:
        eng = OpenAIHTTPEngine(srv.url, model="m", retries=1, backoff_s=0.01)
        with pytest.raises(EngineError) as err:
            eng.reset_prefix_cache()
    assert calls["/reset_prefix_cache"] == 2
    assert str(err.value) == (
        f"{srv.url}/reset_prefix_cache: after 2 attempt(s) (0 answered 429, 0.01 s waited "
        """between them): HTTP 503: '{"error":{"message":"busy"}}'; the server is busy or """
        "failing: try again later, or raise the engine's retries (408, 5xx) or "
        "max_retry_wait_s (429)")


def test_a_synchronous_call_past_the_wait_bound_fails_with_the_reason():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(sync_app(calls, limited=None)) as srv:
        eng = OpenAIHTTPEngine(srv.url, retries=0, backoff_s=0.05, max_retry_wait_s=0.2)
        with pytest.raises(EngineStartError) as err:
            eng.start()
        eng.model = "m"
        with pytest.raises(EngineError) as tok_err:
            eng.prompt_logprobs(GenerationRequest("t", "AB", 3), [50])
    # waits 0.05 + 0.1, then 0.2 would pass 0.2 in total: 3 attempts, all 429
    assert (calls["/v1/models"], calls["/tokenize"], calls["/v1/completions"]) == (3, 3, 0)
    assert str(err.value) == (
        f"{srv.url}/v1/models: after 3 attempt(s) (3 answered 429, 0.15 s waited between them): "
        """HTTP 429: '{"error":{"message":"busy"}}'; gave up: the next wait (Retry-After 0 s: """
        "0.2 s) would take the waits to 0.35 s, past max_retry_wait_s = 0.2 s; the server is "
        "busy or failing: try again later, or raise the engine's retries (408, 5xx) or "
        "max_retry_wait_s (429)")
    assert str(tok_err.value).startswith(f"{srv.url}/tokenize: after 3 attempt(s) (3 answered 429")


def test_other_4xx_answers_to_synchronous_calls_are_not_retried():
    calls: collections.Counter = collections.Counter()
    with BackgroundServer(sync_app(calls, limited=None, status=404)) as srv:
        eng = OpenAIHTTPEngine(srv.url, model="m", retries=3, backoff_s=0.01)
        assert eng.reset_prefix_cache() is False
        with pytest.raises(EngineUnsupported, match="has no /tokenize endpoint"):
            eng.prompt_logprobs(GenerationRequest("t", "AB", 3), [50])
    assert (calls["/reset_prefix_cache"], calls["/tokenize"]) == (1, 1)


# -- workload.retries reaches the engine --------------------------------------------------------

def _openai_declaration(url="http://127.0.0.1:1", engine_args=None, arm_args=None, **workload):
    """The runner's base declaration on engine 'openai'; ``workload.retries`` only where given."""
    data = h.declaration(engine={"kind": "openai", "model": "m",
                                 "args": {"url": url, **(engine_args or {})}})
    del data["workload"]["retries"]
    data["workload"].update(workload)
    if arm_args is not None:
        data["arms"][1]["args"] = arm_args
    return data


@pytest.mark.parametrize("workload,engine_args,arm_args,retries", [
    ({}, None, None, 2),                                    # the declaration's default
    ({"retries": 0}, None, None, 0),                        # declared in the workload
    ({"retries": 5}, {"retries": 5}, None, 5),              # both, agreeing
    ({}, {"retries": 1}, None, 1),                          # the engine's args
    ({}, {"retries": 1}, {"retries": 4}, 4),                # the arm's over the engine's
])
def test_the_engine_s_retries_are_the_workload_s_unless_its_args_set_them(
        workload, engine_args, arm_args, retries):
    exp = validate_experiment(_openai_declaration(engine_args=engine_args, arm_args=arm_args,
                                                  **workload))
    eng = OpenAIHTTPEngine.from_experiment(exp, exp.arms[1])
    assert (eng.retries, eng.retry_policy.retries) == (retries, retries)
    assert registration_problems(exp, "experiments/fakerun.toml") == []


def test_declared_workload_retries_decide_whether_a_failed_request_is_repeated():
    """A server that answers 500 to each prompt's first attempt: with ``workload.retries = 0``
    the requests fail after one attempt, with ``workload.retries = 1`` they succeed on the
    second."""
    outcomes = {}
    for retries in (0, 1):
        calls: collections.Counter = collections.Counter()
        with BackgroundServer(limited_app(calls, limited=1, status=500)) as srv:
            exp = validate_experiment(_openai_declaration(
                srv.url, engine_args={"backoff_s": 0.01, "metrics_interval_s": 0}, retries=retries))
            eng = OpenAIHTTPEngine.from_experiment(exp, exp.control)
            assert eng.start().args["retries"] == retries
            results = []
            eng.run_pass([GenerationRequest(prompt_id="p", prompt=[1, 2], max_tokens=3)],
                         concurrency=1, on_result=results.append, on_metrics=lambda s: None)
        (r,) = results
        outcomes[retries] = (r.error, r.attempts, r.token_ids)
    assert outcomes == {
        0: ('after 1 attempt(s): HTTP 500: {"error":{"message":"rate limited"}}', 1, []),
        1: (None, 2, [10, 11, 12])}


def test_retries_declared_twice_with_different_values_are_refused_at_registration():
    exp = validate_experiment(_openai_declaration(engine_args={"retries": 3},
                                                  arm_args={"retries": 0}, retries=0))
    assert registration_problems(exp, "experiments/fakerun.toml") == [
        "experiments/fakerun.toml: engine.args.retries: 3 disagrees with workload.retries = 0, "
        "which engine 'openai' reads as well; declare the retries once: remove "
        "engine.args.retries, or remove workload.retries and keep engine.args.retries"]
    exp = validate_experiment(_openai_declaration(arm_args={"retries": 1}, retries=2))
    assert registration_problems(exp, "experiments/fakerun.toml") == [
        "experiments/fakerun.toml: arms[1].args.retries: 1 disagrees with workload.retries = 2, "
        "which engine 'openai' reads as well; declare the retries once: remove "
        "arms[1].args.retries, or remove workload.retries and keep arms[1].args.retries"]


def test_the_request_timeout_is_the_workload_s_unless_the_args_set_it_and_twice_is_refused():
    """``workload.request_timeout_s`` reaches the HTTP client like ``retries`` does."""
    exp = validate_experiment(_openai_declaration(request_timeout_s=42.0))
    assert OpenAIHTTPEngine.from_experiment(exp, exp.arms[1]).request_timeout_s == 42.0
    exp = validate_experiment(_openai_declaration(engine_args={"request_timeout_s": 7.0}))
    assert OpenAIHTTPEngine.from_experiment(exp, exp.arms[1]).request_timeout_s == 7.0
    assert registration_problems(exp, "experiments/fakerun.toml") == []
    exp = validate_experiment(_openai_declaration(engine_args={"request_timeout_s": 7.0},
                                                  request_timeout_s=42.0))
    assert registration_problems(exp, "experiments/fakerun.toml") == [
        "experiments/fakerun.toml: engine.args.request_timeout_s: 7.0 disagrees with "
        "workload.request_timeout_s = 42.0, which engine 'openai' reads as well; declare the "
        "request_timeout_s once: remove engine.args.request_timeout_s, or remove "
        "workload.request_timeout_s and keep engine.args.request_timeout_s"]


def test_the_vllm_server_engine_s_client_reads_the_workload_too():
    """Engine ``vllm-server``'s HTTP client: ``workload.retries`` and ``request_timeout_s`` where
    its arguments do not set them (before, its client kept its own 3 retries and 600 s whatever
    the declaration said); both set to different values is refused at registration."""
    from bistat.engines.vllm_server import VLLMServerEngine

    data = h.declaration(engine={"kind": "vllm-server", "model": "m", "args": {}})
    data["workload"].update(retries=2, request_timeout_s=300.0)
    exp = validate_experiment(data)
    eng = VLLMServerEngine.from_experiment(exp, exp.arms[1])
    assert (eng.http_kwargs["retries"], eng.http_kwargs["request_timeout_s"]) == (2, 300.0)
    assert registration_problems(exp, "experiments/fakerun.toml") == []
    data["engine"]["args"] = {"retries": 5}
    exp = validate_experiment(data)
    assert VLLMServerEngine.from_experiment(exp, exp.arms[1]).http_kwargs["retries"] == 5
    assert registration_problems(exp, "experiments/fakerun.toml") == [
        "experiments/fakerun.toml: engine.args.retries: 5 disagrees with workload.retries = 2, "
        "which engine 'vllm-server' reads as well; declare the retries once: remove "
        "engine.args.retries, or remove workload.retries and keep engine.args.retries"]
