#!/usr/bin/env python3
"""Build ``kernels/upstream/``, the evidence package for proposing bistat's H200 GEMM table to
vLLM, from the committed raw files ``kernels/upstream/sources.toml`` lists.

Writes three files, each a pure function of those raw files (no date, no machine state), so the
committed package regenerates byte for byte:

``batch_invariant_configs_nvidia_h200.py``
    the table in the form of vLLM's ``batch_invariant_configs.py`` (``bistat_kernels.export_vllm``
    decides what vLLM's kernel can express); every entry and every bucket names the run that
    measured it, and a legend at the top gives each run's GPU, UUID, serial, driver, versions,
    date, command and raw file;
``provenance.json``
    the same, machine-readable;
``README.md``
    the reviewer-facing summary: what the table is, how it was measured, its ratios to torch.mm
    from the committed benches, vLLM's own table from the last bench that ran it, vLLM's
    ``tests/v1/determinism`` test by test, what the device runs (``scripts/device/
    upstream_bench.py``) measured, or that they are pending, and how to reproduce all of it.

Usage (repository root)::

    python kernels/upstream/build.py            # write the package
    python kernels/upstream/build.py --check    # compare instead; exit 1 naming what differs

``--device DIR`` (repeatable) ingests device folders in place of ``[device] folders`` in
sources.toml, to look at a session's outputs before committing them. A folder that is listed but
missing, or that lacks a file its manifest names, stops the build with an error naming the field
and the path; so do device folders from more than one GPU, and an arm whose log contradicts it
(the plugin installed in the ``vllm-table`` arm, or not in the ``bistat-table`` arm).
"""

from __future__ import annotations

import argparse
import hashlib
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

from pydantic import BaseModel, ConfigDict, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))

from bistat_kernels import export_vllm, tables  # noqa: E402  (a script: kernels/ onto the path)

SOURCES = "kernels/upstream/sources.toml"
TABLE_OUT = "kernels/upstream/batch_invariant_configs_nvidia_h200.py"
PROVENANCE_OUT = "kernels/upstream/provenance.json"
README_OUT = "kernels/upstream/README.md"
SCHEMA = "bistat_kernels.upstream_package/1"
DEVICE_SCHEMA = "bistat_kernels.upstream_device/1"
DEVICE_SCRIPT = "scripts/device/upstream_bench.py"
KERNEL_AB_SCHEMA = "bistat_kernels.upstream_kernel_ab/1"
DETERMINISM_SCHEMA = "bistat_kernels.upstream_determinism/1"
PROVENANCE_KEYS = ("gpu_name", "gpu_uuid", "gpu_serial", "driver", "compute_capability", "torch",
                   "cuda", "triton", "python", "date_utc", "command")
INSTALLED = "tuned GEMM installed"   # the plugin's log line (bistat_kernels.vllm_plugin.install)
STATUSES = ("runs", "runs-local-model", "skips", "cannot")


class PackageError(ValueError):
    """A raw file is missing or says something the package cannot stand on; the message names the
    file, the field and the fix."""


# ---- sources.toml ------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VllmRelease(_Strict):
    version: str
    commit: str
    configs_sha256: str
    kernel_sha256: str


class RunSource(_Strict):
    raw: str
    what: str


class NamedRaw(_Strict):
    name: str
    raw: str


class TableBench(NamedRaw):
    table_sha256: str


class RawFile(_Strict):
    raw: str


class DeviceFolders(_Strict):
    folders: list[str] = []


class Sources(_Strict):
    table: str
    vllm: VllmRelease
    runs: dict[str, RunSource]
    benches: list[TableBench]
    probe: TableBench
    vllm_kernel_bench: NamedRaw
    determinism: RawFile
    device: DeviceFolders = DeviceFolders()


def load_sources(path: Path) -> Sources:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PackageError(f"{path}: not found (the package's list of raw files)") from None
    except tomllib.TOMLDecodeError as exc:
        raise PackageError(f"{path}: not valid TOML ({exc}); fix the syntax") from None
    try:
        return Sources.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise PackageError(f"{path}: field {where}: {err['msg']}; see the comments in the file "
                           f"for what it takes") from None


