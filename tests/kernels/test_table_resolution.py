"""Which table serves a GPU (its name, the user's, its architecture) and which serves each shape
(bistat's entry, vLLM's own table, vLLM's fixed configuration). No torch needed for resolution."""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from bistat_kernels import resolution, tables
from bistat_kernels.resolution import DeviceFacts
from bistat_kernels.vllm_table import read_vllm_table

H200_TABLE = tables.TABLES_DIR / "nvidia_h200.json"
H100 = DeviceFacts("NVIDIA H100 80GB HBM3", "9.0", 132)
NO_VLLM = {"vllm_configs": None}

# A file in vLLM's own format (batch_invariant_configs.py), written for these tests: one Hopper
# shape with three buckets, one Ada shape.
VLLM_CONFIGS = '''
from typing import NamedTuple
class _MatmulMConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
class _MatmulShapeConfig(NamedTuple):
    block_k: int
    m_buckets: tuple
_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS: dict = {
    "ada": {(4096, 2048): _MatmulShapeConfig(block_k=64, m_buckets=(
        (1, _MatmulMConfig(16, 256, 8, 3)),))},
    "hopper": {(4096, 2048): _MatmulShapeConfig(block_k=128, m_buckets=(
        (1, _MatmulMConfig(16, 64, 8, 5)),
        (64, _MatmulMConfig(64, 32, 4, 3)),
        (2048, _MatmulMConfig(64, 64, 4, 4)),
    ))},
}
'''


def _vllm_package(tmp_path: Path, version: str = "0.34.0") -> Path:
    """A vllm/ folder with _version.py and the configs file; returns the configs file."""
    configs = tmp_path / "vllm" / "model_executor" / "determinism" / "batch_invariant_configs.py"
    configs.parent.mkdir(parents=True)
    configs.write_text(VLLM_CONFIGS, encoding="utf-8")
    (tmp_path / "vllm" / "_version.py").write_text(
        f"__version__ = version = '{version}'\n", encoding="utf-8")
    return configs


def _dirs(tmp_path: Path, shipped: tuple[Path, ...] = (H200_TABLE,)) -> dict:
    shipped_dir, user_dir = tmp_path / "shipped", tmp_path / "user"
    shipped_dir.mkdir()
    user_dir.mkdir()
    for path in shipped:
        shutil.copy(path, shipped_dir / path.name)
    return {"shipped_dir": shipped_dir, "user_dir": user_dir, "environ": {}}


def _retitled(device: str, cap: str, sms: int) -> dict:
    """The H200's table as if measured on ``device`` (compute capability, multiprocessors)."""
    data = json.loads(H200_TABLE.read_text(encoding="utf-8"))
    data["device_name"] = device
    for entry in data["entries"]:
        entry["provenance"] = dict(entry["provenance"], gpu_name=device, compute_capability=cap,
                                   multiprocessors=sms)
    return data


def test_an_h100_gets_the_h200_table_by_architecture(tmp_path):
    found = resolution.resolve(H100, **_dirs(tmp_path), **NO_VLLM)
    assert (found.how, Path(found.path).name, found.table.device_name) == (
        "architecture", "nvidia_h200.json", "NVIDIA H200")
    assert found.describe() == (
        "nvidia_h200.json, by architecture (no table for NVIDIA H100 80GB HBM3; NVIDIA H200's "
        "was measured with the same compute capability 9.0 and 132 multiprocessors); shapes "
        "without an entry: vLLM's fixed configuration (vLLM is not installed)")
    assert found.shape_source("bfloat16", 4096, 2048) == "bistat table nvidia_h200.json"
    assert found.shape_source("bfloat16", 111, 222) == (
        "vLLM's fixed configuration, on bistat's kernel")
    assert found.to_dict()["how"] == "architecture" and found.to_dict()["shapes"] == 15


