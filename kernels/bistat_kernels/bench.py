"""Tuned kernel vs torch.mm (cuBLAS) vs the fixed default (vs vLLM 0.33.0's kernel), side by side.

One process, one GPU: for every shape and M the kernels are validated against a float32
reference first (STYLE §6: validate before timing), then timed in the order tuned, torch.mm,
default (, vllm) with :func:`bistat_kernels.timing.graph_time_ms` (CUDA-graph replays over weight
copies that exceed the L2 cache: decode steps run as graph replays in vLLM, without Python launch
cost). With ``vllm_kernel`` (:mod:`bistat_kernels.vllm_kernel`) vLLM's own batch-invariant GEMM
and its tuned table run as a fourth column, gated like ours (accuracy before timing, bitwise
row invariance across the bench's batch sizes).

Beside the graph timing, the document carries:

- ``roofline``: at M <= :data:`ROOFLINE_MAX_M`, each kernel's weight bytes / time as a fraction
  of the copy bandwidth measured in the same run (:func:`copy_bandwidth`, a device-to-device copy
  of :data:`COPY_BYTES`, read + written bytes over its time): how close a decode GEMM comes to
  streaming its weight once at the speed HBM delivers.
- ``host``: host cost per call in eager mode, the path vLLM takes above its CUDA-graph sizes:
  :data:`HOST_CALLS` back-to-back calls from Python at M in :data:`HOST_MS`, no CUDA graph,
  synchronised only before and after, the operators' runs interleaved. ``*_us`` is the Python
  loop's time per call before the final synchronisation; the calls are few enough that the
  launch queue never fills, so that is the host's cost however long the kernels run; ``*_wall_us`` includes the wait for the GPU.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bistat_kernels import matmul_persistent as mp
from bistat_kernels import timing
from bistat_kernels.probe import ACCURACY_TOLERANCE, reference_mm
from bistat_kernels.shapes import GemmShape

SCHEMA = "bistat_kernels.bench/1"
BENCH_MS: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 256, 1024, 4096)
GOAL_MS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)  # the geometric-mean set
DECODE_MAX_M = 32
# The goals: tuned / torch.mm over GOAL_MS, and at M <= DECODE_MAX_M (the earlier goals were 1.15
# and 1.25; RESULTS.md keeps them for bench files that carry no goal_targets).
GOAL_OVERALL = 1.05
GOAL_DECODE = 1.00
ROOFLINE_MAX_M = 16
COPY_BYTES = 2 * 2**30  # the bandwidth copy: at least 2 GiB, far beyond the L2 cache
HOST_MS: tuple[int, ...] = (1, 16)
HOST_CALLS = 200  # <= 2 kernels a call: the launch queue (about 1024 entries) never fills
HOST_REPEATS = 9
HOST_GOAL_US = 5.0  # tuned - torch.mm host cost per call


@dataclass(frozen=True)
class BenchRow:
    """One (shape, M): median times in ms and their ratios."""

    model: str
    layer: str
    n: int
    k: int
    m: int
    tuned_ms: float
    torch_mm_ms: float
    default_ms: float
    tuned_max_rel_err: float
    vllm_ms: float | None = None  # vLLM's kernel; None without one, or when it failed validation
    vllm_max_rel_err: float | None = None
    vllm_tuned: bool | None = None  # (N, K) is in vLLM's own table for this GPU's family

    @property
    def tuned_over_mm(self) -> float:
        return self.tuned_ms / self.torch_mm_ms

    @property
    def default_over_mm(self) -> float:
        return self.default_ms / self.torch_mm_ms

    @property
    def vllm_over_mm(self) -> float | None:
        return None if self.vllm_ms is None else self.vllm_ms / self.torch_mm_ms

    def to_dict(self, with_vllm: bool) -> dict[str, Any]:
        """The JSON row; the vllm fields only when the bench had vLLM's kernel."""
        d = asdict(self)
        if not with_vllm:
            for key in ("vllm_ms", "vllm_max_rel_err", "vllm_tuned"):
                del d[key]
        d.update(tuned_over_mm=self.tuned_over_mm, default_over_mm=self.default_over_mm)
        if with_vllm:
            d["vllm_over_mm"] = self.vllm_over_mm
        return d


