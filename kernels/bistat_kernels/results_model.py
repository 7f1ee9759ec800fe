"""The numbers of ``kernels/RESULTS.md``, from the recorded JSON: one frozen model per section.

Every ratio, geometric mean, sum and pass count on the page is computed here; the template
(``templates/RESULTS.md.j2``) only words and formats these fields. Pure: the builders take the
loaded JSON documents (dicts) and return models; :mod:`bistat_kernels.make_results` loads the files
and renders. Needs only the standard library.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

# The earlier goals: the targets of bench files that carry no ``summary.goal_targets`` (recorded
# before bench files stated their targets); newer files state their own (bench.GOAL_OVERALL,
# bench.GOAL_DECODE).
GOAL_OVERALL = 1.15
GOAL_DECODE = 1.25
SPEEDUP_GOAL = 2.5  # tuned over vLLM's fixed default at decode sizes (geometric mean)
# Layers per model, for the per-decode-step sum (config.json num_hidden_layers).
LAYERS = {"qwen3-8b": 36, "qwen3-1.7b": 28, "smollm2-135m": 30}
DECODE_LAYERS = ("qkv", "o", "gate_up", "down")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


@dataclass(frozen=True)
class Provenance:
    """Where an artefact was measured; ``ident`` and ``rest`` hold only the fields it records."""

    gpu_name: str
    ident: tuple[str, ...]      # "UUID …", "serial …"
    rest: tuple[str, ...]       # "driver …", "torch …", "CUDA …", "triton …"
    date_utc: str
    command: str
    vllm: str | None = None
    vllm_commit: str | None = None


def provenance(prov: dict[str, Any]) -> Provenance:
    return Provenance(
        gpu_name=str(prov.get("gpu_name", "?")),
        ident=tuple(f"{label} {prov[key]}" for label, key in (("UUID", "gpu_uuid"),
                                                              ("serial", "gpu_serial"))
                    if key in prov),
        rest=tuple(f"{label} {prov[key]}" for label, key in (
            ("driver", "driver"), ("torch", "torch"), ("CUDA", "cuda"), ("triton", "triton"))
            if key in prov),
        date_utc=str(prov.get("date_utc", "?")), command=str(prov.get("command", "?")),
        vllm=prov.get("vllm"), vllm_commit=prov.get("vllm_commit"))


# --- status ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    overall: float
    overall_target: float
    overall_met: bool
    decode_max_m: int
    decode: float
    decode_target: float
    decode_met: bool
    gates_passed: bool
    host_diff_us: float | None = None    # mean tuned - torch.mm host cost per eager call
    host_target_us: float | None = None
    host_met: bool | None = None
    # every bench of this table on the bench's GPU, the main one first: (source, overall, decode)
    runs: tuple[tuple[str, float, float], ...] = ()


def goal(bench: dict[str, Any], probe: dict[str, Any] | None,
         repeats: tuple[tuple[str, dict[str, Any]], ...] = ()) -> Goal:
    """The goal status of ``bench``; with ``repeats`` ((source, bench document) of the same
    table benched again on the same GPU), a ratio goal is met only if every run meets it: a
    repeat that misses it shows the main run's margin to be within the bench's run-to-run
    noise."""
    s = bench["summary"]
    targets = s.get("goal_targets", {"overall": GOAL_OVERALL, "decode": GOAL_DECODE})
    host = (bench.get("host") or {}).get("summary")
    uuid = bench["provenance"].get("gpu_uuid")
    for source, doc in repeats:
        if doc["provenance"].get("gpu_uuid") != uuid:
            raise ValueError(f"{source}: a repeat of the main bench must run on its GPU ({uuid}), "
                             f"not {doc['provenance'].get('gpu_uuid')}")
    runs = tuple([("main", s["geomean_tuned_over_mm"], s["decode_geomean_tuned_over_mm"])]
                 + [(source, doc["summary"]["geomean_tuned_over_mm"],
                     doc["summary"]["decode_geomean_tuned_over_mm"]) for source, doc in repeats])
    return Goal(s["geomean_tuned_over_mm"], targets["overall"],
                all(o <= targets["overall"] for _, o, _ in runs),
                s["decode_max_m"], s["decode_geomean_tuned_over_mm"], targets["decode"],
                all(d <= targets["decode"] for _, _, d in runs),
                probe is not None and bool(probe["passed"]),
                None if host is None else host["max_tuned_minus_mm_us"],
                None if host is None else host["goal_us"],
                # "within 5 us of torch.mm's" holds for the operator only if it holds for every
                # shape: judged on the worst one, not the mean
                None if host is None else host["max_tuned_minus_mm_us"] <= host["goal_us"],
                runs if repeats else ())


@dataclass(frozen=True)
class ArtefactRow:
    what: str
    gpu_name: str
    gpu_uuid: str
    date_utc: str
    command: str


def artefact_row(what: str, prov: dict[str, Any]) -> ArtefactRow:
    return ArtefactRow(what, str(prov.get("gpu_name", "?")), str(prov.get("gpu_uuid", "?")),
                       str(prov.get("date_utc", "?")), str(prov.get("command", "?")))


@dataclass(frozen=True)
class OtherGpu:
    """A GPU the table was swept on that is not the bench's: what it shares with it."""

    uuid: str
    same: tuple[str, ...]
    differ: tuple[str, ...]


