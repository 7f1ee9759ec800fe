"""Trimmed compaction (``bistat compact --trim``): of a slim run's outputs, only what the
registered analysis reads (lossy, opt-in).

:func:`trim` rewrites the :data:`OUTPUTS_FILE` of a run compacted with ``slim=True``, keeping
each arm's reference pass in full and every other output up to its first divergence from it,
and records what it did in both Parquet footers (``bistat.trim``); findings regenerate byte for
byte from a trimmed run (``docs/RECORDS.md``, "Trimmed compaction").

Where an output first diverges is the one definition ``bistat.core.divergence`` holds (the
analysis and the anatomy use it too), and the match unit to trim for is the registration's
(:func:`bistat.declare.run_registration.run_declaration`, its seal checked): so the trim sits in
the analysis stage, above the store and the declaration.
What readers of a trimmed run need lives with the readers: ``bistat.store.readers.trim_info``
(whether, and for what, a run is trimmed) and ``check_trim`` (whether that serves a reader);
the constants :data:`OUTPUT_LENGTH`, :data:`TRIM_RULE` and :data:`TRIM_SERVES` are part of the
format (``bistat.store.format``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from bistat.core.divergence import divergence_position
from bistat.declare.run_registration import RunRegistrationError, run_declaration
from bistat.store.compact import _INT32, _write_slim
from bistat.store.format import (
    HEADER_FILE,
    OUTPUTS_FILE,
    OUTPUT_LENGTH,
    RecordsError,
    TRIM_RULE,
    TRIM_SERVES,
)
from bistat.store.run_dir import RecordedRun
from bistat.store.writer import _fsync_dir
from bistat.store.readers import (
    _parquet_is_complete,
    _parquet_meta,
    _read_parquet,
    _slim_outputs,
    _trim_of,
)

__all__ = ["trim"]

_UNITS = tuple(TRIM_SERVES)


def _listed(values: np.ndarray | None) -> list | None:
    return None if values is None else values.tolist()


def _trim_unit(run: RecordedRun, unit: str | None) -> str:
    """The match unit to trim for: ``unit``, else the registration's that ``run.json`` names."""
    run_dir = run.path
    if unit is not None:
        if unit not in _UNITS:
            raise RecordsError(f"{run_dir}: unit {unit!r} is not a match unit; expected one of "
                               f"{', '.join(repr(u) for u in _UNITS)}")
        return unit
    try:
        decl = run_declaration(run)
    except RunRegistrationError as exc:
        raise RecordsError(f"{exc}; or pass the unit (bistat compact --trim --unit UNIT)") from exc
    if decl is None:
        raise RecordsError(
            f"{run_dir / HEADER_FILE}: registration.path does not name a readable registration "
            f"here (relative paths are tried from the working directory, then from the run "
            f"directory), so the match unit to trim for is unknown; run from where the "
            f"registration is found, or pass it (bistat compact --trim --unit UNIT)")
    match = decl.get("match") if isinstance(decl.get("match"), Mapping) else {}
    found = match.get("unit", "token_ids")   # the declaration's default (bistat.declare.experiment)
    if found not in _UNITS:
        raise RecordsError(f"{run_dir / HEADER_FILE}: the registration's match.unit {found!r} "
                           f"is not known; pass it (bistat compact --trim --unit UNIT)")
    return found


def _rows(arr: pa.Array | pa.ChunkedArray, dtype: str) -> list[np.ndarray | None]:
    """Each row of a list column as a numpy array (a view), or None for a null row."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    arr = arr.cast(pa.list_(pa.float64() if dtype == "<f8" else pa.int64()))
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[a:b] if ok else None for a, b, ok in zip(offsets[:-1], offsets[1:], valid)]


def _cut_lists(arr: pa.Array | pa.ChunkedArray, keep: np.ndarray) -> pa.Array:
    """A list column (of any depth) with row ``i`` cut to its first ``keep[i]`` elements, or null
    where ``keep[i] < 0`` (or the row is null); type and inner lists unchanged."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) & (keep >= 0)
    k = np.where(valid, np.minimum(np.diff(offsets), np.maximum(keep, 0)), 0)
    new_offsets = np.concatenate([[0], np.cumsum(k)])
    take = np.repeat(offsets[:-1] - new_offsets[:-1], k) + np.arange(new_offsets[-1])
    offset_type = pa.int64() if pa.types.is_large_list(arr.type) else pa.int32()
    return pa.ListArray.from_arrays(pa.array(new_offsets, type=offset_type),
                                    arr.values.take(pa.array(take, type=pa.int64())),
                                    type=arr.type, mask=pa.array(~valid))


