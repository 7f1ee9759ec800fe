"""Table schema, errors, lookup, the shipped H200 table, and trace-friendliness of the lookup."""

from __future__ import annotations

import copy
import inspect
import json
import logging

import pytest
from helpers_kernels import small_table_dict, torch

from bistat_kernels import tables  # noqa: E402
from bistat_kernels.shapes import MODEL_SHAPES  # noqa: E402


def _error(data, source="t.json") -> str:
    with pytest.raises(tables.TableError) as info:
        tables.parse_table(data, source)
    return str(info.value)


@pytest.mark.parametrize("m,expected_m_max", [(1, 1), (2, 4), (4, 4), (5, 16), (16, 16),
                                              (17, 64), (64, 64), (65, 64), (100000, 64)])
def test_bucket_lookup_is_the_first_bucket_whose_bound_covers_m(m, expected_m_max):
    entry = tables.parse_table(small_table_dict()).entries[("float32", 40, 72)]
    bucket = next(b for b in entry.buckets if b.m_max == expected_m_max)
    cfg = entry.config_for(m)
    assert (cfg.block_m, cfg.block_n, cfg.group_m, cfg.num_warps, cfg.num_stages,
            cfg.programs_per_sm) == (bucket.block_m, bucket.block_n, bucket.group_m,
                                     bucket.num_warps, bucket.num_stages, bucket.programs_per_sm)
    assert cfg.reduction_key() == (32, 1)  # never depends on m


def test_round_trip_through_json_keeps_every_field():
    table = tables.parse_table(small_table_dict())
    again = tables.parse_table(json.loads(json.dumps(
        tables.table_to_dict(table.device_name, list(table.entries.values())))))
    assert again.entries == table.entries
    assert again.entries[("float32", 37, 100)].provenance == small_table_dict()["entries"][1][
        "provenance"]


def _broken(path: str, value):
    data = copy.deepcopy(small_table_dict())
    target = data
    *parents, last = path.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    if value is KeyError:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize("path,value,message", [
    ("schema", "x/1", "t.json: schema: got 'x/1'; expected 'bistat_kernels.gemm_table/1'"),
    ("device_name", "", "t.json: device_name: expected the GPU name torch reports, e.g. "
                        "'NVIDIA H200'; got ''"),
    ("entries.0.dtype", "int8", "t.json: entries[0].dtype: got 'int8'; expected one of "
                                "bfloat16, float16, float32"),
    ("entries.0.block_k", 48, "t.json: entries[0].block_k: got 48; expected a power of two "
                              "(Triton block sizes)"),
    ("entries.0.split_k", 0, "t.json: entries[0].split_k: got 0; expected an integer >= 1"),
    ("entries.0.provenance", {}, "t.json: entries[0].provenance: every entry needs its "
                                 "provenance (GPU name and UUID, driver, torch/triton versions, "
                                 "date, command)"),
    ("entries.0.buckets.1.m_max", 1, "t.json: entries[0].buckets[1].m_max: got 1 after 1; sort "
                                     "buckets by strictly increasing m_max"),
    # entry 1: K = 100, block_k 16, split_k 3 -> ranges [0, 48), [48, 96), [96, 100)
    ("entries.1.buckets.2.block_k", 32, "t.json: entries[1].buckets[2].block_k: 32 cuts K=100 "
                                        "into the split-K ranges [(0, 64), (64, 100)], the "
                                        "entry's block_k 16 into [(0, 48), (48, 96), (96, 100)]; "
                                        "a bucket's block_k must keep the entry's ranges (they "
                                        "fix the K-reduction order): remove the field or pick a "
                                        "block_k that keeps them"),
    ("entries.0.buckets.2.block_k", 48, "t.json: entries[0].buckets[2].block_k: got 48; expected "
                                        "a power of two (Triton block sizes)"),
    ("entries.0.buckets.2.split_k", 2, "t.json: entries[0].buckets[2].split_k: may not vary "
                                       "per M bucket (it changes the K-reduction order); set "
                                       "it once on the entry"),
    ("entries.0.buckets.0.num_warps", KeyError, "t.json: entries[0].buckets[0]: missing field "
                                                "'num_warps'; add it (an integer >= 1)"),
    ("entries.1.n", True, "t.json: entries[1].n: got True; expected an integer >= 1"),
])
def test_schema_errors_name_file_field_and_fix(path, value, message):
    assert _error(_broken(path, value)) == message


