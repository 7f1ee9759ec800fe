"""``bistat run``: execute a registered experiment and record everything it does.

The runner drives engines through the :class:`bistat.engines.base.Engine` protocol only (no
engine is special-cased) and writes the run directory of ``docs/CONTRACTS.md`` through
:class:`bistat.store.writer.RunWriter`:

* the schedule (:mod:`bistat.core.schedule`): warm-up passes after every engine start (recorded with
  ``kind = "warmup"``, discarded by the analysis), then the declared counted passes per arm,
  interleaved in the declared order; ``schedule.jsonl`` gets a ``start`` and an ``end`` line per
  pass, so the schedule actually executed is on disk;
* engines: every arm's engine is started once and all stay up together when
  ``engines_concurrent`` allows it (:func:`bistat.declare.concurrency.resolve_engines_concurrent`: with ``"auto"``, when the
  arms' GPU memory fractions plus a headroom per engine, :data:`~bistat.declare.concurrency.ENGINE_HEADROOM_FRACTION`, fit
  on one GPU); otherwise one engine is
  up at a time and it is restarted per block of passes. ``run.json`` records which, and
  ``block`` on every schedule line says which engine start a pass ran on;
* each pass: the workload's requests in a per-pass shuffled order
  (:func:`bistat.run.workload.pass_order`), each response appended (flushed, fsync'ed) as it
  arrives, engine metrics appended as they arrive, and a ``passes.jsonl`` summary with the
  batching evidence (:func:`batching_summary`);
* failures: transport retries are the engine's (``workload.retries``); a request that still
  fails is recorded with its ``error`` and counted in the pass's ``n_failed``, and the pass ends
  with ``status = "failed"`` (flagged, not re-run). A request the engine never answered is
  recorded as failed with the error ``"engine returned no result"``;
* an engine that refuses the setting or fails to start: an ``events.jsonl`` line (``refused`` /
  ``start_failed``), engines stopped, data kept, and the run ends *untested*;
* an engine that dies mid-pass (:class:`~bistat.engines.base.EngineError` from ``run_pass``) or a
  Ctrl-C: the pass ends ``status = "interrupted"``, engines are stopped, data is kept and the run
  can be resumed;
* a run directory removed or replaced while the run records (checked before each engine start
  and each pass, and after the last: :meth:`bistat.store.writer.RunWriter.lost`): the run stops
  ``lost``, its files copied from the descriptors it holds into a new directory beside the old
  (:meth:`~bistat.store.writer.RunWriter.rescue`), where its engines' stop events go; the copy
  can be resumed.

Resume (``bistat run --resume RUN_DIR``)
----------------------------------------
The counted passes already ended ``complete`` or ``failed`` are kept; the rest of the schedule
is planned again (:func:`bistat.core.schedule.plan_schedule`): engines start afresh, so warm-ups run
again. A pass that had started but not ended (killed process) gets an ``end`` line with
``status = "interrupted"`` first; it is re-run in full under a new ``seq`` and ``pass_index``.
**The analysis must ignore every pass whose end status is "interrupted"** (and any response of
such a ``seq``): its responses are a partial, biased sample (the fast prompts). ``seq`` is thus
the position in the executed schedule, unique in a run, and equals the planned position when
nothing was interrupted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as _dt
import gzip
import math
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Literal,
    Mapping,
    Protocol,
    Sequence,
)

from bistat import __version__
from bistat.run.batching import batching_summary  # one batching mean, the analysis's too
from bistat.run.gpuload import GpuMonitor, sample_interval_s
from bistat.run.leftovers import server_event, stop_left_servers
from bistat.run.hostload import host_record, host_sample
from bistat.engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineRefused,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
    ServerProcesses,
)
from bistat.declare.concurrency import resolve_engines_concurrent
from bistat.engines.registry import capabilities
from bistat.run.fingerprint import collect_fingerprint
from bistat.store.format import (
    ENGINE_LOGS_DIR,
    command_words,
    logprob_sha256,
    token_sha256,
    utc_now,
)
from bistat.store.writer import RunWriter
from bistat.store.compact import compact
from bistat.store.readers import read_header, read_jsonl
from bistat.core.failures import ErrorGroup, describe_groups, error_groups
from bistat.core.schedule import Block, PlannedPass, plan_schedule
from bistat.run.workload import Prompt, load_prompts, prompts_sha256, requests_for_pass

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Arm, Experiment

__all__ = [
    "EngineFactory",
    "GpuBusyError",
    "NullReporter",
    "PassReport",
    "PlainReporter",
    "Reporter",
    "RichReporter",
    "RunOutcome",
    "ResumeState",
    "SignalInterrupt",
    "batching_summary",
    "busy_gpu",
    "check_gpu",
    "execute_run",
    "new_run_dir",
    "read_resume_state",
    "resume_run",
    "start_run",
    "utc_now",
]

EngineFactory = Callable[["Experiment", "Arm"], Engine]
RunCompletion = Literal["complete", "untested", "incomplete", "interrupted", "lost", "stopped"]



@dataclass(frozen=True)
class RunOutcome:
    """How a run (or a resumed part of it) ended.

    ``status``: ``complete`` (the whole schedule ran), ``untested`` (an engine refused the
    setting or failed to start: the hypothesis could not be tested), ``incomplete`` (an engine
    died mid-pass; resumable), ``interrupted`` (Ctrl-C; resumable), ``stopped`` (every request
    of a pass failed: the pass is recorded ``failed``, the engines are stopped and the run ends
    there; resumable, and the resume runs that pass again), ``lost`` (the run directory was
    removed or replaced while the run recorded: stopped before the next pass, its files copied
    from the descriptors the run held into ``run_dir``, a new directory beside the old;
    ``detail`` says what happened and where each file could be read).

    ``errors``: the failed requests of this execution grouped by their error
    (:func:`bistat.core.failures.error_groups`), in the order each first appeared.
    """

    run_dir: Path
    status: RunCompletion
    passes_run: int
    failed_requests: int
    failed_passes: int
    detail: str | None = None
    errors: tuple[ErrorGroup, ...] = ()


@dataclass(frozen=True)
class PassReport:
    """What the reporter is told when a pass ends (the ``passes.jsonl`` line, typed)."""

    planned: PlannedPass
    status: str
    wall_s: float
    n_requests: int
    n_failed: int
    output_tokens: int
    output_tokens_per_s: float | None


# --------------------------------------------------------------------------------------------
# progress reporting
# --------------------------------------------------------------------------------------------


class Reporter(Protocol):
    """Receives progress; may be called from engine threads (``result``)."""

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None: ...

    def result(self, n_tokens: int, failed: bool) -> None: ...

    def pass_finished(self, report: PassReport) -> None: ...

    def message(self, text: str) -> None: ...


class NullReporter:
    """Reports nothing (library use, tests)."""

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        return None

    def result(self, n_tokens: int, failed: bool) -> None:
        return None

    def pass_finished(self, report: PassReport) -> None:
        return None

    def message(self, text: str) -> None:
        return None


def _pass_line(report: PassReport, position: int, total: int) -> str:
    p = report.planned
    rate = "n/a" if report.output_tokens_per_s is None else f"{report.output_tokens_per_s:.1f} tok/s"
    flag = "" if report.status == "complete" else f" [{report.status}]"
    return (
        f"pass {position}/{total} {p.arm} {p.kind} (seq {p.seq}): {report.n_requests} requests, "
        f"{report.n_failed} failed, {report.wall_s:.2f} s, {rate}{flag}"
    )


class PlainReporter:
    """One line per pass and per message on a text stream (logs, pipes, CliRunner)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._position = 0
        self._total = 0

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        self._position, self._total = position, total

    def result(self, n_tokens: int, failed: bool) -> None:
        return None

    def pass_finished(self, report: PassReport) -> None:
        self._write(_pass_line(report, self._position, self._total))

    def message(self, text: str) -> None:
        self._write(text)