def trim(run_dir: str | os.PathLike, *, unit: str | None = None) -> list[Path]:
    """Trim a slim-compacted run to what its registered analysis reads (lossy; opt-in).

    Rewrites :data:`OUTPUTS_FILE` (and ``responses.parquet``'s footer) keeping, of every output:

    - in full, every output of a response in its arm's reference pass (the arm's first counted
      pass, as ``bistat.analysis.summary`` chooses it);
    - nothing (``token_ids``, ``text``, ``logprobs``, ``top_logprobs`` null) of an output only
      warm-up responses gave: their hashes in ``responses.parquet`` still decide the matches;
    - of every other output (a response of another counted pass), its tokens, logprobs and
      top-k up to and including the first position where it differs from its arm's reference
      output for the prompt by ``unit`` (the latest position the analysis or the anatomy
      computes there; the shorter length when one is a prefix of the other), and further to its
      first position with the most alternatives; the most any of its responses needs when one
      output serves several. ``text`` is dropped where an output is cut (kept for unit
      ``text``).

    Each output's full length is kept in the column :data:`OUTPUT_LENGTH`; both footers get
    ``bistat.trim`` (``bistat.store.readers.trim_info``). The hashes are never recomputed. Findings regenerate
    byte for byte; what is lost is every comparison between two non-reference passes beyond
    where they first differ from the reference (see ``docs/RECORDS.md``, "Trimmed compaction").

    Parameters
    ----------
    run_dir : path
        The run directory, compacted with ``slim=True`` (``bistat compact --slim``).
    unit : str, optional
        The match unit to keep divergences for (``token_ids``, ``token_ids+logprobs`` or
        ``text``; :data:`TRIM_SERVES` lists what each still serves). Default: the unit of the
        registration ``run.json`` names.

    Returns
    -------
    list of Path
        ``responses.parquet`` and :data:`OUTPUTS_FILE`, rewritten (each to a temporary name,
        then renamed into place); empty when the run is already trimmed for ``unit``.

    Raises
    ------
    RecordsError
        The run is not slim-compacted (or its JSONL grew since), the unit is unknown or cannot
        be read from the registration, or the run was already trimmed for a unit that keeps
        less than ``unit`` needs.
    """
    run = RecordedRun.open(run_dir)   # the files as they are before the trim rewrites them
    run_dir = run.path
    resp_path, meta = _slim_responses(run_dir)
    out_path, out_meta = _slim_outputs(run_dir, meta)
    unit = _trim_unit(run, unit)
    done = _trim_of(out_meta, out_path)
    if done is not None:
        if unit in TRIM_SERVES[done["unit"]]:
            return []
        raise RecordsError(
            f"{out_path}: already trimmed for match unit {done['unit']!r}, which keeps too "
            f"little for {unit!r}; restore the untrimmed file (e.g. from git history) or "
            f"re-create it from responses.jsonl with `bistat compact --slim {run_dir}`")
    responses = _responses_by_output(resp_path, meta)
    # each arm's reference pass as the analysis chooses it: its first counted pass
    references = {arm: ps[0] for arm, ps in run.counted_passes.items() if ps}
    out = _read_parquet(out_path)
    outputs = _Outputs.read(out, json.loads(out_meta.get("encoding", "{}")))
    keep = _positions_kept(responses, references, outputs, unit)
    columns, whole = _cut_outputs(out, keep, outputs.full, unit)
    n_full, n_dropped = int(whole.sum()), int((keep < 0).sum())
    info = {
        "rule": TRIM_RULE,
        "unit": unit,
        "reference_passes": references,
        "text": "kept" if unit == "text" else "dropped where an output is cut",
        "outputs": {"full": n_full, "cut": out.num_rows - n_full - n_dropped,
                    "emptied": n_dropped},
    }
    _write_trimmed(run_dir, pa.table(columns), out, out_path, resp_path, info)
    return [resp_path, out_path]


