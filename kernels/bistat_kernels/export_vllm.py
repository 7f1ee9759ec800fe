"""Export a bistat GEMM table in the format of vLLM 0.33.0's own tuned tables.

vLLM 0.33.0 keeps its batch-invariant GEMM tables as Python literals in
``vllm/model_executor/determinism/batch_invariant_configs.py``::

    _BATCH_INVARIANT_MATMUL_TUNED_CONFIGS: dict[str, dict[tuple[int, int], _MatmulShapeConfig]]
    # {"hopper": {(N, K): _MatmulShapeConfig(block_k=..., m_buckets=((max_m, _MatmulMConfig(
    #     block_m, block_n, num_warps, num_stages)), ...))}}

keyed by an architecture family (``_get_tuned_matmul_arch_family``: compute capability 12 ->
``sm120``, 10 -> ``blackwell``, 9 -> ``hopper``, 8.9 -> ``ada``) and by the weight shape. Its
loader (``resolve_tuned_matmul_configs``, ``_get_matmul_config``) applies them to bfloat16 only,
takes the first bucket with ``max_m >= M`` (the last one above the range), fixes
``GROUP_SIZE_M`` at 8 and launches ``min(NUM_SMS, tiles)`` programs of a kernel without split-K.
``BLOCK_K`` is per shape, as in bistat's tables. The format has no field for provenance; vLLM's
own entries carry a comment (``# Qwen3-8B tp8_lm_head``), so each exported entry carries its
measurement's provenance in comments, and a JSON sidecar holds the same data machine-readably.

What vLLM's kernel cannot express is decided here, not left implicit:

- ``split_k > 1`` (and with it ``fuse_splits``): vLLM's kernel sums all K-tiles in one chain. The
  nearest expressible configuration (the same ``block_k``, no split) is a different summation order
  and a different launch whose speed nobody measured. By default such an entry is **omitted**
  (vLLM then keeps its own entry or its default for that shape) and listed; ``split_k="nearest"``
  exports it anyway, marked ``UNMEASURED`` in its comment and in the sidecar.
- ``group_m`` other than 8, ``programs_per_sm`` other than 1, and any other bucket field vLLM does
  not read with a value other than its default: **dropped** from the bucket and listed per bucket.
  They only schedule tiles (the bits are unchanged), but the measured time belongs to the bistat
  launch, so each bucket comment says what was dropped next to the number.
- a bucket's own ``block_k`` (bistat's tables let a bucket use another BLOCK_K with the entry's
  split-K ranges; vLLM's format has one per shape): such a bucket's tile launch may not fit in
  shared memory at the entry's BLOCK_K (128 x 256 tiles in three stages do at 64, not at 128).
  A bucket re-tuned by ``sweep.retune_buckets`` recorded the launch it replaced, at the entry's
  BLOCK_K and timed at the same M in the same run (``measured.previous``): that launch is
  exported, with its own time beside bistat's. Otherwise the launch of the nearest smaller bucket
  at the entry's BLOCK_K is exported, not timed at this M. Either way the bucket lists ``block_k``
  as dropped and says where the exported launch came from (``exported_from``).
- entries of a dtype other than bfloat16: omitted (vLLM's tables apply to bfloat16 only).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from bistat_kernels.tables import BucketConfig, GemmTable, ShapeConfig

SIDECAR_SCHEMA = "bistat_kernels.vllm_export/1"
VLLM_VERSION = "0.33.0"
VLLM_CONFIGS_MODULE = "vllm.model_executor.determinism.batch_invariant_configs"
VLLM_DTYPE = "bfloat16"
VLLM_GROUP_M = 8
ARCH_FAMILIES = ("ada", "hopper", "blackwell", "sm120")
SPLIT_K_POLICIES = ("omit", "nearest")
EXPORT_VARIABLE = "BISTAT_TUNED_CONFIGS"

# Bucket fields vLLM's _MatmulMConfig (and its fixed launch) expresses; every other field of
# BucketConfig is dropped when it differs from its default.
_EXPRESSED = ("m_max", "block_m", "block_n", "num_warps", "num_stages")
_NOT_CONFIG = ("measured", "block_k")  # block_k: see _export_shape


class ExportError(ValueError):
    """The table cannot be exported as asked; the message says why and what to pass instead."""


def arch_family_for(capability: str) -> str | None:
    """vLLM 0.33.0's ``_get_tuned_matmul_arch_family`` for ``"major.minor"``."""
    try:
        major, minor = (int(x) for x in capability.split("."))
    except ValueError:
        return None
    if major == 12:
        return "sm120"
    if major == 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    if major == 8 and minor == 9:
        return "ada"
    return None