@pytest.mark.parametrize("facts,why", [
    (DeviceFacts("NVIDIA H100 PCIe", "9.0", 114),
     "no table for NVIDIA H100 PCIe or for its compute capability 9.0, 114 multiprocessors"),
    (DeviceFacts("NVIDIA A100-SXM4-80GB", "8.0", 108),
     "no table for NVIDIA A100-SXM4-80GB or for its compute capability 8.0, 108 multiprocessors"),
    (DeviceFacts("NVIDIA H100 80GB HBM3"), "no table for NVIDIA H100 80GB HBM3"),
])
def test_another_multiprocessor_count_or_capability_is_no_match(tmp_path, facts, why):
    found = resolution.resolve(facts, **_dirs(tmp_path), **NO_VLLM)
    assert (found.how, found.table, found.path) == ("none", None, None)
    assert found.table_text() == f"none ({why}; make one with `bistat kernels tune`)"


def test_the_gpus_own_table_wins_the_users_first_and_the_override_over_all(tmp_path):
    dirs = _dirs(tmp_path)
    shipped_h100 = dirs["shipped_dir"] / "nvidia_h100_80gb_hbm3.json"
    shipped_h100.write_text(json.dumps(_retitled(H100.name, "9.0", 132)), encoding="utf-8")
    found = resolution.resolve(H100, **dirs, **NO_VLLM)
    assert (found.how, found.path) == ("name", str(shipped_h100))
    assert found.table_text() == "nvidia_h100_80gb_hbm3.json, shipped for this GPU"
    user_h100 = dirs["user_dir"] / "nvidia_h100_80gb_hbm3.json"
    shutil.copy(shipped_h100, user_h100)
    found = resolution.resolve(H100, **dirs, **NO_VLLM)
    assert (found.how, found.path) == ("user", str(user_h100))
    assert found.table_text() == (f"nvidia_h100_80gb_hbm3.json, this GPU's own, from `bistat "
                                  f"kernels tune` ({user_h100})")
    dirs["environ"] = {tables.TABLE_ENV: "nvidia_h200"}
    found = resolution.resolve(H100, **dirs, **NO_VLLM)
    assert (found.how, found.path) == ("env", str(dirs["shipped_dir"] / "nvidia_h200.json"))
    assert found.table_text() == ("nvidia_h200.json, named by BISTAT_GEMM_TABLE, measured on "
                                  "NVIDIA H200")


def test_a_users_table_of_the_same_architecture_comes_before_the_shipped_one(tmp_path):
    dirs = _dirs(tmp_path)
    (dirs["user_dir"] / "stray.json").write_text("{}", encoding="utf-8")  # not a table: skipped
    mine = dirs["user_dir"] / "nvidia_gh200_480gb.json"
    mine.write_text(json.dumps(_retitled("NVIDIA GH200 480GB", "9.0", 132)), encoding="utf-8")
    found = resolution.resolve(H100, **dirs, **NO_VLLM)
    assert (found.how, found.path, found.table.device_name) == (
        "architecture", str(mine), "NVIDIA GH200 480GB")


def test_a_table_whose_entries_disagree_on_the_architecture_matches_nothing(tmp_path):
    dirs = _dirs(tmp_path, shipped=())
    data = _retitled("NVIDIA H200", "9.0", 132)
    data["entries"][3]["provenance"]["multiprocessors"] = 114
    (dirs["shipped_dir"] / "mixed.json").write_text(json.dumps(data), encoding="utf-8")
    assert resolution.resolve(H100, **dirs, **NO_VLLM).how == "none"


def test_the_shipped_tables_serve_a_hopper_of_132_multiprocessors_by_architecture():
    """On the real shipped folder, whatever tables it holds: a Hopper GPU of another name."""
    found = resolution.resolve(DeviceFacts("NVIDIA GH200 480GB", "9.0", 132), environ={},
                               user_dir=Path("/nonexistent"), vllm_configs=None)
    assert found.how == "architecture"
    assert Path(found.path).parent == tables.TABLES_DIR
    assert resolution._architecture(found.table) == ("9.0", 132)


