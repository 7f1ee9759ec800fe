"""Engine adapter: ``vllm serve`` started per arm (or attached by URL), driven over HTTP.

Start-up: the server runs in its own process group with the arm's environment on a free loopback
port, with ``--no-enable-prefix-caching`` unless the declaration turns prefix caching on, and
NVLink multicast forced off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``). bistat waits for ``GET /health`` up to a timeout, keeps the server's
log in a file and scans it for batch-invariance and attention-backend lines. A server that exits
before it is healthy is *refused* (``EngineRefused``) when its log says the setting is not
supported, otherwise a start failure (``EngineStartError``); both make the arm *untested*.

A server that dies during a pass (its process exits: vLLM's API server shuts down when its
engine core dies, e.g. of ``torch.OutOfMemoryError``) or no longer answers ``/health`` after a pass
with failed requests is an engine failure: ``run_pass`` raises
:class:`~bistat.engines.base.EngineError` naming the exit code, the root-cause error line of the
log (:func:`last_error_line`) and the log's path, so the runner ends the pass *interrupted*. The
failed requests of a live, healthy server (an HTTP 4xx, or a 500 for one request) stay per-request
failures.

Shutdown: SIGINT to the whole process group, then SIGKILL after a grace period, then wait until
no process of the group is left (so GPU memory is released) — also on errors, on Ctrl-C and at
interpreter exit.

vLLM itself is never imported here: its version and commit come from ``python -c`` run in the
arm's environment.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

from bistat.engines.base import (
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)
from bistat.engines.openai_http import OpenAIHTTPEngine, workload_conflicts, workload_defaults
from bistat.engines.vllm_args import arg_problems

#: Always in the server's environment: NVLink multicast stays off (see ../shared/device/).
FORCED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Defaults a declaration may override.
DEFAULT_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
#: Variables of bistat's own environment that a child does not inherit (an arm may still set
#: them). With ``api_server_count > 1`` vLLM 0.25.0 keeps Prometheus metrics in files under
#: ``PROMETHEUS_MULTIPROC_DIR``: it makes a fresh temporary directory per server unless one is
#: set, and reuses a set one as it is (vllm/v1/metrics/prometheus.py:17-36), so a directory
#: inherited by every arm would carry one arm's counters and gauges into the next.
NOT_INHERITED_ENV = ("PROMETHEUS_MULTIPROC_DIR",)
#: /metrics sampling period (seconds) when the declaration does not set ``metrics_interval_s``
DEFAULT_METRICS_INTERVAL_S = 0.25

#: Server-log lines worth keeping as evidence (batch invariance, attention backend, JIT).
LOG_FINDING_RE = re.compile(
    r"batch[ _-]?invariant|VLLM_BATCH_INVARIANT|attention backend|attn[ _]backend|"
    r"Using \w+ backend|FLASH_ATTN|FLASHINFER|FlashAttention|TRITON_ATTN|JIT-compiled|"
    r"Breakable CUDA graph|preferred_blas_library",
    re.IGNORECASE)
#: Log lines that mean the server refused the requested setting (rather than crashed).
REFUSAL_RE = re.compile(
    r"not supported|unsupported|unrecognized arguments|invalid choice|NotImplementedError|"
    r"is not compatible|requires .* (?:GPU|compute capability)", re.IGNORECASE)

#: A log line naming a Python exception, e.g. vLLM's engine core's
#: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 544.00 MiB ...".
ERROR_LINE_RE = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::\s|:?$)")
#: Exceptions that only report that another process failed; the root cause is logged above them
#: (vLLM 0.25.0's EngineDeadError says "See stack trace (above) for the root cause",
#: vllm/v1/engine/exceptions.py).
WRAPPER_ERROR_RE = re.compile(r"EngineDeadError|EngineGenerateError|BrokenPipeError|"
                              r"Engine core initialization failed|KeyboardInterrupt")
#: Longest error line quoted in an error message.
ERROR_LINE_MAX = 400


def last_error_line(log_text: str, tail: int = 400) -> str | None:
    """The root-cause error line among the last ``tail`` lines of an engine's log.

    The last line naming an exception that is not merely a report of another process's failure
    (``WRAPPER_ERROR_RE``); failing that, the last exception line; None when there is none.

    Examples
    --------
    >>> last_error_line("INFO ok\\n(EngineCore pid=7) ERROR torch.OutOfMemoryError: CUDA out of "
    ...                 "memory.\\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore "
    ...                 "encountered an issue.")
    '(EngineCore pid=7) ERROR torch.OutOfMemoryError: CUDA out of memory.'
    >>> last_error_line("INFO all well") is None
    True
    """
    errors = [line.strip() for line in log_text.splitlines()[-tail:] if ERROR_LINE_RE.search(line)]
    if not errors:
        return None
    causes = [line for line in errors if not WRAPPER_ERROR_RE.search(line)]
    line = (causes or errors)[-1]
    return line if len(line) <= ERROR_LINE_MAX else line[:ERROR_LINE_MAX] + "..."


def read_log(log_path: Path | None) -> str:
    """An engine's log file as text ("" when there is none yet)."""
    if log_path is None or not log_path.exists():
        return ""
    return log_path.read_text(errors="replace")


