"""``bistat kernels export-vllm``: the H200 table in vLLM 0.33.0's tuned-table format.

The exported file is loaded by vLLM 0.33.0's own loader code (``batch_invariant_configs.py`` read
from the wheel, with ``vllm.platforms`` stubbed to report a compute capability) where
BISTAT_VLLM_WHEELS names a folder with the wheel (tests/external.py; CI may not have it). Everywhere,
the file is checked against the format's schema as that module declares it
(``export_vllm.parse_vllm_source``, with ``ast``) and against the table it came from.
"""

from __future__ import annotations

import json
import re
import types
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from external import vllm_wheel

from bistat.cli import cli
from bistat_kernels import export_vllm, tables
from vllm_wheels import load_vllm_configs_module

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "kernels/bistat_kernels/tables/nvidia_h200.json"
EXPORTED = ROOT / "kernels/results/vllm_tuned_configs_nvidia_h200.py"
VERSIONS = ("0.33.0", "0.34.0")
CONFIGS_IN_WHEEL = "vllm/model_executor/determinism/batch_invariant_configs.py"
PROV = {"gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-test", "driver": "1.0",
        "compute_capability": "9.0", "torch": "2.11.0", "triton": "3.6.0",
        "date_utc": "2026-01-01T00:00:00Z", "command": "test"}


def _table(entries: list[dict]) -> tables.GemmTable:
    return tables.parse_table({"schema": tables.SCHEMA, "device_name": "NVIDIA H200",
                               "entries": entries}, "t.json")


def _entry(n: int, k: int, split_k: int = 1, dtype: str = "bfloat16", prov=PROV,
           **bucket_extra) -> dict:
    buckets = [{"m_max": 1, "block_m": 16, "block_n": 64, "group_m": 8, "num_warps": 4,
                "num_stages": 5, "measured": {"m": 1, "time_ms": 0.011, "torch_mm_ms": 0.010}},
               {"m_max": 4096, "block_m": 128, "block_n": 128, "group_m": 4, "num_warps": 8,
                "num_stages": 3, **bucket_extra}]
    return {"dtype": dtype, "n": n, "k": k, "block_k": 64, "split_k": split_k,
            "buckets": buckets, "layers": [f"m/{n}x{k}"], "provenance": prov}


def _vllm_launch(entry: tables.ShapeConfig, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) the export gives ``m``: our bucket's, or, where the
    bucket has its own BLOCK_K, the launch the re-tune replaced (at the entry's BLOCK_K)."""
    c = entry.config_for(m)
    if c.block_k == entry.block_k:
        return (c.block_m, c.block_n, c.num_warps, c.num_stages)
    bucket = next((b for b in entry.buckets if m <= b.m_max), entry.buckets[-1])
    was = dict(re.findall(r"(\w+)=(\w+)", bucket.measured["previous"]["config"]))
    assert int(was["block_k"]) == entry.block_k
    return tuple(int(was[f]) for f in ("block_m", "block_n", "num_warps", "num_stages"))


def _expected(entry: tables.ShapeConfig, m: int) -> dict[str, int]:
    """What vLLM's _get_matmul_config must return for ``m``: the exported launch at the entry's
    BLOCK_K, GROUP_SIZE_M 8."""
    bm, bn, warps, stages = _vllm_launch(entry, m)
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": entry.block_k,
            "GROUP_SIZE_M": 8, "num_warps": warps, "num_stages": stages}


