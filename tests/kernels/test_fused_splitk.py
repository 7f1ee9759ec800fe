"""Fused split-K: the same bits as parallel split-K (workspace + tile counters), without either.

Under the Triton interpreter at tiny shapes: ragged M, N and K (last split short or empty), with
and without bias, bf16/fp16/fp32; row-alone invariance with fused buckets in a table; the table
field; the sweep's candidates and its selection of fused launches.
"""

from __future__ import annotations

import dataclasses

import copy
import json

import pytest
from helpers_kernels import needs_gpu, small_table_dict, torch

from bistat_kernels import make_results  # noqa: E402
from bistat_kernels import matmul_buffers as buffers  # noqa: E402
from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import sweep, tables  # noqa: E402
from bistat_kernels.probe import row_positions  # noqa: E402
from bistat_kernels.shapes import GemmShape  # noqa: E402

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bits_a, bits_e = actual.view(_INT_VIEW[actual.dtype]), expected.view(_INT_VIEW[actual.dtype])
    if not torch.equal(bits_a, bits_e):
        bad = (bits_a != bits_e).nonzero()[:5].tolist()
        raise AssertionError(f"{int((bits_a != bits_e).sum())} elements differ in their bits; "
                             "first: " + "; ".join(f"{tuple(i)}: {actual[tuple(i)].item()!r} vs "
                                                   f"{expected[tuple(i)].item()!r}" for i in bad))
    assert torch.equal(actual, expected)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    w = torch.randn(n, k, generator=gen).to(dtype)  # [N, K]
    bias = torch.randn(n, generator=gen).to(dtype)  # [N]
    return a, w, bias


# K = 200 with BLOCK_K 32: 7 K-tiles, the last one ragged (8 of 32 columns).
# split 3: 3 tiles per split, the last split holds one ragged tile and two empty ones;
# split 5: 2 tiles per split, the last split (tiles 8, 9) is empty altogether.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block_k,split_k", [(32, 3), (32, 5)], ids=["s3-short", "s5-empty"])
def test_fused_equals_parallel_bit_for_bit(dtype, block_k, split_k):
    a, w, bias = _inputs(17, 40, 200, dtype, seed=11)
    parallel = tables.GemmConfig(16, 16, block_k, 8, 4, 2, split_k)
    fused = [tables.GemmConfig(16, 16, block_k, 8, 4, 2, split_k, fuse_splits=True),
             tables.GemmConfig(32, 64, block_k, 1, 4, 3, split_k, 2, fuse_splits=True),
             # the flat loop: at M = 17, 2 x 3 tiles over the interpreter's 4 programs, so two
             # programs carry their loop from one tile into the next
             tables.GemmConfig(16, 16, block_k, 8, 4, 2, split_k, fuse_splits=True,
                               flat_splits=True),
             tables.GemmConfig(16, 32, block_k, 1, 4, 3, split_k, 1, fuse_splits=True,
                               flat_splits=True)]
    for m in (1, 3, 17):
        for bb in (None, bias):
            expected = mp.matmul_persistent(a[:m], w.t(), bb, config=parallel)  # [m, 40]
            for cfg in fused:
                _assert_same_bits(mp.matmul_persistent(a[:m], w.t(), bb, config=cfg), expected)


def test_fused_sums_the_splits_in_order_then_adds_the_bias():
    # fp32, K = 96 in 6 K-tiles of 16, split 3: ((t0 + t1) + (t2 + t3)) + (t4 + t5), then + bias
    a, w, bias = _inputs(5, 24, 96, torch.float32, seed=12)
    b = w.t()
    out = mp.matmul_persistent(a, b, bias, config=tables.GemmConfig(16, 16, 16, 8, 4, 2, 3,
                                                                    fuse_splits=True))
    parts = [a[:, 32 * s:32 * (s + 1)] @ b[32 * s:32 * (s + 1)] for s in range(3)]
    expected = ((parts[0] + parts[1]) + parts[2]) + bias
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(out, expected - bias, rtol=1e-6, atol=1e-5)  # bias added once


