"""Tune the batch-invariant GEMM per weight shape on the GPU and write a table with provenance.

Method, per weight shape ``(N, K)``:

1. *Reduction layout* (shape-wide): for each candidate ``(BLOCK_K, SPLIT_K)`` the best launch
   candidate is timed at the scoring sizes ``SCORE_MS``; the layout with the lowest
   decode-weighted geometric mean of ``time / torch.mm time`` (weights ``SCORE_WEIGHTS``) wins.
2. *Launch parameters* per M bucket: with that layout fixed, every launch candidate of the bucket
   is timed at the bucket's upper bound M, and the fastest one that passes both gates is kept.
   For split-K layouts the large and prefill buckets (M > 128) try every candidate three times,
   with the splits run by separate programs whose last one adds the partial sums (parallel), by
   one program, one split after another (fused), and by one program in one flat loop over its
   tiles' K-tiles (fused, ``flat_splits``): a launch choice per bucket that leaves the bits
   unchanged, so timing decides.
   Smaller buckets try the parallel form only (see ``FUSED_CLASSES``).

Both gates run on every candidate before it is timed: gate 1 compares rows of the candidate's
output bitwise with the same rows computed alone (M = 1) by a fixed canonical launch of the same
layout (always the parallel split-K form, so gate 1 also proves on the GPU that every kept fused
candidate equals the parallel mode bit for bit); gate 2 bounds the error against a float32 (no
TF32) reference. Timing is
:func:`bistat_kernels.timing.graph_time_ms`: CUDA-graph replays over weight copies that exceed the
L2 cache, median per call (no Python launch overhead, weights read from HBM).

The sweep is chunked and resumable: it writes the table and the raw measurements after every
shape, skips shapes already in the table it resumes from, and stops at a shape boundary when its
time budget would be exceeded, so that it fits 10-minute device commands.

Compilation happens before timing, in ``precompile`` worker processes that fill Triton's on-disk
cache; the timed process then only loads kernels. That works only while the workers and the timed
process agree on Triton's cache key, which includes the ptxas version. A ``torch.compile`` earlier
in the same process (the ``check`` stage of ``kernels/device/gpu_call.py``) lets Inductor set
``TRITON_PTXAS_PATH`` to torch's own ptxas and ``TRITON_CACHE_DIR`` to its own folder; workers
spawned afterwards inherit both, while the timed process keeps the ptxas version it cached at its
first compile, so no precompiled kernel is found and every candidate compiles again, one after
another, inside the timed loop. That is the reading of device call 10 (108.9 s for one shape
instead of 3.1 s, about 0.5 s per distinct launch: a compile, not a cache load) that fits its
log; that run recorded no per-candidate clock to confirm it.
:func:`pin_triton_toolchain`, called before anything compiles, fixes both variables for the whole
command. Every raw record carries ``first_launch_s``, the wall time of the candidate's first
launch, so a sweep that compiles in the timed loop shows it (``slow_first_launches`` per shape).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources
from bistat_kernels import matmul_persistent as mp
from bistat_kernels import tables
from bistat_kernels import timing
from bistat_kernels.precompile import pin_triton_toolchain, precompile
from bistat_kernels.probe import ACCURACY_TOLERANCE, reference_mm, row_positions
from bistat_kernels.shapes import GemmShape

_log = logging.getLogger("bistat_kernels.sweep")

RAW_SCHEMA = "bistat_kernels.sweep_raw/1"
BUCKETS: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SCORE_MS: tuple[int, ...] = (1, 16, 256, 4096)
SCORE_WEIGHTS: dict[int, float] = {1: 2.0, 16: 2.0, 256: 1.0, 4096: 1.0}  # decode-weighted
GROUP_M = 8

# Launch candidates per bucket class, as (BLOCK_M, BLOCK_N, num_warps, num_stages, programs per
# SM), built from products of a few values each (the Hopper rows of vLLM's
# batch_invariant_configs.py and the Triton tutorial's configs span these ranges). Small M wants
# narrow tiles and more programs (decode is weight-bandwidth-bound); configs whose shared memory
# exceeds the device's limit are skipped when launched ("out_of_resources" in the raw records).
# The last entries of "large" and "prefill" are small tiles with two programs per SM for narrow or
# short-K shapes (N <= 3072, K <= 1536), where 128-row tiles leave multiprocessors idle at M >= 512.
def _product(bms, bns, warps_stages, per_sm):
    return tuple((bm, bn, w, s, p) for bm in bms for bn in bns for w, s in warps_stages
                 for p in per_sm)


_LAUNCH_CANDIDATES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "decode": _product((16,), (32, 64, 128, 256), ((4, 4), (4, 6)), (1, 2)),
    "small": _product((16, 32), (32, 64, 128), ((4, 4), (4, 6)), (1, 2)),
    "mid": _product((32, 64), (64, 128, 256), ((4, 3), (4, 4), (8, 3)), (1,))
    + ((128, 128, 8, 3, 1), (128, 64, 4, 4, 1), (64, 64, 4, 4, 2)),
    "large": _product((64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 3)), (1,))
    + ((64, 64, 4, 4, 2), (64, 128, 4, 3, 2))
    + ((64, 64, 4, 5, 3), (128, 64, 4, 4, 2), (64, 128, 4, 4, 2), (128, 32, 4, 4, 2)),
    "prefill": _product((128,), (64, 128, 256), ((4, 3), (8, 3), (8, 4), (8, 2)), (1,))
    + ((256, 128, 8, 3, 1), (64, 64, 4, 4, 2), (64, 128, 4, 3, 2), (128, 64, 4, 4, 2),
       (64, 128, 4, 4, 1), (64, 256, 8, 3, 1))
    + ((64, 64, 4, 5, 3), (64, 128, 4, 4, 2), (128, 32, 4, 4, 2)),
}


# Bucket classes whose split-K candidates also come in the fused form. Fused split-K runs a tile's
# splits one after another in one program: it saves the workspace and the partials' round trip,
# which pays at prefill sizes, but gives up the extra parallelism split-K exists for at decode
# sizes.
# Measured on the H200: at M = 1 and 16 the best fused candidate of qwen3-8b/qkv (split-K 2) was
# 13 % and 4 % slower than the best parallel one, at M = 256 within 2 %, at M = 4096 17 % faster
# (kernels/results/call4_retune_partial/, device call 10, not adopted); for both split-K `down` shapes fused
# lost at M = 64 and 256 and won at 1024 and 4096 (kernels/results/fused_compare_nvidia_h200.json).
# Those were the nested form. The flat form (``flat_splits``) keeps the pipeline full across the
# split boundary, where the nested one drains it (17-37 % against split-K 1 at M = 4096 on the
# three split-K shapes, in the first sweep's raw records), so the large class (M 129-512) tries
# both forms too.
FUSED_CLASSES: tuple[str, ...] = ("large", "prefill")
# Bucket classes whose candidates also come with tensor-memory-accelerator loads (Hopper). The
# first sweep with them (M > 32, BLOCK_M >= 64; kernels/results/tma_sweep/) kept a descriptor form
# in 102 of the 105 buckets above M = 32 where it offered them; the decode sizes, bound by the
# weights' HBM traffic, now try them too.
TMA_CLASSES: tuple[str, ...] = ("decode", "small", "mid", "large", "prefill")
TMA_MIN_BLOCK_M = 16
# Bucket classes whose candidates also come with another BLOCK_K than the layout's, where it cuts
# K into the same split-K ranges (tables.split_ranges): the same sums in the same order (measured:
# kernels/device/block_k_check.py, 0 of 2,700 rows differing on the H200 over BLOCK_K 32-256 with
# mma.sync (BLOCK_M 16) and wgmma tiles; gate 1 checks every such candidate bitwise against the
# layout's canonical launch). A layout chosen for decode sizes (BLOCK_K 128) left prefill sizes
# 128x128 tiles, the largest whose three stages fit in shared memory; BLOCK_K 64 fits 128x256
# tiles, 1.17 -> 1.11x torch.mm at M in {256, 1024, 4096} over the twelve shapes whose layout is
# not BLOCK_K 64 (kernels/results/k10/, triton 3.6). Decode and small sizes are bound by the
# weights' HBM traffic: there BLOCK_K 256 halves the K-loop's iterations with loads twice as long
# (16-row tiles; (16 + BLOCK_N) x 256 x 2 B per stage, within the H200's 227 KiB at the stages
# given), and a BLOCK_K-64 layout gets 128: the M <= 32 re-tune with them took the decode set
# from 1.019 to 1.000x torch.mm on one H200 (kernels/results/k11/). The mid buckets (M 33-128)
# were the last without them (M = 64: 1.03-1.23x on eight of the 15 shapes, k11's bench); their
# tiles are the ones whose stages fit 227 KiB at BLOCK_K 256 ((BLOCK_M + BLOCK_N) x 256 x 2 B x
# stages).
FREE_BLOCK_K_CLASSES: tuple[str, ...] = ("decode", "small", "mid", "large", "prefill")
#: per bucket class: the BLOCK_K offered besides the layout's, and the tiles they come with
ALT_BLOCK_K: dict[str, tuple[int, ...]] = {
    "decode": (64, 128, 256), "small": (64, 128, 256), "mid": (64, 128, 256),
    "large": (64, 128), "prefill": (64, 128)}
_PREFILL_ALT_TILES = (
    (128, 256, 8, 3, 1), (128, 256, 8, 4, 1), (128, 128, 4, 4, 1), (128, 128, 8, 4, 1),
    (128, 128, 4, 5, 1), (64, 256, 4, 4, 1), (128, 64, 4, 5, 1))
_ALT_BLOCK_K_TILES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "decode": ((16, 32, 4, 6, 1), (16, 32, 4, 6, 2), (16, 64, 4, 4, 1), (16, 64, 4, 4, 2),
               (16, 128, 4, 3, 1)),
    "small": ((16, 64, 4, 4, 2), (32, 32, 4, 6, 1), (32, 64, 4, 4, 1), (32, 64, 4, 3, 2)),
    "mid": ((16, 64, 4, 4, 1), (32, 64, 4, 4, 1), (32, 64, 4, 3, 2), (64, 64, 4, 3, 1)),
    "large": _PREFILL_ALT_TILES, "prefill": _PREFILL_ALT_TILES}
SLOW_FIRST_LAUNCH_S = 0.25  # a first launch slower than this compiled in the timed process
#: the clock budgets and deadlines are kept by (seconds; tests replace it by a fake one)
CLOCK: Callable[[], float] = time.monotonic


def _bucket_class(m: int) -> str:
    if m <= 16:
        return "decode"
    if m <= 32:
        return "small"
    if m <= 128:
        return "mid"
    if m <= 512:
        return "large"
    return "prefill"


def launch_candidates(m: int, n: int, block_k: int, split_k: int,
                      tma: bool = False, k: int | None = None) -> list[tables.GemmConfig]:
    """Launch candidates for a bucket whose upper bound is ``m`` (BLOCK_N capped near N).

    With ``k`` given and a bucket class in ``FREE_BLOCK_K_CLASSES``, the layout's candidates are
    followed by the class's ``_ALT_BLOCK_K_TILES`` with every BLOCK_K of its ``ALT_BLOCK_K``
    other than ``block_k`` that keeps the layout's split-K ranges of ``k`` (in the same forms:
    fused twins, descriptor loads).

    With ``split_k > 1`` and a bucket class in ``FUSED_CLASSES`` each candidate comes in the
    parallel form followed by the fused one (``fuse_splits=True``) and the fused one in a flat
    loop (``flat_splits=True`` as well); otherwise, and always with
    ``split_k == 1`` (nothing to fuse), in the parallel form only. With ``tma`` (bf16/fp16 on a
    GPU with a tensor-memory accelerator) and a bucket class in ``TMA_CLASSES``, every form with
    BLOCK_M >= ``TMA_MIN_BLOCK_M`` also comes with descriptor loads. Duplicates (after the
    BLOCK_N cap) are dropped, first occurrence kept.
    """
    cap = max(16, triton.next_power_of_2(n))
    raw = [(bm, min(bn, cap), warps, stages, per_sm, block_k)
           for bm, bn, warps, stages, per_sm in _LAUNCH_CANDIDATES[_bucket_class(m)]]
    if m <= 16 and n <= 2048:  # narrow N: 16-column tiles keep every multiprocessor busy
        raw += [(16, 16, 4, 4, 1, block_k), (16, 16, 4, 4, 2, block_k)]
    cls = _bucket_class(m)
    if k is not None and cls in FREE_BLOCK_K_CLASSES:
        ranges = tables.split_ranges(k, block_k, split_k)
        for alt in ALT_BLOCK_K[cls]:
            if alt != block_k and tables.split_ranges(k, alt, split_k) == ranges:
                raw += [(bm, min(bn, cap), warps, stages, per_sm, alt)
                        for bm, bn, warps, stages, per_sm in _ALT_BLOCK_K_TILES[cls]]
    # (fuse_splits, flat_splits): parallel, then fused, then fused in one flat loop
    modes = (((False, False), (True, False), (True, True))
             if split_k > 1 and _bucket_class(m) in FUSED_CLASSES else ((False, False),))
    tma_forms = (False, True) if tma and _bucket_class(m) in TMA_CLASSES else (False,)
    out: list[tables.GemmConfig] = []
    seen: set[tables.GemmConfig] = set()
    for bm, bn, warps, stages, per_sm, bk in raw:
        for fused, flat in modes:
            for use_tma in tma_forms:
                if use_tma and bm < TMA_MIN_BLOCK_M:
                    continue
                cfg = tables.GemmConfig(bm, bn, bk, GROUP_M, warps, stages, split_k, per_sm,
                                        fuse_splits=fused, tma=use_tma, flat_splits=flat)
                if cfg not in seen:
                    seen.add(cfg)
                    out.append(cfg)
    return out


def reduction_candidates(n: int, k: int, num_sms: int) -> list[tuple[int, int]]:
    """``(BLOCK_K, SPLIT_K)`` layouts tried for a shape ``(N, K)``.

    Split-K 2 (BLOCK_K 128) is tried for every N <= 8192 and wherever even 32-column tiles leave
    multiprocessors idle at M = 1; with K >= 4096 split-K 4 as well; BLOCK_K 256 (fewer, longer
    loads per K-step at decode sizes) wherever K >= 2048. The fused mode (partial
    sums added in the program that computed them) spares prefill sizes the workspace, so
    a split layout chosen for decode no longer costs much at large M.
    """
    out = [(64, 1), (128, 1)]
    if k >= 2048:
        out.append((256, 1))
    if n <= 8192 or triton.cdiv(n, 32) < num_sms:
        out.append((128, 2))
        if k >= 4096:
            out.append((128, 4))
    return out


def canonical_config(block_k: int, split_k: int) -> tables.GemmConfig:
    """The fixed launch whose row-alone outputs every candidate of a layout must reproduce."""
    return tables.GemmConfig(16, 64, block_k, GROUP_M, 4, 3, split_k)


def all_sweep_configs(shapes: Sequence[GemmShape], num_sms: int,
                      tma: bool = False) -> list[tables.GemmConfig]:
    """Every launch configuration the sweep may compile (for parallel precompilation)."""
    configs: dict[tables.GemmConfig, None] = {}
    for shape in shapes:
        for bk, split in reduction_candidates(shape.n, shape.k, num_sms):
            configs[canonical_config(bk, split)] = None
            for m in BUCKETS:
                for cfg in launch_candidates(m, shape.n, bk, split, tma, shape.k):
                    configs[cfg] = None
    return list(configs)


def sweep_plan(shapes: Sequence[GemmShape], num_sms: int, tma: bool = False) -> dict[str, int]:
    """Size of a sweep of ``shapes``: configs to precompile, most candidate measurements.

    ``measurements_max`` counts phase 1 (every layout at every scoring size) and phase 2 for the
    layout with the most candidates (the chosen one is known only after phase 1); each shape also
    times torch.mm once per bucket.
    """
    measurements = 0
    for shape in shapes:
        layouts = reduction_candidates(shape.n, shape.k, num_sms)
        measurements += sum(len(launch_candidates(m, shape.n, *lay, tma, shape.k))
                            for m in SCORE_MS for lay in layouts)
        measurements += max(sum(len(launch_candidates(m, shape.n, *lay, tma, shape.k))
                                for m in BUCKETS if m not in SCORE_MS) for lay in layouts)
    return {"shapes": len(shapes), "configs": len(all_sweep_configs(shapes, num_sms, tma)),
            "measurements_max": measurements}


TMA_ENV = "BISTAT_SWEEP_TMA"  # 0: leave the tensor-memory-accelerator forms out of the sweep


def tma_available(dtype: torch.dtype) -> bool:
    """Whether the sweep tries descriptor loads: bf16/fp16 on a GPU of compute capability >= 9."""
    if os.environ.get(TMA_ENV, "1").strip() == "0" or dtype == torch.float32:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9


def time_ms(calls: Sequence[Callable[[], Any]], what: tuple[Any, ...] = ()) -> float:
    """Median GPU time per call in ms (:func:`bistat_kernels.timing.graph_time_ms`); under the
    Triton interpreter the host clock (:func:`bistat_kernels.timing.wall_time_ms`), so that a
    tune runs end to end on the CPU (its times rank nothing a GPU would).

    ``what`` names the measurement (kind, M, config); CPU tests replace this function by a
    deterministic fake clock that reads it.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return timing.wall_time_ms(calls)
    return timing.graph_time_ms(calls)


