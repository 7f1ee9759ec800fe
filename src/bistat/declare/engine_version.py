"""The engine version a run measured, set against the newest release known and the version its
registration requires; and the execution mode each arm's engine ran in.

Everything here is read from what was recorded (no clock, no network), so a finding regenerates
byte for byte: the engine's version and commit and its compilation / CUDA-graph modes from
``environment.jsonl`` (the modes of runs recorded before they were, from the kept engine logs:
:func:`bistat.store.enginelog.logged_modes`), the newest-release checks from the registration's seal
(``engine_release``, made at ``bistat register``), from the run's events (``release_check``,
made when the run started on a machine that reaches the package index) and from the
registration's release log (``NAME.releases.jsonl``: checks made later by ``bistat check-release``
or at ``bistat register --amend``; :mod:`bistat.declare.release_log`), and the required version
from the declaration (``engine.required_version``). :mod:`bistat.declare.releases` makes the checks.

The comparison uses the latest check that found a release; a run with no recorded check says so.
A check from the release log is stated with its time against the run's first record (before or
after it), and the sentence says when the checks made at registration and at the run's start knew
no newest release: a release found later is never presented as known when the study was sealed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from packaging.version import InvalidVersion, Version

from bistat.store.enginelog import EngineModes
from bistat.store.format import parse_time
from bistat.declare.release_log import LoggedCheck
from bistat.declare.experiment import required_specifier
from bistat.declare.releases import ReleaseCheck

__all__ = ["ArmEngine", "EngineVersionReport", "ENGINE_PACKAGES", "check_label",
           "compare_versions", "engine_version_report", "required_specifier"]

#: The package whose releases an engine kind's version is compared with.
ENGINE_PACKAGES = {"vllm-server": "vllm", "vllm-offline": "vllm", "sglang-server": "sglang"}


@dataclass(frozen=True)
class ArmEngine:
    """One arm's engine as recorded at its last start."""

    arm: str
    version: str | None
    commit: str | None
    modes: EngineModes | None


@dataclass(frozen=True)
class EngineVersionReport:
    """What a finding says about the engine's version (see the module docstring).

    Attributes
    ----------
    package : str or None
        The engine's package (``vllm``, ``sglang``); None for engines without releases to compare with.
    arms : tuple of ArmEngine
    checks : tuple of (str, ReleaseCheck)
        Every recorded newest-release check, oldest first: ``registration`` (the seal), ``run``
        (events), ``check-release`` and ``amend`` (the registration's release log).
    used : (str, ReleaseCheck) or None
        The check the comparison rests on: the latest that found a release, else the latest.
    comparison : tuple of str
        One sentence per distinct recorded engine version.
    required : str or None
        The version specifier the declaration requires (``engine.required_version``).
    deviations : tuple of str
        Arms whose recorded version the requirement excludes (or that recorded none).
    first_record_utc : str or None
        The run's first record (``run.json``'s ``created_utc``): later checks are dated against it.
    """

    package: str | None
    arms: tuple[ArmEngine, ...]
    checks: tuple[tuple[str, ReleaseCheck], ...]
    used: tuple[str, ReleaseCheck] | None
    comparison: tuple[str, ...]
    required: str | None
    deviations: tuple[str, ...]
    first_record_utc: str | None = None

    def label(self, where: str, check: ReleaseCheck) -> str:
        """The check's row label in a finding's table (:func:`check_label`)."""
        return check_label(where, check, self.first_record_utc)


def compare_versions(version: str, newest: str) -> str:
    """``newest``, ``older`` or ``newer`` (a development build), or ``incomparable``.

    >>> compare_versions("0.25.0", "0.33.0"), compare_versions("0.33.0", "0.33.0")
    ('older', 'newest')
    """
    try:
        v, n = Version(version), Version(newest)
    except InvalidVersion:
        return "incomparable"
    return "newest" if v == n else "older" if v < n else "newer"


#: Where a check was made, for the checks of the release log (after the seal).
_LATER = {"check-release": "by `bistat check-release`",
          "amend": "when the registration was amended (`bistat register --amend`)"}


def _relation(check: ReleaseCheck, first_record_utc: str | None) -> str | None:
    """``before`` / ``after`` the run's first record, or None when either time is unreadable."""
    try:
        checked, first = parse_time(check.checked_utc), parse_time(first_record_utc)
    except (TypeError, ValueError):
        return None
    return "before" if checked < first else "after"


def check_label(where: str, check: ReleaseCheck, first_record_utc: str | None) -> str:
    """``registration``, ``run``, or for a release-log check what made it and whether it came
    before or after the run's first record: ``bistat check-release, after the run``."""
    if where not in _LATER:
        return where
    made = "bistat check-release" if where == "check-release" else "amendment"
    rel = _relation(check, first_record_utc)
    return made if rel is None else f"{made}, {rel} the run"


def _where(where: str, check: ReleaseCheck, first_record_utc: str | None) -> str:
    if where not in _LATER:
        at = "at registration" if where == "registration" else "when the run started"
        return f"{check.index}, checked {check.checked_utc} {at}"
    rel = _relation(check, first_record_utc)
    first = "" if rel is None else f", {rel} the run's first record ({first_record_utc})"
    return f"{check.index}, checked {check.checked_utc} {_LATER[where]}{first}"


def _unknown_before(used: tuple[str, ReleaseCheck],
                    checks: Sequence[tuple[str, ReleaseCheck]]) -> str:
    """``; the newest release was unknown at registration and when the run started`` when the
    comparison rests on a release-log check and those checks found none (empty otherwise)."""
    if used[0] not in _LATER:
        return ""
    at = {"registration": "at registration", "run": "when the run started"}
    missing = list(dict.fromkeys(at[w] for w, c in checks if w in at and c.newest is None))
    return f"; the newest release was unknown {' and '.join(missing)}" if missing else ""


