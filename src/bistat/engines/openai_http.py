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

The retry loop is bistat's own rather than tenacity's (which would fit): tenacity is not on the
lent GPU machine's image, where bistat is installed without its dependencies
(``scripts/device/install.sh``), and its wait and stop rules would be callables of our own here
anyway; HTTP-dates are parsed by the standard library (:func:`email.utils.parsedate_to_datetime`
reads all three forms RFC 9110 allows).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import email.utils
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

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
from bistat.engines.metrics import MetricsParseError, parse_vllm_metrics

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RATE_LIMITED = 429


def retry_after_s(value: str | None, now: _dt.datetime) -> float | None:
    """Seconds to wait that a ``Retry-After`` header asks for, or None (absent or unreadable).

    ``value`` is delay-seconds (``"120"``) or an HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``,
    and the obsolete RFC 850 and asctime forms), counted from ``now`` (the answer's ``Date``
    header where it has one, so the two clocks need not agree); a date in the past is 0.

    >>> now = _dt.datetime(2015, 10, 21, 7, 27, 30, tzinfo=_dt.timezone.utc)
    >>> retry_after_s("120", now), retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now)
    (120.0, 30.0)
    """
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        when = when.replace(tzinfo=_dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())


def answer_time(headers: Mapping[str, str]) -> _dt.datetime:
    """The answer's ``Date`` header, else this machine's clock."""
    try:
        when = email.utils.parsedate_to_datetime(headers.get("date", ""))
    except (TypeError, ValueError, IndexError):
        return _dt.datetime.now(_dt.timezone.utc)
    return when if when.tzinfo is not None else when.replace(tzinfo=_dt.timezone.utc)


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed attempt is repeated, and after how long (pure).

    Attributes
    ----------
    retries : int
        Further attempts after failures other than 429 (transport errors, timeouts, 408, 5xx,
        bad bodies).
    backoff_s : float
        Wait before the first retry, doubled before each further one (429s included).
    backoff_max_s : float
        Longest backoff between two attempts (a longer ``Retry-After`` is still honoured).
    max_wait_s : float
        Longest total wait between the attempts of one request: the retry whose wait would pass
        it is not made, and the request fails.
    """

    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    max_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not self.backoff_s > 0:
            raise ValueError(f"backoff_s must be > 0 (the first retry's wait), got "
                             f"{self.backoff_s}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_retry_wait_s must be >= 0, got {self.max_wait_s}")

    def next_wait(self, *, attempt: int, failures: int, waited_s: float, rate_limited: bool,
                  retry_after: float | None) -> tuple[float | None, str | None]:
        """``(seconds, None)`` to wait before attempt ``attempt + 1``, or ``(None, why)`` to give
        up (``why`` is None when the ``retries`` are used up, else the wait bound's reason).

        Parameters
        ----------
        attempt : int
            Attempts made so far (the one that just failed included).
        failures : int
            Failed attempts so far that were not 429s.
        waited_s : float
            Seconds already waited between this request's attempts.
        rate_limited : bool
            The attempt that just failed was answered 429.
        retry_after : float or None
            Its ``Retry-After`` in seconds (:func:`retry_after_s`).
        """
        if not rate_limited and failures > self.retries:
            return None, None
        backoff = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        wait = backoff if retry_after is None else max(retry_after, backoff)
        if waited_s + wait > self.max_wait_s:
            asked = f"Retry-After {retry_after:g} s" if retry_after is not None else "backoff"
            return None, (f"the next wait ({asked}: {wait:g} s) would take the waits to "
                          f"{waited_s + wait:g} s, past max_retry_wait_s = {self.max_wait_s:g} s")
        return wait, None


class _Retryable(Exception):
    """A failed attempt worth repeating; ``dead_endpoint`` when the endpoint itself failed (the
    connection was refused or reset, or it answered 5xx), not the request; ``rate_limited`` when
    it was answered 429, with ``retry_after`` its ``Retry-After`` in seconds."""

    def __init__(self, message: str, dead_endpoint: bool = False, rate_limited: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.dead_endpoint = dead_endpoint
        self.rate_limited = rate_limited
        self.retry_after = retry_after


class _Fatal(Exception):
    """A failed attempt not worth repeating (the server rejected the request)."""


def _transport_failure(exc: httpx.HTTPError) -> _Retryable:
    """A transport error or timeout as a failed attempt (a timeout is not a dead endpoint)."""
    dead = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
    return _Retryable(f"{type(exc).__name__}: {exc}", dead_endpoint=dead)


def _answer_failure(resp: httpx.Response) -> _Retryable | None:
    """An answer worth repeating the attempt for (408, 429, 5xx, with its ``Retry-After``: a 503
    may send one too) as a failed attempt; None for any other answer."""
    if resp.status_code not in _RETRY_STATUS:
        return None
    after = retry_after_s(resp.headers.get("retry-after"), answer_time(resp.headers))
    return _Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}",
                      dead_endpoint=resp.status_code >= 500,
                      rate_limited=resp.status_code == RATE_LIMITED, retry_after=after)


@dataclass
class _Tries:
    """One request's attempts under a :class:`RetryPolicy`: the counts its result records."""

    policy: RetryPolicy
    attempts: int = 0
    failures: int = 0           # failed attempts that were not 429s
    rate_limited: int = 0       # attempts answered 429
    waited_s: float = 0.0       # seconds waited between the attempts
    gave_up: str | None = None  # why the wait bound ended them, if it did

    def wait_after(self, failed: _Retryable) -> float | None:
        """Count the failed attempt; the seconds to wait before the next one, or None to give
        up (``gave_up`` then says why, unless the ``retries`` were used up)."""
        self.rate_limited += failed.rate_limited
        self.failures += not failed.rate_limited
        wait, self.gave_up = self.policy.next_wait(
            attempt=self.attempts, failures=self.failures, waited_s=self.waited_s,
            rate_limited=failed.rate_limited, retry_after=failed.retry_after)
        if wait is not None:
            self.waited_s += wait
        return wait


def _parse_token(token: str) -> int:
    """``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not of the form 'token_id:N'")
    return int(token[len("token_id:"):])


def parse_completion_choice(
    data: Any, *, chat: bool
) -> tuple[list[int], str, list[float] | None, list[list[tuple[int, float]]] | None, str | None, int | None]:
    """Token ids, text, logprobs, top logprobs, finish reason and prompt length of an answer.

    Raises ``ValueError`` (or ``KeyError``/``TypeError``) when the body is not shaped like an
    OpenAI completion with token ids.
    """
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    lp = choice.get("logprobs")
    logprobs = top = None
    ids_from_tokens: list[int] | None = None
    if lp is not None:
        if chat:
            content = lp["content"] or []
            ids_from_tokens = [_parse_token(c["token"]) for c in content]
            logprobs = [float(c["logprob"]) for c in content]
            top = [sorted(((_parse_token(a["token"]), float(a["logprob"])) for a in c["top_logprobs"] or []),
                          key=lambda p: -p[1]) for c in content]
        else:
            ids_from_tokens = [_parse_token(t) for t in lp["tokens"]]
            logprobs = [float(x) for x in lp["token_logprobs"]]
            top = [sorted(((_parse_token(k), float(v)) for k, v in (d or {}).items()),
                          key=lambda p: -p[1]) for d in lp["top_logprobs"]]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = ids_from_tokens
    if token_ids is None:
        raise ValueError("the answer has neither token_ids nor logprobs tokens; the server must "
                         "support return_token_ids or return_tokens_as_token_ids")
    token_ids = [int(t) for t in token_ids]
    if ids_from_tokens is not None and ids_from_tokens != token_ids:
        raise ValueError("token_ids and the logprobs' tokens disagree")
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    if not isinstance(text, str):
        raise ValueError("the answer's text is not a string")
    n_prompt = None
    if choice.get("prompt_token_ids") is not None:
        n_prompt = len(choice["prompt_token_ids"])
    elif isinstance(data.get("usage"), dict) and data["usage"].get("prompt_tokens") is not None:
        n_prompt = int(data["usage"]["prompt_tokens"])
    return token_ids, text, logprobs, top, choice.get("finish_reason"), n_prompt


def parse_prompt_logprobs(data: Any, n_prompt: int, continuation: Sequence[int], *,
                          where: str = "the server") -> list[float]:
    """The continuation tokens' logprobs from a completion answer's ``prompt_logprobs``.

    vLLM returns one entry per prompt token (the first is null): a mapping from token id (as a
    string) to ``{"logprob": x, "rank": r, ...}`` (or to the bare logprob), holding at least the
    token actually at that position.

    Raises
    ------
    EngineUnsupported
        The answer has no ``prompt_logprobs`` (the server ignores the field).
    EngineError
        The list is too short or lacks a continuation token.
    """
    try:
        plp = data["choices"][0].get("prompt_logprobs")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise EngineError(f"{where}: not a completion answer ({type(exc).__name__}: {exc})") from exc
    if plp is None:
        raise EngineUnsupported(f"{where} returned no prompt_logprobs (the server does not "
                                "support vLLM's prompt_logprobs request field)")
    if not isinstance(plp, list) or len(plp) < n_prompt + len(continuation):
        raise EngineError(f"{where}: prompt_logprobs has {len(plp) if isinstance(plp, list) else 0}"
                          f" entries for {n_prompt + len(continuation)} prompt tokens")
    out: list[float] = []
    for j, tok in enumerate(continuation):
        entry = plp[n_prompt + j]
        got = entry.get(str(int(tok))) if isinstance(entry, dict) else None
        if got is None and isinstance(entry, dict):
            got = entry.get(f"token_id:{int(tok)}")
        if isinstance(got, dict):
            got = got.get("logprob")
        if got is None:
            raise EngineError(f"{where}: prompt_logprobs at position {n_prompt + j} lacks token "
                              f"{int(tok)}")
        out.append(float(got))
    return out


#: the workload's fields an HTTP engine reads, unless ``engine.args`` or an arm's ``args`` set them
WORKLOAD_HTTP_KEYS = ("retries", "request_timeout_s")


def workload_defaults(experiment: Any) -> dict[str, Any]:
    """The :data:`WORKLOAD_HTTP_KEYS` of ``experiment.workload`` (those it has): the HTTP client's
    settings where the engine's and the arm's arguments do not set them."""
    workload = getattr(experiment, "workload", None)
    return {k: getattr(workload, k) for k in WORKLOAD_HTTP_KEYS if hasattr(workload, k)}


def workload_conflicts(experiment: Any, kind: str) -> list[tuple[str, str]]:
    """``(field, message)`` for each of :data:`WORKLOAD_HTTP_KEYS` that the declaration sets in
    ``workload`` and, to another value, in ``engine.args`` or an arm's ``args``: which one the
    run would use is not what the declaration says."""
    workload = experiment.workload
    problems = []
    for key in WORKLOAD_HTTP_KEYS:
        if key not in workload.model_fields_set:
            continue
        value = getattr(workload, key)
        declared = [(f"engine.args.{key}", experiment.engine.args)]
        declared += [(f"arms[{i}].args.{key}", arm.args) for i, arm in enumerate(experiment.arms)]
        problems += [(field, f"{args[key]!r} disagrees with workload.{key} = {value}, which "
                             f"engine '{kind}' reads as well; declare the {key} once: remove "
                             f"{field}, or remove workload.{key} and keep {field}")
                     for field, args in declared if key in args and args[key] != value]
    return problems


#: longest text kept of one value a server declares
_REPORTED_MAX = 200


def _scalars(data: Any, keys: int = 40) -> dict[str, Any] | None:
    """The first ``keys`` scalar entries of a JSON object (strings cut at 200 characters), sorted
    by key; None for anything else."""
    if not isinstance(data, dict):
        return None
    out = {}
    for key in sorted(data, key=str)[:keys]:
        value = data[key]
        if isinstance(value, str):
            out[str(key)] = value[:_REPORTED_MAX]
        elif value is None or isinstance(value, (bool, int, float)):
            out[str(key)] = value
    return out


def server_report(version: Any, model: Any) -> dict[str, Any]:
    """What a server declares about itself, as an ``openai`` arm records it: its ``GET /version``
    answer (``version``: bistat serve's is ``{"version", "server", "engine", "gemm", ...}``,
    vLLM's ``{"version"}``) and its ``GET /v1/models`` entry for the served model (``model``:
    ``max_model_len``, ``owned_by``, ``root`` where it says them), each a JSON object of scalars,
    None where the server answered nothing readable.

    >>> server_report({"version": "0.1.0", "gemm": "blas", "nested": {}}, {"id": "m", "max_model_len": 2048})
    {'version': {'gemm': 'blas', 'version': '0.1.0'}, 'model': {'id': 'm', 'max_model_len': 2048}}
    """
    entry = _scalars(model)
    if entry is not None:   # what the model entry says of the server, not when it was listed
        entry = {k: v for k, v in entry.items() if k in ("id", "max_model_len", "owned_by", "root")}
    return {"version": _scalars(version), "model": entry}


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

    def parse_answer(self, data: Any, req: GenerationRequest) -> tuple:
        """Token ids, text, logprobs, top logprobs, finish reason and prompt length of an answer
        (:func:`parse_completion_choice`); raises ``ValueError`` (or ``KeyError``, ``TypeError``,
        ``IndexError``) for a body that is not what was asked for."""
        return parse_completion_choice(data, chat=req.chat)

    def parse_metrics(self, text: str, t: float) -> MetricsSample:
        """One ``/metrics`` answer as a sample (vLLM's metric names)."""
        return parse_vllm_metrics(text, t=t, model_name=self.model)

    async def _attempt(self, client: httpx.AsyncClient, req: GenerationRequest,
                       body: dict[str, Any]) -> tuple:
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
            ids, text, lps, top, finish, n_prompt = parsed
            result = GenerationResult(
                prompt_id=req.prompt_id, token_ids=ids, text=text, logprobs=lps,
                top_logprobs=top, finish_reason=finish, n_prompt_tokens=n_prompt,
                t_submit=t_submit, t_first_token=None, t_done=t_done, error=None,
                attempts=attempts, rate_limited=rate_limited, retry_wait_s=waited)
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
