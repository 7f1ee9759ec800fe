#!/usr/bin/env python3
"""Does BLOCK_K change an output element's bits? Measured on the GPU, with what it would pay.

The table fixes ``block_k`` per weight shape because the K-tile size was taken to be part of the
reduction order. On tensor cores a ``tl.dot`` over a K-tile is a chain of k16 (bf16) MMA steps into
one float32 accumulator, and consecutive K-tiles continue that chain, so BLOCK_K 64 and 128 issue
the same steps in the same order; only the split-K boundaries (where partial sums start afresh)
would change the sums. This script tests that claim bitwise and times what it would buy:

* **bits**: for each tuned shape (the shipped table's layout ``(block_k, split_k)``), the rows of
  the layout's canonical launch computed alone (M = 1) against the same rows computed at
  M in ``MS`` by launches with every other BLOCK_K whose split-K ranges are the layout's, with
  pointer and descriptor loads, mma.sync (BLOCK_M 16) and wgmma (BLOCK_M 64/128) tiles, on three
  inputs (two seeds, and one whose columns span 2^-8..2^8);
* **time**: at M >= 256 the table's launch against BLOCK_K-64 launches of the same split ranges,
  beside torch.mm (CUDA-graph replays over weight copies exceeding 3x L2, as the bench).

    PYTHONPATH=kernels python3 kernels/device/block_k_check.py --out "$OUT/block_k_check.json"

Writes one JSON file (provenance, every comparison, every timing) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from bistat_kernels import matmul_persistent as mp
from bistat_kernels import sweep, tables, timing
from bistat_kernels.probe import row_positions
from bistat_kernels.provenance import gpu_provenance
from bistat_kernels.shapes import shapes_for

MODELS = ("qwen3-8b", "qwen3-1.7b", "smollm2-135m")
MS = (1, 33, 256, 1000, 4096)
TIME_MS = (256, 512, 1024, 2048, 4096)
ALT_BLOCK_K = (32, 64, 128, 256)


def bit_configs(block_k: int, split_k: int) -> list[tables.GemmConfig]:
    fused = split_k > 1
    return [
        sweep.canonical_config(block_k, split_k),  # BLOCK_M 16: mma.sync
        tables.GemmConfig(64, 128, block_k, 8, 4, 3, split_k),  # wgmma, pointer loads
        tables.GemmConfig(128, 128, block_k, 8, 8, 3, split_k, fuse_splits=fused, tma=True),
        tables.GemmConfig(128, 256, block_k, 8, 8, 3, split_k, tma=True),
    ]


def time_configs(split_k: int) -> list[tables.GemmConfig]:
    out = []
    for bm, bn, w, s in ((128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 4, 4), (128, 128, 8, 4),
                         (128, 128, 4, 5), (64, 256, 4, 4), (128, 64, 4, 5)):
        out.append(tables.GemmConfig(bm, bn, 64, 8, w, s, split_k, tma=True))
        if split_k > 1:
            out.append(tables.GemmConfig(bm, bn, 64, 8, w, s, split_k, fuse_splits=True,
                                         tma=True))
    return out


def _run(a, b, cfg):
    try:
        out = mp.matmul_persistent(a, b, config=cfg)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out
    except OutOfResources:
        return None


def check_shape(shape, entry, device) -> dict:
    n, k = shape.n, shape.k
    layout = (entry.block_k, entry.split_k)
    ranges = tables.split_ranges(k, *layout)
    canon = sweep.canonical_config(*layout)
    res: dict = {"model": shape.model, "layer": shape.layer, "n": n, "k": k,
                 "layout": list(layout), "split_ranges": [list(r) for r in ranges],
                 "bits": [], "times": []}
    alts = [bk for bk in ALT_BLOCK_K if tables.split_ranges(k, bk, entry.split_k) == ranges]
    res["block_k_same_ranges"] = alts
    for inp in ("seed0", "seed1", "wide"):
        gen = torch.Generator(device=device).manual_seed(0 if inp == "seed0" else 1)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        a_big = torch.randn(max(MS), k, device=device, dtype=torch.bfloat16, generator=gen)
        if inp == "wide":
            scale = torch.pow(2.0, torch.randint(-8, 9, (k,), device=device, generator=gen))
            a_big = (a_big.float() * scale).to(torch.bfloat16)
        b = w.t()
        rows = sorted({r for m in MS for r in row_positions(m)})
        alone = {r: mp.matmul_persistent(a_big[r:r + 1], b, config=canon)[0] for r in rows}
        for bk in alts:
            for cfg in bit_configs(bk, entry.split_k):
                for m in MS:
                    out = _run(a_big[:m], b, cfg)
                    if out is None:
                        res["bits"].append({"input": inp, "config": str(cfg), "m": m,
                                            "status": "out_of_resources"})
                        continue
                    bad = [r for r in row_positions(m) if not torch.equal(out[r], alone[r])]
                    nbits = sum(int((out[r].view(torch.int16) != alone[r].view(torch.int16))
                                    .sum()) for r in bad)
                    res["bits"].append({"input": inp, "block_k": bk, "config": str(cfg), "m": m,
                                        "equal": not bad, "rows_differing": bad,
                                        "elements_differing": nbits})
        del a_big, w, b, alone
    # timing (seed 0 data): the table's launch vs BLOCK_K-64 launches of the same split ranges
    if device == "cuda" and 64 in alts and entry.block_k != 64:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        a_big = torch.randn(max(TIME_MS), k, device=device, dtype=torch.bfloat16, generator=gen)
        copies = [c.t() for c in timing.weight_copies(w)]
        for m in TIME_MS:
            a = a_big[:m]
            torch.mm(a, copies[0])
            mm_ms = timing.graph_time_ms([lambda bb=bb: torch.mm(a, bb) for bb in copies])
            table_cfg = entry.config_for(m)
            row = {"m": m, "torch_mm_ms": mm_ms, "table": str(table_cfg)}
            _run(a, copies[0], table_cfg)
            row["table_ms"] = timing.graph_time_ms(
                [lambda bb=bb: mp.matmul_persistent(a, bb, config=table_cfg) for bb in copies])
            cands = []
            for cfg in time_configs(entry.split_k):
                if _run(a, copies[0], cfg) is None:
                    continue
                t = timing.graph_time_ms(
                    [lambda bb=bb, cfg=cfg: mp.matmul_persistent(a, bb, config=cfg)
                     for bb in copies])
                cands.append({"config": str(cfg), "ms": t})
            best = min(cands, key=lambda c: c["ms"]) if cands else None
            row.update(candidates=cands, best_bk64=best,
                       table_over_mm=row["table_ms"] / mm_ms,
                       best_over_mm=(min(row["table_ms"], best["ms"]) / mm_ms) if best else None)
            res["times"].append(row)
        del copies, a_big, w
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--table", type=Path, default=tables.table_path_for("NVIDIA H200"))
    args = ap.parse_args()
    t0 = time.monotonic()
    sweep.pin_triton_toolchain()
    table = tables.load_table(args.table)
    tables.set_device_table(table)
    doc = {"schema": "bistat_kernels.block_k_check/1", "table": str(args.table),
           "provenance": gpu_provenance(0, ["kernels/device/block_k_check.py", "--out",
                                            str(args.out)]),
           "ms": list(MS), "time_ms": list(TIME_MS), "shapes": []}
    for shape in shapes_for(MODELS):
        entry = table.lookup("bfloat16", shape.n, shape.k)
        res = check_shape(shape, entry, "cuda")
        doc["shapes"].append(res)
        unequal = [b for b in res["bits"] if b.get("equal") is False]
        checked = sum("equal" in b for b in res["bits"])
        gain = ""
        if res["times"]:
            t = [(r["m"], round(r["table_over_mm"], 3), round(r["best_over_mm"], 3))
                 for r in res["times"]]
            gain = f" table->best/mm {t}"
        print(f"{shape.model}/{shape.layer} layout {res['layout']} alts "
              f"{res['block_k_same_ranges']}: {checked} comparisons, {len(unequal)} unequal"
              f"{gain} [{time.monotonic() - t0:.0f}s]", flush=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    # what the adopted best would do to the bench's goal sizes (M in 256, 1024, 4096 here)
    logs_t, logs_b = [], []
    for s in doc["shapes"]:
        for r in s["times"]:
            if r["m"] in (256, 1024, 4096):
                logs_t.append(math.log(r["table_over_mm"]))
                logs_b.append(math.log(r["best_over_mm"]))
    if logs_t:
        doc["summary"] = {"entries": len(logs_t),
                          "geomean_table_over_mm": math.exp(sum(logs_t) / len(logs_t)),
                          "geomean_best_over_mm": math.exp(sum(logs_b) / len(logs_b))}
    doc["unequal_total"] = sum(b.get("equal") is False for s in doc["shapes"] for b in s["bits"])
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: doc[k] for k in ("unequal_total", "elapsed_s", "summary") if k in doc}))


if __name__ == "__main__":
    main()