@dataclass(frozen=True)
class Status:
    goal: Goal | None
    rows: tuple[ArtefactRow, ...]
    compared: bool                   # a bench and a table to set side by side
    bench_uuid: str | None
    other_gpus: tuple[OtherGpu, ...]


def status(bench: dict[str, Any] | None, probe: dict[str, Any] | None,
           check: dict[str, Any] | None, table: dict[str, Any] | None,
           fused: dict[str, Any] | None, slug: str,
           extra_rows: tuple[tuple[str, dict[str, Any]], ...] = (),
           repeats: tuple[tuple[str, dict[str, Any]], ...] = (),
           source_provenance: dict[str, dict[str, Any]] | None = None) -> Status:
    """Goal status and each artefact's GPU and command. ``source_provenance`` maps a bucket's
    ``measured.source`` (the raw file that set it) to that file's provenance."""
    source_provenance = source_provenance or {}
    rows: list[ArtefactRow] = []
    if table is not None:
        sweeps: dict[tuple[str, str, str], list[str]] = {}
        for e in table["entries"]:
            p = e["provenance"]
            sweeps.setdefault((p.get("gpu_uuid", "?"), p.get("date_utc", "?"),
                               p.get("command", "?")), []).append(f"{e['n']}x{e['k']}")
        for (uuid, date, command), shapes in sorted(sweeps.items()):
            rows.append(artefact_row(
                f"`kernels/bistat_kernels/tables/{slug}.json`: sweep of {len(shapes)} entr"
                f"{'y' if len(shapes) == 1 else 'ies'}",
                {"gpu_name": table.get("device_name", "?"), "gpu_uuid": uuid, "date_utc": date,
                 "command": command}))
        # buckets set after the sweep, grouped by what set them: the fused split-K comparison,
        # or a re-tune (sweep.retune_buckets), whose buckets carry the GPU they were re-tuned on
        by_source: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for e in table["entries"]:
            for b in e["buckets"]:
                if "source" in b["measured"]:
                    by_source.setdefault(b["measured"]["source"], []).append((e, b))
        for source, sourced in by_source.items():
            where = ", ".join(f"{e['n']}x{e['k']} M<={b['m_max']}" for e, b in sourced)
            count = f"{len(sourced)} bucket{'s' if len(sourced) != 1 else ''}"
            if "fused_compare" in source:
                if fused is not None:
                    rows.append(artefact_row(
                        f"`kernels/bistat_kernels/tables/{slug}.json`: {count} set from the "
                        f"fused split-K comparison ({where})", fused["provenance"]))
                continue
            what = f"`kernels/bistat_kernels/tables/{slug}.json`: {count} set by {source}: {where}"
            if source in source_provenance:
                rows.append(artefact_row(what, source_provenance[source]))
                continue
            on = next((b["measured"]["retuned_on"] for _, b in sourced
                       if "retuned_on" in b["measured"]), {})
            rows.append(artefact_row(what, {**on, "command": f"(not recorded; see {source})"}))
    for doc, what in ((fused, f"`kernels/results/fused_compare_{slug}.json`"),
                      (probe, f"`kernels/results/probe_{slug}.json`"),
                      (bench, f"`kernels/results/bench_{slug}.json`"),
                      (check, "`kernels/results/check_gpu.json`")):
        if doc is not None:
            rows.append(artefact_row(what, doc["provenance"]))
    rows += [artefact_row(what, prov) for what, prov in extra_rows]
    bench_uuid, others = None, ()
    if bench is not None and table is not None:
        bench_prov = bench["provenance"]
        bench_uuid = bench_prov.get("gpu_uuid")
        keys = (("gpu_name", "model"), ("driver", "driver"), ("torch", "torch"),
                ("triton", "triton"))
        swept = {e["provenance"].get("gpu_uuid", "?"): e["provenance"]
                 for e in table["entries"] if e["provenance"].get("gpu_uuid") != bench_uuid}
        others = tuple(OtherGpu(uuid, tuple(w for k, w in keys if p.get(k) == bench_prov.get(k)),
                                tuple(w for k, w in keys if p.get(k) != bench_prov.get(k)))
                       for uuid, p in sorted(swept.items()))
    return Status(goal(bench, probe, repeats) if bench is not None else None, tuple(rows),
                  bench is not None and table is not None, bench_uuid, others)


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


