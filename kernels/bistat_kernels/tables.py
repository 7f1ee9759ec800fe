"""Config tables for the batch-invariant persistent GEMM: schema, loading, lookup.

A table is data with its reason attached (STYLE §1.7). It maps a weight shape ``(dtype, N, K)``
to one *shape-wide* reduction layout (``block_k``, ``split_k``) and to launch parameters per M
bucket (``block_m``, ``block_n``, ``group_m``, ``num_warps``, ``num_stages``). Only the per-bucket
values change with the batch size M; they change how output tiles are scheduled, never the order
in which an output element's K-reduction is summed, which is what keeps a row's bits independent
of the batch it sits in. Values above the largest bucket reuse the largest bucket. For split-K
layouts a bucket may also set ``fuse_splits`` (optional, default false): the splits' partial sums
are then added by the one program that computed them all rather than by the last of several, in
the same order, so it too is a launch choice that leaves the bits unchanged; with it,
``flat_splits`` (optional, default false) runs that program's tiles and splits as one flat loop
over K-tiles (the same chains, no loop boundary between splits).

A bucket may also set its own ``block_k`` (optional; absent: the entry's), provided it cuts K
into the same split-K ranges as the entry's (:func:`split_ranges`). What orders an output
element's sum is the chain of k16 tensor-core steps into one float32 accumulator, split where a
split-K partial sum starts afresh; a ``tl.dot`` over a K-tile of 64 or 128 continues the same
chain, so BLOCK_K only sizes the loads. That is a claim about Triton's lowering and the hardware,
so it is measured, not assumed: ``kernels/device/block_k_check.py`` found 0 of 2,700 rows differing
across BLOCK_K 32-256 on an H200 (triton 3.6 and 3.8, mma.sync and wgmma, pointer and descriptor
loads; ``kernels/results/k10/``), the sweep's gate 1 compares every candidate with another
BLOCK_K bitwise against the layout's canonical launch, and the probe compares each bucket's
rows with the M = 1 bucket's. ``split_k`` never varies per bucket.

The launcher resolves the table of the device it runs on once, into the module-level value
``_DEVICE_TABLE`` (:mod:`bistat_kernels.resolution` chooses it: the user's or the shipped table of
the device's name, else one of the same compute capability and multiprocessor count), with vLLM's
own table for the shapes it lacks (``_FALLBACK``), and picks the M bucket by a linear scan over a
short sorted tuple: no ``functools.lru_cache`` and no ``bisect(..., key=)`` on the hot path,
because torch.compile's tracer rejected both in vLLM (FIELD-NOTES, "Correctness traps").

The schema is validated by hand rather than with pydantic: this module is imported inside vLLM
workers and on GPU machines whose images may not carry pydantic, and it must not need anything
beyond the standard library at import time.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "bistat_kernels.gemm_table/1"
TABLES_DIR = Path(__file__).resolve().parent / "tables"
#: a path, or the name of a table in TABLES_DIR, that overrides the device's own table
TABLE_ENV = "BISTAT_GEMM_TABLE"
DTYPES = ("bfloat16", "float16", "float32")

_log = logging.getLogger("bistat_kernels")


class TableError(ValueError):
    """A table file that breaks the schema; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class GemmConfig:
    """A complete launch configuration of ``_matmul_persistent_kernel``.

    ``split_k`` and the split-K ranges it cuts K into with ``block_k`` (:func:`split_ranges`) fix
    the K-reduction order; ``block_k`` otherwise only sizes the K-tiles' loads, and the other
    fields only schedule tiles.
    ``fuse_splits`` (split-K only) runs the splits of an output tile one after another in one
    program and adds their partial sums there, in split order, instead of writing them to a
    float32 workspace for the tile's last program to add: the same sums in the same order,
    without the workspace. It means nothing when ``split_k == 1`` and is normalised to
    ``False`` there, so that equal launches compare (and deduplicate) equal. ``flat_splits``
    (fused only; normalised to ``False`` otherwise) runs the fused mode as one flat loop over
    (the program's tiles) x (every K-tile), folding each split's partial into the total where the
    split ends: the nested form drains the software pipeline at every split and tile boundary,
    which cost 17-37 % against split-K 1 at M = 4096 on the three split-K shapes (the sweep's raw
    records); the same chains in the same order either way.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    programs_per_sm: int = 1  # persistent programs launched per multiprocessor (at most)
    fuse_splits: bool = False  # split-K partial sums added in the GEMM kernel (no workspace)
    tma: bool = False  # operand tiles loaded by Hopper's tensor-memory accelerator (descriptors)
    flat_splits: bool = False  # fused split-K in one flat loop over tiles x K-tiles

    def __post_init__(self) -> None:
        object.__setattr__(self, "fuse_splits", bool(self.fuse_splits) and self.split_k > 1)
        object.__setattr__(self, "flat_splits", bool(self.flat_splits) and self.fuse_splits)
        object.__setattr__(self, "tma", bool(self.tma))
        # hashed once: the launcher keys its plans by the config on every call
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _CONFIG_FIELDS)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def reduction_key(self) -> tuple[int, int]:
        """``(block_k, split_k)``: with K, the split-K ranges that order an output element's sum
        (:func:`split_ranges`); launches of another BLOCK_K with the same ranges sum the same way."""
        return (self.block_k, self.split_k)


_CONFIG_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "split_k",
                  "programs_per_sm", "fuse_splits", "tma", "flat_splits")


@dataclass(frozen=True)
class BucketConfig:
    """Launch parameters for every M with ``previous m_max < M <= m_max``.

    ``fuse_splits`` applies only to entries with ``split_k > 1`` (see :class:`GemmConfig`);
    ``tma`` loads the operand tiles through tensor descriptors (Hopper's tensor-memory accelerator)
    instead of pointer arithmetic: the same values reach the same ``tl.dot`` chain, so it too is a
    launch choice that leaves the bits unchanged (the sweep's gate 1 checks it bitwise).
    ``block_k`` (None: the entry's) is another, where it keeps the entry's split-K ranges.
    """

    m_max: int
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1
    fuse_splits: bool = False
    tma: bool = False
    block_k: int | None = None  # None: the entry's; else one with the entry's split-K ranges
    flat_splits: bool = False  # with fuse_splits: one flat loop over tiles x K-tiles
    measured: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class ShapeConfig:
    """The table entry of one weight shape: a shape-wide reduction layout and M buckets."""

    dtype: str
    n: int
    k: int
    block_k: int
    split_k: int
    buckets: tuple[BucketConfig, ...]
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # (m_max, config) per bucket, built once: the launcher's lookup is then a scan over a
        # short tuple that allocates nothing (it runs on every eager GEMM call in vLLM).
        configs = tuple((b.m_max, GemmConfig(
            block_m=b.block_m, block_n=b.block_n, block_k=b.block_k or self.block_k,
            group_m=b.group_m,
            num_warps=b.num_warps, num_stages=b.num_stages, split_k=self.split_k,
            programs_per_sm=b.programs_per_sm, fuse_splits=b.fuse_splits, tma=b.tma,
            flat_splits=b.flat_splits))
            for b in self.buckets)
        object.__setattr__(self, "_configs", configs)

    def config_for(self, m: int) -> GemmConfig:
        """The launch configuration for batch size ``m`` (linear scan; above the range: last)."""
        configs = self._configs  # type: ignore[attr-defined]
        for m_max, config in configs:
            if m <= m_max:
                return config
        return configs[-1][1]


@dataclass(frozen=True)
class GemmTable:
    """All entries of one device's table, keyed by ``(dtype, N, K)``."""

    device_name: str
    entries: dict[tuple[str, int, int], ShapeConfig]
    source: str = ""

    def lookup(self, dtype: str, n: int, k: int) -> ShapeConfig | None:
        return self.entries.get((dtype, n, k))


# vLLM 0.25.0's fixed configuration (`matmul_persistent` in
# vllm/model_executor/layers/batch_invariant.py) for every shape and every M; fp16 uses
# BLOCK_N 256 on GPUs with more than 104 KiB of shared memory per block, as vLLM does there.
DEFAULT_CONFIGS: dict[str, GemmConfig] = {
    "bfloat16": GemmConfig(128, 128, 64, 8, 8, 3),
    "float16": GemmConfig(128, 256, 64, 8, 8, 3),
    "float32": GemmConfig(128, 128, 32, 8, 8, 3),
}


def device_slug(device_name: str) -> str:
    """File stem of a device's table: ``'NVIDIA H200'`` -> ``'nvidia_h200'``."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def _is_pow2(value: int) -> bool:
    return value > 0 and (value & (value - 1)) == 0


def split_ranges(k: int, block_k: int, split_k: int) -> tuple[tuple[int, int], ...]:
    """The K ranges ``[start, end)`` whose partial sums the splits add, clipped to K.

    Two launches with the same ranges sum every output element in the same order (see the module
    docstring), whatever their BLOCK_K.

    >>> split_ranges(1536, 128, 2), split_ranges(1536, 64, 2)
    (((0, 768), (768, 1536)), ((0, 768), (768, 1536)))
    >>> split_ranges(1280, 128, 2), split_ranges(1280, 256, 2)
    (((0, 640), (640, 1280)), ((0, 768), (768, 1280)))
    """
    tiles = -(-k // block_k)
    per = -(-tiles // split_k)
    out = []
    for s in range(split_k):
        start, end = s * per * block_k, min(k, (s + 1) * per * block_k)
        if start < end:
            out.append((start, end))
    return tuple(out)


def _require_int(where: str, obj: dict[str, Any], key: str, *, pow2: bool = False,
                 minimum: int = 1) -> int:
    if key not in obj:
        raise TableError(f"{where}: missing field '{key}'; add it (an integer >= {minimum})")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TableError(f"{where}.{key}: got {value!r}; expected an integer >= {minimum}")
    if pow2 and not _is_pow2(value):
        raise TableError(f"{where}.{key}: got {value}; expected a power of two "
                         f"(Triton block sizes)")
    return value


def _optional_flag(where: str, bucket: dict[str, Any], key: str) -> bool:
    """A bucket's optional true/false field ``key`` (absent: false, as in tables written before
    it)."""
    value = bucket.get(key, False)
    if not isinstance(value, bool):
        raise TableError(f"{where}.{key}: got {value!r}; expected true or false (or leave it out "
                         f"for false)")
    return value


def _optional_fuse_splits(where: str, bucket: dict[str, Any], split_k: int) -> bool:
    """The optional ``fuse_splits`` of a bucket, refused without splits to fuse."""
    value = _optional_flag(where, bucket, "fuse_splits")
    if value and split_k == 1:
        raise TableError(f"{where}.fuse_splits: true needs the entry's split_k > 1 (got "
                         f"split_k 1: there are no splits to fuse); remove the field")
    return value


def _optional_flat_splits(where: str, bucket: dict[str, Any], fuse_splits: bool) -> bool:
    """The optional ``flat_splits`` of a bucket, refused unless the bucket fuses its splits."""
    value = _optional_flag(where, bucket, "flat_splits")
    if value and not fuse_splits:
        raise TableError(f"{where}.flat_splits: true is a form of fused split-K; set "
                         f"fuse_splits to true as well, or remove the field")
    return value


def _optional_tma(where: str, bucket: dict[str, Any], dtype: str) -> bool:
    """The optional ``tma`` of a bucket, refused for float32 entries."""
    value = _optional_flag(where, bucket, "tma")
    if value and dtype == "float32":
        raise TableError(f"{where}.tma: true is for bfloat16/float16 entries (the float32 path "
                         f"keeps pointer loads); remove the field")
    return value


def _optional_block_k(where: str, bucket: dict[str, Any], k: int, entry_block_k: int,
                      split_k: int) -> int | None:
    """A bucket's own ``block_k`` (absent: the entry's), refused unless it keeps the entry's
    split-K ranges of K (which fix the K-reduction order; BLOCK_K alone does not)."""
    if "block_k" not in bucket:
        return None
    value = _require_int(where, bucket, "block_k", pow2=True, minimum=16)
    own, entry = split_ranges(k, value, split_k), split_ranges(k, entry_block_k, split_k)
    if own != entry:
        raise TableError(f"{where}.block_k: {value} cuts K={k} into the split-K ranges {list(own)}, "
                         f"the entry's block_k {entry_block_k} into {list(entry)}; a bucket's "
                         f"block_k must keep the entry's ranges (they fix the K-reduction order): "
                         f"remove the field or pick a block_k that keeps them")
    return None if value == entry_block_k else value


def parse_table(data: Any, source: str = "<table>") -> GemmTable:
    """Validate a decoded table document and build a :class:`GemmTable`.

    Raises
    ------
    TableError
        With the file, the field and what is allowed, e.g.
        ``tables/x.json: entries[2].buckets[1].m_max: got 4 after 8; sort buckets by m_max``.
    """
    if not isinstance(data, dict):
        raise TableError(f"{source}: expected a JSON object at the top level")
    if data.get("schema") != SCHEMA:
        raise TableError(f"{source}: schema: got {data.get('schema')!r}; expected {SCHEMA!r}")
    device_name = data.get("device_name")
    if not isinstance(device_name, str) or not device_name:
        raise TableError(f"{source}: device_name: expected the GPU name torch reports, "
                         f"e.g. 'NVIDIA H200'; got {device_name!r}")
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        raise TableError(f"{source}: entries: expected a list of shape entries")
    entries: dict[tuple[str, int, int], ShapeConfig] = {}
    for i, raw in enumerate(raw_entries):
        where = f"{source}: entries[{i}]"
        if not isinstance(raw, dict):
            raise TableError(f"{where}: expected an object")
        dtype = raw.get("dtype")
        if dtype not in DTYPES:
            raise TableError(f"{where}.dtype: got {dtype!r}; expected one of {', '.join(DTYPES)}")
        n = _require_int(where, raw, "n")
        k = _require_int(where, raw, "k")
        block_k = _require_int(where, raw, "block_k", pow2=True, minimum=16)
        split_k = _require_int(where, raw, "split_k")
        provenance = raw.get("provenance")
        if not isinstance(provenance, dict) or not provenance:
            raise TableError(f"{where}.provenance: every entry needs its provenance (GPU name and "
                             f"UUID, driver, torch/triton versions, date, command)")
        raw_buckets = raw.get("buckets")
        if not isinstance(raw_buckets, list) or not raw_buckets:
            raise TableError(f"{where}.buckets: expected a non-empty list sorted by m_max")
        buckets = []
        previous = 0
        for j, rb in enumerate(raw_buckets):
            bwhere = f"{where}.buckets[{j}]"
            if not isinstance(rb, dict):
                raise TableError(f"{bwhere}: expected an object")
            m_max = _require_int(bwhere, rb, "m_max")
            if m_max <= previous:
                raise TableError(f"{bwhere}.m_max: got {m_max} after {previous}; "
                                 f"sort buckets by strictly increasing m_max")
            previous = m_max
            if "split_k" in rb:
                raise TableError(f"{bwhere}.split_k: may not vary per M bucket (it changes the "
                                 f"K-reduction order); set it once on the entry")
            fuse_splits = _optional_fuse_splits(bwhere, rb, split_k)
            buckets.append(BucketConfig(
                m_max=m_max,
                block_m=_require_int(bwhere, rb, "block_m", pow2=True, minimum=16),
                block_n=_require_int(bwhere, rb, "block_n", pow2=True, minimum=16),
                group_m=_require_int(bwhere, rb, "group_m"),
                num_warps=_require_int(bwhere, rb, "num_warps", pow2=True),
                num_stages=_require_int(bwhere, rb, "num_stages"),
                programs_per_sm=(_require_int(bwhere, rb, "programs_per_sm")
                                 if "programs_per_sm" in rb else 1),
                fuse_splits=fuse_splits,
                tma=_optional_tma(bwhere, rb, dtype),
                block_k=_optional_block_k(bwhere, rb, k, block_k, split_k),
                flat_splits=_optional_flat_splits(bwhere, rb, fuse_splits),
                measured=dict(rb.get("measured") or {}),
            ))
        key = (dtype, n, k)
        if key in entries:
            raise TableError(f"{where}: duplicate entry for dtype={dtype} N={n} K={k}; keep one")
        extra = {name: value for name, value in raw.items()
                 if name not in {"dtype", "n", "k", "block_k", "split_k", "buckets", "provenance"}}
        entries[key] = ShapeConfig(dtype, n, k, block_k, split_k, tuple(buckets), provenance, extra)
    return GemmTable(device_name=device_name, entries=entries, source=source)


def load_table(path: str | os.PathLike[str]) -> GemmTable:
    """Read and validate one table file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                         f"regenerate it with `bistat kernels sweep`") from exc
    return parse_table(data, str(path))


