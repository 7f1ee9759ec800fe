"""A recorded run as one object, and where its registration is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


from bistat.store.readers import read_header

__all__ = ["recorded_registration_path", "run_declaration"]


def recorded_registration_path(run_dir: str | Path, header: Mapping[str, Any]) -> Path | None:
    """The registration file ``run.json`` names (``header``), or None when it names none.

    A relative path is tried as recorded (from where ``bistat run`` started), then relative to
    the run directory. The analysis (which then checks the seal) and :func:`run_declaration`
    find a run's registration this one way.
    """
    reg = header.get("registration") or {}
    path = reg.get("path") if isinstance(reg, Mapping) else None
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (Path(run_dir) / p).exists():
        p = Path(run_dir) / p
    return p


def run_declaration(run_dir: str | Path) -> dict[str, Any] | None:
    """The sealed declaration of the registration ``run.json`` names
    (:func:`recorded_registration_path`), or None when unreadable. The seal is not checked here
    (``bistat verify`` and the analysis do that).
    """
    p = recorded_registration_path(run_dir, read_header(run_dir))
    if p is None:
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sealed = data.get("sealed") if isinstance(data, Mapping) else None
    decl = sealed.get("declaration") if isinstance(sealed, Mapping) else None
    return decl if isinstance(decl, dict) else None