# --- gates -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeRow:
    n: int
    k: int
    rows_equal: int
    rows_checked: int
    ours: float          # max relative error over the accuracy checks
    torch_mm: float
    tolerance: float
    passed: bool
    dtype: str = "bfloat16"
    case: str = "table"   # or k_pow2 / fp32_ieee (probe --edge-cases)


@dataclass(frozen=True)
class Probe:
    source: str
    provenance: Provenance
    rows: tuple[ProbeRow, ...]
    passed: bool
    with_cases: bool = False  # some row is an edge case: the table shows dtype and case


def probe(doc: dict[str, Any], source: str) -> Probe:
    rows = tuple(
        ProbeRow(s["n"], s["k"], s["invariance"]["rows_equal"], s["invariance"]["rows_checked"],
                 max(a["max_rel_err"] for a in s["accuracy"]),
                 max(a["torch_mm_max_rel_err"] for a in s["accuracy"]),
                 s["accuracy"][0]["tolerance"], bool(s["passed"]), s.get("dtype", "bfloat16"),
                 s.get("case", "table")) for s in doc["shapes"])
    return Probe(source, provenance(doc["provenance"]), rows, bool(doc["passed"]),
                 any(r.case != "table" for r in rows))


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


# --- kernel checks ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckConfigs:
    """The distinct launch configurations the gates ran, and their split-K values."""

    count: int
    parallel: tuple[int, ...]
    fused: tuple[int, ...]


def check_configs(gates: list[dict[str, Any]]) -> CheckConfigs:
    configs = {json.dumps(g["config"], sort_keys=True): g["config"] for g in gates}
    return CheckConfigs(
        len(configs),
        tuple(sorted({c["split_k"] for c in configs.values()
                      if c["split_k"] > 1 and not c.get("fuse_splits", False)})),
        tuple(sorted({c["split_k"] for c in configs.values()
                      if c["split_k"] > 1 and c.get("fuse_splits", False)})))