def table_to_dict(table_device: str, entries: list[ShapeConfig]) -> dict[str, Any]:
    """Serialize entries in the schema :func:`parse_table` reads (entries sorted by key)."""
    out = []
    for entry in sorted(entries, key=lambda e: (e.dtype, e.n, e.k)):
        buckets = []
        for b in entry.buckets:
            d = asdict(b)
            for optional in ("fuse_splits", "tma", "block_k", "flat_splits"):
                if not d[optional]:
                    del d[optional]  # optional; absent reads as false (block_k: the entry's)
            if not d["measured"]:
                del d["measured"]
            buckets.append(d)
        item: dict[str, Any] = {"dtype": entry.dtype, "n": entry.n, "k": entry.k,
                                "block_k": entry.block_k, "split_k": entry.split_k,
                                "buckets": buckets}
        item.update(entry.extra)
        item["provenance"] = entry.provenance
        out.append(item)
    return {"schema": SCHEMA, "device_name": table_device, "entries": out}


def table_path_for(device_name: str, tables_dir: Path = TABLES_DIR) -> Path:
    return tables_dir / f"{device_slug(device_name)}.json"


# ---- the module-level resolved table ------------------------------------------------------------

_DEVICE_TABLE: GemmTable | None = None
_DEVICE_TABLE_RESOLVED = False
#: vLLM's own table for the device's architecture family (bistat_kernels.vllm_table): what serves
#: a shape without an entry in _DEVICE_TABLE; None: vLLM's fixed configuration (DEFAULT_CONFIGS)
_FALLBACK: GemmTable | None = None
_RESOLUTION: Any = None  # the resolution.TableResolution that set the two above, if any
_WARNED_SHAPES: set[tuple[str, int, int]] = set()
_GENERATION = 0  # counts changes of the resolved table: launch plans made under another are stale


