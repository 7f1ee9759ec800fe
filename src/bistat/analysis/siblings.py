"""Which registration a run is analysed against, and its siblings: registrations sealed with the
same declaration but for the name and the decision rule (several rules registered together for
one run), under which the same comparisons are classified too (the analysis's phase 1, and the
registrations its phase 6 classifies under: ``bistat.analysis.summary``).

A sibling sealed after the run's first record (:func:`sealed_after_data`) gives an exploratory
analysis, never a test of the hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bistat.analysis.results import AnalysisError
from bistat.declare.experiment import DeclarationError, Experiment
from bistat.declare.git_evidence import git_evidence
from bistat.declare.registration import Registration, load_registration
from bistat.declare.run_registration import run_registration
from bistat.store.format import parse_time
from bistat.store.run_dir import RecordedRun

__all__ = ["Registered", "declaration_without_name_and_rule", "display_path", "registered",
           "sealed_after_data", "sibling_registrations"]


@dataclass(frozen=True)
class Registered:
    """Phase 1 (registration): the registration analysed against and how it relates to the run's."""

    reg: Registration
    exp: Experiment
    header_registration: Mapping[str, Any]   # ``run.json``'s ``registration``
    sibling_of: Registration | None          # the run's own registration, when ``reg`` is a sibling
    exploratory: bool   # ``reg`` is a sibling sealed after the first record of the run


def registered(run: RecordedRun, registration: str | Path | Registration | None,
               deviations: list[str]) -> Registered:
    """Phase 1 (registration): the run's registration, or the one given, its seal checked
    (:func:`bistat.declare.run_registration.run_registration`)."""
    run_dir, header = run.path, run.header
    if not isinstance(registration, Registration):
        registration = run_registration(run, registration).registration
    reg = registration
    hdr_reg = header.get("registration") or {}
    recorded_sha = hdr_reg.get("sha256") if isinstance(hdr_reg, Mapping) else None
    sibling_of = (_sibling_registration(hdr_reg, reg)
                  if recorded_sha is not None and recorded_sha != reg.sha256 else None)
    created = header.get("created_utc")
    exploratory = sibling_of is not None and sealed_after_data(reg, created)
    if exploratory:
        deviations.append(
            f"analysed under {reg.path} ({reg.sha256[:12]}), a sibling of the registration the run "
            f"was recorded under, {sibling_of.path} ({sibling_of.sha256[:12]}): the two declarations "
            f"differ only in their name and decision rule, and this one was sealed at "
            f"{reg.sealed_utc}, after the run's first record ({created}): an exploratory "
            "analysis, not a test of the hypothesis")
    elif sibling_of is not None:
        deviations.append(
            f"analysed under {reg.path} ({reg.sha256[:12]}), a sibling of the registration the run "
            f"was recorded under, {sibling_of.path} ({sibling_of.sha256[:12]}): the two declarations "
            "differ only in their name and decision rule, and both were sealed before the run")
    elif recorded_sha is not None and recorded_sha != reg.sha256:
        earlier = recorded_sha in reg.previous_sha256s
        raise AnalysisError(
            f"{run_dir / 'run.json'}: registration.sha256 {recorded_sha} is not the seal of "
            f"{reg.path} ({reg.sha256})"
            + ("; the run was recorded under an earlier seal, before an amendment"
               if earlier else "; the run was recorded under another registration"))
    return Registered(reg, reg.experiment(), hdr_reg, sibling_of, exploratory)


def _sibling_registration(hdr_reg: Mapping[str, Any], reg: Registration) -> Registration | None:
    """The registration a run was recorded under, when ``reg`` is its sibling: the same resolved
    declaration but for ``name`` and ``rule`` (several rules registered together for one run,
    e.g. the published rule and its improved form). None otherwise."""
    path = hdr_reg.get("path")
    if not isinstance(path, str):
        return None
    # Beside the sibling first (registrations are sealed together in one folder, so a clone
    # elsewhere -- CI, a notebook's folder -- finds it and names it the same way on every
    # machine), else as run.json names it (relative to where `bistat run` ran, or absolute on
    # the machine that ran it). The seal is checked either way.
    recorded = None
    for candidate in dict.fromkeys((Path(reg.path).parent / Path(path).name, Path(path))):
        try:
            found = load_registration(candidate)
        except (OSError, ValueError):
            continue
        if found.sha256 == hdr_reg.get("sha256") and git_evidence(candidate).status != "differs":
            recorded = found
            break
    if recorded is None:
        return None
    # Compare as the current schema resolves them: a registration sealed before a field was
    # added lacks it, with its default meant.
    return recorded if declaration_without_name_and_rule(recorded) == declaration_without_name_and_rule(reg) else None


def declaration_without_name_and_rule(reg: Registration) -> dict[str, Any]:
    """The declaration as the current schema resolves it, without ``name`` and ``rule``."""
    return {k: v for k, v in reg.experiment().resolved().items() if k not in ("name", "rule")}


def sibling_registrations(reg: Registration) -> list[Registration]:
    """The other registrations in ``reg``'s folder sealed with the same declaration but for
    ``name`` and ``rule`` (several decision rules registered together for one run), by path.
    Files that are not readable registrations are skipped."""
    here = Path(reg.path)
    try:
        mine = declaration_without_name_and_rule(reg)
    except (ValueError, DeclarationError):
        return []
    found = []
    for path in sorted(here.parent.glob("*.json")):
        if path.name == here.name:
            continue
        try:
            other = load_registration(path)
            if (other.sha256 != reg.sha256 and declaration_without_name_and_rule(other) == mine
                    and git_evidence(path).status != "differs"):   # a forged one is no sibling
                found.append(other)
        except (OSError, ValueError, DeclarationError):
            continue
    return found


def sealed_after_data(reg: Registration, created_utc: str | None) -> bool:
    """Whether ``reg`` was last sealed after a run's first record (``run.json``'s
    ``created_utc``): a rule applied to data it had seen, so only an exploratory analysis.
    False when a time is missing or unreadable (the validity check then reports it)."""
    if created_utc is None:
        return False
    try:
        return parse_time(reg.sealed_utc) > parse_time(created_utc)
    except (TypeError, ValueError):
        return False


def display_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies inside it, else as given."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve())) if p.is_absolute() else str(p)
    except ValueError:
        return str(p)
