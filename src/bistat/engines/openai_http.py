"""Engine adapter for any OpenAI-compatible server: vLLM, SGLang, ``bistat serve``, ...

``run_pass`` drives ``POST /v1/completions`` (``/v1/chat/completions`` for chat requests)
asynchronously with ``httpx.AsyncClient``, at most ``concurrency`` requests in flight (an asyncio
semaphore). Every request states temperature, top_p, top_k, seed and logprobs explicitly (a
model's generation_config can change a server's defaults), and asks for token ids
(vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids``). ``/metrics`` is sampled about
once per second in the background and handed to ``on_metrics``.

Two optional capabilities serve the probe and ``bistat replay``: ``prompt_logprobs(request,
continuation)`` (the logprob of each continuation token when prompt + continuation is prefilled:
vLLM's ``prompt_logprobs`` request field on ``/v1/completions``, with token-id prompts, no
``echo``) and ``reset_prefix_cache()`` (vLLM's ``POST /reset_prefix_cache``). Servers without them
raise :class:`~bistat.engines.base.EngineUnsupported` / return False.

Transport errors, timeouts, 408/5xx answers and bodies that are not the expected JSON are retried
``retries`` times with exponential backoff; then the request is reported with ``error`` set.
A 429 (rate limited: ``bistat serve`` beyond ``max_queued_prompts``, hosted endpoints) is retried
without using up ``retries``: after at least its ``Retry-After`` (delay-seconds or an HTTP-date,
RFC 9110 section 10.2.3) and at least the exponential backoff, until the waits of the request
would pass ``max_retry_wait_s`` in total (:class:`RetryPolicy`). Each result records its
``attempts``, how many were answered 429 (``rate_limited``) and the seconds waited between them
(``retry_wait_s``, part of its latency). A ``Retry-After`` on a 503 is honoured the same way,
within ``retries``. Other 4xx answers are not retried (the request itself is wrong). One request's
failure never raises. The synchronous calls (``/v1/models`` and ``/version`` at start,
``/tokenize`` and the prompt-logprobs request, ``/reset_prefix_cache``) are retried under the same
policy (:meth:`OpenAIHTTPEngine._send`) and raise once it gives up.

The HTTP engines' (``openai``, ``vllm-server``) ``retries`` and ``request_timeout_s`` are the
declaration's ``workload.retries`` and ``workload.request_timeout_s`` unless ``engine.args`` or the
arm's ``args`` set them (:func:`workload_defaults`); a declaration that sets both to different
values is refused at registration (:func:`workload_conflicts`).

This module holds the adapter (:class:`OpenAIHTTPEngine`). It names the parts it builds on, each a
module of its own, so ``bistat.engines.openai_http.NAME`` serves for their public names too:
:mod:`bistat.engines.http_retry` (when a failed attempt is repeated: :class:`RetryPolicy`,
:func:`retry_after_s`), :mod:`bistat.engines.openai_answers` (reading the server's answers:
:func:`parse_completion_choice`, :func:`parse_prompt_logprobs`, :func:`server_report`) and
:mod:`bistat.engines.http_workload` (the workload's fields an HTTP engine reads).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Callable, Sequence

import httpx

from bistat.engines.base import (
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineStartError,
    EngineUnsupported,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)
from bistat.engines.http_retry import (  # noqa: F401 - RATE_LIMITED, answer_time, retry_after_s too
    RATE_LIMITED, RetryPolicy, _answer_failure, _Fatal, _Retryable, _transport_failure, _Tries,
    answer_time, retry_after_s)
from bistat.engines.http_workload import (  # noqa: F401 - WORKLOAD_HTTP_KEYS read here too
    WORKLOAD_HTTP_KEYS, workload_conflicts, workload_defaults)
from bistat.engines.metrics import MetricsParseError, parse_vllm_metrics
from bistat.engines.openai_answers import (ParsedAnswer, parse_completion_choice,
                                           parse_prompt_logprobs, server_report)


class OpenAIHTTPEngine:
    """Attach to an OpenAI-compatible server at ``base_url``.

    Parameters
    ----------
    base_url : str
        ``http://host:port`` (a trailing ``/v1`` is accepted and removed).
    model : str or None
        The served model id; None takes the server's only model.
    retries : int
        Further attempts after a failed one (transport errors, timeouts, 5xx, bad bodies); 429s
        are retried within ``max_retry_wait_s`` instead.
    backoff_s : float
        Wait before the first retry; doubled before each further one (capped at 10 s).
    max_retry_wait_s : float
        Longest total wait between one request's attempts (``Retry-After`` and backoff).
    request_timeout_s : float
        Per-attempt timeout (connect, read, write).
    metrics_interval_s : float
        Period of ``/metrics`` sampling; ``0`` turns sampling off.
    api_key : str or None
        Sent as ``Authorization: Bearer``.
    kind : str
        Reported kind (``"openai"``; ``vllm_server`` reuses this class).
    """

    kind = "openai"
    capabilities = EngineCapabilities(parallel_start=True, prompt_logprobs=True,
                                      prefix_cache_reset=True, declared_server=True)

    def __init__(self, base_url: str, *, model: str | None = None, retries: int = 3,
                 backoff_s: float = 0.5, max_retry_wait_s: float = 120.0,
                 request_timeout_s: float = 600.0,
                 metrics_interval_s: float = 1.0, api_key: str | None = None,
                 kind: str = "openai", start_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.retries = retries
        self.retry_policy = RetryPolicy(retries=retries, backoff_s=backoff_s,
                                        max_wait_s=max_retry_wait_s)
        self._dead_endpoint_failures = 0
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.metrics_interval_s = metrics_interval_s
        self.kind = kind
        self.start_timeout_s = start_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._server_version: str | None = None
        #: what the server declared at start (:func:`server_report`); None before start
        self.server_reported: dict[str, Any] | None = None
        self.metrics_errors = 0  # /metrics samples that could not be fetched or parsed

    #: the declaration keys of an ``openai`` arm (engine.args overridden by the arm's args)
    DECLARATION_KEYS = ("url", "retries", "backoff_s", "max_retry_wait_s", "request_timeout_s",
                        "metrics_interval_s", "api_key_env")

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """What ``from_experiment`` and ``start`` would refuse, before anything is sealed: an
        argument that is not one of :attr:`DECLARATION_KEYS` (a setting of the server itself is
        made where the server is started), an arm with no ``url`` or with one that is not
        ``http(s)://HOST:PORT``, a client setting of the wrong type, and ``retries`` or
        ``request_timeout_s`` declared twice with different values (:func:`workload_conflicts`)."""
        import difflib

        from bistat.engines.declared import arg_tables, declared_at, number_problems, url_problem

        keys = cls.DECLARATION_KEYS
        problems: list[tuple[str, str]] = []
        for table, args in arg_tables(experiment):
            for key in sorted(set(args) - set(keys)):
                close = difflib.get_close_matches(key, keys, n=1)
                hint = (f"did you mean {close[0]!r}?" if close else
                        "a setting of the server itself (its GEMM, its attention backend) is made "
                        "where the server is started, e.g. `bistat serve --gemm invariant`; to "
                        "start a server per arm from a command, use kind = \"command-server\"")
                problems.append((f"{table}.{key}", f"unknown argument {key!r} for engine "
                                 f"'openai', which only connects to a server started elsewhere; "
                                 f"expected some of {list(keys)}; {hint}"))
        missing = [arm.name for arm in experiment.arms
                   if "url" not in {**dict(experiment.engine.args), **dict(arm.args)}]
        if missing:
            where = ("engine.args.url" if len(missing) == len(experiment.arms)
                     else f"arms[{[a.name for a in experiment.arms].index(missing[0])}].args.url")
            arms = (f"arms {', '.join(map(repr, missing))} have none" if len(missing) > 1
                    else f"arm {missing[0]!r} has none")
            problems.append((where, f"engine 'openai' needs the URL of each arm's server ({arms}),"
                             " e.g. url = \"http://127.0.0.1:8000\" in engine.args or in each "
                             "arm's args"))
        seen: set[str] = set()
        for i, arm in enumerate(experiment.arms):
            args = {**dict(experiment.engine.args), **dict(arm.args)}
            field = declared_at(experiment, i, "url")
            if "url" in args and field not in seen:
                seen.add(field)
                problem = url_problem(args["url"])
                if problem is not None:
                    problems.append((field, problem))
        for table, args in arg_tables(experiment):
            if "api_key_env" in args and not (isinstance(args["api_key_env"], str)
                                              and args["api_key_env"]):
                problems.append((f"{table}.api_key_env", f"{args['api_key_env']!r} is not the "
                                 "name of an environment variable; write e.g. api_key_env = "
                                 "\"OPENAI_API_KEY\" (the key itself never sits in a declaration)"))
        return (problems + number_problems(experiment, keys)
                + workload_conflicts(experiment, "openai"))

    @classmethod
    def declaration_limits(cls, experiment: Any) -> list[str]:
        """What registration cannot check for servers started elsewhere."""
        return ["engine 'openai': workload.max_tokens against the server's context length, and "
                "the model it serves: the server is started elsewhere and tells them only when it "
                "answers (at the run's start, /v1/models); a pass in which every request fails "
                "stops the run"]

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "OpenAIHTTPEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``.

        Keys: ``url`` (required), ``retries`` and ``request_timeout_s`` (the workload's when
        neither sets them), ``backoff_s``, ``max_retry_wait_s``, ``metrics_interval_s``,
        ``api_key_env`` (the name of an environment variable holding the key; a key never sits in
        a declaration).
        """
        import os

        args = {**workload_defaults(experiment), **dict(experiment.engine.args),
                **dict(arm.args)}
        allowed = set(cls.DECLARATION_KEYS)
        unknown = sorted(set(args) - allowed)
        if unknown:
            raise ValueError(f"arms[{arm.name}].args / engine.args: unknown key(s) {unknown} for "
                             f"engine 'openai'; expected some of {sorted(allowed)}")
        if "url" not in args:
            raise ValueError("engine.args.url: engine 'openai' needs the server's URL, e.g. "
                             "url = \"http://127.0.0.1:8000\"")
        key_env = args.pop("api_key_env", None)
        return cls(args.pop("url"), model=experiment.engine.model,
                   api_key=os.environ.get(key_env) if key_env else None, **args)

    # -- start ---------------------------------------------------------------------------
    def _check_url(self) -> None:
        try:
            url = httpx.URL(self.base_url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise EngineStartError(f"bad server URL {self.base_url!r}: {exc}; expected "
                                   f"http://HOST:PORT") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise EngineStartError(f"bad server URL {self.base_url!r}: expected http://HOST:PORT "
                                   f"or https://HOST:PORT")

    def start(self) -> EngineInfo:
        """Check that the server answers and serves the model; raise ``EngineStartError`` if not."""
        self._check_url()
        try:
            with httpx.Client(base_url=self.base_url, timeout=self.start_timeout_s,
                              headers=self._headers) as client:
                resp = self._send(client, "GET", "/v1/models", error=EngineStartError)
                if resp.status_code != 200:
                    raise EngineStartError(
                        f"{self.base_url}/v1/models answered HTTP {resp.status_code}: "
                        f"{resp.text[:200]!r}; is this an OpenAI-compatible server?")
                try:
                    entries = resp.json()["data"]
                    served = [m["id"] for m in entries]
                except (ValueError, KeyError, TypeError) as exc:
                    raise EngineStartError(f"{self.base_url}/v1/models: not an OpenAI model list "
                                           f"({exc}); is this an OpenAI-compatible server?") from exc
                declared = None
                try:
                    v = self._send(client, "GET", "/version")
                    if v.status_code == 200 and isinstance(v.json(), dict):
                        declared = v.json()
                except (httpx.HTTPError, EngineError, ValueError, AttributeError):
                    declared = None
                self._server_version = (str(declared["version"]) if declared is not None
                                        and declared.get("version") is not None else None)
        except httpx.HTTPError as exc:
            raise EngineStartError(
                f"cannot reach the server at {self.base_url} ({type(exc).__name__}: {exc}); "
                f"start it (e.g. `bistat serve` or `vllm serve MODEL`) or fix the URL") from exc
        if self.model is None:
            if len(served) != 1:
                raise EngineStartError(f"{self.base_url} serves {served}; name one as the model")
            self.model = served[0]
        elif self.model not in served:
            raise EngineStartError(f"{self.base_url} does not serve model {self.model!r}; it serves "
                                   f"{served}. Fix the declaration's engine.model")
        entry = next((m for m in entries if isinstance(m, dict) and m.get("id") == self.model),
                     None)
        self.server_reported = server_report(declared, entry)
        return EngineInfo(kind=self.kind, version=self._server_version or "unknown",
                          args={"url": self.base_url, "model": self.model,
                                "retries": self.retries,
                                "server_reported": self.server_reported})

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.base_url, "model": self.model,
                "server_version": self._server_version,
                "server_reported": self.server_reported}

    def stop(self) -> None:
        """Nothing to stop: the server belongs to someone else."""

    def _send(self, client: httpx.Client, method: str, path: str, *,
              error: type[EngineError] = EngineError, **kwargs: Any) -> httpx.Response:
        """One synchronous call to ``path``, repeated under :attr:`retry_policy` as a generation
        request's attempts are: transport errors, timeouts, 408 and 5xx answers ``retries``
        times, 429s within ``max_retry_wait_s``, each after at least its ``Retry-After``.

        Returns the first answer not worth repeating (2xx, or another 4xx, for the caller to
        read). Raises the last ``httpx.HTTPError`` when the last attempt got no answer, and
        ``error`` when it was answered 408, 429 or 5xx.
        """
        tries = _Tries(self.retry_policy)
        while True:
            tries.attempts += 1
            try:
                resp, lost = client.request(method, path, **kwargs), None
            except httpx.HTTPError as exc:
                failed, lost = _transport_failure(exc), exc
            else:
                failed = _answer_failure(resp)
                if failed is None:
                    return resp
            wait = tries.wait_after(failed)
            if wait is None:
                break
            time.sleep(wait)
        if lost is not None:
            raise lost
        why = f"; gave up: {tries.gave_up}" if tries.gave_up is not None else ""
        raise error(f"{self.base_url}{path}: after {tries.attempts} attempt(s) "
                    f"({tries.rate_limited} answered 429, {tries.waited_s:g} s waited between "
                    f"them): HTTP {resp.status_code}: {resp.text[:200]!r}{why}; the server is "
                    "busy or failing: try again later, or raise the engine's retries "
                    "(408, 5xx) or max_retry_wait_s (429)")

    # -- one request ---------------------------------------------------------------------
    def request_body(self, req: GenerationRequest) -> dict[str, Any]:
        """The JSON body for ``req`` (sampling parameters always explicit)."""
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
            "ignore_eos": req.ignore_eos, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "stream": False,
        }
        if req.chat:
            if not isinstance(req.prompt, str):
                raise ValueError("a chat request needs a text prompt")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["logprobs"] = True
            body["top_logprobs"] = max(1, req.logprobs)
        else:
            body["prompt"] = req.prompt
            body["logprobs"] = max(1, req.logprobs)
        return body

    def generate_path(self, req: GenerationRequest) -> str:
        """The path a generation request is sent to."""
        return "/v1/chat/completions" if req.chat else "/v1/completions"

    def parse_answer(self, data: Any, req: GenerationRequest) -> ParsedAnswer:
        """Token ids, text, logprobs, top logprobs, finish reason and prompt length of an answer
        (:func:`parse_completion_choice`; OpenAI answers say nothing of preemptions); raises
        ``ValueError`` (or ``KeyError``, ``TypeError``, ``IndexError``) for a body that is not what
        was asked for."""
        return ParsedAnswer(*parse_completion_choice(data, chat=req.chat))

    def parse_metrics(self, text: str, t: float) -> MetricsSample:
        """One ``/metrics`` answer as a sample (vLLM's metric names)."""
        return parse_vllm_metrics(text, t=t, model_name=self.model)

    async def _attempt(self, client: httpx.AsyncClient, req: GenerationRequest,
                       body: dict[str, Any]) -> ParsedAnswer:
        path = self.generate_path(req)
        try:
            resp = await client.post(path, json=body)
        except httpx.HTTPError as exc:  # transport errors and timeouts
            raise _transport_failure(exc) from exc
        if resp.status_code != 200:
            failed = _answer_failure(resp)
            if failed is not None:
                raise failed
            raise _Fatal(f"HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            data = json.loads(resp.content)
            return self.parse_answer(data, req)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise _Retryable(f"malformed answer ({type(exc).__name__}: {exc}): "
                             f"{resp.text[:200]!r}") from exc

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore,
                   req: GenerationRequest, t0: float,
                   on_result: Callable[[GenerationResult], None]) -> None:
        async with sem:
            t_submit = time.monotonic() - t0
            tries = _Tries(self.retry_policy)
            error, parsed = None, None
            try:
                body = self.request_body(req)
            except ValueError as exc:
                body, error = None, str(exc)
            while body is not None:
                tries.attempts += 1
                try:
                    parsed = await self._attempt(client, req, body)
                    error = None
                    break
                except _Fatal as exc:
                    error = str(exc)
                    break
                except _Retryable as exc:
                    error = str(exc)
                    wait = tries.wait_after(exc)
                    if wait is None:
                        if exc.dead_endpoint:
                            self._dead_endpoint_failures += 1
                        if tries.gave_up is not None:
                            error += f"; gave up: {tries.gave_up}"
                        break
                    await asyncio.sleep(wait)
            t_done = time.monotonic() - t0
            attempts, rate_limited, waited = tries.attempts, tries.rate_limited, tries.waited_s
        if parsed is not None:
            result = GenerationResult(
                prompt_id=req.prompt_id, **parsed._asdict(), t_submit=t_submit,
                t_first_token=None, t_done=t_done, error=None, attempts=attempts,
                rate_limited=rate_limited, retry_wait_s=waited)
        else:
            result = GenerationResult(
                prompt_id=req.prompt_id, token_ids=[], text="", logprobs=None, top_logprobs=None,
                finish_reason=None, n_prompt_tokens=None, t_submit=t_submit, t_first_token=None,
                t_done=t_done, error=f"after {attempts} attempt(s): {error}",
                attempts=max(attempts, 1), rate_limited=rate_limited, retry_wait_s=waited)
        on_result(result)

    # -- optional capabilities -------------------------------------------------------------
    def _prompt_ids(self, client: httpx.Client, req: GenerationRequest) -> list[int]:
        """The prompt's token ids as the server tokenizes it (vLLM's ``POST /tokenize``)."""
        if not req.chat and not isinstance(req.prompt, str):
            return [int(t) for t in req.prompt]
        if not isinstance(req.prompt, str):
            raise ValueError("a chat request needs a text prompt")
        body: dict[str, Any] = {"model": self.model}
        if req.chat:
            body.update(messages=[{"role": "user", "content": req.prompt}],
                        add_generation_prompt=True)
        else:
            body["prompt"] = req.prompt
        resp = self._send(client, "POST", "/tokenize", json=body)
        if resp.status_code in (404, 405):
            raise EngineUnsupported(
                f"{self.base_url} has no /tokenize endpoint (HTTP {resp.status_code}), so a text "
                "prompt cannot be turned into token ids for prompt logprobs; use token-id prompts "
                "(builtin:token-ids) or a vLLM server")
        if resp.status_code != 200:
            raise EngineError(f"{self.base_url}/tokenize answered HTTP {resp.status_code}: "
                              f"{resp.text[:200]!r}")
        try:
            return [int(t) for t in resp.json()["tokens"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"{self.base_url}/tokenize: no token list in the answer "
                              f"({type(exc).__name__}: {exc})") from exc

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        """Logprob of each ``continuation`` token when prompt + continuation is prefilled.

        Sends ``/v1/completions`` with the prompt's token ids followed by ``continuation`` and
        ``prompt_logprobs = 1`` (vLLM's extension; no ``echo``), ``max_tokens = 1``, greedy, and
        reads each continuation position's entry for the token actually there. Text and chat
        prompts are tokenized by the server first (``/tokenize``).

        Raises
        ------
        EngineUnsupported
            The server returns no prompt logprobs (``bistat serve``) or has no ``/tokenize``.
        EngineError
            The server failed or answered something unreadable.
        """
        if self.model is None:
            raise EngineStartError("call start() before prompt_logprobs()")
        cont = [int(t) for t in continuation]
        if not cont:
            return []
        with httpx.Client(base_url=self.base_url, timeout=self.request_timeout_s,
                          headers=self._headers) as client:
            try:
                ids = self._prompt_ids(client, request)
                body = {"model": self.model, "prompt": ids + cont, "max_tokens": 1,
                        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": request.seed,
                        "prompt_logprobs": 1, "return_token_ids": True, "stream": False}
                resp = self._send(client, "POST", "/v1/completions", json=body)
            except httpx.HTTPError as exc:
                raise EngineError(f"{self.base_url}: prompt logprobs request failed "
                                  f"({type(exc).__name__}: {exc})") from exc
        if resp.status_code == 400 and "prompt_logprobs" in resp.text:
            raise EngineUnsupported(f"{self.base_url} refuses prompt_logprobs: {resp.text[:200]!r}")
        if resp.status_code != 200:
            raise EngineError(f"{self.base_url}/v1/completions (prompt_logprobs) answered HTTP "
                              f"{resp.status_code}: {resp.text[:200]!r}")
        return parse_prompt_logprobs(resp.json(), len(ids), cont, where=self.base_url)

    def reset_prefix_cache(self) -> bool:
        """Empty the server's prefix cache (vLLM ``POST /reset_prefix_cache``).

        Returns True when the server did it, False when it has no such endpoint (vLLM serves it
        only with ``VLLM_SERVER_DEV_MODE=1``). Other failures raise ``EngineError`` (a 429 or 5xx
        only once the retry policy gives up, :meth:`_send`).
        """
        try:
            with httpx.Client(base_url=self.base_url, timeout=self.start_timeout_s,
                              headers=self._headers) as client:
                resp = self._send(client, "POST", "/reset_prefix_cache")
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}/reset_prefix_cache: {type(exc).__name__}: {exc}"
                              ) from exc
        if resp.status_code in (404, 405):
            return False
        if resp.status_code != 200:
            raise EngineError(f"{self.base_url}/reset_prefix_cache answered HTTP "
                              f"{resp.status_code}: {resp.text[:200]!r}")
        return True

    # -- metrics ---------------------------------------------------------------------------
    async def _sample(self, client: httpx.AsyncClient, t0: float) -> MetricsSample | None:
        try:
            resp = await client.get("/metrics", timeout=min(5.0, self.request_timeout_s))
            if resp.status_code != 200:
                raise MetricsParseError(f"HTTP {resp.status_code}")
            sample = self.parse_metrics(resp.text, time.monotonic() - t0)
        except (httpx.HTTPError, MetricsParseError):
            self.metrics_errors += 1
            return None
        if math.isnan(sample.num_requests_running):
            self.metrics_errors += 1
            return None
        return sample

    async def _sampler(self, client: httpx.AsyncClient, t0: float,
                       on_metrics: Callable[[MetricsSample], None], done: asyncio.Event) -> None:
        while not done.is_set():
            sample = await self._sample(client, t0)
            if sample is not None:
                on_metrics(sample)
            try:
                await asyncio.wait_for(done.wait(), timeout=self.metrics_interval_s)
            except asyncio.TimeoutError:
                pass

    # -- one pass --------------------------------------------------------------------------
    async def run_pass_async(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                             on_result: Callable[[GenerationResult], None],
                             on_metrics: Callable[[MetricsSample], None]) -> None:
        """``run_pass`` inside a running event loop."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if self.model is None:
            raise EngineStartError("call start() before run_pass()")
        t0 = time.monotonic()
        self._dead_endpoint_failures = 0
        limits = httpx.Limits(max_connections=concurrency + 1,
                              max_keepalive_connections=concurrency + 1)
        timeout = httpx.Timeout(self.request_timeout_s)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits,
                                     headers=self._headers) as client:
            sem = asyncio.Semaphore(concurrency)
            done = asyncio.Event()
            sampler = None
            if self.metrics_interval_s > 0:
                sampler = asyncio.create_task(self._sampler(client, t0, on_metrics, done))
            try:
                await asyncio.gather(*(self._one(client, sem, r, t0, on_result) for r in requests))
            finally:
                done.set()
                if sampler is not None:
                    await sampler
            if self._dead_endpoint_failures:
                await self._check_alive(client)
            if sampler is not None:  # a last sample: the pass's final counters
                sample = await self._sample(client, t0)
                if sample is not None:
                    on_metrics(sample)

    async def _check_alive(self, client: httpx.AsyncClient) -> None:
        """After a pass whose requests failed at the endpoint (connection refused or reset, 5xx
        after every retry): raise :class:`EngineError` when the server is gone (``/v1/models``
        fails the same way), so the runner ends the pass *interrupted* and ``--resume`` re-runs
        it; a server that answers again keeps the failures as flagged requests."""
        n = self._dead_endpoint_failures
        try:
            resp = await client.get("/v1/models", timeout=min(5.0, self.request_timeout_s))
        except httpx.TimeoutException:
            return
        except httpx.TransportError as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code < 500:
                return
            why = f"HTTP {resp.status_code}"
        raise EngineError(f"the server at {self.base_url} stopped answering: {n} request(s) of "
                          f"this pass failed at the endpoint and /v1/models fails ({why}); the "
                          "pass is interrupted; restart the server and resume the run")

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        """Send every request, at most ``concurrency`` at once; callbacks run in this thread."""
        asyncio.run(self.run_pass_async(requests, concurrency=concurrency, on_result=on_result,
                                        on_metrics=on_metrics))