def _read_json(root: Path, rel: str, field_name: str) -> Any:
    path = root / rel
    if not path.is_file():
        raise PackageError(f"{SOURCES}: {field_name} = {rel!r}: no such file; fix the path or "
                           f"remove the entry")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PackageError(f"{rel}: not valid JSON ({exc}); restore it from git") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the table and its runs --------------------------------------------------------------------

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


# ---- benches -----------------------------------------------------------------------------------

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


# ---- device folders ----------------------------------------------------------------------------

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


# ---- rendering: the table ----------------------------------------------------------------------

def _bucket_comment(b: export_vllm.ExportedBucket, tag: str) -> str:
    r = b.ratio_to_torch_mm
    text = (f"[{tag}] {b.measured['time_ms']:.5g} ms = {r:.3f}x torch.mm at M={b.measured.get('m')}"
            if r is not None else f"[{tag}] not measured")
    if b.dropped:
        text += "; dropped " + ", ".join(f"{k}={v}" for k, v in b.dropped.items())
    if b.exported_from:
        timed = (f", {b.exported_from['time_ms']:.5g} ms at M={b.exported_from['m']}"
                 if "time_ms" in b.exported_from else "")
        text += f"; exported: {b.exported_from['launch']}{timed}"
    return text


def render_table(sources: Sources, export: export_vllm.VllmExport, runs: dict[str, Run],
                 tags: dict[tuple[int, int], list[str]], vllm_shapes: set[tuple[int, int]]) -> str:
    v = sources.vllm
    lines = [
        f"# bistat's tuned batch-invariant GEMM entries for vLLM's {export.arch_family!r} table "
        "(H200),",
        "# in the form of vllm/model_executor/determinism/batch_invariant_configs.py "
        f"(vLLM {v.version},",
        f"# whose file, sha256 {v.configs_sha256[:16]}..., is byte-identical to 0.33.0's).",
        f"# Generated by kernels/upstream/build.py from {sources.table}, the table the bistat",
        "# plugin ships; do not edit by hand. To propose it: merge the entries of",
        f"# {export_vllm.EXPORT_VARIABLE}[{export.arch_family!r}] into "
        "_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS[" + repr(export.arch_family) + "].",
        "#",
        "# Each bucket's comment: [run] that measured it, bistat's time there and its ratio to",
        "# torch.mm in the same run (bistat's launch: the fields vLLM's kernel cannot express are",
        "# listed as dropped; vLLM's kernel running the exported launch was not timed by these "
        "runs).",
        "# Runs:",
    ]
    used = {tag for shape_tags in tags.values() for tag in shape_tags}
    for run in runs.values():
        unused = "" if run.tag in used else " (only shapes not exported here)"
        lines += [f"#   [{run.tag}] {run.what}{unused}", f"#       {run.line()}",
                  f"#       command: {run.provenance.get('command')}", f"#       raw: {run.raw}"]
    if export.omitted:
        lines.append("# Not exported (vLLM keeps its own entry, or its default, for these shapes):")
        for o in export.omitted:
            lines.append(f"#   ({o['n']}, {o['k']}) {', '.join(o['layers'])}: {o['reason']}")

    def shape_comments(s: export_vllm.ExportedShape) -> list[str]:
        sweep = next((t for t, r in runs.items() if _same_run(
            r.provenance, s.provenance, ("gpu_uuid", "date_utc", "command"))), "?")
        replaces = ("replaces vLLM's own entry" if (s.n, s.k) in vllm_shapes
                    else "a shape vLLM's table does not have")
        score = f", score {s.selection_score}" if s.selection_score is not None else ""
        return [f"        # {', '.join(s.layers)}: {replaces}; layout (block_k {s.block_k}) "
                f"from [{sweep}]{score};",
                f"        #   buckets measured in {', '.join(sorted(set(tags[(s.n, s.k)])))}"]

    return export_vllm.python_table(
        export, lines, shape_comments,
        lambda s, i, b: _bucket_comment(b, tags[(s.n, s.k)][i]))


