"""The findings index: one table listing every finding with its verdicts.

The index is generated from the findings themselves (``bistat analyze`` writes each verdict as a
``### TREATMENT (treatment) vs CONTROL (control): **LABEL**`` heading), so it cannot drift from them,
and regenerating it from the same findings gives the same bytes. Given the registrations folder it
also lists every sealed registration that has no finding yet, with the reason stated for it in a
TOML file (``[not_run]`` table: ``NAME = "why"``), so that what was not run is said plainly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_VERDICT = re.compile(r"^### (?P<treatment>.+?) \(treatment\) vs (?P<control>.+?) \(control\): "
                      r"\*\*(?P<label>[^*]+)\*\*\s*$")
_TITLE = re.compile(r"^# Finding: (?P<name>.+?)\s*$")
_HYPOTHESIS = re.compile(r"^> (?P<text>.+)$")


@dataclass(frozen=True)
class IndexedFinding:
    path: Path
    name: str
    verdicts: tuple[tuple[str, str, str], ...]  # (treatment, control, label)
    hypothesis: str


def read_finding(path: Path) -> IndexedFinding:
    """Read a finding's name, verdict headings and the first line of its hypothesis."""
    name, hypothesis = path.stem, ""
    verdicts: list[tuple[str, str, str]] = []
    in_hypothesis = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if (m := _TITLE.match(line)) and name == path.stem:
            name = m["name"]
        elif line.strip() == "## Hypothesis":
            in_hypothesis = True
        elif in_hypothesis and (m := _HYPOTHESIS.match(line)):
            hypothesis, in_hypothesis = m["text"], False
        elif m := _VERDICT.match(line):
            verdicts.append((m["treatment"], m["control"], m["label"]))
    if not verdicts:
        raise ValueError(f"{path}: no verdict heading found; is it a finding written by "
                         "`bistat analyze`?")
    return IndexedFinding(path, name, tuple(verdicts), hypothesis)


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


def unrun_registrations(findings: list[IndexedFinding], registrations_dir: str | Path,
                        reasons: dict[str, str], reasons_source: str = "the reasons file"
                        ) -> list[UnrunRegistration]:
    """Registrations in ``registrations_dir`` with no finding named after them; ``reasons`` must
    name only such registrations."""
    from bistat.prereg import RegistrationError, load_registration

    have = {f.name for f in findings}
    out, names = [], set()
    for path in sorted(Path(registrations_dir).glob("*.json")):
        try:
            reg = load_registration(path)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        name = reg.experiment().name
        names.add(name)
        if name in have:
            if name in reasons:
                raise ValueError(f"{reasons_source}: not_run.{name} is stated, but {name} has a "
                                 "finding; remove the line")
            continue
        out.append(UnrunRegistration(name, path, reg.registered_utc, reasons.get(name)))
    unknown = sorted(set(reasons) - names)
    if unknown:
        raise ValueError(f"{reasons_source}: not_run.{unknown[0]} names no registration in "
                         f"{registrations_dir}; fix the name or remove the line")
    return out


def render_index(findings: list[IndexedFinding], base: Path,
                 unrun: list[UnrunRegistration] | None = None,
                 reasons_source: str | None = None) -> str:
    """The index as markdown, findings sorted by file name; then the registrations without a
    finding when ``unrun`` is given."""
    lines = ["# Findings", "",
             "Generated by `bistat index` from the findings in this folder; each finding is "
             "regenerated from its recorded data by `bistat analyze`.", "",
             "| finding | treatment vs control | verdict |", "|---|---|---|"]
    for f in sorted(findings, key=lambda f: f.path.as_posix()):
        rel = f.path.relative_to(base).as_posix()
        for i, (treatment, control, label) in enumerate(f.verdicts):
            cell = f"[{f.name}]({rel})" if i == 0 else ""
            lines.append(f"| {cell} | {treatment} vs {control} | *{label}* |")
    if unrun is not None:
        source = f" (`{reasons_source}`)" if reasons_source else ""
        lines += ["", "## Registered, no finding yet", "",
                  f"Sealed before any data and not run (or not analysed) so far; the reason as "
                  f"stated by the people running the studies{source}.", ""]
        if not unrun:
            lines.append("None: every registration has its finding.")
        else:
            lines += ["| registration | registered (UTC) | why no finding |", "|---|---|---|"]
            for u in unrun:
                rel = Path(os.path.relpath(u.path, base)).as_posix()
                lines.append(f"| [{u.name}]({rel}) | {u.registered_utc or '—'} | "
                             f"{u.reason or '*no reason stated*'} |")
    lines.append("")
    return "\n".join(lines)


def write_index(findings_dir: str | Path, registrations_dir: str | Path | None = None,
                reasons_path: str | Path | None = None) -> Path:
    """Write ``findings_dir/README.md`` listing every ``*.md`` finding below it, and, given
    ``registrations_dir``, the registrations that have none (why: ``reasons_path``)."""
    base = Path(findings_dir)
    paths = [p for p in sorted(base.rglob("*.md")) if p.name != "README.md"]
    findings = [read_finding(p) for p in paths]
    unrun = source = None
    if reasons_path is not None and registrations_dir is None:
        raise ValueError("a reasons file needs the registrations folder (--registrations)")
    if registrations_dir is not None:
        source = None if reasons_path is None else Path(reasons_path).as_posix()
        reasons = {} if reasons_path is None else read_reasons(reasons_path)
        unrun = unrun_registrations(findings, registrations_dir, reasons,
                                    source or "the reasons file")
    out = base / "README.md"
    out.write_text(render_index(findings, base, unrun, source), encoding="utf-8")
    return out
