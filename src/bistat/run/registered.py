"""Running a sealed registration: the library side of ``bistat run`` (and of ``bistat.run(...)``).

A run never starts from a declaration: the registration is verified first (its seal intact, and
no recorded datum earlier than it), a new run directory is chosen, the run is noted beside the
registration and the runner records it (:func:`bistat.run.runner.start_run`). Resuming finds the
run's registration the way the analysis does, refuses a registration sealed since, verifies it
and continues (:func:`bistat.run.runner.resume_run`).

In two steps, so that a caller may speak between them (the CLI checks the GPU and says where the
run goes): :func:`plan_run` / :func:`plan_resume` check everything and write nothing;
:func:`record` writes. :func:`run` and :func:`resume` are both steps at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bistat.declare.prereg import (
    DEFAULT_RUNS_DIR,
    Registration,
    load_registration,
    note_run,
    verify,
)
from bistat.run.runner import EngineFactory, Reporter, RunOutcome, new_run_dir, resume_run, start_run

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment

__all__ = ["RunDirTaken", "RunPlan", "RunRefused", "plan_resume", "plan_run", "record", "resume",
           "run", "verified_registration"]


class RunRefused(ValueError):
    """A registration or a run directory that a run must not use; the message says why and what
    to do instead."""


class RunDirTaken(RunRefused):
    """The chosen run directory already holds a run (a run is never overwritten)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        super().__init__(self.explain("another run directory", f"resume({str(run_dir)!r})"))

    def explain(self, another: str, resume_it: str) -> str:
        """The refusal in words, naming ``another`` way to choose a directory and how to
        ``resume_it`` (the CLI says ``--run-dir`` and ``--resume``)."""
        return (f"{self.run_dir}: a run is already recorded here; choose {another} or continue "
                f"it with {resume_it}")


@dataclass(frozen=True)
class RunPlan:
    """A checked run that has not written anything yet (see :func:`record`)."""

    registration: Registration
    experiment: "Experiment"
    run_dir: Path
    resume: bool


def verified_registration(path: str | Path, runs_dir: str | Path = DEFAULT_RUNS_DIR) -> Registration:
    """The registration at ``path``, verified: its seal intact and every run recorded against it
    under ``runs_dir`` later than it (:func:`bistat.declare.prereg.verify`).

    Raises
    ------
    RunRefused
        ``path`` does not exist, is a declaration (``.toml``), or the registration does not
        verify (the problems, one per line).
    RegistrationError
        The registration cannot be read.
    """
    path = Path(path)
    if path.suffix.lower() == ".toml" and not path.exists():   # missing: not "a declaration"
        raise RunRefused(f"{path}: no such file; run a sealed registration: bistat run "
                         "preregistrations/NAME.json (bistat register experiments/NAME.toml "
                         "writes it)")
    if path.suffix.lower() == ".toml":
        raise RunRefused(f"{path} is a declaration, not a registration; register it first: "
                         f"bistat register {path}")
    report = verify(path, runs_dirs=(runs_dir,))
    if not report.ok:
        raise RunRefused("\n".join(report.problems) + "\nrefusing to run an unverified "
                         f"registration; check it with: bistat verify {path}")
    return load_registration(path)


def plan_run(registration: str | Path, *, runs_dir: str | Path = DEFAULT_RUNS_DIR,
             run_dir: str | Path | None = None) -> RunPlan:
    """Check a new run of ``registration``: verified, into ``run_dir`` or else a new
    ``runs_dir/NAME-<UTC stamp>`` (:func:`bistat.run.runner.new_run_dir`) that holds no run.

    Raises
    ------
    RunRefused, RunDirTaken, RegistrationError
    """
    reg = verified_registration(registration, runs_dir)
    experiment = reg.experiment()
    target = Path(run_dir) if run_dir is not None else new_run_dir(Path(runs_dir), experiment.name)
    if (target / "run.json").exists():
        raise RunDirTaken(target)
    return RunPlan(reg, experiment, target, resume=False)


