"""The interpreter's ``tl.dot`` must give a block's row the same bits wherever the row sits in the
block, as a GPU's MMA does, whatever BLAS numpy loaded and whatever ``OPENBLAS_*`` the machine
presets (conftest.py installs interpreter_dot's reduction; the tests leave the environment alone)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers_kernels import INTERPRETING, torch
from interpreter_dot import row_invariant_matmul

SHAPES = [(16, 32, 32), (16, 72, 40), (32, 64, 64), (64, 100, 37)]


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_a_block_row_has_the_same_bits_in_every_position(m, k, n):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ref = row_invariant_matmul(a, b, np.float32)
    moved = [shift for shift in range(1, m)
             if not np.array_equal(row_invariant_matmul(np.roll(a, -shift, axis=0), b, np.float32),
                                   np.roll(ref, -shift, axis=0))]
    assert not moved, f"rotations {moved[:4]} changed a row's bits"
    # ...and a row computed alone has the bits it has inside the block
    for i in (0, m // 2, m - 1):
        assert np.array_equal(row_invariant_matmul(a[i:i + 1], b, np.float32)[0], ref[i])


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_it_is_a_matmul(m, k, n):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    got = row_invariant_matmul(a, b, np.float32)
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)
    # batched operands, as tl.dot on 3-D blocks
    a3, b3 = np.stack([a, a[::-1]]), np.stack([b, b])
    assert np.array_equal(row_invariant_matmul(a3, b3, np.float32)[1], row_invariant_matmul(a[::-1], b, np.float32))


def test_integer_accumulation_is_exact():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (16, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (64, 16)).astype(np.int8)
    assert np.array_equal(row_invariant_matmul(a, b, np.int32), a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.skipif(not INTERPRETING, reason="checks the interpreter's tl.dot (TRITON_INTERPRET=1)")
def test_the_interpreter_uses_it_for_tl_dot():
    import triton
    import triton.language as tl

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                    IEEE: tl.constexpr):
        rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)  # default precision: TF32, as on a GPU
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], c)

    from interpreter_dot import round_to_tf32

    g = torch.Generator().manual_seed(3)
    a = torch.randn(16, 64, generator=g)
    b = torch.randn(64, 32, generator=g)
    c = torch.empty(16, 32)
    _dot_kernel[(1,)](a, b, c, 16, 64, 32, IEEE=True)
    assert np.array_equal(c.numpy(), row_invariant_matmul(a.numpy(), b.numpy(), np.float32))
    _dot_kernel[(1,)](a, b, c, 16, 64, 32, IEEE=False)
    tf32 = row_invariant_matmul(round_to_tf32(a.numpy()), round_to_tf32(b.numpy()), np.float32)
    assert np.array_equal(c.numpy(), tf32)
    assert not np.array_equal(tf32, row_invariant_matmul(a.numpy(), b.numpy(), np.float32))


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads the start-up environment")
def test_the_tests_leave_openblas_settings_alone():
    # /proc/self/environ holds the environment the process started with; conftest.py must not have
    # set or changed OPENBLAS_* since (CI inherits whatever the machine presets).
    with open("/proc/self/environ", "rb") as f:
        start = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        at_start = start.get(name.encode())
        assert os.environ.get(name) == (at_start.decode() if at_start is not None else None), name


def test_tf32_rounding_keeps_ten_mantissa_bits():
    from interpreter_dot import round_to_tf32

    x = np.array([1.0, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -12, -(1.0 + 3 * 2.0 ** -12),
                  np.inf, np.nan], dtype=np.float32)
    got = round_to_tf32(x)
    # representable; a tie (2^-11) rounds away from zero; below the tie rounds down; sign kept
    np.testing.assert_array_equal(got[:5], np.array(
        [1.0, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -10, 1.0, -(1.0 + 2.0 ** -10)], dtype=np.float32))
    assert np.isinf(got[5]) and np.isnan(got[6])
    assert (got[:5].view(np.uint32) & 0x1FFF == 0).all()