def gone_error(who: str, what: str, code: int | None, log_path: Path | None) -> EngineError:
    """The error for an engine process that is gone: who, what happened, the exit code, the
    root-cause line of its log (:func:`last_error_line`) and the log's path."""
    line = last_error_line(read_log(log_path))
    how = f" with code {code}" if code is not None else ""
    cause = f": {line}" if line else ""
    return EngineError(f"the vLLM {who} {what}{how}{cause} (log: {log_path})")


class _ServerDied(Exception):
    """Raised from the result callback to end a pass whose server process exited."""


#: vLLM's version and git commit, printed as JSON by the arm's Python. The commit lives in
#: ``vllm._version.__commit_id__`` (vcs-versioning; 'gdd10e03f9' for 0.25.0), older builds had
#: ``vllm.__commit__``.
VERSION_PROBE = ("import json, vllm\n"
                 "try:\n    from vllm._version import __commit_id__ as c\n"
                 "except ImportError:\n    c = getattr(vllm, '__commit__', None)\n"
                 "print(json.dumps({'version': vllm.__version__, 'commit': c}))")

_LIVE: "weakref.WeakSet[VLLMServerEngine]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # interpreter exit (including after Ctrl-C): no orphaned servers
    for engine in list(_LIVE):
        engine.stop()


