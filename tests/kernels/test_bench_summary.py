"""The bench's numbers without a GPU: goal maths, the vLLM column, the roofline, the host cost,
and RESULTS.md rendering a bench document that carries them (synthetic rows with known ratios).
"""

from __future__ import annotations

import json
import math

import pytest
from helpers_kernels import torch  # noqa: F401  (skips without torch)
from scipy.stats import gmean

from bistat.cli.cmd_kernels import format_bench_summary
from bistat_kernels import bench, make_results, results_model

SHAPES = (("qwen3-8b", "o", 4096, 4096), ("qwen3-1.7b", "qkv", 4096, 2048))


def _rows(tuned_ratio: float, vllm_ratio: float | None = 1.3, missing: tuple = ()) -> list:
    """Rows of two shapes at every bench M: torch.mm 10 us, tuned and vllm at fixed ratios."""
    rows = []
    for model, layer, n, k in SHAPES:
        for m in bench.BENCH_MS:
            vllm = None if vllm_ratio is None or (layer, m) in missing else 0.01 * vllm_ratio
            rows.append(bench.BenchRow(model, layer, n, k, m, 0.01 * tuned_ratio, 0.01, 0.03,
                                       1e-3, vllm, None if vllm is None else 2e-3,
                                       model == "qwen3-8b"))
    return rows


def test_goals_hold_at_their_boundaries():
    assert (bench.GOAL_OVERALL, bench.GOAL_DECODE, bench.HOST_GOAL_US) == (1.05, 1.00, 5.0)
    at = bench.summarize(_rows(1.05))
    assert at["geomean_tuned_over_mm"] == pytest.approx(1.05)
    assert at["goal_targets"] == {"overall": 1.05, "decode": 1.0}
    assert at["goal_overall_met"] is True and at["goal_decode_met"] is False
    assert "geomean_vllm_over_mm" not in at
    decode = bench.summarize(_rows(1.0))
    assert decode["goal_overall_met"] is True and decode["goal_decode_met"] is True
    assert bench.summarize(_rows(1.051))["goal_overall_met"] is False


def test_the_goal_set_and_the_decode_set_pick_their_rows():
    rows = _rows(1.0)
    # tuned twice as slow at M = 8 and 32 only: outside GOAL_MS, inside the decode set
    rows = [r if r.m not in (8, 32) else bench.BenchRow(*[getattr(r, f) for f in (
        "model", "layer", "n", "k", "m")], 0.02, 0.01, 0.03, 1e-3) for r in rows]
    s = bench.summarize(rows)
    assert s["geomean_tuned_over_mm"] == pytest.approx(1.0)
    decode = [2.0 if m in (8, 32) else 1.0 for _ in SHAPES for m in bench.BENCH_MS if m <= 32]
    assert s["decode_geomean_tuned_over_mm"] == pytest.approx(gmean(decode))
    assert s["decode_speedup_over_default"] == pytest.approx(gmean([3 / (d) for d in decode]))
    assert s["n_rows"] == 2 * len(bench.BENCH_MS)


def test_vllm_geomeans_cover_only_the_rows_it_was_timed_in():
    rows = _rows(1.1, 1.3, missing=(("o", 4096),))
    # the row vLLM failed validation in has tuned 5x torch.mm: in tuned/mm, not in tuned/vllm
    rows = [r if (r.layer, r.m) != ("o", 4096) else bench.BenchRow(
        r.model, r.layer, r.n, r.k, r.m, 0.05, 0.01, 0.03, 1e-3, None, 0.5, True) for r in rows]
    s = bench.summarize(rows, with_vllm=True)
    assert s["n_vllm_rows"] == len(rows) - 1
    assert s["geomean_tuned_over_mm"] == pytest.approx(gmean([1.1] * 13 + [5.0]))
    assert s["geomean_vllm_over_mm"] == pytest.approx(1.3)
    assert s["decode_geomean_vllm_over_mm"] == pytest.approx(1.3)
    assert s["geomean_tuned_over_vllm"] == pytest.approx(1.1 / 1.3)
    d = rows[0].to_dict(with_vllm=True)
    assert d["vllm_ms"] == pytest.approx(0.013) and d["vllm_tuned"] is True
    assert d["vllm_over_mm"] == pytest.approx(1.3)
    assert "vllm_ms" not in rows[0].to_dict(with_vllm=False)
    assert rows[0].to_dict(with_vllm=False)["tuned_over_mm"] == pytest.approx(1.1)


