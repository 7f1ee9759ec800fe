"""One execution of planned blocks (:func:`execute_run`, a fresh run or a resumed part of one):
the engines of each block (:mod:`bistat.run.run_engines`), its passes in order (each request's
response recorded as it arrives, the missing ones as failed, the pass's ``end`` and ``passes.jsonl``
lines, the reporter told), the run directory checked before each engine start and each pass, and
how the run ended (:class:`~bistat.run.outcome.RunOutcome`). A lost run directory's files are
copied into a new directory beside it (:func:`_rescue_dir`), named as :func:`new_run_dir` names a
run directory.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from bistat.core.failures import error_groups
from bistat.core.schedule import Block, PlannedPass
from bistat.engines.base import (Engine, EngineError, GenerationRequest, GenerationResult,
                                 MetricsSample)
from bistat.engines.registry import capabilities
from bistat.run.batching import batching_summary  # one batching mean, the analysis's too
from bistat.run.gpuload import GpuMonitor, sample_interval_s
from bistat.run.hostload import host_record, host_sample
from bistat.run.outcome import (ALL_FAILED, RunCompletion, RunOutcome, SignalInterrupt, _AllFailed,
                                _EngineDied, _RunDirLost, _Untested)
from bistat.run.pass_records import (_metrics_record, _missing_record, _response_record,
                                     _schedule_record)
from bistat.run.progress import PassReport, Reporter
from bistat.run.run_engines import EngineFactory, _Engines
from bistat.run.workload import Prompt, requests_for_pass
from bistat.store.format import utc_now
from bistat.store.writer import RunWriter

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment


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


# --------------------------------------------------------------------------------------------
# run directories
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
