"""A recorded run opened once (:class:`RecordedRun`), and where its registration file is.

Every reader of a run -- the analysis, the divergence anatomy, ``diagnose``, ``inspect``, the
trim, ``replay`` and the probe's needle lookup -- takes a :class:`RecordedRun` (or a path, which
it opens as one). ``run.json`` is then read and checked once, the registration's file is found
once, each table is read the first time it is asked for and kept, the check of whether a
table's Parquet file is still what the JSONL holds (a SHA-256 of the whole JSONL) is made once
per table, and the counted passes are worked out once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from bistat.store.format import _check_table
from bistat.store.passes import counted_passes_of
from bistat.store.readers import (
    TableRead,
    _check_trim,
    _load_table,
    _parquet_state,
    _trim_info,
    read_header,
)

__all__ = ["RecordedRun", "recorded_registration_path"]


class RecordedRun:
    """A run directory opened once.

    Open one with :meth:`open`; a function that reads a run takes a ``RecordedRun`` or a path
    and calls :meth:`of`. Tables come back as the files were when first read: open the run
    again to see lines appended since.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from bistat.store.writer import RunWriter
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
    >>> with RunWriter.create(d, {"run_id": "demo"}) as w:
    ...     w.append("events", {"arm": "a", "event": "started", "time_utc": "t", "detail": None})
    >>> run = RecordedRun.open(d)
    >>> run.run_id, run.table("events")["event"].tolist(), run.counted_passes
    ('demo', ['started'], {})
    """

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        #: ``run.json`` as read (its schema checked)
        self.header = header
        self._states: dict[str, tuple[bool, str | None]] = {}
        self._reads: dict[tuple, TableRead] = {}

    @classmethod
    def open(cls, run_dir: str | os.PathLike) -> "RecordedRun":
        """Read ``run.json`` (:func:`bistat.store.readers.read_header`; ``RecordsError`` when it
        is missing or of another schema)."""
        return cls(Path(run_dir), read_header(run_dir))

    @classmethod
    def of(cls, run: "RecordedRun | str | os.PathLike") -> "RecordedRun":
        """``run`` itself when it is a ``RecordedRun``, else the run directory it names, opened."""
        return run if isinstance(run, RecordedRun) else cls.open(run)

    def __repr__(self) -> str:
        return f"RecordedRun({str(self.path)!r})"

    @property
    def run_id(self) -> str:
        """``run.json``'s ``run_id``, else the directory's name."""
        return str(self.header.get("run_id") or self.path.name)

    @functools.cached_property
    def registration_path(self) -> Path | None:
        """The registration file ``run.json`` names (:func:`recorded_registration_path`)."""
        return recorded_registration_path(self.path, self.header)

    def _state(self, table: str) -> tuple[bool, str | None]:
        if table not in self._states:
            self._states[table] = _parquet_state(self.path, table)
        return self._states[table]

    def load(self, table: str, columns: Sequence[str] | None = None, *,
             filters: Mapping[str, Iterable[Any]] | None = None) -> TableRead:
        """One table as :func:`bistat.store.readers.load_table` reads it, read once per
        ``columns`` and ``filters``. The frame is the caller's to change (a copy-on-write
        copy of the one kept)."""
        _check_table(table)
        key = (table, None if columns is None else tuple(columns),
               None if filters is None else tuple(sorted(
                   (k, tuple(sorted(set(v), key=repr))) for k, v in filters.items())))
        read = self._reads.get(key)
        if read is None:
            read = self._reads[key] = _load_table(self.path, table, columns, filters,
                                                  self._state(table))
        return TableRead(read.frame.copy(deep=False), read.gaps, read.source)

    def table(self, table: str, columns: Sequence[str] | None = None, *,
              filters: Mapping[str, Iterable[Any]] | None = None) -> pd.DataFrame:
        """One table as a frame (:meth:`load` without the gaps)."""
        return self.load(table, columns, filters=filters).frame

    @functools.cached_property
    def counted_passes(self) -> dict[str, list[int]]:
        """Counted passes per arm (:func:`bistat.store.passes.counted_passes`)."""
        return counted_passes_of(self.table("responses", ["arm", "pass_index", "kind"]),
                                 self.table("passes"), self.table("schedule"))

    @functools.cached_property
    def trim_info(self) -> dict[str, Any] | None:
        """What a trim recorded (:func:`bistat.store.readers.trim_info`), or None."""
        return _trim_info(self.path, self._state("responses")[0])

    def check_trim(self, references: Mapping[str, int | None], unit: str) -> None:
        """:func:`bistat.store.readers.check_trim` for this run."""
        _check_trim(self.path, self.trim_info, references, unit)


def recorded_registration_path(run_dir: str | Path, header: Mapping[str, Any]) -> Path | None:
    """The registration file ``run.json`` names (``header``), or None when it names none.

    A relative path is tried as recorded (from where ``bistat run`` started), then relative to
    the run directory. This is where the one resolver of a run's registration,
    :func:`bistat.declare.run_registration.run_registration`, looks (and then checks the seal).
    """
    reg = header.get("registration") or {}
    path = reg.get("path") if isinstance(reg, Mapping) else None
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (Path(run_dir) / p).exists():
        p = Path(run_dir) / p
    return p
