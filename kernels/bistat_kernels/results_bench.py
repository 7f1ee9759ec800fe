"""The bench sections of ``kernels/RESULTS.md``: tuned vs torch.mm vs vLLM's fixed default (and
vLLM's own kernel where it ran), per row, per model and per decode step, the HBM roofline
fraction, the host cost per eager call, and the earlier runs' benches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bistat_kernels.results_common import (DECODE_LAYERS, LAYERS, SPEEDUP_GOAL, Provenance,
                                           geomean, provenance)
from bistat_kernels.results_status import Goal, goal


# --- bench -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRow:
    model: str
    layer: str
    n: int
    k: int
    m: int
    tuned_us: float
    mm_us: float
    default_us: float
    tuned_over_mm: float
    default_over_mm: float
    vllm_us: float | None = None
    vllm_over_mm: float | None = None
    vllm_tuned: bool | None = None


@dataclass(frozen=True)
class ModelGeomean:
    model: str
    tuned_over_mm: float
    default_over_mm: float
    vllm_over_mm: float | None = None


@dataclass(frozen=True)
class StepSum:
    """One decode step's GEMM time: layers x (qkv + o + gate_up + down) + lm_head."""

    model: str
    m: int
    tuned_ms: float
    mm_ms: float
    default_ms: float
    vllm_ms: float | None = None


@dataclass(frozen=True)
class VllmColumn:
    """vLLM's kernel beside ours: where it came from, its geometric means and its gates."""

    version: str
    commit: str | None
    path: str
    arch_family: str | None
    tuned_shapes: int            # shapes of vLLM's own table for this GPU's family
    benched_in_table: int        # of the benched shapes, how many that table covers
    overall: float               # vllm / torch.mm over the goal set
    decode: float
    tuned_over_vllm: float
    decode_tuned_over_vllm: float
    rows_timed: int
    rows: int
    invariant_shapes: int        # shapes whose rows were bitwise invariant across M
    shapes: int
    not_invariant: tuple[str, ...]     # "model/layer (N x K): mismatches at M=..."
    accuracy_failures: tuple[str, ...]


@dataclass(frozen=True)
class RooflineRow:
    model: str
    layer: str
    n: int
    k: int
    m: int
    weight_mib: float
    tuned: float
    mm: float
    vllm: float | None


@dataclass(frozen=True)
class Roofline:
    max_m: int
    copy_gib: float
    copy_gb_per_s: float
    rows: tuple[RooflineRow, ...]
    geomean_tuned: float
    geomean_mm: float
    geomean_vllm: float | None


@dataclass(frozen=True)
class HostRow:
    model: str
    layer: str
    n: int
    k: int
    m: int
    tuned_us: float
    mm_us: float
    vllm_us: float | None
    diff_us: float
    tuned_wall_us: float
    mm_wall_us: float


@dataclass(frozen=True)
class Host:
    calls: int
    repeats: int
    ms: tuple[int, ...]
    timing: str
    rows: tuple[HostRow, ...]
    mean_tuned_us: float
    mean_mm_us: float
    mean_vllm_us: float | None
    mean_diff_us: float
    max_diff_us: float
    goal_us: float
    goal_met: bool


@dataclass(frozen=True)
class Bench:
    source: str
    provenance: Provenance
    timing: str
    goal_ms: tuple[int, ...]
    goal: Goal
    default_over_mm: float
    decode_default_over_mm: float
    decode_speedup: float
    speedup_target: float
    rows: tuple[BenchRow, ...]
    per_model: tuple[ModelGeomean, ...]
    per_step: tuple[StepSum, ...]
    vllm: VllmColumn | None = None
    tuned_invariant_shapes: int | None = None   # from the bench's own gates, when it has them
    gate_shapes: int | None = None
    tuned_not_invariant: tuple[str, ...] = ()
    roofline: Roofline | None = None
    host: Host | None = None
    note: str | None = None  # what this bench is, where it is not the committed table's main one


def _mismatch_text(g: dict[str, Any], key: str) -> str | None:
    inv = g.get(key)
    if inv is None or inv["passed"]:
        return None
    if inv["rows_checked"] == 0:
        return (f"{g['model']}/{g['layer']} ({g['n']} x {g['k']}): not checked (no M passed "
                f"validation)")
    ms = sorted({m for m, _ in inv["mismatches"]})
    return (f"{g['model']}/{g['layer']} ({g['n']} x {g['k']}): {inv['rows_equal']}/"
            f"{inv['rows_checked']} rows equal, mismatches at M = {', '.join(map(str, ms))}")


def _invariance(gates: list[dict[str, Any]], key: str) -> tuple[int, int, tuple[str, ...]]:
    """One kernel's row-invariance gates (``key``: ``tuned_invariance`` or ``vllm_invariance``):
    the shapes that passed, the shapes gated, and a line per shape that did not pass."""
    return (sum(1 for g in gates if g.get(key, {}).get("passed")), len(gates),
            tuple(t for g in gates if (t := _mismatch_text(g, key)) is not None))