@dataclass(frozen=True)
class ExportedBucket:
    m_max: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dropped: dict[str, Any]
    measured: dict[str, Any]
    # where the exported launch came from when it is not bistat's own (a bucket's own BLOCK_K)
    exported_from: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio_to_torch_mm(self) -> float | None:
        t, mm = self.measured.get("time_ms"), self.measured.get("torch_mm_ms")
        return t / mm if t and mm else None


@dataclass(frozen=True)
class ExportedShape:
    n: int
    k: int
    block_k: int
    buckets: tuple[ExportedBucket, ...]
    layers: tuple[str, ...]
    provenance: dict[str, Any]
    selection_score: float | None
    unmeasured: str | None = None  # why the exported launch was never timed (split-K dropped)


@dataclass(frozen=True)
class VllmExport:
    """The exported entries, the omitted ones, and the two files' text."""

    arch_family: str
    source_table: str
    shapes: tuple[ExportedShape, ...]
    omitted: tuple[dict[str, Any], ...]
    split_k_policy: str
    python_text: str = ""
    sidecar: dict[str, Any] = field(default_factory=dict)

    def dropped_summary(self) -> dict[str, int]:
        """How many exported buckets lost each field."""
        counts: dict[str, int] = {}
        for s in self.shapes:
            for b in s.buckets:
                for name in b.dropped:
                    counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))