class BudgetExceeded(RuntimeError):
    """The sweep's deadline passed inside a shape: the shape is left for a later run."""


def _measure_all(st: "_ShapeState", m: int, configs: Sequence[tables.GemmConfig],
                 layout: tuple[int, int], deadline: float | None) -> list[dict[str, Any]]:
    """:func:`_measure_candidate` for each of ``configs`` in order, checking ``deadline``
    (:data:`CLOCK`) before each: past it, :class:`BudgetExceeded`."""
    records = []
    for cfg in configs:
        if deadline is not None and CLOCK() > deadline:
            raise BudgetExceeded(f"sweep: deadline passed at N={st.shape.n} K={st.shape.k} M={m}")
        records.append(_measure_candidate(st, m, cfg, layout))
    return records


@dataclass
class _ShapeState:
    shape: GemmShape
    dtype: torch.dtype
    a_big: torch.Tensor  # [max M, K]
    b: torch.Tensor  # [K, N] (weight.t())
    b_copies: list[torch.Tensor]  # b and clones of it, rotated through when timing
    torch_mm_ms: dict[int, float]
    refs: dict[int, torch.Tensor]
    alone: dict[tuple[int, int], dict[int, torch.Tensor]]


def _measure_candidate(st: _ShapeState, m: int, cfg: tables.GemmConfig,
                       layout: tuple[int, int]) -> dict[str, Any]:
    a = st.a_big[:m]
    rec: dict[str, Any] = {"m": m, **asdict(cfg)}
    t0 = time.monotonic()
    try:
        out = mp.matmul_persistent(a, st.b, config=cfg)  # [m, N]
        if out.is_cuda:
            torch.cuda.synchronize()
    except OutOfResources as exc:
        rec.update(status="out_of_resources", detail=str(exc)[:200],
                   first_launch_s=round(time.monotonic() - t0, 4))
        return rec
    except CompilationError as exc:  # e.g. a tile the tensor descriptors cannot take
        rec.update(status="compile_error", detail=str(exc)[-300:],
                   first_launch_s=round(time.monotonic() - t0, 4))
        return rec
    rec["first_launch_s"] = round(time.monotonic() - t0, 4)  # compile or cache load + run
    alone = st.alone[layout]  # the layout's canonical launch, whatever the candidate's BLOCK_K
    rows = row_positions(m)
    inv_ok = all(torch.equal(out[r], alone[r]) for r in rows)
    diff = (out.float() - st.refs[m]).abs().max().item()
    scale = st.refs[m].abs().max().item()
    rel = diff / scale if scale > 0 else diff
    finite = bool(torch.isfinite(out).all())
    acc_ok = finite and rel <= ACCURACY_TOLERANCE[st.dtype]
    rec.update(invariance_ok=inv_ok, rows_checked=list(rows), max_abs_err=diff, max_rel_err=rel,
               accuracy_ok=acc_ok)
    if not (inv_ok and acc_ok):
        rec["status"] = "gate_failed"
        return rec
    rec["time_ms"] = time_ms([lambda bb=bb: mp.matmul_persistent(a, bb, config=cfg)
                              for bb in st.b_copies], ("tuned", m, cfg))
    rec["status"] = "ok"
    return rec


