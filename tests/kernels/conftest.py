"""Kernel tests run under Triton's CPU interpreter unless a GPU run is asked for.

``@triton.jit`` decides between interpreting and compiling when a kernel module is imported, so
``TRITON_INTERPRET=1`` must be in the environment before any ``bistat_kernels`` kernel module is
imported (STYLE §5, "Kernels under the interpreter"). pytest imports this conftest before the test
modules beside it. On a GPU machine, ``BISTAT_KERNELS_GPU=1 pytest tests/kernels -m gpu`` runs the
``gpu`` tests compiled instead.
"""

import os
import platform

if os.environ.get("BISTAT_KERNELS_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

# The interpreter computes each ``tl.dot`` block with numpy (OpenBLAS). A GPU's MMA gives a row
# of a block the same bits wherever the row sits; OpenBLAS 0.3.31's AVX2 (Haswell) SGEMM kernel
# does not (rows 6.. of a 16-row block differ from rows 0-5; measured on a 2-core AMD EPYC, while
# its AVX-512 SkylakeX kernel agrees), and the kernels' bitwise row-invariance tests would then
# test OpenBLAS instead of the kernels. So the interpreter's BLAS is pinned to OpenBLAS's SSE4.2
# (Nehalem) kernels, whose rows agree and which every x86-64 CPU runs. OpenBLAS reads this when
# numpy loads it: it must come before numpy's first import (test_interpreter_blas.py checks).
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Nehalem")