def test_roofline_is_weight_bytes_over_time_over_the_copy_bandwidth():
    rows = _rows(1.25)
    out = bench.roofline_rows(rows, copy_gb_per_s=4000.0)
    assert [r["m"] for r in out] == [1, 4, 8, 16] * 2  # M <= 16 only
    first = out[0]
    assert first["weight_bytes"] == 4096 * 4096 * 2
    # 32 MiB in 10 us is 3355 GB/s: 0.839 of 4000 GB/s for torch.mm, / 1.25 for tuned
    assert first["torch_mm"] == pytest.approx(4096 * 4096 * 2 / 10e-6 / 4000e9)
    assert first["tuned"] == pytest.approx(first["torch_mm"] / 1.25)
    assert first["vllm"] == pytest.approx(first["torch_mm"] / 1.3)
    assert "vllm" not in bench.roofline_rows(_rows(1.0, None), 4000.0)[0]


def test_host_summary_judges_the_goal_on_the_worst_shape():
    host = [{"tuned_us": t, "torch_mm_us": 7.0, "vllm_us": 30.0} for t in (9.0, 11.0, 12.0)]
    s = bench.host_summary(host)
    assert s["mean_tuned_minus_mm_us"] == pytest.approx(3.6666666)
    assert s["max_tuned_minus_mm_us"] == pytest.approx(5.0)
    assert s["goal_met"] is True and s["goal_us"] == 5.0
    assert s["mean_vllm_us"] == 30.0
    host[2]["tuned_us"] = 12.1  # one shape 5.1 us over torch.mm: the mean (3.7) would pass
    assert bench.host_summary(host)["goal_met"] is False
    empty = bench.host_summary([])
    assert empty["goal_met"] is False and math.isnan(empty["mean_tuned_minus_mm_us"])


def _doc(with_vllm: bool = True) -> dict:
    """A whole bench document as run_bench writes it, from synthetic rows."""
    rows = _rows(1.02, 1.3 if with_vllm else None, missing=(("qkv", 4096),))
    host = []
    for model, layer, n, k in SHAPES:
        for m in bench.HOST_MS:
            h = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "tuned_us": 11.0,
                 "tuned_wall_us": 13.0, "torch_mm_us": 7.5, "torch_mm_wall_us": 9.0}
            if with_vllm:
                h.update(vllm_us=35.0, vllm_wall_us=36.0)
            h["tuned_minus_mm_us"] = h["tuned_us"] - h["torch_mm_us"]
            host.append(h)
    gates = []
    for model, layer, n, k in SHAPES:
        g = {"model": model, "layer": layer, "n": n, "k": k, "m_values": list(bench.BENCH_MS),
             "tuned_invariance": {"rows_checked": 30, "rows_equal": 30, "passed": True,
                                  "mismatches": []}}
        if with_vllm:
            bad = k == 4096
            g["vllm_invariance"] = {"rows_checked": 30, "rows_equal": 28 if bad else 30,
                                    "passed": not bad,
                                    "mismatches": [[64, 1], [256, 1]] if bad else []}
            g["vllm_accuracy_failures"] = ([] if layer != "qkv" else
                                           ["M=4096: relative error 0.25 > 0.01"])
        gates.append(g)
    doc = {"schema": bench.SCHEMA,
           "provenance": {"gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-synthetic",
                          "driver": "580", "torch": "2.11.0", "triton": "3.6.0",
                          "date_utc": "2026-12-01T00:00:00Z",
                          "command": "bistat kernels bench --vllm-kernel /x/vllm"},
           "dtype": "bfloat16", "table": "t.json", "timing": "CUDA-graph replays",
           "rows": [r.to_dict(with_vllm) for r in rows],
           "summary": bench.summarize(rows, with_vllm), "gates": gates,
           "roofline": {"max_m": 16, "copy": {"bytes": 2 * 2**30, "median_ms": 1.0,
                                              "gb_per_s": 4294.967296},
                        "rows": bench.roofline_rows(rows, 4294.967296)},
           "host": {"calls": 200, "repeats": 7, "ms": [1, 16], "timing": "eager calls",
                    "rows": host, "summary": bench.host_summary(host)}}
    if with_vllm:
        doc["vllm"] = {"path": "/x/vllm", "vllm": "0.33.0", "vllm_commit": "g4ba787ec9",
                       "arch_family": "hopper", "tuned_shapes": [[4096, 4096], [12288, 2048]],
                       "function": "mm_batch_invariant"}
    return doc


