"""Host cost per eager call before and after a launcher change, side by side on one GPU.

``--before FILE`` is an earlier ``bistat_kernels/matmul_persistent.py`` (e.g. ``git show
REV:kernels/bistat_kernels/matmul_persistent.py > .dev/mp_before.py``); it is imported beside the
current module and both run with the current table. The launcher's parts are modules of their
own (``matmul_kernels``, ``matmul_buffers``, ``matmul_raw_launch``): an earlier file that imports
them gets the current ones, so only the launcher module itself is compared. For every bench shape
at M in 1 and 16:

1. both outputs are compared bitwise (the same table fixes the same reduction order, so a
   launcher change must not move a bit; for split-K entries this compares two ways of adding
   the partials);
2. torch.mm, the earlier launcher and the current one are timed with
   :func:`bistat_kernels.host_cost.side_by_side_us` (runs interleaved): host us per call.

Writes ``host_before_after_<device>.json`` under ``--out``::

    PYTHONPATH=kernels python3 kernels/device/host_before_after.py --before .dev/mp_before.py \\
        --before-rev 61100e3 --out "$OUT"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bistat_kernels import host_cost, tables
from bistat_kernels import matmul_persistent as mp
from bistat_kernels.provenance import gpu_provenance
from bistat_kernels.shapes import MODEL_SHAPES, shapes_for

MS = (1, 16)


def load_before(path: Path):
    spec = importlib.util.spec_from_file_location("bistat_kernels._matmul_persistent_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file (give an earlier matmul_persistent.py)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--before-rev", required=True, help="the commit the file was taken from")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args()
    start = time.monotonic()
    before = load_before(args.before)
    table = tables.load_table(tables.table_path_for(torch.cuda.get_device_name(0)))
    tables.set_device_table(table)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in shapes_for(list(MODEL_SHAPES)):
        if time.monotonic() - start > args.budget_s:
            break
        w = torch.randn(shape.n, shape.k, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = w.t()
        for m in MS:
            a = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16, generator=gen)
            old, new = before.matmul_persistent(a, b), mp.matmul_persistent(a, b)
            old, new = before.matmul_persistent(a, b), mp.matmul_persistent(a, b)  # plans
            times = host_cost.side_by_side_us({
                "torch_mm": lambda: torch.mm(a, b),
                "before": lambda: before.matmul_persistent(a, b),
                "after": lambda: mp.matmul_persistent(a, b)})
            entry = table.lookup("bfloat16", shape.n, shape.k)
            row = {"model": shape.model, "layer": shape.layer, "n": shape.n, "k": shape.k, "m": m,
                   "split_k": entry.split_k, "config": str(entry.config_for(m)),
                   "same_bits": bool(torch.equal(old, new))}
            for name, (host, wall) in times.items():
                row[f"{name}_us"], row[f"{name}_wall_us"] = round(host, 2), round(wall, 2)
            row["before_minus_mm_us"] = round(row["before_us"] - row["torch_mm_us"], 2)
            row["after_minus_mm_us"] = round(row["after_us"] - row["torch_mm_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {key: {"max": max(r[key] for r in rows),
                     "mean": statistics.fmean(r[key] for r in rows)}
               for key in ("before_minus_mm_us", "after_minus_mm_us")}
    summary["all_same_bits"] = all(r["same_bits"] for r in rows)
    summary["rows"] = len(rows)
    doc = {"schema": "bistat_kernels.host_before_after/1",
           "provenance": gpu_provenance(0, sys.argv), "before_rev": args.before_rev,
           "table": table.source, "method": host_cost.__doc__.strip(), "rows": rows,
           "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_before_after_{tables.device_slug(table.device_name)}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary), flush=True)
    return 0 if summary["all_same_bits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
