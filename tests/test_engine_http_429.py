"""Rate limiting (HTTP 429) in the OpenAI-compatible client: ``Retry-After`` honoured (seconds or
HTTP-date), exponential backoff, a bound on the total wait, the retries counted in the records;
past the bound the request fails like any other HTTP error (recorded, the pass flagged). Against
loopback fake servers that answer 429 and then 200."""

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
from bistat.engines.base import GenerationRequest
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
    assert wall < 5


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
    fail past the bound like any other HTTP error, recorded with their counts, and its passes
    are flagged ``failed``. A resume finds nothing left to run and keeps every record."""
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
        assert outcome.status == "complete"
        assert (outcome.failed_requests, outcome.failed_passes) == (8, 2)
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
        assert sorted((p["arm"], p["n_failed"]) for p in passes) == [
            ("blas", 0), ("blas", 0), ("invariant", 4), ("invariant", 4)]
        again = resume_run(exp, tmp_path / "run")
    assert again.status == "complete"
    assert read_jsonl(tmp_path / "run" / "responses.jsonl")[0] == responses


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