def _slim_responses(run_dir: Path) -> tuple[Path, dict]:
    """``responses.parquet`` of a slim compaction that is what is read, and its footer's
    metadata; a ``RecordsError`` saying how to make one otherwise."""
    resp_path = run_dir / "responses.parquet"
    slim_fix = f"run `bistat compact --slim {run_dir}` first (it needs responses.jsonl)"
    if not resp_path.is_file():
        raise RecordsError(f"{resp_path}: not found; trimming works on a slim compaction: "
                           f"{slim_fix}")
    meta = _parquet_meta(resp_path)
    if meta.get("layout") != "slim":
        raise RecordsError(f"{resp_path}: compacted without --slim; trimming works on a slim "
                           f"compaction (each distinct output once in {OUTPUTS_FILE}): "
                           f"{slim_fix}")
    if not _parquet_is_complete(run_dir, "responses"):
        raise RecordsError(f"{resp_path}: responses.jsonl has grown since compaction, so the "
                           f"Parquet file is not what is read; {slim_fix}")
    return resp_path, meta


def _responses_by_output(resp_path: Path, meta: Mapping) -> pd.DataFrame:
    """Each response's arm, kind, pass, prompt, error and the output row it points at."""
    logical = json.loads(meta["columns"])
    if "token_ids" not in logical:
        raise RecordsError(f"{resp_path}: the responses record no token_ids; there is nothing "
                           f"to trim by")
    light_cols = [c for c in ("arm", "kind", "pass_index", "prompt_id", "error")
                  if c in logical] + ["output_index"]
    light = _read_parquet(resp_path, columns=light_cols).to_pandas()
    for c in ("arm", "kind", "prompt_id", "error"):
        if c not in light:
            light[c] = None
    return light


