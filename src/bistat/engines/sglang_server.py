"""Engine adapter: one SGLang server per arm (``python -m sglang.launch_server``), driven over its
native HTTP API.

Start-up (:class:`~bistat.engines.server_process.LocalServerEngine`): the server runs with the
arm's environment and arguments in its own process group on a free loopback port, as
``python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port PORT --enable-metrics``
plus ``--disable-radix-cache`` unless the declaration turns prefix caching on (as the vLLM adapter
turns vLLM's off), with NVLink multicast forced off. SGLang's engines start one at a time
(``capabilities.parallel_start`` false): each sizes its KV cache from the GPU memory free when it
starts (sglang/srt/mem_cache/kv_cache_configurator.py, ``_profile_available_bytes``), so servers
starting together on one GPU count each other's allocations and are refused. It is ready when
``GET /health_generate`` answers 200: SGLang 0.5.23 answers 503 until its own warm-up request is
done, then runs a one-token generation through its scheduler per probe and answers once any
output came back, after a second at least and 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds
(20 by default; sglang/srt/entrypoints/http_server.py, ``health_generate``), so a 200 means a
model that generates. Its ``/health`` is the same generation
(``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is true by default), so both probes, at start and
after a pass with failed requests, wait that timeout and more (:func:`health_probe_timeout_s`).
Then ``GET /model_info`` gives the served model's name and ``GET /server_info`` the server's
resolved arguments (0.5.23 still serves the deprecated ``/get_model_info`` and
``/get_server_info``; either is read). A server that exits before it is ready is *refused*, the arm *untested*, naming the setting, when
what stopped it (its root-cause error line, or argparse's error) is a refusal: an argument
argparse rejects, a backend the deterministic mode does not support ("ValueError: Currently only
[...] attention backends are supported for deterministic inference"). A warning is never a
refusal: the flashinfer deterministic arm logs "Currently radix cache is not compatible with
flashinfer attention backend for deterministic inference" and starts. Stop: SIGTERM to the whole
group; SGLang's scheduler and detokenizer processes die of it at once, and the main process's
subprocess watchdog then SIGQUITs it, which kills the tree (itself by SIGKILL); SIGKILL to the
group after the grace period. Its log is kept like vLLM's (``engine_log``).

Requests use the native ``POST /generate`` rather than the OpenAI endpoints, because it alone
carries both exactly (sglang/srt/managers/io_struct.py ``GenerateReqInput``;
sglang/api/v1/api_types.py):

- a prompt goes as ``input_ids`` (token-id prompts) or ``text``; a chat prompt is turned into the
  token ids of SGLang's own chat template by ``POST /tokenize`` with ``messages`` (the template
  its ``/v1/chat/completions`` applies), once per prompt text, and sent as ``input_ids``;
- the answer's ``output_ids`` are the generated ids through the stop token (SGLang trims the stop
  token from the text only), and ``meta_info.output_token_logprobs`` holds one
  ``[logprob, token_id, text]`` triple per output token: the chosen token's logprob as the
  sampler's float32 value, unrounded, with its id, which must equal ``output_ids`` (a
  disagreement is a malformed answer); ``meta_info.output_top_logprobs`` the alternatives
  (``top_logprobs_num``), one row per output token, ``null`` where SGLang had none for that
  position (read as no alternatives). The OpenAI ``/v1/completions`` logprobs name tokens by their text,
  which does not identify a token id.
- ``sampling_params`` states ``temperature``, ``top_p``, ``top_k`` (-1 is SGLang's "off" too),
  ``max_new_tokens``, ``ignore_eos`` and ``sampling_seed`` explicitly, each as the JSON type
  SGLang's schema wants: ``/generate`` refuses (HTTP 400) a key ``SamplingParams`` does not
  define, and an integer field sent as ``1.0`` or ``true`` ("invalid type: floating point
  `1.0`, expected i64": sglang/api/v1/api_types.py, ``decode_SamplingParams``). ``seed`` on
  ``/v1/completions`` is ignored (sgl-project/sglang#15481); ``sampling_seed`` is the native
  field, and SGLang 0.5.23 reads it only under ``--enable-deterministic-inference`` (elsewhere
  sampling draws from torch's generator: sglang/srt/sampling/sampling_batch_info.py).

Batching evidence: ``/metrics`` (``--enable-metrics``) sampled as the vLLM adapter samples vLLM's,
SGLang's names mapped onto the same fields (:data:`bistat.engines.metrics.SGLANG_SAMPLE_NAMES`):
running and queued requests feed ``min_mean_running``; SGLang's *retractions* (decode requests
sent back to the queue when the KV cache is full) stand for vLLM's preemptions in
``max_preemptions`` (absent until the first retraction, read as 0:
:func:`~bistat.engines.metrics.parse_sglang_metrics`). SGLang refreshes its scheduler gauges at
each prefill batch, once per ``--decode-log-interval`` decode steps (40 by default) and when it
falls idle, so a sample reads the last refresh, not the instant. Its token counters include its
start-up warm-up request (8 tokens), not its health checks. Each answer's
``meta_info.num_retractions`` is recorded per request (``preemptions`` in ``responses.jsonl``): a
pass's preemptions are then the larger of the counter's increase and the sum over its requests
(:func:`bistat.analysis.passes.pass_summaries`), since the counter's samples can miss the end of a
pass.

Fingerprint: the versions of sglang, sglang-kernel (import name ``sgl_kernel``), flashinfer-python
and torch in the arm's environment, read from package metadata by ``python -c`` without importing
them, and SGLang's commit from ``sglang/_version.py`` (``__commit_id__``, None in the release
wheels); each arm's attention backend, deterministic flag, sampling backend and radix cache as the
running server reports them (``/server_info``, the values after SGLang's own resolution: a
deterministic arm without ``attention_backend`` reports the backend SGLang chose). The GPU is the
runner's fingerprint's, as for vLLM. SGLang is never imported in bistat's process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
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
from bistat.engines.declared import DeclaredContext
from bistat.engines.metrics import parse_sglang_metrics
from bistat.engines.openai_answers import ParsedAnswer
from bistat.engines.openai_http import OpenAIHTTPEngine, workload_conflicts
from bistat.engines.server_process import (
    FORCED_ENV,
    REFUSAL_RE,
    LocalServerEngine,
    inherited_env,
)
from bistat.engines.sglang_args import arg_problems

__all__ = ["SGLangHTTPClient", "SGLangServerEngine", "answer_retractions", "parse_generate_answer",
           "sglang_cli_args"]

#: Server-log lines kept as evidence at every start: attention and sampling backends, the
#: deterministic mode and what SGLang changed for it.
LOG_FINDING_RE = re.compile(
    r"deterministic|batch[ _-]?invariant|attention[ _]backend|sampling[ _]backend|"
    r"radix[ _]cache|num_splits|Falling back to", re.IGNORECASE)
#: SGLang's refusals: argparse's, and its resolution's ValueErrors for settings it cannot run
#: (sglang/srt/arg_groups/overrides.py: "Currently only [...] attention backends are supported
#: for deterministic inference, but you explicitly specified 'X'.").
SGLANG_REFUSAL_RE = re.compile(REFUSAL_RE.pattern + r"|are supported for|is only supported|"
                               r"only supports", re.IGNORECASE)
#: Defaults a declaration may override.
DEFAULT_ENV = {"DO_NOT_TRACK": "1"}
#: The server's resolved arguments recorded at every start (``/server_info``).
SERVER_INFO_KEYS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend",
                    "enable_deterministic_inference", "sampling_backend", "disable_radix_cache",
                    "tp_size", "dtype", "mem_fraction_static", "max_running_requests",
                    "chunked_prefill_size", "page_size", "kv_cache_dtype", "random_seed")
#: SGLang 0.5.23's wait for its health check's generation when the environment does not set
#: ``SGLANG_HEALTH_CHECK_TIMEOUT`` (sglang/srt/entrypoints/http_server.py, HEALTH_CHECK_TIMEOUT).
HEALTH_CHECK_TIMEOUT_S = 20
#: Seconds a health probe waits beyond the server's own health-check timeout for its answer.
HEALTH_PROBE_MARGIN_S = 10
#: The distributions whose versions are recorded (``sgl_kernel`` is sglang-kernel's import name).
VERSIONED = ("sglang", "sglang-kernel", "flashinfer-python", "torch")

#: Printed as JSON by the arm's Python: the versions of :data:`VERSIONED` from package metadata and
#: SGLang's commit from sglang/_version.py, read with ast; nothing is imported (``import sglang``
#: imports torch and patches transformers).
VERSION_PROBE = """
import ast, importlib.metadata as m, importlib.util, json, os
out = {}
for name in %r:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
commit = None
spec = importlib.util.find_spec("sglang")
if spec is not None and spec.submodule_search_locations:
    path = os.path.join(list(spec.submodule_search_locations)[0], "_version.py")
    try:
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__commit_id__"
                                                    for t in ast.walk(node)):
                commit = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
