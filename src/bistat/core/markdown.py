"""Markdown tables, the one builder every generated page uses (findings, the anatomy section,
the findings index), so that a cell is escaped and formatted the same way everywhere."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["md_cell", "md_row", "md_table"]


def md_cell(x: Any) -> str:
    """One table cell: ``None`` as an em dash, booleans as yes / no, floats to four significant
    digits, anything else as its text; ``|`` escaped and line breaks flattened.

    >>> [md_cell(v) for v in (None, True, 0.123456, "a|b\\nc", 3)]
    ['—', 'yes', '0.1235', 'a\\\\|b c', '3']
    """
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (no trailing newline); every cell through :func:`md_cell`.

    >>> print(md_table(("arm", "ok"), [("a|b", True), ("c", None)]))
    | arm | ok |
    |---|---|
    | a\\|b | yes |
    | c | — |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += [md_row(row) for row in rows]
    return "\n".join(lines)


def md_row(cells: Sequence[Any]) -> str:
    """One table row, for a table whose header is written apart: ``| a | b |``."""
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"