def test_fused_allocates_no_workspace_and_counts_nothing(monkeypatch):
    real_lock_buffer = mp._lock_buffer

    def forbidden(device, stream, tiles):  # the buffer is passed always; counters used: none
        if tiles:
            raise AssertionError("split-K counters were asked for")
        return real_lock_buffer(device, stream, tiles)

    a, w, bias = _inputs(3, 40, 200, torch.float32, seed=13)
    parallel = tables.GemmConfig(16, 16, 32, 8, 4, 2, 3)
    expected = mp.matmul_persistent(a, w.t(), bias, config=parallel)
    monkeypatch.setattr(mp, "_lock_buffer", forbidden)
    real_empty = torch.empty
    shapes = []

    def recording_empty(*size, **kwargs):
        shapes.append(tuple(size[0]) if len(size) == 1 else size)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(mp.torch, "empty", recording_empty)
    out = mp.matmul_persistent(a, w.t(), bias, config=tables.GemmConfig(
        16, 16, 32, 8, 4, 2, 3, fuse_splits=True))
    assert shapes == [(3, 40)]  # the output only
    _assert_same_bits(out, expected)
    with pytest.raises(AssertionError, match="split-K counters were asked for"):
        mp.matmul_persistent(a, w.t(), bias, config=parallel)


def test_parallel_split_k_leaves_every_tile_counter_at_zero():
    # 3 x 3 tiles of 16 x 16, 4 splits: 36 work items over the interpreter's 4 programs, so the
    # program that brings a tile's last partial is not always the one with the last split
    a, w, bias = _inputs(40, 40, 250, torch.float32, seed=21)
    parallel = tables.GemmConfig(16, 16, 32, 8, 4, 2, 4)
    fused = dataclasses.replace(parallel, fuse_splits=True)
    first = mp.matmul_persistent(a, w.t(), bias, config=parallel)
    locks = mp._LOCKS[(None, 0)]
    assert locks.dtype == torch.int32 and locks.numel() >= 9
    assert int(locks.abs().sum()) == 0
    for m in (40, 17, 1):  # counters reused by the next launches: the same bits every time
        _assert_same_bits(mp.matmul_persistent(a[:m], w.t(), bias, config=parallel), first[:m])
    _assert_same_bits(mp.matmul_persistent(a, w.t(), bias, config=fused), first)
    assert int(locks.abs().sum()) == 0


def test_counters_are_kept_per_stream_and_grow_without_freeing():
    mp._LOCKS.pop((None, 12345), None)
    small = mp._lock_buffer(torch.device("cpu"), 12345, 10)
    assert small.numel() == 1024 and mp._lock_buffer(torch.device("cpu"), 12345, 1024) is small
    other = mp._lock_buffer(torch.device("cpu"), 777, 10)
    assert other is not small  # another stream: its own counters
    big = mp._lock_buffer(torch.device("cpu"), 12345, 5000)
    assert big.numel() == 5000 and int(big.sum()) == 0
    assert any(t is small for t in mp._RETIRED_LOCKS)  # a captured graph may still point at it
    mp._LOCKS.pop((None, 12345)), mp._LOCKS.pop((None, 777))


def _fused_table_dict() -> dict:
    """The split-3 entry of the small table with fused buckets at M in 2..4 and 17..64."""
    data = copy.deepcopy(small_table_dict())
    entry = data["entries"][1]
    entry["buckets"] = [dict(b) for b in entry["buckets"]]  # the entries share bucket objects
    entry["buckets"][1]["fuse_splits"] = True
    entry["buckets"][2]["fuse_splits"] = True
    return data


