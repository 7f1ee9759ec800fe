"""``bistat serve``: the embedded engine behind an OpenAI-compatible HTTP server (starlette + uvicorn).

Routes (the subset of vLLM 0.25.0's server that bistat's runner and common clients use):

- ``POST /v1/completions`` — text or token-id prompts (or a list of them), ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs`` (top-k), ``ignore_eos``, ``stop``,
  ``return_tokens_as_token_ids``, ``return_token_ids``;
- ``POST /v1/chat/completions``; ``GET /v1/models``; ``GET /health``; ``GET /version``;
- ``GET /metrics`` — Prometheus text with vLLM's names (``vllm:num_requests_running`` ...) and a
  ``model_name`` label, read from the engine's ``metrics()`` at every scrape.

Fields of vLLM's and SGLang's servers that bistat serve does not implement are honoured where it
can (a chat-template variable the model's template reads), accepted and logged where they cannot
change this model's output, and refused otherwise (:mod:`bistat.engines.serve.fields`); a field
nobody knows is refused naming the closest known one.

Each HTTP request becomes ``GenerationRequest`` s submitted to the engine; the engine's loop batches
whatever is in flight together, so concurrent HTTP requests share engine steps exactly as they
would in-process. Malformed requests get OpenAI-style 4xx JSON errors; an engine failure on one
request is a 500 for that request only. Binds to 127.0.0.1 unless told otherwise.

Bounds (:class:`Limits`): a body over ``max_body_bytes`` or with more than
``max_prompts_per_request`` prompts is a 413 naming the limit, read no further than the limit;
a request whose prompts would take the prompts in flight (queued or generating) past
``max_queued_prompts`` is a 429 with ``Retry-After``, and nothing of it is queued; JSON nested too
deeply to parse is a 400. A client that disconnects has its requests cancelled in the engine
(``Future.cancel()``: no more tokens are generated for them). On SIGTERM :func:`serve` stops
accepting connections, lets in-flight requests finish for ``shutdown_timeout_s``, cancels the
rest and exits with status 0.

The engine is anything with ``start()``, ``stop()``, ``submit(GenerationRequest) -> Future``
and ``metrics() -> dict`` (``bistat.engines.embedded.engine.EmbeddedEngine``); the tokenizer anything with
``encode``, ``decode`` and ``apply_chat_template`` (``bistat.model``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bistat import __version__
from bistat.engines.base import GenerationRequest
from bistat.engines.serve.fields import FieldDecision, foreign_fields
from bistat.engines.serve.protocol import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    RequestError,
    apply_stop,
    chat_body,
    completion_body,
    error_body,
    generation_request,
)

from bistat.model.chat import template_variables

log = logging.getLogger("bistat.engines.serve.server")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServableEngine(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> None: ...
    def submit(self, request: GenerationRequest) -> Any: ...  # concurrent.futures.Future
    def metrics(self) -> dict[str, float]: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class _EngineCollector:
    """A prometheus_client collector that reads the engine's counters at scrape time."""

    # (Prometheus family name, engine metrics() key, kind, help)
    _METRICS = (
        ("vllm:num_requests_running", "num_requests_running", "gauge",
         "Number of requests in the running batch."),
        ("vllm:num_requests_waiting", "num_requests_waiting", "gauge",
         "Number of requests waiting to be scheduled."),
        ("vllm:num_preemptions", "num_preemptions_total", "counter",
         "Cumulative number of preemptions."),
        ("vllm:prompt_tokens", "prompt_tokens_total", "counter",
         "Number of prefill tokens processed."),
        ("vllm:generation_tokens", "generation_tokens_total", "counter",
         "Number of generation tokens processed."),
    )

    def __init__(self, engine: ServableEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Any]:
        values = self._engine.metrics()
        for name, key, kind, help_text in self._METRICS:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = cls(name, help_text, labels=["model_name"])
            family.add_metric([self._model_name], float(values[key]))
            yield family