def test_a_bucket_may_have_its_own_block_k_where_the_split_ranges_stay():
    """Entry 0: K = 72, block_k 32, no split: every BLOCK_K keeps the one range [0, 72)."""
    data = json.loads(json.dumps(small_table_dict()))  # the entries share bucket dicts
    data["entries"][0]["buckets"][3]["block_k"] = 64
    table = tables.parse_table(data, "t.json")
    entry = table.lookup("float32", 40, 72)
    assert [entry.config_for(m).block_k for m in (1, 16, 17, 64, 5000)] == [32, 32, 64, 64, 64]
    assert {entry.config_for(m).reduction_key() for m in (1, 64)} == {(32, 1), (64, 1)}
    assert tables.split_ranges(72, 32, 1) == tables.split_ranges(72, 64, 1) == ((0, 72),)
    again = tables.table_to_dict("t", list(table.entries.values()))
    assert again["entries"][1]["buckets"][3]["block_k"] == 64  # sorted: (40, 72) after (37, 100)
    assert "block_k" not in again["entries"][1]["buckets"][2]  # absent reads as the entry's
    assert tables.parse_table(again, "t").lookup("float32", 40, 72) == entry
    # the entry's own value is accepted and normalised to absent
    data["entries"][0]["buckets"][3]["block_k"] = 32
    same = tables.parse_table(data, "t.json")
    assert same.lookup("float32", 40, 72).buckets[3].block_k is None


@pytest.mark.parametrize("k,block_k,split_k,ranges", [
    (12288, 128, 2, ((0, 6144), (6144, 12288))),
    (12288, 64, 2, ((0, 6144), (6144, 12288))),
    (1536, 256, 2, ((0, 768), (768, 1536))),  # 6 tiles of 256: 3 per split
    (1280, 256, 2, ((0, 768), (768, 1280))),  # 5 tiles: 3 per split, not K / 2
    (1280, 128, 2, ((0, 640), (640, 1280))),
    (100, 16, 3, ((0, 48), (48, 96), (96, 100))),
    (40, 32, 4, ((0, 32), (32, 40))),  # fewer tiles than splits: the empty splits add nothing
])
def test_split_ranges(k, block_k, split_k, ranges):
    assert tables.split_ranges(k, block_k, split_k) == ranges


def test_duplicate_entries_are_rejected():
    data = small_table_dict()
    data["entries"].append(copy.deepcopy(data["entries"][0]))
    assert _error(data) == ("t.json: entries[2]: duplicate entry for dtype=float32 N=40 K=72; "
                            "keep one")


