"""``bistat run``: execute a registered experiment."""

from __future__ import annotations

import contextlib
import errno
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import click

from bistat.cli.exitcodes import ERROR, OK, RUN_DIR_LOST
from bistat.cli.fail_on import OUTCOME_FAIL_ON_HELP, fail_on_labels

RUN_EXIT_CODES = """\b
Exit codes: 0 the run ended (the whole schedule ran; failed requests, if
any, are flagged in the records) and --fail-on names no verdict it got;
1 error, or the run stopped early (engine died, every request of a pass
failed, Ctrl-C: resume it with --resume); 3 the run directory was
removed or replaced while the run
recorded (it stops before the next pass and copies its records into
RUN_DIR.rescued-<UTC stamp> beside it); with --fail-on, the code of the
first verdict whose label it names: 10 doubtful, 11 reported as
observed, 12 untested (also when an engine refused the setting or failed
to start; the data so far is kept).
The run ends with a one-screen summary of its analysis for CI logs, and
every ending with the line 'exit CODE: why'."""


def _reporter(no_progress: bool):
    from rich.console import Console

    from bistat.run.runner import PlainReporter, RichReporter

    console = Console(stderr=True)
    if no_progress or not console.is_terminal:
        return PlainReporter(lambda line: click.echo(line, err=True))
    return RichReporter(console)


def _summarise(run_dir: Path, registration, fail_on: frozenset[str], *,
               untested: bool = False) -> int:
    """Analyse the recorded run, print the CI summary ending with the exit line, return its code.

    ``untested``: an engine refused its setting or failed to start, a failed run: the code is
    non-zero (1) even without --fail-on, whose own code wins when it names the verdict. An
    analysis that cannot be made is reported (the data is kept) and exits 1 when --fail-on was
    given (a gate that cannot be evaluated must not pass) or the run is untested, else 0.
    """
    from bistat.analysis.summary import AnalysisError, analyze_run
    from bistat.declare.experiment import DeclarationError
    from bistat.report.gating import GateResult, ci_summary, gate
    from bistat.declare.prereg import RegistrationError
    from bistat.store.format import RecordsError

    try:
        summary = analyze_run(run_dir, registration)
    except (AnalysisError, RecordsError, RegistrationError, DeclarationError) as exc:
        click.echo(f"cannot summarise the run: {exc}", err=True)
        if untested:
            return _exit_line(ERROR, "an engine refused its setting or failed to start (the run "
                                     "is untested), and its analysis failed")
        if fail_on:
            return _exit_line(ERROR, "the analysis failed, so --fail-on cannot be evaluated")
        return _exit_line(OK, "the run ended; its analysis failed and no --fail-on was given")
    result = gate([c.verdict.label.value for c in summary.comparisons], fail_on)
    if untested and result.exit_code == OK:
        result = GateResult(ERROR, "an engine refused its setting or failed to start: the run is "
                                   "untested, a failed run whatever --fail-on names")
    click.echo(ci_summary(summary, fail_on, result=result), nl=False)
    return result.exit_code


def _exit_line(code: int, reason: str) -> int:
    """Print the run's last line, ``exit CODE: REASON``, and return ``code``: every ending of
    ``bistat run`` prints the code it exits with."""
    click.echo(f"exit {code}: {reason}")
    return code


def _error_lines(outcome) -> list[str]:
    """The first errors of the run's failed requests, for its output."""
    from bistat.core.failures import describe_groups

    if not outcome.failed_requests:
        return []
    return ["first errors:"] + [f"  {line}" for line in
                                describe_groups(outcome.errors, outcome.failed_requests)]