def render_provenance(sources: Sources, table_sha: str, export: export_vllm.VllmExport,
                      runs: dict[str, Run], tags: dict[tuple[int, int], list[str]],
                      vllm_shapes: set[tuple[int, int]]) -> str:
    entries = []
    for s in export.shapes:
        entries.append({
            "n": s.n, "k": s.k, "layers": list(s.layers), "block_k": s.block_k,
            "in_vllm_table": (s.n, s.k) in vllm_shapes, "selection_score": s.selection_score,
            "buckets": [{"m_max": b.m_max, "run": tag,
                         "vllm_config": {"block_m": b.block_m, "block_n": b.block_n,
                                         "num_warps": b.num_warps, "num_stages": b.num_stages},
                         "measured": b.measured, "ratio_to_torch_mm": b.ratio_to_torch_mm,
                         "dropped": b.dropped, "exported_from": b.exported_from}
                        for b, tag in zip(s.buckets, tags[(s.n, s.k)])],
            "provenance": s.provenance})
    doc = {"schema": SCHEMA, "vllm": sources.vllm.model_dump(),
           "format": f"{export_vllm.VLLM_CONFIGS_MODULE}._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS",
           "variable": export_vllm.EXPORT_VARIABLE, "arch_family": export.arch_family,
           "source_table": {"path": sources.table, "sha256": table_sha},
           "vllm_launch": {"group_m": export_vllm.VLLM_GROUP_M, "programs": "min(NUM_SMS, tiles)",
                           "split_k": 1, "dtype": export_vllm.VLLM_DTYPE},
           "runs": {t: {"raw": r.raw, "raw_sha256": r.sha256, "what": r.what,
                        "provenance": r.provenance} for t, r in runs.items()},
           "dropped_summary": export.dropped_summary(), "omitted": list(export.omitted),
           "entries": entries}
    return json.dumps(doc, indent=1) + "\n"


# ---- rendering: the README ---------------------------------------------------------------------

def _f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _prov_short(p: dict[str, Any]) -> str:
    return (f"{p.get('gpu_name')} {p.get('gpu_uuid')} (serial {p.get('gpu_serial')}), driver "
            f"{p.get('driver')}, torch {p.get('torch')}, triton {p.get('triton')}, "
            f"{p.get('date_utc')}")


def readme_intro(sources: Sources, export: export_vllm.VllmExport, table_sha: str,
                 vllm_shapes: set[tuple[int, int]]) -> list[str]:
    replaced = sum((s.n, s.k) in vllm_shapes for s in export.shapes)
    dropped = ", ".join(f"`{k}` in {v} buckets" for k, v in export.dropped_summary().items())
    return [
        "# bistat's H200 GEMM table for vLLM's batch-invariant mode: evidence package",
        "",
        f"Generated by `python kernels/upstream/build.py` from the raw files `{SOURCES}` lists;",
        "do not edit by hand (`--check` compares). Every number below is read from a committed",
        "file named beside it.",
        "",
        "## What this is",
        "",
        f"- [`batch_invariant_configs_nvidia_h200.py`](batch_invariant_configs_nvidia_h200.py): "
        f"{len(export.shapes)} bfloat16 weight shapes (N, K) with their M buckets, in the form of "
        f"vLLM's `_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS` "
        f"(`vllm/model_executor/determinism/batch_invariant_configs.py`), as "
        f"`{export_vllm.EXPORT_VARIABLE}[{export.arch_family!r}]`: merge its entries into vLLM's "
        f"`{export.arch_family!r}` dict. {replaced} of them replace an entry vLLM "
        f"{sources.vllm.version} already has; {len(export.shapes) - replaced} are shapes its "
        f"table lacks (vLLM runs its fixed 128x128x64 launch there).",
        f"- Every bucket's comment names the run that measured it; the legend at the top of the "
        f"file gives each run's GPU name, UUID, serial, driver, compute capability, torch, CUDA, "
        f"triton and python versions, date, command and raw file. "
        f"[`provenance.json`](provenance.json) holds the same per bucket, machine-readable.",
        f"- Source: `{sources.table}` (sha256 `{table_sha[:16]}...`), the table the bistat vLLM "
        f"plugin ships (`bistat_kernels.vllm_plugin`, `BISTAT_TUNED_GEMM=1`); "
        f"`bistat_kernels.export_vllm` decides what vLLM's kernel can express.",
        f"- Format: vLLM {sources.vllm.version}'s `batch_invariant_configs.py` (sha256 "
        f"`{sources.vllm.configs_sha256[:16]}...`, byte-identical to 0.33.0's). "
        f"`tests/kernels/test_upstream_package.py` parses the file back with "
        f"`export_vllm.parse_vllm_source` against the shipped table, and, where the "
        f"{sources.vllm.version} wheel is on the machine, checks that sha256 and has vLLM's own "
        f"loader (`resolve_tuned_matmul_configs`, `_get_matmul_config`) read the merged table.",
        "",
        "What vLLM's kernel cannot express, and so is not in the file (bistat's kernel has it):",
        "",
        f"- split-K: {len(export.omitted)} shapes use it for every M (their reduction order may "
        f"not change with M) and are left out, vLLM keeping its own entry or default: "
        + ", ".join(f"({o['n']}, {o['k']}) {', '.join(o['layers'])}" for o in export.omitted) + ";",
        f"- per-bucket fields vLLM's `_MatmulMConfig` has no room for, dropped: {dropped} "
        f"(`programs_per_sm` and `tma` only schedule tiles and choose how they are loaded; a "
        f"bucket with its own `block_k` is exported with the launch it replaced at the entry's "
        f"`block_k`, timed in the same re-tune, or the nearest smaller bucket's).",
        "",
        "So the times in the comments are bistat's launch. vLLM's kernel running the exported "
        "launches is measured by the device step `kernel-ab` (below).",
        "",
    ]