def test_invalid_json_says_how_to_regenerate(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{", encoding="utf-8")
    with pytest.raises(tables.TableError, match=r"bad.json: not valid JSON \(Expecting property "
                                                r"name enclosed in double quotes at line 1\); "
                                                r"regenerate it with `bistat kernels sweep`"):
        tables.load_table(path)


def test_device_slug_and_table_path():
    assert tables.device_slug("NVIDIA H200") == "nvidia_h200"
    assert tables.device_slug("NVIDIA GeForce RTX 4090 D") == "nvidia_geforce_rtx_4090_d"
    assert tables.table_path_for("NVIDIA H200").name == "nvidia_h200.json"


def test_the_shipped_h200_table_covers_all_shapes_with_provenance():
    table = tables.load_table(tables.TABLES_DIR / "nvidia_h200.json")
    assert table.device_name == "NVIDIA H200"
    wanted = {("bfloat16", s.n, s.k) for shapes in MODEL_SHAPES.values() for s in shapes}
    assert set(table.entries) == wanted
    for entry in table.entries.values():
        assert entry.block_k in (64, 128, 256) and entry.split_k in (1, 2, 4)
        assert entry.buckets[-1].m_max == 4096
        prov = entry.provenance
        assert prov["gpu_name"] == "NVIDIA H200"
        assert prov["gpu_uuid"].startswith("GPU-")
        for field in ("driver", "torch", "triton", "date_utc", "command"):
            assert prov[field], field
        for bucket in entry.buckets:  # every bucket was measured, none derived
            assert bucket.measured["m"] == bucket.m_max
            assert bucket.measured["time_ms"] > 0 and bucket.measured["torch_mm_ms"] > 0


def test_resolution_reads_the_env_override_once(tmp_path, monkeypatch, caplog):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(small_table_dict()), encoding="utf-8")
    monkeypatch.setenv(tables.TABLE_ENV, str(path))
    tables.reset_device_table()
    try:
        first = tables.resolve_device_table("NVIDIA H200")
        path.unlink()  # a second resolution would fail: it must not happen
        assert tables.resolve_device_table("NVIDIA H200") is first
        assert tables.lookup_config(3, 40, 72, "float32", "NVIDIA H200").block_n == 32
    finally:
        tables.reset_device_table()


def test_the_override_may_name_a_shipped_table(monkeypatch):
    """BISTAT_GEMM_TABLE=nvidia_h200 loads the H200's shipped table whatever the device (the
    H200's configurations on an H100: the same sm_90 and 132 SMs); an unknown name says which
    tables ship."""
    monkeypatch.setenv(tables.TABLE_ENV, "nvidia_h200")
    tables.reset_device_table()
    try:
        got = tables.resolve_device_table("NVIDIA H100 80GB HBM3")
        assert got is not None and got.device_name == "NVIDIA H200"
        assert got.entries == tables.load_table(tables.TABLES_DIR / "nvidia_h200.json").entries
    finally:
        tables.reset_device_table()
    monkeypatch.setenv(tables.TABLE_ENV, "nvidia_h300")
    with pytest.raises(tables.TableError) as err:
        tables.resolve_device_table("NVIDIA H100 80GB HBM3")
    shipped = sorted(p.stem for p in tables.TABLES_DIR.glob("*.json"))
    assert "nvidia_h200" in shipped
    assert str(err.value) == (
        f"BISTAT_GEMM_TABLE=nvidia_h300: no table of that name in {tables.TABLES_DIR} (shipped: "
        f"{', '.join(shipped)}); give a table name or a path to a table file")
    tables.reset_device_table()

def test_missing_table_warns_and_uses_defaults(monkeypatch, caplog):
    monkeypatch.delenv(tables.TABLE_ENV, raising=False)
    tables.reset_device_table()
    try:
        with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
            assert tables.resolve_device_table("Imaginary GPU 9000") is None
            cfg = tables.lookup_config(8, 4096, 4096, "bfloat16", "Imaginary GPU 9000")
        assert cfg == tables.DEFAULT_CONFIGS["bfloat16"]
        assert [r.getMessage() for r in caplog.records] == [
            "bistat_kernels: batch-invariant GEMM table for Imaginary GPU 9000: none (no table "
            "for Imaginary GPU 9000; make one with `bistat kernels tune`); shapes without an "
            "entry: vLLM's fixed configuration (vLLM is not installed)",
            "bistat_kernels: batch-invariant GEMM bfloat16 N=4096 K=4096 served by vLLM's fixed "
            f"configuration, on bistat's kernel {tables.DEFAULT_CONFIGS['bfloat16']}"]
    finally:
        tables.reset_device_table()


def test_hot_path_avoids_what_torch_compile_rejects():
    source = inspect.getsource(tables.ShapeConfig.config_for) + inspect.getsource(
        tables.lookup_config)
    assert "lru_cache" not in source and "bisect" not in source


def test_bucket_scan_traces_under_torch_compile_with_a_symbolic_batch():
    entry = tables.parse_table(small_table_dict()).entries[("float32", 40, 72)]

    def scaled(x):
        cfg = entry.config_for(x.shape[0])
        return x * cfg.block_n

    compiled = torch.compile(scaled, backend="eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 32.0))
    assert torch.equal(compiled(torch.ones(10)), torch.full((10,), 16.0))