@dataclass(frozen=True)
class CompiledCheck:
    compile_equal_eager: Any
    compile_row_invariant: Any
    cuda_graph_replay_equal: Any
    parallel_max_m: Any = "?"


@dataclass(frozen=True)
class Check:
    source: str
    provenance: Provenance
    configs: CheckConfigs
    gates: int
    gates_passed: int
    fused_equal: int | None        # fused == parallel comparisons that held (None: not run)
    fused_compared: int
    compiled: CompiledCheck
    op_calls: tuple[tuple[str, Any], ...]
    fused_table: CompiledCheck | None


def _compiled(d: dict[str, Any]) -> CompiledCheck:
    return CompiledCheck(d.get("compile_equal_eager"), d.get("compile_row_invariant"),
                         d.get("cuda_graph_replay_equal"), d.get("parallel_max_m", "?"))


def check(doc: dict[str, Any], source: str) -> Check:
    gates, comp = doc["gates"], doc["compiled"]
    fep = doc.get("fused_equals_parallel")
    return Check(source, provenance(doc["provenance"]), check_configs(gates), len(gates),
                 sum(g["passed"] for g in gates), None if fep is None else sum(fep),
                 0 if fep is None else len(fep), _compiled(comp),
                 tuple(sorted(comp.get("op_calls", {}).items())),
                 None if comp.get("fused_table") is None else _compiled(comp["fused_table"]))


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


# --- decode profile in compiled vLLM ---------------------------------------------------------

# vLLM 0.25.0's CompilationMode values (vllm/config/compilation.py), as the engine logs them.
VLLM_COMPILATION_MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE",
                          "3": "VLLM_COMPILE"}
PROFILE_CATEGORIES = (("persistent_gemm", "persistent GEMM"), ("cublas_gemm", "cuBLAS GEMM"),
                      ("attention", "attention"), ("other", "other"))
KERNEL_NAME_WIDTH = 56


def model_layers(model_path: str) -> tuple[str, int] | None:
    """(known model, its layers) for a model folder named after one of ``LAYERS``."""
    base = PurePath(model_path).name
    known = [name for name in LAYERS if base.startswith(name)]
    return (max(known, key=len), LAYERS[max(known, key=len)]) if known else None


def largest_capture_size(doc: dict[str, Any]) -> int | None:
    """The largest CUDA-graph capture size of any arm (None when no arm records one)."""
    sizes = [int(size) for arm in doc["arms"].values()
             for size in arm.get("graphs", {}).get("cudagraph_capture_sizes", [])]
    return max(sizes) if sizes else None


def beyond_graphs(doc: dict[str, Any]) -> bool:
    """Whether the batch exceeds every CUDA-graph capture size, so the decode steps ran eagerly."""
    largest = largest_capture_size(doc)
    return largest is not None and int(doc["settings"]["batch"]) > largest


@dataclass(frozen=True)
class ProfileArm:
    name: str
    batch_invariant: Any          # the arm's VLLM_BATCH_INVARIANT ("?" when unset)
    tuned_gemm: Any               # its BISTAT_TUNED_GEMM
    median_call_s: float
    device_ms_per_step: float
    category_ms_per_step: tuple[float, ...]   # in PROFILE_CATEGORIES order
    gemm_share_pct: float
    graph_launches: Any
    kernel_launches: Any
    host_ms_per_step: float       # median call ms / output tokens per request
    host_minus_device_ms: float   # host time per step not hidden behind the GPU
    call_s: tuple[float, ...]


@dataclass(frozen=True)
class ProfileComparison:
    """The three arms default, batch-invariant and bi-tuned-gemm set against each other."""

    bi_persistent: float
    tuned_persistent: float
    default_cublas: float
    bi_over_tuned_persistent: float
    tuned_over_cublas: float
    tuned_over_default_call: float
    bi_over_default_call: float
    tuned_over_default_device: float
    bi_over_default_device: float
    extra_device: float
    extra_gemm: float
    extra_gemm_pct: float
    recovered_pct: float
    tuned_over_bi_call: float
    tuned_over_bi_device: float
    tuned_over_bi_persistent: float