def readme_measured(runs: dict[str, Run], benches: list[Bench], export: export_vllm.VllmExport,
                    vbench: Bench, vfacts: dict[str, Any], probe: dict[str, Any]) -> list[str]:
    main = benches[0]
    ms = list(main.summary.get("goal_ms", []))
    lines = [
        "## How it was measured",
        "",
        "On lent H200s (one GPU each), by bistat's tools (`kernels/device/gpu_call.py`): a sweep "
        "chose each shape's layout (BLOCK_K, split-K) by a decode-weighted score, then each M "
        "bucket's launch; later runs re-tuned ranges of buckets with the layouts kept. A candidate "
        "was kept only if its rows computed alone and inside the batch were bitwise equal on the "
        "GPU; times are CUDA-graph replays of back-to-back calls over weight copies that exceed "
        "L2 three times (a decode step's pattern), median per call, torch.mm timed the same way "
        "in the same run.",
        "",
    ]
    lines += _table(["run", "what", "GPU and stack", "command", "raw"],
                    [(f"`{r.tag}`", r.what, r.line(), f"`{r.provenance.get('command')}`",
                      f"`{r.raw}`") for r in runs.values()])
    p = probe
    lines += ["", f"Both gates of `bistat kernels probe` on the shipped table (`{p['name']}`, "
              f"`{p['raw']}`, {_prov_short(p['provenance'])}): "
              f"{'passed' if p['passed'] else 'FAILED'}.", ""]
    lines += _table(["case", "shapes", "M values", "rows alone = in batch (bitwise)",
                     "accuracy cases passed"],
                    [(f"`{case}`", c["shapes"], f"{len(c['m'])} from {min(c['m'])} to "
                      f"{max(c['m'])}", f"{c['rows_equal']} of {c['rows_checked']}",
                      f"{c['accuracy_passed']} of {c['accuracy']}")
                     for case, c in p["cases"].items()])
    lines += ["", f"(`table bfloat16` is every entry of the table; `k_pow2` the power-of-two K "
              f"that vLLM #55131 reports, `fp32_ieee` float32 without TF32, vLLM #55466. Largest "
              f"bfloat16 error relative to max |reference|: {_f(p['max_bf16_rel_err'], 4)}.)"]
    lines += ["", "## Ratios to torch.mm (the shipped table, bistat's kernel)", "",
              f"{len(benches)} independent benches of the shipped table (its sha256 is the one "
              f"each bench ran, `{SOURCES}`): "
              + "; ".join(f"`{b.name}` on {_prov_short(b.provenance)} (`{b.raw}`)"
                          for b in benches) + ".", ""]
    lines += _table(["bench", f"geometric mean, M in {{{', '.join(map(str, ms))}}}",
                     f"M <= {main.summary.get('decode_max_m')}", "goals (overall, M <= 32)"],
                    [(b.name, _f(b.summary.get("geomean_tuned_over_mm"), 4),
                      _f(b.summary.get("decode_geomean_tuned_over_mm"), 4),
                      f"{b.summary.get('goal_targets', {}).get('overall')}, "
                      f"{b.summary.get('goal_targets', {}).get('decode')}") for b in benches])
    exported = {(s.n, s.k) for s in export.shapes}
    shapes = sorted(main.layers, key=lambda nk: (main.layers[nk], nk))
    lines += ["", f"Per shape, bench `{main.name}` (tuned time / torch.mm; below 1: faster than "
              f"cuBLAS). `exported` says whether the shape is in the file.", ""]
    lines += _table(["layer", "(N, K)", "exported", *[f"M={m}" for m in ms]],
                    [(main.layers[nk], f"({nk[0]}, {nk[1]})", "yes" if nk in exported else "no",
                      *[_f(main.ratio.get((*nk, m))) for m in ms]) for nk in shapes])
    vshapes = set(map(tuple, vfacts["tuned_shapes"]))
    v_rows = [(vbench.layers[nk], f"({nk[0]}, {nk[1]})", "yes" if nk in vshapes else "no",
               *[_f(vbench.ratio.get((*nk, m))) for m in ms])
              for nk in sorted(vbench.layers, key=lambda nk: (vbench.layers[nk], nk))]
    lines += [
        "", f"## vLLM {vfacts['version']}'s own table, for comparison", "",
        f"Bench `{vbench.name}` (`{vbench.raw}`) timed vLLM {vfacts['version']}'s own kernel and "
        f"table (`mm_batch_invariant`, loaded from the installed vLLM, commit "
        f"{vfacts['commit']}; its `batch_invariant_configs.py` is the file above by sha256) on "
        f"{_prov_short(vbench.provenance)}: geometric mean "
        f"{_f(vbench.summary.get('geomean_vllm_over_mm'))}x torch.mm, "
        f"{_f(vbench.summary.get('decode_geomean_vllm_over_mm'))}x at M <= 32. "
        "Another GPU and another Triton than the benches above, and that run's bistat column is "
        "an earlier table, not shown: the same-node comparison of the two tables is the device "
        "step `kernel-ab` (below). `in vLLM's table` no: vLLM's fixed 128x128x64 launch.", ""]
    lines += _table(["layer", "(N, K)", "in vLLM's table", *[f"M={m}" for m in ms]], v_rows)
    common = sorted(exported & vshapes)
    theirs = geomean(vbench.ratio[(*nk, m)] for nk in common for m in ms)
    ours = geomean(main.ratio[(*nk, m)] for nk in common for m in ms)
    lines += ["", f"On the {len(common)} shapes that both vLLM's table and this file tune, over "
              f"M in {{{', '.join(map(str, ms))}}}: vLLM's table {_f(theirs)}x torch.mm "
              f"(`{vbench.name}`), bistat's table {_f(ours)}x (`{main.name}`, bistat's kernel). Different GPUs, "
              f"stacks and kernels: an indication, not the comparison `kernel-ab` makes."]
    return lines + [""]


