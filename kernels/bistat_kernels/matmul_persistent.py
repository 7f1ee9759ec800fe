"""Batch-invariant persistent GEMM (Triton): kernels and launcher.

``matmul_persistent(a, b, bias)`` computes ``a @ b (+ bias)`` for ``a`` [M, K] and ``b`` [K, N]
(any strides: vLLM passes ``weight.t()``), in bfloat16 or float16 with float32 accumulation, or
in float32 with IEEE-exact products (``input_precision="ieee"``: ``tl.dot`` would otherwise use
TF32 silently). It follows the persistent matmul of the Triton tutorial
(triton-lang/triton ``python/tutorials/09-persistent-matmul.py``) and vLLM 0.25.0's
``matmul_kernel_persistent``, with two changes: the launch configuration comes from a per-device
table with M buckets (:mod:`bistat_kernels.tables`), and the K reduction may be split.

Invariant kept
--------------
Every output element ``C[m, n]`` is the sum over K taken in an order fixed by ``(K, BLOCK_K,
SPLIT_K)`` alone: K-tiles of ``BLOCK_K`` added one after another into a float32 accumulator, split
into ``SPLIT_K`` consecutive groups of ``cdiv(cdiv(K, BLOCK_K), SPLIT_K)`` tiles whose partial sums
are then added in split order (split 0 first); the bias is added last, in float32, before the cast.
The table fixes ``BLOCK_K`` and ``SPLIT_K`` per weight shape ``(N, K)``, never per M, so a row's
bits do not depend on which other rows share the batch. ``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``,
``num_warps``, ``num_stages`` and ``FUSE_SPLITS`` vary per M bucket: they decide which program
computes which tile, and where the partial sums meet, not how a tile sums. The probe
(:mod:`bistat_kernels.probe`) checks that claim bitwise, and the sweep checks it for every
candidate it keeps.

Split-K runs in one of two ways, a per-bucket launch choice. *Parallel*: every (split, tile) pair
is its own persistent work item; each writes its float32 partial sum to a workspace
``[SPLIT_K, M, N]`` and counts itself in the tile's counter, and the program that brings the
tile's last partial, whichever split it computed, adds the partials ``total = p0``, then
``total = total + p1``, ... , then ``+ bias`` in float32, then the cast (one launch; the counter
goes back to zero). *Fused* (``FUSE_SPLITS``): one work item per tile runs the splits one after
another; each split starts from a fresh float32 zero accumulator and runs the very same
``tl.dot(a, b, acc)`` chain over the same K-tiles with the same masks (one helper,
:func:`_split_partial`, serves both modes), and the partial sums are added in registers in the
same order. Storing a float32 partial to the workspace and loading it back is exact, and float32
addition is the same IEEE operation in either place, so fused and parallel produce the same bits:
the same operations on the same values in the same order. Which program adds the partials
decides nothing but where the sum happens. The fused mode comes in two forms (``FLAT_SPLITS``):
nested loops (tiles, splits, K-tiles), whose software pipeline drains at the end of every split,
and one flat loop over the program's tiles times all K-tiles (the persistent tutorial's manual
flattening), where the accumulator is folded into the total and reset where a split ends and the
output stored where a tile ends: the same K-tiles through the same loads (:func:`_k_tile`) into
the same ``tl.dot`` chain from a fresh zero accumulator per split, added in the same order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from bistat_kernels import tables
from bistat_kernels.resolution import DeviceFacts

_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                      torch.float32: "float32"}

# Resolved once per process (first launch): the multiprocessor count and what table resolution
# needs of the device (name, compute capability, multiprocessors). Plain module values, not
# functools.lru_cache (torch.compile's tracer rejects lru_cache).
_NUM_SMS = 0
_DEVICE_FACTS = DeviceFacts(None)
_INTERPRETER_NUM_PROGRAMS = 4  # TRITON_INTERPRET=1 runs programs one after another on the CPU


@triton.jit
def _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M):
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _operand_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                     A_LARGE: tl.constexpr, B_LARGE: tl.constexpr):
    offs_am = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_bn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    if A_LARGE:
        offs_am = offs_am.to(tl.int64)
    if B_LARGE:
        offs_bn = offs_bn.to(tl.int64)
    # Rows/columns past the edge read row/column 0 (always valid memory) and are not stored.
    offs_am = tl.where(offs_am < M, offs_am, 0)
    offs_bn = tl.where(offs_bn < N, offs_bn, 0)
    offs_am = tl.max_contiguous(tl.multiple_of(offs_am, BLOCK_SIZE_M), BLOCK_SIZE_M)
    offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BLOCK_SIZE_N), BLOCK_SIZE_N)
    return offs_am, offs_bn


@triton.jit
def _k_tile(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak, stride_bk, stride_bn, k_tile,
            BLOCK_SIZE_K: tl.constexpr, A_LARGE: tl.constexpr, B_LARGE: tl.constexpr):
    # The operand tiles of K-tile ``k_tile``; K-tiles past K load zeros (adding an exact 0 leaves
    # a sum's bits unchanged).
    offs_k_base = tl.arange(0, BLOCK_SIZE_K)
    k_start = k_tile * BLOCK_SIZE_K
    if A_LARGE or B_LARGE:
        offs_k = k_start + offs_k_base.to(tl.int64)
    else:
        offs_k = k_start + offs_k_base
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    a = tl.load(a_ptrs, mask=offs_k_base[None, :] < K - k_start, other=0.0)
    b = tl.load(b_ptrs, mask=offs_k_base[:, None] < K - k_start, other=0.0)
    return a, b


@triton.jit
def _split_partial(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak, stride_bk, stride_bn,
                   k_tile0, k_tiles_per_split,
                   BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                   BLOCK_SIZE_K: tl.constexpr, A_LARGE: tl.constexpr, B_LARGE: tl.constexpr,
                   IEEE: tl.constexpr):
    # One split's float32 partial sum of a tile: K-tiles k_tile0 .. k_tile0 + k_tiles_per_split - 1
    # added one after another into a fresh zero accumulator (both split-K modes call this).
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(k_tiles_per_split):
        a, b = _k_tile(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak, stride_bk,
                       stride_bn, k_tile0 + kk, BLOCK_SIZE_K, A_LARGE, B_LARGE)
        if IEEE:
            accumulator = tl.dot(a, b, accumulator, input_precision="ieee")
        else:
            accumulator = tl.dot(a, b, accumulator)
    return accumulator


@triton.jit
def _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                    C_LARGE: tl.constexpr):
    offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    if C_LARGE:
        offs_cm = offs_cm.to(tl.int64)
        offs_cn = offs_cn.to(tl.int64)
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    return offs_cm, offs_cn, c_mask


@triton.jit
def _store_output(c_ptr, bias_ptr, total, offs_cm, offs_cn, c_mask, N, stride_cm, stride_cn,
                  HAS_BIAS: tl.constexpr):
    # The epilogue of a complete sum: + bias in float32, then the cast to the output dtype.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_cn, mask=offs_cn < N, other=0.0).to(tl.float32)
        total += bias[None, :]
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _flat_split_end(total, accumulator, ki, k_tiles_per_split, k_tiles_all, pid_m, pid_n,
                    c_ptr, bias_ptr, M, N, stride_cm, stride_cn,
                    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                    C_LARGE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # The flat fused loop after K-tile ``ki``'s dot: where a split ends, its partial is folded
    # into the total (split 0 taken as it is, later ones added in split order) and the next split
    # starts from a fresh zero; where the tile's last split ends, the total is stored.
    if (ki + 1) % k_tiles_per_split == 0:
        total = tl.where(ki < k_tiles_per_split, accumulator, total + accumulator)
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        if ki == k_tiles_all - 1:
            offs_cm, offs_cn, c_mask = _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                       BLOCK_SIZE_N, C_LARGE)
            _store_output(c_ptr, bias_ptr, total, offs_cm, offs_cn, c_mask, N, stride_cm,
                          stride_cn, HAS_BIAS)
    return total, accumulator


@triton.jit
def _split_store_and_fixup(ws_ptr, lock_ptr, c_ptr, bias_ptr, accumulator, split, tile,
                           offs_cm, offs_cn, c_mask, M, N, stride_cm, stride_cn,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    # One split's float32 partial goes to the workspace (its start, as [SPLIT_K, M, N]); the
    # program that brings a tile's last partial (whichever split that is) adds the tile's
    # partials in split order, total = p0, total = total + p1, ..., then + bias and the cast: the
    # same operations in the same order as the fused mode, whatever order the programs arrive in.
    mn = M.to(tl.int64) * N
    offs = offs_cm.to(tl.int64)[:, None] * N + offs_cn.to(tl.int64)[None, :]
    tl.store(ws_ptr + split.to(tl.int64) * mn + offs, accumulator, mask=c_mask)
    # every thread's stores are issued before one thread releases them with the count (gpu scope)
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        # the partials of other programs are read from L2 (.cg), never from a stale L1 line
        total = tl.load(ws_ptr + offs, mask=c_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(ws_ptr + s * mn + offs, mask=c_mask, other=0.0, cache_modifier=".cg")
        # the counter goes back to zero for the next launch on this stream (they run in order)
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
        _store_output(c_ptr, bias_ptr, total, offs_cm, offs_cn, c_mask, N, stride_cm,
                      stride_cn, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, bias_ptr, lock_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    A_LARGE: tl.constexpr, B_LARGE: tl.constexpr, C_LARGE: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, FUSE_SPLITS: tl.constexpr,
    FLAT_SPLITS: tl.constexpr,
):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)  # a function of (K, BLOCK_K, SPLIT_K) only
    num_mn = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n

    if FLAT_SPLITS:
        # Fused split-K in one flat loop over (this program's tiles) x (every K-tile): the same
        # chains and the same sums as below, with no loop boundary between splits or tiles for
        # the software pipeliner to drain (FLAT_SPLITS implies FUSE_SPLITS).
        k_tiles_all = k_tiles_per_split * SPLIT_K
        my_tiles = tl.cdiv(num_mn - start_pid, NUM_PROGRAMS)  # grid <= num_mn: start_pid < num_mn
        tile_id = start_pid - NUM_PROGRAMS
        ki = -1
        pid_m, pid_n = _compute_pid(start_pid, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_am, offs_bn = _operand_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                            A_LARGE, B_LARGE)
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for _ in range(0, k_tiles_all * my_tiles):
            ki = tl.where(ki == k_tiles_all - 1, 0, ki + 1)
            if ki == 0:
                tile_id += NUM_PROGRAMS
                pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
                offs_am, offs_bn = _operand_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                    BLOCK_SIZE_N, A_LARGE, B_LARGE)
            a, b = _k_tile(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak, stride_bk,
                           stride_bn, ki, BLOCK_SIZE_K, A_LARGE, B_LARGE)
            if IEEE:
                accumulator = tl.dot(a, b, accumulator, input_precision="ieee")
            else:
                accumulator = tl.dot(a, b, accumulator)
            total, accumulator = _flat_split_end(
                total, accumulator, ki, k_tiles_per_split, k_tiles_all, pid_m, pid_n, c_ptr,
                bias_ptr, M, N, stride_cm, stride_cn, BLOCK_SIZE_M, BLOCK_SIZE_N, C_LARGE,
                HAS_BIAS)
    elif FUSE_SPLITS:
        # Fused split-K: num_pid_m x num_pid_n tiles; each runs its SPLIT_K splits in order and
        # adds the partial sums as the parallel mode does: total = p0; total = total + p1; ...
        for tile_id in tl.range(start_pid, num_mn, NUM_PROGRAMS):
            pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            offs_am, offs_bn = _operand_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                                A_LARGE, B_LARGE)
            total = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
            for split in range(SPLIT_K):
                partial = _split_partial(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak,
                                         stride_bk, stride_bn, split * k_tiles_per_split,
                                         k_tiles_per_split, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                         BLOCK_SIZE_K, A_LARGE, B_LARGE, IEEE)
                # split 0 is taken as it is (not 0 + p0, which would turn a -0.0 into +0.0)
                total = tl.where(split == 0, partial, total + partial)
            offs_cm, offs_cn, c_mask = _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                       BLOCK_SIZE_N, C_LARGE)
            _store_output(c_ptr, bias_ptr, total, offs_cm, offs_cn, c_mask, N, stride_cm,
                          stride_cn, HAS_BIAS)
    else:
        # Tiles: SPLIT_K x num_pid_m x num_pid_n, walked by NUM_PROGRAMS persistent programs.
        num_tiles = num_mn * SPLIT_K
        # Triton 3.6 cannot fuse the tile loop with the K loop around the split-K fix-up
        # (TritonGPUFuseNestedLoops fails on the H200), so only unsplit launches flatten.
        for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=SPLIT_K == 1):
            split = tile_id // num_mn
            pid_m, pid_n = _compute_pid(tile_id % num_mn, num_pid_in_group, num_pid_m,
                                        GROUP_SIZE_M)
            offs_am, offs_bn = _operand_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                                A_LARGE, B_LARGE)
            accumulator = _split_partial(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak,
                                         stride_bk, stride_bn, split * k_tiles_per_split,
                                         k_tiles_per_split, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                         BLOCK_SIZE_K, A_LARGE, B_LARGE, IEEE)
            offs_cm, offs_cn, c_mask = _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                       BLOCK_SIZE_N, C_LARGE)
            if SPLIT_K == 1:
                _store_output(c_ptr, bias_ptr, accumulator, offs_cm, offs_cn, c_mask, N,
                              stride_cm, stride_cn, HAS_BIAS)
            else:
                _split_store_and_fixup(ws_ptr, lock_ptr, c_ptr, bias_ptr, accumulator, split,
                                       tile_id % num_mn, offs_cm, offs_cn, c_mask, M, N,
                                       stride_cm, stride_cn, SPLIT_K, HAS_BIAS)


@triton.jit
def _split_partial_tma(a_desc, w_desc, row0, col0, k_tile0, k_tiles_per_split,
                       BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                       BLOCK_SIZE_K: tl.constexpr):
    # _split_partial with the operand tiles loaded by the tensor-memory accelerator: the same
    # K-tiles in the same order into a fresh float32 zero accumulator. Rows, columns and K past
    # the tensors' edges arrive as zeros (the descriptors' padding), as the masked loads give.
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(k_tiles_per_split):
        k_start = (k_tile0 + kk) * BLOCK_SIZE_K
        a = a_desc.load([row0, k_start])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([col0, k_start])  # [BLOCK_N, BLOCK_K] of the [N, K] weight
        accumulator = tl.dot(a, w.T, accumulator)
    return accumulator


@triton.jit(do_not_specialize=["M"])
def _matmul_persistent_tma_kernel(
    a_desc, w_desc, c_ptr, ws_ptr, bias_ptr, lock_ptr,
    M, N, K,
    stride_cm, stride_cn,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    C_LARGE: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_SPLITS: tl.constexpr,
    FLAT_SPLITS: tl.constexpr,
):
    # _matmul_persistent_kernel with descriptor loads (bf16/fp16 only): the same tiles, splits and
    # epilogues, so every output element is the same sum in the same order.
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    num_mn = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    if FLAT_SPLITS:
        # the flat fused loop of _matmul_persistent_kernel with descriptor loads
        k_tiles_all = k_tiles_per_split * SPLIT_K
        my_tiles = tl.cdiv(num_mn - start_pid, NUM_PROGRAMS)
        tile_id = start_pid - NUM_PROGRAMS
        ki = -1
        pid_m, pid_n = _compute_pid(start_pid, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for _ in range(0, k_tiles_all * my_tiles):
            ki = tl.where(ki == k_tiles_all - 1, 0, ki + 1)
            if ki == 0:
                tile_id += NUM_PROGRAMS
                pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            k_start = ki * BLOCK_SIZE_K
            a = a_desc.load([pid_m * BLOCK_SIZE_M, k_start])  # [BLOCK_M, BLOCK_K]
            w = w_desc.load([pid_n * BLOCK_SIZE_N, k_start])  # [BLOCK_N, BLOCK_K]
            accumulator = tl.dot(a, w.T, accumulator)
            total, accumulator = _flat_split_end(
                total, accumulator, ki, k_tiles_per_split, k_tiles_all, pid_m, pid_n, c_ptr,
                bias_ptr, M, N, stride_cm, stride_cn, BLOCK_SIZE_M, BLOCK_SIZE_N, C_LARGE,
                HAS_BIAS)
    elif FUSE_SPLITS:
        for tile_id in tl.range(start_pid, num_mn, NUM_PROGRAMS):
            pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            total = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
            for split in range(SPLIT_K):
                partial = _split_partial_tma(a_desc, w_desc, pid_m * BLOCK_SIZE_M,
                                             pid_n * BLOCK_SIZE_N, split * k_tiles_per_split,
                                             k_tiles_per_split, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                             BLOCK_SIZE_K)
                total = tl.where(split == 0, partial, total + partial)
            offs_cm, offs_cn, c_mask = _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                       BLOCK_SIZE_N, C_LARGE)
            _store_output(c_ptr, bias_ptr, total, offs_cm, offs_cn, c_mask, N, stride_cm,
                          stride_cn, HAS_BIAS)
    else:
        num_tiles = num_mn * SPLIT_K
        # Triton 3.6 cannot fuse the tile loop with the K loop around the split-K fix-up
        # (TritonGPUFuseNestedLoops fails on the H200), so only unsplit launches flatten.
        for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=SPLIT_K == 1):
            split = tile_id // num_mn
            pid_m, pid_n = _compute_pid(tile_id % num_mn, num_pid_in_group, num_pid_m,
                                        GROUP_SIZE_M)
            accumulator = _split_partial_tma(a_desc, w_desc, pid_m * BLOCK_SIZE_M,
                                             pid_n * BLOCK_SIZE_N, split * k_tiles_per_split,
                                             k_tiles_per_split, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                             BLOCK_SIZE_K)
            offs_cm, offs_cn, c_mask = _output_offsets(pid_m, pid_n, M, N, BLOCK_SIZE_M,
                                                       BLOCK_SIZE_N, C_LARGE)
            if SPLIT_K == 1:
                _store_output(c_ptr, bias_ptr, accumulator, offs_cm, offs_cn, c_mask, N,
                              stride_cm, stride_cn, HAS_BIAS)
            else:
                _split_store_and_fixup(ws_ptr, lock_ptr, c_ptr, bias_ptr, accumulator, split,
                                       tile_id % num_mn, offs_cm, offs_cn, c_mask, M, N,
                                       stride_cm, stride_cn, SPLIT_K, HAS_BIAS)


def _device_facts(device: torch.device) -> tuple[int, DeviceFacts]:
    """(programs to launch at most, the device's facts for table resolution), read once per
    process; on the CPU (the Triton interpreter) a fixed program count and no device."""
    global _NUM_SMS, _DEVICE_FACTS
    if _NUM_SMS == 0:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            _NUM_SMS = props.multi_processor_count
            _DEVICE_FACTS = DeviceFacts(props.name, f"{props.major}.{props.minor}",
                                        props.multi_processor_count)
        else:
            _NUM_SMS = _INTERPRETER_NUM_PROGRAMS
            _DEVICE_FACTS = DeviceFacts(None)
    return _NUM_SMS, _DEVICE_FACTS


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``; raises ValueError for unsupported dtypes."""
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"matmul_persistent: dtype {dtype} is not supported; expected "
                         f"bfloat16, float16 or float32") from None


