"""The probe's extra gate cases under the interpreter: K a power of two, float32 in IEEE precision.

vLLM #55131 reports upstream's persistent kernel not row-invariant at K a power of two, and vLLM
#55466 that ``tl.dot`` silently used TF32 for float32 inputs. Both gates of the probe must hold at
K 512 and 1024 with BLOCK_K 64 and 128 (and a split-K layout), and float32 results must match an
IEEE float32 reference to float32 accuracy. The interpreter ignores ``input_precision``, so
conftest's dot rounds operands to TF32 where a GPU would (interpreter_dot.py); a TF32 run below
shows the float32 tolerance failing it.
"""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from helpers_kernels import table_dict, torch

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import probe, tables  # noqa: E402

MAX_M = 33


def _pow2_table_dict() -> dict:
    """fp32 entries at K 512 and 1024: BLOCK_K 64 and 128, one split-K layout with a fused bucket."""
    buckets = [
        {"m_max": 1, "block_m": 16, "block_n": 32, "group_m": 1, "num_warps": 4, "num_stages": 2},
        {"m_max": 8, "block_m": 16, "block_n": 64, "group_m": 8, "num_warps": 4, "num_stages": 3,
         "programs_per_sm": 2},
        {"m_max": 32, "block_m": 32, "block_n": 32, "group_m": 2, "num_warps": 4, "num_stages": 2},
    ]
    fused = [dict(b) for b in buckets]
    fused[2]["fuse_splits"] = True
    return table_dict([(64, 512, 64, 1, buckets), (64, 1024, 128, 1, buckets),
                       (48, 1024, 64, 2, fused)])


@pytest.fixture(scope="module")
def pow2_table():
    table = tables.parse_table(_pow2_table_dict(), "pow2_table")
    tables.set_device_table(table)
    yield table
    tables.reset_device_table()


@pytest.mark.parametrize("key", [("float32", 64, 512), ("float32", 64, 1024),
                                 ("float32", 48, 1024)],
                         ids=["k512-bk64", "k1024-bk128", "k1024-bk64-split2-fused"])
def test_both_gates_hold_at_k_a_power_of_two(pow2_table, key):
    dtype, n, k = key
    entry = pow2_table.entries[key]
    result = probe.probe_shape(n, k, torch.float32, "cpu", entry, max_m=MAX_M,
                               accuracy_ms=(1, 16, MAX_M), with_bias=True, case="k_pow2")
    inv = result.invariance
    # every bucket, its edges and the sizes above the last bucket (33 reuses it)
    assert inv.m_values == (1, 2, 3, 7, 8, 9, 16, 32, 33)
    assert len({entry.config_for(m) for m in inv.m_values}) == len(entry.buckets) == 3
    assert inv.passed and inv.mismatches == () and inv.rows_checked == 30
    assert [r.m for r in result.accuracy] == [1, 16, 33]
    for r in result.accuracy:
        assert r.all_written and r.tolerance == 1e-5
        assert r.max_rel_err < 2e-6, r  # float32 accuracy, far inside the gate
    assert result.to_dict()["case"] == "k_pow2" and result.to_dict()["passed"] is True


@pytest.mark.parametrize("n,k,block_k", [(64, 512, 64), (64, 1024, 128)])
def test_fp32_matches_an_ieee_float32_reference(pow2_table, n, k, block_k):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(MAX_M, k, generator=gen)  # [M, K]
    b = (torch.randn(n, k, generator=gen) * 0.02).t()  # [K, N]
    assert pow2_table.lookup("float32", n, k).block_k == block_k
    out = mp.matmul_persistent(a, b)
    ref32 = torch.mm(a, b)  # CPU float32 GEMM: IEEE products, float32 sums
    rel = float((out - ref32).abs().max() / ref32.abs().max())
    # both are float32 sums of the same exact products, in different orders: a few ulps apart
    assert rel < 2e-6, rel


@triton.jit
def _plain_dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                      stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # The textbook tiled GEMM; with IEEE false, tl.dot takes its default precision (TF32 on GPUs).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & ((k0 + offs_k)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=((k0 + offs_k)[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _plain_mm(ieee: bool):
    def mm(a, b, bias):
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty(m, n)
        _plain_dot_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 32))](
            a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
            c.stride(1), BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, IEEE=ieee)
        return c
    return mm


@pytest.mark.parametrize("k", [512, 1024])
def test_the_fp32_tolerance_fails_a_tf32_dot_and_passes_ieee(pow2_table, k):
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(MAX_M, k, generator=gen)
    b = (torch.randn(64, k, generator=gen) * 0.02).t()
    tf32 = probe.check_accuracy(a, b, None, mm=_plain_mm(ieee=False))
    ieee = probe.check_accuracy(a, b, None, mm=_plain_mm(ieee=True))
    ours = probe.check_accuracy(a, b, None)  # the table's kernel, same emulated dot
    assert tf32.tolerance == 1e-5
    # TF32 keeps 10 mantissa bits: ~2e-4 of max |ref|, 20x over the tolerance
    assert not tf32.passed and tf32.max_rel_err > 1e-4, tf32
    assert ieee.passed and ieee.max_rel_err < 1e-6, ieee
    assert ours.passed and ours.max_rel_err < 1e-6, ours


def test_edge_cases_list_k_powers_of_two_and_fp32_of_every_shape():
    cases = probe.edge_cases([(4096, 4096), (2048, 6144)])
    assert [(c.n, c.k, c.dtype, c.case) for c in cases] == [
        (4096, 512, "bfloat16", "k_pow2"), (4096, 1024, "bfloat16", "k_pow2"),
        (4096, 2048, "bfloat16", "k_pow2"), (4096, 4096, "bfloat16", "k_pow2"),
        (4096, 512, "float32", "k_pow2"), (4096, 1024, "float32", "k_pow2"),
        (4096, 2048, "float32", "k_pow2"), (4096, 4096, "float32", "k_pow2"),
        (2048, 6144, "float32", "fp32_ieee")]  # 4096x4096 fp32 is listed once


def test_with_edge_cases_adds_only_what_the_cases_lack():
    table_cases = [probe.ProbeCase(4096, 4096, "bfloat16"), probe.ProbeCase(2048, 6144, "bfloat16")]
    cases = probe.with_edge_cases(table_cases)
    assert cases[:2] == table_cases  # the table's own rows first, case "table"
    assert [(c.n, c.k, c.dtype, c.case) for c in cases[2:]] == [
        (4096, 512, "bfloat16", "k_pow2"), (4096, 1024, "bfloat16", "k_pow2"),
        (4096, 2048, "bfloat16", "k_pow2"),
        (4096, 512, "float32", "k_pow2"), (4096, 1024, "float32", "k_pow2"),
        (4096, 2048, "float32", "k_pow2"), (4096, 4096, "float32", "k_pow2"),
        (2048, 6144, "float32", "fp32_ieee")]