def readme_device(root: Path, dev: Device, device_mod: Any) -> list[str]:
    lines = ["## vLLM's own benchmarks: vLLM's table vs bistat's (one node)", ""]
    lines += [f"`{DEVICE_SCRIPT}` runs them on one H200 with the vLLM {'0.34.0'} payload, each arm "
              "in turn on the same GPU (`nvidia-smi` UUID and serial logged before and after "
              "every run):", ""]
    lines += _table(["arm", "environment"],
                    [(f"`{a}`", " ".join(f"`{k}={v}`" for k, v in env.items()))
                     for a, env in device_mod.ARMS.items()])
    lines += ["", "```bash"]
    lines += [device_mod.shown(device_mod.bench_argv(b, f"OUT/{b}-ARM.json"))
              for b in device_mod.BENCHES]
    lines += ["```", "",
              f"The model is the Qwen3-8B configuration (36 layers, dummy weights; vLLM's own "
              f"table covers its five shapes, so both arms run a tuned table), written by "
              f"`scripts/device/prepare.sh`; the throughput bench takes SmolLM2's tokenizer for "
              f"its random prompts (the config folder has none)."]
    if not dev.runs and not dev.failed:
        return lines + ["", "**Pending GPU measurement.** No device folder is listed in "
                        f"`{SOURCES}` (`[device] folders`): there are no numbers yet for these "
                        "commands, nor for `kernel-ab` and `determinism` below.", ""]
    uuid, serial = dev.node or ("?", "?")
    v = dev.versions
    lines += ["", f"Node: {dev.gpu.get('name')} {uuid} (serial {serial}), driver "
              f"{dev.gpu.get('driver_version')}; vLLM {v.get('vllm')} ({v.get('vllm_commit')}), "
              f"torch {v.get('torch')}, triton {v.get('triton')}, bistat "
              f"{v.get('bistat_commit')}; raw: " + ", ".join(f"`{f}`" for f in dev.folders) + ".",
              ""]
    for bench, keys in (("latency", ("avg_s", "p50_s", "p90_s")),
                        ("throughput", ("requests_per_s", "tokens_per_s",
                                        "output_tokens_per_s"))):
        runs = [r for r in dev.runs if r["step"] == bench]
        if not runs:
            lines += [f"`{bench}`: pending (no run in the listed folders).", ""]
            continue
        rows, by_arm = [], {}
        for r in runs:
            res = bench_result(root, r)
            by_arm.setdefault(r["arm"], []).append(res)
            rows.append((r["arm"], *[_f(res[k], 4) for k in keys], r["start_utc"],
                         f"`{r['folder']}/{r['log']}`"))
        lines += _table(["arm", *keys, "start (UTC)", "raw output"], rows)
        a = geomean(x[keys[0]] for x in by_arm["bistat-table"])
        b = geomean(x[keys[0]] for x in by_arm["vllm-table"])
        lines += ["", f"bistat-table / vllm-table, {keys[0]}: {_f(a / b, 4)}.", ""]
    if dev.kernel_ab:
        s = dev.kernel_ab["summary"]
        lines += ["### `kernel-ab`: vLLM's own kernel with its table vs with these entries", "",
                  *_table(["rows", "vllm-table / torch.mm", "bistat-entries / torch.mm",
                           "bistat-entries / vllm-table", "M <= 32: bistat-entries / vllm-table",
                           "rows invariant"],
                          [(s["rows"], _f(s["all"]["vllm_table_over_mm"]),
                            _f(s["all"]["bistat_entries_over_mm"]),
                            _f(s["all"]["bistat_entries_over_vllm_table"]),
                            _f(s["decode"]["bistat_entries_over_vllm_table"]),
                            ", ".join(f"{k}: {v}" for k, v in s["invariant"].items()))]),
                  "", f"Raw: `{dev.kernel_ab['folder']}/kernel_ab.json`.", ""]
    else:
        lines += ["`kernel-ab`: pending (no run in the listed folders).", ""]
    for run in dev.failed + dev.skipped:
        lines.append(f"- {run['step']} {run.get('arm') or ''}: {run['status']} "
                     f"({run.get('why') or 'rc ' + str(run.get('returncode'))}), "
                     f"`{run['folder']}/{run['log']}`")
    return lines + [""]


