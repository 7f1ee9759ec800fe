"""Compile the sweep's launch candidates ahead of timing, in parallel, into Triton's cache.

The sweep times thousands of launch configurations; compiled one after another in the timed
process they would take most of its time. :func:`precompile` compiles them first in worker
processes (``spawn``), in chunks of :data:`PRECOMPILE_CHUNK`, and a budget stops it between chunks;
the timed process then only loads them from Triton's on-disk cache.

That works only while the workers and the timed process agree on Triton's cache key, which
includes the ptxas version: :func:`pin_triton_toolchain`, called before anything compiles, fixes
``TRITON_CACHE_DIR`` and ``TRITON_PTXAS_PATH`` for the whole command (the module docstring of
:mod:`bistat_kernels.sweep` tells the device call in which a ``torch.compile`` moved them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

from bistat_kernels import matmul_kernels
from bistat_kernels import matmul_persistent as mp
from bistat_kernels import tables


def pin_triton_toolchain() -> dict[str, str]:
    """Fix Triton's cache folder and ptxas for this process and every process it starts.

    Sets ``TRITON_CACHE_DIR`` and ``TRITON_PTXAS_PATH`` to what Triton resolves now, unless they
    are set already, and returns both. Call it before anything compiles: Inductor sets the two
    variables only where they are unset, so a later ``torch.compile`` in the same process can no
    longer point the precompile workers at another ptxas than the one the timed process keyed its
    kernels with (the module docstring of :mod:`bistat_kernels.sweep`).
    """
    from triton import knobs  # triton >= 3.4 (the H200 image has 3.6.0)

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir
    if not os.environ.get("TRITON_PTXAS_PATH"):
        os.environ["TRITON_PTXAS_PATH"] = knobs.nvidia.ptxas.path  # resolves Triton's bundled one
    return {key: os.environ[key] for key in ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")}


def _compile_worker(args: tuple[str, list[tuple[int, ...]]]) -> list[str]:
    dtype_name, raw = args
    dtype = getattr(torch, dtype_name)
    errors = []
    for fields in raw:
        cfg = tables.GemmConfig(*fields)
        try:
            # the workspace is float32 only in parallel split-K; otherwise the launcher passes c
            ws_dtype = torch.float32 if cfg.split_k > 1 and not cfg.fuse_splits else dtype
            if cfg.tma:
                _warm_tma(cfg, dtype, ws_dtype)
                continue
            matmul_kernels._matmul_persistent_kernel.warmup(
                dtype, dtype, dtype, ws_dtype, None, torch.int32,
                64, 64, 64, 64, 1, 1, 64, 64, 1,
                BLOCK_SIZE_M=cfg.block_m, BLOCK_SIZE_N=cfg.block_n, BLOCK_SIZE_K=cfg.block_k,
                GROUP_SIZE_M=cfg.group_m, SPLIT_K=cfg.split_k,
                NUM_PROGRAMS=_WORKER_NUM_SMS * cfg.programs_per_sm,
                A_LARGE=False, B_LARGE=False, C_LARGE=False, HAS_BIAS=False,
                IEEE=dtype == torch.float32, FUSE_SPLITS=cfg.fuse_splits,
                FLAT_SPLITS=cfg.flat_splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                grid=(1,))
        except Exception as exc:  # noqa: BLE001 - reported per config; the real launch re-raises
            errors.append(f"{cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    return errors


def _warm_tma(cfg: tables.GemmConfig, dtype: torch.dtype, ws_dtype: torch.dtype) -> None:
    """Compile the descriptor-load kernel for ``cfg`` (descriptors need real CUDA tensors)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.zeros(64, 64, device="cuda", dtype=dtype)  # [M, K]
    w = torch.zeros(64, 64, device="cuda", dtype=dtype)  # [N, K]
    c = torch.empty(64, 64, device="cuda", dtype=dtype)
    ws = torch.empty(1, device="cuda", dtype=ws_dtype)
    locks = torch.zeros(1, device="cuda", dtype=torch.int32)
    matmul_kernels._matmul_persistent_tma_kernel.warmup(
        TensorDescriptor(a, [64, 64], [64, 1], [cfg.block_m, cfg.block_k]),
        TensorDescriptor(w, [64, 64], [64, 1], [cfg.block_n, cfg.block_k]),
        c, ws, None, locks, 64, 64, 64, 64, 1,
        BLOCK_SIZE_M=cfg.block_m, BLOCK_SIZE_N=cfg.block_n, BLOCK_SIZE_K=cfg.block_k,
        GROUP_SIZE_M=cfg.group_m, SPLIT_K=cfg.split_k,
        NUM_PROGRAMS=_WORKER_NUM_SMS * cfg.programs_per_sm, C_LARGE=False, HAS_BIAS=False,
        FUSE_SPLITS=cfg.fuse_splits, FLAT_SPLITS=cfg.flat_splits, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, grid=(1,))


_WORKER_NUM_SMS = int(os.environ.get("BISTAT_PRECOMPILE_NUM_SMS", "0") or 0)


PRECOMPILE_CHUNK = 4  # configs per task: a budget stops the precompile within one chunk's time


def precompile(configs: Sequence[tables.GemmConfig], dtype: torch.dtype, num_sms: int,
               workers: int, budget_s: float | None = None,
               clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Compile ``configs`` in ``workers`` processes into Triton's on-disk cache.

    The timed process then loads them from the cache instead of compiling one after another.
    Returns the per-config failures (out-of-resources configs fail here and are skipped later).
    With ``budget_s`` (seconds of ``clock``), chunks not started when it runs out are cancelled
    (the chunks running then finish) and listed among the failures as not precompiled: those
    configs compile when first timed, which the sweep's raw records' ``first_launch_s`` shows.
    """
    os.environ["BISTAT_PRECOMPILE_NUM_SMS"] = str(num_sms)
    raw = [tuple(asdict(c).values()) for c in configs]
    # in order, so that a budget cut leaves the last shapes' configs, not every shape's last ones
    chunks = [raw[i:i + PRECOMPILE_CHUNK] for i in range(0, len(raw), PRECOMPILE_CHUNK)]
    name = mp.dtype_name(dtype)
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, wait

    ctx = multiprocessing.get_context("spawn")
    errors: list[str] = []
    start = clock()
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending = {pool.submit(_compile_worker, (name, c)): len(c) for c in chunks}
        while pending:
            left = None if budget_s is None else budget_s - (clock() - start)
            if left is not None and left <= 0:
                skipped = sum(n for f, n in pending.items() if f.cancel())
                if skipped:
                    errors.append(f"{skipped} configs not precompiled: the precompile's budget "
                                  f"of {budget_s:.0f}s ran out")
                for future in [f for f in pending if not f.cancelled()]:
                    errors.extend(future.result())  # the chunks already running
                break
            done, _ = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            for future in done:
                del pending[future]
                errors.extend(future.result())
    return errors
