"""The one compiled part of bistat: the embedded engine's batch-invariant GEMM (C).

Everything else is declared in pyproject.toml. Building needs a C compiler (gcc or clang). No
fast-math and no FMA contraction: the kernels' arithmetic is exactly the fma chain the source
spells out (src/bistat/engines/embedded/_rowgemm.c), nothing the compiler may regroup.

The extension is optional: where it cannot be built (no compiler, as on a lent GPU machine that
only drives vLLM), bistat still installs, and the embedded engine's invariant mode refuses with a
message that says how to build it (``bistat doctor`` reports it too).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "bistat.engines.embedded._rowgemm",
    sources=["src/bistat/engines/embedded/_rowgemm.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-fno-fast-math", "-ffp-contract=off", "-pthread"],
    extra_link_args=["-pthread"],
    libraries=["m"],
    optional=True,
)])
