"""The batch-invariant persistent GEMM's Triton kernels.

``_matmul_persistent_kernel`` loads the operand tiles through pointers (bfloat16, float16, and
float32 with IEEE-exact products: ``IEEE``); ``_matmul_persistent_tma_kernel`` loads them through
tensor descriptors (bfloat16 and float16 only) and computes every output element as the same sum
in the same order. Both share the ``@triton.jit`` helpers below (the tile walk, the K-tile loads
and the split-K epilogues). The launcher that picks their configuration and launches them is
:func:`bistat_kernels.matmul_persistent.matmul_persistent`.

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

import triton
import triton.language as tl


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
