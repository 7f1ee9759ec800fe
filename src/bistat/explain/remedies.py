"""What bistat has measured against an attention kernel whose KV tile changes with the batch.

When every first divergence of an arm starts one key past a power-of-two KV length
(:func:`bistat.analysis.anatomy.kv_tile_boundary`), the attention kernel's tile is the suspect: up to one
tile any tile width reduces a row in the same order. Which remedy applies depends on the
attention backend (the engine log names it: :func:`bistat.analysis.activation.log_markers`) and the head
size (FlashAttention 3 on Hopper switches between a 64 x 192 and a 192 x 128 tile at head size
64, never leaves 128-key tiles at 128; ``kernels/bistat_kernels/vllm_fa3.py``). This module reads the table
``src/bistat/data/attention_remedies.toml`` -- the attention shapes of the models bistat's device
scripts serve, and every remedy with the finding that measured it or the plan that will -- and
words the advice that ``bistat diagnose`` and the findings print. The table is data with its
provenance, edited by hand; nothing here measures.

Everything but :func:`load_table` is pure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ModelShape", "Remedy", "RemedyTable", "TABLE_SCHEMA", "advice_lines", "load_table",
           "model_shape", "remedies_for", "remedy_words"]

TABLE_SCHEMA = "bistat.attention-remedies/1"
STATUSES = ("working", "not yet measured")
#: Where the table lives in the repository (as findings name it).
TABLE_PATH = "src/bistat/data/attention_remedies.toml"


@dataclass(frozen=True)
class ModelShape:
    """A model's attention shape, keyed by the engine's ``model`` argument."""

    engine_model: str
    name: str
    head_size: int
    query_heads: int
    kv_heads: int
    source: str


@dataclass(frozen=True)
class Remedy:
    """One setting against a batch-dependent KV tile, for one backend at some head sizes."""

    backend: str
    head_sizes: tuple[int, ...]
    setting: str
    status: str                 # "working" or "not yet measured"
    evidence: str = ""          # working: what the finding showed
    finding: str = ""           # working: the finding that showed it
    arm: str = ""               # working: its arm in that finding
    measured: str = ""          # working: hardware, engine version, serving, model
    plan: str = ""              # not yet measured: what will measure it


@dataclass(frozen=True)
class RemedyTable:
    models: tuple[ModelShape, ...]
    remedies: tuple[Remedy, ...]


class RemedyTableError(ValueError):
    """The remedies table is malformed (the message names the file, the entry and the field)."""


_MODEL_FIELDS = {"engine_model": str, "name": str, "head_size": int, "query_heads": int,
                 "kv_heads": int, "source": str}
_REMEDY_REQUIRED = {"backend": str, "head_sizes": list, "setting": str, "status": str}
_REMEDY_OPTIONAL = {"evidence": str, "finding": str, "arm": str, "measured": str, "plan": str}


def _entry(where: str, raw: Any, required: Mapping[str, type],
           optional: Mapping[str, type] = {}) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise RemedyTableError(f"{where}: expected a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(required) - set(optional))
    if unknown:
        raise RemedyTableError(f"{where}: unknown field(s) {', '.join(unknown)}; expected "
                               + ", ".join([*required, *optional]))
    for name, kind in {**required, **optional}.items():
        if name in required and name not in raw:
            raise RemedyTableError(f"{where}.{name}: missing")
        if name in raw and not isinstance(raw[name], kind):
            raise RemedyTableError(f"{where}.{name}: expected {kind.__name__}, got "
                                   f"{type(raw[name]).__name__} {raw[name]!r}")
    return dict(raw)


def parse_table(data: Mapping[str, Any], source: str = TABLE_PATH) -> RemedyTable:
    """A :class:`RemedyTable` from the table's TOML data, checked field by field."""
    if data.get("schema") != TABLE_SCHEMA:
        raise RemedyTableError(f"{source}: field 'schema' is {data.get('schema')!r}, expected "
                               f"{TABLE_SCHEMA!r}")
    models = []
    for i, raw in enumerate(data.get("model") or []):
        models.append(ModelShape(**_entry(f"{source}: model[{i}]", raw, _MODEL_FIELDS)))
    remedies = []
    for i, raw in enumerate(data.get("remedy") or []):
        where = f"{source}: remedy[{i}]"
        entry = _entry(where, raw, _REMEDY_REQUIRED, _REMEDY_OPTIONAL)
        if entry["status"] not in STATUSES:
            raise RemedyTableError(f"{where}.status: {entry['status']!r}; expected one of "
                                   + ", ".join(repr(s) for s in STATUSES))
        if entry["status"] == "working" and not all(entry.get(k) for k in ("finding", "evidence",
                                                                            "measured")):
            raise RemedyTableError(f"{where}: a working remedy needs finding, evidence and "
                                   "measured (the study that showed it)")
        if entry["status"] != "working" and not entry.get("plan"):
            raise RemedyTableError(f"{where}.plan: missing (what will measure it)")
        entry["head_sizes"] = tuple(int(x) for x in entry["head_sizes"])
        remedies.append(Remedy(**entry))
    return RemedyTable(tuple(models), tuple(remedies))