def generation() -> int:
    """A number that changes whenever the resolved table may have (launchers key plans by it)."""
    return _GENERATION


def override_path(value: str, tables_dir: Path = TABLES_DIR) -> Path:
    """``$BISTAT_GEMM_TABLE``'s file: a path, or the name of a table shipped in ``tables_dir``
    (``nvidia_h200``: another device's table on this one, e.g. the H200's on an H100).

    >>> override_path("nvidia_h200").name, override_path("/x/t.json").as_posix()
    ('nvidia_h200.json', '/x/t.json')
    """
    if "/" in value or value.endswith(".json"):
        return Path(value)
    path = tables_dir / f"{value}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in tables_dir.glob("*.json"))) or "none"
        raise TableError(f"{TABLE_ENV}={value}: no table of that name in {tables_dir} (shipped: "
                         f"{shipped}); give a table name or a path to a table file")
    return path


def resolve_device_table(device: Any) -> GemmTable | None:
    """Resolve the table of ``device`` into the module value, once, and say so in the log.

    ``device`` is a :class:`bistat_kernels.resolution.DeviceFacts` (name, compute capability,
    multiprocessors), a device name alone (no match by architecture then), or None (no GPU).
    The order (``$BISTAT_GEMM_TABLE``, the user's table, the shipped table of the device's name,
    one of its architecture) is :mod:`bistat_kernels.resolution`'s. Returns ``None`` when none
    resolves; shapes without an entry then go to vLLM's own table where the installed vLLM has
    one, else to :data:`DEFAULT_CONFIGS` (:func:`lookup_config`).
    """
    if _DEVICE_TABLE_RESOLVED:
        return _DEVICE_TABLE
    from bistat_kernels import resolution

    facts = device if isinstance(device, resolution.DeviceFacts) else resolution.DeviceFacts(device)
    found = resolution.resolve(facts)
    # one line, at warning level so that it reaches a vLLM worker's log (no handler is set up for
    # this logger there); a finding's environment quotes it (bistat.analysis.activation)
    _log.warning("bistat_kernels: batch-invariant GEMM table for %s: %s", facts.describe(),
                 found.describe())
    install_resolution(found)
    return found.table


