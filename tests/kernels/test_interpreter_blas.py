"""The interpreter's ``tl.dot`` (numpy, OpenBLAS) must give a block's row the same bits wherever the
row sits in the block, as a GPU's MMA does; else the kernels' bitwise row-invariance tests would
test OpenBLAS (conftest.py pins OpenBLAS's Nehalem kernels on x86-64 for that)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("m, k, n", [(16, 32, 32), (16, 72, 40), (32, 64, 64), (64, 100, 37)])
def test_a_block_row_has_the_same_bits_in_every_position(m, k, n):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ref = a @ b
    moved = []
    for shift in range(1, m):
        if not np.array_equal(np.roll(a, -shift, axis=0) @ b, np.roll(ref, -shift, axis=0)):
            moved.append(shift)
    assert not moved, (
        f"numpy's BLAS gives a [{m}, {k}] @ [{k}, {n}] row other bits when it moves within the block "
        f"(rotations {moved[:4]}...): the interpreter's tl.dot would not behave like a GPU's MMA. "
        f"Run the kernel tests with OPENBLAS_CORETYPE=Nehalem set before numpy is imported "
        f"(tests/kernels/conftest.py sets it unless numpy was imported first).")