def test_the_user_folder_follows_bistat_home_unless_named():
    assert resolution.user_tables_dir({"BISTAT_GEMM_TABLE_DIR": "/t", "BISTAT_HOME": "/h"}) \
        == Path("/t")
    assert resolution.user_tables_dir({"BISTAT_HOME": "/h"}) == Path("/h/gemm_tables")
    assert resolution.user_tables_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/bistat/gemm_tables")
    assert resolution.user_tables_dir({}) == Path.home() / ".cache" / "bistat" / "gemm_tables"


def test_resolution_logs_one_line_and_the_launcher_uses_the_table(tmp_path, monkeypatch, caplog):
    dirs = _dirs(tmp_path)
    monkeypatch.setattr(tables, "TABLES_DIR", dirs["shipped_dir"])
    monkeypatch.setenv(resolution.TABLE_DIR_ENV, str(dirs["user_dir"]))
    monkeypatch.delenv(tables.TABLE_ENV, raising=False)
    monkeypatch.setattr(resolution, "configs_path", lambda: None)
    tables.reset_device_table()
    try:
        with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
            table = tables.resolve_device_table(H100)
            assert tables.resolve_device_table(H100) is table  # once
            cfg = tables.lookup_config(1, 4096, 2048, "bfloat16", H100)
        entry = tables.load_table(H200_TABLE).lookup("bfloat16", 4096, 2048)
        assert cfg == entry.config_for(1)
        assert [r.getMessage() for r in caplog.records] == [
            "bistat_kernels: batch-invariant GEMM table for NVIDIA H100 80GB HBM3 (compute "
            "capability 9.0, 132 multiprocessors): " + tables.resolution().describe()]
        assert tables.resolution().how == "architecture"
        # the lines a vLLM run keeps of its engine log, and what a finding's environment shows
        from bistat.analysis.activation import logged_gemm_tables
        from bistat.engines.vllm_server import LOG_FINDING_RE

        with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
            tables.note_shape("bfloat16", 4096, 2048, tables.shape_source("bfloat16", 4096, 2048))
        lines = [r.getMessage() for r in caplog.records]
        assert all(LOG_FINDING_RE.search(line) for line in lines)
        assert logged_gemm_tables(lines) == ((tables.resolution().describe(),),
                                             (("bistat table nvidia_h200.json", 1),))
    finally:
        tables.reset_device_table()


def test_a_shape_bistat_lacks_goes_to_vllms_table_then_to_its_fixed_configuration(
        tmp_path, caplog):
    configs = _vllm_package(tmp_path)
    empty = {"schema": tables.SCHEMA, "device_name": H100.name, "entries": []}
    dirs = _dirs(tmp_path, shipped=())
    (dirs["user_dir"] / "nvidia_h100_80gb_hbm3.json").write_text(json.dumps(empty))
    found = resolution.resolve(H100, vllm_configs=configs, **dirs)
    assert found.vllm.describe() == ("vLLM 0.34.0's hopper table (1 shapes), else vLLM's fixed "
                                     "configuration")
    assert found.shape_source("bfloat16", 4096, 2048) == (
        "vLLM 0.34.0's hopper table, on bistat's kernel")
    assert found.shape_source("bfloat16", 4096, 2048, vllm_kernel=True) == (
        "vLLM 0.34.0's hopper table, on vLLM's own kernel")
    assert found.shape_source("float16", 4096, 2048) == (  # vLLM's tables are bfloat16 only
        "vLLM's fixed configuration, on bistat's kernel")
    tables.install_resolution(found)
    try:
        with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
            got = [tables.lookup_config(m, 4096, 2048, "bfloat16", None)
                   for m in (1, 2, 64, 65, 4096)]
            fixed = tables.lookup_config(8, 576, 576, "bfloat16", None)
        # vLLM's launch: its BLOCK_K per shape, GROUP_SIZE_M 8, one program per multiprocessor,
        # no split-K; the first bucket with max_m >= M, the last one above the range
        assert [(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) for c in got] == [
            (16, 64, 128, 8, 5), (64, 32, 128, 4, 3), (64, 32, 128, 4, 3), (64, 64, 128, 4, 4),
            (64, 64, 128, 4, 4)]
        assert {(c.group_m, c.split_k, c.programs_per_sm, c.tma) for c in got} == {(8, 1, 1, False)}
        assert fixed == tables.DEFAULT_CONFIGS["bfloat16"]
        assert [r.getMessage() for r in caplog.records] == [
            "bistat_kernels: batch-invariant GEMM bfloat16 N=4096 K=2048 served by vLLM 0.34.0's "
            "hopper table, on bistat's kernel",
            "bistat_kernels: batch-invariant GEMM bfloat16 N=576 K=576 served by vLLM's fixed "
            f"configuration, on bistat's kernel {tables.DEFAULT_CONFIGS['bfloat16']}"]
    finally:
        tables.reset_device_table()