print(json.dumps({"versions": out, "commit": commit}))
""" % (VERSIONED,)


def health_probe_timeout_s(env: Mapping[str, str]) -> float:
    """How long one ``/health`` or ``/health_generate`` probe of a server with environment
    ``env`` may take: SGLang's own health-check timeout (``SGLANG_HEALTH_CHECK_TIMEOUT``, else
    :data:`HEALTH_CHECK_TIMEOUT_S`), after which it answers 503 itself, plus
    :data:`HEALTH_PROBE_MARGIN_S`.

    >>> health_probe_timeout_s({}), health_probe_timeout_s({"SGLANG_HEALTH_CHECK_TIMEOUT": "60"})
    (30.0, 70.0)
    """
    value = env.get("SGLANG_HEALTH_CHECK_TIMEOUT")
    try:
        seconds = int(value) if value is not None else HEALTH_CHECK_TIMEOUT_S
    except ValueError:  # SGLang itself would not start with it
        seconds = HEALTH_CHECK_TIMEOUT_S
    return float(seconds + HEALTH_PROBE_MARGIN_S)


def sglang_cli_args(args: Mapping[str, Any]) -> list[str]:
    """``{"attention_backend": "fa3", "enable_deterministic_inference": True}`` ->
    ``--attention-backend fa3 --enable-deterministic-inference``.

    SGLang's boolean flags are ``store_true`` (sglang/srt/arg_groups/arg_utils.py), so ``True``
    gives the flag and ``False`` or ``None`` omit it (a flag that takes ``--no-X`` is declared as
    ``no_X = true``); a list gives the flag and its items (``nargs="+"``); a dict is passed as
    JSON (``--json-model-override-args``).

    >>> sglang_cli_args({"tp_size": 2, "disable_cuda_graph": False, "cuda_graph_bs": [1, 8]})
    ['--tp-size', '2', '--cuda-graph-bs', '1', '8']
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _top(row: Any) -> list[tuple[int, float]]:
    """One position's ``output_top_logprobs`` row (``[[logprob, token_id, text], ...]`` or
    null) as ``(token_id, logprob)`` pairs, most likely first."""
    return sorted(((int(e[1]), float(e[0])) for e in row or []), key=lambda p: -p[1])