def install_resolution(found: Any) -> None:
    """Make ``found`` (a :class:`bistat_kernels.resolution.TableResolution`) the resolved table
    and fallback of this process."""
    global _DEVICE_TABLE, _DEVICE_TABLE_RESOLVED, _FALLBACK, _RESOLUTION
    _DEVICE_TABLE, _FALLBACK, _RESOLUTION = found.table, found.vllm.table, found
    _DEVICE_TABLE_RESOLVED = True
    _WARNED_SHAPES.clear()
    _bump()


def resolution() -> Any:
    """The :class:`bistat_kernels.resolution.TableResolution` in force (None: none resolved
    yet, or a table set by :func:`set_device_table`)."""
    return _RESOLUTION


def set_device_table(table: GemmTable | None, fallback: GemmTable | None = None) -> None:
    """Install ``table`` as the resolved table (sweeps, probes and tests choose their own);
    shapes it lacks use ``fallback``'s entries (e.g. vLLM's table), else :data:`DEFAULT_CONFIGS`."""
    global _DEVICE_TABLE, _DEVICE_TABLE_RESOLVED, _FALLBACK, _RESOLUTION
    _DEVICE_TABLE, _FALLBACK, _RESOLUTION = table, fallback, None
    _DEVICE_TABLE_RESOLVED = True
    _WARNED_SHAPES.clear()
    _bump()


