"""The recorded-data format of a run directory (schema ``bistat.run/1``): writer, readers, compaction.

A run directory holds ``run.json`` (written once) and one append-only JSONL file per table in
:data:`TABLES`. Every line is one JSON object carrying ``"schema": "bistat.<table>/1"``; each line
is written with a single ``write`` and flushed to the operating system at once, so a crash of the
process loses at most the line in flight; ``os.fsync`` follows at most :data:`FSYNC_INTERVAL_S`
later (and at :meth:`RunWriter.sync` / close), so a crash of the machine loses at most that much.
(An fsync per line blocked the runner's event loop once per response.) Readers ignore an unreadable line (a truncated last line after a crash, or the partial
line a resumed writer closed off) and report it as a *gap*. After a run, :func:`compact` writes
``<table>.parquet`` beside each JSONL file (the JSONL is kept); :func:`read_table` prefers the
Parquet file when it is complete, that is when the JSONL has not grown since compaction.
A *slim* compaction (``compact(run_dir, slim=True)``) stores each distinct output of
``responses`` once in :data:`OUTPUTS_FILE`; :func:`read_table` rejoins it transparently.
:func:`bistat.store.trim.trim` (``bistat compact --trim``) then keeps, lossily, only what the analysis
reads of those outputs (each arm's reference pass in full, every other output up to its first
divergence from it); it lives above this module, as it needs the analysis's divergence rules.
What readers of a trimmed run need stays here: :func:`trim_info` says whether (and for what) a
run is trimmed, :func:`check_trim` whether that serves a reader.

The format is documented field by field in ``docs/RECORDS.md``. Design follows pyperf's versioned,
immutable result files and criterion's raw samples kept beside the analysis (see STYLE.md §1.5).

Examples
--------
>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
>>> with RunWriter.create(d, {"run_id": "demo"}) as w:
...     w.append("events", {"arm": "a", "event": "started", "time_utc": "t", "detail": None})
>>> read_table(d, "events")["event"].tolist()
['started']
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "parse_time",
    "recorded_registration_path",
    "run_declaration",
    "SCHEMA_VERSION",
    "RUN_SCHEMA",
    "TABLES",
    "RecordsError",
    "RunWriter",
    "TableRead",
    "read_header",
    "read_jsonl",
    "read_table",
    "load_table",
    "compact",
    "OUTPUTS_FILE",
    "OUTPUT_FIELDS",
    "OUTPUT_LENGTH",
    "TRIM_RULE",
    "TRIM_SERVES",
    "trim_info",
    "check_trim",
    "COUNTING_STATUSES",
    "pass_counts",
    "pass_states",
    "counted_passes",
    "ENGINE_LOGS_DIR",
    "NOTES_FILE",
    "PROBE_FILE",
    "PROBE_GLOB",
    "token_sha256",
    "logprob_sha256",
    "table_schema",
]

SCHEMA_VERSION = 1
RUN_SCHEMA = f"bistat.run/{SCHEMA_VERSION}"
TABLES = ("schedule", "responses", "passes", "metrics", "environment", "events")
HEADER_FILE = "run.json"
#: Beside the tables: the engines' logs the runner keeps (``ARM-N.log.gz``), the operator's notes
#: (free text, quoted by findings) and a ``bistat probe --output`` report.
ENGINE_LOGS_DIR = "engine-logs"
NOTES_FILE = "NOTES.md"
PROBE_FILE = "probe.json"
#: Parts of one probe beside it (``probe-ARM.json``: the same needle and settings, other arms),
#: merged by ``bistat analyze``.
PROBE_GLOB = "probe*.json"

# Typed Parquet columns per table. Fields not listed here (nested dicts such as ``batching`` or
# ``fingerprint``, lists of lists such as ``top_logprobs``, and any field a later writer adds) are
# stored as JSON text and decoded again on read, so a Parquet read returns what the JSONL read does.
_COLUMN_TYPES: dict[str, dict[str, pa.DataType]] = {
    "schedule": {
        "schema": pa.string(), "event": pa.string(), "seq": pa.int64(), "arm": pa.string(),
        "pass_index": pa.int64(), "kind": pa.string(), "block": pa.int64(),
        "time_utc": pa.string(), "status": pa.string(), "n_failed": pa.int64(),
    },
    "responses": {
        "schema": pa.string(), "arm": pa.string(), "seq": pa.int64(), "pass_index": pa.int64(),
        "kind": pa.string(), "prompt_id": pa.string(), "prompt_index": pa.int64(),
        "token_ids": pa.list_(pa.int64()), "text": pa.string(),
        "logprobs": pa.list_(pa.float64()), "finish_reason": pa.string(),
        "n_prompt_tokens": pa.int64(), "t_submit": pa.float64(), "t_first_token": pa.float64(),
        "t_done": pa.float64(), "error": pa.string(), "attempts": pa.int64(),
        "token_sha256": pa.string(), "logprob_sha256": pa.string(),
    },
    "passes": {
        "schema": pa.string(), "arm": pa.string(), "seq": pa.int64(), "pass_index": pa.int64(),
        "kind": pa.string(), "wall_s": pa.float64(), "n_requests": pa.int64(),
        "n_failed": pa.int64(), "prompt_tokens": pa.int64(), "output_tokens": pa.int64(),
        "output_tokens_per_s": pa.float64(), "requests_per_s": pa.float64(),
        "started_utc": pa.string(),
    },
    "metrics": {
        "schema": pa.string(), "arm": pa.string(), "seq": pa.int64(), "t": pa.float64(),
        "num_requests_running": pa.float64(), "num_requests_waiting": pa.float64(),
        "num_preemptions_total": pa.float64(), "generation_tokens_total": pa.float64(),
        "prompt_tokens_total": pa.float64(), "source": pa.string(),
        "step_batch_size": pa.float64(),
    },
    "environment": {
        "schema": pa.string(), "arm": pa.string(), "block": pa.int64(),
    },
    "events": {
        "schema": pa.string(), "arm": pa.string(), "event": pa.string(),
        "time_utc": pa.string(), "detail": pa.string(),
    },
}

_META_PREFIX = b"bistat."
_CHUNK_LINES = 20_000


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (pyarrow's carry newlines)."""
    return " ".join(str(exc).split())


@functools.lru_cache(maxsize=64)
def _check_parquet_pages(path: str, mtime_ns: int, size: int) -> None:
    """Read every page of a Parquet file once (per file version) with its CRC checked, so a
    damaged page is found even in a column the caller does not read; raises what pyarrow
    raises."""
    pq.read_table(path, page_checksum_verification=True)


def _read_parquet(path, **kwargs) -> pa.Table:
    """``pq.read_table`` checking each data page's CRC where the file has them (every
    compaction since they were written; older files are read as before)."""
    return pq.read_table(path, page_checksum_verification=True, **kwargs)


class RecordsError(Exception):
    """A run directory or one of its files cannot be read or written as ``bistat.run/1``."""


def table_schema(table: str) -> str:
    """Return the ``schema`` value every line of ``table`` carries, e.g. ``"bistat.responses/1"``."""
    _check_table(table)
    return f"bistat.{table}/{SCHEMA_VERSION}"


