"""One inference server process per arm, on this machine: the lifecycle the ``vllm-server``,
``sglang-server`` and ``command-server`` adapters share.

:class:`LocalServerEngine` starts the arm's server (``argv(port)``, ``child_env()``: the adapter
says which) in its own process group on a free loopback port, with its output in a log file kept
after the server stops; waits until ``GET ready_path`` answers 200 (the process exiting first is
a refusal when what stopped it says the setting is not supported, :func:`refusal_line`,
:class:`EngineRefused`, else a start failure, :class:`EngineStartError`; both make the arm
*untested*); drives passes
through an HTTP client the adapter connects (``_connect``: an
:class:`~bistat.engines.openai_http.OpenAIHTTPEngine` or a subclass); and stops the server:
``stop_signal`` to the whole group, SIGKILL after a grace period, then a wait until no process of
the group is left (so GPU memory is released) — also on errors, on Ctrl-C and at interpreter exit.
A ``kill -9`` of ``bistat`` runs none of that: each server has a watchdog that stops its group
once ``bistat`` is gone, and a mark in its environment naming the ``bistat`` process that started
it (:mod:`bistat.engines.lifetime`); the adapter reports the server's process as it starts and as
it is stopped (:meth:`LocalServerEngine.report_processes`), and the runner records both in the run
directory, where ``--resume`` looks for a server still up.

A server that dies during a pass (its process exits) or no longer answers ``health_path`` after a
pass with failed requests is an engine failure: ``run_pass`` raises
:class:`~bistat.engines.base.EngineError` naming the exit code, the root-cause error line of the
log (:func:`last_error_line`) and the log's path, so the runner ends the pass *interrupted*, keeps
the results received and ``--resume`` runs the pass again. The failed requests of a live, healthy
server (an HTTP 4xx, or a 500 for one request) stay per-request failures.
"""

from __future__ import annotations

import abc
import atexit
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

from bistat.engines.lifetime import (
    SERVER_MARK,
    end_watchdog,
    group_pids,
    guard_group,
    owner_mark,
    stop_group,
)
from bistat.engines.base import (
    EngineError,
    EngineInfo,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)

__all__ = ["FORCED_ENV", "NOT_INHERITED_ENV", "DEFAULT_METRICS_INTERVAL_S", "REFUSAL_RE",
           "LocalServerEngine", "cli_args", "free_port", "gone_error", "group_pids",
           "inherited_env", "last_error_line", "read_log", "refusal_line"]

#: Always in a GPU server's environment: NVLink multicast stays off (see ../shared/device/).
FORCED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Variables of bistat's own environment that a child does not inherit (an arm may still set
#: them). With ``api_server_count > 1`` vLLM 0.25.0 keeps Prometheus metrics in files under
#: ``PROMETHEUS_MULTIPROC_DIR``: it makes a fresh temporary directory per server unless one is
#: set, and reuses a set one as it is (vllm/v1/metrics/prometheus.py:17-36), so a directory
#: inherited by every arm would carry one arm's counters and gauges into the next. (SGLang 0.5.23
#: makes a fresh subfolder of a set one: sglang/srt/utils/common.py, set_prometheus_multiproc_dir.)
NOT_INHERITED_ENV = ("PROMETHEUS_MULTIPROC_DIR",)
#: /metrics sampling period (seconds) when the declaration does not set ``metrics_interval_s``
DEFAULT_METRICS_INTERVAL_S = 0.25

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
#: The line argparse prints before it exits with status 2 ("PROG: error: MESSAGE").
ARGPARSE_ERROR_RE = re.compile(r"^\S[^:]*: error: ")


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


def refusal_line(log_text: str, refusal_re: re.Pattern[str] = REFUSAL_RE) -> str | None:
    """The line saying why a server that exited before it was ready refused its setting, or None
    when it did not refuse (it crashed).

    Only what stopped the server can be a refusal: its root-cause error line
    (:func:`last_error_line`) or the error line argparse prints before it exits (``PROG: error:
    ...``), when ``refusal_re`` matches it. A warning or an informational line never is, whatever
    it says: SGLang 0.5.23 logs "Currently radix cache is not compatible with flashinfer attention
    backend for deterministic inference" as a warning and goes on starting, so a crash after it
    (a module missing in the scheduler) is a start failure, not a refused setting.

    Examples
    --------
    >>> refusal_line("[2026-12-07 10:00:00] Currently radix cache is not compatible with "
    ...              "flashinfer attention backend\\nModuleNotFoundError: No module named 'x'") is None
    True
    >>> refusal_line("ValueError: VLLM_BATCH_INVARIANT is not supported on this platform")
    'ValueError: VLLM_BATCH_INVARIANT is not supported on this platform'
    >>> refusal_line("usage: launch_server.py [-h]\\nlaunch_server.py: error: unrecognized "
    ...              "arguments: --no-such-flag")
    'launch_server.py: error: unrecognized arguments: --no-such-flag'
    """
    cause = last_error_line(log_text)
    candidates = ([cause] if cause is not None else []) + [
        line.strip() for line in reversed(log_text.splitlines()[-400:])
        if ARGPARSE_ERROR_RE.search(line)]
    return next((line for line in candidates if refusal_re.search(line)), None)