def _bucket_defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(BucketConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _dropped_fields(bucket: BucketConfig) -> dict[str, Any]:
    defaults = _bucket_defaults()
    dropped: dict[str, Any] = {}
    for f in dataclasses.fields(bucket):
        if f.name in _EXPRESSED or f.name in _NOT_CONFIG:
            continue
        value = getattr(bucket, f.name)
        if f.name == "group_m":
            if value != VLLM_GROUP_M:
                dropped[f.name] = value
        elif f.name not in defaults or value != defaults[f.name]:
            dropped[f.name] = value
    return dropped


_CONFIG_REPR = re.compile(r"(\w+)=(\w+)")


def _previous_launch(bucket: BucketConfig, block_k: int
                     ) -> tuple[tuple[int, int, int, int], float] | None:
    """The launch a re-tune replaced (``measured.previous``, the repr of a GemmConfig and its
    time at this M) as vLLM's four fields, if it ran at ``block_k``."""
    previous = bucket.measured.get("previous")
    if not isinstance(previous, dict) or "config" not in previous:
        return None
    fields = dict(_CONFIG_REPR.findall(str(previous["config"])))
    try:
        if int(fields["block_k"]) != block_k:
            return None
        return ((int(fields["block_m"]), int(fields["block_n"]), int(fields["num_warps"]),
                 int(fields["num_stages"])), float(previous["time_ms"]))
    except (KeyError, ValueError, TypeError):
        return None


def _table_arch_family(table: GemmTable, requested: str | None, source: str) -> str:
    caps = sorted({str(e.provenance.get("compute_capability")) for e in table.entries.values()
                   if e.provenance.get("compute_capability")})
    measured = {c: arch_family_for(c) for c in caps}
    if requested is not None:
        if requested not in ARCH_FAMILIES:
            raise ExportError(f"--arch-family {requested!r}: expected one of "
                              f"{', '.join(ARCH_FAMILIES)} (vLLM {VLLM_VERSION}'s families)")
        wrong = [c for c, fam in measured.items() if fam != requested]
        if wrong:
            raise ExportError(f"{source}: entries were measured on compute capability "
                              f"{', '.join(wrong)} ({measured[wrong[0]]}), not {requested!r}; "
                              f"leave out --arch-family or export a table measured on that family")
        return requested
    families = set(measured.values())
    if len(families) == 1 and None not in families:
        return families.pop()
    if not caps:
        raise ExportError(f"{source}: no entry's provenance has a compute_capability; pass "
                          f"--arch-family ({', '.join(ARCH_FAMILIES)})")
    raise ExportError(f"{source}: the entries' compute capabilities {', '.join(caps)} map to "
                      f"{sorted(str(f) for f in families)}, not one vLLM family; pass "
                      f"--arch-family or export one device's table")


def _export_shape(entry: ShapeConfig, split_k_policy: str) -> ExportedShape | dict[str, Any]:
    layers = tuple(entry.extra.get("layers") or ())
    where = {"dtype": entry.dtype, "n": entry.n, "k": entry.k, "layers": list(layers)}
    if entry.dtype != VLLM_DTYPE:
        return dict(where, reason=f"dtype {entry.dtype}: vLLM {VLLM_VERSION}'s tuned tables "
                                  f"apply to {VLLM_DTYPE} only")
    unmeasured = None
    if entry.split_k > 1:
        if split_k_policy == "omit":
            return dict(where, split_k=entry.split_k,
                        reason=f"split_k {entry.split_k}: vLLM's kernel has no split-K and the "
                               f"nearest layout (block_k {entry.block_k}, no split) was never "
                               f"timed; vLLM keeps its own entry or default for this shape "
                               f"(`--split-k nearest` exports it anyway)")
        unmeasured = (f"split_k {entry.split_k} dropped: this layout (block_k {entry.block_k}, "
                      f"one K chain) was never timed; the numbers are bistat's split-K launch")
    buckets = []
    shared = None  # the last bucket that runs at the entry's BLOCK_K
    origin: dict[str, Any] = {}
    for b in entry.buckets:
        dropped = _dropped_fields(b)
        if entry.split_k > 1:
            dropped = {"split_k": entry.split_k, **dropped}
        launch = (b.block_m, b.block_n, b.num_warps, b.num_stages)
        if b.block_k is not None and b.block_k != entry.block_k:
            previous = _previous_launch(b, entry.block_k)
            dropped = {**dropped, "block_k": b.block_k}
            if previous is not None:
                launch, time_ms = previous
                origin = {"launch": "the bucket's launch before the re-tune, at the entry's "
                                    "block_k", "time_ms": time_ms, "m": b.measured.get("m")}
            elif shared is not None:
                launch = (shared.block_m, shared.block_n, shared.num_warps, shared.num_stages)
                origin = {"launch": f"bucket m_max {shared.m_max}'s launch, not timed at this M"}
            else:
                raise ExportError(f"({entry.n}, {entry.k}): bucket m_max {b.m_max} has its own "
                                  f"block_k {b.block_k}, no launch before a re-tune and no "
                                  f"smaller bucket at the entry's {entry.block_k}; vLLM's format "
                                  f"cannot express it")
        else:
            shared = b
            origin = {}
        buckets.append(ExportedBucket(b.m_max, *launch, dropped, dict(b.measured), origin))
    selection = entry.extra.get("selection") or {}
    score = None
    if isinstance(selection, dict) and selection.get("chosen") in (selection.get("scores") or {}):
        score = selection["scores"][selection["chosen"]]
    return ExportedShape(entry.n, entry.k, entry.block_k, tuple(buckets), layers,
                         dict(entry.provenance), score, unmeasured)


def export_table(table: GemmTable, *, arch_family: str | None = None, split_k: str = "omit",
                 source: str | None = None) -> VllmExport:
    """Build the vLLM-format Python text and its provenance sidecar for ``table``.

    Deterministic: the same table gives the same bytes (no export date; each entry's own
    measurement date is in its provenance).
    """
    source = source or table.source or "<table>"
    if split_k not in SPLIT_K_POLICIES:
        raise ExportError(f"split_k policy {split_k!r}: expected one of {SPLIT_K_POLICIES}")
    family = _table_arch_family(table, arch_family, source)
    shapes: list[ExportedShape] = []
    omitted: list[dict[str, Any]] = []
    for key in sorted(table.entries):
        out = _export_shape(table.entries[key], split_k)
        (shapes if isinstance(out, ExportedShape) else omitted).append(out)
    if not shapes:
        raise ExportError(f"{source}: no entry can be expressed in vLLM {VLLM_VERSION}'s format "
                          f"({len(omitted)} omitted: "
                          f"{'; '.join(o['reason'] for o in omitted[:2])})")
    shapes.sort(key=lambda s: (s.n, s.k))
    export = VllmExport(family, source, tuple(shapes), tuple(omitted), split_k)
    return dataclasses.replace(export, python_text=_python_text(export),
                               sidecar=_sidecar(export))


def _fmt_ratio(b: ExportedBucket) -> str:
    r = b.ratio_to_torch_mm
    if r is None:
        return "not measured"
    source = str(b.measured.get("source", ""))
    label = ("" if not source else " (retune)" if "retune_buckets" in source
             else " (fused_compare)" if "fused_compare" in source else f" ({source.split()[0]})")
    return (f"{b.measured['time_ms']:.5g} ms = {r:.3f}x torch.mm at M={b.measured.get('m')}"
            + label)


def _provenance_comment(s: ExportedShape, indent: str) -> list[str]:
    p = s.provenance
    lines = [f"{indent}# {', '.join(s.layers) or 'bistat'}: {p.get('gpu_name', '?')} "
             f"{p.get('gpu_uuid', '?')}, driver {p.get('driver', '?')}, compute capability "
             f"{p.get('compute_capability', '?')}",
             f"{indent}#   torch {p.get('torch', '?')}, triton {p.get('triton', '?')}, "
             f"measured {p.get('date_utc', '?')}",
             f"{indent}#   command: {p.get('command', '?')}"]
    if s.selection_score is not None:
        lines.append(f"{indent}#   sweep score (decode-weighted geomean of time / torch.mm): "
                     f"{s.selection_score}")
    if s.unmeasured:
        lines.append(f"{indent}#   UNMEASURED: {s.unmeasured}")
    return lines


def python_table(export: VllmExport, header: Sequence[str],
                 shape_comments: Callable[[ExportedShape], list[str]],
                 bucket_comment: Callable[[ExportedShape, int, ExportedBucket], str]) -> str:
    """``export`` as the Python source of vLLM's table: ``header`` (comment lines), vLLM's
    import, then :data:`EXPORT_VARIABLE` with each shape's entry after its
    ``shape_comments(shape)`` lines and each bucket's line ending in the comment
    ``bucket_comment(shape, index, bucket)``."""
    lines = [
        *header,
        "from vllm.model_executor.determinism.batch_invariant_configs import (",
        "    _MatmulMConfig,",
        "    _MatmulShapeConfig,",
        ")",
        "",
        f"{EXPORT_VARIABLE}: dict[str, dict[tuple[int, int], _MatmulShapeConfig]] = {{",
        f'    "{export.arch_family}": {{',
    ]
    for s in export.shapes:
        lines += shape_comments(s)
        lines += [f"        ({s.n}, {s.k}): _MatmulShapeConfig(",
                  f"            block_k={s.block_k},",
                  "            m_buckets=("]
        for i, b in enumerate(s.buckets):
            lines.append(f"                ({b.m_max}, _MatmulMConfig({b.block_m}, {b.block_n}, "
                         f"{b.num_warps}, {b.num_stages})),  # {bucket_comment(s, i, b)}")
        lines += ["            ),", "        ),"]
    lines += ["    },", "}", ""]
    return "\n".join(lines)


def _bucket_note(b: ExportedBucket) -> str:
    """A bucket's measured time and ratio to torch.mm, the fields dropped and the launch it was
    exported with."""
    dropped = (f"; dropped {', '.join(f'{k}={v}' for k, v in b.dropped.items())}"
               if b.dropped else "")
    if b.exported_from:
        timed = (f" ({b.exported_from['time_ms']:.5g} ms at M={b.exported_from['m']})"
                 if "time_ms" in b.exported_from else "")
        dropped += f"; exported: {b.exported_from['launch']}{timed}"
    return f"{_fmt_ratio(b)}{dropped}"


def _python_text(export: VllmExport) -> str:
    header = [
        f"# bistat's tuned batch-invariant GEMM table in vLLM {VLLM_VERSION}'s format",
        f"# ({VLLM_CONFIGS_MODULE}: _BATCH_INVARIANT_MATMUL_TUNED_CONFIGS).",
        f"# Generated by `bistat kernels export-vllm` from {export.source_table};",
        "# do not edit by hand. To propose it upstream, merge the entries of",
        f"# {EXPORT_VARIABLE}[{export.arch_family!r}] into that module's "
        f"{export.arch_family!r} dict.",
        "# Each entry's comment holds its measurement's provenance; each bucket's, the measured",
        "# time and ratio to torch.mm of bistat's launch and the fields vLLM cannot express",
        "# (dropped). Machine-readable: the .provenance.json file beside this one.",
    ]
    if export.omitted:
        header.append("# Omitted (not expressible):")
        for o in export.omitted:
            header.append(f"#   ({o['n']}, {o['k']}) {o['dtype']} "
                          f"{', '.join(o['layers'])}: {o['reason']}")
    return python_table(export, header, lambda s: _provenance_comment(s, " " * 8),
                        lambda s, i, b: _bucket_note(b))


def _sidecar(export: VllmExport) -> dict[str, Any]:
    entries = []
    for s in export.shapes:
        entries.append({
            "n": s.n, "k": s.k, "layers": list(s.layers), "block_k": s.block_k,
            "selection_score": s.selection_score, "unmeasured": s.unmeasured,
            "buckets": [{"m_max": b.m_max,
                         "vllm_config": {"block_m": b.block_m, "block_n": b.block_n,
                                         "num_warps": b.num_warps, "num_stages": b.num_stages},
                         "dropped": b.dropped, "exported_from": b.exported_from,
                         "measured": b.measured,
                         "ratio_to_torch_mm": b.ratio_to_torch_mm} for b in s.buckets],
            "provenance": s.provenance})
    return {"schema": SIDECAR_SCHEMA, "vllm_version": VLLM_VERSION,
            "format": f"{VLLM_CONFIGS_MODULE}._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS",
            "variable": EXPORT_VARIABLE, "arch_family": export.arch_family,
            "source_table": export.source_table, "split_k_policy": export.split_k_policy,
            "vllm_launch": {"group_m": VLLM_GROUP_M, "programs": "min(NUM_SMS, tiles)",
                            "split_k": 1, "dtype": VLLM_DTYPE},
            "dropped_summary": export.dropped_summary(),
            "omitted": list(export.omitted), "entries": entries}


def sidecar_text(export: VllmExport) -> str:
    return json.dumps(export.sidecar, indent=1) + "\n"


# ---- checking the format without vLLM ----------------------------------------------------------

def _int(node: ast.AST, where: str) -> int:
    if not (isinstance(node, ast.Constant) and type(node.value) is int and node.value > 0):
        raise ExportError(f"{where}: expected a positive integer literal, got {ast.unparse(node)}")
    return node.value


def _call(node: ast.AST, name: str, where: str) -> ast.Call:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == name):
        raise ExportError(f"{where}: expected {name}(...), got {ast.unparse(node)[:60]}")
    return node


