"""Kernel tests run under Triton's CPU interpreter unless a GPU run is asked for.

``@triton.jit`` decides between interpreting and compiling when a kernel module is imported, so
``TRITON_INTERPRET=1`` must be in the environment before any ``bistat_kernels`` kernel module is
imported (STYLE §5, "Kernels under the interpreter"). pytest imports this conftest before the test
modules beside it. On a GPU machine, ``BISTAT_KERNELS_GPU=1 pytest tests/kernels -m gpu`` runs the
``gpu`` tests compiled instead.
"""

import os

if os.environ.get("BISTAT_KERNELS_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