@dataclass(frozen=True)
class Limits:
    """What one server accepts: body size, prompts per request, prompts in flight.

    ``max_queued_prompts`` counts every prompt the server has handed to the engine and not yet
    answered (waiting or generating), over all requests; ``retry_after_s`` is the 429's
    ``Retry-After``.
    """

    max_body_bytes: int = 8 * 2**20
    max_prompts_per_request: int = 256
    max_queued_prompts: int = 1024
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompts_per_request", "max_queued_prompts",
                     "retry_after_s"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Limits.{name} ({getattr(self, name)!r}) must be at least 1")


class _TooLarge(Exception):
    """The request body is longer than ``Limits.max_body_bytes``."""


def _error(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc.message, type_=exc.type, status=exc.status,
                                   param=exc.param), status_code=exc.status, headers=headers)


class _EngineFailure(RuntimeError):
    """The engine raised or returned an error for a request: a 500 for that request only."""


def _engine_error(exc: _EngineFailure) -> JSONResponse:
    log.error("%s", exc)
    return JSONResponse(error_body(str(exc), type_="InternalServerError", status=500),
                        status_code=500)


def _validation_error(exc: ValidationError) -> RequestError:
    first = exc.errors()[0]
    loc = first["loc"]
    # keep the field and list indices; drop pydantic's union-branch tags ("str", "list[int]")
    param = ".".join([str(loc[0])] + [str(p) for p in loc[1:] if isinstance(p, int)]) if loc else None
    msg = first["msg"].removeprefix("Value error, ")
    if loc and loc[0] == "prompt" and first["type"] != "missing":
        msg = ("must be a string, a list of token ids, a list of strings or a list of "
               "token-id lists")
    return RequestError(f"{param}: {msg}" if param else msg, param=param)


def create_app(
    engine: ServableEngine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    vocab_size: int | None = None,
    engine_description: dict[str, Any] | None = None,
    manage_engine: bool = True,
    limits: Limits = Limits(),
) -> Starlette:
    """The ASGI application serving ``engine`` under the model name ``model_name``.

    Parameters
    ----------
    engine : ServableEngine
        Started and stopped with the application when ``manage_engine`` is true.
    tokenizer : Tokenizer
        Used for stop strings, token strings in logprobs, chat templates and length checks.
    model_name : str
        The only model id this server answers to (``/v1/models``; the requests' ``model``).
    max_model_len : int
        Prompt plus output tokens may not exceed this; the default ``max_tokens`` fills it.
    vocab_size : int or None
        Token-id prompts must lie in ``[0, vocab_size)`` when given.
    engine_description : dict or None
        Extra fields for ``GET /version`` (for example the GEMM mode).
    manage_engine : bool
        Start the engine at application start-up and stop it at shutdown.
    limits : Limits
        Body size, prompts per request and prompts in flight (413 / 429 beyond them).
    """
    server = _Server(engine, tokenizer, model_name=model_name, max_model_len=max_model_len,
                     vocab_size=vocab_size, engine_description=engine_description or {},
                     manage_engine=manage_engine, limits=limits)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=server.lifespan,
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


