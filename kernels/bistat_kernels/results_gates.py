"""The gate sections of ``kernels/RESULTS.md``: the probe (bitwise row invariance and accuracy
per shape) and the kernel checks on the GPU (the gates' configurations, fused against parallel
split-K, compiled and CUDA-graph runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bistat_kernels.results_common import Provenance, provenance


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
