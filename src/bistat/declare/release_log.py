"""Newest-release checks made after a registration was sealed: ``NAME.releases.jsonl``.

A registration's seal records the newest engine release the package index knew as the study was
registered (``engine_release``). A sealed file never changes, so a check made later -- the index
was switched off when it was sealed, or a finding should say what the newest release is now -- is
appended to a log beside it instead (``preregistrations/NAME.releases.jsonl``), one JSON line per
check, made by ``bistat check-release REGISTRATION`` or by ``bistat register --amend`` (which
checks as it re-seals). The registration's bytes stay as they were sealed and verify as before.

Each line::

    {"schema": "bistat.release-check/1",
     "registration": NAME,                   # the registration's name
     "registration_sha256": "<seal>",        # the seal in force when the check was made
     "by": "check-release" | "amend",
     "check": {"package", "newest", "checked_utc", "index", "error"},   # ReleaseCheck
     "previous_sha256": "<the line before's sha256>" | null,
     "sha256": "<sha256 of the line's canonical JSON without sha256>"}

The lines are hashed and chained like the amendment log inside a seal: a line edited, removed,
inserted or moved after it was written breaks its own hash or the chain, and the log is refused
with the line and the field that broke. As with the seal, the hash proves integrity, not time: the
check's time is what the checking machine's clock said, and committing the log dates it in git.
A finding states each check's time against the run's first record, so a check made after the data
is never taken for one made at registration (:mod:`bistat.declare.engine_version`).

This module reads and appends the log; :func:`bistat.declare.prereg.check_release` makes a check
for a registration, and :func:`bistat.declare.prereg.release_log_checks` reads a registration's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from bistat.declare.releases import ReleaseCheck
from bistat.store.format import parse_time

__all__ = ["LOG_SCHEMA", "BY", "LoggedCheck", "ReleaseLogError", "release_log_path",
           "read_release_log", "append_release_check"]

LOG_SCHEMA = "bistat.release-check/1"
#: What made a logged check.
BY = ("check-release", "amend")
_CHECK_FIELDS = ("package", "newest", "checked_utc", "index", "error")


class ReleaseLogError(ValueError):
    """A release log that cannot be read or does not verify (names the file, line and field)."""


@dataclass(frozen=True)
class LoggedCheck:
    """One verified line of a release log.

    Attributes
    ----------
    check : ReleaseCheck
        What the index answered, and when (``check.checked_utc``).
    by : str
        ``check-release`` or ``amend``.
    registration_sha256 : str
        The seal in force when the check was made.
    sha256 : str
        The line's own hash (the next line's ``previous_sha256``).
    line : int
        1-based line number in the log.
    """

    check: ReleaseCheck
    by: str
    registration_sha256: str
    sha256: str
    line: int


def release_log_path(registration_path: str | Path) -> Path:
    """``NAME.releases.jsonl`` beside ``NAME.json``."""
    p = Path(registration_path)
    return p.with_name(f"{p.stem}.releases.jsonl")


def _sha256(obj: Any) -> str:
    """SHA-256 of the canonical JSON that seals use (sorted keys, no whitespace, UTF-8)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _fix(log: Path, registration: Path) -> str:
    from bistat.store.restore import restore_hint

    return (f"restore the log {restore_hint(log)}, or move it aside and check again "
            f"(bistat check-release {registration})")


