"""Engine adapter: ``vllm.LLM`` in a child process per arm (``vllm_offline_worker``).

The child runs in the arm's environment (so settings such as ``VLLM_BATCH_INVARIANT`` apply from
the first import) and in its own process group; stopping it frees all its GPU memory before the
next arm starts. Requests and results travel as JSON lines over the child's stdin/stdout; the
child's stderr (vLLM's log) goes to a file that is scanned like the server's. The child keeps at
most ``concurrency`` requests in vLLM's engine and adds new ones as others finish, so the batch
composition is continuous-batching like the server's.

A worker that dies (vLLM's engine core hit ``torch.OutOfMemoryError``, say) is an engine failure,
not a run of failed requests: ``run_pass`` delivers the results it received, then raises
:class:`~bistat.engines.base.EngineError` naming the exit code, the root-cause error line of the
worker's log (:func:`bistat.engines.vllm_server.last_error_line`) and the log's path, so the
runner ends the pass *interrupted* and the run stays resumable. A worker silent for
``pass_idle_timeout_s`` is stopped and reported the same way. Requests vLLM itself rejects stay
per-request failures.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

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
from bistat.engines.declared import DeclaredContext
from bistat.engines.lifetime import (SERVER_MARK, end_watchdog, guard_group, owner_mark,
                                     stop_group)
from bistat.store.enginelog import engine_modes
from bistat.engines.vllm_args import arg_problems
from bistat.engines.vllm_server import (
    DEFAULT_ENV,
    FORCED_ENV,
    LOG_FINDING_RE,
    _group_pids,
    gone_error,
    inherited_env,
    read_log,
)

WORKER_MODULE = "bistat.engines.vllm_offline_worker"


class VLLMOfflineEngine(DeclaredContext):
    """``vllm.LLM(model, **engine_args)`` in a child process.

    Parameters
    ----------
    model : str
        Model path or id for ``vllm.LLM``.
    args : mapping
        ``vllm.LLM`` keyword arguments (``tensor_parallel_size`` is passed through).
        ``enable_prefix_caching`` defaults to False and ``disable_log_stats`` to False:
        ``vllm.LLM`` turns stat logging off by default (vllm/entrypoints/llm.py:235-236), and
        without it ``LLM.get_metrics()`` has no running/waiting/preemption counts
        (vllm/v1/engine/llm_engine.py:378-380), so the worker could report only its own
        in-flight count.
    env : mapping
        The arm's environment variables.
    python : str
        Interpreter of the arm's environment.
    start_timeout_s : float
        Longest wait for the engine to load and compile.
    pass_idle_timeout_s : float
        Longest silence from the child during a pass before it is declared hung.
    metrics_interval_s : float
        Seconds between the worker's metrics samples (``LLM.get_metrics()``); 0 samples after
        every engine step (what the probe asks for its short passes, :meth:`every_step_metrics`;
        too costly for throughput passes).
    log_path : path or None
        The child's stderr (a temporary file by default).
    stream_outputs : bool
        Ask vLLM for every request's output at every step (``RequestOutputKind.CUMULATIVE``), which
        gives the time to the first token but makes the worker rebuild every running request's
        output each step; by default only finished outputs (``FINAL_ONLY``, what ``LLM.generate``
        uses: vllm/entrypoints/offline_utils.py:561), and ``t_first_token`` is not recorded.
    """

    kind = "vllm-offline"
    capabilities = EngineCapabilities(local_gpu=True, default_memory_fraction=0.9, engine_log=True,
                                      front_end=False)

    def __init__(self, model: str, *, args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, python: str = sys.executable,
                 start_timeout_s: float = 900.0, pass_idle_timeout_s: float = 600.0,
                 metrics_interval_s: float = 1.0, stop_grace_s: float = 30.0,
                 log_path: str | os.PathLike | None = None, stream_outputs: bool = False) -> None:
        self.model = model
        self.stream_outputs = bool(stream_outputs)
        self.engine_args = {"enable_prefix_caching": False, "disable_log_stats": False,
                            **dict(args or {})}
        self.arm_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.pass_idle_timeout_s = pass_idle_timeout_s
        self.metrics_interval_s = metrics_interval_s
        self.stop_grace_s = stop_grace_s
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.info: EngineInfo | None = None
        self._lines: queue.Queue = queue.Queue()
        self._log_fh = None
        self._watchdog: subprocess.Popen | None = None
        self._report: Callable[[Mapping[str, Any]], None] | None = None
        self._started: dict[str, Any] | None = None

    def report_processes(self, report: Callable[[Mapping[str, Any]], None]) -> None:
        """Call ``report`` with the worker process as it starts and once it is stopped, as a
        server adapter reports its server (:meth:`bistat.engines.server_process.LocalServerEngine
        .report_processes`): the worker holds the GPU as a server does, and a ``kill -9`` of
        ``bistat run`` mid-pass must not leave it computing (its watchdog stops it)."""
        self._report = report

    ADAPTER_KEYS = ("python", "start_timeout_s", "pass_idle_timeout_s", "metrics_interval_s",
                    "stop_grace_s", "log_path", "stream_outputs")

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """Argument names no supported vLLM's ``vllm.LLM`` accepts (:mod:`.vllm_args`)."""
        from bistat.engines.declared import number_problems

        return (arg_problems(experiment, "offline", cls.ADAPTER_KEYS)
                + number_problems(experiment, cls.ADAPTER_KEYS))

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "VLLMOfflineEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``; the adapter's own
        keys (``ADAPTER_KEYS``) are taken out, the rest are ``vllm.LLM`` keyword arguments."""
        args = {**dict(experiment.engine.args), **dict(arm.args)}
        own = {k: args.pop(k) for k in cls.ADAPTER_KEYS if k in args}
        return cls(experiment.engine.model, args=args, env=dict(arm.env), **own)

    def child_env(self) -> dict[str, str]:
        return {**inherited_env(), **DEFAULT_ENV, **self.arm_env, **FORCED_ENV}

    def log_findings(self) -> tuple[str, ...]:
        return tuple(line.strip() for line in read_log(self.log_path).splitlines()
                     if LOG_FINDING_RE.search(line))

    def _logged_modes(self) -> dict[str, Any]:
        modes = engine_modes(read_log(self.log_path))
        return {} if modes is None else modes.to_dict()

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _reader(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)  # end of stream: the child exited

    def _next(self, timeout: float) -> dict[str, Any] | None:
        """The child's next message; None when it exited; ``TimeoutError`` when silent."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        return None if line is None else json.loads(line)

    def start(self) -> EngineInfo:
        """Start the child and load the model; ``EngineRefused``/``EngineStartError`` on failure."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="bistat-vllm-offline-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_fh = open(self.log_path, "ab")
        try:
            # the mark names this process, not the arm's setting (bistat.engines.lifetime)
            argv = [self.python, "-m", WORKER_MODULE]
            self.proc = subprocess.Popen(
                argv, env={**self.child_env(), SERVER_MARK: owner_mark()}, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._log_fh, text=True, bufsize=1,
                start_new_session=True)
        except OSError as exc:
            raise EngineStartError(f"cannot run {self.python!r}: {exc}") from exc
        threading.Thread(target=self._reader, args=(self.proc.stdout,), daemon=True).start()
        try:
            # a watchdog stops the worker's group once this process is gone, as a server's
            self._watchdog, self._started = guard_group(self.proc.pid, argv, signal.SIGINT,
                                                        self.stop_grace_s)
            if self._report is not None:
                self._report({"state": "started", **self._started})
            self._send({"op": "init", "model": self.model, "engine_args": self.engine_args})
            msg = self._next(self.start_timeout_s)
        except TimeoutError:
            self.stop()
            raise EngineStartError(f"vllm.LLM({self.model!r}) did not load within "
                                   f"{self.start_timeout_s:g} s (log: {self.log_path})") from None
        except BaseException:
            self.stop()
            raise
        if msg is None or msg.get("op") != "ready":
            self.stop()
            detail = msg["message"] if msg else "the worker exited without a word"
            if msg is not None and msg.get("refused"):
                raise EngineRefused(f"vLLM refused the setting: {detail} (log: {self.log_path})")
            raise EngineStartError(f"vllm.LLM({self.model!r}) failed to start: {detail} "
                                   f"(log: {self.log_path})")
        self.info = EngineInfo(kind=self.kind, version=msg["version"], commit=msg.get("commit"),
                               args={"model": self.model, **self.engine_args,
                                     "log_path": str(self.log_path)},
                               env={**self.arm_env, **FORCED_ENV},
                               log_findings=self.log_findings(),
                               modes=dict(msg.get("modes") or {}) or self._logged_modes())
        return self.info

    @contextlib.contextmanager
    def every_step_metrics(self) -> Iterator[None]:
        """Within the block, the worker samples metrics after every engine step
        (``metrics_interval_s = 0``), so a pass shorter than the interval still has samples
        while each request runs (the probe's batching evidence); restored afterwards."""
        saved, self.metrics_interval_s = self.metrics_interval_s, 0.0
        try:
            yield
        finally:
            self.metrics_interval_s = saved

    def _died(self, what: str) -> EngineError:
        """The error for a worker that is gone: exit code, the log's root-cause line, the log."""
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        return gone_error("worker", what, code, self.log_path)

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        """Run one pass in the worker; results and metrics reach the callbacks as they arrive.

        Raises
        ------
        EngineError
            The worker exited (before or during the pass) or was silent for
            ``pass_idle_timeout_s`` (then it is stopped); the results received before are
            delivered first, the unanswered requests are not reported.
        """
        if self.proc is None:
            raise EngineStartError("call start() before run_pass()")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if self.proc.poll() is not None:
            raise self._died("had exited before the pass")
        t0 = time.monotonic()
        outstanding = {r.prompt_id for r in requests}
        try:
            self._send({"op": "pass", "requests": [asdict(r) for r in requests],
                        "concurrency": concurrency, "metrics_interval_s": self.metrics_interval_s,
                        "final_only": not self.stream_outputs})
        except (BrokenPipeError, OSError):
            raise self._died("is gone (its input pipe is closed)") from None
        while True:
            try:
                msg = self._next(self.pass_idle_timeout_s)
            except TimeoutError:
                self.stop()
                raise EngineError(f"the vLLM worker was silent for {self.pass_idle_timeout_s:g} s "
                                  f"during a pass and was stopped (log: {self.log_path})") from None
            if msg is None:
                raise self._died("exited mid-pass")
            op = msg.pop("op")
            if op == "pass_done":
                break
            if op == "metrics":
                on_metrics(MetricsSample(**msg))
            elif op == "result":
                outstanding.discard(msg["prompt_id"])
                msg["top_logprobs"] = (None if msg["top_logprobs"] is None else
                                       [[(int(t), float(lp)) for t, lp in pos]
                                        for pos in msg["top_logprobs"]])
                on_result(GenerationResult(**msg))
        for r in requests:  # the worker ended the pass without answering these: a protocol fault
            if r.prompt_id in outstanding:
                now = time.monotonic() - t0
                on_result(GenerationResult(
                    prompt_id=r.prompt_id, token_ids=[], text="", logprobs=None,
                    top_logprobs=None, finish_reason=None, n_prompt_tokens=None, t_submit=now,
                    t_first_token=None, t_done=now, error="no answer from the worker"))

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model,
                "version": self.info.version if self.info else None,
                "commit": self.info.commit if self.info else None}

    def stop(self) -> None:
        """Ask the child to exit, then stop what is left of its process group as a server's is
        stopped (:func:`~bistat.engines.lifetime.stop_group`: SIGINT, SIGKILL after the grace,
        until none of its processes is left); reap everything."""
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid
            try:
                self._send_to(proc, {"op": "exit"})
                proc.wait(timeout=self.stop_grace_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            if _group_pids(pgid):
                stop_group(pgid, signal.SIGINT, self.stop_grace_s, leader=proc)
            proc.wait()
        watchdog, self._watchdog = self._watchdog, None
        end_watchdog(watchdog)
        started, self._started = self._started, None
        if started is not None and self._report is not None:
            self._report({"state": "stopped", "pid": started["pid"], "pgid": started["pgid"]})
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    @staticmethod
    def _send_to(proc: subprocess.Popen, obj: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(obj) + "\n")
        proc.stdin.flush()
        proc.stdin.close()

    def __enter__(self) -> "VLLMOfflineEngine":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