class RichReporter:
    """A rich progress bar per pass (requests done, failures, output tokens/s), then its summary line."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self._console = console or Console(stderr=True)
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self._tokens = 0
        self._failed = 0
        self._t0 = 0.0
        self._position = 0
        self._total = 0

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._position, self._total = position, total
        self._tokens, self._failed, self._t0 = 0, 0, time.perf_counter()
        self._progress = Progress(
            TextColumn(f"[bold]pass {position}/{total}[/] {planned.arm} {planned.kind}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=self._console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("pass", total=n_requests, rate="0.0", failed=0)

    def result(self, n_tokens: int, failed: bool) -> None:
        with self._lock:
            self._tokens += n_tokens
            self._failed += int(failed)
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            if self._progress is not None:
                self._progress.update(
                    self._task, advance=1, rate=f"{self._tokens / elapsed:.1f}", failed=self._failed
                )

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def pass_finished(self, report: PassReport) -> None:
        self._stop()
        self._console.print(_pass_line(report, self._position, self._total), highlight=False)

    def message(self, text: str) -> None:
        self._stop()
        self._console.print(text, highlight=False)




# --------------------------------------------------------------------------------------------
# batching evidence
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


def _finite_or_none(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _response_record(
    planned: PlannedPass, prompt_index: int, result: GenerationResult
) -> dict[str, Any]:
    ok = result.error is None
    logprobs = result.logprobs
    return {
        "arm": planned.arm,
        "seq": planned.seq,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "prompt_id": result.prompt_id,
        "prompt_index": prompt_index,
        "token_ids": [int(t) for t in result.token_ids],
        "text": result.text,
        # JSON has no -inf/NaN: such a logprob is written as null; the hash keeps its bits.
        "logprobs": None if logprobs is None else [_finite_or_none(float(x)) for x in logprobs],
        "top_logprobs": None
        if result.top_logprobs is None
        else [[[int(t), _finite_or_none(float(lp))] for t, lp in pos] for pos in result.top_logprobs],
        "finish_reason": result.finish_reason,
        "n_prompt_tokens": result.n_prompt_tokens,
        "t_submit": result.t_submit,
        "t_first_token": result.t_first_token,
        "t_done": result.t_done,
        "error": result.error,
        "attempts": result.attempts,
        "rate_limited": result.rate_limited,
        "retry_wait_s": result.retry_wait_s,
        "token_sha256": token_sha256(result.token_ids) if ok else None,
        "logprob_sha256": logprob_sha256(logprobs) if ok else None,
    }


def _missing_record(planned: PlannedPass, prompt_index: int, request: GenerationRequest) -> dict[str, Any]:
    """A request the engine never answered (a protocol violation): recorded as failed."""
    return {
        "arm": planned.arm,
        "seq": planned.seq,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "prompt_id": request.prompt_id,
        "prompt_index": prompt_index,
        "token_ids": [],
        "text": "",
        "logprobs": None,
        "top_logprobs": None,
        "finish_reason": None,
        "n_prompt_tokens": None,
        "t_submit": None,
        "t_first_token": None,
        "t_done": None,
        "error": "engine returned no result",
        "attempts": 0,
        "rate_limited": 0,
        "retry_wait_s": 0.0,
        "token_sha256": None,
        "logprob_sha256": None,
    }


def _metrics_record(planned: PlannedPass, sample: MetricsSample) -> dict[str, Any]:
    record: dict[str, Any] = {"arm": planned.arm, "seq": planned.seq}
    for key, value in dataclasses.asdict(sample).items():
        record[key] = _finite_or_none(value) if isinstance(value, float) else value
    return record


def _schedule_record(planned: PlannedPass, event: str, **extra: Any) -> dict[str, Any]:
    return {
        "event": event,
        "seq": planned.seq,
        "arm": planned.arm,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "block": planned.block,
        "time_utc": utc_now(),
        **extra,
    }


# --------------------------------------------------------------------------------------------
# one run session (a fresh run or a resumed part)
# --------------------------------------------------------------------------------------------




#: the ``stopped`` field of the ``end`` line of a pass the run stopped on
ALL_FAILED = "every request failed"


class SignalInterrupt(KeyboardInterrupt):
    """A signal other than SIGINT that stops the run as Ctrl-C does (``bistat run`` raises it
    for SIGTERM): the run ends ``interrupted``, saying which signal."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"signal {signal_name}")
        self.signal_name = signal_name