def parse_generate_answer(data: Any) -> tuple[list[int], str, list[float] | None,
                                               list[list[tuple[int, float]]] | None,
                                               str | None, int | None]:
    """Token ids, text, logprobs, top logprobs, finish reason and prompt length of a ``/generate``
    answer with ``return_logprob`` (see the module docstring).

    A server started with ``--skip-tokenizer-init`` answers without ``text`` (ids only): the text
    is then empty. Raises ``ValueError`` (or ``KeyError``/``TypeError``/``IndexError``) when the
    body is not such an answer: no ``output_ids``, logprob triples whose count or token ids disagree with
    them, or an aborted request (``finish_reason.type == "abort"``, with SGLang's message).

    Examples
    --------
    >>> parse_generate_answer({"text": " Paris", "output_ids": [7, 2], "meta_info": {
    ...     "prompt_tokens": 5, "finish_reason": {"type": "stop", "matched": 2},
    ...     "output_token_logprobs": [[-0.5, 7, None], [-0.25, 2, None]],
    ...     "output_top_logprobs": [[[-0.5, 7, None], [-1.5, 9, None]], [[-0.25, 2, None]]]}})
    ([7, 2], ' Paris', [-0.5, -0.25], [[(7, -0.5), (9, -1.5)], [(2, -0.25)]], 'stop', 5)
    """
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason == "abort":
        raise ValueError(f"the server aborted the request: {finish.get('message')}")
    ids = [int(t) for t in data["output_ids"]]
    entries = meta.get("output_token_logprobs")
    logprobs = top = None
    if entries is not None:
        if [int(e[1]) for e in entries] != ids:
            raise ValueError(f"output_token_logprobs name {len(entries)} token(s) that disagree "
                             f"with the {len(ids)} output_ids")
        logprobs = [float(e[0]) for e in entries]
        rows = meta.get("output_top_logprobs")
        if rows:
            if len(rows) != len(ids):
                raise ValueError(f"{len(rows)} output_top_logprobs rows for {len(ids)} tokens")
            top = [_top(row) for row in rows]
    text = data.get("text", "")  # absent with --skip-tokenizer-init: ids only
    if not isinstance(text, str):
        raise ValueError("the answer's text is not a string")
    n_prompt = meta.get("prompt_tokens")
    return ids, text, logprobs, top, reason, None if n_prompt is None else int(n_prompt)


