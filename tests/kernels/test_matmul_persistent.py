"""The GEMM under the Triton interpreter: bitwise row invariance per bucket, accuracy, edges."""

from __future__ import annotations

import logging

import pytest

from helpers_kernels import (
    assert_verbose_allclose, needs_gpu, small_table_dict, torch)

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import tables  # noqa: E402
from bistat_kernels.probe import row_positions  # noqa: E402

BATCH_SIZES = (2, 3, 7, 8, 16, 64)


@pytest.fixture
def small_table():
    table = tables.parse_table(small_table_dict(), "small_table")
    tables.set_device_table(table)
    yield table
    tables.reset_device_table()


def _inputs(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen)  # [M, K]
    w = torch.randn(n, k, generator=gen)  # [N, K]
    bias = torch.randn(n, generator=gen)  # [N]
    return a, w, bias


@pytest.mark.parametrize("key", [("float32", 40, 72), ("float32", 37, 100)],
                         ids=["bk32-split1", "bk16-split3-ragged"])
def test_rows_alone_equal_rows_in_batch_for_every_bucket(small_table, key):
    entry = small_table.entries[key]
    _, n, k = key
    a, w, bias = _inputs(max(BATCH_SIZES), n, k, seed=1)
    # every bucket is exercised: M=1 (bucket 1), 2..4 (bucket 2), 7..16, 64
    used = {entry.config_for(m) for m in BATCH_SIZES} | {entry.config_for(1)}
    assert len(used) == len(entry.buckets)
    alone = {r: mp.matmul_persistent(a[r:r + 1], w.t(), bias)[0]
             for m in BATCH_SIZES for r in row_positions(m)}
    for m in BATCH_SIZES:
        batch = mp.matmul_persistent(a[:m], w.t(), bias)  # [m, N]
        for r in row_positions(m):
            assert torch.equal(batch[r], alone[r]), (m, r, entry.config_for(m))


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (16, 40, 72), (7, 37, 100), (64, 37, 100)])
def test_accuracy_against_float64(small_table, m, n, k):
    a, w, bias = _inputs(m, n, k, seed=2)
    out = mp.matmul_persistent(a, w.t(), bias)
    ref = a.double() @ w.double().t() + bias.double()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # IEEE fp32 products: error of an fp32 sum of K terms, far below TF32's ~1e-3
    assert_verbose_allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_bias_is_added_once(small_table):
    a, w, bias = _inputs(5, 40, 72, seed=3)
    with_bias = mp.matmul_persistent(a, w.t(), bias)
    without = mp.matmul_persistent(a, w.t())
    assert_verbose_allclose(with_bias - without, bias.expand(5, 40), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(3, 17, 5), (5, 33, 1), (9, 1, 40), (2, 50, 0)])
def test_ragged_and_degenerate_shapes_use_the_default_config(m, n, k):
    tables.set_device_table(None)
    try:
        gen = torch.Generator().manual_seed(4)
        a = torch.randn(m, k, generator=gen)
        b = torch.randn(k, n, generator=gen)
        bias = torch.randn(n, generator=gen)
        out = mp.matmul_persistent(a, b, bias)
        ref = a.double() @ b.double() + bias.double()
        assert_verbose_allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    finally:
        tables.reset_device_table()


def test_empty_batch_returns_an_empty_output(small_table):
    w = torch.randn(40, 72)
    out = mp.matmul_persistent(torch.empty(0, 72), w.t())
    assert out.shape == (0, 40)


def test_split_k_reduces_partials_in_a_fixed_order():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(8, 96, generator=gen)
    b = torch.randn(96, 24, generator=gen)
    split1 = tables.GemmConfig(16, 16, 16, 8, 4, 2, split_k=1)
    split3 = tables.GemmConfig(16, 16, 16, 8, 4, 2, split_k=3)
    other3 = tables.GemmConfig(32, 32, 16, 1, 4, 3, split_k=3, programs_per_sm=2)
    out1 = mp.matmul_persistent(a, b, config=split1)
    out3 = mp.matmul_persistent(a, b, config=split3)
    assert_verbose_allclose(out3, out1, rtol=1e-5, atol=1e-5)
    # same reduction layout, different launch parameters: identical bits
    assert torch.equal(mp.matmul_persistent(a, b, config=other3), out3)
    # split 3 of 6 K-tiles: (t0+t1) + (t2+t3) + (t4+t5), reproduced in float32 by hand
    parts = [a[:, 32 * s:32 * (s + 1)] @ b[32 * s:32 * (s + 1)] for s in range(3)]
    assert_verbose_allclose(out3, (parts[0] + parts[1]) + parts[2], rtol=1e-6, atol=1e-5)


def test_input_checks_name_the_problem():
    a = torch.randn(2, 8)
    with pytest.raises(AssertionError, match="Incompatible dimensions"):
        mp.matmul_persistent(a, torch.randn(7, 4))
    with pytest.raises(AssertionError, match="Incompatible dtypes"):
        mp.matmul_persistent(a, torch.randn(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported; expected "
                                         "bfloat16, float16 or float32"):
        mp.matmul_persistent(a.double(), torch.randn(8, 4, dtype=torch.float64))


def test_unknown_shape_falls_back_and_says_so_once(caplog):
    tables.set_device_table(None)
    try:
        with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
            for _ in range(3):
                mp.matmul_persistent(torch.randn(2, 8), torch.randn(8, 4))
        messages = [r.getMessage() for r in caplog.records]
        assert messages == ["bistat_kernels: batch-invariant GEMM float32 N=4 K=8 served by "
                            "vLLM's fixed configuration, on bistat's kernel "
                            "GemmConfig(block_m=128, block_n=128, "
                            "block_k=32, group_m=8, num_warps=8, num_stages=3, split_k=1, "
                            "programs_per_sm=1, fuse_splits=False, tma=False, "
                            "flat_splits=False)"]
    finally:
        tables.reset_device_table()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_rows_invariant_with_the_shipped_table(dtype):
    table = tables.load_table(tables.TABLES_DIR / "nvidia_h200.json")
    tables.set_device_table(table)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        dt = getattr(torch, dtype)
        w = torch.randn(4096, 4096, device="cuda", dtype=dt, generator=gen) * 0.02
        a = torch.randn(1024, 4096, device="cuda", dtype=dt, generator=gen)
        batch = mp.matmul_persistent(a, w.t())
        for r in (0, 1, 511, 1023):
            assert torch.equal(mp.matmul_persistent(a[r:r + 1], w.t())[0], batch[r])
    finally:
        tables.reset_device_table()
