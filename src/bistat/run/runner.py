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

Parts
-----
This module starts a run and resumes one (:func:`start_run`, :func:`resume_run`). It names the
parts it builds on, each a module of its own, so ``bistat.run.runner.NAME`` serves for all the
names of its ``__all__``; the package's modules that need only a part import that part:

- :mod:`bistat.run.session` -- one execution of planned blocks (:func:`execute_run`): the passes,
  the run directory checked before each, a lost directory's files rescued; :func:`new_run_dir`.
- :mod:`bistat.run.run_engines` -- a run's engines (:data:`EngineFactory`): started a block at a
  time, each start recorded, stopped with their server logs kept.
- :mod:`bistat.run.pass_records` -- the lines a pass writes (responses, metrics, schedule).
- :mod:`bistat.run.outcome` -- :class:`RunOutcome` and the stops that end a run early
  (:class:`SignalInterrupt`, :data:`ALL_FAILED`).
- :mod:`bistat.run.resume_state` -- the progress a run directory records
  (:func:`read_resume_state`), and the passes a resume ends again.
- :mod:`bistat.run.gpu_check` -- the busy-GPU check (:func:`check_gpu`, :class:`GpuBusyError`).
- :mod:`bistat.run.progress` -- the reporters (:class:`Reporter`, :class:`PlainReporter`, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from bistat import __version__
from bistat.core.schedule import Block, plan_schedule
from bistat.declare.concurrency import resolve_engines_concurrent
from bistat.run.batching import batching_summary  # one batching mean, the analysis's too
from bistat.run.gpu_check import (GpuBusyError, _gpu_busy_to_record, _record_gpu_busy, busy_gpu,
                                  check_gpu)
from bistat.run.gpuload import sample_interval_s
from bistat.run.leftovers import stop_left_servers
from bistat.run.outcome import (  # noqa: F401 - the runner named these too: kept
    ALL_FAILED, RunCompletion, RunOutcome, SignalInterrupt)
from bistat.run.pass_records import _response_record  # noqa: F401 - benchmarks read it here
from bistat.run.progress import NullReporter, PassReport, PlainReporter, Reporter, RichReporter
from bistat.run.resume_state import ResumeState, _close_open_passes, read_resume_state
from bistat.run.run_engines import EngineFactory
from bistat.run.session import execute_run, new_run_dir
from bistat.run.workload import Prompt, load_prompts, prompts_sha256
from bistat.store.compact import compact
from bistat.store.format import command_words, utc_now
from bistat.store.readers import read_header
from bistat.store.writer import RunWriter

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment


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


def _default_factory() -> EngineFactory:
    from bistat.engines.registry import create_engine

    return create_engine


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