def test_the_h200_table_exports_12_shapes_and_says_what_it_left_out():
    table = tables.load_table(TABLE)
    export = export_vllm.export_table(table, source="kernels/bistat_kernels/tables/nvidia_h200.json")
    assert export.arch_family == "hopper"  # provenance: compute capability 9.0
    assert len(export.shapes) == 12
    assert [(o["n"], o["k"], o["split_k"]) for o in export.omitted] == [
        (576, 1536, 2), (2048, 6144, 2), (4096, 12288, 2)]
    assert "vLLM's kernel has no split-K" in export.omitted[0]["reason"]
    assert export.dropped_summary() == {"block_k": 58, "programs_per_sm": 34, "tma": 95}
    parsed = export_vllm.parse_vllm_source(export.python_text)
    assert list(parsed) == ["hopper"]
    for s in export.shapes:
        entry = table.lookup("bfloat16", s.n, s.k)
        block_k, buckets = parsed["hopper"][(s.n, s.k)]
        assert block_k == entry.block_k
        assert buckets == tuple((b.m_max, _vllm_launch(entry, b.m_max)) for b in entry.buckets)
        assert s.provenance["gpu_uuid"].startswith("GPU-") and s.provenance["driver"]
    # every entry's provenance and every bucket's ratio to torch.mm are in the file
    first = export.shapes[0]
    assert f"# {first.layers[0]}: NVIDIA H200 {first.provenance['gpu_uuid']}, driver " \
           f"{first.provenance['driver']}" in export.python_text
    assert export.python_text.count("x torch.mm at M=") == sum(len(s.buckets)
                                                             for s in export.shapes)
    side = export.sidecar
    first_bucket = table.lookup("bfloat16", side["entries"][0]["n"], side["entries"][0]["k"]).buckets[0]
    assert side["entries"][0]["buckets"][0]["ratio_to_torch_mm"] == pytest.approx(
        first_bucket.measured["time_ms"] / first_bucket.measured["torch_mm_ms"])
    assert side["entries"][0]["buckets"][0]["dropped"] == (
        {} if first_bucket.programs_per_sm == 1 else {"programs_per_sm": first_bucket.programs_per_sm})