def test_rows_alone_equal_rows_in_batch_with_fused_buckets():
    table = tables.parse_table(_fused_table_dict(), "fused_table")
    entry = table.entries[("float32", 37, 100)]
    assert [entry.config_for(m).fuse_splits for m in (1, 4, 64)] == [False, True, True]
    tables.set_device_table(table)
    try:
        a, w, bias = _inputs(64, 37, 100, torch.float32, seed=14)
        sizes = (2, 3, 17, 64)
        # M = 1 uses the parallel bucket: fused batches must reproduce its rows
        alone = {r: mp.matmul_persistent(a[r:r + 1], w.t(), bias)[0]
                 for m in sizes for r in row_positions(m)}
        for m in sizes:
            batch = mp.matmul_persistent(a[:m], w.t(), bias)  # [m, 37]
            for r in row_positions(m):
                _assert_same_bits(batch[r], alone[r])
    finally:
        tables.reset_device_table()


# ---- config and table ---------------------------------------------------------------------------

def test_fuse_splits_is_normalised_away_without_splits():
    plain = tables.GemmConfig(16, 32, 64, 8, 4, 4, 1)
    assert tables.GemmConfig(16, 32, 64, 8, 4, 4, 1, fuse_splits=True) == plain
    assert tables.GemmConfig(16, 32, 64, 8, 4, 4, 1, fuse_splits=True).fuse_splits is False
    fused = tables.GemmConfig(16, 32, 64, 8, 4, 4, 2, fuse_splits=True)
    assert fused.fuse_splits is True and fused != tables.GemmConfig(16, 32, 64, 8, 4, 4, 2)
    assert fused.reduction_key() == (64, 2)  # a launch choice: the reduction order is the same


def test_round_trip_keeps_fuse_splits_and_writes_it_only_when_true():
    table = tables.parse_table(_fused_table_dict())
    dumped = tables.table_to_dict(table.device_name, list(table.entries.values()))
    written = [["fuse_splits" in b for b in e["buckets"]] for e in dumped["entries"]]
    assert written == [[False, True, True], [False] * 4]  # sorted by (dtype, N, K)
    again = tables.parse_table(json.loads(json.dumps(dumped)))
    assert again.entries == table.entries
    assert [b.fuse_splits for b in again.entries[("float32", 37, 100)].buckets] == [
        False, True, True]


def test_a_table_without_the_field_reads_as_parallel():
    table = tables.parse_table(small_table_dict())  # written before fuse_splits existed
    assert dict(small_table_dict()["entries"][1]["buckets"][1]).get("fuse_splits") is None
    assert all(not b.fuse_splits for e in table.entries.values() for b in e.buckets)
    tables.set_device_table(table)
    try:
        assert tables.lookup_config(4, 37, 100, "float32", None).fuse_splits is False
    finally:
        tables.reset_device_table()


def test_lookup_config_returns_the_buckets_fuse_splits():
    tables.set_device_table(tables.parse_table(_fused_table_dict()))
    try:
        got = [tables.lookup_config(m, 37, 100, "float32", None) for m in (1, 3, 64, 500)]
    finally:
        tables.reset_device_table()
    assert [(c.split_k, c.fuse_splits) for c in got] == [(3, False), (3, True), (3, True),
                                                          (3, True)]


@pytest.mark.parametrize("entry,value,message", [
    (1, "yes", "t.json: entries[1].buckets[1].fuse_splits: got 'yes'; expected true or false "
               "(or leave it out for false)"),
    (0, True, "t.json: entries[0].buckets[1].fuse_splits: true needs the entry's split_k > 1 "
              "(got split_k 1: there are no splits to fuse); remove the field"),
])
def test_fuse_splits_errors_name_file_field_and_fix(entry, value, message):
    data = copy.deepcopy(small_table_dict())
    buckets = [dict(b) for b in data["entries"][entry]["buckets"]]  # shared between entries
    buckets[1]["fuse_splits"] = value
    data["entries"][entry]["buckets"] = buckets
    with pytest.raises(tables.TableError) as info:
        tables.parse_table(data, "t.json")
    assert str(info.value) == message


