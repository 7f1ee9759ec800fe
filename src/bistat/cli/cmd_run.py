"""``bistat run`` (execute a registered experiment) and ``bistat probe`` (the bitwise invariance probe)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import click

from bistat.cli.exitcodes import ERROR, RUN_DIR_LOST

RUN_EXIT_CODES = """\b
Exit codes: 0 the run ended (the whole schedule ran; failed requests, if
any, are flagged in the records) and --fail-on names no verdict it got;
1 error, or the run stopped early (engine died, Ctrl-C: resume it with
--resume); 3 the run directory was removed or replaced while the run
recorded (it stops before the next pass and copies its records into
RUN_DIR.rescued-<UTC stamp> beside it); with --fail-on, the code of the
first verdict whose label it names: 10 doubtful, 11 reported as
observed, 12 untested (also when an engine refused the setting or failed
to start; the data so far is kept).
The run ends with a one-screen summary of its analysis for CI logs."""

PROBE_EXIT_CODES = """\b
Exit codes: 0 whatever the outcome unless --fail-on names its label;
1 error. Outcomes map to labels: confirmed (bitwise invariant and the
negative control differs) -> working; violated (a probed arm gave the
needle different bits) -> 'reported as observed' (11); no_power (the
negative control did not differ either), vacuous (the engine's batching
evidence does not show the needle sharing a step with other requests)
and untested (an engine could not run, or the mode is unsupported)
-> untested (12)."""

#: Probe outcome -> verdict label (``bistat.report.gating.PROBE_OUTCOME_LABELS`` plus ``vacuous``).
from bistat.report.gating import PROBE_OUTCOME_LABELS as PROBE_LABELS  # probe outcome -> verdict label
from bistat.analysis.probe_report import FILLER_TOKENS, LONG_NEEDLES, NEEDLE_TOKENS

FAIL_ON_HELP = ("Exit non-zero when the outcome has one of these verdict labels (comma-separated, "
                "or repeated; 'any' for all): doubtful, reported-as-observed, untested.")


def _fail_on(values: tuple[str, ...]) -> frozenset[str]:
    from bistat.report.gating import FailOnError, parse_fail_on

    try:
        return parse_fail_on(values)
    except FailOnError as exc:
        raise click.UsageError(str(exc)) from exc


def _reporter(no_progress: bool):
    from rich.console import Console

    from bistat.run.runner import PlainReporter, RichReporter

    console = Console(stderr=True)
    if no_progress or not console.is_terminal:
        return PlainReporter(lambda line: click.echo(line, err=True))
    return RichReporter(console)


def _summarise(run_dir: Path, registration, fail_on: frozenset[str]) -> int:
    """Analyse the recorded run, print the CI summary, return the gate's exit code.

    An analysis that cannot be made is reported (the data is kept) and exits 1 when --fail-on
    was given (a gate that cannot be evaluated must not pass), else 0.
    """
    from bistat.analysis.summary import AnalysisError, analyze_run
    from bistat.declare.experiment import DeclarationError
    from bistat.report.gating import ci_summary, gate
    from bistat.declare.prereg import RegistrationError
    from bistat.store.format import RecordsError

    try:
        summary = analyze_run(run_dir, registration)
    except (AnalysisError, RecordsError, RegistrationError, DeclarationError) as exc:
        click.echo(f"cannot summarise the run: {exc}", err=True)
        return ERROR if fail_on else 0
    click.echo(ci_summary(summary, fail_on), nl=False)
    return gate([c.verdict.label.value for c in summary.comparisons], fail_on).exit_code


def _finish(outcome, registration, fail_on: frozenset[str]) -> None:
    run_dir = outcome.run_dir
    if outcome.status == "complete":
        flagged = (
            f"; {outcome.failed_requests} failed request(s) in {outcome.failed_passes} flagged pass(es)"
            if outcome.failed_requests
            else ""
        )
        click.echo(f"run complete: {run_dir} ({outcome.passes_run} pass(es) run{flagged})")
        if outcome.detail:
            click.echo(outcome.detail)
        click.echo(f"next: bistat analyze {run_dir}")
        sys.exit(_summarise(run_dir, registration, fail_on))
    if outcome.status == "untested":
        click.echo(f"run untested: {outcome.detail}", err=True)
        click.echo(f"data kept in {run_dir}; the finding will say untested: bistat analyze {run_dir}")
        # an engine that could not start (or refused its setting) is a failed run: non-zero even
        # without --fail-on, whose own code wins when it names the verdict
        sys.exit(_summarise(run_dir, registration, fail_on) or ERROR)
    if outcome.status == "lost":
        click.echo(f"run stopped: the run directory was lost: {outcome.detail}", err=True)
        click.echo(f"data kept in {run_dir}; check it, then continue with: bistat run --resume "
                   f"{run_dir}", err=True)
        sys.exit(RUN_DIR_LOST)
    what = "interrupted" if outcome.status == "interrupted" else "stopped"
    click.echo(f"run {what}: {outcome.detail}", err=True)
    click.echo(f"data kept in {run_dir}; continue with: bistat run --resume {run_dir}", err=True)
    sys.exit(ERROR)


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
@click.option("--fail-on", "fail_on", multiple=True, help=FAIL_ON_HELP)
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
    fail_labels = _fail_on(fail_on)
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
    """SIGINT and SIGTERM stop a run as Ctrl-C does (``KeyboardInterrupt``: the runner records
    the pass in flight as interrupted, keeps every response received and stops its engines).

    Also when the process started with SIGINT ignored, as a background job of a non-interactive
    shell does (``cmd &``, the device's ``run_bg.sh``): Python then installs no handler, and on
    2026-12-03 a SIGINT to such a run did nothing. And a plain ``kill`` (SIGTERM) would have
    ended the process without stopping its engines. The previous handlers come back afterwards;
    outside the main thread (where signals cannot be handled) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

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
    sys.exit(ERROR)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.1f} TiB"


