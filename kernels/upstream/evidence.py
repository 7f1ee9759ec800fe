"""The measured evidence the package states, read from the raw files ``sources.toml`` lists: the
runs that measured each bucket of the table (every bucket names one, with full provenance), the
benches against ``torch.mm``, the probe, vLLM's own table, and the device folders of
``scripts/device/upstream_bench.py`` (refused when listed but missing, incomplete, from two GPUs
or contradicted by their own logs).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from bistat_kernels import export_vllm, tables
from upstream.sources import (DEVICE_SCHEMA, DEVICE_SCRIPT, INSTALLED, KERNEL_AB_SCHEMA,
                              PROVENANCE_KEYS, SOURCES, NamedRaw, PackageError, Sources, TableBench,
                              _read_json, _sha256)


@dataclass(frozen=True)
class Run:
    tag: str
    raw: str
    what: str
    provenance: dict[str, Any]
    sha256: str

    def line(self) -> str:
        p = self.provenance
        return (f"{p.get('gpu_name', '?')} {p.get('gpu_uuid', '?')} (serial "
                f"{p.get('gpu_serial', '?')}), driver {p.get('driver', '?')}, compute capability "
                f"{p.get('compute_capability', '?')}, torch {p.get('torch', '?')} (CUDA "
                f"{p.get('cuda', '?')}), triton {p.get('triton', '?')}, python "
                f"{p.get('python', '?')}, {p.get('date_utc', '?')}")


def load_runs(root: Path, sources: Sources) -> dict[str, Run]:
    runs = {}
    for tag, src in sources.runs.items():
        data = _read_json(root, src.raw, f"[runs.{tag}] raw")
        prov = data.get("provenance") if isinstance(data, dict) else None
        if not isinstance(prov, dict) or not prov.get("gpu_uuid"):
            raise PackageError(f"{src.raw}: no provenance with a gpu_uuid; [runs.{tag}] must name "
                               f"a raw file written by a bistat device run")
        runs[tag] = Run(tag, src.raw, src.what, {k: prov.get(k) for k in PROVENANCE_KEYS},
                        _sha256(root / src.raw))
    return runs


def _same_run(a: dict[str, Any], b: dict[str, Any], keys: Sequence[str]) -> bool:
    return all(a.get(k) == b.get(k) for k in keys)


def bucket_runs(table: tables.GemmTable, export: export_vllm.VllmExport,
                runs: dict[str, Run]) -> dict[tuple[int, int], list[str]]:
    """The run tag of every exported bucket: its ``measured.source`` file's run, or, for a bucket
    the sweep set, the run whose provenance is the entry's."""
    by_path = {run.raw: run.tag for run in runs.values()}
    out: dict[tuple[int, int], list[str]] = {}
    for shape in export.shapes:
        entry = table.lookup("bfloat16", shape.n, shape.k)
        where = f"{table.source} entry ({shape.n}, {shape.k})"
        sweep = next((r.tag for r in runs.values() if _same_run(
            r.provenance, entry.provenance, ("gpu_uuid", "date_utc", "command"))), None)
        tags = []
        for bucket in entry.buckets:
            source = bucket.measured.get("source")
            if source:
                path = str(source).split()[0]
                tag = by_path.get(path)
                if tag is None:
                    raise PackageError(f"{where} bucket m_max {bucket.m_max}: measured.source "
                                       f"names {path}, which no [runs.*] raw in {SOURCES} is; add "
                                       f"that run")
                retuned = bucket.measured.get("retuned_on")
                if isinstance(retuned, dict) and not _same_run(retuned, runs[tag].provenance,
                                                               ("gpu_uuid", "date_utc")):
                    raise PackageError(f"{where} bucket m_max {bucket.m_max}: retuned_on "
                                       f"{retuned.get('gpu_uuid')} {retuned.get('date_utc')} is "
                                       f"not {path}'s provenance; the table and the raw file "
                                       f"disagree")
            elif sweep is None:
                raise PackageError(f"{where}: its provenance ({entry.provenance.get('gpu_uuid')}, "
                                   f"{entry.provenance.get('date_utc')}) is no [runs.*] raw's in "
                                   f"{SOURCES}; add the sweep's raw file")
            else:
                tag = sweep
            tags.append(tag)
        out[(shape.n, shape.k)] = tags
    return out


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


