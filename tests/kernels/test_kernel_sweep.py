"""The sweep's selection logic on the CPU, with a deterministic fake clock."""

from __future__ import annotations

import math
import os

import pytest
from helpers_kernels import torch, use_tiny_sweep

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import precompile, sweep, tables  # noqa: E402
from bistat_kernels.shapes import GemmShape  # noqa: E402


def test_candidates_cap_block_n_and_try_split_k_only_for_narrow_n():
    assert all(c.block_n <= 64 for c in sweep.launch_candidates(1, 48, 64, 1))
    assert {c.block_k for c in sweep.launch_candidates(4096, 4096, 128, 1)} == {128}
    assert sweep.reduction_candidates(4096, 4096, 132) == [(64, 1), (128, 1), (256, 1), (128, 2),
                                                           (128, 4)]
    assert sweep.reduction_candidates(151936, 4096, 132) == [(64, 1), (128, 1), (256, 1)]


@pytest.fixture
def tiny_sweep(monkeypatch):
    use_tiny_sweep(monkeypatch)


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


def test_fused_twins_only_for_large_and_prefill_buckets():
    for m in sweep.BUCKETS:
        fused = [c for c in sweep.launch_candidates(m, 4096, 128, 2) if c.fuse_splits]
        flat = [c for c in fused if c.flat_splits]
        assert bool(fused) == bool(flat) == (m > 128), m
    assert not any(c.fuse_splits for c in sweep.launch_candidates(4096, 4096, 128, 1))


def test_the_full_three_model_plan_has_the_stated_size():
    from bistat_kernels.shapes import shapes_for

    shapes = shapes_for(("qwen3-8b", "qwen3-1.7b", "smollm2-135m"))
    # kernels/README.md states these numbers and the time they take on the H200 (which offers
    # descriptor loads: tma=True); without them every candidate has one form
    assert sweep.sweep_plan(shapes, 132, tma=True) == {"shapes": 15, "configs": 1109,
                                                       "measurements_max": 24520}
    assert sweep.sweep_plan(shapes, 132) == {"shapes": 15, "configs": 557,
                                             "measurements_max": 12260}


