"""What the findings index reads from the registrations: those without a finding, the releases.

:func:`load_registrations` loads every registration of a folder, its seal checked;
:func:`unrun_registrations` lists those that have no finding yet, each with the reason stated for
it in a TOML file (``[not_run]`` table: ``NAME = "why"``, :func:`read_reasons`), so that what was
not run is said plainly; :func:`newest_releases` gives the newest release of each engine package
that the registrations' checks recorded (at registration and ``bistat check-release``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bistat.report.index_findings import IndexedFinding
from bistat.report.index_releases import NewestRelease

if TYPE_CHECKING:
    from bistat.declare.registration import Registration

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class UnrunRegistration:
    """A sealed registration without a finding, and why (None: no reason stated)."""

    name: str
    path: Path
    registered_utc: str | None
    reason: str | None


def read_reasons(path: str | Path) -> dict[str, str]:
    """The ``[not_run]`` table of a reasons file: registration name -> why it has no finding."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: not a readable TOML file ({exc})") from None
    table = data.get("not_run")
    if not isinstance(table, dict) or set(data) != {"not_run"}:
        raise ValueError(f"{path}: expected one table [not_run] of NAME = \"reason\" lines, got "
                         f"{', '.join(sorted(data)) or 'nothing'}")
    for name, why in table.items():
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"{path}: field not_run.{name} must be a non-empty string (why "
                             "registration NAME has no finding)")
    return {str(k): v.strip() for k, v in table.items()}


def load_registrations(registrations_dir: str | Path) -> dict[str, Registration]:
    """Every registration in ``registrations_dir`` by its declared name, each seal checked (a
    broken one is a ``ValueError`` naming the file)."""
    from bistat.declare.registration import RegistrationError, load_registration

    out = {}
    for path in sorted(Path(registrations_dir).glob("*.json")):
        try:
            reg = load_registration(path)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        out[reg.experiment().name] = reg
    return out


def unrun_registrations(findings: list[IndexedFinding], registrations_dir: str | Path,
                        reasons: dict[str, str], reasons_source: str = "the reasons file",
                        registrations: Mapping[str, Registration] | None = None
                        ) -> list[UnrunRegistration]:
    """Registrations in ``registrations_dir`` (already loaded: ``registrations``) with no finding
    named after them; ``reasons`` must name only such registrations."""
    if registrations is None:
        registrations = load_registrations(registrations_dir)
    have = {f.name for f in findings}
    out, names = [], set()
    for name, reg in registrations.items():
        names.add(name)
        if name in have:
            if name in reasons:
                raise ValueError(f"{reasons_source}: not_run.{name} is stated, but {name} has a "
                                 "finding; remove the line")
            continue
        out.append(UnrunRegistration(name, reg.path, reg.registered_utc, reasons.get(name)))
    unknown = sorted(set(reasons) - names)
    if unknown:
        raise ValueError(f"{reasons_source}: not_run.{unknown[0]} names no registration in "
                         f"{registrations_dir}; fix the name or remove the line")
    return out


def newest_releases(registrations: Mapping[str, Registration]) -> dict[str, NewestRelease]:
    """Per package (``vllm``), the newest release found by the latest recorded check: each
    registration's check at registration and its release log (``bistat check-release``)."""
    from bistat.declare.prereg import RegistrationError, release_log_checks

    found: dict[str, NewestRelease] = {}

    def consider(check: Mapping[str, Any], where: str) -> None:
        if not check or not check.get("newest"):
            return
        n = NewestRelease(str(check["package"]), str(check["newest"]), str(check["checked_utc"]),
                          str(check.get("index", "")), where)
        if n.package not in found or found[n.package].checked_utc < n.checked_utc:
            found[n.package] = n

    for name, reg in registrations.items():
        consider(reg.sealed.get("engine_release") or {}, f"the registration of {name}")
        try:
            logged = release_log_checks(reg)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        for c in logged:
            consider(c.check.to_dict(), f"`bistat check-release` on {name}")
    return found