@dataclass(frozen=True)
class Bench:
    name: str
    raw: str
    provenance: dict[str, Any]
    summary: dict[str, Any]
    ratio: dict[tuple[int, int, int], float]       # (n, k, m) -> the kernel's time / torch.mm
    layers: dict[tuple[int, int], str]


def load_bench(root: Path, src: NamedRaw, field_name: str, column: str) -> Bench:
    data = _read_json(root, src.raw, field_name)
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows or not isinstance(data.get("provenance"), dict):
        raise PackageError(f"{src.raw}: no rows or no provenance; {field_name} must name a "
                           f"`bistat kernels bench` output")
    ratio, layers = {}, {}
    for row in rows:
        if row.get(column) is not None:
            ratio[(row["n"], row["k"], row["m"])] = row[column]
            layers[(row["n"], row["k"])] = f"{row['model']}/{row['layer']}"
    if not ratio:
        raise PackageError(f"{src.raw}: no row has {column}; {field_name} must be a bench "
                           f"{'run with --vllm-kernel' if column.startswith('vllm') else ''}")
    return Bench(src.name, src.raw, {k: data["provenance"].get(k) for k in PROVENANCE_KEYS},
                 data.get("summary", {}), ratio, layers)


def load_probe(root: Path, src: TableBench) -> dict[str, Any]:
    """The probe's verdict on the shipped table: rows compared bitwise, accuracy cases, worst
    bfloat16 relative error; per case kind."""
    data = _read_json(root, src.raw, "[probe] raw")
    shapes = data.get("shapes") if isinstance(data, dict) else None
    if not shapes or not isinstance(data.get("provenance"), dict):
        raise PackageError(f"{src.raw}: no shapes or no provenance; [probe] raw must name a "
                           f"`bistat kernels probe` output")
    cases: dict[str, dict[str, Any]] = {}
    for s in shapes:
        c = cases.setdefault(f"{s['case']} {s['dtype']}", {"shapes": 0, "rows_checked": 0,
                                                           "rows_equal": 0, "accuracy": 0,
                                                           "accuracy_passed": 0, "m": set()})
        c["shapes"] += 1
        c["rows_checked"] += s["invariance"]["rows_checked"]
        c["rows_equal"] += s["invariance"]["rows_equal"]
        c["m"] |= set(s["invariance"]["m_values"])
        c["accuracy"] += len(s["accuracy"])
        c["accuracy_passed"] += sum(a["passed"] for a in s["accuracy"])
    bf16 = [a["max_rel_err"] for s in shapes if s["dtype"] == "bfloat16" for a in s["accuracy"]]
    return {"name": src.name, "raw": src.raw, "passed": data.get("passed"),
            "provenance": {k: data["provenance"].get(k) for k in PROVENANCE_KEYS},
            "cases": cases, "max_bf16_rel_err": max(bf16) if bf16 else None}


def vllm_table_facts(root: Path, sources: Sources) -> dict[str, Any]:
    """vLLM's own Hopper table as the vLLM-kernel bench recorded it, checked to be the release's."""
    src = sources.vllm_kernel_bench
    data = _read_json(root, src.raw, "[vllm_kernel_bench] raw")
    info = data.get("vllm") or {}
    got = (info.get("sha256") or {}).get("batch_invariant_configs.py")
    if got != sources.vllm.configs_sha256:
        raise PackageError(f"{src.raw}: vLLM's batch_invariant_configs.py had sha256 {got}, not "
                           f"[vllm] configs_sha256 {sources.vllm.configs_sha256} "
                           f"(vLLM {sources.vllm.version}); name a bench of that release")
    return {"version": info.get("vllm"), "commit": info.get("vllm_commit"),
            "tuned_shapes": sorted(tuple(s) for s in info.get("tuned_shapes", [])),
            "sha256": info.get("sha256")}


@dataclass
class Device:
    folders: list[str]
    node: tuple[str, str] | None = None           # (uuid, serial)
    gpu: dict[str, str] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)   # ok runs, with "folder"
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    kernel_ab: dict[str, Any] | None = None


