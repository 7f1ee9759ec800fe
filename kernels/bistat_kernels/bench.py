"""Tuned kernel vs torch.mm (cuBLAS) vs the fixed default configuration, side by side.

One process, one GPU: for every shape and M the three are validated against a float32
reference first (STYLE §6: validate before timing), then timed in the order tuned, torch.mm,
default with :func:`bistat_kernels.timing.graph_time_ms` (CUDA-graph replays over weight copies
that exceed the L2 cache: decode steps run as graph replays in vLLM, without Python launch cost).
"""

from __future__ import annotations

import math
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
GOAL_MS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)  # issue 5's geometric-mean set
DECODE_MAX_M = 32


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

    @property
    def tuned_over_mm(self) -> float:
        return self.tuned_ms / self.torch_mm_ms

    @property
    def default_over_mm(self) -> float:
        return self.default_ms / self.torch_mm_ms


def geomean(values: Sequence[float]) -> float:
    """Geometric mean; NaN for an empty sequence."""
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: Sequence[BenchRow]) -> dict[str, Any]:
    """Geometric means of the ratios over the goal set, the decode rows and all rows."""
    goal = [r for r in rows if r.m in GOAL_MS]
    decode = [r for r in rows if r.m <= DECODE_MAX_M]
    return {
        "goal_ms": list(GOAL_MS),
        "geomean_tuned_over_mm": geomean([r.tuned_over_mm for r in goal]),
        "geomean_default_over_mm": geomean([r.default_over_mm for r in goal]),
        "decode_max_m": DECODE_MAX_M,
        "decode_geomean_tuned_over_mm": geomean([r.tuned_over_mm for r in decode]),
        "decode_geomean_default_over_mm": geomean([r.default_over_mm for r in decode]),
        "decode_speedup_over_default": geomean([r.default_ms / r.tuned_ms for r in decode]),
        "goal_overall_le_1_15": geomean([r.tuned_over_mm for r in goal]) <= 1.15,
        "goal_decode_le_1_25": geomean([r.tuned_over_mm for r in decode]) <= 1.25,
        "n_rows": len(rows),
    }


def _time(fn: Callable[[torch.Tensor], Any], b_copies: Sequence[torch.Tensor]) -> float:
    fn(b_copies[0])  # compile / create handles outside the capture
    return timing.graph_time_ms([lambda bb=bb: fn(bb) for bb in b_copies])


def bench_shape(shape: GemmShape, ms: Sequence[int], dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> list[BenchRow]:
    """Validate, then time tuned / torch.mm / default for one shape at every M in ``ms``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape.n, shape.k, device="cuda", dtype=dtype, generator=gen) * 0.02  # [N, K]
    b = w.t()  # [K, N]
    b_copies = [c.t() for c in timing.weight_copies(w)]
    a_big = torch.randn(max(ms), shape.k, device="cuda", dtype=dtype, generator=gen)
    rows = []
    for m in ms:
        a = a_big[:m]
        ref = reference_mm(a, b, None)
        out = mp.matmul_persistent(a, b)
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        if not (math.isfinite(err) and err <= ACCURACY_TOLERANCE[dtype]):
            raise RuntimeError(f"bench: tuned kernel failed validation at {shape.model}/"
                               f"{shape.layer} M={m}: relative error {err:.3g}")
        del ref, out
        tuned = _time(lambda bb: mp.matmul_persistent(a, bb), b_copies)
        cublas = _time(lambda bb: torch.mm(a, bb), b_copies)
        default = _time(lambda bb: mp.default_matmul(a, bb), b_copies)
        rows.append(BenchRow(shape.model, shape.layer, shape.n, shape.k, m, tuned, cublas,
                             default, err))
    return rows


def run_bench(shapes: Sequence[GemmShape], ms: Sequence[int] = BENCH_MS,
              dtype: torch.dtype = torch.bfloat16, command: list[str] | None = None,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Bench every shape; returns the JSON document (rows, summary, provenance, table)."""
    from bistat_kernels import tables
    from bistat_kernels.provenance import gpu_provenance

    provenance = gpu_provenance(0, command)
    table = tables.resolve_device_table(torch.cuda.get_device_name(0))
    rows: list[BenchRow] = []
    for shape in shapes:
        shape_rows = bench_shape(shape, ms, dtype)
        rows.extend(shape_rows)
        progress(f"bench: {shape.model}/{shape.layer} " + " ".join(
            f"M={r.m}:{r.tuned_over_mm:.2f}/{r.default_over_mm:.2f}" for r in shape_rows))
    return {"schema": SCHEMA, "provenance": provenance, "dtype": mp.dtype_name(dtype),
            "table": table.source if table is not None else None,
            "timing": "CUDA-graph replays of back-to-back calls over weight copies exceeding "
                      f"{timing.L2_MULTIPLE}x the L2 cache, median per call; order tuned, "
                      "torch.mm, default",
            "rows": [dict(asdict(r), tuned_over_mm=r.tuned_over_mm,
                          default_over_mm=r.default_over_mm) for r in rows],
            "summary": summarize(rows)}