@click.command("probe", epilog=PROBE_EXIT_CODES)
@click.argument("declaration", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--arm", "arms", multiple=True,
              help="Arm to probe (repeatable; default: every treatment arm).")
@click.option("--control", default=None,
              help="Negative-control arm, which must show a difference (default: the control arm).")
@click.option("--no-control", is_flag=True, help="Run no negative control (the outcome is then at best no_power).")
@click.option("--trials", default=3, show_default=True, type=click.IntRange(min=1),
              help="Placements of the needle among fillers.")
@click.option("--min-fillers", default=32, show_default=True, type=click.IntRange(min=1),
              help="Fewest filler prompts around the needle.")
@click.option("--max-fillers", default=128, show_default=True, type=click.IntRange(min=1),
              help="Most filler prompts around the needle.")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1),
              help="Tokens per needle [default: 128 in the kv-sweep design, else the "
                   "declaration's workload.max_tokens].")
@click.option("--design", default="kv-sweep", show_default=True,
              type=click.Choice(["kv-sweep", "single"]),
              help="batch mode: kv-sweep runs needles of several lengths (the needle prompt, then "
                   "--long-needles) among fillers that arrive while they decode, and gives a "
                   "verdict per needle; single runs one needle among fillers submitted at once.")
@click.option("--long-needles", default=",".join(map(str, LONG_NEEDLES)), show_default=True,
              callback=lambda ctx, param, value: _lengths(value),
              help="kv-sweep: approximate prompt tokens of the needles added to the needle prompt "
                   "(comma-separated; '' for none).")
@click.option("--filler-tokens", default=FILLER_TOKENS, show_default=True,
              type=click.IntRange(min=1), help="kv-sweep: tokens each filler generates.")
@click.option("--needle", "needle_index", default=0, show_default=True, type=click.IntRange(min=0),
              help="Index of the needle prompt in the declaration's prompt source.")
@click.option("--needle-from", "needle_from", type=click.Path(path_type=Path, file_okay=False),
              help="Choose the needle from this recorded run of the same workload: the prompt "
                   "whose outputs first diverged earliest (bitwise, any arm and counted pass; "
                   "ties: the lowest index). Excludes --needle.")