def answer_retractions(data: Any) -> int | None:
    """How often SGLang retracted this request (sent it back to the queue, its KV cache freed, to
    be prefilled and decoded again): ``meta_info.num_retractions``, which SGLang 0.5.23 sets in
    every ``/generate`` answer (srt/managers/tokenizer_manager.py, from the scheduler's
    ``req.retraction_count``); None where the answer has no such count.

    >>> answer_retractions({"meta_info": {"num_retractions": 2}})
    2
    >>> answer_retractions({"meta_info": {}}) is None
    True
    """
    value = data["meta_info"].get("num_retractions")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"meta_info.num_retractions is {value!r}, not a count")
    return value


class SGLangHTTPClient(OpenAIHTTPEngine):
    """SGLang's native API at ``base_url``: ``/generate`` for requests, SGLang's metric names,
    ``/model_info`` and ``/server_info`` at start, ``/flush_cache`` to empty its radix cache.
    The retry policy, concurrency and metrics sampling are :class:`OpenAIHTTPEngine`'s."""

    capabilities = EngineCapabilities(parallel_start=True, prefix_cache_reset=True)

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        kwargs.setdefault("kind", "sglang-server")
        super().__init__(base_url, **kwargs)
        self.server_info: dict[str, Any] = {}
        self.model_info: dict[str, Any] = {}
        self._chat_ids: dict[str, list[int]] = {}

    def _get_json(self, client: httpx.Client, *paths: str) -> dict[str, Any]:
        """The JSON object the first of ``paths`` that exists answers (SGLang 0.5.23 serves the
        current name and the deprecated ``/get_...`` one)."""
        for path in paths:
            resp = self._send(client, "GET", path, error=EngineStartError)
            if resp.status_code == 404:
                continue
            if resp.status_code != 200:
                raise EngineStartError(f"{self.base_url}{path} answered HTTP {resp.status_code}: "
                                       f"{resp.text[:200]!r}")
            try:
                data = resp.json()
            except ValueError as exc:
                raise EngineStartError(f"{self.base_url}{path}: not JSON ({exc}); is this an "
                                       "SGLang server?") from exc
            if not isinstance(data, dict):
                raise EngineStartError(f"{self.base_url}{path}: not a JSON object")
            return data
        raise EngineStartError(f"{self.base_url} has none of {list(paths)}; is this an SGLang "
                               "server?")

    def start(self) -> EngineInfo:
        """Read the served model (``/model_info``) and the resolved arguments (``/server_info``)."""
        self._check_url()
        try:
            with httpx.Client(base_url=self.base_url, timeout=self.start_timeout_s,
                              headers=self._headers) as client:
                self.model_info = self._get_json(client, "/model_info", "/get_model_info")
                self.server_info = self._get_json(client, "/server_info", "/get_server_info")
        except httpx.HTTPError as exc:
            raise EngineStartError(f"cannot reach the SGLang server at {self.base_url} "
                                   f"({type(exc).__name__}: {exc})") from exc
        served = self.model_info.get("served_model_name") or self.model_info.get("model_path")
        if not isinstance(served, str):
            raise EngineStartError(f"{self.base_url}/model_info names no model: "
                                   f"{json.dumps(self.model_info)[:200]}")
        self.model = served
        self._server_version = (str(self.server_info["version"])
                                if self.server_info.get("version") is not None else None)
        return EngineInfo(kind=self.kind, version=self._server_version or "unknown",
                          args={"url": self.base_url, "model": self.model,
                                "retries": self.retries})

    def reported(self) -> dict[str, Any]:
        """The server's resolved arguments that :data:`SERVER_INFO_KEYS` names (absent: null)."""
        return {k: self.server_info.get(k) for k in SERVER_INFO_KEYS}

    # -- requests ------------------------------------------------------------------------------
    def generate_path(self, req: GenerationRequest) -> str:
        return "/generate"

    def request_body(self, req: GenerationRequest) -> dict[str, Any]:
        """The ``/generate`` body for ``req`` (sampling parameters always explicit)."""
        body: dict[str, Any] = {   # each value as the JSON type SGLang's schema wants
            "sampling_params": {
                "max_new_tokens": int(req.max_tokens), "temperature": float(req.temperature),
                "top_p": float(req.top_p), "top_k": int(req.top_k),
                "ignore_eos": bool(req.ignore_eos),
                "sampling_seed": None if req.seed is None else int(req.seed)},
            "return_logprob": True, "top_logprobs_num": max(1, int(req.logprobs)),
            "stream": False,
        }
        if req.chat:
            if not isinstance(req.prompt, str):
                raise ValueError("a chat request needs a text prompt")
            if req.prompt not in self._chat_ids:
                raise ValueError("the chat prompt was not tokenized before the pass")
            body["input_ids"] = self._chat_ids[req.prompt]
        elif isinstance(req.prompt, str):
            body["text"] = req.prompt
        else:
            body["input_ids"] = [int(t) for t in req.prompt]
        return body

    def parse_answer(self, data: Any, req: GenerationRequest) -> ParsedAnswer:
        """:func:`parse_generate_answer`'s fields, and the request's retractions as its
        preemptions (:func:`answer_retractions`)."""
        return ParsedAnswer(*parse_generate_answer(data), preemptions=answer_retractions(data))

    def parse_metrics(self, text: str, t: float) -> MetricsSample:
        return parse_sglang_metrics(text, t=t, model_name=self.model)

    def tokenize_chat(self, prompts: Sequence[str]) -> None:
        """Token ids of each chat prompt not seen yet under SGLang's chat template (``POST
        /tokenize`` with ``messages``; one request per prompt, kept for later passes).

        Raises
        ------
        EngineError
            The server could not tokenize a prompt.
        """
        todo = [p for p in dict.fromkeys(prompts) if p not in self._chat_ids]
        if not todo:
            return
        with httpx.Client(base_url=self.base_url, timeout=self.request_timeout_s,
                          headers=self._headers) as client:
            for prompt in todo:
                body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                        "add_generation_prompt": True}
                try:
                    resp = self._send(client, "POST", "/tokenize", json=body)
                except httpx.HTTPError as exc:
                    raise EngineError(f"{self.base_url}/tokenize: {type(exc).__name__}: {exc}"
                                      ) from exc
                try:
                    if resp.status_code != 200:
                        raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]!r}")
                    self._chat_ids[prompt] = [int(t) for t in resp.json()["tokens"]]
                except (ValueError, KeyError, TypeError) as exc:
                    raise EngineError(f"{self.base_url}/tokenize could not apply the chat "
                                      f"template ({type(exc).__name__}: {exc})") from exc

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        """Tokenize the chat prompts not seen yet (first pass only), then run the pass."""
        self.tokenize_chat([r.prompt for r in requests if r.chat and isinstance(r.prompt, str)])
        super().run_pass(requests, concurrency=concurrency, on_result=on_result,
                         on_metrics=on_metrics)

    # -- optional capabilities -----------------------------------------------------------------
    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        raise EngineUnsupported("sglang-server: prompt logprobs are not implemented for SGLang "
                                "(its input_token_logprobs are not read by bistat)")

    def reset_prefix_cache(self) -> bool:
        """Empty SGLang's radix cache (``POST /flush_cache``); False when the server refused
        (it does while requests run) or has no such endpoint."""
        try:
            with httpx.Client(base_url=self.base_url, timeout=self.start_timeout_s,
                              headers=self._headers) as client:
                resp = self._send(client, "POST", "/flush_cache")
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}/flush_cache: {type(exc).__name__}: {exc}") from exc
        return resp.status_code == 200