def readme_determinism(root: Path, det: dict[str, Any], dev: Device, device_mod: Any) -> list[str]:
    src = det["source"]
    tests = det["tests"]
    counts = {s: sum(t["on_lent_h200"] == s for t in tests) for s in STATUSES}
    lines = [
        "## vLLM's `tests/v1/determinism` (0.34.0) with bistat's table", "",
        f"Read from vLLM 0.34.0's sdist on PyPI (the wheel ships no tests): `{src['file']}`, "
        f"sha256 `{src['sha256'][:16]}...`, folder `{src['folder']}`, "
        f"{len(src['files_sha256'])} files (their sha256 in `{SOURCES.rsplit('/', 1)[0]}/"
        f"raw/vllm034_determinism_tests.json`). {len(tests)} test functions in "
        f"{len({t['file'] for t in tests})} files; on the lent H200 (one GPU, no network, vLLM "
        f"0.34.0 payload): " + ", ".join(f"{counts[s]} {s}" for s in STATUSES) + ".", "",
        "- " + "\n- ".join(f"`{s}`: {det['statuses'][s]}" for s in STATUSES), "",
        "How they are pointed at bistat's table:", "",
        "- tests that build an engine (`LLM`, `vllm serve`): `BISTAT_TUNED_GEMM=1` in the "
        "environment, bistat installed beside vLLM (`scripts/device/prepare.sh`): vLLM loads "
        "bistat's `vllm.general_plugins` entry point in every engine process and the engine log "
        f"says `bistat_kernels: {INSTALLED} as vllm.model_executor.determinism.batch_invariant."
        "matmul_persistent`; `VLLM_TEST_MODEL=/tmp/model/smollm2` replaces the hub model;",
        "- kernel-level tests (no engine): `pytest -p pytest_bistat_table` "
        "([`pytest_bistat_table.py`](pytest_bistat_table.py), on `PYTHONPATH`) loads vLLM's "
        "plugins in the test process before collection and refuses to run if the hook is not "
        "installed; the report header says which GEMM ran;",
        "- the baseline is the same command with `BISTAT_TUNED_GEMM=0` (vLLM's own table).", "",
        f"`{DEVICE_SCRIPT} run --steps determinism` runs, per arm, one pytest each for "
        + ", ".join(f"`{name}`" for name, k in device_mod.DETERMINISM if k is None)
        + f" and, in `test_batch_invariance.py` with `-k \"TEST and {device_mod.E2E_SELECT}\"`, "
        + ", ".join(f"`{k.split(' and ')[0]}`" for name, k in device_mod.DETERMINISM if k)
        + ": the tests marked selected below, "
        f"{len(device_mod.DETERMINISM)} runs per arm.", ""]
    rows = []
    for t in tests:
        rows.append((f"`{t['file']}`", f"`{t['test']}`" + (" (selected)" if t["selected"] else ""),
                     t["parametrized"], t["checks"], t["needs"], t["reaches_bistat_gemm"],
                     f"**{t['on_lent_h200']}**: {t['why']}"))
    lines += _table(["file", "test", "parametrized", "checks", "needs", "reaches bistat's GEMM",
                     "on the lent H200"], rows)
    det_runs = [r for r in dev.runs + dev.failed if r["step"] == "determinism"]
    lines += [""]
    if not det_runs:
        lines += ["**Pending GPU run.** No determinism run is in the listed device folders: "
                  "the result of these tests with bistat's table on the H200 is not known yet.", ""]
        return lines
    rows = []
    for r in det_runs:
        xml = root / r["folder"] / r["files"][0]
        c = junit_counts(xml) if xml.is_file() else {}
        argv = r["argv"]
        target = next(a for a in argv if a.startswith("tests/"))
        select = f" -k \"{argv[argv.index('-k') + 1]}\"" if "-k" in argv else ""
        rows.append((r["arm"], f"`{target.rsplit('/', 1)[-1]}{select}`",
                     *[c.get(k, "–") for k in ("passed", "failed", "errors", "skipped")],
                     f"`{r['folder']}/{r['log']}`"))
    lines += _table(["arm", "selection", "passed", "failed", "errors", "skipped", "raw"], rows)
    return lines + [""]