def geomean(values: Sequence[float]) -> float:
    """Geometric mean; NaN for an empty sequence."""
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: Sequence[BenchRow], with_vllm: bool = False) -> dict[str, Any]:
    """Geometric means of the ratios over the goal set and the decode rows, against the goals.

    With ``with_vllm``, vLLM's kernel's own geometric means too, over the rows where it was timed
    (``n_vllm_rows`` of ``n_rows``; a row it failed validation in has no time), and tuned / vllm
    over the same rows.
    """
    goal = [r for r in rows if r.m in GOAL_MS]
    decode = [r for r in rows if r.m <= DECODE_MAX_M]
    overall = geomean([r.tuned_over_mm for r in goal])
    decode_gm = geomean([r.tuned_over_mm for r in decode])
    out: dict[str, Any] = {
        "goal_ms": list(GOAL_MS),
        "geomean_tuned_over_mm": overall,
        "geomean_default_over_mm": geomean([r.default_over_mm for r in goal]),
        "decode_max_m": DECODE_MAX_M,
        "decode_geomean_tuned_over_mm": decode_gm,
        "decode_geomean_default_over_mm": geomean([r.default_over_mm for r in decode]),
        "decode_speedup_over_default": geomean([r.default_ms / r.tuned_ms for r in decode]),
        "goal_targets": {"overall": GOAL_OVERALL, "decode": GOAL_DECODE},
        "goal_overall_met": overall <= GOAL_OVERALL,
        "goal_decode_met": decode_gm <= GOAL_DECODE,
        "n_rows": len(rows),
    }
    if with_vllm:
        vgoal = [r for r in goal if r.vllm_ms is not None]
        vdecode = [r for r in decode if r.vllm_ms is not None]
        out.update({
            "geomean_vllm_over_mm": geomean([r.vllm_over_mm for r in vgoal]),
            "decode_geomean_vllm_over_mm": geomean([r.vllm_over_mm for r in vdecode]),
            "geomean_tuned_over_vllm": geomean([r.tuned_ms / r.vllm_ms for r in vgoal]),
            "decode_geomean_tuned_over_vllm": geomean([r.tuned_ms / r.vllm_ms for r in vdecode]),
            "n_vllm_rows": sum(r.vllm_ms is not None for r in rows),
        })
    return out


def roofline_rows(rows: Sequence[BenchRow], copy_gb_per_s: float, element_size: int = 2,
                  max_m: int = ROOFLINE_MAX_M) -> list[dict[str, Any]]:
    """Per row at M <= ``max_m``: weight bytes / time over the copy bandwidth, per kernel.

    ``copy_gb_per_s`` is :func:`copy_bandwidth`'s read + written bytes per second / 1e9.
    """
    out = []
    for r in rows:
        if r.m > max_m:
            continue
        weight = r.n * r.k * element_size

        def frac(ms: float | None, weight: int = weight) -> float | None:
            return None if ms is None else weight / (ms * 1e-3) / (copy_gb_per_s * 1e9)

        d = {"model": r.model, "layer": r.layer, "n": r.n, "k": r.k, "m": r.m,
             "weight_bytes": weight, "tuned": frac(r.tuned_ms), "torch_mm": frac(r.torch_mm_ms)}
        if r.vllm_ms is not None:
            d["vllm"] = frac(r.vllm_ms)
        out.append(d)
    return out


