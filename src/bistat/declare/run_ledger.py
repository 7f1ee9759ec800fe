"""The runs recorded under a registration: those under a runs folder whose ``run.json`` names it,
and those its run ledger lists (``preregistrations/.NAME.runs``: every run directory ``bistat run``
started under it, appended as each starts, on the machine that ran it; never committed), and
whether a run recorded data (an amendment is refused once one has).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from bistat.declare.registration import Registration


def _run_json(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _names_registration(run: dict[str, Any], reg: Registration) -> bool:
    ref = run.get("registration")
    if not isinstance(ref, dict):
        return False
    return (ref.get("sha256") in {reg.sha256, *reg.previous_sha256s}
            or ref.get("name") == reg.name)


def find_recorded_runs(reg: Registration, runs_dirs: Iterable[str | Path]) -> list[Path]:
    """Run directories (children of ``runs_dirs``, or those directories themselves) whose
    ``run.json`` names this registration: its seal, an earlier seal, or its name."""
    found: list[Path] = []
    for base in runs_dirs:
        base = Path(base)
        if not base.is_dir():
            continue
        candidates = [base] + sorted(p for p in base.iterdir() if p.is_dir())
        for d in candidates:
            run = _run_json(d)
            if run is not None and _names_registration(run, reg):
                found.append(d)
    return found


def ledger_path(reg_path: str | Path) -> Path:
    """The run ledger of a registration: ``.NAME.runs`` beside ``NAME.json``, one run directory
    (absolute path) per line, appended by ``bistat run`` as a run starts (:func:`note_run`). It
    lets ``--amend`` find runs recorded anywhere (``--run-dir`` outside ``runs/``). Paths are
    written relative to the registration's folder, so a copied project points at its own runs."""
    p = Path(reg_path)
    return p.with_name(f".{p.stem}.runs")


def note_run(reg: Registration, run_dir: str | Path) -> None:
    """Append ``run_dir`` to the registration's run ledger (once)."""
    ledger = ledger_path(reg.path)
    line = os.path.relpath(Path(run_dir).resolve(), ledger.parent.resolve())
    known = ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []
    if line not in known:
        with open(ledger, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def ledger_runs(reg: Registration) -> list[Path]:
    """The run directories in the registration's ledger that still name it."""
    ledger = ledger_path(reg.path)
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text(encoding="utf-8").splitlines():
        d = Path(os.path.normpath(ledger.parent / line))
        run = _run_json(d) if line.strip() else None
        if run is not None and _names_registration(run, reg):
            out.append(d)
    return out


def ledger_entries(reg: Registration) -> list[tuple[Path, bool]]:
    """Every run directory the registration's ledger lists, in order, with whether it is still
    a run of it (``run.json`` there names this registration); a directory since removed or
    replaced is listed as ``False``: a run was started, and its record is gone."""
    ledger = ledger_path(reg.path)
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d = Path(os.path.normpath(ledger.parent / line))
        run = _run_json(d)
        out.append((d, run is not None and _names_registration(run, reg)))
    return out


def known_runs(reg: Registration, runs_dirs: Iterable[str | Path] = ()) -> list[Path]:
    """The run directories of ``reg`` that its run ledger lists or that lie under ``runs_dirs``
    (:func:`find_recorded_runs`), each once (by resolved path), in that order."""
    out: dict[Path, Path] = {}
    for d in [*ledger_runs(reg), *find_recorded_runs(reg, runs_dirs)]:
        out.setdefault(d.resolve(), d)
    return list(out.values())


def _has_data(run_dir: Path) -> bool:
    """True when the run recorded data: a response or a pass (``responses.jsonl``/``.parquet``,
    ``passes.jsonl``). Headers alone (``run.json``, the engine's failed start in
    ``events.jsonl``) are not data: a registration whose run never started may be amended."""
    if (run_dir / "responses.parquet").exists():
        return True
    for table in ("responses.jsonl", "passes.jsonl"):
        try:
            with open(run_dir / table, encoding="utf-8", errors="replace") as fh:
                if any(line.strip() for line in fh):
                    return True
        except OSError:
            pass
    return False