def parse_vllm_source(text: str, variable: str = EXPORT_VARIABLE,
                      ) -> dict[str, dict[tuple[int, int], tuple[int, tuple[tuple[int, tuple[int, int, int, int]], ...]]]]:
    """Read a table in vLLM 0.33.0's literal format with ``ast`` (no vLLM, no execution).

    The schema is the one ``batch_invariant_configs.py`` declares: ``_MatmulShapeConfig(block_k:
    int, m_buckets: tuple[tuple[int, _MatmulMConfig], ...])`` and ``_MatmulMConfig(block_m,
    block_n, num_warps, num_stages)``; buckets strictly ascending in ``max_m`` (the loader takes
    the first with ``max_m >= M``). Returns ``{family: {(N, K): (block_k, ((max_m, (bm, bn, nw,
    ns)), ...))}}``; raises :class:`ExportError` naming the entry that breaks it.
    """
    tree = ast.parse(text)
    value = None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == variable:
            value = node.value
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable
                                                  for t in node.targets):
            value = node.value
    if not isinstance(value, ast.Dict):
        raise ExportError(f"no dict literal assigned to {variable}")
    out: dict[str, Any] = {}
    for fam_node, shapes_node in zip(value.keys, value.values):
        if not (isinstance(fam_node, ast.Constant) and fam_node.value in ARCH_FAMILIES):
            raise ExportError(f"{variable}: key {ast.unparse(fam_node)} is not one of "
                              f"{ARCH_FAMILIES}")
        family = fam_node.value
        if not isinstance(shapes_node, ast.Dict):
            raise ExportError(f"{variable}[{family!r}]: expected a dict")
        shapes: dict[tuple[int, int], Any] = {}
        for key_node, cfg_node in zip(shapes_node.keys, shapes_node.values):
            where = f"{variable}[{family!r}][{ast.unparse(key_node)}]"
            if not (isinstance(key_node, ast.Tuple) and len(key_node.elts) == 2):
                raise ExportError(f"{where}: key must be (N, K)")
            key = (_int(key_node.elts[0], where), _int(key_node.elts[1], where))
            if key in shapes:
                raise ExportError(f"{where}: duplicate key")
            call = _call(cfg_node, "_MatmulShapeConfig", where)
            kw = {k.arg: k.value for k in call.keywords}
            if call.args or set(kw) != {"block_k", "m_buckets"}:
                raise ExportError(f"{where}: expected _MatmulShapeConfig(block_k=..., "
                                  f"m_buckets=...)")
            block_k = _int(kw["block_k"], where + ".block_k")
            if not isinstance(kw["m_buckets"], ast.Tuple) or not kw["m_buckets"].elts:
                raise ExportError(f"{where}.m_buckets: expected a non-empty tuple")
            buckets = []
            for i, item in enumerate(kw["m_buckets"].elts):
                bw = f"{where}.m_buckets[{i}]"
                if not (isinstance(item, ast.Tuple) and len(item.elts) == 2):
                    raise ExportError(f"{bw}: expected (max_m, _MatmulMConfig(...))")
                max_m = _int(item.elts[0], bw)
                m_call = _call(item.elts[1], "_MatmulMConfig", bw)
                if m_call.keywords or len(m_call.args) != 4:
                    raise ExportError(f"{bw}: _MatmulMConfig takes block_m, block_n, num_warps, "
                                      f"num_stages")
                cfg = tuple(_int(a, bw) for a in m_call.args)
                if buckets and max_m <= buckets[-1][0]:
                    raise ExportError(f"{bw}: max_m {max_m} after {buckets[-1][0]}; sort "
                                      f"ascending")
                buckets.append((max_m, cfg))
            shapes[key] = (block_k, tuple(buckets))
        out[family] = shapes
    return out
