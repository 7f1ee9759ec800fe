"""The cells and lists that every section of a finding formats alike (no statistics).

A missing number is an em dash (:func:`_f`, :func:`_int`), a criterion's outcome is one of three
words (:func:`_met`), a validity check's observed value is rounded once and never across its limit
(:func:`_decided_cell`), and a list with nothing in it says so (:func:`_bullets`).
"""

from __future__ import annotations

from typing import Any, Iterable

from bistat.core.decided import format_decided
from bistat.core.markdown import md_cell


def _f(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _decided_cell(observed: Any, limit: Any) -> str:
    """A validity check's observed value, rounded once and never across its limit."""
    if isinstance(observed, float) and isinstance(limit, (int, float)) \
            and not isinstance(limit, bool):
        return format_decided(observed, [float(limit)], 4, significant=True)
    return md_cell(observed)


def _int(x: int | None) -> str:
    return "—" if x is None else str(x)


def _met(x: bool | None) -> str:
    return {True: "**met**", False: "not met", None: "not evaluable"}[x]


def _bullets(items: Iterable[str], empty: str) -> str:
    items = list(items)
    return "\n".join(f"- {x}" for x in items) if items else empty