def _finish(outcome, registration, fail_on: frozenset[str]) -> None:
    run_dir = outcome.run_dir
    if outcome.status == "complete":
        flagged = (
            f"; {outcome.failed_requests} failed request(s) in {outcome.failed_passes} flagged pass(es)"
            if outcome.failed_requests
            else ""
        )
        click.echo(f"run complete: {run_dir} ({outcome.passes_run} pass(es) run{flagged})")
        for line in _error_lines(outcome):
            click.echo(line)
        if outcome.detail:
            click.echo(outcome.detail)
        click.echo(f"next: bistat analyze {run_dir}")
        sys.exit(_summarise(run_dir, registration, fail_on))
    if outcome.status == "untested":
        click.echo(f"run untested: {outcome.detail}", err=True)
        click.echo(f"data kept in {run_dir}; the finding will say untested: bistat analyze {run_dir}")
        sys.exit(_summarise(run_dir, registration, fail_on, untested=True))
    if outcome.status == "lost":
        click.echo(f"run stopped: the run directory was lost: {outcome.detail}", err=True)
        click.echo(f"data kept in {run_dir}; check it, then continue with: bistat run --resume "
                   f"{run_dir}", err=True)
        sys.exit(_exit_line(RUN_DIR_LOST, f"the run directory was lost; its records are in "
                                          f"{run_dir}"))
    what = {"interrupted": "interrupted", "incomplete": "stopped", "stopped": "stopped"}.get(
        outcome.status, outcome.status)
    click.echo(f"run {what}: {outcome.detail}", err=True)
    for line in _error_lines(outcome):
        click.echo(line, err=True)
    click.echo(f"data kept in {run_dir}; continue with: bistat run --resume {run_dir}", err=True)
    why = {"interrupted": "the run was interrupted",
           "incomplete": "an engine failed during a pass",
           "stopped": "every request of a pass failed"}.get(outcome.status, "the run stopped early")
    sys.exit(_exit_line(ERROR, f"{why}; resume it with: bistat run --resume {run_dir}"))


def _gpu_busy(experiment: Any, allow: bool) -> str | None:
    """The runner's busy-GPU check (:func:`bistat.run.runner.check_gpu`) in the CLI's words, before
    the run says it starts: refused (--allow-busy-gpu not given), or warned about and returned
    for the run's records. None: nothing there, or not a local GPU run."""
    from bistat.run.runner import GpuBusyError, check_gpu

    try:
        what = check_gpu(experiment, allow_busy_gpu=allow)
    except GpuBusyError as exc:
        raise click.ClickException(exc.explain("--allow-busy-gpu")) from exc
    if what:
        click.echo(f"warning: other processes hold the GPU: {what}; recorded (--allow-busy-gpu)",
                   err=True)
    return what


@click.command("run", epilog=RUN_EXIT_CODES)
@click.argument("registration", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path, file_okay=False),
              help="Continue the run recorded in this directory where it stopped.")
@click.option("--runs-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
              show_default=True, help="Where new run directories <name>-<UTC stamp> go.")
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Record into exactly this (new) directory instead.")
@click.option("--no-progress", is_flag=True, help="Print one line per pass instead of progress bars.")
@click.option("--fail-on", "fail_on", multiple=True, help=OUTCOME_FAIL_ON_HELP)
@click.option("--allow-busy-gpu", is_flag=True,
              help="Start a vLLM run although other processes hold the GPU (recorded; the finding "
                   "lists it as a deviation). Without it such a run is refused.")