@dataclass(frozen=True)
class _Outputs:
    """The distinct outputs' token ids, logprobs, alternatives per position and full lengths."""

    toks: list[np.ndarray | None]
    lps: list[np.ndarray | None]
    alts: list[np.ndarray | None]    # alternatives recorded per position, per output
    full: list[int | None]

    @classmethod
    def read(cls, out: pa.Table, encoding: Mapping) -> "_Outputs":
        n_out = out.num_rows
        toks = _rows(out.column("token_ids"), "<i8")
        lps = (_rows(out.column("logprobs"), "<f8") if "logprobs" in out.column_names
               else [None] * n_out)
        alts: list[np.ndarray | None] = [None] * n_out
        if encoding.get("top_logprobs") == "parallel":
            top = out.column("top_token_ids").combine_chunks()
            counts = top.values.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
            offsets = top.offsets.to_numpy()
            alts = [counts[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        elif "top_logprobs" in out.column_names:
            alts = [None if r is None else np.array([len(p) if isinstance(p, list) else 0
                                                     for p in json.loads(r)], dtype=np.int64)
                    for r in out.column("top_logprobs").to_pylist()]
        return cls(toks, lps, alts, [None if t is None else len(t) for t in toks])


def _positions_kept(responses: pd.DataFrame, references: Mapping[str, int], outputs: _Outputs,
                    unit: str) -> np.ndarray:
    """Positions kept per output (-1: none, the output emptied): every output of a reference
    pass in full; of another counted pass's, up to and including its first divergence from the
    reference output by ``unit`` (in full where there is none to compare with); the most any of
    its responses needs, and further to its first position with the most alternatives."""
    toks, lps, alts, full = outputs.toks, outputs.lps, outputs.alts, outputs.full
    keep = np.full(len(toks), -1, dtype=np.int64)

    def need(row: int, k: int | None) -> None:
        n = full[row] or 0
        k = n if k is None else min(k, n)
        a = alts[row]
        if a is not None and k < len(a) and a[k:].max() > (a[:k].max() if k else -1):
            k = int(np.argmax(a)) + 1     # the anatomy's top-k: the most alternatives recorded
        keep[row] = max(int(keep[row]), k)

    arm_l, kind_l = responses["arm"].tolist(), responses["kind"].tolist()
    pass_l, pid_l = responses["pass_index"].tolist(), responses["prompt_id"].tolist()
    err_l, idx_l = responses["error"].tolist(), responses["output_index"].tolist()
    reference: dict[tuple[str, str], int | None] = {}
    for arm, kind, p, pid, err, row in zip(arm_l, kind_l, pass_l, pid_l, err_l, idx_l):
        if kind == "counted" and references.get(str(arm)) == int(p):
            need(row, None)
            # the last response recorded for a prompt and pass counts, as in the analysis
            reference[(str(arm), str(pid))] = None if isinstance(err, str) else row
    for arm, kind, p, pid, row in zip(arm_l, kind_l, pass_l, pid_l, idx_l):
        if kind != "counted" or references.get(str(arm)) == int(p):
            continue
        ref = reference.get((str(arm), str(pid)))
        if ref is None or toks[ref] is None or toks[row] is None:
            need(row, None)               # nothing to compare with: kept in full
            continue
        pos = divergence_position(toks[ref].tolist(), toks[row].tolist(), _listed(lps[ref]),
                                  _listed(lps[row]), unit)
        need(row, None if pos is None else pos + 1)
    return keep


def _cut_outputs(out: pa.Table, keep: np.ndarray, full: list[int | None], unit: str
                 ) -> tuple[dict[str, pa.Array], np.ndarray]:
    """The outputs' columns cut to ``keep`` positions each (``text`` dropped where an output is
    cut, but for unit ``text``), with every output's full length in :data:`OUTPUT_LENGTH`; and
    which outputs were kept whole."""
    whole = np.array([k >= 0 and k == (n or 0) for k, n in zip(keep, full)], dtype=bool)
    columns: dict[str, pa.Array] = {}
    for name in out.column_names:
        col = out.column(name).combine_chunks()
        if name in ("token_ids", "logprobs", "top_token_ids", "top_logprob_values"):
            col = _cut_lists(col, keep)
        elif name == "top_logprobs":    # JSON text
            col = pa.array([None if k < 0 or v is None else
                            json.dumps(json.loads(v)[:k], sort_keys=True, ensure_ascii=False)
                            for v, k in zip(col.to_pylist(), keep)], type=col.type)
        elif name == "text":
            kept = whole | ((keep >= 0) & (unit == "text"))
            col = pc.if_else(pa.array(kept), col, pa.nulls(len(col), col.type))
        columns[name] = col
    length_type = pa.int32() if max((n for n in full if n is not None), default=0) \
        <= _INT32[1] else pa.int64()
    columns[OUTPUT_LENGTH] = pa.array(full, type=length_type)
    return columns, whole


def _write_trimmed(run_dir: Path, outputs: pa.Table, out: pa.Table, out_path: Path,
                   resp_path: Path, info: Mapping) -> None:
    """Write the trimmed outputs and ``responses.parquet``, both footers marked ``bistat.trim``
    (``info``), each to a temporary name and renamed into place."""
    trim_meta = {"bistat.trim": json.dumps(info, sort_keys=True)}
    outputs = outputs.replace_schema_metadata({**(out.schema.metadata or {}), **trim_meta})
    responses = _read_parquet(resp_path)
    responses = responses.replace_schema_metadata(
        {**(responses.schema.metadata or {}), **trim_meta})
    out_tmp, resp_tmp = run_dir / f".{out_path.name}.tmp", run_dir / ".responses.parquet.tmp"
    _write_slim(outputs, out_tmp)
    _write_slim(responses, resp_tmp)
    # the outputs first: their footer is the one readers check, so a crash in between leaves
    # trimmed outputs marked as such beside an unchanged responses.parquet
    os.replace(out_tmp, out_path)
    os.replace(resp_tmp, resp_path)
    _fsync_dir(run_dir)