def _check_table(table: str) -> None:
    if table not in TABLES:
        raise RecordsError(
            f"unknown table {table!r}; expected one of {', '.join(repr(t) for t in TABLES)}"
        )


def _json_default(value: Any) -> Any:
    """Turn numpy scalars and arrays into JSON; refuse anything else by name."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    raise TypeError(f"value of type {type(value).__name__} is not JSON serialisable")


def _dumps(record: Mapping[str, Any], where: str) -> str:
    try:
        return json.dumps(record, default=_json_default, allow_nan=False, ensure_ascii=False,
                          separators=(",", ":"))
    except ValueError as exc:
        bad = sorted(k for k, v in record.items()
                     if isinstance(v, float) and not np.isfinite(v))
        raise RecordsError(
            f"{where}: field(s) {bad or '(nested)'} hold NaN or infinity, which JSON cannot "
            f"represent; write null for a value that was not measured"
        ) from exc
    except TypeError as exc:
        raise RecordsError(f"{where}: {exc}; convert it to str, int, float, list or dict") from exc


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


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

    def _handle(self, table: str):
        fh = self._files.get(table)
        if fh is None:
            path = self.run_dir / f"{table}.jsonl"
            fh = open(path, "ab")
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
            for fh in self._files.values():
                fh.close()
            self._files.clear()
            self._closed = True

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_header(run_dir: str | os.PathLike) -> dict:
    """Read and check ``run.json``; raise :class:`RecordsError` for a missing file or unknown schema."""
    path = Path(run_dir) / HEADER_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise RecordsError(f"{path}: not found; is {Path(run_dir)} a bistat run directory?") from exc
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise RecordsError(f"{path}: expected a JSON object")
    _check_schema(header.get("schema"), RUN_SCHEMA, f"{path}: field 'schema'")
    return header


def _check_schema(found: Any, expected: str, where: str) -> None:
    if found == expected:
        return
    kind = expected.rsplit("/", 1)[0]
    if isinstance(found, str) and found.startswith(kind + "/"):
        raise RecordsError(
            f"{where}: schema version {found!r} is not supported; this bistat reads {expected!r}. "
            f"Upgrade bistat to read newer records"
        )
    raise RecordsError(f"{where}: schema {found!r}, expected {expected!r}")


def _table_of(path: Path) -> str | None:
    name = path.name
    for suffix in (".jsonl", ".parquet"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return stem if stem in TABLES else None
    return None


def _iter_jsonl(path: Path, stop_at: int | None = None) -> Iterator[tuple[int, bytes, bool]]:
    """Yield (line number, raw line, ends with newline) up to byte ``stop_at``."""
    with open(path, "rb") as fh:
        read = 0
        for lineno, raw in enumerate(fh, start=1):
            read += len(raw)
            if stop_at is not None and read > stop_at:
                return
            yield lineno, raw, raw.endswith(b"\n")


def _parse_lines(path: Path, columns: Sequence[str] | None, stop_at: int | None = None,
                 chunk: int | None = None) -> Iterator[tuple[list[dict], list[str]]]:
    table = _table_of(path)
    expected = table_schema(table) if table else None
    keep = set(columns) | {"schema"} if columns is not None else None
    records: list[dict] = []
    gaps: list[str] = []
    for lineno, raw, complete in _iter_jsonl(path, stop_at):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            what = "truncated line (no newline: cut off while being written)" if not complete \
                else "unreadable line (cut off by a crash and closed off on resume)"
            gaps.append(f"{path.name}:{lineno}: {what}; ignored")
            continue
        if not isinstance(record, dict):
            gaps.append(f"{path.name}:{lineno}: not a JSON object; ignored")
            continue
        schema = record.get("schema")
        if expected is not None:
            _check_schema(schema, expected, f"{path}:{lineno}")
        elif not isinstance(schema, str):
            raise RecordsError(f"{path}:{lineno}: record has no 'schema' field")
        if keep is not None:
            record = {k: v for k, v in record.items() if k in keep}
        records.append(record)
        if chunk is not None and len(records) >= chunk:
            yield records, gaps
            records, gaps = [], []
    yield records, gaps


def iter_jsonl_strict(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, record)`` of a JSONL file, refusing damage instead of skipping it.

    For checks that must not pass over data (registration precedence, design CV): only a
    truncated *last* line (a crash while writing) is ignored; any other unparsable line raises
    :class:`RecordsError` naming the file and line. Lines that are not JSON objects are skipped;
    a missing file yields nothing. (:func:`read_jsonl` is the lenient reader that reports gaps.)
    """
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                continue
            raise RecordsError(f"{path}:{i + 1}: not a JSON line ({exc})") from None
        if isinstance(rec, dict):
            yield i + 1, rec


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Read one JSONL table file: return its records and its gaps.

    A gap is a line that cannot be parsed (typically a truncated last line after a crash); it is
    skipped and described as ``"<file>:<line>: ..."``. A record of an unknown schema version
    raises :class:`RecordsError`. A missing file reads as no records and no gaps.
    """
    path = Path(path)
    if not path.exists():
        return [], []
    records, gaps = next(_parse_lines(path, None))
    return records, gaps


@dataclass(frozen=True)
class TableRead:
    """One table as read: the frame, the gaps found and which file it came from."""

    frame: pd.DataFrame
    gaps: tuple[str, ...]
    source: str  # "parquet", "jsonl" or "absent"


def _parquet_meta(path: Path) -> dict[str, str]:
    meta = pq.read_metadata(path).metadata or {}
    return {k[len(_META_PREFIX):].decode(): v.decode() for k, v in meta.items()
            if k.startswith(_META_PREFIX)}


def file_sha256(path: Path, size: int | None = None) -> str:
    """SHA-256 (hex) of a file's first ``size`` bytes (all when None)."""
    h = hashlib.sha256()
    left = path.stat().st_size if size is None else size
    with open(path, "rb") as fh:
        while left > 0:
            block = fh.read(min(left, 1 << 20))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _parquet_state(run_dir: Path, table: str) -> tuple[bool, str | None]:
    """Whether ``<table>.parquet`` is what a read uses, and why not when the JSONL's content
    changed behind it: the JSONL has the size recorded at compaction but not the content hash
    (``source_sha256``; compactions before it was recorded are checked by size only)."""
    pq_path = run_dir / f"{table}.parquet"
    if not pq_path.exists():
        return False, None
    jsonl = run_dir / f"{table}.jsonl"
    try:
        meta = _parquet_meta(pq_path)
    except (OSError, pa.ArrowException) as exc:   # a damaged footer
        if not jsonl.exists():
            raise RecordsError(f"{pq_path}: unreadable ({_one_line(exc)}); its JSONL is not kept, so the "
                               "table cannot be read: restore the file from where the run was "
                               "copied from") from exc
        return False, f"{pq_path}: unreadable ({_one_line(exc)}); read from {jsonl.name} instead"
    if meta.get("schema") != table_schema(table):
        return False, None
    if not jsonl.exists():
        return True, None
    if str(jsonl.stat().st_size) != meta.get("source_bytes"):
        return False, None
    recorded = meta.get("source_sha256")
    if recorded is None:
        return True, None
    actual = file_sha256(jsonl)
    if actual == recorded:
        return True, None
    return False, (f"{jsonl}: content changed since compaction (sha256 {actual}, recorded "
                   f"{recorded} at compaction, same size); the JSONL was read, not "
                   f"{pq_path.name}: check which one holds the recorded data")