def readme_reproduce(sources: Sources) -> list[str]:
    return [
        "## Reproduce", "",
        "```bash",
        "python kernels/upstream/build.py --check        # this package from the raw files",
        "python -m pytest -q tests/kernels/test_upstream_package.py "
        "tests/kernels/test_export_vllm.py",
        "# the table and its raw files on an H200 (bistat's tools; kernels/README.md):",
        "PYTHONPATH=kernels python3 kernels/device/gpu_call.py sweep probe bench --retune "
        "--out $OUT",
        "# vLLM's benchmarks and tests, both tables, one node (vLLM 0.34.0 payload,",
        "# scripts/device/README.md): install.sh, SKIP_SYNTH=1 prepare.sh, then",
        ". scripts/device/env.sh && python3 scripts/device/upstream_bench.py run --out $OUT \\",
        "    --steps kernel-ab,latency,throughput --budget-s 540",
        "# here, before a call that runs --steps determinism (carry .dev/upstream):",
        "python scripts/device/upstream_bench.py pack-tests --sdist vllm-0.34.0.tar.gz",
        "```", "",
        f"Then copy each call's `$OUT` under `kernels/upstream/raw/device/`, list the folders in "
        f"`{SOURCES}` (`[device] folders`) and run the build again.", ""]


def readme_pending(dev: Device, det_ran: bool) -> list[str]:
    pending = []
    steps = {r["step"] for r in dev.runs}
    if not {"latency", "throughput"} <= steps:
        pending.append("`vllm bench latency` and `vllm bench throughput` before/after on one node "
                       "(device steps `latency`, `throughput`)")
    if dev.kernel_ab is None:
        pending.append("vLLM's own kernel timed with these entries against its own table on one "
                       "GPU (device step `kernel-ab`)")
    if not det_ran:
        pending.append("vLLM's `tests/v1/determinism` run with bistat's table and with vLLM's "
                       "(device step `determinism`)")
    if not pending:
        return []
    return ["## Pending GPU measurement", "",
            "Nothing below has been measured yet; this package states no number for it:", "",
            *[f"- {p};" for p in pending[:-1]], f"- {pending[-1]}.", ""]