def matmul_persistent(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                      *, config: tables.GemmConfig | None = None) -> torch.Tensor:
    """Batch-invariant ``a @ b + bias`` with a tuned, M-bucketed launch configuration.

    Parameters
    ----------
    a : torch.Tensor
        [M, K], bfloat16, float16 or float32; any strides.
    b : torch.Tensor
        [K, N], same dtype as ``a``; any strides (``weight.t()`` of a [N, K] weight is typical).
    bias : torch.Tensor, optional
        [N]; added in float32 before the cast to the output dtype.
    config : GemmConfig, optional
        Launch configuration to use instead of the table's (sweeps and probes pass candidates).

    Returns
    -------
    torch.Tensor
        [M, N] in the inputs' dtype, contiguous.

    Notes
    -----
    The table entry for ``(dtype, N, K)`` fixes ``block_k`` and ``split_k`` for all M (see the
    module docstring); ``config.fuse_splits`` adds split-K partial sums inside the GEMM kernel
    (no float32 workspace, no counters) with the same bits as the parallel mode;
    ``config.tma`` loads the operand tiles through tensor descriptors where the operands allow it
    (16-byte aligned, unit inner stride; otherwise pointer loads, with the same bits). Shapes
    without an entry use vLLM's own table's entry where the installed vLLM has one for the GPU,
    else vLLM's fixed configuration; which one is logged once per shape. On a
    GPU, every launch after the first of its kind goes straight to the compiled kernel
    (:func:`_launch`).
    """
    if _FAST_LAUNCH:
        # Everything the launch depends on, read in a few attribute calls; a plan made by an
        # earlier call with the same key allocates the output and launches its compiled kernels.
        plan_key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype,
                    a.data_ptr() & 15, b.data_ptr() & 15,
                    None if bias is None else (bias.shape, bias.dtype, bias.data_ptr() & 15),
                    a.get_device(), config, tables.generation())
        plan = _PLANS.get(plan_key)
        if plan is not None and _hooks_idle():
            return plan(a, b, bias)
    else:
        plan_key = None
    assert a.dim() == 2 and b.dim() == 2, "matmul_persistent: a and b must be 2-D"
    assert a.shape[1] == b.shape[0], "Incompatible dimensions"
    assert a.dtype == b.dtype, "Incompatible dtypes"
    assert bias is None or (bias.dim() == 1 and bias.shape[0] == b.shape[1]), \
        "bias must be 1-D of length N"
    M, K = a.shape
    N = b.shape[1]
    dtype = a.dtype
    num_sms, facts = _device_facts(a.device)
    if config is None:
        config = tables.lookup_config(M, N, K, dtype_name(dtype), facts)
    c = torch.empty((M, N), device=a.device, dtype=dtype)  # [M, N]
    if M == 0 or N == 0:
        return c
    split_k = config.split_k
    parallel = split_k > 1 and not config.fuse_splits  # fuse_splits is False when split_k == 1
    num_mn = -(-M // config.block_m) * -(-N // config.block_n)
    num_programs = num_sms * config.programs_per_sm
    grid0 = min(num_programs, num_mn * (split_k if parallel else 1))
    sa0, sa1 = a.stride()
    sb0, sb1 = b.stride()
    a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
    # the counters are passed (int32, one kernel signature) even where no split uses them
    stream = _current_stream(a.device)
    locks = _lock_buffer(a.device, stream, num_mn if parallel else 0)
    if parallel:
        ws = _workspace(a.device, stream, split_k, M, N)  # >= S*M*N, flat
    else:
        ws = c  # unused by the kernel: no split, or splits added in one program
    c_large = M * N > 2**31
    tma = (config.tma and sa1 == 1 and sb0 == 1 and dtype is not torch.float32
           and (sa0 * 2) % 16 == 0 and (sb1 * 2) % 16 == 0 and a_ptr % 16 == 0
           and b_ptr % 16 == 0 and a.is_cuda)
    key = (config, dtype, N, K, sa0, sa1, sb0, sb1, a_ptr % 16 == 0, b_ptr % 16 == 0,
           None if bias is None else bias.data_ptr() % 16 == 0, M * K > 2**31, K * N > 2**31,
           c_large, tma, a.device.index)
    has_bias = bias is not None
    if tma:
        head = (_TmaOperand(a, (M, K), (sa0, 1)), _TmaOperand(b, (N, K), (sb1, 1)),
                c, ws, bias, locks, M, N, K, N, 1)
    else:
        head = (a, b, c, ws, bias, locks, M, N, K, sa0, sa1, sb0, sb1, N, 1)
    _launch(key, grid0, head, config, num_programs, has_bias, tma)
    if plan_key is not None and key in _COMPILED:
        if len(_PLANS) >= MAX_PLANS:  # one plan per call shape: bound them (a few hundred bytes)
            _PLANS.clear()
        _PLANS[plan_key] = _make_plan(_COMPILED[key], _TAILS[key], grid0, tma, M, N, K,
                                      (sa0, sa1, sb0, sb1), c.device, dtype,
                                      split_k if parallel else 1, num_mn)
    return c


def _make_plan(compiled, tail: tuple, grid0: int, tma: bool, M: int, N: int, K: int,
               strides: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype,
               split_k: int, num_mn: int):
    """A launch with everything but the tensors fixed: allocate, launch, return.

    The same arguments in the same order as the first launch of its kind passed to Triton; the
    tensors' strides and alignment are part of the plan's key, so only their addresses change.
    Where the compiled kernel's launcher allows it (:func:`_raw_launcher`), the plan calls the
    launcher Triton's own wrapper calls, with the descriptor arguments expanded as Triton expands
    them and kept per operand address; otherwise it calls the compiled kernel's ``run``.
    """
    stream_of, device_now = _STREAM_OF, _DEVICE_NOW
    function, packed = compiled.function, compiled.packed_metadata
    run = compiled.run
    raw = _raw_launcher(compiled, tma)
    parallel = split_k > 1
    tiles = num_mn if parallel else 0
    # everything after the tensors, fixed by the plan's key (the strides are in it)
    if tma:
        rest = (M, N, K, N, 1, *tail)
    else:
        rest = (M, N, K, *strides, N, 1, *tail)

    def plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        c = torch.empty((M, N), device=device, dtype=dtype)  # [M, N]
        stream = stream_of(device_now())
        locks = _lock_buffer(device, stream, tiles)
        ws = _workspace(device, stream, split_k, M, N) if parallel else c  # >= S*M*N, flat
        if raw is not None:
            if tma:
                raw(grid0, stream, function, packed,
                    (*raw.descriptor(0, a, (M, K), (strides[0], 1)),
                     *raw.descriptor(1, b, (N, K), (strides[3], 1)), c, ws, bias, locks, *rest))
            else:
                raw(grid0, stream, function, packed, (a, b, c, ws, bias, locks, *rest))
        elif tma:
            run(grid0, 1, 1, stream, function, packed, None, None, None,
                _TmaOperand(a, (M, K), (strides[0], 1)), _TmaOperand(b, (N, K), (strides[3], 1)),
                c, ws, bias, locks, *rest)
        else:
            run(grid0, 1, 1, stream, function, packed, None, None, None,
                a, b, c, ws, bias, locks, *rest)
        return c

    return plan


# ---- split-K tile counters and workspace ---------------------------------------------------------
#
# Parallel split-K counts each tile's arrived partials in an int32 counter that the last program
# of the tile sets back to zero, so a buffer is zero between launches; the float32 partials live
# in a workspace that the same launch has finished reading when it ends. Launches on one stream
# run in order and may share both; launches on two streams may run at once and must not, so they
# are kept per (device, stream). A buffer that has to grow is replaced, and the old one is kept
# alive: a CUDA graph captured with it still points at it. (Two graphs captured on one stream
# must therefore not be replayed at the same time on two streams, as with any captured
# workspace.) Workspaces above WORKSPACE_KEPT_MAX elements are allocated per call instead.

_LOCKS: dict[tuple, torch.Tensor] = {}  # (device index, stream handle) -> int32 counters, zeros
_RETIRED_LOCKS: list[torch.Tensor] = []


def _lock_buffer(device: torch.device, stream: int, tiles: int) -> torch.Tensor:
    locks = _LOCKS.get((device.index, stream))
    if locks is None or locks.numel() < tiles:  # (tiles = 0: any buffer, for the signature)
        if locks is not None:
            _RETIRED_LOCKS.append(locks)
        size = max(tiles, 1024 if locks is None else 2 * locks.numel())
        locks = torch.zeros(size, device=device, dtype=torch.int32)
        _LOCKS[(device.index, stream)] = locks
    return locks


WORKSPACE_KEPT_MAX = 1 << 24  # float32 elements (64 MiB) kept per (device, stream) at most
_WORKSPACES: dict[tuple, torch.Tensor] = {}  # (device index, stream handle) -> float32, flat
_RETIRED_WORKSPACES: list[torch.Tensor] = []


def _workspace(device: torch.device, stream: int, split_k: int, M: int, N: int) -> torch.Tensor:
    """This stream's float32 workspace, flat, with room for [split_k, M, N] at its start (the
    kernel indexes it from its address; above WORKSPACE_KEPT_MAX a fresh one for this call)."""
    need = split_k * M * N
    if need > WORKSPACE_KEPT_MAX:
        return torch.empty(need, device=device, dtype=torch.float32)
    ws = _WORKSPACES.get((device.index, stream))
    if ws is None or ws.numel() < need:
        if ws is not None:
            _RETIRED_WORKSPACES.append(ws)
        size = min(WORKSPACE_KEPT_MAX, max(need, 1 << 20 if ws is None else 2 * ws.numel()))
        ws = torch.empty(size, device=device, dtype=torch.float32)
        _WORKSPACES[(device.index, stream)] = ws
    return ws


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


# ---- the compiled kernel's launcher, without Triton's per-call Python ---------------------------
#
# ``CompiledKernel.run`` (Triton's ``CudaLauncher``) allocates the kernel's scratch memory and,
# for a kernel with tensor-descriptor arguments, goes through a wrapper that expands every
# descriptor into the CUDA tensor map and the shape and strides the kernel takes, encoding the
# tensor map again on each call (``make_tensordesc_arg``). That is about 8 us per eager call on the
# H200's host for the two descriptors (kernels/results/host_cost_nvidia_h200.json: the m=1 rows,
# which use descriptor loads, against the m=16 rows, which do not). A tensor map is a function
# of the address, shape, strides and the kernel's block and swizzle only; a plan fixes all but the
# address, so :class:`_RawLauncher` keeps each expansion per address, using Triton's own
# ``make_tensordesc_arg`` to make it, and calls the launcher the wrapper calls. Three calling
# conventions are known: triton 3.6 (a launcher compiled per kernel, arguments flattened after
# the scratch pointers and the metadata) and triton 3.7/3.8 (one launcher for all kernels, the
# argument list last, after the kernel's argument annotations and signature). Anything else (no
# such wrapper, scratch memory, a sanitizer, descriptors Triton does not lower to tensor maps)
# keeps ``run``.

_DESCRIPTORS_KEPT = 64  # per operand of a plan; then the kept expansions start again


class _RawLauncher:
    """Launch one compiled kernel as Triton's ``CudaLauncher.__call__`` would, minus its Python."""

    __slots__ = ("launch", "listed", "coop", "pdl", "annotations", "signature", "metas", "make",
                 "kept")

    def __init__(self, launch, listed: bool, run, metas, make):
        self.launch, self.listed, self.metas, self.make = launch, listed, metas, make
        self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
        self.annotations = getattr(run, "arg_annotations", None)
        self.signature = getattr(run, "kernel_signature", None)
        self.kept: tuple[dict, ...] = tuple({} for _ in metas)

    def descriptor(self, i: int, base: torch.Tensor, shape: tuple, strides: tuple) -> list:
        """Descriptor argument ``i`` expanded as Triton expands it (kept per address)."""
        kept = self.kept[i]
        ptr = base.data_ptr()
        expanded = kept.get(ptr)
        if expanded is None:
            if len(kept) >= _DESCRIPTORS_KEPT:
                kept.clear()
            expanded = kept[ptr] = self.make(_TmaOperand(base, shape, strides), self.metas[i])
        return expanded

    def __call__(self, grid0: int, stream: int, function, packed, args: tuple) -> None:
        if self.listed:  # triton 3.7, 3.8: a list after expanding descriptors, else the tuple
            self.launch(grid0, 1, 1, stream, function, self.coop, self.pdl, packed, None, None,
                        None, None, None, self.annotations, self.signature,
                        list(args) if self.metas else args)
        else:  # triton 3.6
            self.launch(grid0, 1, 1, stream, function, self.coop, self.pdl, None, None, packed,
                        None, None, None, *args)


def _raw_launcher(compiled, tma: bool) -> _RawLauncher | None:
    """The launcher under ``compiled.run``, or None where only ``run`` is known to be right."""
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "gsan_enabled", False):
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        return None
    listed = hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")
    closure = getattr(launch, "__closure__", None)
    if not tma:
        # no descriptor: Triton's wrapper is the launcher itself (a C function)
        return None if closure else _RawLauncher(launch, listed, run, (), None)
    if not closure:
        return None
    cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in closure)))
    inner, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if inner is None or not metas or len(metas) != 2 or any(m is None for m in metas):
        return None
    make = cells.get("make_tensordesc_arg")  # triton 3.8 passes it in: (arg, meta, base_args)
    if make is not None:
        make3 = make
        make = lambda arg, meta: make3(arg, meta, None)  # noqa: E731 (its third argument is unused)
    else:
        import sys

        make = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        if make is None:
            return None
    return _RawLauncher(inner, listed, run, tuple(metas), make)


