"""The sweep's selection logic on the CPU, with a deterministic fake clock."""

from __future__ import annotations

import math
import os

import pytest
from helpers_kernels import torch

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import sweep, tables  # noqa: E402
from bistat_kernels.shapes import GemmShape  # noqa: E402


def test_candidates_cap_block_n_and_try_split_k_only_for_narrow_n():
    assert all(c.block_n <= 64 for c in sweep.launch_candidates(1, 48, 64, 1))
    assert {c.block_k for c in sweep.launch_candidates(4096, 4096, 128, 1)} == {128}
    assert sweep.reduction_candidates(4096, 4096, 132) == [(64, 1), (128, 1), (256, 1), (128, 2),
                                                           (128, 4)]
    assert sweep.reduction_candidates(151936, 4096, 132) == [(64, 1), (128, 1), (256, 1)]


@pytest.fixture
def tiny_sweep(monkeypatch):
    monkeypatch.setattr(sweep, "BUCKETS", (1, 8, 32))
    monkeypatch.setattr(sweep, "SCORE_MS", (1, 32))
    monkeypatch.setattr(sweep, "SCORE_WEIGHTS", {1: 2.0, 32: 1.0})
    monkeypatch.setattr(sweep, "_LAUNCH_CANDIDATES", {
        "decode": ((16, 16, 4, 2, 1), (16, 32, 4, 2, 1)),
        "small": ((16, 16, 4, 2, 1), (32, 32, 4, 2, 2)),
    })

    def fake_clock(calls, what):
        kind, m, cfg = what
        if cfg is None:
            return 1.0  # torch.mm
        # BLOCK_K 32 is faster; then wider BLOCK_N; programs_per_sm 2 helps
        return (1.0 if cfg.block_k == 32 else 1.5) + 1.0 / cfg.block_n - 0.01 * cfg.programs_per_sm

    monkeypatch.setattr(sweep, "time_ms", fake_clock)
    monkeypatch.setattr(sweep, "reduction_candidates", lambda n, k, num_sms: [(16, 1), (32, 1)])


def test_sweep_picks_the_layout_by_score_and_the_fastest_gated_candidate(tiny_sweep):
    entry, raw = sweep.sweep_shape(GemmShape("t", "x", 40, 72), torch.float32, 4,
                                   {"gpu_name": "cpu"}, device="cpu")
    assert (entry.block_k, entry.split_k) == (32, 1)
    assert [(b.m_max, b.block_m, b.block_n, b.programs_per_sm) for b in entry.buckets] == [
        (1, 16, 32, 1), (8, 16, 32, 1), (32, 32, 32, 2)]
    assert entry.extra["selection"]["chosen"] == "bk32_s1"
    def score(base):  # weighted geometric mean: M=1 best (16x32, p1), M=32 best (32x32, p2)
        return math.exp((2 * math.log(base + 1 / 32 - 0.01) + math.log(base + 1 / 32 - 0.02)) / 3)

    assert entry.extra["selection"]["scores"] == {"bk16_s1": round(score(1.5), 4),
                                                  "bk32_s1": round(score(1.0), 4)}
    assert {r["status"] for r in raw["records"]} == {"ok"}
    # the entry is valid table data
    tables.parse_table(tables.table_to_dict("cpu", [entry]))


def test_a_candidate_that_breaks_invariance_is_never_chosen(tiny_sweep, monkeypatch):
    real = mp.matmul_persistent

    def leaky(a, b, bias=None, *, config=None):
        out = real(a, b, bias, config=config)
        if config is not None and config.block_n == 32 and a.shape[0] > 1:
            out = out * (1 + 2.0 ** -20)  # bits change with the batch: not invariant
        return out

    monkeypatch.setattr(mp, "matmul_persistent", leaky)
    entry, raw = sweep.sweep_shape(GemmShape("t", "x", 40, 72), torch.float32, 4,
                                   {"gpu_name": "cpu"}, device="cpu")
    failed = [r for r in raw["records"] if r["status"] == "gate_failed"]
    assert failed and all(r["block_n"] == 32 and r["invariance_ok"] is False for r in failed)
    assert [b.block_n for b in entry.buckets] == [32, 16, 16]  # M=1 is alone by definition


def test_every_candidate_the_sweep_launches_was_precompiled(tiny_sweep, monkeypatch):
    """Device call 10 compiled in the timed loop; the precompiled set must cover every launch."""
    monkeypatch.setattr(sweep, "reduction_candidates", lambda n, k, num_sms: [(16, 1), (16, 2)])
    monkeypatch.setattr(sweep, "FUSED_CLASSES", ("decode", "small"))  # fused twins in this plan
    launched = set()
    real = mp.matmul_persistent

    def spy(a, b, bias=None, *, config=None):
        launched.add(config)
        return real(a, b, bias, config=config)

    monkeypatch.setattr(mp, "matmul_persistent", spy)
    shape = GemmShape("t", "x", 40, 72)
    _, raw = sweep.sweep_shape(shape, torch.float32, 4, {"gpu_name": "cpu"}, device="cpu")
    precompiled = set(sweep.all_sweep_configs([shape], 4))
    assert any(c.fuse_splits for c in launched) and any(c.split_k == 2 for c in launched)
    assert launched - precompiled == set()
    assert all(r["first_launch_s"] >= 0 for r in raw["records"])
    assert raw["slow_first_launches"] == sum(r["first_launch_s"] > sweep.SLOW_FIRST_LAUNCH_S
                                             for r in raw["records"])


def test_fused_twins_only_for_prefill_buckets():
    for m in sweep.BUCKETS:
        fused = [c for c in sweep.launch_candidates(m, 4096, 128, 2) if c.fuse_splits]
        assert bool(fused) == (m > 512), m
    assert not any(c.fuse_splits for c in sweep.launch_candidates(4096, 4096, 128, 1))


def test_the_full_three_model_plan_has_the_stated_size():
    from bistat_kernels.shapes import shapes_for

    shapes = shapes_for(("qwen3-8b", "qwen3-1.7b", "smollm2-135m"))
    # kernels/README.md states these numbers and the time they take on the H200 (which offers
    # descriptor loads: tma=True); without them every candidate has one form
    assert sweep.sweep_plan(shapes, 132, tma=True) == {"shapes": 15, "configs": 769,
                                                       "measurements_max": 14348}
    assert sweep.sweep_plan(shapes, 132) == {"shapes": 15, "configs": 387,
                                             "measurements_max": 7174}


def test_pin_triton_toolchain_sets_unset_variables_and_keeps_set_ones(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    pinned = sweep.pin_triton_toolchain()
    assert pinned["TRITON_CACHE_DIR"] == os.environ["TRITON_CACHE_DIR"] != ""
    assert os.path.basename(pinned["TRITON_PTXAS_PATH"]).startswith("ptxas")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/other/ptxas")
    assert sweep.pin_triton_toolchain() == {"TRITON_CACHE_DIR": str(tmp_path),
                                            "TRITON_PTXAS_PATH": "/opt/other/ptxas"}