@dataclass(frozen=True)
class GraphRow:
    name: str
    mode: str
    mode_name: str
    cudagraph_mode: Any
    capture_sizes: tuple[Any, ...]
    captured: tuple[str, ...]
    graph_launches: Any
    kernel_launches: Any
    compile_s: float | None
    jit_during_inference: int


@dataclass(frozen=True)
class PluginRow:
    name: str
    requested: Any
    registered_by: Any
    installed: Any
    ours: Any
    log_lines: Any


@dataclass(frozen=True)
class OpLaunch:
    n: int
    k: int
    layer: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    calls: int


@dataclass(frozen=True)
class OpLaunches:
    arm: str
    shapes: int
    splits: tuple[tuple[int, str], ...]     # (SPLIT_K, layer) of the split-K launches
    launches: tuple[OpLaunch, ...]


@dataclass(frozen=True)
class TopKernel:
    arm: str
    name: str             # cut at its argument list and to KERNEL_NAME_WIDTH characters
    cut: bool             # whether the width cut it
    category: str
    share_pct: float
    ms_per_step: float


@dataclass(frozen=True)
class Profile:
    title: str
    source: str
    logs: str
    provenance: Provenance
    model: str
    model_layers: tuple[str, int] | None
    load_format: Any
    batch: Any
    prompt_tokens: Any
    max_tokens: Any
    warmups: Any
    timed_calls: Any
    eager: bool
    largest_capture: int | None
    category_labels: tuple[str, ...]
    arms: tuple[ProfileArm, ...]
    comparison: ProfileComparison | None
    graphs: tuple[GraphRow, ...]
    graphs_used: tuple[str, ...]
    graphs_captured: tuple[str, ...]
    plugin: tuple[PluginRow, ...]
    op_launches: tuple[OpLaunches, ...]
    top_kernels: tuple[TopKernel, ...]


def layer_names() -> dict[tuple[int, int], str]:
    """(N, K) -> 'model/layer' for every tuned shape (from ``shapes.py``, which is pure)."""
    from bistat_kernels.shapes import MODEL_SHAPES
    names: dict[tuple[int, int], list[str]] = {}
    for model_shapes in MODEL_SHAPES.values():
        for shape in model_shapes:
            names.setdefault((shape.n, shape.k), []).append(f"{shape.model}/{shape.layer}")
    return {key: ", ".join(value) for key, value in names.items()}


def _comparison(arms: dict[str, Any]) -> ProfileComparison | None:
    default, bi, tuned = (arms.get(k) for k in ("default", "batch-invariant", "bi-tuned-gemm"))
    if default is None or bi is None or tuned is None:
        return None

    def per_step(arm: dict[str, Any], key: str) -> float:
        return float(arm["profile"]["categories"][key]["ms_per_step"])

    def gemm(arm: dict[str, Any]) -> float:
        return per_step(arm, "persistent_gemm") + per_step(arm, "cublas_gemm")

    def dev(arm: dict[str, Any]) -> float:
        return float(arm["profile"]["total_device_ms_per_step"])

    bi_p, t_p = per_step(bi, "persistent_gemm"), per_step(tuned, "persistent_gemm")
    d_c = per_step(default, "cublas_gemm")
    d_s, b_s, t_s = (a["median_call_s"] for a in (default, bi, tuned))
    extra_dev, extra_gemm = dev(bi) - dev(default), gemm(bi) - gemm(default)
    return ProfileComparison(
        bi_p, t_p, d_c, bi_p / t_p, t_p / d_c, t_s / d_s, b_s / d_s, dev(tuned) / dev(default),
        dev(bi) / dev(default), extra_dev, extra_gemm, 100 * extra_gemm / extra_dev,
        100 * (b_s - t_s) / (b_s - d_s), t_s / b_s, dev(tuned) / dev(bi), t_p / bi_p)