# ---- the build ---------------------------------------------------------------------------------

def build(root: Path = ROOT, device_folders: Sequence[str] | None = None,
          sources_path: Path | None = None) -> dict[str, str]:
    """{path relative to root: text} of every generated file. ``sources_path`` reads another
    sources.toml (paths in it still relative to ``root``)."""
    sources = load_sources(sources_path or root / SOURCES)
    table_path = root / sources.table
    if not table_path.is_file():
        raise PackageError(f"{SOURCES}: table = {sources.table!r}: no such file")
    try:
        table = tables.load_table(table_path)
    except Exception as exc:  # the loader's own message names the field and the fix
        raise PackageError(str(exc)) from None
    export = export_vllm.export_table(table, source=sources.table)
    runs = load_runs(root, sources)
    tags = bucket_runs(table, export, runs)
    vfacts = vllm_table_facts(root, sources)
    vllm_shapes = {tuple(s) for s in vfacts["tuned_shapes"]}
    table_sha = _sha256(table_path)
    for where, b in [("[[benches]]", b) for b in sources.benches] + [("[probe]", sources.probe)]:
        if b.table_sha256 != table_sha:
            raise PackageError(f"{SOURCES}: {where} {b.name!r} ran the table with sha256 "
                               f"{b.table_sha256[:16]}..., not {sources.table} as it is now "
                               f"({table_sha[:16]}...): bench and probe the shipped table and "
                               f"list those files")
    probe = load_probe(root, sources.probe)
    benches = [load_bench(root, b, f"[[benches]] {b.name!r} raw", "tuned_over_mm")
               for b in sources.benches]
    vbench = load_bench(root, sources.vllm_kernel_bench, "[vllm_kernel_bench] raw", "vllm_over_mm")
    det = _read_json(root, sources.determinism.raw, "[determinism] raw")
    if det.get("schema") != DETERMINISM_SCHEMA:
        raise PackageError(f"{sources.determinism.raw}: schema {det.get('schema')!r}, not "
                           f"{DETERMINISM_SCHEMA!r}")
    bad = [t["test"] for t in det["tests"] if t["on_lent_h200"] not in STATUSES]
    if bad:
        raise PackageError(f"{sources.determinism.raw}: on_lent_h200 of {bad[0]} is not one of "
                           f"{', '.join(STATUSES)}")
    folders = list(device_folders) if device_folders is not None else sources.device.folders
    field_name = ("--device" if device_folders is not None else f"{SOURCES} [device] folders")
    dev = load_device(root, folders, field_name)
    device_mod = _load_device_script(root)
    det_ran = any(r["step"] == "determinism" for r in dev.runs + dev.failed)
    readme = (readme_intro(sources, export, table_sha, vllm_shapes)
              + readme_measured(runs, benches, export, vbench, vfacts, probe)
              + readme_device(root, dev, device_mod)
              + readme_determinism(root, det, dev, device_mod)
              + readme_pending(dev, det_ran)
              + readme_reproduce(sources))
    return {TABLE_OUT: render_table(sources, export, runs, tags, vllm_shapes),
            PROVENANCE_OUT: render_provenance(sources, table_sha, export, runs, tags, vllm_shapes),
            README_OUT: "\n".join(readme).rstrip("\n") + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing")
    parser.add_argument("--device", action="append", default=None, metavar="DIR",
                        help="a device folder (repeatable), in place of sources.toml's list")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        files = build(args.root, args.device)
    except PackageError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    differ = []
    for rel, text in files.items():
        path = args.root / rel
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                differ.append(rel)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {rel} ({len(text.encode())} bytes)")
    if differ:
        print("differs from the raw files (run python kernels/upstream/build.py): "
              + ", ".join(differ), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