# ---- sweep --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,num_sms,expected", [
    (576, 576, 132, [(64, 1), (128, 1), (128, 2)]),
    (6144, 4096, 132, [(64, 1), (128, 1), (256, 1), (128, 2), (128, 4)]),  # K >= 4096: split 4
    (8192, 8192, 132, [(64, 1), (128, 1), (256, 1), (128, 2), (128, 4)]),
    (4096, 12288, 132, [(64, 1), (128, 1), (256, 1), (128, 2), (128, 4)]),
    (4096, 4095, 132, [(64, 1), (128, 1), (256, 1), (128, 2)]),
    (2048, 1536, 132, [(64, 1), (128, 1), (128, 2)]),  # K < 2048: no BLOCK_K 256
    (12288, 2048, 132, [(64, 1), (128, 1), (256, 1)]),
    (151936, 4096, 132, [(64, 1), (128, 1), (256, 1)]),
    (12288, 8192, 400, [(64, 1), (128, 1), (256, 1), (128, 2), (128, 4)]),  # 384 tiles < 400
])
def test_reduction_candidates(n, k, num_sms, expected):
    assert sweep.reduction_candidates(n, k, num_sms) == expected


@pytest.mark.parametrize("m", [256, 512, 513, 1024, 4096])
def test_large_and_prefill_candidates_pair_each_split_candidate_with_its_fused_twins(m):
    single = sweep.launch_candidates(m, 2048, 128, 1)
    assert not any(c.fuse_splits or c.flat_splits for c in single)
    split = sweep.launch_candidates(m, 2048, 128, 2)
    parallel = [c for c in split if not c.fuse_splits]
    nested = [c for c in split if c.fuse_splits and not c.flat_splits]
    flat = [c for c in split if c.flat_splits]
    assert len(set(split)) == len(split)
    assert len(parallel) == len(nested) == len(flat) == len(single)
    assert nested == [dataclasses.replace(c, fuse_splits=True) for c in parallel]
    assert flat == [dataclasses.replace(c, fuse_splits=True, flat_splits=True) for c in parallel]
    assert all(c.fuse_splits for c in flat)
    assert {(c.block_k, c.split_k) for c in split} == {(128, 2)}


@pytest.mark.parametrize("m", [1, 32, 64, 128])
def test_smaller_buckets_try_split_candidates_in_the_parallel_form_only(m):
    # fused lost at M <= 128 on the H200 (sweep.FUSED_CLASSES cites the measurements)
    single = sweep.launch_candidates(m, 2048, 128, 1)
    split = sweep.launch_candidates(m, 2048, 128, 2)
    assert split == [dataclasses.replace(c, split_k=2) for c in single]


def test_prefill_candidates_include_small_tiles_for_narrow_shapes():
    got = {(c.block_m, c.block_n, c.num_warps, c.num_stages, c.programs_per_sm)
           for c in sweep.launch_candidates(4096, 576, 128, 1)}
    assert {(64, 64, 4, 4, 2), (64, 64, 4, 5, 3), (128, 64, 4, 4, 2), (128, 32, 4, 4, 2)} <= got


def test_all_sweep_configs_include_fused_only_for_split_layouts():
    configs = sweep.all_sweep_configs([GemmShape("t", "down", 4096, 12288)], 132)
    # the layouts, and BLOCK_K 64 (every free class) and 256 (decode, small and mid buckets) with
    # the split layouts' ranges (6144 and 3072 per split; sweep.FREE_BLOCK_K_CLASSES)
    assert {(c.block_k, c.split_k) for c in configs} == {(64, 1), (128, 1), (256, 1), (128, 2),
                                                         (128, 4), (64, 2), (64, 4), (256, 2),
                                                         (256, 4)}
    # at BLOCK_K 256 only tiles whose stages fit 227 KiB: 16 and 32 rows, and 64 x 64 in mid
    deep = [c for c in configs if c.block_k == 256 and c.split_k > 1]
    assert {c.block_m for c in deep} == {16, 32, 64}
    assert all((c.block_m + c.block_n) * 256 * 2 * c.num_stages <= 227 * 1024 for c in deep)
    assert {tables.split_ranges(12288, c.block_k, c.split_k) for c in configs if c.split_k == 4} \
        == {((0, 3072), (3072, 6144), (6144, 9216), (9216, 12288))}
    assert {c.split_k for c in configs if c.fuse_splits} == {2, 4}
    assert sweep.canonical_config(128, 2).fuse_splits is False