def profile(doc: dict[str, Any], source: str, logs: str, title: str) -> Profile:
    st, arms = doc["settings"], doc["arms"]
    names = layer_names()
    rows, graphs, plugin, launches, top = [], [], [], [], []
    for name, arm in arms.items():
        prof, g, log = arm["profile"], arm["graphs"], arm.get("log", {})
        rows.append(ProfileArm(
            name, arm["env"].get("VLLM_BATCH_INVARIANT", "?"),
            arm["env"].get("BISTAT_TUNED_GEMM", "?"), arm["median_call_s"],
            prof["total_device_ms_per_step"],
            tuple(prof["categories"][key]["ms_per_step"] for key, _ in PROFILE_CATEGORIES),
            100 * prof["gemm_share"], g.get("cuda_graph_launches_in_profile", "?"),
            g.get("kernel_launch_calls_in_profile", "?"),
            1000 * arm["median_call_s"] / st["max_tokens"],
            1000 * arm["median_call_s"] / st["max_tokens"] - prof["total_device_ms_per_step"],
            tuple(arm.get("call_s", []))))
        mode = str(g.get("compilation_mode", "?"))
        graphs.append(GraphRow(
            name, mode, VLLM_COMPILATION_MODES.get(mode, "unknown"), g.get("cudagraph_mode", "?"),
            tuple(g.get("cudagraph_capture_sizes", [])), tuple(g.get("capture_modes_in_log", [])),
            g.get("cuda_graph_launches_in_profile", "?"),
            g.get("kernel_launch_calls_in_profile", "?"), log.get("compile_s"),
            len(log.get("jit_during_inference", []))))
        pl = arm["plugin"]
        plugin.append(PluginRow(name, pl["requested"], pl["registered_by"] or "nothing",
                                pl["installed"], pl["matmul_persistent_is_ours"],
                                log.get("tuned_gemm_installed_lines", "?")))
        if pl["calls"]:
            calls = pl["calls"]
            launches.append(OpLaunches(
                name, len({(c["n"], c["k"]) for c in calls}),
                tuple(sorted({(c["split_k"], names.get((c["n"], c["k"]), f"{c['n']}x{c['k']}"))
                              for c in calls if c.get("split_k", 1) > 1})),
                tuple(OpLaunch(c["n"], c["k"], names.get((c["n"], c["k"]), "?"), c["block_m"],
                               c["block_n"], c["block_k"], c["split_k"], c["calls"])
                      for c in calls)))
        for k in prof["top_kernels"][:3]:
            short = k["name"].split("(")[0]
            top.append(TopKernel(name, short[:KERNEL_NAME_WIDTH], len(short) > KERNEL_NAME_WIDTH,
                                 k["category"], 100 * k["share"], k["ms_per_step"]))
    return Profile(
        title, source, logs, provenance(doc["provenance"]), st["model"],
        model_layers(st["model"]), st["load_format"], st["batch"], st["prompt_tokens"],
        st["max_tokens"], st["warmups"], st["timed_calls"], beyond_graphs(doc),
        largest_capture_size(doc), tuple(label for _, label in PROFILE_CATEGORIES), tuple(rows),
        _comparison(arms), tuple(graphs),
        tuple(name for name, arm in arms.items() if arm["graphs"].get("used")),
        tuple(name for name, arm in arms.items() if arm["graphs"].get("capture_modes_in_log")),
        tuple(plugin), tuple(launches), tuple(top))


# --- the bistat probe of the plugin in compiled vLLM -----------------------------------------

@dataclass(frozen=True)
class ProbeModel:
    """The synthetic model a probe ran on (its sidecar file)."""

    layers: Any
    arch: Any
    init: Any
    std: Any
    seed: Any
    n_parameters: int
    weights_sha256: str
    path: str


