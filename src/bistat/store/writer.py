"""Writing a run directory: :class:`RunWriter`, the append-only writer of ``run.json`` and the
tables (format: ``bistat.store.format``).

``run.json`` is written once and never overwritten. Every table line is written with a single
``write`` and flushed to the operating system at once, so a crash of the process loses at most
the line in flight; ``os.fsync`` follows at most :data:`FSYNC_INTERVAL_S` later (and at
:meth:`RunWriter.sync` / close), so a crash of the machine loses at most that much. (An fsync
per line would block the runner's event loop once per response.) A resumed writer closes off a line
cut by a crash, which readers then report as a gap.

The writer holds every file of the run open (``run.json`` and each table, read-only besides the
append handles) and remembers which directory it opened (device and inode). Should the directory
be removed or replaced while the run records (:meth:`RunWriter.lost` says so), its files live on
through those descriptors (:meth:`RunWriter.open_files`: ``/proc/PID/fd/N``) for as long as the
process does, and :meth:`RunWriter.rescue` copies them into a new directory and appends there
from then on.

Examples
--------
>>> import tempfile, pathlib
>>> from bistat.store.readers import read_table
>>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
>>> with RunWriter.create(d, {"run_id": "demo"}) as w:
...     w.append("events", {"arm": "a", "event": "started", "time_utc": "t", "detail": None})
>>> read_table(d, "events")["event"].tolist()
['started']
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping


from bistat.store.format import (
    HEADER_FILE,
    RUN_SCHEMA,
    TABLES,
    RecordsError,
    _check_table,
    _dumps,
    _json_default,
    table_schema,
)
from bistat.store.readers import read_header

__all__ = ["FSYNC_INTERVAL_S", "RunWriter"]

#: Longest time (seconds) between a line's write and its ``os.fsync``.
FSYNC_INTERVAL_S = 0.5


class RunWriter:
    """Append-only writer of one run directory.

    Use :meth:`create` for a new run and :meth:`open_existing` to resume one. :meth:`append` is
    thread-safe (engine callbacks may arrive from worker threads).
    """

    def __init__(self, run_dir: Path, header: dict) -> None:
        self.run_dir = Path(run_dir)
        self.header = header
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._synced: dict[str, float] = {}   # table -> time.monotonic() of its last fsync
        self._dirty: set[str] = set()
        #: (st_dev, st_ino) of the directory opened; None if there was none to open
        self._identity = _identity(self.run_dir)
        #: file name -> a read-only descriptor of it, held while the writer is open
        self._kept: dict[str, int] = {}
        for name in (HEADER_FILE, *(f"{t}.jsonl" for t in TABLES)):
            self._keep(name)

    @classmethod
    def create(cls, run_dir: str | os.PathLike, header: dict) -> "RunWriter":
        """Create ``run_dir`` (parents too) and write ``run.json`` once.

        ``header`` gets ``"schema": "bistat.run/1"`` if it has no schema. Refuses a directory that
        already holds a ``run.json``: a run is never overwritten (resume with :meth:`open_existing`).
        """
        run_dir = Path(run_dir)
        if not isinstance(header, Mapping):
            raise RecordsError(f"{run_dir / HEADER_FILE}: header must be a dict, got "
                               f"{type(header).__name__}")
        header = dict(header)
        schema = header.setdefault("schema", RUN_SCHEMA)
        if schema != RUN_SCHEMA:
            raise RecordsError(f"{run_dir / HEADER_FILE}: header schema {schema!r} is not "
                               f"{RUN_SCHEMA!r}; leave 'schema' out and the writer sets it")
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / HEADER_FILE
        text = json.dumps(header, default=_json_default, allow_nan=False, indent=2,
                          sort_keys=True, ensure_ascii=False) + "\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError as exc:
            raise RecordsError(
                f"{path}: a run is already recorded here and is never overwritten; choose a new "
                f"run directory, or resume this one (RunWriter.open_existing / bistat run --resume)"
            ) from exc
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(run_dir)
        return cls(run_dir, header)

    @classmethod
    def open_existing(cls, run_dir: str | os.PathLike) -> "RunWriter":
        """Open a recorded run for appending (``--resume``); its ``run.json`` must exist and be valid.

        A table whose last line was cut off by a crash is closed off with a newline before the
        first new line is appended, so the partial line stays (never rewritten) and readers
        report it as a gap.
        """
        run_dir = Path(run_dir)
        header = read_header(run_dir)
        return cls(run_dir, header)

    def _keep(self, name: str) -> None:
        if name in self._kept:
            return
        try:
            self._kept[name] = os.open(self.run_dir / name, os.O_RDONLY)
        except FileNotFoundError:
            pass

    def _handle(self, table: str):
        fh = self._files.get(table)
        if fh is None:
            path = self.run_dir / f"{table}.jsonl"
            fh = open(path, "ab")
            self._keep(path.name)
            if fh.tell() > 0:
                with open(path, "rb") as probe:
                    probe.seek(-1, os.SEEK_END)
                    if probe.read(1) != b"\n":
                        fh.write(b"\n")   # close off a line cut by a crash; readers report it
                        fh.flush()
                        os.fsync(fh.fileno())
            self._files[table] = fh
        return fh

    def append(self, table: str, record: dict) -> None:
        """Append ``record`` as one line of ``<table>.jsonl``: written and flushed at once,
        fsync'ed at most :data:`FSYNC_INTERVAL_S` later (see the module docstring).

        Adds ``"schema": "bistat.<table>/1"``. A record that names another schema is refused.
        """
        _check_table(table)
        if self._closed:
            raise RecordsError(f"{self.run_dir}: writer is closed; open the run again to append")
        if not isinstance(record, Mapping):
            raise RecordsError(f"{self.run_dir / (table + '.jsonl')}: a record must be a dict, "
                               f"got {type(record).__name__}")
        expected = table_schema(table)
        line_record = {"schema": expected}
        for key, value in record.items():
            if key == "schema":
                if value != expected:
                    raise RecordsError(f"{self.run_dir / (table + '.jsonl')}: record schema "
                                       f"{value!r} does not match table schema {expected!r}")
                continue
            line_record[key] = value
        line = _dumps(line_record, str(self.run_dir / f"{table}.jsonl")) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            fh = self._handle(table)
            fh.write(data)
            fh.flush()
            now = time.monotonic()
            if now - self._synced.get(table, -math.inf) >= FSYNC_INTERVAL_S:
                os.fsync(fh.fileno())
                self._synced[table] = now
                self._dirty.discard(table)
            else:
                self._dirty.add(table)

    def sync(self) -> None:
        """``os.fsync`` every table written since its last fsync (the runner calls it after each
        pass; :meth:`close` calls it too)."""
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        for table in sorted(self._dirty):
            fh = self._files.get(table)
            if fh is not None and not fh.closed:
                os.fsync(fh.fileno())
            self._synced[table] = time.monotonic()
        self._dirty.clear()

    def close(self) -> None:
        """fsync and close every open table file (idempotent)."""
        with self._lock:
            self._sync_locked()
            self._close_files()
            self._closed = True

    def _close_files(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        for fd in self._kept.values():
            os.close(fd)
        self._kept.clear()

    def lost(self) -> str | None:
        """Why :attr:`run_dir` is no longer the directory this writer opened (removed, replaced
        by another directory, without its ``run.json`` or with another file of that name), in
        words; None while it is."""
        try:
            st = os.stat(self.run_dir)
        except FileNotFoundError:
            return f"{self.run_dir} no longer exists"
        except OSError as exc:
            return f"{self.run_dir} cannot be read: {exc.strerror or exc}"
        if self._identity is not None and _identity_of(st) != self._identity:
            return (f"{self.run_dir} is another directory now (device {st.st_dev}, inode "
                    f"{st.st_ino}; this run opened device {self._identity[0]}, inode "
                    f"{self._identity[1]})")
        header = self.run_dir / HEADER_FILE
        try:
            now = os.stat(header)
        except FileNotFoundError:
            return f"{header} is gone"
        except OSError as exc:
            return f"{header} cannot be read: {exc.strerror or exc}"
        kept = self._kept.get(HEADER_FILE)
        if kept is not None and (now.st_dev, now.st_ino) != _identity_of(os.fstat(kept)):
            return f"{header} is another file now (a copy put in its place)"
        return None

    def open_files(self) -> dict[str, str]:
        """Each file of the run this writer holds open -> where its content can be read while
        this process lives, also after the directory is gone: ``/proc/PID/fd/N`` (Linux), else
        ``descriptor N of process PID``."""
        pid = os.getpid()
        proc = Path(f"/proc/{pid}/fd")
        with self._lock:
            return {name: str(proc / str(fd)) if proc.is_dir() else
                    f"descriptor {fd} of process {pid}" for name, fd in self._kept.items()}

    def rescue(self, dest: str | os.PathLike) -> Path:
        """Copy every file of the run this writer holds open, as it stands, into the new
        directory ``dest``, and write there from now on (a run whose directory was removed or
        replaced; see :meth:`lost`). Returns ``dest``.

        The copies are read through the writer's own descriptors, so they hold every line
        written, whatever happened to the directory's name. ``engine-logs/`` is not held open
        and is not copied.
        """
        dest = Path(dest)
        with self._lock:
            self._sync_locked()
            dest.mkdir(parents=True)
            for name, fd in sorted(self._kept.items()):
                with open(dest / name, "wb") as out:
                    offset = 0
                    while chunk := os.pread(fd, 1 << 20, offset):
                        out.write(chunk)
                        offset += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            _fsync_dir(dest)
            names = list(self._kept)
            self._close_files()
            self.run_dir = dest
            self._identity = _identity(dest)
            for name in names:
                self._keep(name)
        return dest

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        return _identity_of(os.stat(path))
    except OSError:
        return None


def _identity_of(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