def reset_device_table() -> None:
    """Forget the resolved table so that the next lookup resolves it again."""
    global _DEVICE_TABLE, _DEVICE_TABLE_RESOLVED, _FALLBACK, _RESOLUTION
    _DEVICE_TABLE, _FALLBACK, _RESOLUTION = None, None, None
    _DEVICE_TABLE_RESOLVED = False
    _WARNED_SHAPES.clear()
    _bump()


def _bump() -> None:
    global _GENERATION
    _GENERATION += 1


def shape_source(dtype: str, n: int, k: int, *, vllm_kernel: bool = False) -> str:
    """Which table serves ``(dtype, N, K)`` under the table in force (see
    :meth:`bistat_kernels.resolution.TableResolution.shape_source`)."""
    if _RESOLUTION is not None:
        return _RESOLUTION.shape_source(dtype, n, k, vllm_kernel=vllm_kernel)
    if _DEVICE_TABLE is not None and _DEVICE_TABLE.lookup(dtype, n, k) is not None:
        return f"bistat table {Path(_DEVICE_TABLE.source).name}"
    kernel = ", on vLLM's own kernel" if vllm_kernel else ", on bistat's kernel"
    if _FALLBACK is not None and _FALLBACK.lookup(dtype, n, k) is not None:
        return _FALLBACK.device_name + kernel
    return "vLLM's fixed configuration" + kernel