def _render(tmp_path, doc) -> str:
    (tmp_path / "bench_nvidia_h200.json").write_text(json.dumps(doc), encoding="utf-8")
    return make_results.render_results(tmp_path, tmp_path / "no-tables")


def test_results_page_shows_the_vllm_column_roofline_and_host_cost(tmp_path):
    page = _render(tmp_path, _doc())
    assert ("Goal **not met**: geometric mean of tuned / torch.mm 1.020 (target <= 1.05, met), "
            "at M <= 32 1.020 (target <= 1.0, **not met**); host cost per eager call, tuned - "
            "torch.mm at the worst shape 3.5 us (target <= 5, met); both gates") in page
    assert "## Tuned kernel vs torch.mm (cuBLAS) vs the fixed default configuration vs vLLM " \
           "0.33.0's kernel\n" in page
    assert ("`mm_batch_invariant` of vLLM 0.33.0 (commit g4ba787ec9), its source run unchanged "
            "from `/x/vllm` with its own tuned table (family hopper: 2 shapes, 1 of the benched "
            "ones; the others use its fixed default), validated against the same reference "
            "before timing (17 of 18 rows passed and were timed).") in page
    assert "| vLLM's kernel / torch.mm, goal set | 1.300 | | |" in page
    assert "| tuned / vLLM's kernel, goal set (below 1: ahead) | 0.785 | < 1 | met |" in page
    assert ("| host cost per eager call, tuned - torch.mm at the worst shape at M in 1, 16 "
            "(mean 3.5 us) | 3.5 us | <= 5 us | met |") in page
    assert "tuned 2 of 2 shapes, vLLM's kernel 1 of 2." in page
    assert ("- vLLM's kernel not invariant: qwen3-8b/o (4096 x 4096): 28/30 rows equal, "
            "mismatches at M = 64, 256") in page
    assert "- vLLM's kernel failed validation (not timed): qwen3-1.7b/qkv M=4096: relative " \
           "error 0.25 > 0.01" in page
    assert ("| model | layer | N | K | M | tuned | torch.mm | default | vllm | tuned/mm | "
            "default/mm | vllm/mm |") in page
    assert "| qwen3-8b | o | 4096 | 4096 | 1 | 10.2 | 10.0 | 30.0 | 13.0 | 1.02 | 3.00 | 1.30 |" \
        in page
    assert "| qwen3-1.7b | qkv | 4096 | 2048 | 1 | 10.2 | 10.0 | 30.0 | 13.0 (default) |" in page
    assert "| qwen3-1.7b | qkv | 4096 | 2048 | 4096 | 10.2 | 10.0 | 30.0 | - (default) | 1.02 " \
           "| 3.00 | - |" in page
    assert "| qwen3-8b | 1.020 | 3.000 | 1.300 |" in page
    roof = results_model.bench(_doc(), "b.json").roofline
    assert roof.geomean_mm == pytest.approx(gmean([r["torch_mm"] for r in
                                                   _doc()["roofline"]["rows"]]))
    assert ("device-to-device copy of 2 GiB measured in the same run (4295 GB/s, bytes read + "
            f"written). Geometric mean: tuned {roof.geomean_tuned:.2f}, torch.mm "
            f"{roof.geomean_mm:.2f}, vLLM's kernel {roof.geomean_vllm:.2f}.") in page
    assert "| qwen3-8b | o | 4096 | 4096 | 1 | 32.0 | 0.77 | 0.78 | 0.60 |" in page
    assert ("| qwen3-8b | o | 4096 | 4096 | 1 | 11.0 | 7.5 | 35.0 | 3.5 | 13.0 | 9.0 |") in page