def _load_device_script(root: Path) -> Any:
    spec = importlib.util.spec_from_file_location("upstream_bench", root / DEVICE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("upstream_bench", module)
    spec.loader.exec_module(module)
    return module


def load_device(root: Path, folders: Sequence[str], field_name: str) -> Device:
    dev = Device(list(folders))
    nodes: set[tuple[str, str]] = set()
    for rel in folders:
        folder = root / rel
        manifest_path = folder / "manifest.json"
        if not manifest_path.is_file():
            raise PackageError(f"{field_name}: {rel!r} has no manifest.json (the folder is "
                               f"missing or not a `{DEVICE_SCRIPT} run --out` folder): copy that "
                               f"call's $OUT there, or remove the entry")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("schema") != DEVICE_SCHEMA:
            raise PackageError(f"{rel}/manifest.json: schema {manifest.get('schema')!r}, not "
                               f"{DEVICE_SCHEMA!r}")
        for gpu in manifest.get("gpu", []):
            nodes.add((gpu["uuid"], gpu["serial"]))
            dev.gpu = gpu
        dev.versions = manifest.get("versions") or dev.versions
        for run in manifest.get("runs", []):
            run = dict(run, folder=rel)
            if run["status"] == "skipped":
                dev.skipped.append(run)
                continue
            for gpu in run.get("gpu_before", []) + run.get("gpu_after", []):
                nodes.add((gpu["uuid"], gpu["serial"]))
            if run["status"] != "ok":
                dev.failed.append(run)
                continue
            for name in [run["log"], *run.get("files", [])]:
                if not (folder / name).is_file():
                    raise PackageError(f"{field_name}: {rel}/manifest.json names {name}, which "
                                       f"is not in {rel}: copy the call's whole $OUT folder")
            installed = any(INSTALLED in line for line in run.get("plugin_lines", []))
            if run.get("arm") == "bistat-table" and run["step"] != "determinism" and not installed:
                raise PackageError(f"{rel}/{run['log']}: the bistat-table arm's log has no "
                                   f"'{INSTALLED}' line: that run used vLLM's own GEMM")
            if run.get("arm") == "vllm-table" and installed:
                raise PackageError(f"{rel}/{run['log']}: the vllm-table arm's log shows bistat's "
                                   f"plugin installed: that run was not vLLM's table")
            if run["step"] == "kernel-ab":
                ab = json.loads((folder / "kernel_ab.json").read_text(encoding="utf-8"))
                if ab.get("schema") != KERNEL_AB_SCHEMA or "summary" not in ab:
                    raise PackageError(f"{rel}/kernel_ab.json: no summary (schema "
                                       f"{KERNEL_AB_SCHEMA}): the run did not finish")
                dev.kernel_ab = dict(ab, folder=rel)
            dev.runs.append(run)
    if len(nodes) > 1:
        raise PackageError(f"{field_name}: the folders ran on {len(nodes)} GPUs "
                           f"({', '.join(u for u, _ in sorted(nodes))}); a before/after "
                           f"comparison needs one node: list one session's folders")
    dev.node = next(iter(nodes), None)
    for bench in ("latency", "throughput"):
        arms = {r["arm"] for r in dev.runs if r["step"] == bench}
        if arms and arms != {"vllm-table", "bistat-table"}:
            raise PackageError(f"{field_name}: {bench} has only the {', '.join(sorted(arms))} "
                               f"arm; the comparison needs vllm-table and bistat-table runs")
    return dev


def bench_result(root: Path, run: dict[str, Any]) -> dict[str, float]:
    """The numbers of one ``vllm bench`` run: its --output-json, and the throughput line of its
    log (output tokens/s is printed, not written)."""
    folder = root / run["folder"]
    data = json.loads((folder / run["files"][0]).read_text(encoding="utf-8"))
    if run["step"] == "latency":
        pct = data.get("percentiles", {})
        return {"avg_s": data["avg_latency"], "p50_s": pct.get("50"), "p90_s": pct.get("90"),
                "iters": len(data.get("latencies", []))}
    out = {"requests_per_s": data["requests_per_second"], "tokens_per_s": data["tokens_per_second"],
           "elapsed_s": data["elapsed_time"], "requests": data["num_requests"]}
    log = (folder / run["log"]).read_text(errors="replace")
    match = re.search(r"([\d.]+) output tokens/s", log)
    out["output_tokens_per_s"] = float(match.group(1)) if match else None
    return out


def junit_counts(path: Path) -> dict[str, int]:
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
        elif "error" in kinds:
            counts["errors"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts
