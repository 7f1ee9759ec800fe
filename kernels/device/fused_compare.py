#!/usr/bin/env python3
"""Fused versus parallel split-K on the GPU, per weight shape and batch size, beside torch.mm.

Measures
--------
For every weight shape ``(N, K)`` given (default: the two split-K ``down`` shapes of the H200
table, Qwen3-8B 4096 x 12288 and Qwen3-1.7B 2048 x 6144, bf16) and every batch size ``M`` (default
64, 256, 1024, 4096) the GPU time per call of

``table``
    the launch configuration the device's table gives for ``M`` (its ``fuse_splits`` as stored);
``fused``
    the same launch with ``fuse_splits=True`` (the splits' partial sums added in the GEMM kernel);
``fused_<BM>x<BN>w<W>s<S>``
    fused launches with BLOCK_M, BLOCK_N, num_warps, num_stages from :data:`FUSED_LAUNCHES` and
    one program per multiprocessor (``block_k`` and ``split_k`` stay the table's);
``mm``
    ``torch.mm`` (cuBLAS) on the same operands.

Every time is :func:`bistat_kernels.timing.graph_time_ms`: the calls captured in one CUDA graph,
one per weight copy (the copies together exceed the L2 cache three times, so each call reads its
weight from HBM), the median replay divided by the number of calls. Every kernel variant's output
is compared bitwise with the table configuration's (``<name>_equal``): ``block_k`` and ``split_k``
are the table's in all of them, so all must be equal, fused or not. A variant that cannot launch
(for instance more shared memory than the device has) records the error text instead of a time.
cuBLAS is warmed up outside the capture (a first ``torch.mm`` inside a CUDA graph capture fails
with ``CUBLAS_STATUS_NOT_INITIALIZED``): once at start and once per operand set before its graph.

Running
-------
On the GPU machine, from the repository root, with ``kernels/`` (the folder that holds the package
``bistat_kernels``) on the path::

    PYTHONPATH=kernels python3 kernels/device/fused_compare.py --out "$OUT"

``--shapes 4096x12288,2048x6144``, ``--ms 64,256,1024,4096`` and ``--table PATH`` (a table file
instead of the device's) change what is measured. It takes about a minute on the H200.

Output
------
``<out>/fused_compare_<device slug>.json``::

    {"schema": "bistat_kernels.fused_compare/1",
     "provenance": {...},          # bistat_kernels.provenance.gpu_provenance: GPU, UUID, driver,
                                   # torch, triton, date (UTC), command
     "table": "<table source>", "gpu": "<device name>", "torch": "<version>",
     "rows": [{"n": N, "k": K, "m": M,
               "table_config": {GemmConfig fields},
               "table": ms, "table_equal": true,
               "fused": ms, "fused_equal": bool,
               "fused_128x128w8s3": ms or "error text", "fused_128x128w8s3_equal": bool, ...,
               "mm": ms}, ...]}

``kernels/bistat_kernels/make_results.py`` summarises the committed file in ``kernels/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from bistat_kernels import matmul_persistent as mp
from bistat_kernels import tables, timing
from bistat_kernels.provenance import gpu_provenance

SCHEMA = "bistat_kernels.fused_compare/1"
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((4096, 12288), (2048, 6144))
DEFAULT_MS: tuple[int, ...] = (64, 256, 1024, 4096)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the fused launches tried beside the table's.
FUSED_LAUNCHES: tuple[tuple[int, int, int, int], ...] = (
    (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4))


def variant_name(block_m: int, block_n: int, warps: int, stages: int) -> str:
    """``fused_<BM>x<BN>w<W>s<S>``, the row key of one fused launch."""
    return f"fused_{block_m}x{block_n}w{warps}s{stages}"


def variants(cfg: tables.GemmConfig) -> dict[str, tables.GemmConfig]:
    """The launches compared for one table configuration, by row key, the table's first."""
    out = {"table": cfg, "fused": dataclasses.replace(cfg, fuse_splits=True)}
    for bm, bn, warps, stages in FUSED_LAUNCHES:
        out[variant_name(bm, bn, warps, stages)] = dataclasses.replace(
            cfg, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, fuse_splits=True,
            programs_per_sm=1)
    return out


def compare_shape(n: int, k: int, m: int, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0) -> dict[str, Any]:
    """One row: every variant's time and bitwise equality with the table's output, and torch.mm."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)  # [M, K]
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02  # [N, K]
    ws = timing.weight_copies(w)
    cfg = tables.lookup_config(m, n, k, mp.dtype_name(dtype), torch.cuda.get_device_name())
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "table_config": dataclasses.asdict(cfg)}
    ref = mp.matmul_persistent(x, ws[0].t(), config=cfg)
    for name, c in variants(cfg).items():
        try:
            y = mp.matmul_persistent(x, ws[0].t(), config=c)  # compiles outside the capture
            row[name + "_equal"] = bool(torch.equal(y, ref))
            row[name] = timing.graph_time_ms(
                [lambda wc=wc, c=c: mp.matmul_persistent(x, wc.t(), config=c) for wc in ws])
        except Exception as exc:  # noqa: BLE001 - recorded in the row (out of shared memory)
            row[name] = repr(exc)[:100]
    torch.mm(x, ws[0].t())  # cuBLAS handle and workspace for this stream, outside the capture
    torch.cuda.synchronize()
    row["mm"] = timing.graph_time_ms([lambda wc=wc: torch.mm(x, wc.t()) for wc in ws])
    return row


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"4096x12288,2048x6144"`` -> ``((4096, 12288), (2048, 6144))``."""
    out = []
    for item in text.split(","):
        n, _, k = item.strip().partition("x")
        if not (n.isdigit() and k.isdigit()):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not NxK, e.g. 4096x12288")
        out.append((int(n), int(k)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, help="NxK,NxK,...")
    parser.add_argument("--ms", type=lambda s: tuple(int(v) for v in s.split(",")),
                        default=DEFAULT_MS, help="M,M,...")
    parser.add_argument("--table", type=Path, default=None,
                        help="table file to use instead of the device's")
    args = parser.parse_args(argv)
    if args.table is not None:
        tables.set_device_table(tables.load_table(args.table))
    device = torch.cuda.get_device_name()
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)  # initialise cuBLAS before any graph capture
    torch.cuda.synchronize()
    rows = []
    for n, k in args.shapes:
        for m in args.ms:
            row = compare_shape(n, k, m)
            print(json.dumps({key: (round(v, 5) if isinstance(v, float) else v)
                              for key, v in row.items() if key != "table_config"}), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()  # the weight copies of this row are garbage now
    table = tables.resolve_device_table(device)
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    doc = {"schema": SCHEMA, "provenance": gpu_provenance(0, command),
           "table": table.source if table is not None else "none (default configuration)",
           "gpu": device, "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fused_compare_{tables.device_slug(device)}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