def plan_resume(run_dir: str | Path) -> RunPlan:
    """Check that the run recorded in ``run_dir`` can continue: its registration found as the
    analysis finds it (:func:`bistat.declare.run_registration.run_registration`), sealed as the
    run recorded it, and verified against the runs beside ``run_dir``.

    Raises
    ------
    RunRefused, RegistrationError
    """
    from bistat.declare.run_registration import RunRegistrationError, run_registration
    from bistat.store.format import RecordsError
    from bistat.store.run_dir import RecordedRun

    run_dir = Path(run_dir)
    try:
        recorded = RecordedRun.open(run_dir)
        found = run_registration(recorded)
    except (RecordsError, RunRegistrationError) as exc:
        raise RunRefused(f"cannot resume: {exc}") from exc
    ref = recorded.header.get("registration") or {}
    if not found.is_recorded_seal or ref.get("sha256") is None:
        raise RunRefused(
            f"{run_dir / 'run.json'}: recorded against registration seal {ref.get('sha256')}, "
            f"but {found.path} is now sealed as {found.registration.sha256}; a run cannot "
            "continue under another registration")
    reg = verified_registration(found.path, run_dir.parent)
    return RunPlan(reg, reg.experiment(), run_dir, resume=True)


def record(plan: RunPlan, *, reporter: Reporter | None = None, gpu_busy: str | None = None,
           allow_busy_gpu: bool = False, engine_factory: EngineFactory | None = None
           ) -> RunOutcome:
    """Record the planned run: a new one is noted beside its registration
    (:func:`bistat.declare.prereg.note_run`) and started (:func:`bistat.run.runner.start_run`),
    a resumed one continued (:func:`bistat.run.runner.resume_run`). ``gpu_busy`` and
    ``allow_busy_gpu`` as for :func:`~bistat.run.runner.start_run`.

    Raises
    ------
    bistat.run.runner.GpuBusyError
        Other processes hold the GPU and ``allow_busy_gpu`` is false.
    """
    if plan.resume:
        return resume_run(plan.experiment, plan.run_dir, engine_factory=engine_factory,
                          reporter=reporter, gpu_busy=gpu_busy, allow_busy_gpu=allow_busy_gpu)
    note_run(plan.registration, plan.run_dir)
    return start_run(plan.experiment, plan.registration.reference(), plan.run_dir,
                     engine_factory=engine_factory, reporter=reporter, gpu_busy=gpu_busy,
                     allow_busy_gpu=allow_busy_gpu)


def run(registration: str | Path, *, runs_dir: str | Path = DEFAULT_RUNS_DIR,
        run_dir: str | Path | None = None, reporter: Reporter | None = None,
        allow_busy_gpu: bool = False, engine_factory: EngineFactory | None = None) -> RunOutcome:
    """Run a sealed registration and record everything, as ``bistat run REGISTRATION`` does.

    Parameters
    ----------
    registration
        ``preregistrations/NAME.json``; it must verify (:func:`bistat.declare.prereg.verify`).
    runs_dir
        Where the new run directory ``NAME-<UTC stamp>`` goes, and where earlier runs of the
        registration are looked for when it is verified.
    run_dir
        Record into exactly this new directory instead.
    reporter
        Progress (:class:`bistat.run.runner.PlainReporter`, ...; default: none).
    allow_busy_gpu
        Start engines on this machine's GPU although other processes hold it (recorded; the
        finding lists it as a deviation).
    engine_factory
        ``(experiment, arm) -> Engine``; default: the registered adapters.

    Returns
    -------
    bistat.run.runner.RunOutcome
        How the run ended and where it is recorded.

    Raises
    ------
    RunRefused, RegistrationError, bistat.run.runner.GpuBusyError
    """
    return record(plan_run(registration, runs_dir=runs_dir, run_dir=run_dir), reporter=reporter,
                  allow_busy_gpu=allow_busy_gpu, engine_factory=engine_factory)


def resume(run_dir: str | Path, *, reporter: Reporter | None = None, allow_busy_gpu: bool = False,
           engine_factory: EngineFactory | None = None) -> RunOutcome:
    """Continue the run recorded in ``run_dir`` where it stopped, as ``bistat run --resume``
    does (see :func:`plan_resume` for what is checked first).

    Raises
    ------
    RunRefused, RegistrationError, bistat.run.runner.ResumeError, bistat.run.runner.GpuBusyError
    """
    return record(plan_resume(run_dir), reporter=reporter, allow_busy_gpu=allow_busy_gpu,
                  engine_factory=engine_factory)