def host_summary(host_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and largest tuned - torch.mm host cost per call (us) against :data:`HOST_GOAL_US`."""
    diffs = [r["tuned_us"] - r["torch_mm_us"] for r in host_rows]
    out: dict[str, Any] = {
        "goal_us": HOST_GOAL_US,
        "mean_tuned_minus_mm_us": statistics.fmean(diffs) if diffs else float("nan"),
        "max_tuned_minus_mm_us": max(diffs) if diffs else float("nan"),
        "mean_tuned_us": statistics.fmean(r["tuned_us"] for r in host_rows) if diffs
        else float("nan"),
        "mean_torch_mm_us": statistics.fmean(r["torch_mm_us"] for r in host_rows) if diffs
        else float("nan"),
    }
    out["goal_met"] = bool(diffs) and out["max_tuned_minus_mm_us"] <= HOST_GOAL_US  # every shape
    vllm = [r["vllm_us"] for r in host_rows if r.get("vllm_us") is not None]
    if vllm:
        out["mean_vllm_us"] = statistics.fmean(vllm)
    return out


def _time(fn: Callable[[torch.Tensor], Any], b_copies: Sequence[torch.Tensor]) -> float:
    fn(b_copies[0])  # compile / create handles outside the capture
    return timing.graph_time_ms([lambda bb=bb: fn(bb) for bb in b_copies])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy of ``nbytes``: median time and (read + written bytes) / time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "median_ms": ms, "gb_per_s": 2 * nbytes / (ms * 1e-3) / 1e9,
            "counted": "bytes read + bytes written per copy", "repeats": repeats}


def host_cost_us(fns: dict[str, Callable[[], Any]], calls: int = HOST_CALLS,
                 repeats: int = HOST_REPEATS) -> dict[str, tuple[float, float]]:
    """name -> (host us per call, wall us per call) of ``calls`` back-to-back eager calls of each
    operator, their runs interleaved (:func:`bistat_kernels.host_cost.side_by_side_us`); medians."""
    from bistat_kernels.host_cost import side_by_side_us

    return side_by_side_us(fns, calls, repeats, warmup=10)


def _invariance(a_big: torch.Tensor, b: torch.Tensor, ms: Sequence[int],
                mm: Callable[..., torch.Tensor]) -> dict[str, Any]:
    from bistat_kernels.probe import check_invariance

    r = check_invariance(a_big, b, None, ms, mm)
    return {"rows_checked": r.rows_checked, "rows_equal": r.rows_equal, "passed": r.passed,
            "mismatches": [list(x) for x in r.mismatches]}


@dataclass
class ShapeBench:
    """One shape's rows, its gates and its host costs."""

    rows: list[BenchRow]
    gates: dict[str, Any]
    host: list[dict[str, Any]]


def bench_shape(shape: GemmShape, ms: Sequence[int], dtype: torch.dtype = torch.bfloat16,
                seed: int = 0, vllm_kernel: Any = None, vllm_shapes: frozenset = frozenset(),
                host_ms: Sequence[int] = HOST_MS) -> ShapeBench:
    """Validate, then time tuned / torch.mm / default (/ vllm) for one shape at every M in ``ms``.

    The tuned kernel failing validation stops the bench; vLLM's kernel failing it (or raising)
    leaves that row's vllm time empty and says why in ``vllm_accuracy_failures`` of the gates.
    Both kernels' rows are then checked for bitwise row invariance across ``ms``, and the host
    cost per eager call is measured at ``host_ms``.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape.n, shape.k, device="cuda", dtype=dtype, generator=gen) * 0.02  # [N, K]
    b = w.t()  # [K, N]
    b_copies = [c.t() for c in timing.weight_copies(w)]
    a_big = torch.randn(max(ms), shape.k, device="cuda", dtype=dtype, generator=gen)
    tol = ACCURACY_TOLERANCE[dtype]
    gates: dict[str, Any] = {"model": shape.model, "layer": shape.layer, "n": shape.n,
                             "k": shape.k, "m_values": list(ms)}
    vllm_errors: list[str] = []
    rows = []
    for m in ms:
        a = a_big[:m]
        ref = reference_mm(a, b, None)
        err = _rel_err(mp.matmul_persistent(a, b), ref)
        if not (math.isfinite(err) and err <= tol):
            raise RuntimeError(f"bench: tuned kernel failed validation at {shape.model}/"
                               f"{shape.layer} M={m}: relative error {err:.3g}")
        verr, vllm_failure = None, None
        if vllm_kernel is not None:
            try:
                verr = _rel_err(vllm_kernel.mm(a, b), ref)
            except Exception as exc:  # upstream's kernel failing is a result, not a crash
                vllm_failure = f"M={m}: {type(exc).__name__}: {exc}"
            else:
                if not (math.isfinite(verr) and verr <= tol):
                    vllm_failure = f"M={m}: relative error {verr:.3g} > {tol}"
                    verr = verr if math.isfinite(verr) else None
        del ref
        tuned = _time(lambda bb: mp.matmul_persistent(a, bb), b_copies)
        cublas = _time(lambda bb: torch.mm(a, bb), b_copies)
        default = _time(lambda bb: mp.default_matmul(a, bb), b_copies)
        vllm_ms = None
        if vllm_kernel is not None:
            if vllm_failure is None:
                vllm_ms = _time(lambda bb: vllm_kernel.mm(a, bb), b_copies)
            else:
                vllm_errors.append(vllm_failure)
        rows.append(BenchRow(shape.model, shape.layer, shape.n, shape.k, m, tuned, cublas,
                             default, err, vllm_ms, verr,
                             None if vllm_kernel is None else (shape.n, shape.k) in vllm_shapes))
    gates["tuned_invariance"] = _invariance(a_big, b, ms, mp.matmul_persistent)
    if vllm_kernel is not None:
        timed = [r.m for r in rows if r.vllm_ms is not None]  # where it ran and was right
        gates["vllm_invariance"] = _invariance(a_big, b, timed, vllm_kernel.mm) if timed else \
            {"rows_checked": 0, "rows_equal": 0, "passed": False, "mismatches": []}
        gates["vllm_accuracy_failures"] = vllm_errors
    host = []
    for m in host_ms:
        a = a_big[:m]
        row: dict[str, Any] = {"model": shape.model, "layer": shape.layer, "n": shape.n,
                               "k": shape.k, "m": m}
        fns = {"tuned": lambda: mp.matmul_persistent(a, b), "torch_mm": lambda: torch.mm(a, b)}
        if vllm_kernel is not None and m in {r.m for r in rows if r.vllm_ms is not None}:
            fns["vllm"] = lambda: vllm_kernel.mm(a, b)
        for name, (host_us, wall_us) in host_cost_us(fns).items():
            row[f"{name}_us"], row[f"{name}_wall_us"] = host_us, wall_us
        row["tuned_minus_mm_us"] = row["tuned_us"] - row["torch_mm_us"]
        host.append(row)
    del b_copies
    return ShapeBench(rows, gates, host)


def run_bench(shapes: Sequence[GemmShape], ms: Sequence[int] = BENCH_MS,
              dtype: torch.dtype = torch.bfloat16, command: list[str] | None = None,
              progress: Callable[[str], None] = print, vllm_kernel: Any = None,
              host_ms: Sequence[int] = HOST_MS, empty_cache: bool = False) -> dict[str, Any]:
    """Bench every shape, in the order given; returns the JSON document (rows, summary,
    provenance, table, gates, roofline, host, allocator; ``vllm`` with vLLM's kernel's provenance
    when ``vllm_kernel`` is given).

    ``empty_cache``: hand PyTorch's cached blocks back to the driver before each shape
    (``torch.cuda.empty_cache``), so that where a shape's weight copies land does not depend on
    what the shapes before it left cached. The k13 bench (kernels/results/k13) read qwen3-8b
    ``lm_head`` at M = 1 8 % slower after a table whose previous shape held a 128 MiB split-K
    workspace, with its own launches unchanged; benching with and without this (and in another
    order) tells whether that was the allocator."""
    from bistat_kernels import tables
    from bistat_kernels.provenance import gpu_provenance

    from bistat_kernels.resolution import cuda_device_facts

    provenance = gpu_provenance(0, command)
    table = tables.resolve_device_table(cuda_device_facts(0))
    copy = copy_bandwidth()
    progress(f"bench: device-to-device copy {copy['gb_per_s']:.0f} GB/s "
             f"({copy['bytes'] / 2**30:.0f} GiB, read + write)")
    vllm_doc = None
    vllm_shapes: frozenset = frozenset()
    if vllm_kernel is not None:
        family = vllm_kernel.arch_family(torch.cuda.get_device_capability(0))
        vllm_shapes = vllm_kernel.tuned_shapes(family)
        vllm_doc = dict(vllm_kernel.provenance(), arch_family=family,
                        tuned_shapes=sorted(list(s) for s in vllm_shapes),
                        function="mm_batch_invariant")
    with_vllm = vllm_kernel is not None
    rows: list[BenchRow] = []
    gates: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    for shape in shapes:
        if empty_cache:
            gc.collect()
            torch.cuda.empty_cache()
        res = bench_shape(shape, ms, dtype, vllm_kernel=vllm_kernel, vllm_shapes=vllm_shapes,
                          host_ms=host_ms)
        rows.extend(res.rows)
        gates.append(res.gates)
        host.extend(res.host)
        line = " ".join(f"M={r.m}:{r.tuned_over_mm:.2f}/{r.default_over_mm:.2f}"
                        + (f"/{r.vllm_over_mm:.2f}" if r.vllm_over_mm is not None else "")
                        for r in res.rows)
        progress(f"bench: {shape.model}/{shape.layer} {line}")
    order = "tuned, torch.mm, default" + (", vllm" if with_vllm else "")
    doc: dict[str, Any] = {
        "schema": SCHEMA, "provenance": provenance, "dtype": mp.dtype_name(dtype),
        "table": table.source if table is not None else None,
        # which table served each shape's tuned column (bistat's, vLLM's, the fixed default)
        "served_by": {f"{s.n}x{s.k}": tables.shape_source(mp.dtype_name(dtype), s.n, s.k)
                      for s in shapes},
        "table_resolution": (tables.resolution().to_dict() if tables.resolution() is not None
                             else "set by the caller (--table)"),
        "timing": "CUDA-graph replays of back-to-back calls over weight copies exceeding "
                  f"{timing.L2_MULTIPLE}x the L2 cache, median per call; order {order}",
        "rows": [r.to_dict(with_vllm) for r in rows],
        "summary": summarize(rows, with_vllm),
        "gates": gates,
        "roofline": {"max_m": ROOFLINE_MAX_M, "copy": copy,
                     "rows": roofline_rows(rows, copy["gb_per_s"],
                                           torch.empty((), dtype=dtype).element_size())},
        "host": {"calls": HOST_CALLS, "repeats": HOST_REPEATS, "ms": list(host_ms),
                 "timing": "eager back-to-back calls from Python, no CUDA graph, synchronised "
                           "before and after; us = the loop's time per call before the final "
                           "synchronisation, wall_us including it; medians of the repeats",
                 "rows": host, "summary": host_summary(host)},
        "allocator": ("emptied before each shape (torch.cuda.empty_cache)" if empty_cache else
                      "kept across shapes (PyTorch's caching allocator)"),
    }
    if vllm_doc is not None:
        doc["vllm"] = vllm_doc
    return doc