def test_results_page_without_vllm_has_no_vllm_column(tmp_path):
    page = _render(tmp_path, _doc(with_vllm=False))
    assert "vLLM 0.33.0's kernel" not in page and "vllm/mm" not in page
    assert "| model | layer | N | K | M | tuned | torch.mm | default | tuned/mm | default/mm |" \
        in page
    assert "tuned 2 of 2 shapes." in page
    assert "| qwen3-8b | o | 4096 | 4096 | 1 | 32.0 | 0.77 | 0.78 |\n" in page
    assert "| qwen3-8b | o | 4096 | 4096 | 1 | 11.0 | 7.5 | 3.5 | 13.0 | 9.0 |" in page


def test_a_bench_without_goal_targets_keeps_the_earlier_goals():
    old = json.loads((make_results.RESULTS_DIR / "history" / "bench_nvidia_h200_2026-11-29.json").read_text())
    g = results_model.bench(old, "b.json").goal
    assert (g.overall_target, g.decode_target, g.host_diff_us) == (1.15, 1.25, None)
    assert results_model.bench(_doc(), "b.json").goal.overall_target == 1.05


def test_the_cli_summary_states_the_new_goals_and_the_host_cost():
    doc = _doc()
    text = format_bench_summary(doc["summary"], doc["host"]["summary"])
    assert text.splitlines() == [
        "geomean tuned/torch.mm over M in [1, 4, 16, 64, 256, 1024, 4096]: 1.020 (goal <= 1.05)",
        "geomean tuned/torch.mm at M <= 32: 1.020 (goal <= 1.00)",
        "geomean default/torch.mm over the goal set: 3.000",
        "geomean vllm/torch.mm over the goal set: 1.300, at M <= 32: 1.300 (17 of 18 rows timed)",
        "geomean tuned/vllm over the goal set: 0.785",
        "host us per eager call: tuned 11.0, torch.mm 7.5, vllm 35.0; tuned - torch.mm 3.5 "
        "(max 3.5; goal <= 5)"]
    old = json.loads((make_results.RESULTS_DIR / "history" / "bench_nvidia_h200_2026-11-29.json").read_text())
    assert format_bench_summary(old["summary"]).splitlines()[0].endswith("1.141 (goal <= 1.15)")


