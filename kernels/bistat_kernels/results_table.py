"""The table sections of ``kernels/RESULTS.md``, what the table is and how it was made: its
entries and M buckets, the fused split-K comparison that set some of its buckets, and the timing
check of a sweep after the toolchain was pinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bistat_kernels.results_common import Provenance, provenance


# --- the table -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    warps: int
    stages: int
    programs: int
    fused: bool


def launch(c: dict[str, Any]) -> Launch:
    return Launch(c["block_m"], c["block_n"], c["num_warps"], c["num_stages"],
                  c.get("programs_per_sm", 1), bool(c.get("fuse_splits", False)))


@dataclass(frozen=True)
class BucketCell(Launch):
    ratio: float      # sweep-time tuned / torch.mm at the bucket bound
    sourced: bool     # set (and measured) by another file than the sweep
    block_k: int | None = None  # the bucket's own BLOCK_K (same split-K ranges), else the entry's


@dataclass(frozen=True)
class TableEntry:
    n: int
    k: int
    layers: tuple[str, ...]
    block_k: int
    split_k: int
    scores: tuple[tuple[str, Any], ...]
    gpu_uuid: str
    date_utc: str
    buckets: tuple[BucketCell, ...]


@dataclass(frozen=True)
class Table:
    source: str
    entries: tuple[TableEntry, ...]
    any_fused: bool
    bounds: tuple[int, ...]           # the first entry's bucket bounds (the column heads)
    sources: tuple[str, ...]
    first_provenance: Provenance


def table(doc: dict[str, Any], source: str) -> Table:
    entries = []
    for e in doc["entries"]:
        cells = tuple(BucketCell(*vars(launch(b)).values(),
                                 ratio=b["measured"]["time_ms"] / b["measured"]["torch_mm_ms"],
                                 sourced="source" in b["measured"], block_k=b.get("block_k"))
                      for b in e["buckets"])
        entries.append(TableEntry(e["n"], e["k"], tuple(e["layers"]), e["block_k"], e["split_k"],
                                  tuple(sorted(e["selection"]["scores"].items())),
                                  e["provenance"]["gpu_uuid"], e["provenance"]["date_utc"], cells))
    return Table(source, tuple(entries),
                 any(b.get("fuse_splits", False) for e in doc["entries"] for b in e["buckets"]),
                 tuple(b["m_max"] for b in doc["entries"][0]["buckets"]),
                 tuple(sorted({b["measured"]["source"] for e in doc["entries"]
                               for b in e["buckets"] if "source" in b["measured"]})),
                 provenance(doc["entries"][0]["provenance"]))


# --- fused split-K ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """A timed variant: the table's launch, that launch fused, or a fused tile ("other")."""

    kind: str           # "table" | "fused" | "other"
    tile: str = ""      # "128x128" (other only)
    warps: str = ""
    stages: str = ""


def variant(name: str) -> Variant:
    if name in ("table", "fused"):
        return Variant(name)
    tile, _, ws = name.removeprefix("fused_").partition("w")
    warps, _, stages = ws.partition("s")
    return Variant("other", tile, warps, stages)


@dataclass(frozen=True)
class FusedRow:
    n: int
    k: int
    m: int
    config: Launch | None
    table_variant: Variant
    best_variant: Variant
    table_us: float
    fused_us: float
    best_us: float
    mm_us: float
    best_over_table: float
    best_over_mm: float
    equal: bool


@dataclass(frozen=True)
class Fused:
    source: str
    provenance: Provenance
    note: str | None
    rows: tuple[FusedRow, ...]
    failed: tuple[str, ...]


def fused(doc: dict[str, Any], source: str) -> Fused:
    prov = doc["provenance"]
    recon = doc.get("table_configs_reconstructed", {})
    rows = []
    for r in doc["rows"]:
        cfg = r.get("table_config") or recon.get(f"{r['n']}x{r['k']}/M={r['m']}")
        timed = {name: ms for name, ms in r.items()
                 if name.startswith("fused") and not name.endswith("_equal")
                 and isinstance(ms, float)}
        best = min(timed, key=timed.__getitem__)
        rows.append(FusedRow(
            r["n"], r["k"], r["m"], launch(cfg) if cfg else None, variant("table"),
            variant(best), r["table"] * 1000, r["fused"] * 1000, timed[best] * 1000,
            r["mm"] * 1000, timed[best] / r["table"], timed[best] / r["mm"],
            all(v for key, v in r.items() if key.endswith("_equal"))))
    failed = sorted({name for r in doc["rows"] for name, v in r.items()
                     if isinstance(v, str) and not name.endswith("_equal")})
    return Fused(source, provenance(prov),
                 prov.get("note", "") if prov.get("reconstructed") else None,
                 tuple(rows), tuple(failed))


