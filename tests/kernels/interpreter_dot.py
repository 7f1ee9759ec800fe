"""A row-position-independent ``tl.dot`` for Triton's CPU interpreter.

The interpreter computes each ``tl.dot`` block with ``np.matmul``, that is with numpy's BLAS. A GPU's
MMA gives a row of a block the same bits wherever the row sits in the block; OpenBLAS need not: its
AVX2 (Haswell) SGEMM kernel gives rows 6.. of a 16-row block other bits than rows 0-5 (measured on a
2-core AMD EPYC, OpenBLAS 0.3.31), and which kernel OpenBLAS runs depends on the CPU and on
``OPENBLAS_CORETYPE``, which some machines preset. The kernels' bitwise row-invariance tests would
then test OpenBLAS instead of the kernels, and pass or fail with the environment.

``row_invariant_dot`` replaces the interpreter's BLAS call by an explicit reduction: every output
element is the sum over K of its products, accumulated in the accumulator's dtype in ascending K
order (numpy reduces a non-innermost axis one slice at a time). An element's bits then depend on its
row of A and its column of B alone, never on the row's position in the block, whatever BLAS numpy
loaded and whatever ``OPENBLAS_*`` says. The tests install it (``install``) and leave the environment
as they found it.

The interpreter also ignores ``input_precision``: it multiplies float32 operands exactly even where
a GPU's ``tl.dot`` (default ``"tf32"``) would use TF32, so a kernel that forgot
``input_precision="ieee"`` (vLLM #55466) would pass every float32 accuracy test here. The installed
dot therefore rounds float32 operands to TF32 (``round_to_tf32``: 10 explicit mantissa bits, round
to nearest, ties away from zero, as ``cvt.rna.tf32.f32`` does) when the precision is TF32, and
leaves them exact for IEEE. Hardware that truncates instead errs more, never less.
"""

from __future__ import annotations

import numpy as np


def row_invariant_matmul(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """``a @ b`` with each element summed over K in ascending order, in ``dtype``.

    a: [..., M, K], b: [..., K, N] -> [..., M, N]. No BLAS is involved.
    """
    a = np.asarray(a, dtype=dtype)
    b = np.asarray(b, dtype=dtype)
    products = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N]
    return np.add.reduce(products, axis=-2, dtype=dtype)  # [..., M, N]


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (8-bit exponent, 10-bit mantissa), kept as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(finite, rounded, x).astype(np.float32)


def install() -> None:
    """Make the interpreter's ``tl.dot`` use ``row_invariant_matmul`` (idempotent)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_bistat_row_invariant", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            # fp8 operands: let the interpreter's own conversion path handle them.
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        if input_precision == ir.INPUT_PRECISION.TF32 and a_data.dtype == np.float32 \
                and b_data.dtype == np.float32:
            a_data, b_data = round_to_tf32(a_data), round_to_tf32(b_data)
        out = row_invariant_matmul(a_data, b_data, d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot._bistat_row_invariant = True
    builder.create_dot = create_dot
