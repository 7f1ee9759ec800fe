"""Compaction (``bistat compact``): :func:`compact` writes ``<table>.parquet`` beside each JSONL
table of a run (the JSONL is kept), plain or slim.

Known fields get typed columns; other fields are stored as JSON text. The footer records the
schema, the JSONL's size and content hash at compaction (the completeness check of
``bistat.store.readers``) and the gaps found; every page carries a CRC. A *slim* compaction
stores each distinct output of ``responses`` once in :data:`OUTPUTS_FILE`, in the narrowest
types that keep every bit; this module owns those encodings, ``readers`` their decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bistat.store.format import (
    OUTPUT_FIELDS,
    OUTPUTS_FILE,
    TABLES,
    RecordsError,
    _CHUNK_LINES,
    _COLUMN_TYPES,
    file_sha256,
    table_schema,
)
from bistat.store.readers import _parse_lines, read_header
from bistat.store.writer import _fsync_dir

__all__ = ["compact"]


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