# --- sweep timing check ----------------------------------------------------------------------

@dataclass(frozen=True)
class SweepShape:
    model: str
    layer: str
    n: int
    k: int
    measurements: int
    elapsed_s: float
    slowest_first_launch_s: float | None
    slow_first_launches: Any
    chosen: tuple[int, int] | None        # (BLOCK_K, SPLIT_K) this sweep chose
    committed: tuple[int, int] | None     # ... and the committed table has

    @property
    def changed(self) -> bool:
        """Whether this sweep chose another layout than the committed table."""
        return bool(self.chosen and self.committed and self.chosen != self.committed)


@dataclass(frozen=True)
class BeforeFix:
    """A shape's sweep time before the toolchain was pinned, beside this sweep's."""

    model: str
    layer: str
    before_s: float
    before_measurements: int
    before_ms_each: float
    after_s: float
    after_measurements: int
    after_ms_each: float


@dataclass(frozen=True)
class SweepTiming:
    source: str
    provenance: Provenance
    why_not_adopted: str | None
    shapes: tuple[SweepShape, ...]
    measurements: int
    total_s: float
    min_s: float
    max_s: float
    device_output: bool               # the device command's printed output was recorded
    precompile_s: Any                 # from it
    sweep_total_s: Any
    slowest_first_launch_s: float | None
    slow_first_launches: int
    before_source: str
    before_date: str
    before: tuple[BeforeFix, ...]


def sweep_timing(raw: dict[str, Any], table: dict[str, Any] | None,
                 committed: dict[str, Any] | None, before: dict[str, Any] | None,
                 device_output: dict[str, Any] | None, source: str,
                 before_source: str) -> SweepTiming:
    shapes = raw["shapes"]
    chosen = {(e["n"], e["k"]): e for e in (table or {}).get("entries", [])}
    kept = {(e["n"], e["k"]): e for e in (committed or {}).get("entries", [])}
    rows = []
    for s in shapes:
        mine = [r["first_launch_s"] for r in s["records"] if "first_launch_s" in r]
        new, old = chosen.get((s["n"], s["k"])), kept.get((s["n"], s["k"]))
        rows.append(SweepShape(s["model"], s["layer"], s["n"], s["k"], len(s["records"]),
                               s["elapsed_s"], max(mine) if mine else None,
                               s.get("slow_first_launches", "?"),
                               (new["block_k"], new["split_k"]) if new else None,
                               (old["block_k"], old["split_k"]) if old else None))
    fixes = []
    if before is not None:
        by_name = {(s["model"], s["layer"]): s for s in shapes}
        for old in before["shapes"]:
            new = by_name.get((old["model"], old["layer"]))
            if new is not None:
                fixes.append(BeforeFix(
                    old["model"], old["layer"], old["elapsed_s"], len(old["records"]),
                    1000 * old["elapsed_s"] / len(old["records"]), new["elapsed_s"],
                    len(new["records"]), 1000 * new["elapsed_s"] / len(new["records"])))
    elapsed = [s["elapsed_s"] for s in shapes]
    first = [r["first_launch_s"] for s in shapes for r in s["records"] if "first_launch_s" in r]
    not_adopted = device_output is not None and device_output.get("adopted") is False
    return SweepTiming(
        source, provenance(raw["provenance"]),
        device_output["why_not_adopted"] if not_adopted else None, tuple(rows),
        sum(len(s["records"]) for s in shapes), sum(elapsed), min(elapsed), max(elapsed),
        device_output is not None, None if device_output is None else device_output["precompile_s"],
        None if device_output is None else device_output["sweep_total_s"],
        max(first) if first else None, sum(s.get("slow_first_launches", 0) for s in shapes),
        before_source, "?" if before is None else before["provenance"].get("date_utc", "?"),
        tuple(fixes))