def _sentence(package: str, version: str | None, commit: str | None,
              used: tuple[str, ReleaseCheck] | None,
              checks: Sequence[tuple[str, ReleaseCheck]] = (),
              first_record_utc: str | None = None) -> str:
    label = f"{package} {version}" + (f" ({commit})" if commit else "") if version else None
    if label is None:
        return f"The engine's {package} version was not recorded: it cannot be compared."
    if used is None:
        return (f"{label}: no check of the newest {package} release was recorded with this run "
                "or its registration, so how it compares with the newest release is unknown.")
    where, check = used
    if check.newest is None:
        return (f"{label}: the newest {package} release is unknown ({check.error}; "
                f"{_where(where, check, first_record_utc)}).")
    how = compare_versions(version, check.newest)
    text = {"newest": f"the newest release known ({check.newest})",
            "older": f"older than the newest release known, {check.newest}",
            "newer": f"newer than the newest release known, {check.newest} (a pre-release or "
                     "development build)",
            "incomparable": f"not comparable with the newest release known, {check.newest}"}[how]
    return (f"{label} is {text} ({_where(where, check, first_record_utc)})"
            f"{_unknown_before(used, checks)}.")


def engine_version_report(engine_kind: str | None, declaration: Mapping[str, Any],
                          sealed: Mapping[str, Any], environment: Iterable[Mapping[str, Any]],
                          events: Iterable[Mapping[str, Any]],
                          logged: Mapping[str, Sequence[EngineModes | None]] | None = None,
                          *, later_checks: Sequence[LoggedCheck] = (),
                          first_record_utc: str | None = None) -> EngineVersionReport:
    """The report for one run (pure: the caller reads the records).

    Parameters
    ----------
    engine_kind : str or None
        ``run.json``'s ``engine_kind``.
    declaration : mapping
        The sealed declaration (``engine.required_version``, arm names in order).
    sealed : mapping
        The registration's sealed content (``engine_release``: the check made at registration).
    environment : iterable of mapping
        ``environment.jsonl`` rows (``arm``, ``engine``: kind/version/commit, ``modes``).
    events : iterable of mapping
        ``events.jsonl`` rows (``release_check`` events carry the run's check).
    logged : mapping, optional
        Arm -> modes per engine start from the kept engine logs, for rows without ``modes``.
    later_checks : sequence of LoggedCheck
        The registration's release log, verified
        (:func:`bistat.declare.prereg.release_log_checks`).
    first_record_utc : str, optional
        The run's first record (``run.json``'s ``created_utc``), which the release log's checks
        are dated against.
    """
    package = ENGINE_PACKAGES.get(engine_kind or "")
    last: dict[str, Mapping[str, Any]] = {}
    starts: dict[str, int] = {}
    for row in environment:
        arm = str(row.get("arm"))
        last[arm] = row
        starts[arm] = starts.get(arm, 0) + 1
    arms = []
    for a in declaration.get("arms") or []:
        name = str(a.get("name"))
        row = last.get(name)
        if row is None:
            continue
        engine = row.get("engine") if isinstance(row.get("engine"), Mapping) else {}
        modes = None
        from_log = (logged[name][starts[name] - 1]
                    if logged and logged.get(name) and len(logged[name]) >= starts[name] else None)
        if isinstance(row.get("modes"), Mapping) and row.get("modes"):
            modes = EngineModes.from_dict(dict(row["modes"]))
            if from_log is not None and from_log.breakable_cudagraph and not modes.breakable_cudagraph:
                # bistat's offline worker read breakable graphs from the environment variable
                # vLLM 0.33 sets; 0.34 keeps the switch in its config instead, and its log says so
                modes = EngineModes(modes.compilation_mode, modes.cudagraph_mode, True,
                                    f"{modes.source}; breakable CUDA graphs from the engine log")
        else:
            modes = from_log
        arms.append(ArmEngine(name, engine.get("version"), engine.get("commit"), modes))
    checks: list[tuple[str, ReleaseCheck]] = []
    if isinstance(sealed.get("engine_release"), Mapping):
        checks.append(("registration", ReleaseCheck.from_dict(sealed["engine_release"])))
    for ev in events:
        if ev.get("event") == "release_check" and isinstance(ev.get("release_check"), Mapping):
            checks.append(("run", ReleaseCheck.from_dict(ev["release_check"])))
    checks += [(c.by, c.check) for c in later_checks]
    try:  # oldest first; the recorded order where a time is unreadable
        checks.sort(key=lambda c: parse_time(c[1].checked_utc))
    except (TypeError, ValueError):
        pass
    found = [c for c in checks if c[1].newest is not None]
    used = (found or checks or [None])[-1]
    comparison: tuple[str, ...] = ()
    if package is not None:
        seen = dict.fromkeys((a.version, a.commit) for a in arms)
        comparison = tuple(_sentence(package, v, c, used, checks, first_record_utc)
                           for v, c in seen) or (
            _sentence(package, None, None, used, checks, first_record_utc),)
    required = (declaration.get("engine") or {}).get("required_version")
    deviations = []
    if required:
        spec = required_specifier(str(required))
        for a in arms:
            if a.version is None:
                deviations.append(f"arm {a.arm}: the engine's version was not recorded; the "
                                  f"registration requires {spec}")
            elif not spec.contains(a.version, prereleases=True):
                deviations.append(f"arm {a.arm}: the engine ran version {a.version}, which the "
                                  f"registration's required version ({spec}) excludes")
    return EngineVersionReport(package, tuple(arms), tuple(checks), used, comparison,
                               str(required) if required else None, tuple(deviations),
                               first_record_utc)