def test_the_committed_export_regenerates_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the header names the table relative to the working directory
    out = tmp_path / "x.py"
    result = CliRunner().invoke(cli, ["kernels", "export-vllm", "--output", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [
        "dropped block_k (vLLM's kernel cannot express it) in 58 buckets",
        "dropped programs_per_sm (vLLM's kernel cannot express it) in 34 buckets",
        "dropped tma (vLLM's kernel cannot express it) in 95 buckets",
        *[f"omitted ({n}, {k}) bfloat16: split_k {split}: vLLM's kernel has no split-K and the "
          f"nearest layout (block_k 128, no split) was never timed; vLLM keeps its own entry or "
          f"default for this shape (`--split-k nearest` exports it anyway)"
          for n, k, split in ((576, 1536, 2), (2048, 6144, 2), (4096, 12288, 2))]]
    assert out.read_bytes() == EXPORTED.read_bytes()
    assert out.with_suffix(".provenance.json").read_bytes() == \
        EXPORTED.with_suffix(".provenance.json").read_bytes()


def test_split_k_nearest_exports_it_marked_unmeasured_and_lists_every_dropped_field():
    table = _table([_entry(512, 1024, split_k=2, programs_per_sm=2, fuse_splits=True)])
    with pytest.raises(export_vllm.ExportError, match=r"t\.json: no entry can be expressed"):
        export_vllm.export_table(table)
    export = export_vllm.export_table(table, split_k="nearest")
    (shape,) = export.shapes
    assert shape.unmeasured.startswith("split_k 2 dropped")
    assert [b.dropped for b in shape.buckets] == [
        {"split_k": 2},
        {"split_k": 2, "group_m": 4, "programs_per_sm": 2, "fuse_splits": True}]
    assert "#   UNMEASURED: split_k 2 dropped" in export.python_text
    assert "; dropped split_k=2, group_m=4, programs_per_sm=2, fuse_splits=True" in \
        export.python_text
    assert export.dropped_summary() == {"fuse_splits": 1, "group_m": 1, "programs_per_sm": 1,
                                        "split_k": 2}


def test_a_bucket_with_its_own_block_k_exports_a_smaller_buckets_launch():
    """vLLM's format has one BLOCK_K per shape; the 128x128 launch was measured at BLOCK_K 128,
    so the bucket is exported with the M = 1 bucket's launch (which ran at the entry's 64)."""
    table = _table([_entry(512, 1024, block_k=128)])
    export = export_vllm.export_table(table)
    (shape,) = export.shapes
    assert shape.block_k == 64
    assert [(b.block_m, b.block_n, b.num_warps, b.num_stages) for b in shape.buckets] == [
        (16, 64, 4, 5), (16, 64, 4, 5)]
    assert shape.buckets[1].dropped == {"group_m": 4, "block_k": 128}
    assert shape.buckets[1].exported_from == {
        "launch": "bucket m_max 1's launch, not timed at this M"}
    parsed = export_vllm.parse_vllm_source(export.python_text)
    assert parsed["hopper"][(512, 1024)] == (64, ((1, (16, 64, 4, 5)), (4096, (16, 64, 4, 5))))
    assert ("; dropped group_m=4, block_k=128; exported: bucket m_max 1's launch, not timed at "
            "this M") in export.python_text
    assert export.dropped_summary() == {"block_k": 1, "group_m": 1}


def test_a_retuned_bucket_exports_the_launch_it_replaced_with_its_time():
    """sweep.retune_buckets records the launch it replaced at the entry's BLOCK_K, timed at the
    same M: that launch is exported (it fits and was measured), bistat's own time beside it."""
    previous = {"config": str(tables.GemmConfig(128, 128, 64, 8, 8, 3, 1, tma=True)),
                "time_ms": 0.7}
    table = _table([_entry(512, 1024, block_k=128, measured={
        "m": 4096, "time_ms": 0.6, "torch_mm_ms": 0.5, "source": "r.json (sweep.retune_buckets)",
        "previous": previous})])
    (shape,) = export_vllm.export_table(table).shapes
    b = shape.buckets[1]
    assert (b.block_m, b.block_n, b.num_warps, b.num_stages) == (128, 128, 8, 3)
    assert b.exported_from == {"launch": "the bucket's launch before the re-tune, at the entry's "
                                         "block_k", "time_ms": 0.7, "m": 4096}
    text = export_vllm.export_table(table).python_text
    assert ("(4096, _MatmulMConfig(128, 128, 8, 3)),  # 0.6 ms = 1.200x torch.mm at M=4096 "
            "(retune); dropped group_m=4, block_k=128; exported: the bucket's launch before the "
            "re-tune, at the entry's block_k (0.7 ms at M=4096)") in text
    # a replaced launch at another BLOCK_K than the entry's is not taken
    previous["config"] = str(tables.GemmConfig(128, 128, 128, 8, 8, 3, 1))
    (shape,) = export_vllm.export_table(_table([_entry(512, 1024, block_k=128, measured={
        "m": 4096, "time_ms": 0.6, "torch_mm_ms": 0.5, "previous": previous})])).shapes
    assert shape.buckets[1].exported_from["launch"].startswith("bucket m_max 1's launch")


def test_non_bf16_entries_are_omitted_and_the_family_must_be_known():
    table = _table([_entry(64, 512), _entry(64, 512, dtype="float32")])
    export = export_vllm.export_table(table)
    assert [(s.n, s.k) for s in export.shapes] == [(64, 512)]
    assert export.omitted[0]["reason"] == ("dtype float32: vLLM 0.33.0's tuned tables apply to "
                                           "bfloat16 only")
    with pytest.raises(export_vllm.ExportError,
                       match=r"t\.json: entries were measured on compute capability 9\.0 "
                             r"\(hopper\), not 'ada'"):
        export_vllm.export_table(table, arch_family="ada")
    unknown = _table([_entry(64, 512, prov={"gpu_name": "x"})])
    with pytest.raises(export_vllm.ExportError, match="no entry's provenance has a "
                                                      "compute_capability; pass --arch-family"):
        export_vllm.export_table(unknown)
    assert export_vllm.export_table(unknown, arch_family="blackwell").arch_family == "blackwell"
    mixed = _table([_entry(64, 512), _entry(64, 1024, prov=dict(PROV, compute_capability="8.0"))])
    with pytest.raises(export_vllm.ExportError, match=r"capabilities 8\.0, 9\.0 map to"):
        export_vllm.export_table(mixed)
    assert [export_vllm.arch_family_for(c) for c in ("12.0", "10.0", "9.0", "8.9", "8.0")] == [
        "sm120", "blackwell", "hopper", "ada", None]


def test_the_cli_names_a_bad_table(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    result = CliRunner().invoke(cli, ["kernels", "export-vllm", "--table", str(bad),
                                      "--output", str(tmp_path / "o.py")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {bad}: not valid JSON")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("(4, _MatmulMConfig", "(1, _MatmulMConfig", 1),
     r"m_buckets\[1\]: max_m 1 after 1; sort ascending"),
    (lambda t: t.replace("_MatmulMConfig(16, 32, 4, 6)", "_MatmulMConfig(16, 32, 4)", 1),
     "_MatmulMConfig takes block_m, block_n, num_warps, num_stages"),
    (lambda t: t.replace('"hopper": {', '"h100": {'), "key 'h100' is not one of"),
    (lambda t: t.replace("block_k=128", "block_k=0", 1), "expected a positive integer literal"),
])
def test_the_schema_check_names_what_breaks_it(edit, message):
    text = EXPORTED.read_text(encoding="utf-8")
    export_vllm.parse_vllm_source(text)
    with pytest.raises(export_vllm.ExportError, match=message):
        export_vllm.parse_vllm_source(edit(text))


def _load_vllm_configs_module(monkeypatch, version: str) -> types.ModuleType:
    """vLLM VERSION's batch_invariant_configs.py, from the wheel BISTAT_VLLM_WHEELS names, with
    vllm.platforms stubbed."""
    pytest.importorskip("torch")
    return load_vllm_configs_module(monkeypatch, vllm_wheel(version))


def test_vllm_0_34_0_kept_0_33_0s_tuned_table_file_byte_for_byte():
    """So the export, written for 0.33.0's format, is 0.34.0's format too."""
    old, new = (zipfile.ZipFile(vllm_wheel(v)).read(CONFIGS_IN_WHEEL) for v in VERSIONS)
    assert old == new and b"_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS" in new


@pytest.mark.parametrize("version", VERSIONS)
def test_vllms_own_loader_reads_the_export(monkeypatch, version):
    """vLLM 0.33.0's and 0.34.0's loader code reads the exported table as ours."""
    import torch

    vllm_cfg = _load_vllm_configs_module(monkeypatch, version)
    own_hopper = dict(vllm_cfg._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"])
    exported: dict = {}
    exec(compile(EXPORTED.read_text(encoding="utf-8"), str(EXPORTED), "exec"), exported)
    ours = exported[export_vllm.EXPORT_VARIABLE]
    # what a proposal upstream does: our entries merged into vLLM's hopper dict
    merged = {**vllm_cfg._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS,
              "hopper": {**own_hopper, **ours["hopper"]}}
    monkeypatch.setattr(vllm_cfg, "_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS", merged)
    vllm_cfg.resolve_tuned_matmul_configs()
    assert vllm_cfg._TUNED_MATMUL_CONFIGS_RESOLVED
    default = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
               "num_stages": 3, "num_warps": 8}
    table = tables.load_table(TABLE)
    checked = 0
    for (dtype, n, k), entry in sorted(table.entries.items()):
        for m in (1, 2, 5, 16, 33, 100, 1000, 4096, 10000):
            got = vllm_cfg._get_matmul_config(m, n, k, torch.bfloat16, default)
            if entry.split_k > 1:  # omitted: vLLM's own entry (or its default) for this shape stays
                own = own_hopper.get((n, k))
                assert got["BLOCK_SIZE_K"] == (default["BLOCK_SIZE_K"] if own is None
                                               else own.block_k)
                continue
            assert got == _expected(entry, m), (n, k, m)
            checked += 1
        assert vllm_cfg._get_matmul_config(1, n, k, torch.float16, default) is default
    assert checked == 12 * 9


def test_every_exported_bucket_is_in_the_sidecar_with_its_measurement():
    side = json.loads(EXPORTED.with_suffix(".provenance.json").read_text(encoding="utf-8"))
    table = tables.load_table(TABLE)
    assert side["schema"] == "bistat_kernels.vllm_export/1" and side["vllm_version"] == "0.33.0"
    for e in side["entries"]:
        entry = table.lookup("bfloat16", e["n"], e["k"])
        assert e["provenance"] == entry.provenance
        assert [b["measured"] for b in e["buckets"]] == [b.measured for b in entry.buckets]
        for b in e["buckets"]:
            assert b["ratio_to_torch_mm"] == pytest.approx(
                b["measured"]["time_ms"] / b["measured"]["torch_mm_ms"])
