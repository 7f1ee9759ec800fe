"""The recorded-data format of a run directory (schema ``bistat.run/1``): writer, readers, compaction.

A run directory holds ``run.json`` (written once) and one append-only JSONL file per table in
:data:`TABLES`. Every line is one JSON object carrying ``"schema": "bistat.<table>/1"``; each line
is written with a single ``write``, flushed and ``os.fsync``'ed, so a crash loses at most the line
in flight. Readers ignore an unreadable line (a truncated last line after a crash, or the partial
line a resumed writer closed off) and report it as a *gap*. After a run, :func:`compact` writes
``<table>.parquet`` beside each JSONL file (the JSONL is kept); :func:`read_table` prefers the
Parquet file when it is complete, that is when the JSONL has not grown since compaction.

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

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
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
    "token_sha256",
    "logprob_sha256",
    "table_schema",
]

SCHEMA_VERSION = 1
RUN_SCHEMA = f"bistat.run/{SCHEMA_VERSION}"
TABLES = ("schedule", "responses", "passes", "metrics", "environment", "events")
HEADER_FILE = "run.json"

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
        """Append ``record`` as one line of ``<table>.jsonl``, flushed and fsync'ed.

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
            os.fsync(fh.fileno())

    def close(self) -> None:
        """Close every open table file (idempotent)."""
        with self._lock:
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


def _parquet_is_complete(run_dir: Path, table: str) -> bool:
    pq_path = run_dir / f"{table}.parquet"
    if not pq_path.exists():
        return False
    meta = _parquet_meta(pq_path)
    if meta.get("schema") != table_schema(table):
        return False
    jsonl = run_dir / f"{table}.jsonl"
    if not jsonl.exists():
        return True
    return str(jsonl.stat().st_size) == meta.get("source_bytes")


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
    JSON-encoded columns as their decoded values in both cases.
    """
    _check_table(table)
    run_dir = Path(run_dir)
    cols = list(columns) if columns is not None else None
    flt = {k: frozenset(v) for k, v in (filters or {}).items()}
    if _parquet_is_complete(run_dir, table):
        return _load_parquet(run_dir / f"{table}.parquet", table, cols, flt)
    path = run_dir / f"{table}.jsonl"
    if not path.exists():
        return TableRead(_records_to_frame([], table, cols or []), (), "absent")
    want = None if cols is None else sorted(set(cols) | set(flt))
    parts: list[pd.DataFrame] = []
    gaps: list[str] = []
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
    json_cols = set(json.loads(meta.get("json_columns", "[]")))
    gaps = tuple(json.loads(meta.get("gaps", "[]")))
    present = pq.read_schema(path).names
    read_cols = None if cols is None else [c for c in cols if c in present]
    pa_filters = None
    if flt:
        pa_filters = [(k, "in", sorted(v, key=repr)) for k, v in flt.items() if k in present]
        if any(k not in present for k in flt):   # filter on an absent column: nothing matches
            read_cols = read_cols if read_cols is not None else present
            empty = pq.read_table(path, columns=read_cols).slice(0, 0)
            return TableRead(_finish_columns(_to_pandas(empty, json_cols), cols, table), gaps,
                             "parquet")
    tbl = pq.read_table(path, columns=read_cols, filters=pa_filters or None)
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


def compact(run_dir: str | os.PathLike) -> list[Path]:
    """Write ``<table>.parquet`` beside every non-empty ``<table>.jsonl`` of a run; keep the JSONL.

    Known fields get typed columns (``token_ids`` as ``list<int64>``, times as ``float64``...);
    other fields are stored as JSON text and decoded on read. The Parquet footer records the
    schema, the JSONL's byte size at compaction (the completeness check of :func:`read_table`)
    and the gaps found. Each file is written to a temporary name and renamed into place.

    Returns
    -------
    list of Path
        The Parquet files written, in :data:`TABLES` order.
    """
    run_dir = Path(run_dir)
    read_header(run_dir)
    written: list[Path] = []
    for table in TABLES:
        src = run_dir / f"{table}.jsonl"
        if not src.exists() or src.stat().st_size == 0:
            continue
        size = src.stat().st_size
        fields = _scan_fields(src, size)
        typed = _COLUMN_TYPES[table]
        json_cols = [f for f in fields if f not in typed]
        schema = pa.schema([(f, typed.get(f, pa.string())) for f in fields])
        dst = run_dir / f"{table}.parquet"
        tmp = run_dir / f".{table}.parquet.tmp"
        gaps: list[str] = []
        n_rows = 0
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for records, chunk_gaps in _parse_lines(src, None, stop_at=size, chunk=_CHUNK_LINES):
                gaps.extend(chunk_gaps)
                if not records:
                    continue
                arrays = []
                for f in fields:
                    values = [r.get(f) for r in records]
                    if f in json_cols:
                        values = [None if v is None else
                                  json.dumps(v, sort_keys=True, ensure_ascii=False)
                                  for v in values]
                    try:
                        arrays.append(pa.array(values, type=schema.field(f).type))
                    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                        raise RecordsError(
                            f"{src}: field {f!r} does not hold {schema.field(f).type} values "
                            f"({exc}); fix the writer of this table"
                        ) from exc
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
                n_rows += len(records)
            writer.add_key_value_metadata({
                "bistat.schema": table_schema(table),
                "bistat.source_bytes": str(size),
                "bistat.source_records": str(n_rows),
                "bistat.json_columns": json.dumps(json_cols),
                "bistat.gaps": json.dumps(gaps),
            })
        os.replace(tmp, dst)
        written.append(dst)
    _fsync_dir(run_dir)
    return written


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