_PLANS: dict[tuple, object] = {}  # plan key (see matmul_persistent) -> plan
#: Plans kept at most; then they are dropped and rebuilt (a rebuild is one direct launch through
#: the compiled kernel). vLLM's eager steps can see every M up to its batched-token limit.
MAX_PLANS = 16384


# ---- the launch --------------------------------------------------------------------------------
#
# Triton's ``kernel[grid](...)`` binds and specialises every argument and hashes the result on
# each call: 40-60 us of host time per call in triton 3.6 on the H200's host, about six times
# torch.mm's, paid on every eager GEMM in vLLM (steps beyond its CUDA-graph sizes).
# The first launch of each kind goes through it and keeps the compiled kernel it returns; later
# launches of the same kind call that kernel's launcher directly, with the same arguments, as
# ``JITFunction.run`` itself does after its cache lookup (triton 3.4-3.8 share that call).
#
# "The same kind" is a key holding everything Triton specialises on: for the GEMM, the config (every
# constexpr and launch option), the dtype, N and K and the four operand strides (values, so
# their ==1 and %16 classes too), each pointer's 16-byte alignment, the int64-offset flags and
# the device. M is declared ``do_not_specialize`` and the output, workspace and split-K counters
# are allocations of their own (always aligned), so neither needs more. The path is off under
# ``BISTAT_GEMM_FAST_LAUNCH=0``, in Triton's interpreter (no compiled kernel), and while a
# launch hook is installed (profilers: Triton then builds launch metadata per call; with none,
# it passes the empty hook chains, which do nothing, where the direct path passes None).