class SGLangServerEngine(DeclaredContext, LocalServerEngine):
    """Start an SGLang server for one arm and drive it over its native API (module docstring).

    Parameters
    ----------
    model : str
        ``--model-path``: a local folder or a Hugging Face id.
    args : mapping
        Further ``sglang.launch_server`` arguments (:func:`sglang_cli_args`).
    env : mapping
        The arm's environment variables, on top of this process's environment.
    command : sequence of str or None
        The server command before ``--model-path``: ``python -m sglang.launch_server`` with
        ``python`` by default; tests point it at the stand-in.
    python : str
        Interpreter of the arm's environment: runs the server and the version probe.
    enable_prefix_caching : bool
        SGLang's radix cache; off (``--disable-radix-cache``) unless the declaration turns it on.
    health_timeout_s : float
        Longest wait for ``/health_generate`` (model load and CUDA-graph capture: minutes).
    stop_grace_s : float
        Wait after SIGTERM before SIGKILL.
    log_path : path or None
        Where the server's output goes (a temporary file by default); kept after ``stop``.
    http : dict
        Keyword arguments for :class:`SGLangHTTPClient` (retries, request_timeout_s, ...).
    """

    kind = "sglang-server"
    CONTEXT_ARG = "context_length"
    CONTEXT_ENGINE = "SGLang"
    #: one server starts at a time (see the module docstring: SGLang sizes its KV cache from the
    #: GPU memory free at its start)
    capabilities = EngineCapabilities(local_gpu=True, default_memory_fraction=0.9,
                                      memory_fraction_arg="mem_fraction_static", engine_log=True,
                                      prefix_cache_reset=True, parallel_start=False)
    engine_name = "SGLang"
    install_hint = "install SGLang (pip install 'bistat[sglang]') or set the engine's command"
    ready_path = "/health_generate"
    health_path = "/health"
    stop_signal = signal.SIGTERM
    refusal_re = SGLANG_REFUSAL_RE
    log_finding_re = LOG_FINDING_RE
    log_prefix = "bistat-sglang-"

    #: declaration keys that configure bistat's handling rather than the server
    ADAPTER_KEYS = ("command", "python", "health_timeout_s", "stop_grace_s", "log_path",
                    "enable_prefix_caching")

    def __init__(self, model: str, *, args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, command: Sequence[str] | None = None,
                 python: str = sys.executable, host: str = "127.0.0.1", port: int | None = None,
                 enable_prefix_caching: bool = False, health_timeout_s: float = 900.0,
                 stop_grace_s: float = 30.0, log_path: str | os.PathLike | None = None,
                 http: Mapping[str, Any] | None = None) -> None:
        self._init_server(model, env=env, http=http, host=host, port=port,
                          health_timeout_s=health_timeout_s, stop_grace_s=stop_grace_s,
                          log_path=log_path)
        self.args = dict(args or {})
        self.ready_probe_timeout_s = self.health_probe_timeout_s = health_probe_timeout_s(
            self.child_env())
        self.python = python
        self.command = list(command) if command else [python, "-m", "sglang.launch_server"]
        self.enable_prefix_caching = enable_prefix_caching
        self.client: SGLangHTTPClient | None = None
        self.versions: dict[str, str | None] = {}

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """Argument names SGLang's ``launch_server`` does not accept (:mod:`.sglang_args`), and
        the HTTP client's settings declared twice with different values."""
        from bistat.engines.declared import chosen_address_problems, number_problems

        return (arg_problems(experiment, cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                + chosen_address_problems(experiment, cls.kind)
                + number_problems(experiment, cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                + workload_conflicts(experiment, cls.kind))

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "SGLangServerEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``; the adapter's own
        keys are taken out, the rest become server flags; ``arm.env`` is the server's
        environment; ``retries`` and ``request_timeout_s`` default to the workload's."""
        args, own, http = cls.split_args(experiment, arm)
        return cls(experiment.engine.model, args=args, env=dict(arm.env), http=http, **own)

    # -- pieces ----------------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """Ours (less ``NOT_INHERITED_ENV``), the defaults, the arm's, then the forced settings."""
        return {**inherited_env(), **DEFAULT_ENV, **self.arm_env, **FORCED_ENV}

    def argv(self, port: int) -> list[str]:
        """The full server command line."""
        flags = ["--model-path", self.model, "--host", self.host, "--port", str(port),
                 "--enable-metrics"]
        if not self.enable_prefix_caching:
            flags.append("--disable-radix-cache")
        return self.command + flags + sglang_cli_args(self.args)

    def probe_versions(self) -> tuple[dict[str, str | None], str | None, str | None]:
        """(versions, commit, problem) in the arm's environment, via ``python -c``."""
        try:
            out = subprocess.run([self.python, "-c", VERSION_PROBE], env=self.child_env(),
                                 capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {}, None, f"version probe failed: {exc}"
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return {}, None, f"version probe failed: {tail}"
        data = json.loads(out.stdout.strip().splitlines()[-1])
        return dict(data["versions"]), data.get("commit"), None

    def _connect(self, base: str) -> SGLangHTTPClient:
        client = SGLangHTTPClient(base, model=None, **self.http_kwargs)
        client.start()
        return client

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> EngineInfo:
        """Start the server and wait until it generates; record what it reports."""
        versions, commit, problem = self.probe_versions()
        argv, _ = self._start_server()
        assert self.client is not None
        self.versions = versions
        version = versions.get("sglang") or self.client._server_version or "unknown"
        self.info = EngineInfo(
            kind=self.kind, version=version, commit=commit,
            args={"argv": argv, "model": self.model, **self.args,
                  "enable_prefix_caching": self.enable_prefix_caching,
                  "log_path": str(self.log_path), "versions": versions,
                  "server_reported": self.client.reported()},
            env={**self.arm_env, **FORCED_ENV},
            log_findings=self.log_findings() + ((problem,) if problem else ()),
            modes=self.logged_modes())
        return self.info

    def logged_modes(self) -> dict[str, Any]:
        """torch.compile and the CUDA graphs as the server's logged ``server_args`` state them
        (:func:`bistat.store.enginelog.engine_modes`); empty when it states none."""
        from bistat.store.enginelog import engine_modes

        modes = engine_modes(self.log_text())
        return {} if modes is None else modes.to_dict()

    def reset_prefix_cache(self) -> bool:
        """Ask the server to empty its radix cache (``/flush_cache``)."""
        if self.client is None:
            raise EngineStartError("sglang-server: reset_prefix_cache() before start()")
        return self.client.reset_prefix_cache()

    def fingerprint(self) -> dict[str, Any]:
        """The engine's own details; the runner adds the machine's (GPUs, driver)."""
        info = self.info
        versions = dict(self.versions)
        if versions.get("sglang") is None and info is not None and info.version != "unknown":
            versions["sglang"] = info.version   # the server's own word where metadata has none
        return {"kind": self.kind, "model": self.model,
                "version": info.version if info else None,
                "commit": info.commit if info else None,
                "versions": versions,
                "server": self.client.reported() if self.client else {},
                "url": self.client.base_url if self.client else None}