def _ensure_ref(st: _ShapeState, m: int) -> None:
    if m not in st.refs:
        st.refs.clear()  # keep one reference alive (lm_head at M = 4096 is 2.5 GB in fp32)
        torch.cuda.empty_cache()
        st.refs[m] = reference_mm(st.a_big[:m], st.b, None)
    if m not in st.torch_mm_ms:
        a = st.a_big[:m]
        torch.mm(a, st.b)
        st.torch_mm_ms[m] = time_ms([lambda bb=bb: torch.mm(a, bb) for bb in st.b_copies],
                                    ("torch.mm", m, None))


def _ensure_alone(st: _ShapeState, layout: tuple[int, int]) -> None:
    if layout in st.alone:
        return
    canon = canonical_config(*layout)
    rows = sorted({r for m in BUCKETS for r in row_positions(m)})
    st.alone[layout] = {r: mp.matmul_persistent(st.a_big[r:r + 1], st.b, config=canon)[0]
                        for r in rows}


def _best(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in records if r.get("status") == "ok"]
    return min(ok, key=lambda r: r["time_ms"]) if ok else None


def sweep_shape(shape: GemmShape, dtype: torch.dtype, num_sms: int, provenance: dict[str, Any],
                seed: int = 0, device: str = "cuda", tma: bool = False,
                deadline: float | None = None,
                ) -> tuple[tables.ShapeConfig, dict[str, Any]]:
    """Tune one weight shape; returns its table entry and the raw measurements.

    Past ``deadline`` (:data:`CLOCK`), checked before every candidate, it raises
    :class:`BudgetExceeded` and the shape's measurements are dropped (a later run tunes it).
    """
    t0 = time.monotonic()
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(shape.n, shape.k, device=device, dtype=dtype, generator=gen) * 0.02  # [N, K]
    a_big = torch.randn(max(BUCKETS), shape.k, device=device, dtype=dtype, generator=gen)
    copies = timing.weight_copies(w) if device != "cpu" else [w]
    st = _ShapeState(shape, dtype, a_big, w.t(), [c.t() for c in copies], {}, {}, {})
    layouts = reduction_candidates(shape.n, shape.k, num_sms)
    records: list[dict[str, Any]] = []
    best: dict[tuple[tuple[int, int], int], dict[str, Any]] = {}

    # Phase 1: score each reduction layout at the scoring sizes.
    for m in SCORE_MS:
        _ensure_ref(st, m)
        for layout in layouts:
            _ensure_alone(st, layout)
            recs = _measure_all(st, m, launch_candidates(m, shape.n, *layout, tma, shape.k),
                                layout, deadline)
            for r in recs:
                r["phase"] = "layout"
            records.extend(recs)
            winner = _best(recs)
            if winner is not None:
                best[(layout, m)] = winner
    scores: dict[str, float] = {}
    for layout in layouts:
        if all((layout, m) in best for m in SCORE_MS):
            log_sum = sum(SCORE_WEIGHTS[m] * math.log(best[(layout, m)]["time_ms"]
                                                       / st.torch_mm_ms[m]) for m in SCORE_MS)
            scores[f"bk{layout[0]}_s{layout[1]}"] = math.exp(
                log_sum / sum(SCORE_WEIGHTS.values()))
    if not scores:
        raise RuntimeError(f"sweep: no reduction layout of N={shape.n} K={shape.k} passed both "
                           f"gates at every scoring size; see the raw records")
    chosen_name = min(scores, key=scores.__getitem__)
    chosen = next(lay for lay in layouts if f"bk{lay[0]}_s{lay[1]}" == chosen_name)

    # Phase 2: the remaining buckets with the chosen layout.
    buckets = []
    for m in BUCKETS:
        if (chosen, m) not in best:
            _ensure_ref(st, m)
            recs = _measure_all(st, m, launch_candidates(m, shape.n, *chosen, tma, shape.k),
                                chosen, deadline)
            for r in recs:
                r["phase"] = "bucket"
            records.extend(recs)
            winner = _best(recs)
            if winner is None:
                raise RuntimeError(f"sweep: no candidate for N={shape.n} K={shape.k} M={m} "
                                   f"passed both gates")
            best[(chosen, m)] = winner
        w_rec = best[(chosen, m)]
        buckets.append(tables.BucketConfig(
            m_max=m, block_m=w_rec["block_m"], block_n=w_rec["block_n"], group_m=w_rec["group_m"],
            num_warps=w_rec["num_warps"], num_stages=w_rec["num_stages"],
            programs_per_sm=w_rec["programs_per_sm"],
            fuse_splits=w_rec["fuse_splits"], tma=w_rec.get("tma", False),
            flat_splits=w_rec.get("flat_splits", False),
            block_k=None if w_rec["block_k"] == chosen[0] else w_rec["block_k"],
            measured={"m": m, "time_ms": round(w_rec["time_ms"], 5),
                      "torch_mm_ms": round(st.torch_mm_ms[m], 5),
                      "max_rel_err": w_rec["max_rel_err"]}))
    entry = tables.ShapeConfig(
        dtype=mp.dtype_name(dtype), n=shape.n, k=shape.k, block_k=chosen[0], split_k=chosen[1],
        buckets=tuple(buckets), provenance=provenance,
        extra={"layers": [f"{shape.model}/{shape.layer}"],
               "selection": {"score": "decode-weighted geometric mean of best time / torch.mm "
                                      "time at M in SCORE_MS",
                             "score_weights": {str(k): v for k, v in SCORE_WEIGHTS.items()},
                             "scores": {k: round(v, 4) for k, v in scores.items()},
                             "chosen": chosen_name},
               "gates": {"invariance": "every kept candidate (any BLOCK_K with the layout's "
                                       "split-K ranges) reproduced the row-alone output of "
                                       f"{canonical_config(*chosen)} bitwise at rows "
                                       "first/second/middle/last",
                         "accuracy_tolerance_rel": ACCURACY_TOLERANCE[dtype]}})
    raw = {"n": shape.n, "k": shape.k, "model": shape.model, "layer": shape.layer,
           "dtype": mp.dtype_name(dtype), "torch_mm_ms": {str(k): v for k, v in
                                                           st.torch_mm_ms.items()},
           "records": records, "elapsed_s": round(time.monotonic() - t0, 1),
           "slow_first_launches": sum(r["first_launch_s"] > SLOW_FIRST_LAUNCH_S
                                      for r in records)}
    del st, w, a_big, copies
    torch.cuda.empty_cache()
    return entry, raw


