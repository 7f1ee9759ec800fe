"""Engine releases as the findings index names them: their order, how far each is from the newest.

An engine as a finding names it (``vLLM 0.33.0``) is read as a package and a version
(:func:`_engine_release`): the index's tables run newest release first (:func:`_table_order`).
Each release is said against the newest one recorded for its package (:class:`NewestRelease`,
read from the registrations by :func:`bistat.report.index_registrations.newest_releases`):
:func:`release_words`, :func:`releases_sentence`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version


def _engine_release(engine: str) -> tuple[str, Version | None]:
    """``vLLM 0.33.0`` -> ("vLLM", Version("0.33.0")); a version that does not parse -> None."""
    name, _, version = engine.rpartition(" ")
    try:
        return name or engine, Version(version)
    except InvalidVersion:
        return engine, None


def _table_order(engine: str, gpu: str) -> tuple:
    """Tables with a GPU first, then by engine, newest release first."""
    name, version = _engine_release(engine)
    return (gpu == "no GPU", name.lower(), -(version.major if version else 0),
            -(version.minor if version else 0), -(version.micro if version else 0), gpu)


@dataclass(frozen=True)
class NewestRelease:
    """The newest release of an engine's package that the registrations' checks recorded."""

    package: str
    version: str
    checked_utc: str
    index: str
    where: str              # "the registration of NAME" or "`bistat check-release` on NAME"


def _behind(engine: str, newest: Mapping[str, NewestRelease]) -> tuple[str, NewestRelease] | None:
    """How far an engine release is from the newest release recorded for its package:
    ("the newest release" | "1 minor version older" | ..., that record); None without one."""
    name, version = _engine_release(engine)
    n = newest.get(name.lower())
    if n is None or version is None:
        return None
    latest = Version(n.version)
    if version == latest:
        return "the newest release", n
    if version > latest:
        return f"newer than {n.version}, the newest release recorded", n
    if version.major != latest.major:
        return f"older than {n.version}", n
    k = latest.minor - version.minor
    return (f"{k} minor version{'s' if k != 1 else ''} older than {n.version}" if k
            else f"a patch release before {n.version}"), n


def _source(n: NewestRelease) -> str:
    host = n.index.split("//")[-1].split("/")[0] or n.index
    return f"{host}, checked {n.checked_utc} at {n.where}"


def release_words(engine: str, newest: Mapping[str, NewestRelease]) -> str | None:
    """One sentence on how far an engine release is from the newest release recorded: ``vLLM
    0.33.0 is 1 minor version older than 0.34.0, the newest release (…).``; None for an engine
    whose package no registration checked (the embedded engine)."""
    behind = _behind(engine, newest)
    if behind is None:
        return None
    gap, n = behind
    if gap == "the newest release":
        return f"{engine} is the newest release ({_source(n)})."
    return f"{engine} is {gap}, the newest release ({_source(n)})."


def releases_sentence(engines: Sequence[str], newest: Mapping[str, NewestRelease]) -> str:
    """Which releases of each engine the rows ran on (in the order given) and how far each is
    from the newest release recorded: ``vLLM rows ran on 0.34.0 (the newest release), 0.33.0 (1
    minor version older) and 0.25.0 (9 minor versions older); …``."""
    by_name: dict[str, list[str]] = {}
    for e in dict.fromkeys(engines):
        by_name.setdefault(_engine_release(e)[0], []).append(e)
    out = []
    for name, releases in by_name.items():
        parts, record = [], None
        for e in releases:
            version = e.rpartition(" ")[2]
            behind = _behind(e, newest)
            if behind is None:
                parts.append(version)
                continue
            gap, record = behind
            parts.append(f"{version} ({gap.replace(f' than {record.version}', '')})")
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        if record is not None:
            out.append(f"{name} rows ran on {listed}; the newest release is {record.version} "
                       f"({_source(record)}).")
        elif name == "embedded":
            out.append(f"The embedded engine is bistat's own ({listed}, this checkout).")
        else:
            out.append(f"{name} rows ran on {listed} (no newest-release check recorded).")
    return " ".join(out)