FAST_LAUNCH_ENV = "BISTAT_GEMM_FAST_LAUNCH"
_FAST_LAUNCH = os.environ.get(FAST_LAUNCH_ENV, "1").strip().lower() not in {"0", "false", "no",
                                                                             "off"}
_COMPILED: dict[tuple, object] = {}  # launch key -> Triton's CompiledKernel
_STREAM_OF = None  # triton.runtime.driver.active.get_current_stream, bound at the first launch
_DEVICE_NOW = None  # ... get_current_device


class _TmaOperand:
    """A 2-D operand as Triton's host-side tensor descriptor presents it to the launcher.

    The first launch of a kind passes real ``TensorDescriptor`` objects (Triton specialises on
    them); later direct launches pass this lighter object with the attributes the launcher reads
    (``base``, ``shape``, ``strides``, ``padding``; triton 3.8 also ``round_f32_to_tf32``, and
    ``element_strides`` in im2col mode). The launcher validated the alignment
    and strides a descriptor needs before choosing the tensor-memory path.
    """

    __slots__ = ("base", "shape", "strides", "padding")
    # read by triton 3.8's descriptor packing (tiled mode, no TF32 rounding of fp32 operands)
    round_f32_to_tf32 = False
    element_strides = None

    def __init__(self, base: torch.Tensor, shape: tuple[int, int], strides: tuple[int, int]):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"

    def descriptor(self, block: list[int]):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), block)