@pytest.fixture
def split_sweep(monkeypatch):
    monkeypatch.setattr(sweep, "BUCKETS", (1, 32))
    monkeypatch.setattr(sweep, "SCORE_MS", (1, 32))
    monkeypatch.setattr(sweep, "SCORE_WEIGHTS", {1: 1.0, 32: 1.0})
    monkeypatch.setattr(sweep, "_LAUNCH_CANDIDATES", {
        "decode": ((16, 16, 4, 2, 1),), "small": ((16, 32, 4, 2, 1),)})
    monkeypatch.setattr(sweep, "reduction_candidates", lambda n, k, num_sms: [(16, 3)])
    monkeypatch.setattr(sweep, "FUSED_CLASSES", ("decode", "small"))  # twins at these tiny M

    def fake_clock(calls, what):
        _, m, cfg = what
        if cfg is None:
            return 1.0
        return 0.5 if cfg.fuse_splits == (m > 1) else 0.7  # parallel wins M=1, fused M=32

    monkeypatch.setattr(sweep, "time_ms", fake_clock)


def test_sweep_keeps_fused_where_it_is_faster_and_gated(split_sweep):
    entry, raw = sweep.sweep_shape(GemmShape("t", "x", 37, 100), torch.float32, 4,
                                   {"gpu_name": "cpu"}, device="cpu")
    assert (entry.block_k, entry.split_k) == (16, 3)
    assert [(b.m_max, b.fuse_splits) for b in entry.buckets] == [(1, False), (32, True)]
    assert {(r["m"], r["fuse_splits"], r["status"]) for r in raw["records"]} == {
        (1, False, "ok"), (1, True, "ok"), (32, False, "ok"), (32, True, "ok")}
    again = tables.parse_table(json.loads(json.dumps(tables.table_to_dict("cpu", [entry]))))
    assert again.entries[("float32", 37, 100)].config_for(32).fuse_splits is True


def test_a_fused_candidate_whose_bits_differ_is_never_kept(split_sweep, monkeypatch):
    real = mp.matmul_persistent

    def off_by_an_ulp(a, b, bias=None, *, config=None):
        out = real(a, b, bias, config=config)
        return out * (1 + 2.0 ** -20) if config is not None and config.fuse_splits else out

    monkeypatch.setattr(mp, "matmul_persistent", off_by_an_ulp)
    entry, raw = sweep.sweep_shape(GemmShape("t", "x", 37, 100), torch.float32, 4,
                                   {"gpu_name": "cpu"}, device="cpu")
    fused = [r for r in raw["records"] if r["fuse_splits"]]
    assert fused and all(r["status"] == "gate_failed" and r["invariance_ok"] is False
                         for r in fused)
    assert [b.fuse_splits for b in entry.buckets] == [False, False]


# ---- results page -------------------------------------------------------------------------------

def _table_json(fused: bool) -> dict:
    bucket = {"m_max": 4096, "block_m": 64, "block_n": 128, "group_m": 8, "num_warps": 4,
              "num_stages": 3, "programs_per_sm": 1,
              "measured": {"time_ms": 0.2, "torch_mm_ms": 0.1}}
    if fused:
        bucket["fuse_splits"] = True
    return {"entries": [{"n": 4096, "k": 12288, "layers": ["m/down"], "block_k": 128,
                         "split_k": 2, "selection": {"scores": {"bk128_s2": 1.1}},
                         "provenance": {"gpu_uuid": "GPU-x", "date_utc": "2026-01-01"},
                         "buckets": [bucket]}]}