def read_release_log(registration_path: str | Path, *, name: str,
                     seals: Collection[str], registered_utc: str) -> tuple[LoggedCheck, ...]:
    """The verified checks of a registration's release log, in order; () when there is none.

    Parameters
    ----------
    registration_path : path
        ``NAME.json``; the log is :func:`release_log_path` of it.
    name : str
        The registration's name (each line names it).
    seals : collection of str
        The registration's seals, current and before its amendments: a line names one of them.
    registered_utc : str
        When it was registered: no check can be older.

    Raises
    ------
    ReleaseLogError
        A line that is not JSON, of another schema, lacking a field, whose hash or chain is broken,
        naming another registration, or dated before the registration or the line before it.
    """
    reg_path = Path(registration_path)
    log = release_log_path(reg_path)
    try:
        text = log.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReleaseLogError(f"{log}: not a readable release log ({exc}); "
                              f"{_fix(log, reg_path)}") from exc
    out: list[LoggedCheck] = []
    previous: str | None = None
    last_time = parse_time(registered_utc).replace(microsecond=0)  # checks are dated to the second
    for lineno, raw in enumerate(text.splitlines(), 1):
        where = f"{log}:{lineno}"
        if not raw.strip():
            raise ReleaseLogError(f"{where}: an empty line; the log was edited: {_fix(log, reg_path)}")
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ReleaseLogError(f"{where}: not JSON ({exc.msg}); the log was edited or "
                                  f"truncated: {_fix(log, reg_path)}") from None
        if not isinstance(rec, dict) or rec.get("schema") != LOG_SCHEMA:
            got = rec.get("schema") if isinstance(rec, dict) else None
            raise ReleaseLogError(f"{where}: schema: {got!r} is not {LOG_SCHEMA!r}; not a bistat "
                                  "release log, or written by an incompatible version")
        missing = [k for k in ("registration", "registration_sha256", "by", "check",
                               "previous_sha256", "sha256") if k not in rec]
        check = rec.get("check")
        if not missing and isinstance(check, dict):
            missing = [f"check.{k}" for k in _CHECK_FIELDS if k not in check]
        elif not missing:
            missing = ["check"]
        if missing:
            raise ReleaseLogError(f"{where}: lacks {', '.join(missing)}; the log was edited: "
                                  f"{_fix(log, reg_path)}")
        body = {k: v for k, v in rec.items() if k != "sha256"}
        try:
            actual = _sha256(body)
        except ValueError as exc:
            raise ReleaseLogError(f"{where}: cannot be hashed ({exc}); {_fix(log, reg_path)}") from None
        if actual != rec["sha256"]:
            raise ReleaseLogError(f"{where}: sha256: the line hashes to {actual}, not its recorded "
                                  f"{rec['sha256']}; it was changed after it was written: "
                                  f"{_fix(log, reg_path)}")
        if rec["previous_sha256"] != previous:
            raise ReleaseLogError(f"{where}: previous_sha256: {rec['previous_sha256']!r} is not the "
                                  f"sha256 of the line before it ({previous!r}); lines were "
                                  f"removed, inserted or reordered: {_fix(log, reg_path)}")
        if rec["registration"] != name or rec["registration_sha256"] not in seals:
            raise ReleaseLogError(f"{where}: registration_sha256: {rec['registration_sha256']!r} "
                                  f"({rec['registration']!r}) is not a seal of {reg_path}; the log "
                                  "belongs to another registration: move it aside")
        if rec["by"] not in BY:
            raise ReleaseLogError(f"{where}: by: {rec['by']!r} is not one of {', '.join(BY)}")
        try:
            when = parse_time(check["checked_utc"])
        except (TypeError, ValueError):
            raise ReleaseLogError(f"{where}: check.checked_utc: {check['checked_utc']!r} is not an "
                                  f"ISO 8601 time; {_fix(log, reg_path)}") from None
        if when < last_time:
            raise ReleaseLogError(
                f"{where}: check.checked_utc: {check['checked_utc']} is before "
                f"{'the registration' if not out else 'the check on the line before'} "
                f"({registered_utc if not out else out[-1].check.checked_utc}); the log was "
                f"edited or the checking machine's clock was wrong: {_fix(log, reg_path)}")
        last_time = when
        out.append(LoggedCheck(ReleaseCheck.from_dict(check), rec["by"],
                               rec["registration_sha256"], rec["sha256"], lineno))
        previous = rec["sha256"]
    return tuple(out)


def append_release_check(registration_path: str | Path, check: ReleaseCheck, *, by: str,
                         name: str, registration_sha256: str,
                         logged: tuple[LoggedCheck, ...]) -> LoggedCheck:
    """Append ``check`` to the registration's log (flushed and fsync'ed) and return its line.

    ``logged`` is the log as :func:`read_release_log` verified it just before: the new line
    chains to its last line.
    """
    if by not in BY:
        raise ValueError(f"by: {by!r} is not one of {', '.join(BY)}")
    body = {"schema": LOG_SCHEMA, "registration": name,
            "registration_sha256": registration_sha256, "by": by, "check": check.to_dict(),
            "previous_sha256": logged[-1].sha256 if logged else None}
    rec = {**body, "sha256": _sha256(body)}
    log = release_log_path(registration_path)
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return LoggedCheck(check, by, registration_sha256, rec["sha256"], len(logged) + 1)
