"""``bistat serve``: the embedded engine behind an OpenAI-compatible HTTP server (starlette + uvicorn).

Routes (the subset of vLLM 0.25.0's server that bistat's runner and common clients use):

- ``POST /v1/completions`` — text or token-id prompts (or a list of them), ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs`` (top-k), ``ignore_eos``, ``stop``,
  ``return_tokens_as_token_ids``, ``return_token_ids``;
- ``POST /v1/chat/completions``; ``GET /v1/models``; ``GET /health``; ``GET /version``;
- ``GET /metrics`` — Prometheus text with vLLM's names (``vllm:num_requests_running`` ...) and a
  ``model_name`` label, read from the engine's ``metrics()`` at every scrape.

Each HTTP request becomes ``GenerationRequest`` s submitted to the engine; the engine's loop batches
whatever is in flight together, so concurrent HTTP requests share engine steps exactly as they
would in-process. Malformed requests get OpenAI-style 4xx JSON errors; an engine failure on one
request is a 500 for that request only. Binds to 127.0.0.1 unless told otherwise.

The engine is anything with ``start()``, ``stop()``, ``submit(GenerationRequest) -> Future``
and ``metrics() -> dict`` (``bistat.engines.embedded.engine.EmbeddedEngine``); the tokenizer anything with
``encode``, ``decode`` and ``apply_chat_template`` (``bistat.model``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any, Iterator, Protocol

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


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, type_=exc.type, status=exc.status,
                                   param=exc.param), status_code=exc.status)


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
    """
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, model_name))  # type: ignore[arg-type]
    decode = tokenizer.decode
    created = int(time.time())

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise RequestError(f"The model `{requested}` does not exist; this server serves "
                               f"`{model_name}`.", status=404, param="model",
                               type_="NotFoundError")

    def prompt_length(prompt: str | list[int], param: str) -> tuple[int, list[int] | None]:
        if isinstance(prompt, str):
            if prompt == "":
                raise RequestError("prompt must not be empty", param=param)
            return len(tokenizer.encode(prompt)), None
        if len(prompt) == 0:
            raise RequestError("prompt must not be empty", param=param)
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of range [0, {vocab_size})",
                                   param=param)
        return len(prompt), list(prompt)

    def resolve_max_tokens(requested: int | None, n_prompt: int) -> int:
        room = max_model_len - n_prompt
        if room < 1:
            raise RequestError(f"the prompt has {n_prompt} tokens; this model's maximum context "
                               f"length is {max_model_len}", param="prompt")
        if requested is None:
            return room
        if requested > room:
            raise RequestError(f"max_tokens={requested} plus the prompt's {n_prompt} tokens "
                               f"exceeds the maximum context length {max_model_len}",
                               param="max_tokens")
        return requested

    async def parse_body(request: Request, model: type) -> Any:
        try:
            raw = await request.body()
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        ignored = sorted(set(data) - set(model.model_fields))
        if ignored:
            log.warning("ignored request fields: %s", ", ".join(ignored))
        check_model(parsed.model)
        return parsed

    async def run_engine(requests: list[GenerationRequest]) -> list[Any]:
        futures = [asyncio.wrap_future(engine.submit(r)) for r in requests]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise _EngineFailure(f"the engine failed: {r!r}") from r
            if r.error is not None:
                raise _EngineFailure(f"the engine failed: {r.error}")
        return list(results)

    async def completions(request: Request) -> Response:
        try:
            body: CompletionRequest = await parse_body(request, CompletionRequest)
            prompts = body.prompts()
            reqs, prompt_ids = [], []
            for i, prompt in enumerate(prompts):
                param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
                if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                    raise RequestError("a prompt must be a string or a list of token ids",
                                       param=param)
                n_prompt, ids = prompt_length(prompt, param)
                max_tokens = resolve_max_tokens(body.max_tokens, n_prompt)
                reqs.append(generation_request(body, prompt, max_tokens=max_tokens,
                                               logprobs=body.logprobs, chat=False))
                prompt_ids.append(ids)
        except RequestError as exc:
            return _error(exc)
        try:
            results = await run_engine(reqs)
        except _EngineFailure as exc:
            return _engine_error(exc)
        choices = [Choice(apply_stop(r, body.stop, decode), ids)
                   for r, ids in zip(results, prompt_ids)]
        return JSONResponse(completion_body(body, choices, model_name=model_name, decode=decode))

    async def chat_completions(request: Request) -> Response:
        try:
            body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            if len(messages) == 1 and messages[0]["role"] == "user":
                # The engine applies its own chat template to a lone user message: the same
                # path as an in-process chat request, so both give the same tokens.
                prompt, chat = messages[0]["content"], True
                n_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
            else:
                prompt, chat = tokenizer.apply_chat_template(messages), False
                n_prompt = len(tokenizer.encode(prompt))
            requested = body.max_completion_tokens or body.max_tokens
            max_tokens = resolve_max_tokens(requested, n_prompt)
            k = body.top_logprobs if body.logprobs else None
            req = generation_request(body, prompt, max_tokens=max_tokens, logprobs=k, chat=chat)
        except RequestError as exc:
            return _error(exc)
        try:
            (result,) = await run_engine([req])
        except _EngineFailure as exc:
            return _engine_error(exc)
        choice = Choice(apply_stop(result, body.stop, decode), None)
        return JSONResponse(chat_body(body, choice, model_name=model_name, decode=decode))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "bistat",
            "root": model_name, "parent": None, "max_model_len": max_model_len}]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__, "server": "bistat serve",
                             **(engine_description or {})})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                       type_=type_, status=exc.status_code),
                            status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed", exc_info=exc)
        return JSONResponse(error_body(str(exc), type_="InternalServerError", status=500),
                            status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.stop()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


def uvicorn_config(app: Starlette, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn settings for bistat serve: no access log, h11, asyncio, one worker."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", loop="asyncio", http="h11", timeout_keep_alive=30,
                          backlog=4096)


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Run ``app`` in the foreground until SIGINT/SIGTERM (uvicorn's graceful shutdown)."""
    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level)).run()


class BackgroundServer:
    """Run an app on a free loopback port in a thread (tests, benchmarks, in-process runs).

    >>> with BackgroundServer(app) as srv:  # doctest: +SKIP
    ...     httpx.get(srv.url + "/health")
    """

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
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