@click.option("--seed", default=None, type=int, help="Placement seed [default: the declaration's workload.seed].")
@click.option("--output", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write the JSON report to this file.")
@click.option("--mode", default="batch", show_default=True,
              type=click.Choice(["batch", "prefill-decode", "prefix-cache"]),
              help="batch: the needle alone and among fillers; prefill-decode: decode logprobs "
                   "against prefilling the same prefix; prefix-cache: prefix cache cold vs warm.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the summary.")
@click.option("--fail-on", "fail_on", multiple=True, help=FAIL_ON_HELP)
def probe_command(declaration: Path, arms: tuple[str, ...], control: str | None, no_control: bool,
                  trials: int, min_fillers: int, max_fillers: int, max_tokens: int | None,
                  design: str, long_needles: tuple[int, ...], filler_tokens: int,
                  needle_index: int, needle_from: Path | None, seed: int | None, mode: str,
                  output: Path | None, as_json: bool, fail_on: tuple[str, ...]) -> None:
    """Bitwise invariance probe: needle prompts alone, then among fillers, on a declaration's engine.

    DECLARATION is an experiments/NAME.toml or a preregistrations/NAME.json. Token ids and
    logprobs are compared bitwise: each needle alone against the needle in each batch, and each
    filler that ran in two or more trials across them. The default design (kv-sweep) runs the
    needle prompt and needles of about 112, 176, 304 and 600 prompt tokens, 128 tokens each,
    while fillers of 16 tokens keep arriving, so that their attention crosses the KV tiles of
    attention kernels (64 to 640 keys) beside prefills, and gives a verdict per needle. The
    negative control (invariance off) runs first and must differ, or the probe is reported as
    lacking power. With --needle-from RUN_DIR the needle is the prompt a recorded run of the
    same workload saw diverge first.
    """
    from click.core import ParameterSource

    from bistat.declare.experiment import DeclarationError, load_experiment
    from bistat.analysis.probe_report import ProbeReport, ProbeSettings
    from bistat.explain.probe import needle_from_run, run_probe
    from bistat.store.format import RecordsError
    from bistat.run.workload import WorkloadError

    if no_control and control is not None:
        raise click.UsageError("--control and --no-control exclude each other")
    needle_given = (click.get_current_context().get_parameter_source("needle_index")
                    not in (ParameterSource.DEFAULT, None))
    if needle_from is not None and needle_given:
        raise click.UsageError("--needle and --needle-from exclude each other")
    fail_labels = _fail_on(fail_on)
    try:
        if declaration.suffix == ".json":
            from bistat.declare.prereg import RegistrationError, load_registration

            try:
                experiment = load_registration(declaration).experiment()
            except RegistrationError as exc:
                raise click.ClickException(str(exc)) from exc
        else:
            experiment = load_experiment(declaration)
        source = None
        if needle_from is not None:
            source = needle_from_run(needle_from, experiment, declaration=str(declaration))
            needle_index = source.prompt_index
            click.echo(f"needle: {source.describe()}", err=True)
        sweep = mode == "batch" and design == "kv-sweep"
        settings = ProbeSettings(
            trials=trials,
            min_fillers=min_fillers,
            max_fillers=max_fillers,
            needle_index=needle_index,
            max_tokens=max_tokens or (NEEDLE_TOKENS if sweep else experiment.workload.max_tokens),
            seed=experiment.workload.seed if seed is None else seed,
            mode=mode,
            design=design,
            long_needles=long_needles,
            filler_tokens=filler_tokens,
        )
        saved: list[int] = []

        def keep(partial: ProbeReport) -> None:
            # every finished arm goes to disk at once: an interrupted probe loses only its
            # current arm
            if output is not None:
                _write_json_atomic(output, partial.to_json())
                saved.append(len(partial.arms))

        try:
            report = run_probe(
                experiment,
                arms=list(arms) or None,
                control="" if no_control else control,
                settings=settings,
                on_arm=None if as_json else (lambda name: click.echo(f"probing arm {name} ...", err=True)),
                on_report=keep,
                needle_source=source,
            )
        except KeyboardInterrupt:
            kept = (f"the report of the {saved[-1]} finished arm(s) is in {output}" if saved
                    else "no arm had finished, nothing was written")
            click.echo(f"interrupted: {kept}", err=True)
            sys.exit(130)
    except DeclarationError as exc:
        raise click.ClickException(str(exc)) from exc
    except (ValueError, WorkloadError, RecordsError) as exc:
        raise click.ClickException(str(exc)) from exc
    data = report.to_json()
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        for line in report.summary_lines():
            click.echo(line)
    from bistat.report.gating import gate

    result = gate([PROBE_LABELS[report.outcome]], fail_labels)
    click.echo(f"exit {result.exit_code}: {result.reason}", err=as_json)
    sys.exit(result.exit_code)


def _lengths(value: str) -> tuple[int, ...]:
    """``--long-needles``: comma-separated positive, increasing prompt lengths."""
    try:
        out = tuple(int(x) for x in value.replace(" ", "").split(",") if x)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated token counts, e.g. "
                                 "112,176,304,600") from None
    if any(x < 1 for x in out) or list(out) != sorted(set(out)):
        raise click.BadParameter(f"{value!r}: expected increasing token counts of at least 1")
    return out


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def register(group: click.Group) -> None:
    group.add_command(run_command)
    group.add_command(probe_command)
