#!/usr/bin/env python3
"""vLLM's own batch-invariant GEMM with its own tuned table, and with bistat's exported entries
merged into it, beside torch.mm, on one GPU: what a change to vLLM's table would do.

The bench of ``bistat kernels bench --vllm-kernel`` compares *bistat's kernel* with vLLM's. A
proposal to vLLM changes only ``batch_invariant_configs.py``: vLLM's kernel (one K chain, GROUP_M
8, ``min(NUM_SMS, tiles)`` programs, pointer loads) then runs the exported launch of each bucket,
which drops what vLLM's kernel cannot express (``programs_per_sm``, descriptor loads, split-K). That
launch was never timed inside vLLM's kernel. This script times it.

vLLM's ``batch_invariant.py`` and ``batch_invariant_configs.py`` are loaded from the installed
vLLM (``--vllm $SITE/vllm``) by ``bistat_kernels.vllm_kernel`` (its kernel and loader, unchanged).
Two arms share that one loaded kernel: ``vllm-table`` (its table as shipped) and
``bistat-entries`` (``kernels/upstream/batch_invariant_configs_nvidia_h200.py``'s
``BISTAT_TUNED_CONFIGS["hopper"]`` merged over vLLM's ``"hopper"`` dict, as a pull request would;
the loader's resolution is reset between arms). Per exported shape and M in ``--ms`` (the bench's
goal set): both arms' launches and times and torch.mm's, each a CUDA-graph replay over weight
copies that exceed L2 (``bistat_kernels.timing``), the three timed in turn, the arms' order
reversed in every second round (``--rounds``); both arms' rows checked bitwise alone vs in batch
(``bistat_kernels.probe.check_invariance``) and against a float32 reference. Output (JSON,
``--out``): provenance, vLLM's files and their sha256, rows, geometric means.

Everything above ``# --- GPU side`` is pure and tested on the CPU
(``tests/kernels/test_upstream_package.py``, with the 0.34.0 wheel's configs module).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "bistat_kernels.upstream_kernel_ab/1"
ARMS = ("vllm-table", "bistat-entries")
CONFIGS_IMPORT = "vllm.model_executor.determinism.batch_invariant_configs"
EXPORT_VARIABLE = "BISTAT_TUNED_CONFIGS"
FAMILY = "hopper"


def load_export(text: str, configs: types.ModuleType, source: str = "<export>") -> dict:
    """Execute the exported table with its one import (``_MatmulMConfig``, ``_MatmulShapeConfig``
    from vLLM's configs module) answered by ``configs``; return ``BISTAT_TUNED_CONFIGS``."""
    saved = sys.modules.get(CONFIGS_IMPORT)
    sys.modules[CONFIGS_IMPORT] = configs
    try:
        namespace: dict[str, Any] = {}
        exec(compile(text, source, "exec"), namespace)
    finally:
        if saved is None:
            sys.modules.pop(CONFIGS_IMPORT, None)
        else:
            sys.modules[CONFIGS_IMPORT] = saved
    if EXPORT_VARIABLE not in namespace:
        raise ValueError(f"{source}: defines no {EXPORT_VARIABLE}")
    return namespace[EXPORT_VARIABLE]


def merged_tables(own: Mapping[str, Mapping], exported: Mapping[str, Mapping]) -> dict[str, dict]:
    """{arm: table}: vLLM's own, and vLLM's with the exported entries over its ``"hopper"`` dict."""
    merged = {family: dict(shapes) for family, shapes in own.items()}
    for family, shapes in exported.items():
        merged[family] = {**merged.get(family, {}), **shapes}
    return {"vllm-table": {f: dict(s) for f, s in own.items()}, "bistat-entries": merged}


def use_table(configs: types.ModuleType, table: Mapping[str, Mapping]) -> None:
    """Make vLLM's loader serve ``table`` from its next lookup on (its resolution runs again)."""
    configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS = table
    configs._TUNED_MATMUL_CONFIGS_RESOLVED = False
    configs._TUNED_MATMUL_CONFIGS_FOR_DEVICE = None


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarise(rows: Sequence[Mapping[str, Any]], decode_max_m: int = 32) -> dict[str, Any]:
    """Geometric means of each arm over torch.mm and of bistat-entries over vllm-table, over all
    rows and over rows with M <= ``decode_max_m``."""
    out: dict[str, Any] = {"rows": len(rows), "decode_max_m": decode_max_m}
    for label, subset in (("all", rows), ("decode", [r for r in rows if r["m"] <= decode_max_m])):
        out[label] = {
            "vllm_table_over_mm": geomean([r["vllm-table_ms"] / r["torch_mm_ms"] for r in subset]),
            "bistat_entries_over_mm": geomean([r["bistat-entries_ms"] / r["torch_mm_ms"]
                                               for r in subset]),
            "bistat_entries_over_vllm_table": geomean([r["bistat-entries_ms"] / r["vllm-table_ms"]
                                                       for r in subset]),
        }
    out["invariant"] = {arm: all(r["invariant"][arm] for r in rows) for arm in ARMS}
    return out


# --- GPU side ------------------------------------------------------------------------------------

def _graph_ms(fn: Any, copies: Sequence[Any]) -> float:
    """Median ms per call of ``fn`` over the weight copies, one CUDA graph; the first call (Triton's
    compilation, cuBLAS's handle) runs outside the capture."""
    from bistat_kernels import timing

    fn(copies[0])
    return timing.graph_time_ms([lambda bb=bb: fn(bb) for bb in copies])


def main(argv: list[str] | None = None) -> int:
    import torch

    from bistat_kernels import bench, probe, timing
    from bistat_kernels.provenance import gpu_provenance
    from bistat_kernels.vllm_kernel import load_vllm_kernel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, required=True, help="the installed vllm package dir")
    parser.add_argument("--export", type=Path, required=True,
                        help="kernels/upstream/batch_invariant_configs_nvidia_h200.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", default=",".join(map(str, bench.GOAL_MS)))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    ms = [int(x) for x in args.ms.split(",")]

    kernel = load_vllm_kernel(args.vllm)
    configs = kernel.configs
    own = {f: dict(s) for f, s in configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.items()}
    exported = load_export(args.export.read_text(), configs, str(args.export))
    tables = merged_tables(own, exported)
    shapes = sorted(exported[FAMILY])
    doc: dict[str, Any] = {"schema": SCHEMA, "provenance": gpu_provenance(),
                           "vllm": kernel.provenance(), "export": str(args.export),
                           "ms": ms, "rounds": args.rounds, "arms": list(ARMS),
                           "timing": "CUDA-graph replays over weight copies exceeding L2 "
                                     "(bistat_kernels.timing), median per call", "rows": []}
    torch.manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = timing.weight_copies(w)
        a_full = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        ref = {m: probe.reference_mm(a_full[:m], w.t(), None) for m in ms}
        for m in ms:
            a = a_full[:m]
            row: dict[str, Any] = {"n": n, "k": k, "m": m, "config": {}, "invariant": {},
                                   "max_rel_err": {}, "in_vllm_table": (n, k) in own[FAMILY]}
            times: dict[str, list[float]] = {"torch_mm": [], **{arm: [] for arm in ARMS}}
            for r in range(args.rounds):
                for arm in (ARMS if r % 2 == 0 else tuple(reversed(ARMS))):
                    use_table(configs, tables[arm])
                    row["config"][arm] = kernel.config_for(m, n, k, torch.bfloat16)
                    times[arm].append(_graph_ms(lambda bb: kernel.mm(a, bb.t()), copies))
                times["torch_mm"].append(_graph_ms(lambda bb: torch.mm(a, bb.t()), copies))
            for arm in ARMS:
                use_table(configs, tables[arm])
                row["max_rel_err"][arm] = float((kernel.mm(a, w.t()).float() - ref[m]).abs().max()
                                                / ref[m].abs().max())
                row["invariant"][arm] = probe.check_invariance(
                    a_full[:m], w.t(), None, [m], lambda x, y, bias: kernel.mm(x, y, bias)).passed
            for name, values in times.items():
                row[f"{name}_ms"] = statistics.median(values)
            doc["rows"].append(row)
            print(f"{n}x{k} M={m}: vllm-table {row['vllm-table_ms']:.5f} ms, bistat-entries "
                  f"{row['bistat-entries_ms']:.5f} ms, torch.mm {row['torch_mm_ms']:.5f} ms",
                  flush=True)
            args.out.write_text(json.dumps(doc, indent=1) + "\n")  # a killed run keeps its rows
        del copies, w, a_full, ref
        torch.cuda.empty_cache()
    use_table(configs, tables["vllm-table"])
    doc["summary"] = summarise(doc["rows"])
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