def test_pin_triton_toolchain_sets_unset_variables_and_keeps_set_ones(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    pinned = precompile.pin_triton_toolchain()
    assert pinned["TRITON_CACHE_DIR"] == os.environ["TRITON_CACHE_DIR"] != ""
    assert os.path.basename(pinned["TRITON_PTXAS_PATH"]).startswith("ptxas")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/other/ptxas")
    assert precompile.pin_triton_toolchain() == {"TRITON_CACHE_DIR": str(tmp_path),
                                            "TRITON_PTXAS_PATH": "/opt/other/ptxas"}


# ---- BLOCK_K per bucket (sweep.FREE_BLOCK_K_CLASSES) ---------------------------------------

@pytest.fixture
def free_block_k(monkeypatch):
    """Buckets 1 (decode) and 256 (large); layout BLOCK_K 32; BLOCK_K 16 offered at M = 256."""
    monkeypatch.setattr(sweep, "BUCKETS", (1, 256))
    monkeypatch.setattr(sweep, "SCORE_MS", (1, 256))
    monkeypatch.setattr(sweep, "SCORE_WEIGHTS", {1: 1.0, 256: 1.0})
    monkeypatch.setattr(sweep, "_LAUNCH_CANDIDATES", {
        "decode": ((16, 16, 4, 2, 1),), "large": ((32, 32, 4, 2, 1), (64, 32, 4, 2, 1))})
    monkeypatch.setattr(sweep, "_ALT_BLOCK_K_TILES", {"large": ((64, 64, 4, 2, 1),)})
    monkeypatch.setattr(sweep, "ALT_BLOCK_K", {"large": (16, 32)})
    monkeypatch.setattr(sweep, "FREE_BLOCK_K_CLASSES", ("large",))
    monkeypatch.setattr(sweep, "reduction_candidates", lambda n, k, num_sms: [(32, 1)])

    def fake_clock(calls, what):  # another BLOCK_K is fastest, then the present 32x32 launch
        _, m, cfg = what
        if cfg is None:
            return 1.0
        return 0.5 if cfg.block_k != 32 else (0.8 if cfg.block_m == 32 else 0.9)

    monkeypatch.setattr(sweep, "time_ms", fake_clock)


def test_candidates_offer_other_block_k_only_with_the_layouts_split_ranges():
    # K = 12288 split in two: BLOCK_K 64 and 256 keep [0, 6144), [6144, 12288); the large and
    # prefill classes offer 64 and 128, decode and small sizes 256 too, with 16- and 32-row tiles
    large = sweep.launch_candidates(256, 4096, 128, 2, k=12288)
    assert {c.block_k for c in large} == {128, 64}
    for m in (1, 16, 32):
        small = sweep.launch_candidates(m, 4096, 128, 2, k=12288)
        assert {c.block_k for c in small} == {64, 128, 256}
        assert {c.block_m for c in small if c.block_k != 128} <= {16, 32}
        for c in small:
            assert tables.split_ranges(12288, c.block_k, 2) == ((0, 6144), (6144, 12288))
        # a 256-deep stage of bf16 operands fits the H200's 227 KiB at the stages offered
        assert all((c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= 227 * 1024
                   for c in small if c.block_k == 256)
    # the mid class (33..128) offers 64 and 256 as well (since the M <= 32 re-tune), with tiles
    # of at most 64 rows whose stages fit 227 KiB at BLOCK_K 256
    mid = sweep.launch_candidates(64, 4096, 128, 2, k=12288)
    assert {c.block_k for c in mid} == {64, 128, 256}
    assert {(c.block_m, c.block_n, c.num_stages) for c in mid if c.block_k == 256} == {
        (16, 64, 4), (32, 64, 4), (32, 64, 3), (64, 64, 3)}
    assert all((c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= 227 * 1024
               for c in mid if c.block_k == 256)
    for c in mid:
        assert tables.split_ranges(12288, c.block_k, 2) == ((0, 6144), (6144, 12288))
    assert {c.block_k for c in sweep.launch_candidates(256, 4096, 128, 2)} == {128}  # no k given
    # K = 576 unsplit: any BLOCK_K keeps the one range; a BLOCK_K-64 layout gets 128 and 256
    assert {c.block_k for c in sweep.launch_candidates(1, 49152, 64, 1, k=576)} == {64, 128, 256}
    # K = 1280 split in two: BLOCK_K 128 cuts at 640, 64 at 640 too, 256 at 768 (not offered)
    assert {c.block_k for c in sweep.launch_candidates(4096, 2048, 128, 2, k=1280)} == {128, 64}
    assert {c.block_k for c in sweep.launch_candidates(4096, 2048, 256, 2, k=1280)} == {256}
    for c in large:
        assert tables.split_ranges(12288, c.block_k, 2) == ((0, 6144), (6144, 12288))


# Under the interpreter a tl.dot adds each K-tile's sum to the accumulator (the tests' dot,
# interpreter_dot.py), so there BLOCK_K changes float32 bits wherever K spans several tiles: at
# K = 72 gate 1 fails every BLOCK_K 16 candidate (a real difference, not a fake one). At K = 16
# both BLOCK_K cover K in one tile (32 adds zeros past K), so both give the same bits.
@pytest.mark.parametrize("k,kept", [(16, 16), (72, None)])
def test_a_bucket_takes_another_block_k_only_where_gate_1_passes(free_block_k, k, kept):
    entry, raw = sweep.sweep_shape(GemmShape("t", "x", 40, k), torch.float32, 4,
                                   {"gpu_name": "cpu"}, device="cpu")
    assert (entry.block_k, entry.split_k) == (32, 1)
    assert [b.block_k for b in entry.buckets] == [None, kept]
    alt = [r for r in raw["records"] if r["block_k"] == 16]
    assert alt and all(r["m"] == 256 for r in alt)
    assert {r["invariance_ok"] for r in alt} == {kept is not None}
    assert {r["accuracy_ok"] for r in raw["records"]} == {True}
    assert entry.config_for(256).block_k == (kept or 32)
    again = tables.parse_table(tables.table_to_dict("cpu", [entry]))
    assert again.entries[("float32", 40, k)] == entry


@pytest.mark.parametrize("k", [16, 72])
def test_retune_buckets_keeps_small_buckets_and_says_what_it_replaced(free_block_k, k):
    small = tables.BucketConfig(1, 16, 16, 8, 4, 2, measured={"m": 1, "time_ms": 1.0})
    large = tables.BucketConfig(256, 32, 32, 8, 4, 2, measured={"m": 256, "time_ms": 1.0})
    entry = tables.ShapeConfig("float32", 40, k, 32, 1, (small, large), {"gpu_uuid": "GPU-old"},
                               {"layers": ["t/x"]})
    prov = {"gpu_name": "cpu", "gpu_uuid": "GPU-new", "driver": "1", "torch": "t",
            "triton": "3", "date_utc": "2026-12-03T00:00:00Z"}
    new, raw = sweep.retune_buckets(entry, GemmShape("t", "x", 40, k), torch.float32, prov, 256,
                                    "raw.json", device="cpu")
    assert new.buckets[0] is small and new.provenance == entry.provenance
    assert {r["phase"] for r in raw["records"]} == {"retune"}
    assert all(r["m"] == 256 for r in raw["records"])
    if k == 72:  # BLOCK_K 16 fails gate 1 there; 32x32, the present launch, is the fastest left
        assert new.buckets[1] is large
        return
    b = new.buckets[1]
    assert (b.block_m, b.block_n, b.block_k) == (64, 64, 16)
    assert b.measured["time_ms"] == 0.5 and b.measured["torch_mm_ms"] == 1.0
    assert b.measured["source"] == "raw.json" and b.measured["retuned_on"]["gpu_uuid"] == "GPU-new"
    assert b.measured["previous"] == {"config": str(entry.config_for(256)), "time_ms": 0.8}


def test_a_candidate_that_does_not_compile_is_recorded_and_passed_over(free_block_k, monkeypatch):
    # decode and small buckets now also try BLOCK_K 256, with descriptor loads on Hopper: a tile
    # Triton refuses to compile must cost its record, not the re-tune of every later shape
    import ast

    from triton.compiler.errors import CompilationError

    real = mp.matmul_persistent

    def refusing(a, b, bias=None, *, config=None):
        if config is not None and config.block_k == 16:
            raise CompilationError("src", ast.parse("x").body[0], "tile not supported")
        return real(a, b, bias, config=config)

    monkeypatch.setattr(mp, "matmul_persistent", refusing)
    small = tables.BucketConfig(1, 16, 16, 8, 4, 2, measured={"m": 1, "time_ms": 1.0})
    large = tables.BucketConfig(256, 32, 32, 8, 4, 2, measured={"m": 256, "time_ms": 1.0})
    entry = tables.ShapeConfig("float32", 40, 16, 32, 1, (small, large), {}, {"layers": ["t/x"]})
    new, raw = sweep.retune_buckets(entry, GemmShape("t", "x", 40, 16), torch.float32,
                                    {"gpu_name": "cpu"}, 256, "raw.json", device="cpu")
    refused = [r for r in raw["records"] if r["block_k"] == 16]
    assert refused and {r["status"] for r in refused} == {"compile_error"}
    assert all("tile not supported" in r["detail"] for r in refused)
    # the fastest launch that compiled and passed both gates: 32x32 (0.8) over 64x32 (0.9)
    assert new.buckets[1] is large


def test_retune_buckets_between_min_m_and_max_m_only(free_block_k, monkeypatch):
    monkeypatch.setattr(sweep, "BUCKETS", (1, 256, 512))
    b1 = tables.BucketConfig(1, 16, 16, 8, 4, 2, measured={"m": 1, "time_ms": 1.0})
    b256 = tables.BucketConfig(256, 32, 32, 8, 4, 2, measured={"m": 256, "time_ms": 1.0})
    b512 = tables.BucketConfig(512, 32, 32, 8, 4, 2, measured={"m": 512, "time_ms": 1.0})
    entry = tables.ShapeConfig("float32", 40, 16, 32, 1, (b1, b256, b512), {}, {"layers": ["t/x"]})
    new, raw = sweep.retune_buckets(entry, GemmShape("t", "x", 40, 16), torch.float32,
                                    {"gpu_name": "cpu"}, 256, "raw.json", device="cpu", max_m=256)
    assert {r["m"] for r in raw["records"]} == {256} and raw["max_m"] == 256
    assert new.buckets[0] is b1 and new.buckets[2] is b512
    assert new.buckets[1].block_k == 16            # the BLOCK_K-16 candidate won at M = 256


def test_a_precompile_out_of_budget_cancels_the_chunks_not_started():
    """With no time left the precompile starts nothing more: the chunks already handed to the
    worker finish, the others are cancelled and counted as not precompiled (they compile when
    first timed)."""
    configs = sweep.launch_candidates(1, 4096, 64, 1) * 3  # 48 configs: 12 chunks of 4
    errors = precompile.precompile(configs, torch.float32, 4, workers=1, budget_s=0.0)
    (note,) = [e for e in errors if "not precompiled" in e]
    skipped = int(note.split()[0])
    assert note == f"{skipped} configs not precompiled: the precompile's budget of 0s ran out"
    # one worker: at most the chunk it runs and the one queued for it were not cancellable
    assert len(configs) - 2 * precompile.PRECOMPILE_CHUNK <= skipped <= len(configs)
    assert skipped % precompile.PRECOMPILE_CHUNK == 0