class _Server:
    """One application's state (the engine, its model, the bounds, the prompts in flight) and
    its routes, in the order a request meets them: the body read and parsed, the prompts
    checked and admitted, the engine run, the answer."""

    def __init__(self, engine: ServableEngine, tokenizer: Tokenizer, *, model_name: str,
                 max_model_len: int, vocab_size: int | None,
                 engine_description: dict[str, Any], manage_engine: bool,
                 limits: Limits) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.engine_description = engine_description
        self.manage_engine = manage_engine
        self.limits = limits
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))  # type: ignore[arg-type]
        self.decode = tokenizer.decode
        self.created = int(time.time())
        #: prompts handed to the engine and not yet answered; only touched on the event loop
        self.in_flight = 0
        #: the variables the model's chat template reads besides the messages (a tokenizer
        #: without a template source reads none: its apply_chat_template takes the messages)
        source = getattr(tokenizer, "chat_template", None)
        self.template_reads = template_variables(source) if isinstance(source, str) else frozenset()
        #: (field, value) of the fields accepted without effect that were logged
        self.accepted_logged: set[tuple[str, str]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        if self.manage_engine:
            self.engine.start()
        try:
            yield
        finally:
            if self.manage_engine:
                self.engine.stop()

    # the request: its body, its model, its prompts -------------------------------------------

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise RequestError(f"The model `{requested}` does not exist; this server serves "
                               f"`{self.model_name}`.", status=404, param="model",
                               type_="NotFoundError")

    def prompt_length(self, prompt: str | list[int], param: str) -> tuple[int, list[int] | None]:
        if isinstance(prompt, str):
            if prompt == "":
                raise RequestError("prompt must not be empty", param=param)
            return len(self.tokenizer.encode(prompt)), None
        if len(prompt) == 0:
            raise RequestError("prompt must not be empty", param=param)
        if self.vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of range [0, {self.vocab_size})",
                                   param=param)
        return len(prompt), list(prompt)

    def resolve_max_tokens(self, requested: int | None, n_prompt: int) -> int:
        room = self.max_model_len - n_prompt
        if room < 1:
            raise RequestError(f"the prompt has {n_prompt} tokens; this model's maximum context "
                               f"length is {self.max_model_len}", param="prompt")
        if requested is None:
            return room
        if requested > room:
            raise RequestError(f"max_tokens={requested} plus the prompt's {n_prompt} tokens "
                               f"exceeds the maximum context length {self.max_model_len}",
                               param="max_tokens")
        return requested

    def too_large(self, what: str) -> RequestError:
        return RequestError(f"{what}; this server accepts at most {self.limits.max_body_bytes} "
                            f"bytes (bistat serve --max-body-bytes)", status=413,
                            type_="invalid_request_error")

    async def read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self.too_large(f"the request body has {int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self.too_large(f"the request body has more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse_body(self, request: Request, model: type) -> tuple[Any, FieldDecision]:
        """The request's body validated by ``model``, and what is done with the fields of vLLM's
        and SGLang's servers it does not declare (:func:`bistat.engines.serve.fields.foreign_fields`)."""
        raw = await self.read_body(request)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise RequestError("the request body is JSON nested too deeply to parse") from exc
        if not isinstance(data, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        except RecursionError as exc:
            raise RequestError("the request body is JSON nested too deeply to validate") from exc
        decision = foreign_fields(data, model.model_fields, chat=model is ChatCompletionRequest,
                                  template_reads=self.template_reads)
        self.check_model(parsed.model)
        self.record_accepted(decision)
        return parsed, decision

    def record_accepted(self, decision: FieldDecision) -> None:
        """Log each field accepted without effect, once per field and value (a client sends the
        same payload with every request), at WARNING as vLLM logs the fields it ignores: in the
        server's log, which a run keeps, whatever uvicorn's ``--log-level``."""
        for name, value, why in decision.accepted:
            key = (name, repr(value))
            if key not in self.accepted_logged and len(self.accepted_logged) < 1000:
                self.accepted_logged.add(key)
                log.warning("accepted request field %s = %r without effect: %s", name, value, why)

    def admit(self, n: int) -> None:
        """Refuse ``n`` prompts that would take the prompts in flight past the bound: 413 when
        they could never fit (more than one request may carry, or than may be in flight at
        all), 429 with ``Retry-After`` when they fit once others are answered."""
        limits = self.limits
        if n > limits.max_prompts_per_request:
            raise RequestError(f"the request has {n} prompts; this server accepts at most "
                               f"{limits.max_prompts_per_request} per request (bistat serve "
                               f"--max-prompts-per-request)", status=413, param="prompt")
        if n > limits.max_queued_prompts:
            raise RequestError(f"the request has {n} prompts, more than this server ever holds "
                               f"in flight ({limits.max_queued_prompts}, bistat serve "
                               f"--max-queued-prompts): it can never be admitted; send fewer "
                               f"prompts per request", status=413, param="prompt")
        if self.in_flight + n > limits.max_queued_prompts:
            raise RequestError(f"the server is busy: {self.in_flight} prompts are in flight and "
                               f"this request adds {n}, over the bound of "
                               f"{limits.max_queued_prompts} (bistat serve --max-queued-prompts); "
                               f"retry after {limits.retry_after_s} s", status=429,
                               type_="rate_limit_error")

    def retry_after(self, exc: RequestError) -> dict[str, str] | None:
        return {"Retry-After": str(self.limits.retry_after_s)} if exc.status == 429 else None

    # the engine ------------------------------------------------------------------------------

    async def run_engine(self, request: Request, requests: list[GenerationRequest]
                         ) -> list[Any] | None:
        """The engine's results, or None when the client went away first (its requests are then
        cancelled in the engine). Cancelled itself (server shutdown), it cancels them too."""
        self.in_flight += len(requests)
        futures = [asyncio.wrap_future(self.engine.submit(r)) for r in requests]
        gathered = asyncio.gather(*futures, return_exceptions=True)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done():
                log.info("client disconnected: %d requests cancelled", len(requests))
                return None
            results = gathered.result()
        finally:
            watcher.cancel()
            for f in futures:  # cancels the engine's concurrent future: the request leaves
                f.cancel()
            gathered.cancel()
            self.in_flight -= len(requests)
        for r in results:
            if isinstance(r, BaseException):
                raise _EngineFailure(f"the engine failed: {r!r}") from r
            if r.error is not None:
                raise _EngineFailure(f"the engine failed: {r.error}")
        return list(results)

    async def answer(self, request: Request, requests: list[GenerationRequest],
                     body: Callable[[list[Any]], dict[str, Any]]) -> Response:
        """Run ``requests`` and answer with ``body(results)``: a 500 when the engine failed,
        499 when the client went away (nobody reads it)."""
        try:
            results = await self.run_engine(request, requests)
        except _EngineFailure as exc:
            return _engine_error(exc)
        if results is None:
            return Response(status_code=499)
        return JSONResponse(body(results))

    # routes ----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body, _ = await self.parse_body(request, CompletionRequest)
            prompts = body.prompts()
            reqs, prompt_ids = [], []
            self.admit(len(prompts))
            for i, prompt in enumerate(prompts):
                param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
                if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                    raise RequestError("a prompt must be a string or a list of token ids",
                                       param=param)
                n_prompt, ids = self.prompt_length(prompt, param)
                max_tokens = self.resolve_max_tokens(body.max_tokens, n_prompt)
                reqs.append(generation_request(body, prompt, max_tokens=max_tokens,
                                               logprobs=body.logprobs, chat=False))
                prompt_ids.append(ids)
        except RequestError as exc:
            return _error(exc, self.retry_after(exc))

        def completion(results: list[Any]) -> dict[str, Any]:
            choices = [Choice(apply_stop(r, body.stop, self.decode), ids)
                       for r, ids in zip(results, prompt_ids)]
            return completion_body(body, choices, model_name=self.model_name, decode=self.decode)

        return await self.answer(request, reqs, completion)

    async def chat_completions(self, request: Request) -> Response:
        tokenizer = self.tokenizer
        try:
            body, fields = await self.parse_body(request, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            if fields.template_variables:   # the template reads them: rendered with them
                prompt, chat = tokenizer.apply_chat_template(messages,
                                                             **fields.template_variables), False
                n_prompt = len(tokenizer.encode(prompt))
            elif len(messages) == 1 and messages[0]["role"] == "user":
                # The engine applies its own chat template to a lone user message: the same
                # path as an in-process chat request, so both give the same tokens.
                prompt, chat = messages[0]["content"], True
                n_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
            else:
                prompt, chat = tokenizer.apply_chat_template(messages), False
                n_prompt = len(tokenizer.encode(prompt))
            requested = body.max_completion_tokens or body.max_tokens
            max_tokens = self.resolve_max_tokens(requested, n_prompt)
            k = body.top_logprobs if body.logprobs else None
            req = generation_request(body, prompt, max_tokens=max_tokens, logprobs=k, chat=chat)
            self.admit(1)
        except RequestError as exc:
            return _error(exc, self.retry_after(exc))

        def chat_completion(results: list[Any]) -> dict[str, Any]:
            (result,) = results
            choice = Choice(apply_stop(result, body.stop, self.decode), None)
            return chat_body(body, choice, model_name=self.model_name, decode=self.decode)

        return await self.answer(request, [req], chat_completion)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "bistat", "root": self.model_name, "parent": None,
            "max_model_len": self.max_model_len}]})

    async def version(self, request: Request) -> Response:
        """bistat's version and what the server runs: the model, its context length and the
        engine's settings (the embedded engine's GEMM mode and batch size), so that a client
        (an ``openai`` arm) records what it measured."""
        engine = {}
        if isinstance(getattr(self.engine, "gemm", None), str):
            engine = {"engine": "embedded", "gemm": self.engine.gemm,
                      "max_batch_size": getattr(self.engine, "max_batch_size", None)}
        return JSONResponse({"version": __version__, "server": "bistat serve",
                             "model": self.model_name, "max_model_len": self.max_model_len,
                             **engine, **self.engine_description})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _health(request: Request) -> Response:
    return Response(status_code=200)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                   type_=type_, status=exc.status_code),
                        status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    return JSONResponse(error_body(str(exc), type_="InternalServerError", status=500),
                        status_code=500)