def run_command(registration: Path | None, resume_dir: Path | None, runs_dir: Path, run_dir: Path | None,
                no_progress: bool, fail_on: tuple[str, ...], allow_busy_gpu: bool) -> None:
    """Run a sealed registration (preregistrations/NAME.json) and record everything.

    Warm-up passes, then the declared passes per arm in the declared order; every response is
    written as it arrives, so a killed run loses nothing and --resume continues it.
    """
    from bistat.declare.prereg import RegistrationError
    from bistat.run.gpuload import GpuSamplingError, sample_interval_s
    from bistat.run.registered import RunDirTaken, RunRefused, plan_resume, plan_run, record
    from bistat.run.runner import GpuBusyError, ResumeError
    from bistat.run.workload import WorkloadError
    from bistat.store.format import RecordsError

    if (registration is None) == (resume_dir is None):
        raise click.UsageError("give either REGISTRATION or --resume RUN_DIR")
    fail_labels = fail_on_labels(fail_on)
    if resume_dir is not None and run_dir is not None:
        raise click.UsageError("--run-dir cannot be combined with --resume")
    reporter = _reporter(no_progress)
    target = resume_dir
    try:
        sample_interval_s()   # the environment's BISTAT_GPU_SAMPLE_S, before anything is written
        try:
            if resume_dir is not None:
                plan = plan_resume(resume_dir)
                click.echo(f"resuming {resume_dir}")
            else:
                assert registration is not None
                plan = plan_run(registration, runs_dir=runs_dir, run_dir=run_dir)
        except RunDirTaken as exc:
            raise click.ClickException(
                exc.explain("another --run-dir", f"--resume {exc.run_dir}")) from exc
        except (RunRefused, RegistrationError) as exc:
            raise click.ClickException(str(exc)) from exc
        target = plan.run_dir
        if plan.resume:   # a server the killed process left up would hold the GPU: stop it first
            from bistat.run.leftovers import stop_left_servers

            for left in stop_left_servers(plan.run_dir):
                click.echo(left.sentence())
        # checked here first, so that a refusal or a warning comes before the run starts;
        # the runner checks again when nothing was there (a process that came since)
        busy = _gpu_busy(plan.experiment, allow_busy_gpu)
        if not plan.resume:
            click.echo(f"running {plan.experiment.name} into {target}")
        with stoppable():
            outcome = record(plan, reporter=reporter, gpu_busy=busy, allow_busy_gpu=allow_busy_gpu)
    except GpuBusyError as exc:
        raise click.ClickException(exc.explain("--allow-busy-gpu")) from exc
    except (WorkloadError, RecordsError, ResumeError, GpuSamplingError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        _disk_full(target, exc)
    _finish(outcome, plan.registration, fail_labels)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """SIGINT and SIGTERM stop a run as Ctrl-C does (``KeyboardInterrupt``; for SIGTERM its
    subclass :class:`bistat.run.runner.SignalInterrupt`, so the run says which: the runner records
    the pass in flight as interrupted, keeps every response received and stops its engines).

    Also when the process started with SIGINT ignored, as a background job of a non-interactive
    shell does (``cmd &``, the device's ``run_bg.sh``): Python then installs no handler, so
    without this a SIGINT to such a run would do nothing. And a plain ``kill`` (SIGTERM) would
    end the process without stopping its engines. The previous handlers come back afterwards;
    outside the main thread (where signals cannot be handled) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _terminate(signum: int, frame: Any) -> None:
        from bistat.run.runner import SignalInterrupt

        raise SignalInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _disk_full(run_dir: Path, exc: OSError) -> None:
    """A write failed for lack of space: say what was kept, the free space and how to resume,
    and exit 1 (no traceback). Records are appended whole lines at a time, so every line written
    before stays readable; a line cut by the failure is skipped on reading and re-run on resume."""
    import shutil

    from bistat.store.readers import read_jsonl

    try:
        kept = len(read_jsonl(run_dir / "responses.jsonl")[0])
    except Exception:  # noqa: BLE001 - the count is informative; the message must still come
        kept = 0
    try:
        free = _size(shutil.disk_usage(run_dir).free)
    except OSError:
        free = "unknown"
    click.echo(f"run stopped: no space left on device (disk full) writing under {run_dir}: "
               f"{exc.strerror or exc}", err=True)
    click.echo(f"kept {kept} response(s) in {run_dir / 'responses.jsonl'}; free space there now: "
               f"{free}", err=True)
    click.echo(f"free some space, then continue with: bistat run --resume {run_dir}", err=True)
    sys.exit(_exit_line(ERROR, f"no space left on device; free some, then resume it with: "
                               f"bistat run --resume {run_dir}"))


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.1f} TiB"


def register(group: click.Group) -> None:
    group.add_command(run_command)