class _Untested(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _EngineDied(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _AllFailed(Exception):
    """Every request of a pass failed: the run stops on it (see :class:`RunOutcome`)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _RunDirLost(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class _PassState:
    planned: PlannedPass
    index_of: Mapping[str, int]
    received: set[str] = field(default_factory=set)
    samples: list[MetricsSample] = field(default_factory=list)
    n_failed: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    errors: list[str] = field(default_factory=list)   # the failed requests' errors, in order
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Engines:
    """A run's engines: started a block at a time (in parallel where the kind allows), each start
    recorded (``events``, ``environment``), stopped with their server logs kept."""

    def __init__(self, experiment: "Experiment", writer: RunWriter,
                 engine_factory: EngineFactory) -> None:
        self.experiment = experiment
        self.writer = writer
        self.engine_factory = engine_factory
        self.arms = {arm.name: arm for arm in experiment.arms}
        #: the engines up now, by arm
        self.running: dict[str, Engine] = {}
        #: the GPUs each arm's engine uses (its fingerprint's UUIDs; empty: all of them)
        self.gpu_uuids: dict[str, tuple[str, ...]] = {}
        #: an engine log's path as its engine names it -> where the run kept its copy
        self.kept_logs: dict[str, str] = {}

    def cite_kept(self, text: str) -> str:
        """``text`` with each engine log it names replaced by the copy the run directory keeps
        (``engine-logs/ARM-N.log.gz``): an adapter's own log may be a temporary file, removed
        once kept."""
        for src, dest in self.kept_logs.items():
            text = text.replace(src, dest)
        return text

    def event(self, arm: str, event: str, detail: Any = None) -> None:
        self.writer.append("events", {"arm": arm, "event": event, "time_utc": utc_now(), "detail": detail})

    def _launch(self, arm: str) -> tuple[Engine | None, EngineInfo | None, BaseException | None]:
        """Create and start one arm's engine; never raises (the caller records the outcome).
        An engine with processes of its own has each one recorded as it starts and once it is
        stopped (:func:`bistat.run.leftovers.server_event`), not after the start: a run killed
        while its server loads leaves that server in the records."""
        engine: Engine | None = None
        try:
            engine = self.engine_factory(self.experiment, self.arms[arm])
            if isinstance(engine, ServerProcesses):
                engine.report_processes(
                    lambda process, arm=arm: self.writer.append("events", server_event(arm, process)))
            return engine, engine.start(), None
        except BaseException as exc:  # recorded and re-raised by start
            return engine, None, exc

    def start(self, arms: Sequence[str], block: int) -> None:
        """Start the block's engines at once and record the outcomes in arm order.

        Where the kind allows (``capabilities.parallel_start``) the starts run in parallel threads;
        the records (events, environment) are written afterwards in the
        block's arm order, so a run directory does not depend on which start finished first.
        When a start fails, the engines that did start are stopped and the run is *untested*.
        """
        if len(arms) == 1 or not capabilities(self.experiment.engine.kind).parallel_start:
            launched = [self._launch(arm) for arm in arms]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(arms),
                                                       thread_name_prefix="bistat-start") as pool:
                launched = list(pool.map(self._launch, arms))
        failure: BaseException | None = None
        for arm, (engine, info, exc) in zip(arms, launched):
            if exc is None and failure is None:
                assert engine is not None and info is not None
                self._record_started(arm, block, engine, info)
                continue
            if exc is None:  # started, but an earlier arm failed: stop it, record nothing
                assert engine is not None
                self._stop_quietly(arm, engine)
                continue
            if engine is not None:
                self._stop_quietly(arm, engine)
            said = self.cite_kept(str(exc))
            if isinstance(exc, EngineRefused):
                self.event(arm, "refused", said)
                failure = failure or _Untested(f"engine for arm {arm!r} refused the setting: {said}")
            elif isinstance(exc, EngineError):
                self.event(arm, "start_failed", f"{type(exc).__name__}: {said}")
                what = "could not be created" if engine is None else "failed to start"
                failure = failure or _Untested(f"engine for arm {arm!r} {what}: {said}")
            elif engine is None and isinstance(exc, (ValueError, TypeError)):
                # the adapter refused the declaration's arguments (a registration sealed before
                # register checked them): a refusal, not a defect
                self.event(arm, "refused", f"{type(exc).__name__}: {exc}")
                failure = failure or _Untested(f"engine for arm {arm!r} could not be created "
                                               f"from the declaration: {exc}")
            else:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _record_started(self, arm: str, block: int, engine: Engine, info: EngineInfo) -> None:
        self.running[arm] = engine
        self.event(arm, "started", f"block {block}; {info.kind} {info.version}" + (f" ({info.commit})" if info.commit else ""))
        fingerprint = self._fingerprint(arm, engine)
        gpus = fingerprint.get("gpus") if isinstance(fingerprint, dict) else None
        self.gpu_uuids[arm] = tuple(str(g["uuid"]) for g in gpus or ()
                                    if isinstance(g, dict) and g.get("uuid"))
        self.writer.append(
            "environment",
            {
                "arm": arm,
                "block": block,
                "fingerprint": fingerprint,
                "engine": {
                    "kind": info.kind,
                    "version": info.version,
                    "commit": info.commit,
                    "args": info.args,
                    "env": info.env,
                },
                "log_findings": list(info.log_findings),
                **({"modes": dict(info.modes)} if info.modes else {}),
            },
        )

    def _fingerprint(self, arm: str, engine: Engine) -> dict[str, Any]:
        """The engine's fingerprint in :mod:`bistat.run.fingerprint`'s format.

        An engine whose fingerprint lacks ``gpus`` (in-process engines return ``{}``; some
        adapters return only their own details) gets this machine's fingerprint, marked
        ``"source": "runner"``, with what the engine reported kept under ``engine_reported``.
        """
        fp = engine.fingerprint()
        if isinstance(fp, dict) and "gpus" in fp:
            return fp
        local = {**collect_fingerprint(self.arms[arm].env), "source": "runner"}
        if fp:
            local["engine_reported"] = fp
        return local

    def _keep_log(self, arm: str, engine: Engine) -> None:
        """Copy a stopped engine's server log (engines with a ``log_path``) into the run
        directory, gzipped, as ``engine-logs/ARM-N.log.gz`` (N counts this arm's starts); a log
        the adapter wrote to a temporary file of its own (``log_temporary``) is removed once
        kept, and the run's messages name the copy (:meth:`cite_kept`)."""
        src = getattr(engine, "log_path", None)
        if src is None or not Path(src).is_file():
            return
        if self.writer.lost() is not None:   # not into whatever now has the run directory's name
            self.event(arm, "exited", f"server log {src} not kept: the run directory is lost")
            return
        dest_dir = self.writer.run_dir / ENGINE_LOGS_DIR
        try:
            dest_dir.mkdir(exist_ok=True)
            n = 1 + sum(1 for _ in dest_dir.glob(f"{arm}-*.log.gz"))
            dest = dest_dir / f"{arm}-{n}.log.gz"
            with open(src, "rb") as fin, gzip.open(dest, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        except OSError as exc:  # a lost log must not lose the run
            self.event(arm, "exited", f"server log {src} not kept: {exc}")
            return
        self.kept_logs[str(src)] = str(dest)
        if getattr(engine, "log_temporary", False):
            Path(src).unlink(missing_ok=True)

    def _stop_quietly(self, arm: str, engine: Engine) -> bool:
        """Stop ``engine`` and keep its log; a failed stop is an ``exited`` event. True if it
        stopped cleanly."""
        try:
            engine.stop()
        except EngineError as exc:
            self.event(arm, "exited", f"stop failed: {exc}")
            self._keep_log(arm, engine)
            return False
        self._keep_log(arm, engine)
        return True

    def stop(self, arm: str) -> None:
        if self._stop_quietly(arm, self.running.pop(arm)):
            self.event(arm, "stopped")

    def stop_all(self) -> None:
        for arm in list(self.running):
            self.stop(arm)


    def discard(self, arm: str, engine: Engine) -> None:
        """An engine that failed during a pass: stopped (its log kept), no ``stopped`` event."""
        self.running.pop(arm, None)
        self._stop_quietly(arm, engine)


@dataclass(frozen=True)
class _PassEnd:
    """How a pass ended, from its state once the engine returned (see ``_Session._end_pass``)."""

    status: str
    samples: list[MetricsSample]
    n_failed: int
    output_tokens: int
    prompt_tokens: int
    errors: tuple[str, ...] = ()


class _Session:
    """One execution of planned blocks: the engines of each block, its passes in order, the run
    directory checked before each, and how the run ended."""

    def __init__(
        self,
        experiment: "Experiment",
        writer: RunWriter,
        prompts: Sequence[Prompt],
        engine_factory: EngineFactory,
        reporter: Reporter,
    ) -> None:
        self.experiment = experiment
        self.writer = writer
        self.prompts = prompts
        self.reporter = reporter
        self.engines = _Engines(experiment, writer, engine_factory)
        self.passes_run = 0
        self.failed_requests = 0
        self.failed_passes = 0
        #: every failed request's error of this execution, in order
        self.errors: list[str] = []
        #: samples this machine's GPUs while engines run on them (bistat.run.gpuload)
        self.gpu_monitor: GpuMonitor | None = None

    # passes ----------------------------------------------------------------------------------

    def run_pass(self, planned: PlannedPass, position: int, total: int) -> None:
        """One pass: its requests sent, each response recorded as it arrives, the missing ones
        recorded as failed, its ``end`` and ``passes`` records, and the reporter told."""
        engine = self.engines.running[planned.arm]
        requests = self._requests(planned)
        state = _PassState(planned=planned, index_of={p.prompt_id: p.index for p in self.prompts})
        started_utc = utc_now()
        self.writer.append("schedule", _schedule_record(planned, "start"))
        self.reporter.pass_started(planned, len(requests), position, total)
        wall_s, host, gpu = self._drive(engine, requests, state)
        end = self._end_pass(requests, state)
        self._record_pass(planned, requests, started_utc, wall_s, host, gpu, end)
        if requests and end.n_failed == len(requests):
            (first, *_) = error_groups(end.errors)
            raise _AllFailed(
                f"every request of pass {planned.pass_index} of arm {planned.arm!r} "
                f"({planned.kind}, schedule position {planned.seq}) failed: the pass is "
                f"recorded failed and the engines are stopped. {first.count} of "
                f"{len(requests)} requests failed with this error (numbers aside): {first.first}")

    def _requests(self, planned: PlannedPass) -> list[GenerationRequest]:
        """The pass's requests, in its shuffled order (:func:`bistat.run.workload.requests_for_pass`)."""
        wl = self.experiment.workload
        return requests_for_pass(
            self.prompts,
            seed=wl.seed,
            arm=planned.arm,
            pass_index=planned.pass_index,
            shuffle=wl.shuffle_within_pass,
            max_tokens=wl.max_tokens,
            temperature=wl.temperature,
            top_p=wl.top_p,
            top_k=wl.top_k,
            ignore_eos=wl.ignore_eos,
            logprobs=wl.top_logprobs,
            max_tokens_min=wl.max_tokens_min,
        )

    def _on_result(self, state: _PassState) -> Callable[[GenerationResult], None]:
        """The engine's callback for each response: recorded at once, counted, reported."""
        planned = state.planned

        def on_result(result: GenerationResult) -> None:
            failed = result.error is not None
            with state.lock:
                index = state.index_of.get(result.prompt_id, -1)
                self.writer.append("responses", _response_record(planned, index, result))
                state.received.add(result.prompt_id)
                if failed:
                    state.n_failed += 1
                    state.errors.append(str(result.error))
                else:
                    state.output_tokens += len(result.token_ids)
                    state.prompt_tokens += result.n_prompt_tokens or 0
            self.reporter.result(0 if failed else len(result.token_ids), failed)

        return on_result

    def _on_metrics(self, state: _PassState) -> Callable[[MetricsSample], None]:
        """The engine's callback for each metrics sample: kept for the batching summary and
        recorded."""

        def on_metrics(sample: MetricsSample) -> None:
            with state.lock:
                state.samples.append(sample)
                self.writer.append("metrics", _metrics_record(state.planned, sample))

        return on_metrics

    def _drive(self, engine: Engine, requests: list[GenerationRequest], state: _PassState
               ) -> tuple[float, Any, Any]:
        """Run the pass on ``engine``; its wall time and the host's and GPUs' load meanwhile.

        An engine that fails ends the pass ``interrupted`` and is stopped (:class:`_EngineDied`);
        Ctrl-C or an adapter's defect ends it ``interrupted`` and propagates."""
        planned, wl = state.planned, self.experiment.workload
        host_before = host_sample()
        t0_wall = time.time()
        t0 = time.perf_counter()
        try:
            engine.run_pass(requests, concurrency=wl.concurrency, on_result=self._on_result(state),
                            on_metrics=self._on_metrics(state))
        except EngineError as exc:
            self._end_interrupted(state)
            self.engines.discard(planned.arm, engine)   # its log kept: the messages name the copy
            said = self.engines.cite_kept(str(exc))
            self.engines.event(planned.arm, "exited", f"{type(exc).__name__} during pass seq {planned.seq}: {said}")
            raise _EngineDied(f"engine for arm {planned.arm!r} failed during pass seq {planned.seq}: {said}") from exc
        except BaseException:
            # Ctrl-C, or a defect in an adapter: mark the pass, keep the data, let it propagate.
            self._end_interrupted(state)
            raise
        wall_s = time.perf_counter() - t0
        host = host_record(host_before, host_sample())
        gpu = (self.gpu_monitor.record(t0_wall, time.time(), self.engines.gpu_uuids.get(planned.arm, ()))
               if self.gpu_monitor is not None else None)
        return wall_s, host, gpu

    def _end_interrupted(self, state: _PassState) -> None:
        with state.lock:
            self.writer.append(
                "schedule", _schedule_record(state.planned, "end", status="interrupted", n_failed=state.n_failed)
            )

    def _end_pass(self, requests: list[GenerationRequest], state: _PassState) -> _PassEnd:
        """Requests the engine never answered recorded as failed; the responses synced to disk;
        the pass's ``end`` line (``complete``, or ``failed`` with a failure)."""
        planned = state.planned
        with state.lock:
            for request in requests:
                if request.prompt_id not in state.received:
                    missing = _missing_record(planned, state.index_of[request.prompt_id], request)
                    self.writer.append("responses", missing)
                    state.received.add(request.prompt_id)
                    state.n_failed += 1
                    state.errors.append(missing["error"])
            status = "complete" if state.n_failed == 0 else "failed"
            end = _PassEnd(status, list(state.samples), state.n_failed, state.output_tokens,
                           state.prompt_tokens, tuple(state.errors))
            all_failed = bool(requests) and end.n_failed == len(requests)
            self.writer.sync()   # the pass's responses reach the disk before its "end" record
            self.writer.append("schedule", _schedule_record(
                planned, "end", status=status, n_failed=end.n_failed,
                **({"stopped": ALL_FAILED} if all_failed else {})))
        return end

    def _record_pass(self, planned: PlannedPass, requests: list[GenerationRequest],
                     started_utc: str, wall_s: float, host: Any, gpu: Any, end: _PassEnd) -> None:
        """The pass's ``passes.jsonl`` line (throughput, batching evidence, load), the run's
        counts, and the reporter told."""
        rate = end.output_tokens / wall_s if wall_s > 0 else None
        self.writer.append(
            "passes",
            {
                "arm": planned.arm,
                "seq": planned.seq,
                "pass_index": planned.pass_index,
                "kind": planned.kind,
                "wall_s": wall_s,
                "n_requests": len(requests),
                "n_failed": end.n_failed,
                "prompt_tokens": end.prompt_tokens,
                "output_tokens": end.output_tokens,
                "output_tokens_per_s": rate,
                "requests_per_s": len(requests) / wall_s if wall_s > 0 else None,
                "started_utc": started_utc,
                "status": end.status,
                "block": planned.block,
                "batching": batching_summary(end.samples, wall_s),
                **({"host": host} if host is not None else {}),
                **({"gpu": gpu} if gpu is not None else {}),
            },
        )
        self.passes_run += 1
        self.failed_requests += end.n_failed
        self.failed_passes += int(end.n_failed > 0)
        self.errors.extend(end.errors)
        self.reporter.pass_finished(
            PassReport(
                planned=planned,
                status=end.status,
                wall_s=wall_s,
                n_requests=len(requests),
                n_failed=end.n_failed,
                output_tokens=end.output_tokens,
                output_tokens_per_s=rate,
            )
        )

    # the schedule ----------------------------------------------------------------------------


    def _start_gpu_monitor(self) -> None:
        """Sample the GPUs during the passes where the engines run on this machine's GPU
        (``capabilities.local_gpu``) and ``nvidia-smi`` answers (:mod:`bistat.run.gpuload`)."""
        if not capabilities(self.experiment.engine.kind).local_gpu:
            return
        monitor = GpuMonitor(sample_interval_s())
        if monitor.start():
            self.gpu_monitor = monitor

    def execute(self, blocks: Sequence[Block]) -> RunOutcome:
        self._start_gpu_monitor()
        try:
            return self._execute(blocks)
        finally:
            if self.gpu_monitor is not None:
                self.gpu_monitor.stop()

    def _execute(self, blocks: Sequence[Block]) -> RunOutcome:
        total = sum(len(b.passes) for b in blocks)
        position = 0
        try:
            for block in blocks:
                for arm in [a for a in self.engines.running if a not in block.arms]:
                    self.engines.stop(arm)
                for arm in block.arms:
                    if arm in self.engines.running:  # a new block is a new start
                        self.engines.stop(arm)
                self._check_run_dir()
                self.engines.start(block.arms, block.block)
                for planned in block.passes:
                    position += 1
                    self._check_run_dir()
                    self.run_pass(planned, position, total)
            self._check_run_dir()   # the last pass's records too
        except _RunDirLost as exc:
            return self._rescue(exc.detail)
        except _Untested as exc:
            self.engines.stop_all()
            return self._outcome("untested", exc.detail)
        except _EngineDied as exc:
            self.engines.stop_all()
            return self._outcome("incomplete", exc.detail)
        except _AllFailed as exc:
            self.engines.stop_all()
            return self._outcome("stopped", exc.detail)
        except KeyboardInterrupt as exc:
            self.engines.stop_all()
            how = (f"interrupted by {exc.signal_name}" if isinstance(exc, SignalInterrupt)
                   else "interrupted by SIGINT (Ctrl-C)")
            return self._outcome("interrupted", how)
        except BaseException:
            self.engines.stop_all()
            raise
        self.engines.stop_all()
        return self._outcome("complete", None)

    def _check_run_dir(self) -> None:
        """Stop (:class:`_RunDirLost`) when the run directory is no longer the one the run
        opened: removed, or replaced by another (a copy of the tree put in its place). The run's
        files then have no name, and every later record would go where nobody finds it."""
        why = self.writer.lost()
        if why is not None:
            raise _RunDirLost(why)

    def _rescue(self, why: str) -> RunOutcome:
        """The run directory is lost: say where its files can still be read, copy them into a
        new directory beside it, stop the engines (their events and logs go to the copy) and
        end the run ``lost``."""
        lost_dir = self.writer.run_dir
        held = self.writer.open_files()
        self.reporter.message("\n".join(
            [f"run directory lost: {why}. Its files are open in this process, and readable "
             "there until it exits:", *(f"  {name}: {where}" for name, where in held.items())]))
        try:
            kept = self.writer.rescue(_rescue_dir(lost_dir))
        except OSError as exc:
            self.engines.stop_all()
            return self._outcome("lost", f"{why}; its files could not be copied ({exc}); they "
                                         "were readable while the run's process lived: "
                                         + "; ".join(f"{n} at {w}" for n, w in held.items()))
        self.reporter.message(f"copied them into {kept}")
        self.engines.stop_all()
        return self._outcome("lost", f"{why}; every record made so far was copied from the files "
                                     f"this run held open into {kept}")

    def _outcome(self, status: RunCompletion, detail: str | None) -> RunOutcome:
        return RunOutcome(
            run_dir=self.writer.run_dir,
            status=status,
            passes_run=self.passes_run,
            failed_requests=self.failed_requests,
            failed_passes=self.failed_passes,
            detail=detail,
            errors=error_groups(self.errors),
        )


# --------------------------------------------------------------------------------------------
# run directories, resume state
# --------------------------------------------------------------------------------------------


def _rescue_dir(lost: Path, now: _dt.datetime | None = None) -> Path:
    """A new directory for the files of the lost run directory ``lost``:
    ``<lost>.rescued-<UTC stamp>`` beside it where its parent still exists, else in the
    system's temporary directory."""
    import tempfile

    now = now or _dt.datetime.now(_dt.timezone.utc)
    parent = lost.parent if lost.parent.is_dir() else Path(tempfile.gettempdir())
    return new_run_dir(parent, f"{lost.name}.rescued", now)


def new_run_dir(runs_dir: Path, name: str, now: _dt.datetime | None = None) -> Path:
    """``runs_dir/<name>-<UTC stamp>``, e.g. ``runs/quickstart-20260101T120000Z`` (``-2``... if taken)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    stem = f"{name}-{now.strftime('%Y%m%dT%H%M%SZ')}"
    candidate = Path(runs_dir) / stem
    n = 2
    while candidate.exists():
        candidate = Path(runs_dir) / f"{stem}-{n}"
        n += 1
    return candidate


@dataclass(frozen=True)
class ResumeState:
    """What a run directory's schedule says about progress (see :func:`read_resume_state`)."""

    done_counted: Mapping[str, int]
    next_seq: int
    next_block: int
    next_pass_index: Mapping[str, int]
    open_passes: tuple[Mapping[str, Any], ...]  # start lines without an end line
    #: the end lines of counted passes the run stopped on (every request failed): run again
    stopped_on: tuple[Mapping[str, Any], ...] = ()


def read_resume_state(run_dir: Path) -> ResumeState:
    """Progress recorded in ``schedule.jsonl`` (and engine blocks in ``environment.jsonl``)."""
    schedule, _ = read_jsonl(Path(run_dir) / "schedule.jsonl")
    environment, _ = read_jsonl(Path(run_dir) / "environment.jsonl")
    starts: dict[int, Mapping[str, Any]] = {}
    ended: set[int] = set()
    done: Counter[str] = Counter()
    next_pass: dict[str, int] = {}
    max_seq, max_block = -1, -1
    last_end: dict[int, Mapping[str, Any]] = {}
    for rec in schedule:
        seq = int(rec["seq"])
        max_seq = max(max_seq, seq)
        max_block = max(max_block, int(rec["block"]))
        next_pass[rec["arm"]] = max(next_pass.get(rec["arm"], 0), int(rec["pass_index"]) + 1)
        if rec["event"] == "start":
            starts[seq] = rec
        elif rec["event"] == "end":
            ended.add(seq)
            last_end[seq] = rec   # a resume may end a pass again (superseding it): the last counts
    stopped_on = []
    for seq, rec in sorted(last_end.items()):
        if rec["kind"] != "counted":
            continue
        if rec.get("status") == "failed" and rec.get("stopped") == ALL_FAILED:
            stopped_on.append(rec)   # the run stopped on it: run again, not kept
        elif rec.get("status") in ("complete", "failed"):
            done[rec["arm"]] += 1
    for rec in environment:
        max_block = max(max_block, int(rec["block"]))
    open_passes = tuple(rec for seq, rec in sorted(starts.items()) if seq not in ended)
    return ResumeState(
        done_counted=dict(done),
        next_seq=max_seq + 1,
        next_block=max_block + 1,
        next_pass_index=next_pass,
        open_passes=open_passes,
        stopped_on=tuple(stopped_on),
    )


def _supersede_stopped_passes(writer: RunWriter, state: ResumeState) -> None:
    """End again, ``status = "interrupted"``, each counted pass the run stopped on because every
    request of it failed: it no longer counts, and the resumed schedule runs it again in full
    (under a new ``seq`` and ``pass_index``, as an interrupted pass)."""
    for rec in state.stopped_on:
        writer.append("schedule", {
            "event": "end", "seq": rec["seq"], "arm": rec["arm"],
            "pass_index": rec["pass_index"], "kind": rec["kind"], "block": rec["block"],
            "time_utc": utc_now(), "status": "interrupted", "n_failed": rec.get("n_failed", 0),
            "detail": "superseded on resume: every request of this pass failed and the run "
                      "stopped on it; it is run again in full"})


def _close_open_passes(writer: RunWriter, state: ResumeState) -> None:
    """End passes a killed process left open: ``status = "interrupted"`` with their failures so far."""
    _supersede_stopped_passes(writer, state)
    if not state.open_passes:
        return
    responses, _ = read_jsonl(writer.run_dir / "responses.jsonl")
    failed = Counter(int(r["seq"]) for r in responses if r.get("error") is not None)
    for rec in state.open_passes:
        seq = int(rec["seq"])
        writer.append(
            "schedule",
            {
                "event": "end",
                "seq": seq,
                "arm": rec["arm"],
                "pass_index": rec["pass_index"],
                "kind": rec["kind"],
                "block": rec["block"],
                "time_utc": utc_now(),
                "status": "interrupted",
                "n_failed": failed.get(seq, 0),
                "detail": "closed on resume: the process ended during this pass",
            },
        )


def _workload_prompts(experiment: "Experiment", base_dir: Path | None) -> list[Prompt]:
    wl = experiment.workload
    return load_prompts(wl.source, wl.n_prompts, wl.seed, base_dir=base_dir)


def _plan(experiment: "Experiment", concurrent: bool, state: ResumeState | None) -> tuple[Block, ...]:
    wl = experiment.workload
    return plan_schedule(
        [a.name for a in experiment.arms],
        passes=wl.passes,
        warmup_passes=wl.warmup_passes,
        order=wl.order,
        seed=wl.seed,
        engines_concurrent=concurrent,
        done_counted=state.done_counted if state else None,
        first_seq=state.next_seq if state else 0,
        first_block=state.next_block if state else 0,
        next_pass_index=state.next_pass_index if state else None,
    )


def execute_run(
    experiment: "Experiment",
    writer: RunWriter,
    blocks: Sequence[Block],
    *,
    prompts: Sequence[Prompt],
    engine_factory: EngineFactory,
    reporter: Reporter,
) -> RunOutcome:
    """Run ``blocks`` of passes into ``writer``'s run directory; engines are always stopped."""
    return _Session(experiment, writer, prompts, engine_factory, reporter).execute(blocks)


def _default_factory() -> EngineFactory:
    from bistat.engines.registry import create_engine

    return create_engine



class GpuBusyError(RuntimeError):
    """Other processes hold the GPU a run would start its engines on (see :func:`check_gpu`).

    ``detail`` names them, as recorded in a ``gpu_busy`` event when the run is allowed anyway.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(self.explain("allow_busy_gpu=True"))

    def explain(self, override: str) -> str:
        """The refusal in words, naming ``override`` as the way to run anyway (the CLI says
        ``--allow-busy-gpu``)."""
        return (f"other processes hold the GPU: {self.detail}. They would share its memory and "
                f"time with the engines this run starts (and a leftover run's engines are among "
                f"them). Stop them, or record the run anyway with {override} (its finding will "
                f"list this as a deviation)")


def busy_gpu(experiment: "Experiment") -> str | None:
    """What else holds this machine's GPU, in words, when ``experiment`` starts its engines on it
    (its kind's ``capabilities.local_gpu``); None: nothing there, not a local GPU run, or no ``nvidia-smi`` to
    tell (:func:`bistat.run.fingerprint.gpu_processes`)."""
    from bistat.run import fingerprint
    if not capabilities(getattr(experiment.engine, "kind", "")).local_gpu:
        return None
    procs = fingerprint.gpu_processes() or []
    if not procs:
        return None
    return "; ".join(f"pid {p['pid']} {p['name'] or '?'} ({p['used_memory_mib']} MiB on "
                     f"{p['gpu_uuid'] or '?'})" for p in procs)


def check_gpu(experiment: "Experiment", *, allow_busy_gpu: bool = False) -> str | None:
    """Refuse a run that starts vLLM engines while other processes hold the GPU (they share its
    memory and its time, and a leftover run's engines would outlive the check), unless allowed.

    Returns
    -------
    str or None
        What else held the GPU (:func:`busy_gpu`) when it was allowed, for the run's records;
        None when nothing was there.

    Raises
    ------
    GpuBusyError
        Other processes hold the GPU and ``allow_busy_gpu`` is false.
    """
    detail = busy_gpu(experiment)
    if detail and not allow_busy_gpu:
        raise GpuBusyError(detail)
    return detail


def _gpu_busy_to_record(experiment: "Experiment", gpu_busy: str | None, allow_busy_gpu: bool,
                        reporter: Reporter) -> str | None:
    """The ``gpu_busy`` detail a run records: the caller's, where it checked the GPU itself and
    allowed what it found, else :func:`check_gpu`'s (which refuses unless allowed)."""
    if gpu_busy:
        return gpu_busy
    found = check_gpu(experiment, allow_busy_gpu=allow_busy_gpu)
    if found:
        reporter.message(f"warning: other processes hold the GPU: {found}; recorded (allowed)")
    return found


def start_run(
    experiment: "Experiment",
    registration: Mapping[str, Any],
    run_dir: Path,
    *,
    engine_factory: EngineFactory | None = None,
    reporter: Reporter | None = None,
    command: Sequence[str] | None = None,
    base_dir: Path | None = None,
    compact_at_end: bool = True,
    gpu_busy: str | None = None,
    allow_busy_gpu: bool = False,
) -> RunOutcome:
    """Create ``run_dir`` and run the whole schedule of a registered experiment.

    Parameters
    ----------
    experiment
        The sealed declaration, validated.
    registration
        ``{"path", "sha256", "registered_utc", "name"}`` of the registration (for ``run.json``).
    run_dir
        A new directory (never overwritten; see :func:`new_run_dir`).
    engine_factory
        ``(experiment, arm) -> Engine``; default: :func:`bistat.engines.registry.create_engine`.
    reporter
        Progress reporting (default: none).
    command
        The command line recorded in ``run.json`` (default: ``sys.argv``), its program written
        ``bistat`` however it was started (:func:`bistat.store.format.command_words`).
    base_dir
        Where a relative ``file:`` prompt source is resolved (default: the current directory).
    compact_at_end
        Write the Parquet tables when the run ends complete or untested.
    gpu_busy
        What else held the GPU as the run started, where the caller checked it itself
        (:func:`check_gpu`) and allowed it: recorded as a ``gpu_busy`` event (arm ``*``), which
        the finding lists as a deviation. Without it the runner checks: see ``allow_busy_gpu``.
    allow_busy_gpu
        Start a run of engines on this machine's GPU (``capabilities.local_gpu``) although other processes hold the
        GPU: they are then recorded as ``gpu_busy`` is (and the reporter warned). Without it
        such a run is refused before ``run_dir`` is created.

    Raises
    ------
    GpuBusyError
        Other processes hold the GPU and ``allow_busy_gpu`` is false (``gpu_busy`` not given).
    """
    reporter = reporter or NullReporter()
    sample_interval_s()   # a malformed BISTAT_GPU_SAMPLE_S stops the run before its directory
    gpu_busy = _gpu_busy_to_record(experiment, gpu_busy, allow_busy_gpu, reporter)
    prompts = _workload_prompts(experiment, base_dir)
    concurrent, why = resolve_engines_concurrent(experiment)
    header = {
        "run_id": Path(run_dir).name,
        "registration": dict(registration),
        "bistat_version": __version__,
        "created_utc": utc_now(),
        "command": list(command_words(command if command is not None else sys.argv)),
        "engine_kind": experiment.engine.kind,
        "engines_concurrent": concurrent,
        "engines_concurrent_reason": why,
        "workload_sha256": prompts_sha256(prompts),
    }
    writer = RunWriter.create(run_dir, header)
    _record_gpu_busy(writer, gpu_busy)
    _record_release_check(writer, experiment)
    return _execute_and_close(experiment, writer, lambda: _plan(experiment, concurrent, None),
                              prompts, engine_factory, reporter, compact_at_end)


def _record_release_check(writer: RunWriter, experiment: "Experiment") -> None:
    """For a vLLM engine: the newest release the package index knows as the run starts
    (:func:`bistat.declare.releases.check_newest_release`; a machine that reaches no index records why),
    as a ``release_check`` event (arm ``*``) that the finding's "Engine version" section reads."""
    from bistat.declare import releases
    from bistat.declare.engine_version import ENGINE_PACKAGES

    package = ENGINE_PACKAGES.get(getattr(experiment.engine, "kind", None))
    if package is None:
        return
    check = releases.check_newest_release(package)
    detail = (f"{package} {check.newest} is the newest release ({check.index})"
              if check.newest else f"{package}: newest release unknown ({check.error})")
    writer.append("events", {"arm": "*", "event": "release_check", "time_utc": utc_now(),
                             "detail": detail, "release_check": check.to_dict()})


def _record_gpu_busy(writer: RunWriter, detail: str | None) -> None:
    if detail:
        writer.append("events", {"arm": "*", "event": "gpu_busy", "time_utc": utc_now(),
                                 "detail": detail})


def _execute_and_close(
    experiment: "Experiment",
    writer: RunWriter,
    plan: Callable[[], Sequence[Block]],
    prompts: Sequence[Prompt],
    engine_factory: EngineFactory | None,
    reporter: Reporter,
    compact_at_end: bool,
) -> RunOutcome:
    """Run the planned blocks (nothing left: the schedule is complete), close the writer, and
    compact the run when it ended complete or untested."""
    try:
        blocks = plan()
        if not blocks:
            outcome = RunOutcome(writer.run_dir, "complete", 0, 0, 0,
                                 "nothing left to run: the schedule is complete")
        else:
            outcome = execute_run(experiment, writer, blocks, prompts=prompts,
                                  engine_factory=engine_factory or _default_factory(),
                                  reporter=reporter)
    finally:
        writer.close()
    if compact_at_end and outcome.status in ("complete", "untested"):
        compact(writer.run_dir)
    return outcome


class ResumeError(ValueError):
    """A run directory cannot be resumed with this declaration."""


def resume_run(
    experiment: "Experiment",
    run_dir: Path,
    *,
    engine_factory: EngineFactory | None = None,
    reporter: Reporter | None = None,
    base_dir: Path | None = None,
    compact_at_end: bool = True,
    gpu_busy: str | None = None,
    allow_busy_gpu: bool = False,
) -> RunOutcome:
    """Continue a recorded run where it stopped (see the module docstring, "Resume").

    The experiment must be the one the run was recorded for (the caller finds the registration
    with :func:`bistat.declare.run_registration.run_registration`, which checks its seal, and
    checks its hash against ``run.json``); the prompts must hash as they did. ``gpu_busy``
    and ``allow_busy_gpu`` as for :func:`start_run`: a resumed run of vLLM engines on a busy GPU
    is refused (:class:`GpuBusyError`) before anything is written, unless allowed. First, a
    server of the run that an earlier, killed process left up is stopped (and recorded so):
    :func:`bistat.run.leftovers.stop_left_servers`.
    """
    reporter = reporter or NullReporter()
    sample_interval_s()   # a malformed BISTAT_GPU_SAMPLE_S stops the run before it writes
    run_dir = Path(run_dir)
    header = read_header(run_dir)
    for left in stop_left_servers(run_dir):   # before the GPU check and the new servers
        reporter.message(left.sentence())
    prompts = _workload_prompts(experiment, base_dir)
    if header.get("workload_sha256") not in (None, prompts_sha256(prompts)):
        raise ResumeError(
            f"{run_dir / 'run.json'}: the workload's prompts differ from the ones this run was started "
            "with (workload_sha256); restore the prompt file or start a new run"
        )
    gpu_busy = _gpu_busy_to_record(experiment, gpu_busy, allow_busy_gpu, reporter)
    concurrent = header.get("engines_concurrent")
    if not isinstance(concurrent, bool):
        concurrent, _ = resolve_engines_concurrent(experiment)
    state = read_resume_state(run_dir)
    writer = RunWriter.open_existing(run_dir)
    _record_gpu_busy(writer, gpu_busy)

    def plan() -> Sequence[Block]:
        _close_open_passes(writer, state)
        return _plan(experiment, concurrent, state)

    return _execute_and_close(experiment, writer, plan, prompts, engine_factory, reporter,
                              compact_at_end)
