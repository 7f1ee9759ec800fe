"""A sealed registration (``preregistrations/NAME.json``) as it is read: the file, its seal checked
on every load (the hash of the canonical form, the declaration's hash, the amendment log), and the
names of its parts. :mod:`bistat.declare.prereg` writes, amends and verifies registrations; the
layout of the file is in its docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bistat.declare.canonical import sha256_hex
from bistat.declare.errors import DeclarationError
from bistat.store.format import parse_time

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment


SCHEMA = "bistat.registration/1"
DEFAULT_REGISTRATIONS_DIR = "preregistrations"
DEFAULT_RUNS_DIR = "runs"


class RegistrationError(ValueError):
    """A registration could not be written, amended or read."""


@dataclass(frozen=True)
class Registration:
    """A registration file's content (``data``) and where it lives."""

    path: Path
    data: dict[str, Any]

    @property
    def sealed(self) -> dict[str, Any]:
        return self.data["sealed"]

    @property
    def sha256(self) -> str:
        return self.data["sha256"]

    @property
    def name(self) -> str:
        return self.sealed["name"]

    @property
    def registered_utc(self) -> str:
        return self.sealed["registered_utc"]

    @property
    def sealed_utc(self) -> str:
        """When the declaration now in force was sealed (registration or last amendment)."""
        return self.sealed["sealed_utc"]

    @property
    def declaration(self) -> dict[str, Any]:
        return self.sealed["declaration"]

    @property
    def declaration_sha256(self) -> str:
        return self.sealed["declaration_sha256"]

    @property
    def amendments(self) -> list[dict[str, Any]]:
        return list(self.sealed["amendments"])

    @property
    def design(self) -> dict[str, Any]:
        return self.sealed["design"]

    @property
    def previous_sha256s(self) -> list[str]:
        """Seals this registration had before its amendments."""
        return [a["previous_sha256"] for a in self.sealed["amendments"]]

    def experiment(self) -> Experiment:
        """The registered declaration, validated."""
        from bistat.declare.experiment import validate_experiment

        return validate_experiment(self.declaration, source=f"{self.path}: declaration")

    def reference(self) -> dict[str, Any]:
        """What a run records in ``run.json`` under ``registration``."""
        return {"path": str(self.path), "sha256": self.sha256,
                "registered_utc": self.registered_utc, "name": self.name}


def registration_path(name: str, registrations_dir: str | Path = DEFAULT_REGISTRATIONS_DIR) -> Path:
    return Path(registrations_dir) / f"{name}.json"


def _read(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.suffix.lower() == ".toml" and not p.exists():   # missing: not "a declaration"
        raise RegistrationError(f"{path}: no such file; give a sealed registration, "
                                f"{DEFAULT_REGISTRATIONS_DIR}/NAME.json")
    if p.suffix.lower() == ".toml":
        sealed = registration_path(p.stem, p.parent.parent / DEFAULT_REGISTRATIONS_DIR
                                   if p.parent.name == "experiments" else DEFAULT_REGISTRATIONS_DIR)
        raise RegistrationError(f"{path} is a declaration, not a registration; give the sealed "
                                f".json ({sealed}, which `bistat register {path}` writes)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise RegistrationError(f"{path}: no such registration") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegistrationError(f"{path}: not a readable registration ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else None
        raise RegistrationError(f"{path}: schema {got!r} is not {SCHEMA!r}; not a bistat "
                                "registration, or written by an incompatible version")
    if not isinstance(data.get("sealed"), dict) or not isinstance(data.get("sha256"), str):
        raise RegistrationError(f"{path}: 'sealed' or 'sha256' is missing; the file is damaged")
    return data


def _seal_problems(path: Path, data: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    sealed = data["sealed"]
    try:
        actual = sha256_hex(sealed)
    except ValueError as exc:  # NaN or similar: cannot have been written by register
        return [f"{path}: seal broken: the content cannot be serialized canonically ({exc})"]
    if actual != data["sha256"]:
        problems.append(f"{path}: seal broken: the sealed content hashes to {actual}, but the "
                        f"seal is {data['sha256']}; the registration was changed after it was "
                        "sealed")
    required = ("name", "declaration", "declaration_sha256", "registered_utc", "sealed_utc",
                "amendments")
    missing = [k for k in required if k not in sealed]
    if missing:
        problems.append(f"{path}: sealed content lacks {', '.join(missing)}; the file is damaged")
        return problems
    if sha256_hex(sealed["declaration"]) != sealed["declaration_sha256"]:
        problems.append(f"{path}: declaration_sha256 does not match the declaration; the "
                        "declaration was changed after it was sealed")
    from bistat.declare.experiment import validate_experiment

    try:
        exp = validate_experiment(sealed["declaration"], source=f"{path}: declaration")
        if not _sealed_within(sealed["declaration"], exp.resolved()):
            problems.append(f"{path}: the declaration is not in resolved form; it was not "
                            "written by bistat register")
    except DeclarationError as exc:
        problems.extend(exc.messages)
    amendments = sealed["amendments"]
    if not isinstance(amendments, list) or not all(isinstance(a, dict) for a in amendments):
        problems.append(f"{path}: the amendment log is not a list of amendments; the file is "
                        "damaged")
        return problems
    times = [sealed["registered_utc"]] + [a.get("time_utc") for a in amendments]
    try:
        parsed = [parse_time(t) for t in times]
        if any(b < a for a, b in zip(parsed, parsed[1:])):
            problems.append(f"{path}: amendment times are not in order; the log was edited")
        if parse_time(sealed["sealed_utc"]) != parsed[-1]:
            problems.append(f"{path}: sealed_utc {sealed['sealed_utc']} is not the time of the "
                            f"last sealing ({times[-1]})")
    except (TypeError, ValueError) as exc:
        problems.append(f"{path}: a registration time is not an ISO 8601 time ({exc})")
    for i, a in enumerate(amendments):
        nxt = (amendments[i + 1]["old_declaration_sha256"] if i + 1 < len(amendments)
               else None)
        if nxt is not None and a.get("new_declaration_sha256") != nxt:
            problems.append(f"{path}: amendments[{i}] and amendments[{i + 1}] do not chain; "
                            "the log was edited")
    if amendments and amendments[-1].get("new_declaration_sha256") != sealed["declaration_sha256"]:
        problems.append(f"{path}: the last amendment does not produce the sealed declaration; "
                        "the log was edited")
    return problems


def _sealed_within(sealed: Any, resolved: Any) -> bool:
    """True when every value the seal holds is what the current schema resolves it to.

    Fields added to the schema after a registration was sealed appear in ``resolved`` with their
    defaults and are tolerated, so old registrations stay readable (additive schema changes only);
    any sealed field the schema resolves differently is not.
    """
    if isinstance(sealed, dict):
        return (isinstance(resolved, dict)
                and all(k in resolved and _sealed_within(v, resolved[k]) for k, v in sealed.items()))
    if isinstance(sealed, list):
        return (isinstance(resolved, list) and len(sealed) == len(resolved)
                and all(_sealed_within(a, b) for a, b in zip(sealed, resolved)))
    return sealed == resolved


def load_registration(path: str | Path) -> Registration:
    """Read a registration and check its seal; raise ``RegistrationError`` if it is broken."""
    data = _read(path)
    problems = _seal_problems(Path(path), data)
    if problems:
        raise RegistrationError("\n".join(problems))
    return Registration(Path(path), data)