@pytest.mark.parametrize("cap,reason", [
    ("8.0", "vLLM 0.34.0 has no tuned table for compute capability 8.0"),
    (None, "vLLM 0.34.0 has no tuned table for compute capability unknown"),
])
def test_no_vllm_family_for_the_capability_leaves_the_fixed_configuration(tmp_path, cap, reason):
    got = read_vllm_table(_vllm_package(tmp_path), cap)
    assert (got.table, got.reason) == (None, reason)
    assert read_vllm_table(_vllm_package(tmp_path / "ada"), "8.9").table.lookup(
        "bfloat16", 4096, 2048).block_k == 64


def test_a_configs_file_that_is_not_vllms_format_is_named_not_raised(tmp_path):
    configs = _vllm_package(tmp_path)
    configs.write_text("_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS = {'hopper': {(1, 2): 3}}\n")
    got = read_vllm_table(configs, "9.0")
    assert got.table is None and got.reason.startswith(f"{configs} could not be read as vLLM's")
    assert got.describe().startswith("vLLM's fixed configuration (")


def test_vllm_0_34_0s_own_loader_picks_what_the_fallback_launches(tmp_path, monkeypatch):
    """Every shape of vLLM 0.34.0's Hopper table at batch sizes across its buckets: vLLM's own
    ``_get_matmul_config`` (its file executed, vllm.platforms stubbed to sm_90) and the fallback
    read with ``ast`` give the same launch."""
    import torch
    from vllm_wheels import CONFIGS_IN_WHEEL, load_vllm_configs_module, vllm_wheel

    wheel = vllm_wheel("0.34.0")
    own = load_vllm_configs_module(monkeypatch, wheel)
    configs = tmp_path / "batch_invariant_configs.py"
    configs.write_bytes(zipfile.ZipFile(wheel).read(CONFIGS_IN_WHEEL))
    fallback = read_vllm_table(configs, "9.0", version="0.34.0")
    assert fallback.label() == "vLLM 0.34.0's hopper table"
    default = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
               "num_stages": 3, "num_warps": 8}
    shapes = sorted(own._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"])
    assert len(shapes) == len(fallback.table.entries) == 13
    for n, k in shapes:
        entry = fallback.table.lookup("bfloat16", n, k)
        for m in (1, 3, 8, 17, 64, 200, 512, 1024, 2048, 4096, 9999):
            c = entry.config_for(m)
            assert own._get_matmul_config(m, n, k, torch.bfloat16, default) == {
                "BLOCK_SIZE_M": c.block_m, "BLOCK_SIZE_N": c.block_n, "BLOCK_SIZE_K": c.block_k,
                "GROUP_SIZE_M": c.group_m, "num_warps": c.num_warps,
                "num_stages": c.num_stages}, (n, k, m)


def test_every_shipped_table_says_which_architecture_it_was_measured_on():
    """The resolution by architecture reads each entry's compute capability and multiprocessor
    count; a table shipped without them would match no other GPU, silently."""
    shipped = sorted(tables.TABLES_DIR.glob("*.json"))
    assert shipped
    for path in shipped:
        table = tables.load_table(path)
        cap, sms = resolution._architecture(table)
        assert cap is not None and sms is not None, path.name
        assert table.device_name == table.entries[next(iter(table.entries))].provenance.get(
            "torch_device_name", table.device_name), path.name
        assert tables.table_path_for(table.device_name) == path  # found by its own GPU's name
