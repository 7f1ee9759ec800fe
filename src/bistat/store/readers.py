"""Reading a run directory: ``run.json`` (:func:`read_header`), one JSONL file
(:func:`read_jsonl`, :func:`iter_jsonl_strict`) and one table whichever way it is stored
(:func:`load_table`, :func:`read_table`); a trimmed run as readers see it (:func:`trim_info`,
:func:`check_trim`).

Readers ignore an unreadable line (a truncated last line after a crash, or the partial line a
resumed writer closed off) and report it as a *gap*. A table is read from its compacted
``<table>.parquet`` when that is complete (the JSONL has neither grown nor changed since
compaction) and every page's CRC checks; otherwise from the JSONL, with the reason among the
gaps. A slim ``responses.parquet`` is rejoined with :data:`OUTPUTS_FILE` transparently, so every
layout gives the same frame. A trimmed run (``bistat.analysis.trim``) keeps each non-reference
output only to its first divergence; :func:`check_trim` refuses a reader it cannot serve.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bistat.store.format import (
    HEADER_FILE,
    OUTPUT_FIELDS,
    OUTPUT_LENGTH,
    OUTPUTS_FILE,
    RUN_SCHEMA,
    TRIM_SERVES,
    RecordsError,
    _COLUMN_TYPES,
    _META_PREFIX,
    _check_schema,
    _check_table,
    _one_line,
    _table_of,
    file_sha256,
    table_schema,
)

__all__ = ["TableRead", "read_header", "read_jsonl", "iter_jsonl_strict", "load_table",
           "read_table", "trim_info", "check_trim", "optional_float", "optional_int",
           "optional_str"]


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
    return _load_table(run_dir, table, columns, filters, _parquet_state(run_dir, table))


def _load_table(run_dir: Path, table: str, columns: Sequence[str] | None,
                filters: Mapping[str, Iterable[Any]] | None,
                state: tuple[bool, str | None]) -> TableRead:
    """:func:`load_table` given the table's :func:`_parquet_state` (``RecordedRun`` finds it
    once per table: it hashes the whole JSONL)."""
    cols = list(columns) if columns is not None else None
    flt = {k: frozenset(v) for k, v in (filters or {}).items()}
    complete, changed = state
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
# Slim responses: rejoining each response's output from the outputs file
# --------------------------------------------------------------------------------------------


def _outputs_fix(run_dir: Path, out_path: Path) -> str:
    if (run_dir / "responses.jsonl").exists():
        return f"re-create it with `bistat compact --slim {run_dir}`"
    from bistat.store.restore import restore_hint

    return (f"restore it {restore_hint(out_path, otherwise='from where the run is kept')}; without "
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
# Trimmed runs, as readers see them (the trim itself is bistat.analysis.trim)
# --------------------------------------------------------------------------------------------


def trim_info(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What :func:`bistat.analysis.trim.trim` recorded (``bistat.trim`` of :data:`OUTPUTS_FILE`), or None.

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
    return _trim_info(run_dir, _parquet_is_complete(run_dir, "responses"))


def _trim_info(run_dir: Path, responses_parquet_complete: bool) -> dict[str, Any] | None:
    """:func:`trim_info`, given whether ``responses.parquet`` is what a read uses."""
    if not responses_parquet_complete:
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
    _check_trim(run_dir, trim_info(run_dir), references, unit)


def _check_trim(run_dir: Path, info: Mapping[str, Any] | None,
                references: Mapping[str, int | None], unit: str) -> None:
    """:func:`check_trim`, given the run's :func:`trim_info`."""
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
# one value of a table as read (pandas gives NaN / NA where a record has none)


def optional_float(x: Any) -> float | None:
    """``float(x)``, or None for None, NaN, pandas' missing values and anything not a number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def optional_int(x: Any) -> int | None:
    """``int(x)`` of a number as :func:`optional_float` reads it, else None."""
    v = optional_float(x)
    return None if v is None else int(v)


def optional_str(x: Any) -> str | None:
    """A string field as read (pandas gives NaN / NA for a missing string), or None."""
    if x is None or (not isinstance(x, str) and pd.isna(x)):
        return None
    return str(x)
