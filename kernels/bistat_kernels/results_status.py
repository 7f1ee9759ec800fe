"""The status section of ``kernels/RESULTS.md``: the goal (the bench's ratios to torch.mm
against their targets, the gates, the host cost) and each artefact's GPU and command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bistat_kernels.results_common import GOAL_DECODE, GOAL_OVERALL


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