def _config_of(record: dict[str, Any]) -> tables.GemmConfig:
    # records written before a field existed lack it: its default then (flat_splits)
    return tables.GemmConfig(**{k: record[k] for k in tables._CONFIG_FIELDS if k in record})


def retune_buckets(entry: tables.ShapeConfig, shape: GemmShape, dtype: torch.dtype,
                   provenance: dict[str, Any], min_m: int, source: str, seed: int = 0,
                   device: str = "cuda", tma: bool = False, max_m: int | None = None,
                   ) -> tuple[tables.ShapeConfig, dict[str, Any]]:
    """Re-tune the buckets from ``min_m`` to ``max_m`` (None: every larger one) of ``entry`` with
    its layout kept; the rest stay as they are.

    Each re-tuned bucket is timed over :func:`launch_candidates` (with ``k``, so the other
    BLOCK_K of ``FREE_BLOCK_K_CLASSES``) plus the bucket's present launch, all through both gates
    against the layout's canonical launch, side by side in this process; the fastest that passes
    wins, so a bucket changes only where a candidate beat its present launch here. Its
    ``measured`` says so: ``source`` (the raw file), ``retuned_on`` (GPU UUID, date, versions) and
    ``previous`` (the launch it replaced, with its time in this run).
    """
    t0 = time.monotonic()
    layout = (entry.block_k, entry.split_k)
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(shape.n, shape.k, device=device, dtype=dtype, generator=gen) * 0.02  # [N, K]
    a_big = torch.randn(max(BUCKETS), shape.k, device=device, dtype=dtype, generator=gen)
    copies = timing.weight_copies(w) if device != "cpu" else [w]
    st = _ShapeState(shape, dtype, a_big, w.t(), [c.t() for c in copies], {}, {}, {})
    _ensure_alone(st, layout)
    records: list[dict[str, Any]] = []
    buckets = []
    retuned_on = {key: provenance.get(key) for key in ("gpu_name", "gpu_uuid", "driver", "torch",
                                                      "triton", "date_utc")}
    for bucket in entry.buckets:
        if bucket.m_max < min_m or (max_m is not None and bucket.m_max > max_m):
            buckets.append(bucket)
            continue
        m = bucket.m_max
        _ensure_ref(st, m)
        present = entry.config_for(m)
        cands = launch_candidates(m, shape.n, *layout, tma, shape.k)
        if present not in cands:
            cands.append(present)
        recs = [_measure_candidate(st, m, cfg, layout) for cfg in cands]
        for r in recs:
            r["phase"] = "retune"
        records.extend(recs)
        winner = _best(recs)
        was = next((r for r in recs if _config_of(r) == present), None)
        if winner is None or was is None or was.get("status") != "ok":
            raise RuntimeError(f"retune: N={shape.n} K={shape.k} M={m}: the present launch "
                               f"{present} or every candidate failed a gate; see the raw records")
        if _config_of(winner) == present:
            buckets.append(bucket)
            continue
        buckets.append(tables.BucketConfig(
            m_max=m, block_m=winner["block_m"], block_n=winner["block_n"],
            group_m=winner["group_m"], num_warps=winner["num_warps"],
            num_stages=winner["num_stages"], programs_per_sm=winner["programs_per_sm"],
            fuse_splits=winner["fuse_splits"], tma=winner.get("tma", False),
            flat_splits=winner.get("flat_splits", False),
            block_k=None if winner["block_k"] == layout[0] else winner["block_k"],
            measured={"m": m, "time_ms": round(winner["time_ms"], 5),
                      "torch_mm_ms": round(st.torch_mm_ms[m], 5),
                      "max_rel_err": winner["max_rel_err"], "source": source,
                      "retuned_on": retuned_on,
                      "previous": {"config": str(present), "time_ms": round(was["time_ms"], 5)}}))
    new = tables.ShapeConfig(entry.dtype, entry.n, entry.k, entry.block_k, entry.split_k,
                             tuple(buckets), entry.provenance, entry.extra)
    raw = {"n": shape.n, "k": shape.k, "model": shape.model, "layer": shape.layer,
           "dtype": mp.dtype_name(dtype), "min_m": min_m, "max_m": max_m,
           "torch_mm_ms": {str(k): v for k, v in st.torch_mm_ms.items()}, "records": records,
           "elapsed_s": round(time.monotonic() - t0, 1),
           "slow_first_launches": sum(r["first_launch_s"] > SLOW_FIRST_LAUNCH_S
                                      for r in records)}
    del st, w, a_big, copies
    if device != "cpu":
        torch.cuda.empty_cache()
    return new, raw


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


