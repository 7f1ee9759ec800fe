#!/usr/bin/env python3
"""Driver for one device command: check, sweep (chunked), probe and bench on the lent GPU.

The device image has torch and triton but not bistat; run from the repository root with
``bistat_kernels`` on the path (the folder ``kernels/`` holds the package), e.g.::

    PYTHONPATH=kernels python3 kernels/device/gpu_call.py all --out "$OUT" --budget-s 360

Stages (``all`` runs check, sweep, probe and bench in this order, each only while the time budget
lasts): ``check`` (gates on ragged shapes in every dtype, split-K parallel and fused, bias, fused
== parallel bitwise, torch.compile + CUDA graph through the plugin's custom op, also with a table
that switches to fused split-K above M = 4), ``sweep`` (resumes from
``kernels/bistat_kernels/tables`` and ``kernels/results``), ``buckets`` (not in ``all``: re-tunes
the committed table's buckets from ``--min-m`` up (to ``--retune-max-m``) with each shape's
layout kept, every candidate of :func:`bistat_kernels.sweep.launch_candidates` and the present
launch timed side by side; writes the table under ``--out``, where probe and bench then read it), ``probe`` (both gates on every entry
of the table) and ``bench``. Every stage writes JSON under ``--out``; the Triton cache is packed
there too so that the next command compiles nothing.
Triton's cache folder and ptxas are pinned first (:func:`bistat_kernels.sweep.pin_triton_toolchain`),
so that the check stage's ``torch.compile`` cannot make the sweep's precompiled kernels unfindable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bistat_kernels import bench, probe, sweep, tables
from bistat_kernels import matmul_persistent as mp
from bistat_kernels.provenance import gpu_provenance
from bistat_kernels.shapes import MODEL_SHAPES, shapes_for

ROOT = Path(__file__).resolve().parents[2]
CACHE_TGZ = ROOT / ".cache" / "bistat_kernels" / "triton_cache.tgz"
MODELS = ("qwen3-8b", "qwen3-1.7b", "smollm2-135m")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _compiled_path_check(op, w: torch.Tensor, xs: torch.Tensor) -> dict:
    """torch.compile (dynamic M) + CUDA graph through the custom op, against eager, bitwise."""
    res: dict = {}

    def layer(x):  # x2 is exact in bf16, so compiled and eager must agree bitwise
        return op(x, w.t(), None) * 2

    f = torch.compile(layer, fullgraph=True, dynamic=True)
    outs = {m: f(xs[:m]) for m in (1, 7, 64)}
    eager = {m: mp.matmul_persistent(xs[:m], w.t()) * 2 for m in outs}
    res["compile_equal_eager"] = all(torch.equal(outs[m], eager[m]) for m in outs)
    res["compile_row_invariant"] = bool(torch.equal(outs[7][3], outs[64][3])
                                        and torch.equal(outs[1][0], outs[64][0]))
    static = xs[:8].clone()
    g = torch.cuda.CUDAGraph()
    f(static)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        gout = f(static)
    static.copy_(xs[8:16])
    g.replay()
    torch.cuda.synchronize()
    res["cuda_graph_replay_equal"] = bool(torch.equal(gout, eager[64][8:16]))
    return res


FUSED_CHECK_PARALLEL_MAX_M = 4  # the fused-table check: parallel split-K up to here, fused above


def _fused_check_table(device: str) -> tables.GemmTable:
    """A table for (bf16, 4096, 2048): split-K 2, parallel at M <= 4 and fused above."""
    buckets = (tables.BucketConfig(FUSED_CHECK_PARALLEL_MAX_M, 16, 64, 8, 4, 4),
               tables.BucketConfig(16, 16, 64, 8, 4, 4, fuse_splits=True),
               tables.BucketConfig(4096, 64, 128, 8, 4, 3, fuse_splits=True))
    entry = tables.ShapeConfig("bfloat16", 4096, 2048, 128, 2, buckets,
                               provenance={"command": "kernels/device/gpu_call.py check"})
    return tables.GemmTable(device, {("bfloat16", 4096, 2048): entry}, "gpu_call fused check")


def stage_check(out: Path) -> bool:
    """Gates on small ragged shapes with several configs per dtype, and the compiled path."""
    results = []
    ok = True
    configs = [tables.GemmConfig(16, 32, 64, 8, 4, 4, 1),
               tables.GemmConfig(64, 128, 128, 8, 4, 3, 1),
               tables.GemmConfig(128, 128, 64, 8, 8, 3, 1),
               tables.GemmConfig(16, 64, 128, 8, 4, 4, 2),
               tables.GemmConfig(32, 64, 128, 8, 4, 4, 3),
               tables.GemmConfig(16, 64, 128, 8, 4, 4, 2, fuse_splits=True),
               tables.GemmConfig(64, 128, 128, 8, 4, 3, 3, fuse_splits=True)]
    plan = [(torch.bfloat16, n, k, bias, cfg) for n, k, bias in
            ((1000, 1000, False), (4096, 2048, False), (576, 1536, True)) for cfg in configs]
    # (configs[6] needs more shared memory than fp32 has room for at 3 stages)
    plan += [(dtype, 1000, 1000, True, cfg) for dtype in (torch.float16, torch.float32)
             for cfg in (configs[0], configs[4], configs[5])]
    for dtype, n, k, bias, cfg in plan:
        fn = (lambda a, b, bb, c=cfg: mp.matmul_persistent(a, b, bb, config=c))
        res = probe.probe_shape(n, k, dtype, "cuda", None, max_m=1024,
                                accuracy_ms=(1, 255, 1024), with_bias=bias, mm=fn)
        d = res.to_dict()
        d["config"] = cfg.__dict__
        results.append(d)
        ok &= res.passed
        if not res.passed:
            log(f"check FAILED {dtype} N={n} K={k} {cfg}: {json.dumps(d)[:600]}")
    # Fused split-K equals parallel split-K bit for bit (same layout, with bias, ragged M).
    fused_equal = []
    fused_error = None
    try:
        gen = torch.Generator(device="cuda").manual_seed(7)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for n, k, split in ((1000, 1000, 3), (576, 1536, 2), (4096, 2048, 2)):
                a = torch.randn(1031, k, device="cuda", dtype=dtype, generator=gen)
                w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.05
                bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
                par = tables.GemmConfig(32, 64, 128, 8, 4, 4, split)
                fused_configs = [tables.GemmConfig(16, 64, 128, 8, 4, 4, split, fuse_splits=True)]
                if dtype != torch.float32:
                    fused_configs.append(tables.GemmConfig(64, 128, 128, 8, 4, 3, split,
                                                           fuse_splits=True))
                for m in (1, 17, 1031):
                    for bb in (None, bias):
                        expected = mp.matmul_persistent(a[:m], w.t(), bb, config=par)
                        fused_equal.extend(
                            bool(torch.equal(mp.matmul_persistent(a[:m], w.t(), bb, config=fus),
                                             expected)) for fus in fused_configs)
    except Exception as exc:  # noqa: BLE001 - recorded and reported, the stage fails
        fused_error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    ok &= fused_error is None and all(fused_equal)
    log(f"check: {sum(r['passed'] for r in results)}/{len(results)} gate runs passed; fused == "
        f"parallel split-K bitwise in {sum(fused_equal)}/{len(fused_equal)} comparisons")
    # The compiled path: torch.compile (dynamic M) + CUDA graphs through the plugin's custom op,
    # with the device's table, then with a table that switches to fused split-K above M = 4.
    compiled: dict = {}
    try:
        from bistat_kernels import vllm_plugin
        op = vllm_plugin.tuned_matmul_op()
        w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
        compiled.update(_compiled_path_check(op, w, xs))
        compiled["op_calls"] = {str(k): v for k, v in vllm_plugin.CALLS.items()}
        fused_table = _fused_check_table(torch.cuda.get_device_name(0))
        tables.set_device_table(fused_table)
        try:
            fused = _compiled_path_check(op, w, xs)
        finally:
            tables.reset_device_table()
        entry = fused_table.entries[("bfloat16", 4096, 2048)]
        fused["parallel_max_m"] = FUSED_CHECK_PARALLEL_MAX_M
        fused["configs"] = {str(m): entry.config_for(m).__dict__ for m in (1, 7, 8, 64)}
        compiled["fused_table"] = fused
    except Exception as exc:  # noqa: BLE001 - recorded and reported, the stage fails
        compiled["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    checks = ("compile_equal_eager", "compile_row_invariant", "cuda_graph_replay_equal")
    ok &= all(compiled.get(k) is True for k in checks)
    ok &= all(compiled.get("fused_table", {}).get(k) is True for k in checks)
    log(f"check compiled path: {compiled}")
    write(out / "check_gpu.json", {"provenance": gpu_provenance(0), "passed": ok,
                                   "gates": results, "fused_equals_parallel": fused_equal,
                                   **({"fused_error": fused_error} if fused_error else {}),
                                   "compiled": compiled})
    return ok


def stage_sweep(out: Path, budget_s: float, workers: int, retune: bool) -> dict:
    device = torch.cuda.get_device_name(0)
    slug = tables.device_slug(device)
    if retune:
        # A re-tune spread over several commands on one warm machine resumes from what the
        # earlier commands wrote under --out (keep --out outside $OUT, which starts empty).
        resume, resume_raw = out / f"{slug}.json", out / f"sweep_raw_{slug}.json"
    else:
        resume = ROOT / "kernels" / "bistat_kernels" / "tables" / f"{slug}.json"
        resume_raw = ROOT / "kernels" / "results" / f"sweep_raw_{slug}.json"
    res = sweep.run_sweep(
        shapes_for(MODELS), out, resume_table=resume, resume_raw=resume_raw, budget_s=budget_s,
        precompile_workers=workers, command=sys.argv, progress=log)
    log(f"sweep: {json.dumps(res)}")
    fallback = ROOT / "kernels" / "bistat_kernels" / "tables" / f"{slug}.json"
    fresh_path = Path(res["table"])
    if res["missing"] and fallback.is_file() and fresh_path.is_file():
        # Shapes this command could not re-tune keep their entry from the previous table
        # (each entry carries its own provenance, so the table says which command measured it).
        fresh = tables.load_table(fresh_path).entries
        for key, entry in tables.load_table(fallback).entries.items():
            fresh.setdefault(key, entry)
        write(fresh_path, tables.table_to_dict(device, list(fresh.values())))
        log(f"sweep: kept {len(res['missing'])} entries from {fallback}")
        res["missing"] = []
    return res


def _table_path(out: Path) -> Path:
    slug = tables.device_slug(torch.cuda.get_device_name(0))
    fresh = out / f"{slug}.json"
    return fresh if fresh.is_file() else ROOT / "kernels" / "bistat_kernels" / "tables" / f"{slug}.json"


def stage_probe(out: Path, max_m: int) -> bool:
    table = tables.load_table(_table_path(out))
    tables.set_device_table(table)
    # every table entry, then the edge cases: K a power of two (vLLM #55131) and float32
    # in IEEE precision (vLLM #55466), each probed with its own table entry or the default
    cases = probe.with_edge_cases([probe.ProbeCase(n, k, dt)
                                   for (dt, n, k) in sorted(table.entries)])

    def progress(case: probe.ProbeCase, res: probe.ShapeProbe) -> None:
        log(f"probe: {case.case} {case.dtype} N={case.n} K={case.k} invariance "
            f"{res.invariance.rows_equal}/{res.invariance.rows_checked} accuracy "
            + " ".join(f"M={r.m}:{r.max_rel_err:.2e}(mm {r.torch_mm_max_rel_err:.2e})"
                       for r in res.accuracy) + (" PASS" if res.passed else " FAIL"))

    results = probe.probe_cases(cases, table, "cuda", max_m, report=progress)
    slug = tables.device_slug(table.device_name)
    write(out / f"probe_{slug}.json",
          probe.probe_document(results, table, gpu_provenance(0, sys.argv)))
    return all(r.passed for r in results)


def stage_bench(out: Path, vllm_kernel_path: Path | None = None, shapes: list | None = None,
                reverse: bool = False, empty_cache: bool = False) -> dict:
    """Bench the table in ``out`` (``shapes``: the models' shapes or a selection of them, in the
    models' order or ``reverse``d; ``empty_cache``: see ``bench.run_bench``)."""
    table = tables.load_table(_table_path(out))
    tables.set_device_table(table)
    vllm_kernel = None
    if vllm_kernel_path is not None:
        from bistat_kernels import vllm_kernel as vk

        vllm_kernel = vk.load_vllm_kernel(vllm_kernel_path)
    shapes = list(shapes_for(MODELS) if shapes is None else shapes)
    doc = bench.run_bench(shapes[::-1] if reverse else shapes, command=sys.argv, progress=log,
                          vllm_kernel=vllm_kernel, empty_cache=empty_cache)
    write(out / f"bench_{tables.device_slug(table.device_name)}.json", doc)
    log(f"bench summary: {json.dumps(doc['summary'])}")
    return doc["summary"]


HOSTCOST_SHAPES = (("qwen3-8b", "qkv"), ("qwen3-8b", "o"), ("qwen3-8b", "down"),
                   ("smollm2-135m", "qkv"))
HOSTCOST_MS = (1, 16, 256)


def stage_hostcost(out: Path) -> dict:
    """Host time per eager call: torch.mm, the tuned launcher through Triton's JIT path and
    directly, and the vLLM plugin's operator; every direct launch checked bitwise first."""
    from bistat_kernels import host_cost, vllm_plugin

    table = tables.load_table(_table_path(out))
    tables.set_device_table(table)
    op = vllm_plugin.tuned_matmul_op()
    shapes = {(s.model, s.layer): s for s in shapes_for(MODELS)}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for key in HOSTCOST_SHAPES:
        shape = shapes[key]
        w = torch.randn(shape.n, shape.k, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = w.t()
        for m in HOSTCOST_MS:
            a = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16, generator=gen)
            mp.set_fast_launch(False)
            slow = mp.matmul_persistent(a, b)
            mp.set_fast_launch(True)
            mp.matmul_persistent(a, b)  # the first launch of its kind: through Triton
            fast = mp.matmul_persistent(a, b)
            same = bool(torch.equal(slow, fast))
            row = {"model": shape.model, "layer": shape.layer, "n": shape.n, "k": shape.k, "m": m,
                   "direct_equals_jit_bitwise": same}
            # torch.mm, the direct launch and the plugin's operator side by side (runs
            # interleaved); Triton's JIT path after them (the direct path off for the process)
            times = host_cost.side_by_side_us({"torch_mm": lambda: torch.mm(a, b),
                                               "tuned_direct": lambda: mp.matmul_persistent(a, b),
                                               "plugin_op": lambda: op(a, b, None)})
            mp.set_fast_launch(False)
            times["tuned_jit"] = host_cost.per_call_us(lambda: mp.matmul_persistent(a, b))
            mp.set_fast_launch(True)
            for name, (enqueue, wall) in times.items():
                row[f"{name}_enqueue_us"], row[f"{name}_wall_us"] = round(enqueue, 2), round(wall, 2)
            rows.append(row)
            log("hostcost: " + json.dumps(row))
    doc = {"schema": "bistat_kernels.host_cost/1", "provenance": gpu_provenance(0, sys.argv),
           "table": table.source, "method": host_cost.__doc__.strip(), "rows": rows}
    write(out / f"host_cost_{tables.device_slug(table.device_name)}.json", doc)
    return doc


def pack_cache(out: Path, cache_dir: Path) -> None:
    if not cache_dir.is_dir():
        return
    target = out / "triton_cache.tgz"
    with tarfile.open(target, "w:gz") as tar:
        tar.add(cache_dir, arcname="cache")
    if target.stat().st_size > 15 * 2**20:
        log(f"triton cache {target.stat().st_size / 2**20:.1f} MiB is too large to return; dropped")
        target.unlink()


def _shape_list(text: str) -> list[tuple[int, int]]:
    """``"576x1536,2048x6144"`` -> ``[(576, 1536), (2048, 6144)]`` (argparse type)."""
    out = []
    for item in text.split(","):
        n, sep, k = item.strip().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise argparse.ArgumentTypeError(   # argparse prefixes the option's name
                f"{item.strip()!r} is not NxK (e.g. 576x1536); give weight shapes as "
                f"N x K separated by commas")
        out.append((int(n), int(k)))
    return out


def _selected_shapes(wanted: list[tuple[int, int]] | None, option: str = "--shapes") -> list:
    """The models' shapes, or those of them named by ``option`` (each must be one of them)."""
    shapes = shapes_for(MODELS)
    if wanted is None:
        return shapes
    known = {(s.n, s.k) for s in shapes}
    unknown = [f"{n}x{k}" for n, k in wanted if (n, k) not in known]
    if unknown:
        raise SystemExit(f"{option}: {', '.join(unknown)} is not a shape of {', '.join(MODELS)}; "
                         f"known: {', '.join(f'{n}x{k}' for n, k in sorted(known))}")
    wanted_set = set(wanted)
    return [s for s in shapes if (s.n, s.k) in wanted_set]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="+", choices=("check", "hostcost", "sweep", "buckets",
                                                       "probe", "bench", "all"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=360.0, help="whole-command budget")
    parser.add_argument("--workers", type=int, default=16, help="precompile processes")
    parser.add_argument("--max-m", type=int, default=4096)
    parser.add_argument("--pack-cache", action="store_true")
    parser.add_argument("--vllm-kernel", type=Path, default=None,
                        help="vLLM's batch-invariant GEMM (package dir or its module) as a bench column")
    parser.add_argument("--min-m", type=int, default=256,
                        help="buckets: re-tune the committed table's buckets from this M up")
    parser.add_argument("--retune-max-m", type=int, default=None,
                        help="buckets: ... and up to this M (default: every larger bucket)")
    parser.add_argument("--shapes", type=_shape_list, default=None,
                        help="buckets: only these weight shapes, as NxK[,NxK...] (default: all)")
    parser.add_argument("--bench-shapes", type=_shape_list, default=None,
                        help="bench: only these weight shapes (default: all; --shapes is the "
                             "re-tune's alone, so a re-tune's bench still covers the goal set)")
    parser.add_argument("--reverse", action="store_true",
                        help="bench: the shapes in reverse order")
    parser.add_argument("--empty-cache", action="store_true",
                        help="bench: torch.cuda.empty_cache() before each shape")
    parser.add_argument("--retune", action="store_true",
                        help="re-tune every shape; shapes not reached keep the committed table's entry")
    args = parser.parse_args()
    # named shapes checked before anything runs
    bench_shapes = (None if args.bench_shapes is None
                    else _selected_shapes(args.bench_shapes, "--bench-shapes"))
    t0 = time.monotonic()
    # Before anything compiles: the check stage's torch.compile would otherwise re-point
    # TRITON_PTXAS_PATH / TRITON_CACHE_DIR and the sweep's precompiled kernels would be missed.
    toolchain = sweep.pin_triton_toolchain()
    args.out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(toolchain["TRITON_CACHE_DIR"])
    if CACHE_TGZ.is_file():
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(CACHE_TGZ) as tar:
            tar.extractall(tmp, filter="data")  # the archive holds one folder named "cache"
            shutil.copytree(Path(tmp) / "cache", cache_dir, dirs_exist_ok=True)
        log(f"restored Triton cache from {CACHE_TGZ}")
    stages = ("check", "sweep", "probe", "bench") if "all" in args.stages else args.stages
    log(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, models "
        f"{', '.join(MODELS)} ({sum(len(MODEL_SHAPES[m]) for m in MODELS)} shapes); "
        f"Triton toolchain pinned: {json.dumps(toolchain)}")
    status = 0
    sweep_complete = True
    for stage in stages:
        left = args.budget_s - (time.monotonic() - t0)
        try:
            if stage == "check" and left > 50:
                status |= 0 if stage_check(args.out) else 1
            elif stage == "hostcost" and left > 40:
                stage_hostcost(args.out)
            elif stage == "sweep":
                res = stage_sweep(args.out, left - 60, args.workers, args.retune)
                sweep_complete = not res["missing"]
            elif stage == "buckets":
                res = sweep.run_retune_buckets(
                    _selected_shapes(args.shapes), _table_path(args.out), args.out,
                    min_m=args.min_m, max_m=args.retune_max_m, budget_s=left - 100,
                    precompile_workers=args.workers, command=sys.argv, progress=log)
                log(f"buckets: {json.dumps(res)}")
            elif stage == "probe" and sweep_complete and left > 60:
                status |= 0 if stage_probe(args.out, args.max_m) else 1
            elif stage == "bench" and sweep_complete and left > 45:
                stage_bench(args.out, args.vllm_kernel, bench_shapes, reverse=args.reverse,
                            empty_cache=args.empty_cache)
            else:
                log(f"{stage}: skipped (sweep complete={sweep_complete}, {left:.0f}s left)")
        except Exception:  # noqa: BLE001 - keep going so the files written so far come back
            traceback.print_exc()
            status |= 2
        log(f"after {stage}: {time.monotonic() - t0:.0f}s")
    if args.pack_cache:
        pack_cache(args.out, cache_dir)
    return status


if __name__ == "__main__":
    sys.exit(main())
