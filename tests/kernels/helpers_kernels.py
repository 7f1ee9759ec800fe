"""Shared helpers of the kernel tests: a small fp32 table and verbose comparisons."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need torch (pip install torch==2.13.0)")
pytest.importorskip("triton", reason="kernel tests need triton (pip install triton==3.7.1)")

from bistat_kernels import tables  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                               reason="needs a CUDA GPU and BISTAT_KERNELS_GPU=1 "
                                      "(CPU runs use the Triton interpreter)")

PROVENANCE = {"gpu_name": "test", "command": "tests/kernels/helpers_kernels.py"}


def table_dict(entries: list[tuple[int, int, int, int, list[dict]]]) -> dict:
    """A table document of fp32 entries ``(n, k, block_k, split_k, buckets)`` on "Test GPU"."""
    return {
        "schema": tables.SCHEMA,
        "device_name": "Test GPU",
        "entries": [{"dtype": "float32", "n": n, "k": k, "block_k": block_k, "split_k": split_k,
                     "buckets": buckets, "provenance": PROVENANCE}
                    for n, k, block_k, split_k, buckets in entries],
    }


def small_table_dict() -> dict:
    """Two fp32 shapes; buckets differ in every launch parameter, including programs per SM."""
    buckets = [
        {"m_max": 1, "block_m": 16, "block_n": 16, "group_m": 1, "num_warps": 4, "num_stages": 2},
        {"m_max": 4, "block_m": 16, "block_n": 32, "group_m": 8, "num_warps": 4, "num_stages": 3,
         "programs_per_sm": 2},
        {"m_max": 16, "block_m": 32, "block_n": 16, "group_m": 2, "num_warps": 2, "num_stages": 2},
        {"m_max": 64, "block_m": 64, "block_n": 32, "group_m": 8, "num_warps": 4, "num_stages": 3},
    ]
    return table_dict([(40, 72, 32, 1, buckets), (37, 100, 16, 3, buckets[:2] + buckets[3:])])


def assert_verbose_allclose(actual, expected, rtol: float, atol: float) -> None:
    """allclose that lists the first mismatched elements when it fails (Liger's test utils)."""
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol)
    if not bool(close.all()):
        bad = (~close).nonzero()[:10].tolist()
        details = [f"{tuple(i)}: got {actual[tuple(i)].item()!r}, "
                   f"expected {expected[tuple(i)].item()!r}" for i in bad]
        raise AssertionError(f"{int((~close).sum())} mismatched elements; first: "
                             + "; ".join(details))