INTERPRETER_DEVICE = "Triton interpreter (CPU)"  # the device name of a sweep on the CPU


def run_sweep(shapes: Sequence[GemmShape], out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
              resume_table: Path | None = None, resume_raw: Path | None = None,
              budget_s: float = 480.0, precompile_workers: int = 0,
              precompile_budget_s: float | None = None,
              command: list[str] | None = None,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Sweep ``shapes`` not yet in ``resume_table``; write ``<device>.json`` and the raw file.

    The budget is kept: no shape starts whose expected time (the longest so far) would cross
    ``budget_s`` from the start, and a shape still running at that moment is dropped before its
    next candidate (:class:`BudgetExceeded`; a later run tunes it). ``precompile_budget_s``
    bounds the precompile (:func:`precompile`). On the CPU (``TRITON_INTERPRET=1``, no CUDA) the
    sweep runs the interpreter, for tests, under the device name :data:`INTERPRETER_DEVICE`.

    Returns a summary: shapes done now, shapes still missing, the paths written, the seconds
    used and whether a shape was dropped at the deadline.
    """
    from bistat_kernels.provenance import gpu_provenance

    t_start = CLOCK()
    deadline = t_start + budget_s
    toolchain = pin_triton_toolchain()
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    provenance = gpu_provenance(0, command)
    if on_gpu:
        device_name = torch.cuda.get_device_name(0)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        device_name, num_sms = INTERPRETER_DEVICE, mp._INTERPRETER_NUM_PROGRAMS
        provenance["gpu_name"] = device_name
    out_dir.mkdir(parents=True, exist_ok=True)
    table_path = tables.table_path_for(device_name, out_dir)
    raw_path = out_dir / f"sweep_raw_{tables.device_slug(device_name)}.json"

    entries: dict[tuple[str, int, int], tables.ShapeConfig] = {}
    if resume_table is not None and resume_table.is_file():
        entries.update(tables.load_table(resume_table).entries)
    raw_shapes: list[dict[str, Any]] = []
    if resume_raw is not None and resume_raw.is_file():
        raw_shapes = json.loads(resume_raw.read_text(encoding="utf-8"))["shapes"]
    name = mp.dtype_name(dtype)
    tma = tma_available(dtype)
    todo = []
    for shape in shapes:
        key = (name, shape.n, shape.k)
        if key not in entries and all(s.k != shape.k or s.n != shape.n for s in todo):
            todo.append(shape)
    progress(f"sweep: {len(todo)} shape(s) to tune on {device_name}, "
             f"{len(entries)} already in the table")
    if todo:
        plan = sweep_plan(todo, num_sms, tma)
        progress(f"sweep: plan {plan['configs']} configs, at most {plan['measurements_max']} "
                 f"measurements; Triton cache {toolchain['TRITON_CACHE_DIR']}, ptxas "
                 f"{toolchain['TRITON_PTXAS_PATH']}")
    if todo and precompile_workers > 0 and on_gpu:
        t0 = CLOCK()
        errs = precompile(all_sweep_configs(todo, num_sms, tma), dtype, num_sms,
                          precompile_workers, budget_s=precompile_budget_s, clock=CLOCK)
        progress(f"sweep: precompiled in {CLOCK() - t0:.1f}s, {len(errs)} config(s) "
                 f"failed to compile (skipped when timed)"
                 + "".join(f"; {e}" for e in errs if "not precompiled" in e))
    done: list[str] = []
    per_shape_s: list[float] = []
    dropped = None
    for shape in todo:
        elapsed = CLOCK() - t_start
        estimate = max(per_shape_s) if per_shape_s else (20.0 if on_gpu else 0.0)
        if elapsed + estimate > budget_s:
            progress(f"sweep: budget {budget_s:.0f}s reached after {elapsed:.0f}s; resume later")
            break
        t0 = CLOCK()
        try:
            entry, raw = sweep_shape(shape, dtype, num_sms, provenance, tma=tma,
                                     device="cuda" if on_gpu else "cpu", deadline=deadline)
        except BudgetExceeded:
            dropped = f"{shape.model}/{shape.layer}"
            progress(f"sweep: budget {budget_s:.0f}s reached inside {dropped} after "
                     f"{CLOCK() - t_start:.0f}s; it is left for a later run")
            break
        per_shape_s.append(CLOCK() - t0)
        entries[(name, shape.n, shape.k)] = entry
        raw_shapes = [r for r in raw_shapes if (r["n"], r["k"], r["dtype"]) !=
                      (shape.n, shape.k, name)] + [raw]
        _write_json(table_path, tables.table_to_dict(device_name, list(entries.values())))
        _write_json(raw_path, {"schema": RAW_SCHEMA, "device_name": device_name,
                               "provenance": provenance, "shapes": raw_shapes})
        ratios = ", ".join(f"M={b.m_max}:{b.measured['time_ms'] / b.measured['torch_mm_ms']:.2f}"
                           for b in entry.buckets)
        progress(f"sweep: {shape.model}/{shape.layer} N={shape.n} K={shape.k} -> "
                 f"{entry.extra['selection']['chosen']} in {per_shape_s[-1]:.1f}s "
                 f"({len(raw['records'])} candidates, {raw['slow_first_launches']} first "
                 f"launches over {SLOW_FIRST_LAUNCH_S}s); "
                 f"tuned/torch.mm {ratios}")
        done.append(f"{shape.model}/{shape.layer}")
    missing = [f"{s.model}/{s.layer}" for s in shapes if (name, s.n, s.k) not in entries]
    return {"done": done, "missing": missing, "table": str(table_path), "raw": str(raw_path),
            "device_name": device_name, "elapsed_s": round(CLOCK() - t_start, 1),
            "dropped_at_deadline": dropped}


def run_retune_buckets(shapes: Sequence[GemmShape], table_path: Path, out_dir: Path, *,
                       min_m: int = 256, max_m: int | None = None,
                       dtype: torch.dtype = torch.bfloat16,
                       budget_s: float = 300.0, precompile_workers: int = 0,
                       command: list[str] | None = None,
                       progress: Callable[[str], None] = print) -> dict[str, Any]:
    """:func:`retune_buckets` for every shape of ``shapes`` in the table at ``table_path``.

    Writes ``<device>.json`` (the whole table: shapes not reached keep their entries) and
    ``retune_raw_<device>.json`` under ``out_dir`` after every shape; stops at a shape boundary
    when the budget would be exceeded. Returns the shapes done, those left and the paths.
    """
    from bistat_kernels.provenance import gpu_provenance

    t_start = time.monotonic()
    toolchain = pin_triton_toolchain()
    device_name = torch.cuda.get_device_name(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    provenance = gpu_provenance(0, command)
    table = tables.load_table(table_path)
    entries = dict(table.entries)
    name = mp.dtype_name(dtype)
    tma = tma_available(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_table = tables.table_path_for(device_name, out_dir)
    raw_path = out_dir / f"retune_raw_{tables.device_slug(device_name)}.json"
    span = f"M >= {min_m}" if max_m is None else f"{min_m} <= M <= {max_m}"
    source = f"kernels/results/{raw_path.name} (sweep.retune_buckets, {span})"
    todo = [s for s in shapes if (name, s.n, s.k) in entries]
    if precompile_workers > 0 and todo:
        configs: dict[tables.GemmConfig, None] = {}
        for s in todo:
            e = entries[(name, s.n, s.k)]
            for m in BUCKETS:
                if m >= min_m and (max_m is None or m <= max_m):
                    for cfg in launch_candidates(m, s.n, e.block_k, e.split_k, tma, s.k):
                        configs[cfg] = None
        t0 = time.monotonic()
        errs = precompile(list(configs), dtype, num_sms, precompile_workers)
        progress(f"retune: precompiled {len(configs)} configs in {time.monotonic() - t0:.1f}s, "
                 f"{len(errs)} failed to compile (skipped when timed); Triton cache "
                 f"{toolchain['TRITON_CACHE_DIR']}")
    raw_shapes: list[dict[str, Any]] = []
    done: list[str] = []
    per_shape_s: list[float] = []
    for shape in todo:
        elapsed = time.monotonic() - t_start
        if elapsed + (max(per_shape_s) if per_shape_s else 15.0) > budget_s:
            progress(f"retune: budget {budget_s:.0f}s reached after {elapsed:.0f}s")
            break
        t0 = time.monotonic()
        key = (name, shape.n, shape.k)
        old = entries[key]
        entries[key], raw = retune_buckets(old, shape, dtype, provenance, min_m, source, tma=tma,
                                           max_m=max_m)
        per_shape_s.append(time.monotonic() - t0)
        raw_shapes.append(raw)
        _write_json(out_table, tables.table_to_dict(device_name, list(entries.values())))
        _write_json(raw_path, {"schema": RAW_SCHEMA, "device_name": device_name,
                               "provenance": provenance, "source_table": str(table_path),
                               "shapes": raw_shapes})
        changes = ", ".join(
            f"M={b.m_max}:{b.measured['previous']['time_ms'] / b.measured['torch_mm_ms']:.2f}"
            f"->{b.measured['time_ms'] / b.measured['torch_mm_ms']:.2f}"
            for b in entries[key].buckets if "previous" in b.measured
            and b.measured.get("source") == source)
        progress(f"retune: {shape.model}/{shape.layer} in {per_shape_s[-1]:.1f}s "
                 f"({len(raw['records'])} candidates, {raw['slow_first_launches']} slow first "
                 f"launches); tuned/torch.mm {changes or 'unchanged'}")
        done.append(f"{shape.model}/{shape.layer}")
    left = [f"{s.model}/{s.layer}" for s in todo if f"{s.model}/{s.layer}" not in done]
    return {"done": done, "left": left, "table": str(out_table), "raw": str(raw_path)}
