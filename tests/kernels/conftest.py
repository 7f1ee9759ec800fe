"""Kernel tests run under Triton's CPU interpreter unless a GPU run is asked for.

``@triton.jit`` decides between interpreting and compiling when a kernel module is imported, so
``TRITON_INTERPRET=1`` must be in the environment before any ``bistat_kernels`` kernel module is
imported (STYLE §5, "Kernels under the interpreter"). pytest imports this conftest before the test
modules beside it. On a GPU machine, ``BISTAT_KERNELS_GPU=1 pytest tests/kernels -m gpu`` runs the
``gpu`` tests compiled instead.
"""

import os

import pytest

if os.environ.get("BISTAT_KERNELS_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

# The interpreter computes each ``tl.dot`` block with numpy's BLAS, whose rows can change bits with
# their position in a block depending on the CPU and on OPENBLAS_CORETYPE (which some machines preset
# and which the tests must leave alone). interpreter_dot.install() gives the interpreter a dot whose
# rows cannot: the bitwise row-invariance tests then test the kernels, not OpenBLAS.
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:  # the kernel tests skip without triton (helpers_kernels.py)
        pass
    else:
        from interpreter_dot import install

        install()


@pytest.fixture(autouse=True)
def _own_user_tables(tmp_path_factory, monkeypatch):
    """Every test sees an empty folder of user GEMM tables, never the machine's own
    (``bistat kernels tune`` writes there, and table resolution reads it)."""
    monkeypatch.setenv("BISTAT_GEMM_TABLE_DIR", str(tmp_path_factory.mktemp("gemm_tables")))