def _constexprs(config: tables.GemmConfig, num_programs: int, has_bias: bool, tma: bool,
                dtype: torch.dtype, large: tuple[bool, bool, bool]) -> tuple:
    common = (config.block_m, config.block_n, config.block_k, config.group_m, config.split_k,
              num_programs)
    if tma:
        return common + (large[2], has_bias, config.fuse_splits, config.flat_splits)
    return common + (*large, has_bias, dtype == torch.float32, config.fuse_splits,
                     config.flat_splits)


def _launch(key: tuple, grid0: int, head: tuple, config: tables.GemmConfig, num_programs: int,
            has_bias: bool, tma: bool) -> None:
    """Launch the GEMM kernel: directly when this kind was launched before, else through Triton."""
    if _FAST_LAUNCH and _run_direct(key, grid0, head):
        return
    dtype = head[2].dtype
    large = (key[11], key[12], key[13])
    tail = _constexprs(config, num_programs, has_bias, tma, dtype, large)
    if tma:
        a_op, w_op = head[0], head[1]
        jit_head = (a_op.descriptor([config.block_m, config.block_k]),
                    w_op.descriptor([config.block_n, config.block_k])) + head[2:]
        kernel = _matmul_persistent_tma_kernel
    else:
        jit_head = head
        kernel = _matmul_persistent_kernel
    _launch_jit(key, kernel, grid0, jit_head, tail, config.num_warps, config.num_stages)


