"""kernels/make_results.py: the status/provenance section and the fused split-K comparison."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from bistat_kernels import make_results, tables
from helpers_kernels import torch  # noqa: F401  (skips without torch/triton)

KERNELS = Path(make_results.__file__).resolve().parent


def _prov(uuid: str, date: str, command: str, **extra) -> dict:
    return {"gpu_name": "NVIDIA H200", "gpu_uuid": uuid, "driver": "580", "torch": "2.11",
            "triton": "3.6", "date_utc": date, "command": command, **extra}


def _bench(geomean: float, decode: float) -> dict:
    return {"provenance": _prov("GPU-b", "d2", "gpu_call.py probe bench"),
            "summary": {"geomean_tuned_over_mm": geomean, "decode_max_m": 32,
                        "decode_geomean_tuned_over_mm": decode}}


def _table(measured: dict, triton: str = "3.6") -> dict:
    bucket = {"m_max": 4096, "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
              "measured": measured}
    return {"device_name": "NVIDIA H200",
            "entries": [{"n": 4096, "k": 12288, "buckets": [bucket],
                         "provenance": _prov("GPU-a", "d1", "gpu_call.py sweep",
                                             triton=triton)}]}


def test_status_says_goal_met_and_names_each_artefacts_gpu():
    fused = {"provenance": _prov("GPU-b", "d0", "fused_compare.py")}
    lines = make_results._status_section(
        _bench(1.1406, 1.063), {"passed": True, "provenance": _prov("GPU-b", "d2", "x")}, None,
        _table({"source": "s"}), fused, "h")
    text = "\n".join(lines)
    assert lines[2] == ("Goal met: geometric mean of tuned / torch.mm 1.141 (target <= 1.15, "
                        "met), at M <= 32 1.063 (target <= 1.25, met); both gates on every "
                        "table entry: yes.")
    assert ("| `kernels/tables/h.json`: sweep of 1 entry | NVIDIA H200 (GPU-a) | d1 | "
            "`gpu_call.py sweep` |") in lines
    assert ("| `kernels/tables/h.json`: 1 bucket set from the fused split-K comparison "
            "(4096x12288 M<=4096) | NVIDIA H200 (GPU-b) | d0 | `fused_compare.py` |") in lines
    assert lines[-1] == (
        "Every ratio to torch.mm in the bench was measured side by side in one run on one GPU "
        "(GPU-b), so the goal status stands on its own. The table's sweep ran on another GPU "
        "(GPU-a), a sibling with the same model, driver, torch and triton: the bench measures how "
        "well its launch choices carry over, and the sweep-time ratios in the table section are "
        "that GPU's.")
    assert "not met" not in text


def test_status_says_not_met_and_names_a_differing_version():
    lines = make_results._status_section(_bench(1.2, 1.1), {"passed": False, "provenance": {}},
                                         None, _table({}, triton="3.5"), None, "h")
    assert lines[2].startswith("Goal **not met**: geometric mean of tuned / torch.mm 1.200 "
                               "(target <= 1.15, **not met**)")
    assert lines[2].endswith("both gates on every table entry: **no**.")
    assert "same model, driver and torch but a different triton:" in lines[-1]
    assert not any("fused split-K comparison" in line for line in lines)


def test_fused_section_picks_the_best_fused_launch_per_row():
    row = {"n": 2048, "k": 6144, "m": 1024, "table": 0.050, "table_equal": True,
           "fused": 0.060, "fused_equal": True, "fused_128x128w8s3": 0.040,
           "fused_128x128w8s3_equal": True, "fused_128x256w8s3": "OutOfResources(1, 2)",
           "mm": 0.032}
    cfg = {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 3,
           "programs_per_sm": 1, "fuse_splits": False}
    doc = {"provenance": _prov("GPU-b", "d0", "c", reconstructed=True, note="drafted"),
           "table_configs_reconstructed": {"2048x6144/M=1024": cfg}, "rows": [row]}
    lines = make_results._fused_section(doc, "f.json")
    assert "Note: drafted" in lines
    assert ("| 2048 | 6144 | 1024 | table (128x128 w4 s3 p1) | 50.0 | 60.0 | fused 128x128 w8 "
            "s3 p1 | 40.0 | 32.0 | 0.80 | 1.25 | yes |") in lines
    assert lines[-1] == "Did not launch (error text in the file): `fused_128x256w8s3`."
    row["fused_equal"] = False
    assert "| **no** |" in make_results._fused_section(doc, "f.json")[-3]


def test_committed_fused_comparison_keeps_the_measured_numbers_and_says_how():
    doc = json.loads((KERNELS / "results" / "fused_compare_nvidia_h200.json").read_text())
    prov = doc["provenance"]
    assert prov["reconstructed"] is True and "earlier draft" in prov["note"]
    assert prov["gpu_uuid"] == "GPU-5a063f7e-dba3-0564-e90e-802315aa3708"
    assert "graph_time_ms" in prov["draft_script_source"]
    big = next(r for r in doc["rows"] if (r["n"], r["k"], r["m"]) == (4096, 12288, 4096))
    assert round(big["fused_128x128w8s3"], 3) == 0.643 and round(big["table"], 3) == 0.707
    # the table's fused buckets name this file as their source and carry its numbers
    table = tables.load_table(KERNELS / "tables" / "nvidia_h200.json")
    bucket = table.lookup("bfloat16", 4096, 12288).buckets[-1]
    assert bucket.fuse_splits and "fused_compare_nvidia_h200.json" in bucket.measured["source"]
    assert bucket.measured["time_ms"] == round(big["fused_128x128w8s3"], 5)


def _fused_compare_module():
    path = KERNELS / "device" / "fused_compare.py"
    spec = importlib.util.spec_from_file_location("fused_compare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fused_compare_variants_keep_the_reduction_layout():
    fc = _fused_compare_module()
    cfg = tables.GemmConfig(64, 64, 128, 8, 4, 4, 2, 2)
    out = fc.variants(cfg)
    assert list(out) == ["table", "fused", "fused_128x128w8s3", "fused_128x256w8s3",
                         "fused_128x128w4s4", "fused_64x128w4s4"]
    assert out["fused"] == tables.GemmConfig(64, 64, 128, 8, 4, 4, 2, 2, fuse_splits=True)
    assert out["fused_128x128w8s3"] == tables.GemmConfig(128, 128, 128, 8, 8, 3, 2, 1, True)
    assert {c.reduction_key() for c in out.values()} == {(128, 2)}
    assert fc.parse_shapes("4096x12288, 2048x6144") == ((4096, 12288), (2048, 6144))
