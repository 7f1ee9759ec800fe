"""The recorded-data format of a run directory (schema ``bistat.run/1``): what is on disk and
how it is named and encoded.

A run directory holds ``run.json`` (written once, :data:`HEADER_FILE`) and one append-only JSONL
file per table in :data:`TABLES`; every line is one JSON object carrying
``"schema": "bistat.<table>/1"`` (:func:`table_schema`). After a run, ``<table>.parquet`` may sit
beside each JSONL file (``bistat.store.compact``), and a slim compaction adds
:data:`OUTPUTS_FILE`. This module owns the names (tables, files beside them, the typed Parquet
columns), the JSON encoding of a line, the error every reader and writer raises
(:class:`RecordsError`), the hashes recorded with the data (:func:`token_sha256`,
:func:`logprob_sha256`, :func:`file_sha256`) and the time stamps' parser (:func:`parse_time`).
It does no reading or writing of a run itself: ``writer`` appends, ``readers`` read,
``compact`` compacts, ``passes`` says which passes count and ``run_dir`` opens a run once.

The format is documented field by field in ``docs/RECORDS.md``. Design follows pyperf's versioned,
immutable result files and criterion's raw samples kept beside the analysis (see STYLE.md §1.5).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from bistat.core.lazy import lazy_module

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

# numpy loads when a hash is first taken or a numpy value first written: the format's names,
# constants and errors also serve commands (and every --help) that never read a table
np = lazy_module("numpy")

__all__ = [
    "SCHEMA_VERSION", "RUN_SCHEMA", "TABLES", "HEADER_FILE", "ENGINE_LOGS_DIR", "NOTES_FILE",
    "PROBE_FILE", "PROBE_GLOB", "OUTPUTS_FILE", "OUTPUT_FIELDS", "OUTPUT_LENGTH", "TRIM_RULE",
    "TRIM_SERVES", "RecordsError", "table_schema", "file_sha256", "token_sha256", "utc_now",
    "command_words",
    "logprob_sha256", "parse_time",
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

#: The file of a slim compaction that holds each distinct output once.
OUTPUTS_FILE = "outputs.parquet"
#: The heavy fields of ``responses`` that a slim compaction moves to :data:`OUTPUTS_FILE`.
OUTPUT_FIELDS = ("token_ids", "text", "logprobs", "top_logprobs")
#: The logical ``responses`` column a trimmed run adds on request: each output's full length in
#: tokens, as recorded before trimming (null where the run is not trimmed: ``len(token_ids)``).
OUTPUT_LENGTH = "n_output_tokens"
#: The rule a trimmed ``outputs.parquet`` follows (``bistat.trim`` in both footers).
TRIM_RULE = "bistat.trim/1"
#: Match units a run trimmed for the key's unit can still be analysed under: a ``token_ids``
#: trim keeps every output through its first differing token, which is at or past the first
#: differing logprob; a ``token_ids+logprobs`` trim only through the earlier of the two.
TRIM_SERVES: dict[str, tuple[str, ...]] = {
    "token_ids": ("token_ids", "token_ids+logprobs"),
    "token_ids+logprobs": ("token_ids+logprobs",),
    "text": ("text", "token_ids", "token_ids+logprobs"),
}

def _column_types() -> dict[str, dict[str, pa.DataType]]:
    """Typed Parquet columns per table. Fields not listed here (nested dicts such as ``batching``
    or ``fingerprint``, lists of lists such as ``top_logprobs``, and any field a later writer
    adds) are stored as JSON text and decoded again on read, so a Parquet read returns what the
    JSONL read does."""
    import pyarrow as pa

    return {
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
            "rate_limited": pa.int64(), "retry_wait_s": pa.float64(), "preemptions": pa.int64(),
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


def __getattr__(name: str) -> Any:
    """``_COLUMN_TYPES`` (the typed Parquet columns per table), built with pyarrow when first read:
    only the readers and the compaction need it."""
    if name == "_COLUMN_TYPES":
        value = globals()[name] = _column_types()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_META_PREFIX = b"bistat."
_CHUNK_LINES = 20_000


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (pyarrow's carry newlines)."""
    return " ".join(str(exc).split())


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
                     if isinstance(v, float) and not math.isfinite(v))
        raise RecordsError(
            f"{where}: field(s) {bad or '(nested)'} hold NaN or infinity, which JSON cannot "
            f"represent; write null for a value that was not measured"
        ) from exc
    except TypeError as exc:
        raise RecordsError(f"{where}: {exc}; convert it to str, int, float, list or dict") from exc


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
# The run's time stamps
# --------------------------------------------------------------------------------------------


def command_words(argv: Sequence[str]) -> tuple[str, ...]:
    """A recorded command line as its user would type it: ``bistat`` for the program however the
    process was started -- an installed script's absolute path (``/home/me/.venv/bin/bistat``),
    ``python -m bistat`` (``.../bistat/__main__.py``), ``python -c`` (``-c``) -- so a finding
    does not show one machine's paths as the command. Another program's name (a script that
    called the library) is kept.

    Examples
    --------
    >>> command_words(["/tmp/fresh/.venv/bin/bistat", "run", "preregistrations/q.json"])
    ('bistat', 'run', 'preregistrations/q.json')
    >>> command_words(["-c", "run", "p.json"])
    ('bistat', 'run', 'p.json')
    >>> command_words(["study.py", "--fast"])
    ('study.py', '--fast')
    """
    words = tuple(str(w) for w in argv)
    if not words:
        return words
    first = words[0].replace("\\", "/")
    if (first == "-c" or first.rsplit("/", 1)[-1] == "bistat"
            or first.endswith("bistat/__main__.py")):
        return ("bistat",) + words[1:]
    return words


def utc_now() -> str:
    """The current UTC time as ISO 8601 with microseconds and a ``Z``: every record's
    ``time_utc``."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> dt.datetime:
    """Parse an ISO 8601 time; a time without a zone is taken as UTC."""
    t = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)