def _parquet_is_complete(run_dir: Path, table: str) -> bool:
    return _parquet_state(run_dir, table)[0]


def load_table(run_dir: str | os.PathLike, table: str, columns: Sequence[str] | None = None, *,
               filters: Mapping[str, Iterable[Any]] | None = None) -> TableRead:
    """Read one table of a run as a :class:`TableRead`.

    Parameters
    ----------
    run_dir : path
        The run directory.
    table : str
        One of :data:`TABLES`.
    columns : sequence of str, optional
        Columns to read (all when None). A requested column that no record has comes back
        filled with None, so callers can rely on it.
    filters : mapping, optional
        ``{column: allowed values}``; only rows whose value is among the allowed ones are read.

    Notes
    -----
    The compacted ``<table>.parquet`` is read when it is complete (the JSONL has not grown since
    compaction); otherwise the JSONL is parsed. List columns come back as Python lists and
    JSON-encoded columns as their decoded values in both cases. A slim ``responses.parquet``
    is rejoined with :data:`OUTPUTS_FILE` (read only when a heavy column is asked for) and
    gives the same frame as a plain one.
    """
    _check_table(table)
    run_dir = Path(run_dir)
    cols = list(columns) if columns is not None else None
    flt = {k: frozenset(v) for k, v in (filters or {}).items()}
    complete, changed = _parquet_state(run_dir, table)
    path = run_dir / f"{table}.jsonl"
    if complete:
        try:
            st = (run_dir / f"{table}.parquet").stat()
            _check_parquet_pages(str(run_dir / f"{table}.parquet"), st.st_mtime_ns, st.st_size)
            return _load_parquet(run_dir / f"{table}.parquet", table, cols, flt)
        except (OSError, pa.ArrowException) as exc:
            # a page whose CRC fails, a damaged footer: the JSONL, when kept, is the record
            if not path.exists():
                raise RecordsError(
                    f"{run_dir / f'{table}.parquet'}: unreadable ({_one_line(exc)}); its JSONL is not kept, "
                    f"so the table cannot be read: restore the file from where the run was "
                    f"copied from") from exc
            changed = (f"{run_dir / f'{table}.parquet'}: unreadable ({_one_line(exc)}); "
                       f"read from {path.name} instead")
    if not path.exists():
        return TableRead(_records_to_frame([], table, cols or []), (), "absent")
    want = None if cols is None else sorted(set(cols) | set(flt))
    parts: list[pd.DataFrame] = []
    gaps: list[str] = [changed] if changed else []
    for records, chunk_gaps in _parse_lines(path, want, chunk=200_000):
        gaps.extend(chunk_gaps)
        if flt:
            records = [r for r in records
                       if all(r.get(k) in allowed for k, allowed in flt.items())]
        parts.append(_records_to_frame(records, table, cols))
    frame = _concat(parts, table, cols)
    return TableRead(_finish_columns(frame, cols), tuple(gaps), "jsonl")


def _field_names(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def _records_to_frame(records: list[dict], table: str, cols: list[str] | None) -> pd.DataFrame:
    """Build the frame a Parquet read of the same records would give (same dtypes)."""
    typed = _COLUMN_TYPES[table]
    fields = _field_names(records) if cols is None else [c for c in cols]
    data: dict[str, Any] = {}
    for f in fields:
        values = [r.get(f) for r in records]
        if f in typed:
            try:
                arr = pa.array(values, type=typed[f])
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise RecordsError(f"{table}.jsonl: field {f!r} does not hold {typed[f]} values "
                                   f"({exc}); fix the writer of this table") from exc
            data[f] = _arrow_to_series(arr)
        else:
            data[f] = pd.Series(values, dtype=object)
    return pd.DataFrame(data, columns=fields)


def _concat(parts: list[pd.DataFrame], table: str, cols: list[str] | None) -> pd.DataFrame:
    parts = [p for p in parts if len(p)] or parts[:1]
    if not parts:
        return _records_to_frame([], table, cols)
    if len(parts) == 1:
        return parts[0]
    return pd.concat(parts, ignore_index=True)


def _arrow_to_series(col: "pa.Array | pa.ChunkedArray") -> pd.Series:
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        # pandas' default string dtype (Arrow-backed from pandas 3: no copy, fast factorize);
        # a missing value reads as missing (NaN / None), test it with isna()
        return pd.Series(col.to_pandas())
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t):
        return pd.Series(col.to_pylist(), dtype=object)
    return pd.Series(col.to_pandas())


def _finish_columns(frame: pd.DataFrame, cols: list[str] | None,
                    table: str | None = None) -> pd.DataFrame:
    """Add requested columns no record has (typed nulls) and order the columns as requested."""
    if cols is None:
        return frame
    typed = _COLUMN_TYPES.get(table or "", {})
    for c in cols:
        if c not in frame.columns:
            if c in typed:
                frame[c] = _arrow_to_series(pa.nulls(len(frame), typed[c])).set_axis(frame.index)
            else:
                frame[c] = pd.Series([None] * len(frame), dtype=object, index=frame.index)
    return frame[cols]


def _load_parquet(path: Path, table: str, cols: list[str] | None,
                  flt: Mapping[str, frozenset]) -> TableRead:
    meta = _parquet_meta(path)
    if table == "responses" and meta.get("layout") == "slim":
        return _load_slim_responses(path, meta, cols, flt)
    json_cols = set(json.loads(meta.get("json_columns", "[]")))
    gaps = tuple(json.loads(meta.get("gaps", "[]")))
    present = pq.read_schema(path).names
    read_cols = None if cols is None else [c for c in cols if c in present]
    pa_filters = None
    if flt:
        pa_filters = [(k, "in", sorted(v, key=repr)) for k, v in flt.items() if k in present]
        if any(k not in present for k in flt):   # filter on an absent column: nothing matches
            read_cols = read_cols if read_cols is not None else present
            empty = _read_parquet(path, columns=read_cols).slice(0, 0)
            return TableRead(_finish_columns(_to_pandas(empty, json_cols), cols, table), gaps,
                             "parquet")
    tbl = _read_parquet(path, columns=read_cols, filters=pa_filters or None)
    frame = _to_pandas(tbl, json_cols)
    return TableRead(_finish_columns(frame, cols, table), gaps, "parquet")


def _to_pandas(tbl: pa.Table, json_cols: set[str]) -> pd.DataFrame:
    data: dict[str, Any] = {}
    for name in tbl.column_names:
        col = tbl.column(name)
        if name in json_cols:
            data[name] = pd.Series([None if v is None else json.loads(v) for v in col.to_pylist()],
                                   dtype=object)
        else:
            data[name] = _arrow_to_series(col)
    return pd.DataFrame(data, columns=tbl.column_names)


def read_table(run_dir: str | os.PathLike, table: str, columns: Sequence[str] | None = None, *,
               filters: Mapping[str, Iterable[Any]] | None = None) -> pd.DataFrame:
    """Read one table of a run as a pandas DataFrame (see :func:`load_table`, which adds the gaps)."""
    return load_table(run_dir, table, columns, filters=filters).frame


