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


def use_tiny_sweep(monkeypatch, clock: list[float] | None = None) -> None:
    """Shrink the sweep for the interpreter: buckets 1, 8, 32 (scored at 1 and 32), two launch
    candidates per bucket class, layouts BLOCK_K 16 and 32 with one split, and a deterministic fake
    clock for the candidates' times (BLOCK_K 32 faster, then wider BLOCK_N, then two programs per
    SM). With ``clock`` (a one-element list of seconds), every timed measurement also moves
    ``sweep.CLOCK`` on by one second, so that budgets are kept and spent deterministically."""
    from bistat_kernels import sweep

    monkeypatch.setattr(sweep, "BUCKETS", (1, 8, 32))
    monkeypatch.setattr(sweep, "SCORE_MS", (1, 32))
    monkeypatch.setattr(sweep, "SCORE_WEIGHTS", {1: 2.0, 32: 1.0})
    monkeypatch.setattr(sweep, "_LAUNCH_CANDIDATES", {
        "decode": ((16, 16, 4, 2, 1), (16, 32, 4, 2, 1)),
        "small": ((16, 16, 4, 2, 1), (32, 32, 4, 2, 2)),
    })

    def fake_time_ms(calls, what):
        kind, m, cfg = what
        if clock is not None:
            clock[0] += 1.0
        if cfg is None:
            return 1.0  # torch.mm
        # BLOCK_K 32 is faster; then wider BLOCK_N; programs_per_sm 2 helps
        return (1.0 if cfg.block_k == 32 else 1.5) + 1.0 / cfg.block_n - 0.01 * cfg.programs_per_sm

    monkeypatch.setattr(sweep, "time_ms", fake_time_ms)
    monkeypatch.setattr(sweep, "reduction_candidates", lambda n, k, num_sms: [(16, 1), (32, 1)])
    # the layouts' own BLOCK_K only (test_kernel_sweep's free_block_k tests cover the others)
    monkeypatch.setattr(sweep, "FREE_BLOCK_K_CLASSES", ())
    if clock is not None:
        monkeypatch.setattr(sweep, "CLOCK", lambda: clock[0])

