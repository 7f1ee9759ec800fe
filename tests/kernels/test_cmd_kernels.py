"""``bistat kernels ...`` through CliRunner: help, errors, the interpreted probe, RESULTS.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_kernels import torch

from bistat.cli import cli

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _run(args, **kw):
    return CliRunner().invoke(cli, ["kernels", *args], **kw)


def test_help_lists_the_six_commands():
    result = _run(["--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == (
        "Usage: cli kernels [OPTIONS] COMMAND [ARGS]...\n\n"
        "  The tuned batch-invariant Triton GEMM: tune, probe, sweep, bench, results,\n"
        "  vLLM export.\n\n"
        "Options:\n  -h, --help  Show this message and exit.\n\n"
        "Commands:\n"
        "  bench        Time tuned, torch.mm and the fixed default per shape and M.\n"
        "  export-vllm  Write the table in vLLM 0.33.0's tuned-table format.\n"
        "  probe        Check both gates: bitwise row invariance and accuracy.\n"
        "  results      Regenerate RESULTS.md from the recorded JSON.\n"
        "  sweep        Tune the GEMM table on this GPU (chunked, resumable).\n"
        "  tune         Make this GPU's table: sweep, probe, write.\n")


def test_sweep_and_bench_refuse_without_a_gpu():
    if torch.cuda.is_available():  # pragma: no cover - GPU machines run the real thing
        return
    for command in ("sweep", "bench"):
        result = _run([command])
        assert result.exit_code == 1
        assert result.output == f"Error: bistat kernels {command} needs a CUDA GPU\n"


def test_probe_rejects_a_malformed_shape():
    result = _run(["probe", "--shape", "4096by2048"])
    assert result.exit_code == 2
    assert result.output.endswith("Error: Invalid value for --shape: got '4096by2048'; expected "
                                  "NxK, e.g. 4096x2048\n")


def test_probe_runs_on_the_interpreter_and_writes_json(tmp_path):
    out = tmp_path / "probe.json"
    result = _run(["probe", "--shape", "40x72", "--dtype", "float32", "--max-m", "8",
                   "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"N=40 K=72 float32: invariance 14/14 rows equal; rel err "
                        r"M=1:\d\.\d\de-\d\d\(torch\.mm \d\.\d\de-\d\d\) "
                        r"M=8:\d\.\d\de-\d\d\(torch\.mm \d\.\d\de-\d\d\); PASS\n", result.output)
    assert '"passed": true' in out.read_text(encoding="utf-8")


def test_results_regenerates_the_committed_page_byte_for_byte(tmp_path):
    target = tmp_path / "RESULTS.md"
    result = _run(["results", "--output", str(target)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == f"wrote {target}\n"
    assert target.read_bytes() == (KERNELS / "RESULTS.md").read_bytes()


def test_probe_edge_cases_add_k_pow2_and_fp32_rows(tmp_path, monkeypatch):
    from bistat_kernels import probe

    # the edge cases at interpreter size: N 64 instead of 4096, K 512 only
    monkeypatch.setattr(probe, "EDGE_N", 64)
    monkeypatch.setattr(probe, "POW2_KS", (512,))
    out = tmp_path / "probe.json"
    result = _run(["probe", "--shape", "40x72", "--dtype", "float32", "--max-m", "4",
                   "--edge-cases", "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(":")[0] for line in lines] == ["N=40 K=72 float32",
                                                      "N=64 K=512 float32 [k_pow2]"]
    assert all(line.endswith("PASS") for line in lines)
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [(s["n"], s["k"], s["dtype"], s["case"], s["passed"]) for s in doc["shapes"]] == [
        (40, 72, "float32", "table", True), (64, 512, "float32", "k_pow2", True)]
    assert doc["passed"] is True
    assert doc["provenance"]["gpu_name"] == "none (Triton interpreter on the CPU)"
    # RESULTS.md's probe section reads it as written
    from bistat_kernels import results_model

    probe = results_model.probe(doc, "probe.json")
    assert probe.with_cases and [r.case for r in probe.rows] == ["table", "k_pow2"]


def _gpu_call():
    """kernels/device/gpu_call.py as a module (a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_call", KERNELS / "device" / "gpu_call.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_device_probe_stage_writes_the_cli_probes_document(tmp_path, monkeypatch):
    from helpers_kernels import small_table_dict

    from bistat_kernels import probe, tables

    # No power-of-two-K cases: the device stage adds them in bfloat16 too, which the interpreter
    # cannot compute (its tl.dot multiplies bfloat16 bit patterns as integers: 1e10 errors;
    # triton-lang/triton#11584, closed as unsupported); the fp32 cases of the (fp32) table's
    # shapes are the table's own rows.
    monkeypatch.setattr(probe, "POW2_KS", ())
    table_file = tmp_path / "test_gpu.json"
    table_file.write_text(json.dumps(small_table_dict()), encoding="utf-8")
    cli_out = tmp_path / "cli.json"
    result = _run(["probe", "--table", str(table_file), "--dtype", "float32", "--max-m", "4",
                   "--edge-cases", "--output", str(cli_out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output

    # The device stage on the CPU: its GPU's table, provenance and device "cuda" stood in for.
    gpu_call = _gpu_call()
    monkeypatch.setattr(gpu_call, "_table_path", lambda out: table_file)
    monkeypatch.setattr(gpu_call, "gpu_provenance", lambda *a: {"gpu_name": "test"})
    probe_cases = probe.probe_cases
    monkeypatch.setattr(probe, "probe_cases", lambda cases, table, device, max_m, **kw:
                        probe_cases(cases, table, "cpu", max_m, **kw))
    try:
        assert gpu_call.stage_probe(tmp_path, max_m=4) is True
    finally:
        tables.reset_device_table()

    cli = json.loads(cli_out.read_text(encoding="utf-8"))
    device = json.loads((tmp_path / "probe_test_gpu.json").read_text(encoding="utf-8"))
    assert list(device) == list(cli) == ["schema", "table", "provenance", "passed", "shapes"]
    assert device["schema"] == cli["schema"] and device["table"] == cli["table"] == str(table_file)
    assert device["provenance"] == {"gpu_name": "test"}
    assert [(s["n"], s["k"], s["dtype"], s["case"]) for s in device["shapes"]] == [
        (37, 100, "float32", "table"), (40, 72, "float32", "table")]
    # same cases, same seeds: the same rows, both gates' numbers included
    assert device["shapes"] == cli["shapes"]
    assert device["passed"] is cli["passed"] is True


def test_the_device_bucket_retune_takes_a_list_of_shapes():
    import argparse

    gpu_call = _gpu_call()
    assert gpu_call._shape_list("576x1536, 2048x6144") == [(576, 1536), (2048, 6144)]
    with pytest.raises(argparse.ArgumentTypeError, match=r"'576-1536' is not NxK \(e\.g\. "
                                                           r"576x1536\)"):
        gpu_call._shape_list("576-1536")
    picked = gpu_call._selected_shapes([(4096, 12288), (576, 1536)])
    assert sorted((s.model, s.layer) for s in picked) == [("qwen3-8b", "down"),
                                                          ("smollm2-135m", "down")]
    assert len(gpu_call._selected_shapes(None)) == 15
    with pytest.raises(SystemExit, match=r"--shapes: 5x7 is not a shape of qwen3-8b, qwen3-1.7b, "
                                         r"smollm2-135m; known: 576x576"):
        gpu_call._selected_shapes([(5, 7)])


def test_the_device_bench_stage_takes_a_selection_an_order_and_an_emptied_cache(tmp_path,
                                                                              monkeypatch):
    """``gpu_call.py bench --bench-shapes ... --reverse --empty-cache``, the k13 follow-up
    (kernels/results/k13: qwen3-8b lm_head 8 % slower after a table whose previous shape held a
    split-K workspace): the shapes reach run_bench selected, in reverse, with the cache emptied;
    run_bench empties it before every shape and says so in its document. No GPU: the shape bench,
    the copy bandwidth, the provenance and the table are stood in for."""
    from helpers_kernels import small_table_dict

    from bistat_kernels import bench, tables

    gpu_call = _gpu_call()
    table_file = tmp_path / "test_gpu.json"
    table_file.write_text(json.dumps(small_table_dict()), encoding="utf-8")
    monkeypatch.setattr(gpu_call, "_table_path", lambda out: table_file)
    events: list[str] = []
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: events.append("empty"))

    def fake_shape(shape, ms, dtype, **kw):
        events.append(shape.layer)
        row = bench.BenchRow(shape.model, shape.layer, shape.n, shape.k, 1, 0.011, 0.01, 0.03,
                             1e-3, None, None, True)
        return bench.ShapeBench([row], {"layer": shape.layer}, [])
    monkeypatch.setattr(bench, "bench_shape", fake_shape)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: {"bytes": 2**30, "median_ms": 1.0,
                                                          "gb_per_s": 1000.0})
    monkeypatch.setattr("bistat_kernels.provenance.gpu_provenance", lambda *a: {"gpu": "test"})
    monkeypatch.setattr(tables, "resolve_device_table", lambda device: None)
    monkeypatch.setattr("bistat_kernels.resolution.cuda_device_facts", lambda index: None)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "test")
    picked = gpu_call._selected_shapes([(151936, 4096), (4096, 12288)], "--bench-shapes")
    try:
        gpu_call.stage_bench(tmp_path, None, picked, reverse=True, empty_cache=True)
    finally:
        tables.reset_device_table()
    assert events == ["empty", "lm_head", "empty", "down"]      # qwen3-8b's order, reversed
    doc = json.loads((tmp_path / "bench_test_gpu.json").read_text(encoding="utf-8"))
    assert doc["allocator"] == "emptied before each shape (torch.cuda.empty_cache)"
    assert [(r["layer"], r["n"]) for r in doc["rows"]] == [("lm_head", 151936), ("down", 4096)]

    events.clear()
    try:
        gpu_call.stage_bench(tmp_path, None)                       # the defaults: all, in order
    finally:
        tables.reset_device_table()
    assert "empty" not in events and len(events) == 15 and events[:2] == ["qkv", "o"]
    doc = json.loads((tmp_path / "bench_test_gpu.json").read_text(encoding="utf-8"))
    assert doc["allocator"] == "kept across shapes (PyTorch's caching allocator)"
    with pytest.raises(SystemExit, match=r"^--bench-shapes: 5x7 is not a shape of"):
        gpu_call._selected_shapes([(5, 7)], "--bench-shapes")


def test_bench_empty_cache_reaches_the_bench(monkeypatch):
    """``bistat kernels bench --empty-cache`` (the GPU and the bench itself stood in for)."""
    from bistat.cli import cmd_kernels
    from bistat_kernels import bench

    seen = []
    summary = {"goal_ms": [1], "geomean_tuned_over_mm": 1.0, "decode_max_m": 32,
               "decode_geomean_tuned_over_mm": 1.0, "geomean_default_over_mm": 1.5}
    monkeypatch.setattr(cmd_kernels, "_require_torch", lambda *a, **k: torch)
    monkeypatch.setattr(bench, "run_bench", lambda shapes, **kw: seen.append(
        ([s.model for s in shapes], kw["empty_cache"])) or {"summary": summary})
    for args, want in ((["--model", "qwen3-8b", "--empty-cache"], True),
                       (["--model", "qwen3-8b"], False)):
        result = _run(["bench", *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert seen.pop() == (["qwen3-8b"] * 5, want)
