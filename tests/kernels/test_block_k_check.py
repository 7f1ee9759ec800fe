"""``kernels/device/block_k_check.py`` on the CPU interpreter at a small size: which BLOCK_K it
compares (those with the layout's split-K ranges), and that its comparison reports what it finds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers_kernels import torch  # noqa: F401  (skips without torch/triton)

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import tables  # noqa: E402
from bistat_kernels.shapes import GemmShape  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "kernels" / "device" / "block_k_check.py"


@pytest.fixture
def check(monkeypatch):
    spec = importlib.util.spec_from_file_location("block_k_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "MS", (1, 5, 33))
    monkeypatch.setattr(module, "ALT_BLOCK_K", (16, 32, 64))
    full = module.bit_configs  # the interpreter has no descriptor loads; small tiles only
    monkeypatch.setattr(module, "bit_configs", lambda bk, sk: [
        c for c in full(bk, sk) if not c.tma and c.block_m <= 64])
    return module


def _entry(k, block_k, split_k):
    return tables.ShapeConfig("bfloat16", 48, k, block_k, split_k,
                              (tables.BucketConfig(64, 16, 32, 8, 4, 3),))


def test_only_block_k_with_the_layouts_split_ranges_is_compared(check):
    res = check.check_shape(GemmShape("t", "x", 48, 96), _entry(96, 32, 2), "cpu")
    # K = 96 split in two: 32 cuts at 64 (2 tiles of 3), 16 at 48 and 64 at 64 (one tile each)
    assert res["split_ranges"] == [[0, 64], [64, 96]]
    assert res["block_k_same_ranges"] == [32, 64]
    assert {b["block_k"] for b in res["bits"]} == {32, 64}
    assert res["times"] == []  # timing needs a GPU


def test_a_launch_that_changes_the_bits_is_reported_with_its_rows(check, monkeypatch):
    real = mp.matmul_persistent

    def off_by_a_bit(a, b, bias=None, *, config=None):
        out = real(a, b, bias, config=config)
        if config is not None and config.block_k == 16 and a.shape[0] == 33:
            out = out.clone()
            out[32] = out[32] * (1 + 2.0 ** -6)  # the last row, larger than bf16's ulp
        return out

    monkeypatch.setattr(mp, "matmul_persistent", off_by_a_bit)
    res = check.check_shape(GemmShape("t", "x", 48, 96), _entry(96, 32, 1), "cpu")
    bad = [b for b in res["bits"] if b.get("equal") is False]
    assert bad and {(b["block_k"], b["m"]) for b in bad} == {(16, 33)}
    assert all(b["rows_differing"] == [32] and b["elements_differing"] > 0 for b in bad)
    assert all(b["equal"] for b in res["bits"] if b["block_k"] != 16 or b["m"] != 33)