def read_log(log_path: Path | None) -> str:
    """An engine's log file as text ("" when there is none yet)."""
    if log_path is None or not log_path.exists():
        return ""
    return log_path.read_text(errors="replace")


def gone_error(who: str, what: str, code: int | None, log_path: Path | None, *,
               engine: str = "vLLM") -> EngineError:
    """The error for an engine process that is gone: which engine's ``who`` (server, worker),
    what happened, the exit code, the root-cause line of its log (:func:`last_error_line`) and
    the log's path."""
    line = last_error_line(read_log(log_path))
    how = f" with code {code}" if code is not None else ""
    cause = f": {line}" if line else ""
    return EngineError(f"the {engine} {who} {what}{how}{cause} (log: {log_path})")


class _ServerDied(Exception):
    """Raised from the result callback to end a pass whose server process exited."""


_LIVE: "weakref.WeakSet[LocalServerEngine]" = weakref.WeakSet()


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


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalServerEngine(abc.ABC):
    """The process lifecycle of an adapter that starts one HTTP server per arm (see the module
    docstring). A subclass sets the class attributes, calls :meth:`_init_server` from its
    constructor and provides ``argv(port)``, ``child_env()`` and ``_connect(base_url)`` (a started
    HTTP client with ``run_pass`` and ``base_url``); :meth:`_start_server` then starts the process,
    waits until it is ready and connects."""

    kind = "local-server"
    #: the engine in messages ("the vLLM server exited ...")
    engine_name = "server"
    #: what to install (or set) when the command cannot be run
    install_hint = "set the engine's command"
    #: the path answered 200 once the server serves requests
    ready_path = "/health"
    #: the path asked after a pass with failed requests: does the server still answer?
    health_path = "/health"
    #: seconds one ``ready_path`` probe, and one ``health_path`` probe, may take to be answered
    ready_probe_timeout_s = 5.0
    health_probe_timeout_s = 10.0
    #: the signal that asks the server's process group to shut down
    stop_signal: int = signal.SIGINT
    #: the refusal lines of this server's log (:data:`REFUSAL_RE`)
    refusal_re: re.Pattern[str] = REFUSAL_RE
    #: the log lines kept as evidence at every start (None: none)
    log_finding_re: re.Pattern[str] | None = None
    #: prefix of the temporary log file's name
    log_prefix = "bistat-server-"
    #: declaration keys that configure bistat's handling rather than the server
    ADAPTER_KEYS: tuple[str, ...] = ()
    #: declaration keys for the HTTP client
    HTTP_KEYS: tuple[str, ...] = ("retries", "backoff_s", "max_retry_wait_s", "request_timeout_s",
                                  "metrics_interval_s")

    @classmethod
    def split_args(cls, experiment: Any, arm: Any
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``engine.args`` overridden by ``arm.args``, split into (the server's arguments, the
        adapter's own keys, the HTTP client's keywords: the workload's ``retries`` and
        ``request_timeout_s`` where the arguments do not set them); a ``command`` as a tuple."""
        from bistat.engines.http_workload import workload_defaults

        args = {**dict(experiment.engine.args), **dict(arm.args)}
        own = {k: args.pop(k) for k in cls.ADAPTER_KEYS if k in args}
        http = {**workload_defaults(experiment),
                **{k: args.pop(k) for k in cls.HTTP_KEYS if k in args}}
        if "command" in own and not isinstance(own["command"], str):
            own["command"] = tuple(own["command"])
        return args, own, http

    def _init_server(self, model: str, *, env: Mapping[str, str] | None,
                     http: Mapping[str, Any] | None, host: str, port: int | None,
                     health_timeout_s: float, stop_grace_s: float,
                     log_path: str | os.PathLike | None) -> None:
        """What every adapter's server has: the model, the arm's environment, the HTTP client's
        settings (``/metrics`` sampled every :data:`DEFAULT_METRICS_INTERVAL_S` unless declared:
        a pass of a few seconds sampled once a second under-reads the running batch), and the
        process's address, timeouts and log."""
        self.model = model
        self.arm_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.http_kwargs = {"metrics_interval_s": DEFAULT_METRICS_INTERVAL_S, **dict(http or {})}
        self.info: EngineInfo | None = None
        self.host = host
        self.port = port
        self.health_timeout_s = health_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.client: Any = None
        self._log_fh: Any = None
        #: the log is a temporary file this adapter made (no ``log_path`` declared)
        self.log_temporary = False
        self._watchdog: subprocess.Popen | None = None
        self._report: Callable[[Mapping[str, Any]], None] | None = None
        self._started: dict[str, Any] | None = None

    def report_processes(self, report: Callable[[Mapping[str, Any]], None]) -> None:
        """Call ``report`` with the server's process as it starts (``state = "started"``: its
        PID, process group, start time and the machine's boot id,
        :func:`bistat.engines.lifetime.process_identity`; its command line; its watchdog's PID;
        the signal and grace period that stop it) and once it is stopped (``state =
        "stopped"``)."""
        self._report = report

    # -- what each adapter provides -------------------------------------------------------------
    @abc.abstractmethod
    def argv(self, port: int) -> list[str]:
        """The server's command line, listening on ``port``."""

    @abc.abstractmethod
    def child_env(self) -> dict[str, str]:
        """The server process's whole environment."""

    @abc.abstractmethod
    def _connect(self, base: str) -> Any:
        """A started HTTP client of the server at ``base`` (with ``run_pass`` and ``base_url``)."""

    # -- the log ---------------------------------------------------------------------------------
    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_findings(self) -> tuple[str, ...]:
        """The server-log lines ``log_finding_re`` keeps (backend, batch invariance, ...)."""
        if self.log_finding_re is None:
            return ()
        return tuple(line.strip() for line in self.log_text().splitlines()
                     if self.log_finding_re.search(line))

    # -- lifecycle -------------------------------------------------------------------------------
    def _start_server(self) -> tuple[list[str], str]:
        """Start the server, wait until it is ready and connect: ``(argv, base_url)``. On any
        failure (Ctrl-C included) the server is stopped before the error propagates."""
        port = self.port or free_port(self.host)
        base = f"http://{self.host}:{port}"
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self.log_temporary = True   # the runner removes it once its copy is kept
        self._log_fh = open(self.log_path, "ab")
        argv = self.argv(port)
        try:
            # the mark is not the arm's environment: it names this process, not the setting
            self.proc = subprocess.Popen(argv, env={**self.child_env(), SERVER_MARK: owner_mark()},
                                         stdout=self._log_fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self._close_log()
            raise EngineStartError(f"cannot run {argv[0]!r}: {exc}; {self.install_hint}") from exc
        _LIVE.add(self)
        try:
            self._watchdog, self._started = guard_group(self.proc.pid, argv, self.stop_signal,
                                                        self.stop_grace_s)
            if self._report is not None:
                self._report({"state": "started", **self._started})
            self._wait_ready(base)
            self.client = self._connect(base)
        except BaseException:  # includes KeyboardInterrupt: never leave a server behind
            self.stop()
            raise
        return argv, base

    def _wait_ready(self, base: str) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        with httpx.Client(timeout=self.ready_probe_timeout_s) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self._raise_exited(code)
                try:
                    if client.get(base + self.ready_path).status_code == 200:
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
        text = self.log_text()
        refusal = refusal_line(text, self.refusal_re)
        if refusal is not None:
            raise EngineRefused(f"the server refused the setting (exit code {code}): "
                                f"{refusal} (log: {self.log_path})")
        tail = text.splitlines()[-20:]
        cause = last_error_line(text) or (tail[-1].strip() if tail else "no output")
        raise EngineStartError(f"the server exited with code {code} before it was healthy: "
                               f"{cause} (log: {self.log_path})")

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        """Run one pass over HTTP; a request that fails while the server lives is a failed result.

        Raises
        ------
        EngineError
            The server process had exited before the pass, exited during it (the pass ends at
            the first failed request seen after the exit; the results received before are
            delivered, the rest are not reported), or no longer answers ``health_path`` after a
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
                if not self._alive_after_failure():  # not this request's failure: the server is gone
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
        """None when ``GET health_path`` answers 200, else what went wrong, in words."""
        try:
            resp = httpx.get(self.client.base_url.rstrip("/") + self.health_path,
                             timeout=self.health_probe_timeout_s)
        except httpx.HTTPError as exc:
            return f"does not answer {self.health_path} ({type(exc).__name__}: {exc})"
        if resp.status_code != 200:
            return f"answers {self.health_path} with HTTP {resp.status_code}"
        return None

    def _died(self, what: str) -> EngineError:
        """The error for a server process that is gone: exit code, log's root cause, log path."""
        return gone_error("server", what, self.proc.poll() if self.proc is not None else None,
                          self.log_path, engine=self.engine_name)

    def _alive_after_failure(self, wait_s: float = 1.0) -> bool:
        """Whether the server still runs after a request failed: a dying server closes its
        sockets before its exit status can be read, so a failure seen in that instant waits up to
        ``wait_s`` for the process to end before it counts as the request's own."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return True
        return False

    def alive(self) -> bool:
        """Whether the started server process is still running (always True when attached)."""
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        """``stop_signal`` to the server's process group, SIGKILL after the grace period, reap
        everything (:func:`bistat.engines.lifetime.stop_group`), then its watchdog."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            stop_group(proc.pid, self.stop_signal, self.stop_grace_s, leader=proc)  # pid = pgid
        watchdog, self._watchdog = self._watchdog, None
        end_watchdog(watchdog)
        started, self._started = self._started, None
        if started is not None and self._report is not None:
            self._report({"state": "stopped", "pid": started["pid"], "pgid": started["pgid"]})
        self._close_log()

    def _close_log(self) -> None:
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> "LocalServerEngine":
        self.start()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
