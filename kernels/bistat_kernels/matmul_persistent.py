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
``[SPLIT_K, M, N]`` and ``_splitk_reduce_kernel`` computes ``((p0 + p1) + ...) + bias``. *Fused*
(``FUSE_SPLITS``): one work item per tile runs the splits one after another; each split starts
from a fresh float32 zero accumulator and runs the very same ``tl.dot(a, b, acc)`` chain over the
same K-tiles with the same masks (one helper, :func:`_split_partial`, serves both modes), and the
partial sums are added in registers in the reduce kernel's order: ``total = p0``, then
``total = total + p1``, ... , then ``+ bias`` in float32, then the cast. Storing a float32 partial
to the workspace and loading it back is exact, and float32 addition is the same IEEE operation in
either kernel, so fused and parallel produce the same bits: the same operations on the same values
in the same order, with no workspace and no second kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bistat_kernels import tables

_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                      torch.float32: "float32"}
_SPLITK_REDUCE_BLOCK = 1024

# Resolved once per process (first launch): the multiprocessor count and the device's name.
# Plain module values, not functools.lru_cache (torch.compile's tracer rejects lru_cache).
_NUM_SMS = 0
_DEVICE_NAME: str | None = None
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
def _split_partial(a_ptr, b_ptr, offs_am, offs_bn, K, stride_am, stride_ak, stride_bk, stride_bn,
                   k_tile0, k_tiles_per_split,
                   BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                   BLOCK_SIZE_K: tl.constexpr, A_LARGE: tl.constexpr, B_LARGE: tl.constexpr,
                   IEEE: tl.constexpr):
    # One split's float32 partial sum of a tile: K-tiles k_tile0 .. k_tile0 + k_tiles_per_split - 1
    # added one after another into a fresh zero accumulator (both split-K modes call this).
    offs_k_base = tl.arange(0, BLOCK_SIZE_K)
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(k_tiles_per_split):
        # K-tiles past K load zeros: adding an exact 0 leaves the sum's bits unchanged.
        k_start = (k_tile0 + kk) * BLOCK_SIZE_K
        if A_LARGE or B_LARGE:
            offs_k = k_start + offs_k_base.to(tl.int64)
        else:
            offs_k = k_start + offs_k_base
        a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
        b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
        a = tl.load(a_ptrs, mask=offs_k_base[None, :] < K - k_start, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k_base[:, None] < K - k_start, other=0.0)
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


@triton.jit(do_not_specialize=["M"])
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    A_LARGE: tl.constexpr, B_LARGE: tl.constexpr, C_LARGE: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, FUSE_SPLITS: tl.constexpr,
):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)  # a function of (K, BLOCK_K, SPLIT_K) only
    num_mn = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n

    if FUSE_SPLITS:
        # Fused split-K: num_pid_m x num_pid_n tiles; each runs its SPLIT_K splits in order and
        # adds the partial sums as _splitk_reduce_kernel does: total = p0; total = total + p1; ...
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
        for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=True):
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
                # float32 partial sums, workspace [SPLIT_K, M, N] contiguous
                ws_offs = (split.to(tl.int64) * M * N + offs_cm.to(tl.int64)[:, None] * N
                           + offs_cn.to(tl.int64)[None, :])
                tl.store(ws_ptr + ws_offs, accumulator, mask=c_mask)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, M, N, stride_cm, stride_cn,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # C[m, n] = ((ws[0, m, n] + ws[1, m, n]) + ...) + bias[n], always in this order.
    pid = tl.program_id(axis=0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    total = M.to(tl.int64) * N
    mask = offs < total
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    offs_m = offs // N
    offs_n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs_m * stride_cm + offs_n * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def _device_facts(device: torch.device) -> tuple[int, str | None]:
    """(programs to launch at most, device name), read once per process."""
    global _NUM_SMS, _DEVICE_NAME
    if _NUM_SMS == 0:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            _NUM_SMS = props.multi_processor_count
            _DEVICE_NAME = props.name
        else:
            _NUM_SMS = _INTERPRETER_NUM_PROGRAMS
            _DEVICE_NAME = None
    return _NUM_SMS, _DEVICE_NAME


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
    (no float32 workspace, no reduce kernel) with the same bits as the parallel mode; shapes without an entry use vLLM 0.25.0's fixed configuration, which is
    logged once per shape.
    """
    assert a.dim() == 2 and b.dim() == 2, "matmul_persistent: a and b must be 2-D"
    assert a.shape[1] == b.shape[0], "Incompatible dimensions"
    assert a.dtype == b.dtype, "Incompatible dtypes"
    assert bias is None or (bias.dim() == 1 and bias.shape[0] == b.shape[1]), \
        "bias must be 1-D of length N"
    M, K = a.shape
    N = b.shape[1]
    name = dtype_name(a.dtype)
    num_sms, device_name = _device_facts(a.device)
    if config is None:
        config = tables.lookup_config(M, N, K, name, device_name)
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)  # [M, N]
    if M == 0 or N == 0:
        return c
    split_k = config.split_k
    fused = config.fuse_splits  # always False when split_k == 1 (GemmConfig normalises it)
    if split_k > 1 and not fused:
        ws = torch.empty((split_k, M, N), device=a.device, dtype=torch.float32)  # [S, M, N]
    else:
        ws = c  # unused by the kernel: no split, or splits added in the kernel
    num_tiles = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
                 * (1 if fused else split_k))
    num_programs = num_sms * config.programs_per_sm
    grid = (min(num_programs, num_tiles),)
    _matmul_persistent_kernel[grid](
        a, b, c, ws, bias,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_SIZE_M=config.block_m, BLOCK_SIZE_N=config.block_n, BLOCK_SIZE_K=config.block_k,
        GROUP_SIZE_M=config.group_m, SPLIT_K=split_k, NUM_PROGRAMS=num_programs,
        A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=c.numel() > 2**31,
        HAS_BIAS=bias is not None and (split_k == 1 or fused), IEEE=a.dtype == torch.float32,
        FUSE_SPLITS=fused, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1 and not fused:
        reduce_grid = (triton.cdiv(M * N, _SPLITK_REDUCE_BLOCK),)
        _splitk_reduce_kernel[reduce_grid](
            ws, c, bias, M, N, c.stride(0), c.stride(1),
            SPLIT_K=split_k, BLOCK=_SPLITK_REDUCE_BLOCK, HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return c


def default_matmul(a: torch.Tensor, b: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same kernel with vLLM 0.25.0's fixed configuration for every M (the baseline)."""
    return matmul_persistent(a, b, bias, config=tables.DEFAULT_CONFIGS[dtype_name(a.dtype)])