def uvicorn_config(app: Starlette, *, host: str, port: int, log_level: str = "warning",
                   shutdown_timeout_s: float = 2.0) -> uvicorn.Config:
    """uvicorn settings for bistat serve: no access log, h11, asyncio, one worker; on shutdown
    in-flight requests get ``shutdown_timeout_s`` seconds, then they are cancelled."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", loop="asyncio", http="h11", timeout_keep_alive=30,
                          backlog=4096, timeout_graceful_shutdown=shutdown_timeout_s)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free port; ``getsockname()`` says which)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning", shutdown_timeout_s: float = 2.0,
          on_bound: Callable[[int], None] | None = None,
          sock: socket.socket | None = None) -> None:
    """Run ``app`` in the foreground until SIGINT/SIGTERM.

    The socket is bound first (or ``sock``, already bound, is used; ``host``/``port`` are then
    ignored) and ``on_bound(port)`` told the port bound (the free one chosen for ``port=0``). On SIGTERM uvicorn stops accepting connections, waits up to
    ``shutdown_timeout_s`` for in-flight requests, cancels the rest (the engine drops them) and
    stops the engine; this function then returns, so the process exits with status 0.
    """
    if sock is None:
        sock = bind(host, port)
    host = sock.getsockname()[0]
    if on_bound is not None:
        on_bound(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, host=host, port=sock.getsockname()[1],
                                           log_level=log_level,
                                           shutdown_timeout_s=shutdown_timeout_s))
    # uvicorn re-raises the signal that stopped it once it is done, to the handler it found:
    # a no-op one for SIGTERM makes a requested stop an ordinary return (exit status 0).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


class BackgroundServer:
    """Run an app on a free loopback port in a thread (tests, benchmarks, in-process runs).

    >>> with BackgroundServer(app) as srv:  # doctest: +SKIP
    ...     httpx.get(srv.url + "/health")
    """

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 30.0) -> None:
        self._sock = bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = url_of(host, self.port)
        self._server = uvicorn.Server(uvicorn_config(app, host=host, port=self.port))
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._run, name="bistat-serve", daemon=True)
        self._timeout = startup_timeout_s
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported to the starting thread
            self._error = exc

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server at {self.url} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start in {self._timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