def _run_direct(key: tuple, grid0: int, head: tuple) -> bool:
    compiled = _COMPILED.get(key)
    if compiled is None or not _hooks_idle():
        return False
    compiled.run(grid0, 1, 1, _STREAM_OF(_DEVICE_NOW()), compiled.function,
                 compiled.packed_metadata, None, None, None, *head, *_TAILS[key])
    return True


def _launch_jit(key: tuple, kernel, grid0: int, head: tuple, tail: tuple, num_warps: int,
                num_stages: int) -> None:
    """Launch through Triton's JIT call and keep the compiled kernel it returns for ``key``."""
    global _STREAM_OF, _DEVICE_NOW
    compiled = kernel[(grid0,)](*head, *tail, num_warps=num_warps, num_stages=num_stages)
    if _FAST_LAUNCH and hasattr(compiled, "packed_metadata") and not _interpreting():
        if _STREAM_OF is None:
            _STREAM_OF, _DEVICE_NOW = _stream_functions()
        _COMPILED[key] = compiled
        _TAILS[key] = tail


_TAILS: dict[tuple, tuple] = {}  # launch key -> its constexpr arguments, in signature order


def _stream_functions():
    """Triton's (current stream of a device, current device): what ``JITFunction.run`` uses."""
    from triton.runtime import driver

    return driver.active.get_current_stream, driver.active.get_current_device