# --------------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------------


def _scan_fields(path: Path, stop_at: int) -> list[str]:
    """Every field name used in a JSONL file, in first-seen order."""
    seen: dict[str, None] = {}
    for records, _ in _parse_lines(path, None, stop_at=stop_at, chunk=_CHUNK_LINES):
        for r in records:
            for k in r:
                seen.setdefault(k, None)
    return list(seen)


def compact(run_dir: str | os.PathLike, *, slim: bool = False,
            top_k: int | None = None) -> list[Path]:
    """Write ``<table>.parquet`` beside every non-empty ``<table>.jsonl`` of a run; keep the JSONL.

    Known fields get typed columns (``token_ids`` as ``list<int64>``, times as ``float64``...);
    other fields are stored as JSON text and decoded on read. The Parquet footer records the
    schema, the JSONL's byte size at compaction (the completeness check of :func:`read_table`)
    and the gaps found. Each file is written to a temporary name and renamed into place.

    Parameters
    ----------
    run_dir : path
        The run directory.
    slim : bool, default False
        Store each distinct output of ``responses`` once: ``responses.parquet`` keeps one row per
        response without ``token_ids``, ``text``, ``logprobs`` and ``top_logprobs`` (plus
        ``output_index``, the row of its output), and :data:`OUTPUTS_FILE` holds every distinct
        output once, in the narrowest types that keep every bit (see ``docs/RECORDS.md``,
        "Slim compaction"). :func:`read_table` rejoins them and returns what it returns for a
        plain compaction.
    top_k : int, optional
        With ``slim``: keep only the first ``top_k`` alternatives of ``top_logprobs`` at each
        position (recorded in both footers as ``bistat.top_k``). Default: keep what was recorded.

    Returns
    -------
    list of Path
        The Parquet files written, in :data:`TABLES` order (:data:`OUTPUTS_FILE` right after
        ``responses.parquet``).

    Raises
    ------
    RecordsError
        No readable ``run.json``; a field whose values do not fit its typed column; ``top_k``
        without ``slim`` or below 1.
    """
    run_dir = Path(run_dir)
    read_header(run_dir)
    if top_k is not None:
        if not slim:
            raise RecordsError(f"{run_dir}: top_k={top_k!r} applies to a slim compaction only; "
                               f"pass slim=True (bistat compact --slim --top-k K)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise RecordsError(f"{run_dir}: top_k must be a whole number >= 1, got {top_k!r}")
    written: list[Path] = []
    for table in TABLES:
        src = run_dir / f"{table}.jsonl"
        if not src.exists() or src.stat().st_size == 0:
            continue
        if table == "responses" and slim:
            written.extend(_compact_responses_slim(run_dir, src, top_k))
            continue
        written.append(_compact_table(run_dir, table, src))
        if table == "responses":
            # a slim compaction's outputs file would be left over, unreferenced
            (run_dir / OUTPUTS_FILE).unlink(missing_ok=True)
    _fsync_dir(run_dir)
    return written


def _records_to_arrow(records: list[dict], schema: pa.Schema, json_cols: Sequence[str],
                      src: Path) -> pa.Table:
    """One chunk of records as a table of ``schema`` (JSON columns as text)."""
    arrays = []
    for f in schema.names:
        values = [r.get(f) for r in records]
        if f in json_cols:
            values = [None if v is None else json.dumps(v, sort_keys=True, ensure_ascii=False)
                      for v in values]
        try:
            arrays.append(pa.array(values, type=schema.field(f).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise RecordsError(
                f"{src}: field {f!r} does not hold {schema.field(f).type} values "
                f"({exc}); fix the writer of this table"
            ) from exc
    return pa.Table.from_arrays(arrays, schema=schema)


def _source_meta(table: str, size: int, n_rows: int, json_cols: Sequence[str],
                 gaps: Sequence[str], sha256: str) -> dict[str, str]:
    return {
        "bistat.schema": table_schema(table),
        "bistat.source_bytes": str(size),
        "bistat.source_sha256": sha256,
        "bistat.source_records": str(n_rows),
        "bistat.json_columns": json.dumps(list(json_cols)),
        "bistat.gaps": json.dumps(list(gaps)),
    }


def _compact_table(run_dir: Path, table: str, src: Path) -> Path:
    """The plain compaction of one table: every field in ``<table>.parquet``."""
    size = src.stat().st_size
    fields = _scan_fields(src, size)
    typed = _COLUMN_TYPES[table]
    json_cols = [f for f in fields if f not in typed]
    schema = pa.schema([(f, typed.get(f, pa.string())) for f in fields])
    dst = run_dir / f"{table}.parquet"
    tmp = run_dir / f".{table}.parquet.tmp"
    gaps: list[str] = []
    n_rows = 0
    # page CRCs (dictionary and data pages): reads check them, see ``_check_parquet_pages``
    with pq.ParquetWriter(tmp, schema, compression="zstd", write_page_checksum=True) as writer:
        for records, chunk_gaps in _parse_lines(src, None, stop_at=size, chunk=_CHUNK_LINES):
            gaps.extend(chunk_gaps)
            if not records:
                continue
            writer.write_table(_records_to_arrow(records, schema, json_cols, src))
            n_rows += len(records)
        writer.add_key_value_metadata(_source_meta(table, size, n_rows, json_cols, gaps,
                                                   file_sha256(src, size)))
    os.replace(tmp, dst)
    return dst


# --------------------------------------------------------------------------------------------
# Slim compaction of responses: each distinct output stored once
# --------------------------------------------------------------------------------------------

#: The file of a slim compaction that holds each distinct output once.
OUTPUTS_FILE = "outputs.parquet"
#: The heavy fields of ``responses`` that a slim compaction moves to :data:`OUTPUTS_FILE`.
OUTPUT_FIELDS = ("token_ids", "text", "logprobs", "top_logprobs")
_KEY_HASHES = ("token_sha256", "logprob_sha256")   # the output key, when it identifies the payload
_KEY_PAYLOAD = ("payload_sha256",)                  # the fallback key: a hash of the whole payload
_ZSTD_LEVEL = 19
_INT32 = (-(2 ** 31), 2 ** 31 - 1)


def _payload_digest(payload: Sequence[Any]) -> bytes:
    """SHA-256 of an output's heavy fields as canonical JSON (floats by repr: every bit counts)."""
    text = json.dumps(list(payload), ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).digest()


def _compact_responses_slim(run_dir: Path, src: Path, top_k: int | None) -> list[Path]:
    """Write the slim ``responses.parquet`` and :data:`OUTPUTS_FILE`; return both paths."""
    size = src.stat().st_size
    fields = _scan_fields(src, size)
    typed = _COLUMN_TYPES["responses"]
    light = [f for f in fields if f not in OUTPUT_FIELDS]
    heavy = [f for f in OUTPUT_FIELDS if f in fields]
    json_cols = [f for f in light if f not in typed]
    light_schema = pa.schema([(f, typed.get(f, pa.string())) for f in light])

    chunks: list[pa.Table] = []
    gaps: list[str] = []
    payload_of_digest: dict[bytes, int] = {}
    payloads: list[tuple] = []            # distinct heavy payloads, first-seen order
    digests: list[bytes] = []
    first_prompt: list[str] = []          # prompt of the first response of each payload
    payload_of_key: dict[tuple, int] = {}
    key_identifies_payload = True
    resp_payload: list[int] = []
    resp_key: list[tuple] = []
    max_alternatives = 0
    for records, chunk_gaps in _parse_lines(src, None, stop_at=size, chunk=_CHUNK_LINES):
        gaps.extend(chunk_gaps)
        if not records:
            continue
        for r in records:
            payload = [r.get(f) for f in OUTPUT_FIELDS]
            top = payload[3]
            if isinstance(top, list):
                for pos in top:
                    if isinstance(pos, list):
                        max_alternatives = max(max_alternatives, len(pos))
                if top_k is not None:
                    payload[3] = [pos[:top_k] if isinstance(pos, list) else pos for pos in top]
            digest = _payload_digest(payload)
            idx = payload_of_digest.get(digest)
            if idx is None:
                idx = payload_of_digest[digest] = len(payloads)
                payloads.append(tuple(payload))
                digests.append(digest)
                first_prompt.append(str(r.get("prompt_id")))
            key = (r.get("token_sha256"), r.get("logprob_sha256"))
            if payload_of_key.setdefault(key, idx) != idx:
                key_identifies_payload = False
            resp_payload.append(idx)
            resp_key.append(key)
        chunks.append(_records_to_arrow(records, light_schema, json_cols, src))
    n_rows = len(resp_payload)

    # Output rows: one per distinct key, grouped by prompt so that near-identical outputs sit
    # side by side (zstd finds the shared prefixes).
    if key_identifies_payload:
        key_cols = _KEY_HASHES
        row_keys = list(payload_of_key)               # first-seen order
        row_payload = [payload_of_key[k] for k in row_keys]
        resp_row_key = resp_key
    else:
        key_cols = _KEY_PAYLOAD
        row_keys = [(d.hex(),) for d in digests]
        row_payload = list(range(len(payloads)))
        resp_row_key = [row_keys[i] for i in resp_payload]
    order = sorted(range(len(row_keys)), key=lambda i: (first_prompt[row_payload[i]], i))
    row_keys = [row_keys[i] for i in order]
    row_payload = [row_payload[i] for i in order]
    row_of_key = {k: row for row, k in enumerate(row_keys)}
    output_index = pa.array([row_of_key[k] for k in resp_row_key], type=pa.int32())
    outputs_id = hashlib.sha256(json.dumps(
        [size, n_rows, list(key_cols), row_keys], separators=(",", ":")).encode()).hexdigest()

    out_arrays, encoding = _encode_outputs([payloads[i] for i in row_payload], heavy, src)
    out_columns: dict[str, pa.Array] = {}
    for j, name in enumerate(key_cols):
        out_columns[name] = pa.array([k[j] for k in row_keys], type=pa.string())
    out_columns.update(out_arrays)
    outputs = pa.table(out_columns)
    top_k_text = "recorded" if top_k is None else str(top_k)
    common = {
        "bistat.outputs_id": outputs_id,
        "bistat.outputs_key": "+".join(key_cols),
        "bistat.top_k": top_k_text,
    }
    outputs = outputs.replace_schema_metadata({
        **common,
        "bistat.schema": table_schema("responses"),
        "bistat.part": "outputs",
        "bistat.n_outputs": str(len(row_keys)),
        "bistat.columns": json.dumps(heavy),
        "bistat.encoding": json.dumps(encoding, sort_keys=True),
        "bistat.max_alternatives_recorded": str(max_alternatives),
    })

    light_tbl = (pa.concat_tables(chunks) if chunks else light_schema.empty_table())
    light_tbl = light_tbl.append_column("output_index", output_index)
    if key_cols == _KEY_PAYLOAD:
        light_tbl = light_tbl.append_column(
            "payload_sha256", pa.array([k[0] for k in resp_row_key], type=pa.string()))
    light_tbl = light_tbl.replace_schema_metadata({
        **_source_meta("responses", size, n_rows, json_cols, gaps, file_sha256(src, size)),
        **common,
        "bistat.layout": "slim",
        "bistat.columns": json.dumps(fields),
        "bistat.outputs_file": OUTPUTS_FILE,
    })

    out_dst, resp_dst = run_dir / OUTPUTS_FILE, run_dir / "responses.parquet"
    out_tmp, resp_tmp = run_dir / f".{OUTPUTS_FILE}.tmp", run_dir / ".responses.parquet.tmp"
    _write_slim(outputs, out_tmp)
    _write_slim(light_tbl, resp_tmp)
    os.replace(out_tmp, out_dst)
    os.replace(resp_tmp, resp_dst)
    return [resp_dst, out_dst]


def _write_slim(tbl: pa.Table, path: Path) -> None:
    """zstd at a high level; dictionaries for strings only; byte-stream split for floats."""
    strings, floats = [], []
    for field in tbl.schema:
        t, leaf = field.type, field.name
        while pa.types.is_list(t):
            t, leaf = t.value_type, leaf + ".list.element"
        if pa.types.is_string(t):
            strings.append(leaf)
        elif pa.types.is_floating(t):
            floats.append(leaf)
    # Page CRCs: a read checks every data page's content (``_read_parquet``), so an edit inside
    # the file that keeps its size is found, not read as data.
    pq.write_table(tbl, path, compression="zstd", compression_level=_ZSTD_LEVEL,
                   use_dictionary=strings, use_byte_stream_split=floats or False,
                   write_page_checksum=True)


def _flat_values(arr: pa.Array) -> np.ndarray:
    while pa.types.is_list(arr.type):
        arr = arr.flatten()
    return arr.drop_null().to_numpy(zero_copy_only=False)


def _fits_int32(arr: pa.Array) -> bool:
    vals = _flat_values(arr)
    return bool(vals.size == 0 or (vals.min() >= _INT32[0] and vals.max() <= _INT32[1]))


def _float32_exact(arr: pa.Array) -> bool:
    """Whether every value survives float64 -> float32 -> float64 bit for bit."""
    vals = np.ascontiguousarray(_flat_values(arr), dtype=np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        back = vals.astype(np.float32).astype(np.float64)
    return bool(np.array_equal(back.view(np.uint64), vals.view(np.uint64)))


def _narrow(arr: pa.Array, int_or_float: str) -> tuple[pa.Array, str]:
    """``arr`` (list of int64 / float64 at any depth) in 32 bits where that keeps every bit."""
    if int_or_float == "int":
        ok, narrow, names = _fits_int32(arr), pa.int32(), ("int32", "int64")
    else:
        ok, narrow, names = _float32_exact(arr), pa.float32(), ("float32", "float64")
    if not ok:
        return arr, names[1]
    return arr.cast(_with_leaf(arr.type, narrow), safe=False), names[0]


def _with_leaf(type_: pa.DataType, leaf: pa.DataType) -> pa.DataType:
    """``type_`` (a list type at any depth) with its innermost value type replaced by ``leaf``."""
    if pa.types.is_list(type_):
        return pa.list_(_with_leaf(type_.value_type, leaf))
    return leaf


def _typed(values: list, type_: pa.DataType, field: str, src: Path) -> pa.Array:
    try:
        return pa.array(values, type=type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RecordsError(f"{src}: field {field!r} does not hold {type_} values ({exc}); fix "
                           f"the writer of this table") from exc


def _same_float(a: Any, b: Any) -> bool:
    return (type(a) is float and type(b) is float
            and struct.pack("<d", a) == struct.pack("<d", b))


def _split_top(tops: list, tokens: list, lps: list) -> tuple[list, list, list] | None:
    """``top_logprobs`` as parallel token-id / logprob lists, or None when not ``[int, float]`` pairs.

    Where every position's first alternative is the chosen token with the chosen logprob
    (bitwise), that first alternative is left out and the output's ``top_chosen_first`` is set.
    """
    ids_col, val_col, chosen_col = [], [], []
    for top, toks, lp in zip(tops, tokens, lps):
        if top is None:
            ids_col.append(None)
            val_col.append(None)
            chosen_col.append(False)
            continue
        if not isinstance(top, list):
            return None
        for pos in top:
            if pos is None:
                continue
            if not isinstance(pos, list):
                return None
            for alt in pos:
                if not (isinstance(alt, list) and len(alt) == 2 and type(alt[0]) is int
                        and type(alt[1]) is float):
                    return None
        chosen = (isinstance(toks, list) and isinstance(lp, list)
                  and len(top) == len(toks) == len(lp) and len(top) > 0
                  and all(pos and type(t) is int and pos[0][0] == t
                          and type(v) in (int, float) and not isinstance(v, bool)
                          and _same_float(pos[0][1], float(v))
                          for pos, t, v in zip(top, toks, lp)))
        skip = 1 if chosen else 0
        ids_col.append([None if pos is None else [a[0] for a in pos[skip:]] for pos in top])
        val_col.append([None if pos is None else [a[1] for a in pos[skip:]] for pos in top])
        chosen_col.append(chosen)
    return ids_col, val_col, chosen_col


def _encode_outputs(payloads: list[tuple], heavy: list[str],
                    src: Path) -> tuple[dict[str, pa.Array], dict[str, str]]:
    """The outputs' columns (narrowed where exact) and how each heavy field was stored."""
    columns: dict[str, pa.Array] = {}
    encoding: dict[str, str] = {}
    tokens = [p[0] for p in payloads]
    lps = [p[2] for p in payloads]
    if "token_ids" in heavy:
        arr = _typed(tokens, pa.list_(pa.int64()), "token_ids", src)
        columns["token_ids"], encoding["token_ids"] = _narrow(arr, "int")
    if "text" in heavy:
        columns["text"] = _typed([p[1] for p in payloads], pa.string(), "text", src)
        encoding["text"] = "string"
    if "logprobs" in heavy:
        arr = _typed(lps, pa.list_(pa.float64()), "logprobs", src)
        columns["logprobs"], encoding["logprobs"] = _narrow(arr, "float")
    if "top_logprobs" in heavy:
        tops = [p[3] for p in payloads]
        split = _split_top(tops, tokens if "token_ids" in heavy else [None] * len(tops),
                           lps if "logprobs" in heavy else [None] * len(tops))
        if split is None:
            # not all [token_id, logprob] pairs of an int and a float: JSON text, as today
            columns["top_logprobs"] = pa.array(
                [None if v is None else json.dumps(v, sort_keys=True, ensure_ascii=False)
                 for v in tops], type=pa.string())
            encoding["top_logprobs"] = "json"
        else:
            ids, vals, chosen = split
            columns["top_token_ids"], id_type = _narrow(
                _typed(ids, pa.list_(pa.list_(pa.int64())), "top_logprobs", src), "int")
            columns["top_logprob_values"], val_type = _narrow(
                _typed(vals, pa.list_(pa.list_(pa.float64())), "top_logprobs", src), "float")
            columns["top_chosen_first"] = pa.array(chosen, type=pa.bool_())
            encoding["top_logprobs"] = "parallel"
            encoding["top_token_ids"] = id_type
            encoding["top_logprob_values"] = val_type
    return columns, encoding


def _outputs_fix(run_dir: Path, out_path: Path) -> str:
    if (run_dir / "responses.jsonl").exists():
        return f"re-create it with `bistat compact --slim {run_dir}`"
    return (f"restore it from where the run is kept (e.g. `git checkout -- {out_path}`); without "
            f"responses.jsonl it cannot be rebuilt")


def _slim_outputs(run_dir: Path, meta: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
    """The outputs file a slim ``responses.parquet`` names, its footer checked against ``meta``."""
    out_path = run_dir / meta.get("outputs_file", OUTPUTS_FILE)
    holds = ("responses.parquet was compacted with --slim and keeps token_ids, text, logprobs "
             "and top_logprobs in it")
    if not out_path.is_file():
        raise RecordsError(f"{out_path}: not found; {holds}; {_outputs_fix(run_dir, out_path)}")
    try:
        out_meta = _parquet_meta(out_path)
    except (pa.ArrowException, OSError) as exc:
        raise RecordsError(f"{out_path}: not a readable Parquet file ({exc}); {holds}; "
                           f"{_outputs_fix(run_dir, out_path)}") from exc
    if out_meta.get("part") != "outputs" or out_meta.get("outputs_id") != meta.get("outputs_id"):
        raise RecordsError(
            f"{out_path}: does not belong to {run_dir / 'responses.parquet'} (its outputs_id "
            f"{out_meta.get('outputs_id')!r} differs from {meta.get('outputs_id')!r}); "
            f"{_outputs_fix(run_dir, out_path)}")
    return out_path, out_meta


def _join_outputs(run_dir: Path, out_path: Path, out_meta: Mapping[str, str], resp: pa.Table,
                  fields: list[str]) -> dict[str, pd.Series]:
    """The heavy ``fields`` of every row of ``resp`` (which holds ``output_index`` and the key)."""
    encoding = json.loads(out_meta.get("encoding", "{}"))
    key_cols = out_meta.get("outputs_key", "").split("+")
    parallel = encoding.get("top_logprobs") == "parallel"
    need = set(fields)
    if "top_logprobs" in need and parallel:
        need.discard("top_logprobs")
        need |= {"top_token_ids", "top_logprob_values", "top_chosen_first"}
        need |= {f for f in ("token_ids", "logprobs") if f in encoding}
    read = key_cols + [c for c in ("token_ids", "text", "logprobs", "top_logprobs",
                                   "top_token_ids", "top_logprob_values", "top_chosen_first",
                                   OUTPUT_LENGTH)
                       if c in need]
    try:
        out = _read_parquet(out_path, columns=read)
    except (pa.ArrowException, OSError) as exc:
        raise RecordsError(f"{out_path}: cannot be read ({exc}); "
                           f"{_outputs_fix(run_dir, out_path)}") from exc
    index = resp.column("output_index").combine_chunks()
    n_out = out.num_rows
    if index.null_count or (len(index) and not (0 <= pc.min(index).as_py()
                                                and pc.max(index).as_py() < n_out)):
        raise RecordsError(f"{run_dir / 'responses.parquet'}: output_index outside the "
                           f"{n_out} rows of {out_path}; {_outputs_fix(run_dir, out_path)}")
    taken = out.take(index)
    for k in key_cols:
        a, b = taken.column(k), resp.column(k)
        same = pc.or_(pc.fill_null(pc.equal(a, b), False), pc.and_(pc.is_null(a), pc.is_null(b)))
        if not pc.all(same).as_py():
            raise RecordsError(f"{out_path}: its {k} column does not match "
                               f"{run_dir / 'responses.parquet'}'s; "
                               f"{_outputs_fix(run_dir, out_path)}")
    result: dict[str, pd.Series] = {}
    if "token_ids" in fields:
        result["token_ids"] = _arrow_to_series(
            taken.column("token_ids").cast(pa.list_(pa.int64())))
    if "text" in fields:
        result["text"] = _arrow_to_series(taken.column("text"))
    if "logprobs" in fields:
        result["logprobs"] = _arrow_to_series(
            taken.column("logprobs").cast(pa.list_(pa.float64())))
    if OUTPUT_LENGTH in fields:
        result[OUTPUT_LENGTH] = _arrow_to_series(taken.column(OUTPUT_LENGTH).cast(pa.int64()))
    if "top_logprobs" in fields:
        if parallel:
            result["top_logprobs"] = pd.Series(_rejoin_top(taken, encoding), dtype=object)
        else:
            result["top_logprobs"] = pd.Series(
                [None if v is None else json.loads(v)
                 for v in taken.column("top_logprobs").to_pylist()], dtype=object)
    return result


def _rejoin_top(taken: pa.Table, encoding: Mapping[str, str]) -> list:
    """``top_logprobs`` as recorded: ``[[token_id, logprob], ...]`` per position."""
    ids = taken.column("top_token_ids").to_pylist()
    vals = taken.column("top_logprob_values").cast(pa.list_(pa.list_(pa.float64()))).to_pylist()
    chosen = taken.column("top_chosen_first").to_pylist()
    n = taken.num_rows
    toks = (taken.column("token_ids").cast(pa.list_(pa.int64())).to_pylist()
            if "token_ids" in encoding else [None] * n)
    lps = (taken.column("logprobs").cast(pa.list_(pa.float64())).to_pylist()
           if "logprobs" in encoding else [None] * n)
    rows: list = []
    for row_ids, row_vals, first, row_toks, row_lps in zip(ids, vals, chosen, toks, lps):
        if row_ids is None:
            rows.append(None)
        elif first:
            rows.append([[[t, v]] + [[a, b] for a, b in zip(pi, pv)]
                         for t, v, pi, pv in zip(row_toks, row_lps, row_ids, row_vals)])
        else:
            rows.append([None if pi is None else [[a, b] for a, b in zip(pi, pv)]
                         for pi, pv in zip(row_ids, row_vals)])
    return rows


def _load_slim_responses(path: Path, meta: Mapping[str, str], cols: list[str] | None,
                         flt: Mapping[str, frozenset]) -> TableRead:
    """Read a slim ``responses.parquet``, rejoining the heavy fields from its outputs file."""
    run_dir = path.parent
    out_path, out_meta = _slim_outputs(run_dir, meta)
    logical = json.loads(meta["columns"])
    json_cols = set(json.loads(meta.get("json_columns", "[]")))
    gaps = tuple(json.loads(meta.get("gaps", "[]")))
    key_cols = meta.get("outputs_key", "").split("+")
    outputs_fields = (*OUTPUT_FIELDS, OUTPUT_LENGTH)
    if (OUTPUT_LENGTH in (cols or ()) or OUTPUT_LENGTH in flt) and \
            _trim_of(out_meta, out_path) is not None:
        logical = [*logical, OUTPUT_LENGTH]   # a trimmed run's full lengths, read on request
    want = list(logical) if cols is None else [c for c in cols if c in logical]
    heavy_flt = {k: v for k, v in flt.items() if k in outputs_fields}
    light_flt = {k: v for k, v in flt.items() if k not in outputs_fields}
    heavy = [f for f in outputs_fields if f in logical and (f in want or f in heavy_flt)]
    light = [c for c in want if c not in heavy]
    read_cols = list(dict.fromkeys(light + (["output_index", *key_cols] if heavy else [])))
    if any(k not in logical for k in flt):   # filter on an absent column: nothing matches
        tbl = _read_parquet(path, columns=read_cols).slice(0, 0)
    else:
        pa_filters = [(k, "in", sorted(v, key=repr)) for k, v in light_flt.items()]
        tbl = _read_parquet(path, columns=read_cols, filters=pa_filters or None)
    frame = _to_pandas(tbl.select(light), json_cols)
    if heavy:
        for name, series in _join_outputs(run_dir, out_path, out_meta, tbl, heavy).items():
            frame[name] = series
        if heavy_flt:
            keep = np.ones(len(frame), dtype=bool)
            for k, allowed in heavy_flt.items():
                keep &= np.array([_allowed(v, allowed) for v in frame[k]], dtype=bool)
            frame = frame[keep].reset_index(drop=True)
    frame = frame[want]
    return TableRead(_finish_columns(frame, cols, "responses"), gaps, "parquet")


def _allowed(value: Any, allowed: frozenset) -> bool:
    try:
        return value in allowed
    except TypeError:   # an unhashable value (a list) is never among hashable allowed values
        return False


# --------------------------------------------------------------------------------------------
# Which passes count (one rule for bistat.analysis.summary, bistat.analysis.anatomy and the trim)
# --------------------------------------------------------------------------------------------

#: How a ``counted`` pass may end (its last ``end`` event in ``schedule``) and still count:
#: ``failed`` = it ran to its end with some requests failed (their prompts are excluded from
#: matching); ``interrupted`` passes were re-run in full and do not count.
COUNTING_STATUSES = ("complete", "failed")


def pass_counts(kind: str | None, status: str | None, has_responses: bool) -> bool:
    """Whether a pass counts: recorded ``counted`` and ended in :data:`COUNTING_STATUSES`, or
    with no ``end`` event (``status`` None) but with counted responses recorded."""
    return kind == "counted" and (status in COUNTING_STATUSES
                                  or (status is None and has_responses))


def _field(value: Any) -> str | None:
    """A string field as recorded: None when missing (pandas reads NaN / NA) or empty."""
    return value if isinstance(value, str) and value else None


def pass_states(passes: pd.DataFrame, schedule: pd.DataFrame,
                with_responses: set[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, str | None]]:
    """``(kind, status)`` of every pass the records mention, by ``(arm, pass_index)``.

    The kind is the pass record's (``passes``), else its ``start`` event's (``schedule``), else
    ``counted`` when it has counted responses (``with_responses``), else ``unknown``; the status
    is its last ``end`` event's (``no status`` when that has none), or None without an ``end``
    event. :func:`pass_counts` of the two (and of ``with_responses``) says whether it counts.
    """
    pass_kind: dict[tuple[str, int], str | None] = {}
    if not passes.empty and {"arm", "pass_index"} <= set(passes.columns):
        for rec in passes.to_dict("records"):
            pass_kind[(str(rec.get("arm")), int(rec.get("pass_index")))] = _field(rec.get("kind"))
    start_kind: dict[tuple[str, int], str | None] = {}
    status: dict[tuple[str, int], str] = {}
    if not schedule.empty and {"event", "arm", "pass_index"} <= set(schedule.columns):
        for rec in schedule.to_dict("records"):
            key = (str(rec.get("arm")), int(rec.get("pass_index")))
            if rec.get("event") == "end":
                status[key] = _field(rec.get("status")) or "no status"
            elif rec.get("event") == "start":
                start_kind[key] = _field(rec.get("kind"))
    return {key: (pass_kind.get(key) or start_kind.get(key)
                  or ("counted" if key in with_responses else "unknown"), status.get(key))
            for key in set(pass_kind) | set(start_kind) | with_responses | set(status)}


def counted_passes(run_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Counted passes per arm (:func:`pass_states`, :func:`pass_counts`), as ``bistat.analysis.summary``
    counts them (which also leaves out arms its registration does not declare)."""
    run_dir = Path(run_dir)
    resp = read_table(run_dir, "responses", ["arm", "pass_index", "kind"])
    resp = resp[resp["kind"] == "counted"]
    with_responses = {(str(a), int(p)) for a, p in zip(resp["arm"], resp["pass_index"])}
    out: dict[str, set[int]] = {}
    states = pass_states(read_table(run_dir, "passes"), read_table(run_dir, "schedule"),
                         with_responses)
    for key, (kind, status) in states.items():
        if pass_counts(kind, status, key in with_responses):
            out.setdefault(key[0], set()).add(key[1])
    return {arm: sorted(ps) for arm, ps in sorted(out.items())}


# --------------------------------------------------------------------------------------------
# Trimmed runs, as readers see them (the trim itself is bistat.store.trim: it needs the analysis)
# --------------------------------------------------------------------------------------------

#: The logical ``responses`` column a trimmed run adds on request: each output's full length in
#: tokens, as recorded before trimming (null where the run is not trimmed: ``len(token_ids)``).
OUTPUT_LENGTH = "n_output_tokens"
#: The rule a trimmed ``outputs.parquet`` follows (``bistat.store.trim`` in both footers).
TRIM_RULE = "bistat.trim/1"
#: Match units a run trimmed for the key's unit can still be analysed under: a ``token_ids``
#: trim keeps every output through its first differing token, which is at or past the first
#: differing logprob; a ``token_ids+logprobs`` trim only through the earlier of the two.
TRIM_SERVES: dict[str, tuple[str, ...]] = {
    "token_ids": ("token_ids", "token_ids+logprobs"),
    "token_ids+logprobs": ("token_ids+logprobs",),
    "text": ("text", "token_ids", "token_ids+logprobs"),
}


def trim_info(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What :func:`bistat.store.trim.trim` recorded (``bistat.store.trim`` of :data:`OUTPUTS_FILE`), or None.

    None also when the outputs are not what a read uses: no complete slim ``responses.parquet``
    (e.g. ``responses.jsonl`` grew since compaction and is read instead).

    Returns
    -------
    dict or None
        ``rule``, ``unit`` (the match unit the outputs were trimmed for), ``reference_passes``
        (``{arm: pass_index}``: each arm's reference pass, its first counted pass), ``text`` and
        ``outputs`` (how many rows were kept in full, cut and emptied).
    """
    run_dir = Path(run_dir)
    if not _parquet_is_complete(run_dir, "responses"):
        return None
    meta = _parquet_meta(run_dir / "responses.parquet")
    if meta.get("layout") != "slim":
        return None
    _, out_meta = _slim_outputs(run_dir, meta)
    return _trim_of(out_meta, run_dir / meta.get("outputs_file", OUTPUTS_FILE))


def _trim_of(out_meta: Mapping[str, str], out_path: Path) -> dict[str, Any] | None:
    text = out_meta.get("trim")
    if text is None:
        return None
    try:
        info = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{out_path}: footer bistat.trim is not JSON ({exc}); restore the "
                           f"file from where the run is kept") from exc
    if not isinstance(info, dict) or info.get("unit") not in TRIM_SERVES:
        raise RecordsError(f"{out_path}: footer bistat.trim names no known match unit "
                           f"({text[:80]!r}); restore the file from where the run is kept")
    return info


def check_trim(run_dir: str | os.PathLike, references: Mapping[str, int | None],
               unit: str) -> None:
    """Refuse to compute divergences from a trimmed run that was trimmed for something else.

    A trimmed run keeps each non-reference output only up to where it first differs from its
    arm's reference pass under the match unit it was trimmed for; divergences from another
    reference pass, or by a unit that needs more, cannot be computed from it.

    Parameters
    ----------
    run_dir : path
        The run directory.
    references : mapping
        ``{arm: reference pass}`` as the caller defines it (None: the arm has no counted pass).
    unit : str
        The match unit the caller compares outputs by.

    Raises
    ------
    RecordsError
        Naming the file, the arm or unit, and the fix. Nothing when the run is not trimmed.
    """
    run_dir = Path(run_dir)
    info = trim_info(run_dir)
    if info is None:
        return
    path = run_dir / OUTPUTS_FILE
    fix = (f"restore the untrimmed {OUTPUTS_FILE} and responses.parquet (e.g. from git history), "
           f"or re-create them from responses.jsonl with `bistat compact --slim {run_dir}`")
    if unit not in TRIM_SERVES[info["unit"]]:
        raise RecordsError(
            f"{path}: trimmed (bistat compact --trim) for match unit {info['unit']!r}, which "
            f"keeps each non-reference output only to its first difference by that unit: too "
            f"little to compare by {unit!r}; {fix}, then trim with --unit {unit}")
    refs = info.get("reference_passes") or {}
    for arm, ref in references.items():
        trimmed_ref = refs.get(str(arm))
        if ref is None or trimmed_ref is None or int(trimmed_ref) == int(ref):
            continue
        raise RecordsError(
            f"{path}: arm {arm!r} was trimmed against reference pass {trimmed_ref} (its first "
            f"counted pass when trimmed), but pass {ref} is its reference here: its other "
            f"passes' outputs are kept only to where they first differ from pass "
            f"{trimmed_ref}; {fix}, then trim again")


# --------------------------------------------------------------------------------------------
# Hashes of token ids and logprobs (the match keys)
# --------------------------------------------------------------------------------------------


def token_sha256(ids: Sequence[int]) -> str:
    """SHA-256 (hex) of token ids as little-endian int64 bytes.

    >>> token_sha256([]) == hashlib.sha256(b"").hexdigest()
    True
    """
    return hashlib.sha256(np.asarray(list(ids), dtype="<i8").tobytes()).hexdigest()


def logprob_sha256(lps: Sequence[float] | None) -> str | None:
    """SHA-256 (hex) of logprobs as little-endian float64 bytes (bitwise); None when absent."""
    if lps is None:
        return None
    return hashlib.sha256(np.asarray(list(lps), dtype="<f8").tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# The run's time stamps and its registration


def parse_time(text: str) -> dt.datetime:
    """Parse an ISO 8601 time; a time without a zone is taken as UTC."""
    t = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)


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
