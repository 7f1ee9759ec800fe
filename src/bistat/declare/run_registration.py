"""The registration a recorded run belongs to: one resolver, with the seal checked.

A run's ``run.json`` names its registration (``registration.path`` and ``registration.sha256``).
:func:`run_registration` is the one way every command finds it -- ``bistat analyze``, ``inspect``,
``diagnose``, ``replay``, the probe's needle lookup, the trim and ``bistat run --resume``:

1. the file: the path given (``bistat analyze --registration``), else the one ``run.json`` names,
   tried as recorded (relative to where ``bistat run`` started) and then relative to the run
   directory (:attr:`bistat.store.run_dir.RecordedRun.registration_path`);
2. its seal: the content hash and the amendment log (:func:`bistat.declare.prereg.load_registration`),
   and that git does not hold the file as committed with other content
   (:func:`bistat.declare.prereg.git_evidence`).

A registration that cannot be found or does not verify raises :class:`RunRegistrationError`,
which names the file and the fix. Whether the seal is the one the run recorded
(:attr:`RunRegistration.is_recorded_seal`) is the caller's to judge: the analysis accepts a
sibling registration named on the command line, a resumed run accepts only its own seal.
The result is kept with the :class:`~bistat.store.run_dir.RecordedRun`, so a run opened once
resolves its registration once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bistat.declare.git_evidence import git_evidence
from bistat.declare.registration import Registration, RegistrationError, load_registration
from bistat.store.format import HEADER_FILE
from bistat.store.restore import restore_hint
from bistat.store.run_dir import RecordedRun

__all__ = ["RunRegistration", "RunRegistrationError", "run_registration", "run_declaration"]


class RunRegistrationError(RegistrationError):
    """The registration a run names is not named, not here, or its seal does not verify.

    ``reason`` is one of ``"not named"``, ``"not found"``, ``"seal broken"`` and
    ``"changed after commit"``.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RunRegistration:
    """A run's registration as resolved, its seal verified."""

    #: the registration, loaded with its seal checked
    registration: Registration
    #: ``run.json``'s ``registration.sha256`` (None when it records none)
    recorded_sha256: str | None

    @property
    def path(self) -> Path:
        return Path(self.registration.path)

    @property
    def is_recorded_seal(self) -> bool:
        """Whether the registration's seal is the one the run recorded (or the run recorded none)."""
        return self.recorded_sha256 in (None, self.registration.sha256)

    @property
    def recorded_earlier_seal(self) -> bool:
        """Whether the run recorded a seal this registration had before an amendment."""
        return self.recorded_sha256 in self.registration.previous_sha256s


_RESOLVED: "weakref.WeakKeyDictionary[RecordedRun, RunRegistration]" = weakref.WeakKeyDictionary()


def _recorded(header: Mapping[str, Any]) -> Mapping[str, Any]:
    reg = header.get("registration")
    return reg if isinstance(reg, Mapping) else {}


def run_registration(run: RecordedRun | str | Path,
                     registration: str | Path | None = None) -> RunRegistration:
    """The registration of a recorded run, its seal verified (see the module docstring).

    Parameters
    ----------
    run : RecordedRun or path
        The run (a path is opened).
    registration : path, optional
        The registration to use instead of the one ``run.json`` names (``bistat analyze
        --registration``: the run's own when its recorded path does not resolve here, or a
        sibling). Its seal is checked the same way.

    Raises
    ------
    RunRegistrationError
        Naming ``run.json`` or the registration file, what is wrong and the fix.
    """
    run = RecordedRun.of(run)
    if registration is None and run in _RESOLVED:
        return _RESOLVED[run]
    run_json = run.path / HEADER_FILE
    recorded = _recorded(run.header)
    if registration is not None:
        path = Path(registration)
    else:
        found = run.registration_path
        if found is None:
            raise RunRegistrationError(
                f"{run_json}: field 'registration.path' missing; pass --registration PATH",
                "not named")
        path = found
    if not path.exists():
        named = (f"registration.path {recorded.get('path')!r}" if registration is None
                 else f"the registration {str(path)!r}")
        raise RunRegistrationError(
            f"{run_json}: {named} does not exist here (a relative path is tried from the "
            f"working directory, then from the run directory); run from where it is found, or "
            f"pass --registration PATH", "not found")
    fix = (f"restore the registration as it was sealed {restore_hint(path)}, and check it "
           f"with `bistat verify {path} {run.path}`")
    try:
        reg = load_registration(path)
    except RegistrationError as exc:
        raise RunRegistrationError(f"{exc}\n{fix}", "seal broken") from exc
    evidence = git_evidence(reg.path)
    if evidence.status == "differs":   # rewritten after it was committed: not the seal
        raise RunRegistrationError(f"{reg.path}: {evidence.line()}; check it with: "
                                   f"bistat verify {reg.path} {run.path}", "changed after commit")
    result = RunRegistration(reg, recorded.get("sha256") if isinstance(recorded.get("sha256"), str)
                             else None)
    if registration is None:
        _RESOLVED[run] = result
    return result


def run_declaration(run: RecordedRun | str | Path) -> dict[str, Any] | None:
    """The sealed declaration of the registration ``run.json`` names (:func:`run_registration`).

    None when the run names no registration or its file is not here (callers then use their
    defaults); :class:`RunRegistrationError` when the file is here but its seal does not verify.
    """
    try:
        return run_registration(run).registration.declaration
    except RunRegistrationError as exc:
        if exc.reason in ("not named", "not found"):
            return None
        raise