def _vllm_column(doc: dict[str, Any]) -> VllmColumn | None:
    v, s = doc.get("vllm"), doc["summary"]
    if v is None:
        return None
    gates = doc.get("gates", [])
    tuned = {tuple(x) for x in v.get("tuned_shapes", [])}
    benched = {(r["n"], r["k"]) for r in doc["rows"]}
    return VllmColumn(
        str(v.get("vllm") or "?"), v.get("vllm_commit"), str(v.get("path", "?")),
        v.get("arch_family"), len(tuned), len(benched & tuned),
        s["geomean_vllm_over_mm"], s["decode_geomean_vllm_over_mm"],
        s["geomean_tuned_over_vllm"], s["decode_geomean_tuned_over_vllm"],
        s["n_vllm_rows"], s["n_rows"], *_invariance(gates, "vllm_invariance"),
        tuple(f"{g['model']}/{g['layer']} {e}" for g in gates
              for e in g.get("vllm_accuracy_failures", [])))


def _roofline(doc: dict[str, Any]) -> Roofline | None:
    r = doc.get("roofline")
    if r is None:
        return None
    rows = tuple(RooflineRow(x["model"], x["layer"], x["n"], x["k"], x["m"],
                             x["weight_bytes"] / 2**20, x["tuned"], x["torch_mm"], x.get("vllm"))
                 for x in r["rows"])
    vllm = [x.vllm for x in rows if x.vllm is not None]
    return Roofline(r["max_m"], r["copy"]["bytes"] / 2**30, r["copy"]["gb_per_s"], rows,
                    geomean([x.tuned for x in rows]), geomean([x.mm for x in rows]),
                    geomean(vllm) if vllm else None)


def _host(doc: dict[str, Any]) -> Host | None:
    h = doc.get("host")
    if h is None:
        return None
    s = h["summary"]
    return Host(h["calls"], h["repeats"], tuple(h["ms"]), h["timing"], tuple(
        HostRow(x["model"], x["layer"], x["n"], x["k"], x["m"], x["tuned_us"], x["torch_mm_us"],
                x.get("vllm_us"), x["tuned_minus_mm_us"], x["tuned_wall_us"],
                x["torch_mm_wall_us"]) for x in h["rows"]),
        s["mean_tuned_us"], s["mean_torch_mm_us"], s.get("mean_vllm_us"),
        s["mean_tuned_minus_mm_us"], s["max_tuned_minus_mm_us"], s["goal_us"],
        s["max_tuned_minus_mm_us"] <= s["goal_us"])


def bench(doc: dict[str, Any], source: str, note: str | None = None) -> Bench:
    s, rows = doc["summary"], doc["rows"]
    with_vllm = "vllm" in doc
    per_model = []
    for model in sorted({r["model"] for r in rows}):
        chosen = [r for r in rows if r["model"] == model and r["m"] in s["goal_ms"]]
        timed = [r["vllm_over_mm"] for r in chosen if r.get("vllm_over_mm") is not None]
        per_model.append(ModelGeomean(model, geomean([r["tuned_over_mm"] for r in chosen]),
                                      geomean([r["default_over_mm"] for r in chosen]),
                                      geomean(timed) if with_vllm and timed else None))
    per_step = []
    for model, layers in sorted(LAYERS.items()):
        for m in sorted({r["m"] for r in rows if r["m"] <= s["decode_max_m"]}):
            by_layer = {r["layer"]: r for r in rows if r["model"] == model and r["m"] == m}
            if set(by_layer) != {*DECODE_LAYERS, "lm_head"}:
                continue
            totals = [layers * sum(by_layer[name][key] for name in DECODE_LAYERS)
                      + by_layer["lm_head"][key]
                      for key in ("tuned_ms", "torch_mm_ms", "default_ms")]
            vllm_total = None
            if with_vllm and all(by_layer[name].get("vllm_ms") is not None
                                 for name in (*DECODE_LAYERS, "lm_head")):
                vllm_total = (layers * sum(by_layer[name]["vllm_ms"] for name in DECODE_LAYERS)
                              + by_layer["lm_head"]["vllm_ms"])
            per_step.append(StepSum(model, m, *totals, vllm_total))
    gates = doc.get("gates")
    return Bench(
        source, provenance(doc["provenance"]), doc["timing"], tuple(s["goal_ms"]),
        goal(doc, None), s["geomean_default_over_mm"], s["decode_geomean_default_over_mm"],
        s["decode_speedup_over_default"], SPEEDUP_GOAL,
        tuple(BenchRow(r["model"], r["layer"], r["n"], r["k"], r["m"], r["tuned_ms"] * 1000,
                       r["torch_mm_ms"] * 1000, r["default_ms"] * 1000, r["tuned_over_mm"],
                       r["default_over_mm"],
                       None if r.get("vllm_ms") is None else r["vllm_ms"] * 1000,
                       r.get("vllm_over_mm"), r.get("vllm_tuned")) for r in rows),
        tuple(per_model), tuple(per_step), _vllm_column(doc),
        *((None, None, ()) if gates is None else _invariance(gates, "tuned_invariance")),
        _roofline(doc), _host(doc), note)


# --- earlier runs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EarlierRun:
    folder: str
    what: str
    overall: float
    decode: float
    default_over_mm: float
    provenance: Provenance


@dataclass(frozen=True)
class History:
    runs: tuple[EarlierRun, ...]


def history(benches: list[tuple[str, str, dict[str, Any]]]) -> History | None:
    """(folder, what it was, its bench document) of each earlier run found; None when none."""
    runs = tuple(EarlierRun(folder, what, b["summary"]["geomean_tuned_over_mm"],
                            b["summary"]["decode_geomean_tuned_over_mm"],
                            b["summary"]["geomean_default_over_mm"], provenance(b["provenance"]))
                 for folder, what, b in benches)
    return History(runs) if runs else None