def cli_args(args: Mapping[str, Any]) -> list[str]:
    """``{"max_num_seqs": 256, "enforce_eager": True}`` -> ``--max-num-seqs 256 --enforce-eager``.

    ``False`` gives ``--no-FLAG``; dicts and lists are passed as JSON (vLLM's convention for
    ``--compilation-config`` and the like); ``None`` omits the flag.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def inherited_env() -> dict[str, str]:
    """This process's environment without ``NOT_INHERITED_ENV``: the base of a child's."""
    return {k: v for k, v in os.environ.items() if k not in NOT_INHERITED_ENV}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux /proc; zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            pids.append(int(entry))
    return pids


class VLLMServerEngine:
    """Start ``vllm serve MODEL`` for one arm (or attach to ``url``) and drive it over HTTP.

    Parameters
    ----------
    model : str
        Model path or Hugging Face id given to ``vllm serve`` (and the served model name).
    args : mapping
        Extra ``vllm serve`` arguments (``cli_args`` turns them into flags).
    env : mapping
        The arm's environment variables, on top of this process's environment.
    url : str or None
        Attach to this already-running server instead of starting one.
    command : sequence of str
        The server command before the model: ``("vllm", "serve")`` by default; tests point it at
        a script that starts ``bistat serve``.
    python : str
        Interpreter of the arm's environment, used for the version probe.
    enable_prefix_caching : bool
        Off unless the declaration turns it on (prefix caching can make logprobs order-dependent).
    tensor_parallel_size : int or None
        ``--tensor-parallel-size``.
    health_timeout_s : float
        Longest wait for ``/health`` (vLLM compiles at start: minutes).
    stop_grace_s : float
        Wait after SIGINT before SIGKILL.
    log_path : path or None
        Where the server's output goes (a temporary file by default); kept after ``stop``.
    http : dict
        Keyword arguments for ``OpenAIHTTPEngine`` (retries, backoff_s, request_timeout_s, ...).
    """

    kind = "vllm-server"
    capabilities = EngineCapabilities(local_gpu=True, default_memory_fraction=0.9, engine_log=True,
                                      prompt_logprobs=True, prefix_cache_reset=True)

    def __init__(self, model: str, *, args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, url: str | None = None,
                 command: Sequence[str] = ("vllm", "serve"), python: str = sys.executable,
                 host: str = "127.0.0.1", port: int | None = None,
                 enable_prefix_caching: bool = False, tensor_parallel_size: int | None = None,
                 health_timeout_s: float = 900.0, stop_grace_s: float = 30.0,
                 log_path: str | os.PathLike | None = None,
                 http: Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.args = dict(args or {})
        self.arm_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.url = url
        self.command = list(command)
        self.python = python
        self.host = host
        self.port = port
        self.enable_prefix_caching = enable_prefix_caching
        self.tensor_parallel_size = tensor_parallel_size
        self.health_timeout_s = health_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_path = Path(log_path) if log_path else None
        # Sample /metrics every 0.25 s unless declared: a pass of a few seconds sampled once a
        # second under-reads the running batch (the fixture run's lesson, docs/STUDIES.md).
        self.http_kwargs = {"metrics_interval_s": DEFAULT_METRICS_INTERVAL_S, **dict(http or {})}
        self.proc: subprocess.Popen | None = None
        self.client: OpenAIHTTPEngine | None = None
        self.info: EngineInfo | None = None
        self._log_fh = None

    #: declaration keys that configure bistat's handling rather than ``vllm serve``
    ADAPTER_KEYS = ("url", "command", "python", "health_timeout_s", "stop_grace_s", "log_path",
                    "enable_prefix_caching", "tensor_parallel_size")
    HTTP_KEYS = ("retries", "backoff_s", "max_retry_wait_s", "request_timeout_s",
                 "metrics_interval_s")

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """Argument names no supported vLLM's ``vllm serve`` accepts (:mod:`.vllm_args`), and
        the HTTP client's settings declared twice with different values
        (:func:`~bistat.engines.openai_http.workload_conflicts`)."""
        return (arg_problems(experiment, "server", cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                + workload_conflicts(experiment, "vllm-server"))

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "VLLMServerEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``; the adapter's own
        keys (``ADAPTER_KEYS``, ``HTTP_KEYS``) are taken out, the rest become ``vllm serve``
        flags; ``arm.env`` is the server's environment. The HTTP client's ``retries`` and
        ``request_timeout_s`` are the workload's where the arguments do not set them."""
        args = {**dict(experiment.engine.args), **dict(arm.args)}
        own = {k: args.pop(k) for k in cls.ADAPTER_KEYS if k in args}
        http = {**workload_defaults(experiment),
                **{k: args.pop(k) for k in cls.HTTP_KEYS if k in args}}
        if "command" in own:
            own["command"] = tuple(own["command"])
        return cls(experiment.engine.model, args=args, env=dict(arm.env), http=http, **own)

    # -- pieces ------------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """The server's environment: ours (less ``NOT_INHERITED_ENV``), the defaults, the arm's,
        then the forced settings."""
        return {**inherited_env(), **DEFAULT_ENV, **self.arm_env, **FORCED_ENV}

    def argv(self, port: int) -> list[str]:
        """The full server command line."""
        flags = ["--host", self.host, "--port", str(port)]
        flags.append("--enable-prefix-caching" if self.enable_prefix_caching
                     else "--no-enable-prefix-caching")
        if self.tensor_parallel_size is not None:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return self.command + [self.model] + flags + cli_args(self.args)

    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_findings(self) -> tuple[str, ...]:
        """Server-log lines about batch invariance, the attention backend and JIT compiles."""
        return tuple(line.strip() for line in self.log_text().splitlines()
                     if LOG_FINDING_RE.search(line))

    def logged_modes(self) -> dict[str, Any]:
        """The compilation / CUDA-graph modes the server's log states (its engine core logs its
        configuration before it is healthy); empty when it states none."""
        from bistat.store.enginelog import engine_modes

        modes = engine_modes(self.log_text())
        return {} if modes is None else modes.to_dict()

    def probe_version(self) -> tuple[str, str | None, str | None]:
        """(version, commit, problem) of vLLM in the arm's environment, via ``python -c``."""
        try:
            out = subprocess.run([self.python, "-c", VERSION_PROBE], env=self.child_env(),
                                 capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return "unknown", None, f"version probe failed: {exc}"
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return "unknown", None, f"version probe failed: {tail}"
        data = json.loads(out.stdout.strip().splitlines()[-1])
        return str(data["version"]), data.get("commit"), None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EngineInfo:
        """Start (or attach to) the server and wait until it is healthy and serves the model."""
        if self.url is not None:
            self.client = OpenAIHTTPEngine(self.url, model=None, kind=self.kind,
                                           **self.http_kwargs)
            info = self.client.start()
            self.info = EngineInfo(kind=self.kind, version=info.version,
                                   args={"url": self.url, **self.args}, env=self.arm_env)
            return self.info
        version, commit, problem = self.probe_version()
        port = self.port or _free_port(self.host)
        base = f"http://{self.host}:{port}"
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="bistat-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_fh = open(self.log_path, "ab")
        argv = self.argv(port)
        try:
            self.proc = subprocess.Popen(argv, env=self.child_env(), stdout=self._log_fh,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            self._close_log()
            raise EngineStartError(f"cannot run {argv[0]!r}: {exc}; install vLLM "
                                   f"(pip install 'bistat[vllm]') or set the engine's command") from exc
        _LIVE.add(self)
        try:
            self._wait_healthy(base)
            self.client = OpenAIHTTPEngine(base, model=self.model, kind=self.kind,
                                           **self.http_kwargs)
            served = self.client.start()
        except BaseException:  # includes KeyboardInterrupt: never leave a server behind
            self.stop()
            raise
        if version == "unknown" and served.version != "unknown":
            version = served.version
        findings = self.log_findings() + ((problem,) if problem else ())
        self.info = EngineInfo(
            kind=self.kind, version=version, commit=commit,
            args={"argv": argv, "model": self.model, **self.args,
                  "enable_prefix_caching": self.enable_prefix_caching,
                  "tensor_parallel_size": self.tensor_parallel_size,
                  "log_path": str(self.log_path)},
            env={**self.arm_env, **FORCED_ENV}, log_findings=findings,
            modes=self.logged_modes())
        return self.info

    def _wait_healthy(self, base: str) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self._raise_exited(code)
                try:
                    if client.get(base + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"the server at {base} did not become healthy within "
                        f"{self.health_timeout_s:g} s (log: {self.log_path}); raise "
                        f"health_timeout_s or read the log")
                time.sleep(0.25)

    def _raise_exited(self, code: int) -> None:
        tail = self.log_text().splitlines()[-20:]
        refusal = [line for line in tail if REFUSAL_RE.search(line)]
        if refusal:
            raise EngineRefused(f"the server refused the setting (exit code {code}): "
                                f"{refusal[-1].strip()} (log: {self.log_path})")
        last = tail[-1].strip() if tail else "no output"
        raise EngineStartError(f"the server exited with code {code} before it was healthy: "
                               f"{last} (log: {self.log_path})")

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        """Prefill logprobs of ``continuation`` (vLLM's ``prompt_logprobs``), via the HTTP client."""
        if self.client is None:
            raise EngineStartError("vllm-server: prompt_logprobs() before start()")
        return self.client.prompt_logprobs(request, continuation)

    def reset_prefix_cache(self) -> bool:
        """Ask the server to drop its prefix cache (vLLM serves the endpoint only with
        ``VLLM_SERVER_DEV_MODE=1``); False when it has no such endpoint."""
        if self.client is None:
            raise EngineStartError("vllm-server: reset_prefix_cache() before start()")
        return self.client.reset_prefix_cache()

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        """Run one pass over HTTP; a request that fails while the server lives is a failed result.

        Raises
        ------
        EngineError
            The server process had exited before the pass, exited during it (the pass ends at
            the first failed request seen after the exit; the results received before are
            delivered, the rest are not reported), or no longer answers ``GET /health`` after a
            pass in which requests failed.
        """
        if self.client is None:
            raise EngineStartError("call start() before run_pass()")
        if not self.alive():
            raise self._died("had exited before the pass")
        failed = 0

        def checked(result: GenerationResult) -> None:
            nonlocal failed
            if result.error is not None:
                if not self.alive():  # not this request's failure: the server is gone
                    raise _ServerDied
                failed += 1
            on_result(result)

        try:
            self.client.run_pass(requests, concurrency=concurrency, on_result=checked,
                                 on_metrics=on_metrics)
        except _ServerDied:
            raise self._died("exited during the pass") from None
        if not self.alive():
            raise self._died("exited during the pass")
        if failed:
            problem = self._health_problem()
            if problem is not None:
                raise EngineError(f"{failed} request(s) failed and the server at "
                                  f"{self.client.base_url} {problem} (log: {self.log_path})")

    def _health_problem(self) -> str | None:
        """None when ``GET /health`` answers 200, else what went wrong, in words."""
        assert self.client is not None
        try:
            resp = httpx.get(self.client.base_url.rstrip("/") + "/health", timeout=10.0)
        except httpx.HTTPError as exc:
            return f"does not answer /health ({type(exc).__name__}: {exc})"
        if resp.status_code != 200:
            return f"answers /health with HTTP {resp.status_code}"
        return None

    def _died(self, what: str) -> EngineError:
        """The error for a server process that is gone: exit code, log's root cause, log path."""
        return gone_error("server", what, self.proc.poll() if self.proc is not None else None,
                          self.log_path)

    def fingerprint(self) -> dict[str, Any]:
        info = self.info
        return {"kind": self.kind, "model": self.model,
                "version": info.version if info else None,
                "commit": info.commit if info else None,
                "url": self.client.base_url if self.client else self.url}

    def alive(self) -> bool:
        """Whether the started server process is still running (always True when attached)."""
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        """SIGINT the server's process group, SIGKILL after the grace period, reap everything."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            pgid = proc.pid  # start_new_session: the leader's pid is the group id
            self._signal_group(pgid, signal.SIGINT)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + self.stop_grace_s
            while _group_pids(pgid) and time.monotonic() < deadline:  # workers shutting down
                time.sleep(0.1)
            self._signal_group(pgid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 30
            while _group_pids(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._close_log()

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _close_log(self) -> None:
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> "VLLMServerEngine":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