def test_results_page_marks_fused_buckets_and_explains_the_mark_only_when_used():
    fused = "\n".join(make_results._table_section(_table_json(True), "t.json"))
    plain = "\n".join(make_results._table_section(_table_json(False), "t.json"))
    assert "| 4096 | 12288 | 64x128 w4 s3 p1 fused (2.00) |" in fused
    assert "| 4096 | 12288 | 64x128 w4 s3 p1 (2.00) |" in plain
    assert "`fused`: the split-K partial sums are added inside the GEMM kernel" in fused
    assert "fused" not in plain


def test_check_section_counts_fused_configurations():
    def gate(cfg):
        return {"config": cfg, "passed": True}

    base = {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 8, "num_warps": 4,
            "num_stages": 4, "programs_per_sm": 1}
    gates = [gate({**base, "split_k": 1}), gate({**base, "split_k": 2}),
             gate({**base, "split_k": 2, "fuse_splits": True}),
             gate({**base, "split_k": 3, "fuse_splits": True})]
    assert make_results._check_configs(gates) == (
        "four launch configurations including split-K 2 and fused split-K 2 and 3 (partial "
        "sums added inside the GEMM kernel)")
    assert make_results._check_configs(gates[:2]) == (
        "two launch configurations including split-K 2")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_parallel_split_k_sums_in_split_order_whichever_program_arrives_last(tma):
    # Many tiles and splits on 132 SMs: the program bringing a tile's last partial varies from
    # launch to launch, the bits must not. Reference: the fused mode (one program, split order).
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    a = torch.randn(300, 12288, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    for split in (2, 3, 4):
        for block_m, block_n in ((16, 64), (64, 128)):
            parallel = tables.GemmConfig(block_m, block_n, 128, 8, 4, 4, split, tma=tma)
            fused = dataclasses.replace(parallel, fuse_splits=True)
            for m in (1, 16, 300):
                for with_bias in (None, bias):
                    expected = mp.matmul_persistent(a[:m], w.t(), with_bias, config=fused)
                    for _ in range(5):  # the first through Triton, then the plan
                        _assert_same_bits(
                            mp.matmul_persistent(a[:m], w.t(), with_bias, config=parallel),
                            expected)
    torch.cuda.synchronize()
    assert all(int(t.abs().sum()) == 0 for t in mp._LOCKS.values())


@needs_gpu
@pytest.mark.gpu
def test_gpu_plans_launch_below_run_on_this_triton():
    # the plans' C-launcher path is taken on this Triton (not silently the slower run())
    gen = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = torch.randn(8, 6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    for tma in (False, True):
        cfg = tables.GemmConfig(16, 64, 128, 8, 4, 4, 4, tma=tma)
        mp.matmul_persistent(a, w.t(), config=cfg)
        mp.matmul_persistent(a, w.t(), config=cfg)
    kinds = [(key, compiled) for key, compiled in mp._COMPILED.items()
             if key[0].block_n == 64 and key[0].split_k == 4]
    assert {key[14] for key, _ in kinds} == {False, True}
    for key, compiled in kinds:
        assert mp._raw_launcher(compiled, key[14]) is not None, key


def test_the_workspace_is_kept_per_stream_grows_and_large_ones_are_not_kept(monkeypatch):
    cpu = torch.device("cpu")
    buffers._WORKSPACES.pop((None, 4242), None)
    first = buffers._workspace(cpu, 4242, 2, 3, 40)
    assert first.dtype == torch.float32 and first.dim() == 1 and first.numel() == 1 << 20
    assert buffers._workspace(cpu, 4242, 4, 100, 100) is first  # fits: the same buffer
    assert buffers._workspace(cpu, 77, 2, 3, 40) is not first  # another stream: its own
    monkeypatch.setattr(buffers, "WORKSPACE_KEPT_MAX", 1 << 21)
    grown = buffers._workspace(cpu, 4242, 2, 1000, 1000)
    assert grown.numel() == 1 << 21 and any(t is first for t in buffers._RETIRED_WORKSPACES)
    big = buffers._workspace(cpu, 4242, 4, 1000, 1000)  # above the bound: this call's own
    assert big.numel() == 4_000_000 and buffers._WORKSPACES[(None, 4242)] is grown
    buffers._WORKSPACES.pop((None, 4242)), buffers._WORKSPACES.pop((None, 77))


@needs_gpu
@pytest.mark.gpu
def test_gpu_split_k_in_a_cuda_graph_replays_the_eager_bits():
    # counters and workspace captured on the capture stream, replayed on the current one
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    a = torch.randn(16, 12288, device="cuda", dtype=torch.bfloat16, generator=gen)
    cfg = tables.GemmConfig(16, 64, 128, 8, 4, 4, 2, tma=True)
    eager = mp.matmul_persistent(a, w.t(), config=cfg)
    mp.matmul_persistent(a, w.t(), config=cfg)  # compiled and planned before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mp.matmul_persistent(a, w.t(), config=cfg)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bits(out, eager)
        _assert_same_bits(mp.matmul_persistent(a, w.t(), config=cfg), eager)  # eager between


# ---- the flat fused form ------------------------------------------------------------------------

def test_flat_splits_is_normalised_away_without_fused_splits():
    assert tables.GemmConfig(16, 32, 64, 8, 4, 4, 2, flat_splits=True).flat_splits is False
    assert tables.GemmConfig(16, 32, 64, 8, 4, 4, 1, fuse_splits=True,
                             flat_splits=True).flat_splits is False
    flat = tables.GemmConfig(16, 32, 64, 8, 4, 4, 2, fuse_splits=True, flat_splits=True)
    assert flat.flat_splits is True
    assert flat != tables.GemmConfig(16, 32, 64, 8, 4, 4, 2, fuse_splits=True)
    assert flat.reduction_key() == (64, 2)


def test_a_table_keeps_flat_splits_and_rejects_it_without_fuse_splits():
    data = _fused_table_dict()
    data["entries"][1]["buckets"][2]["flat_splits"] = True
    table = tables.parse_table(data, "flat_table")
    entry = table.entries[("float32", 37, 100)]
    assert [entry.config_for(m).flat_splits for m in (1, 4, 64)] == [False, False, True]
    dumped = tables.table_to_dict(table.device_name, list(table.entries.values()))
    assert [["flat_splits" in b for b in e["buckets"]] for e in dumped["entries"]] == [
        [False, False, True], [False] * 4]
    assert tables.parse_table(json.loads(json.dumps(dumped))).entries == table.entries
    bad = _fused_table_dict()
    bad["entries"][1]["buckets"][0]["flat_splits"] = True  # a parallel bucket
    with pytest.raises(tables.TableError, match=r"bad_table: .*buckets\[0\]\.flat_splits: true is "
                                                r"a form of fused split-K; set fuse_splits"):
        tables.parse_table(bad, "bad_table")
    bad["entries"][1]["buckets"][0]["flat_splits"] = "yes"
    with pytest.raises(tables.TableError, match=r"flat_splits: got 'yes'; expected true or false"):
        tables.parse_table(bad, "bad_table")


def test_rows_alone_equal_rows_in_batch_with_flat_buckets():
    data = _fused_table_dict()
    data["entries"][1]["buckets"][2]["flat_splits"] = True  # M 5..64: flat; 2..4: nested
    tables.set_device_table(tables.parse_table(data, "flat_table"))
    try:
        a, w, bias = _inputs(64, 37, 100, torch.float32, seed=15)
        alone = {r: mp.matmul_persistent(a[r:r + 1], w.t(), bias)[0]
                 for m in (3, 17, 64) for r in row_positions(m)}
        for m in (3, 17, 64):
            batch = mp.matmul_persistent(a[:m], w.t(), bias)  # [m, 37]
            for r in row_positions(m):
                _assert_same_bits(batch[r], alone[r])
    finally:
        tables.reset_device_table()