def _hooks_idle() -> bool:
    """No launch hook is installed (triton >= 3.6 keeps an empty ``HookChain`` there; older
    versions None). With one, Triton builds launch metadata per call: the JIT path does that."""
    runtime = _RUNTIME_KNOBS
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_RUNTIME_KNOBS = triton.knobs.runtime  # one object for the process; its hooks are read per call


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in {"", "0"}


def fast_launch_stats() -> dict[str, int]:
    """How many kinds of launch go straight to a compiled kernel (for benches and tests)."""
    return {"compiled_kinds": len(_COMPILED), "plans": len(_PLANS), "enabled": int(_FAST_LAUNCH)}


def set_fast_launch(enabled: bool) -> None:
    """Turn the direct launch on or off in this process (benches compare the two side by side)."""
    global _FAST_LAUNCH
    _FAST_LAUNCH = bool(enabled)
    _PLANS.clear()


def precompile_buckets(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                       entry: tables.ShapeConfig) -> int:
    """Launch every distinct bucket configuration of ``entry`` once on ``a[:1]``: the kinds a later
    call of any M will need are then compiled (Triton's cache) and kept (:func:`_launch`).

    The launches use the caller's own ``b``, ``bias`` and the first row of ``a``, so their kinds
    (strides, alignment, dtype, bias or not) are exactly those of the calls to come; only M, which
    is not specialised, differs. Returns the number of configurations launched. Nothing is
    launched while a CUDA graph is being captured (the launches would be captured with it) or
    when ``a`` has no rows.
    """
    if a.shape[0] == 0 or (a.is_cuda and torch.cuda.is_current_stream_capturing()):
        return 0
    configs = list(dict.fromkeys(entry.config_for(b_.m_max) for b_ in entry.buckets))
    for config in configs:
        matmul_persistent(a[:1], b, bias, config=config)
    return len(configs)


def default_matmul(a: torch.Tensor, b: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same kernel with vLLM 0.25.0's fixed configuration for every M (the baseline)."""
    return matmul_persistent(a, b, bias, config=tables.DEFAULT_CONFIGS[dtype_name(a.dtype)])