def load_table(path: str | Path | None = None) -> RemedyTable:
    """The remedies table (default: the one shipped as ``bistat/data/attention_remedies.toml``)."""
    if path is None:
        text = (resources.files("bistat") / "data" / "attention_remedies.toml").read_text(
            encoding="utf-8")
        source = TABLE_PATH
    else:
        text, source = Path(path).read_text(encoding="utf-8"), str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RemedyTableError(f"{source}: not valid TOML ({exc})") from exc
    return parse_table(data, source)


def model_shape(model: str | None, table: RemedyTable) -> ModelShape | None:
    """The table's entry for an engine's ``model`` argument: the same path, else the same last
    path component (``/tmp/model/smollm2`` and ``smollm2``); None when the table has none.

    Only the table is read, never the model folder, so that a finding regenerates to the same
    bytes on a machine without the model.
    """
    if not model:
        return None
    for m in table.models:
        if m.engine_model == model:
            return m
    name = PurePosixPath(model.rstrip("/")).name
    return next((m for m in table.models if PurePosixPath(m.engine_model).name == name), None)


def remedies_for(backend: str, head_size: int | None, table: RemedyTable) -> tuple[Remedy, ...]:
    """The table's remedies for an attention backend at a head size (working ones first)."""
    found = [r for r in table.remedies
             if r.backend == backend and (head_size is None or head_size in r.head_sizes)]
    return tuple(sorted(found, key=lambda r: STATUSES.index(r.status)))


def remedy_words(r: Remedy) -> str:
    """One remedy in words: the setting, its status and the finding (or the plan)."""
    if r.status == "working":
        return (f"{r.setting}: working — {r.evidence} (`{r.finding}`, arm {r.arm}; "
                f"{r.measured})")
    return f"{r.setting}: {r.status} ({r.plan})"


def _shape_words(shape: ModelShape | None, model: str | None) -> str:
    if shape is None:
        return (f"head size not known to bistat (engine model {model!r} is not in "
                f"`{TABLE_PATH}`)" if model else "head size not known (no engine model recorded)")
    return (f"head size {shape.head_size} ({shape.name}: {shape.query_heads} query heads, "
            f"{shape.kv_heads} KV heads; {shape.source})")


def advice_lines(backends: Mapping[str, Sequence[str]], model: str | None,
                 table: RemedyTable) -> list[str]:
    """What the engine ran and what bistat measured against it, for arms whose divergences start
    one key past a KV tile: one line naming each backend's arms, the backend and the head size,
    then one line per remedy of the table for that backend and head size (none: the table's
    path and what to measure).

    Parameters
    ----------
    backends : mapping
        Arm name -> the attention backends its engine log named (empty: no engine log).
    model : str or None
        The engine's ``model`` argument.
    """
    shape = model_shape(model, table)
    by_backend: dict[str, list[str]] = {}
    for arm, names in backends.items():
        by_backend.setdefault(", ".join(names) if names else "", []).append(arm)
    lines = []
    for backend, arms in sorted(by_backend.items()):
        who = f"arm{'s' if len(arms) > 1 else ''} {', '.join(arms)}"
        if not backend:
            lines.append(f"{who}: attention backend not in an engine log; {_shape_words(shape, model)}")
            continue
        lines.append(f"{who}: attention backend {backend} (engine log), {_shape_words(shape, model)}")
        found = remedies_for(backend, None if shape is None else shape.head_size, table)
        at = "" if shape is None else f" at head size {shape.head_size}"
        if not found:
            lines.append(f"no remedy for {backend}{at} is in `{TABLE_PATH}` yet: an arm with an "
                         "attention backend of a fixed tile is the test")
        lines += [f"remedy for {backend}{at}: {remedy_words(r)}" for r in found]
    return lines