def note_shape(dtype: str, n: int, k: int, source: str) -> None:
    """Log once per process and shape which table serves it (``source``: :func:`shape_source`)."""
    key = (dtype, n, k)
    if key not in _WARNED_SHAPES:
        _WARNED_SHAPES.add(key)
        _log.warning("bistat_kernels: batch-invariant GEMM %s N=%d K=%d served by %s", dtype, n,
                     k, source)


def lookup_config(m: int, n: int, k: int, dtype: str, device: Any) -> GemmConfig:
    """The launch configuration for one GEMM: the table's entry, else vLLM's table's, else the
    fixed default; a shape without an entry of the table is logged once (:func:`note_shape`).

    ``device`` is what :func:`resolve_device_table` takes, used only at the first call."""
    table = _DEVICE_TABLE if _DEVICE_TABLE_RESOLVED else resolve_device_table(device)
    entry = table.lookup(dtype, n, k) if table is not None else None
    if entry is not None:
        return entry.config_for(m)
    entry = _FALLBACK.lookup(dtype, n, k) if _FALLBACK is not None else None
    note_shape(dtype, n, k, shape_source(dtype, n, k) + (
        "" if entry is not None else f" {DEFAULT_CONFIGS[dtype]}"))
    return entry.config_for(m) if entry is not None else DEFAULT_CONFIGS[dtype]