@dataclass(frozen=True)
class Sidecar:
    """The probe's provenance, recorded beside it (the probe's output records no GPU)."""

    source: str
    provenance: Provenance
    date_note: str
    declaration: str
    registered_utc: str
    registration: str
    registration_sha256: str
    engine_kind: str
    engine_model: str
    model: ProbeModel | None
    note: str | None


@dataclass(frozen=True)
class ProbeTrial:
    trial: Any
    fillers: Any
    evidence: str
    shared_step: bool


@dataclass(frozen=True)
class ProbeArm:
    name: str
    role: str
    gemm: str | None                # "tuned" | "batch-invariant" | "default"; None: not declared
    attention: str | None
    alone_repeat_identical: bool
    equal: int                      # trials whose tokens and logprobs equal the needle alone
    divergences: tuple[int, ...]    # distinct first-divergence tokens
    diverged: int                   # trials with a first divergence
    shared: int                     # trials with shared-step evidence
    trials: tuple[ProbeTrial, ...]


@dataclass(frozen=True)
class PluginProbe:
    source: str
    sidecar: Sidecar | None
    needle: str
    max_tokens: Any
    min_fillers: Any
    max_fillers: Any
    trials: Any
    mode: Any
    seed: Any
    outcome: str
    reason: str
    arms: tuple[ProbeArm, ...]
    probed_shared: tuple[int, ...]  # distinct shared-step trial counts of the probed arms
    probed_trials: int | None       # trials per probed arm (None: no arm probed)


def gemm_kind(env: dict[str, str]) -> str:
    if env.get("VLLM_BATCH_INVARIANT") == "1":
        return "tuned" if env.get("BISTAT_TUNED_GEMM") == "1" else "batch-invariant"
    return "default"


def plugin_probe(doc: dict[str, Any], sidecar: dict[str, Any] | None,
                 model_doc: dict[str, Any] | None, source: str,
                 sidecar_source: str) -> PluginProbe:
    side = None
    if sidecar is not None:
        pm = None if model_doc is None else ProbeModel(
            model_doc["layers"], model_doc["arch"], model_doc["init"], model_doc["std"],
            model_doc["seed"], model_doc["n_parameters"], model_doc["weights"]["sha256"],
            sidecar["model"])
        side = Sidecar(sidecar_source, provenance(sidecar["provenance"]), sidecar["date_note"],
                       sidecar["declaration"], sidecar["registered_utc"],
                       sidecar["registration"], sidecar["registration_sha256"],
                       sidecar["engine"]["kind"], sidecar["engine"]["model"], pm,
                       sidecar.get("note"))
    declared = {a["name"]: a for a in (sidecar or {}).get("arms", [])}
    arms = []
    for arm in doc["arms"]:
        trials = arm["trials"]
        diverge = [t["first_divergence"] for t in trials if t["first_divergence"] is not None]
        decl = declared.get(arm["arm"])
        arms.append(ProbeArm(
            arm["arm"], arm["role"], gemm_kind(decl["env"]) if decl else None,
            decl.get("args", {}).get("attention_backend", "engine default") if decl else None,
            bool(arm["alone_repeat_identical"]),
            sum(t["tokens_equal"] and t["logprobs_equal"] for t in trials),
            tuple(sorted(set(diverge))), len(diverge), sum(t["shared_step"] for t in trials),
            tuple(ProbeTrial(t["trial"], t["n_fillers"], t["evidence"], bool(t["shared_step"]))
                  for t in trials)))
    probed = [a for a in arms if a.role == "probed"]
    st = doc["settings"]
    return PluginProbe(
        source, side, doc["needle_prompt_id"], st["max_tokens"], st["min_fillers"],
        st["max_fillers"], st["trials"], st["mode"], st["seed"], doc["outcome"], doc["reason"],
        tuple(arms), tuple(sorted({a.shared for a in probed})),
        len(probed[0].trials) if probed else None)


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