def test_probe_page_shows_dtype_and_case_when_edge_cases_were_probed(tmp_path):
    def shape(n, k, dtype, case, err):
        return {"n": n, "k": k, "dtype": dtype, "case": case, "passed": err < 1e-5 or
                dtype != "float32",
                "invariance": {"rows_equal": 30, "rows_checked": 30},
                "accuracy": [{"max_rel_err": err, "torch_mm_max_rel_err": 3e-7,
                              "tolerance": 1e-5 if dtype == "float32" else 1e-2}]}

    doc = {"provenance": {"gpu_name": "NVIDIA H200", "date_utc": "d", "command": "c"},
           "passed": False, "shapes": [shape(4096, 4096, "bfloat16", "table", 2e-3),
                                       shape(4096, 512, "float32", "k_pow2", 2e-7),
                                       shape(2048, 6144, "float32", "fp32_ieee", 2.5e-4)]}
    p = results_model.probe(doc, "p.json")
    assert p.with_cases and [r.case for r in p.rows] == ["table", "k_pow2", "fp32_ieee"]
    (tmp_path / "probe_nvidia_h200.json").write_text(json.dumps(doc), encoding="utf-8")
    page = make_results.render_results(tmp_path, tmp_path / "no-tables")
    assert "| 4096 | 512 | float32 | k_pow2 | 30/30 | 2.00e-07 | 3.00e-07 | 1e-05 | pass |" in page
    assert ("| 2048 | 6144 | float32 | fp32_ieee | 30/30 | 2.50e-04 | 3.00e-07 | 1e-05 | "
            "**FAIL** |") in page
    before = json.loads((make_results.RESULTS_DIR / "history" / "probe_nvidia_h200_2026-11-29.json")
                        .read_text())
    assert not results_model.probe(before, "p.json").with_cases  # probed before the edge cases
    committed = json.loads((make_results.RESULTS_DIR / "probe_nvidia_h200.json").read_text())
    assert {r.case for r in results_model.probe(committed, "p.json").rows} == {
        "table", "k_pow2", "fp32_ieee"}


@pytest.mark.gpu
def test_gpu_run_bench_with_vllm_on_one_small_shape(tmp_path):
    """On a GPU (BISTAT_KERNELS_GPU=1): the whole bench path, vLLM column included when the
    folder BISTAT_VLLM_WHEELS names is given (it must then hold the 0.33.0 wheel), on SmolLM2's o
    projection at M 1 and 16."""
    from helpers_kernels import INTERPRETING

    if INTERPRETING or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and BISTAT_KERNELS_GPU=1")
    import os
    import zipfile
    from pathlib import Path

    from external import WHEELS_VAR, vllm_wheel_name

    from bistat_kernels import tables, vllm_kernel
    from bistat_kernels.shapes import MODEL_SHAPES

    kernel = None
    if os.environ.get(WHEELS_VAR):
        with zipfile.ZipFile(Path(os.environ[WHEELS_VAR]) / vllm_wheel_name("0.33.0")) as z:
            for name in ("vllm/_version.py", "vllm/model_executor/determinism/batch_invariant.py",
                         "vllm/model_executor/determinism/batch_invariant_configs.py"):
                z.extract(name, tmp_path)
        kernel = vllm_kernel.load_vllm_kernel(tmp_path / "vllm")
    tables.reset_device_table()
    shape = MODEL_SHAPES["smollm2-135m"][1]
    doc = bench.run_bench([shape], ms=(1, 16), command=["test"], progress=lambda s: None,
                          vllm_kernel=kernel)
    assert [r["m"] for r in doc["rows"]] == [1, 16]
    assert all(r["tuned_ms"] > 0 and r["torch_mm_ms"] > 0 for r in doc["rows"])
    assert doc["gates"][0]["tuned_invariance"]["passed"]
    assert doc["roofline"]["copy"]["gb_per_s"] > 100
    assert [r["m"] for r in doc["roofline"]["rows"]] == [1, 16]
    assert [r["m"] for r in doc["host"]["rows"]] == [1, 16]
    assert all(r["tuned_us"] > 0 and r["torch_mm_us"] > 0 for r in doc["host"]["rows"])
    if kernel is not None:
        assert doc["vllm"]["vllm"] == "0.33.0" and doc["vllm"]["arch_family"] is not None
        assert all(r["vllm_ms"] is not None for r in doc["rows"])
        assert "geomean_vllm_over_mm" in doc["summary"]
    (tmp_path / "bench_nvidia_h200.json").write_text(json.dumps(doc), encoding="utf-8")
    assert "## Tuned kernel vs torch.mm" in make_results.render_results(tmp_path, tmp_path)
