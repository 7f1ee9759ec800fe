"""Steps beyond the CUDA-graph sizes: the logged sizes, the time share, the finding.

A step with more requests running than vLLM's ``max_cudagraph_capture_size`` runs without a CUDA
graph, every kernel launched from the host: where a launcher's per-call cost shows. The recorded
workload (i) runs (1000 requests at once, vLLM 0.25.0, an H200) are the real case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bistat.analysis.summary import analyze_run, summary_to_dict, time_beyond_graphs
from bistat.report.finding import render_markdown
from bistat.store.enginelog import CudaGraphSizes, cudagraph_sizes, kept_logs

ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT = ROOT / "data" / "h200" / "h200-cost-qwen3-8b-throughput-r2"
LATENCY_B32 = ROOT / "data" / "h200-v034" / "h200-v034-i23-latency-qwen3-8b-b32-compiled"

CONFIG_025 = ("(EngineCore_DP0 pid=1) INFO 12-01 16:40:01 [core.py:114] Initializing a V1 LLM engine "
              "(v0.25.0) with config: model='m', compilation_config={'mode': "
              "<CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: "
              "(2, 1)>, 'cudagraph_capture_sizes': [1, 2, 4, 8], 'max_cudagraph_capture_size': 512}")


def test_sizes_from_the_logged_configuration():
    assert cudagraph_sizes("INFO started\n" + CONFIG_025 + "\nINFO ready") == CudaGraphSizes(
        "FULL_AND_PIECEWISE", 512, None)
    eager = CONFIG_025.replace("FULL_AND_PIECEWISE: (2, 1)", "NONE: 0").replace("512", "0")
    assert cudagraph_sizes(eager) == CudaGraphSizes("NONE", 0, None)
    # the last configuration line of a start wins; a log without one gives None
    assert cudagraph_sizes(CONFIG_025 + "\n" + CONFIG_025.replace("512", "256")).max_capture_size == 256
    assert cudagraph_sizes("INFO [core.py:1] no configuration here") is None
    # the real 0.34.0 logs: full decode graphs to 256 requests, any graph to 512 tokens
    logs = kept_logs(LATENCY_B32)
    assert {arm: cudagraph_sizes(starts[max(starts)]) for arm, starts in logs.items()} == {
        arm: CudaGraphSizes("FULL_AND_PIECEWISE", 512, 256)
        for arm in ("default", "bi-tuned-gemm", "bi-tuned-gemm-compiled")}


def _runner_share(run: Path, arm: str, limit: int) -> tuple[float, float, int]:
    """The same share from the runner's own histograms in passes.jsonl (recorded during the run,
    not recomputed from metrics.jsonl): (seconds, seconds beyond, counted passes)."""
    total = beyond = 0.0
    n = 0
    for line in (run / "passes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["arm"] != arm or rec["kind"] != "counted":
            continue
        hist = rec["batching"]["running_hist"]
        total += sum(hist.values())
        beyond += sum(v for k, v in hist.items() if int(k) > limit)
        n += 1
    return total, beyond, n


def test_workload_i_on_vllm_025_spent_most_counted_time_beyond_the_graphs():
    summary = analyze_run(THROUGHPUT)
    found = {b.arm: b for b in time_beyond_graphs(summary)}
    assert list(found) == ["default", "batch-invariant", "bi-tuned-gemm"]
    for arm, b in found.items():
        assert b.sizes == CudaGraphSizes("FULL_AND_PIECEWISE", 512, None)
        total, beyond, n = _runner_share(THROUGHPUT, arm, 512)
        assert b.n_passes == n == 8
        assert b.seconds_total == pytest.approx(total, abs=1e-3)   # histograms kept to 1e-6 s
        assert b.seconds_beyond == pytest.approx(beyond, abs=1e-3)
    assert [round(b.share, 3) for b in found.values()] == [0.832, 0.846, 0.851]
    # the tuned arm's extra time per pass fell where no graph ran (the eager path)
    extra, extra_beyond = found["bi-tuned-gemm"].extra_over(found["default"])
    assert (round(extra, 3), round(extra_beyond, 3)) == (1.182, 1.150)
    data = summary_to_dict(summary)["beyond_graphs"]       # what `bistat analyze --json` gives
    assert [(d["arm"], d["max_capture_size"], d["n_passes"], round(d["share"], 3)) for d in data] == [
        ("default", 512, 8, 0.832), ("batch-invariant", 512, 8, 0.846),
        ("bi-tuned-gemm", 512, 8, 0.851)]
    text = render_markdown(summary)
    assert ("| bi-tuned-gemm | FULL_AND_PIECEWISE, 512 tokens | 8 | 8.750 | 7.451 | 85.1% |"
            in text)
    assert ("- bi-tuned-gemm took 1.182 s more per counted pass than default, 1.150 s of it with "
            "more requests running than the largest graph size.") in text


def test_a_batch_within_the_graphs_says_so_and_an_eager_engine_counts_every_second(monkeypatch):
    summary = analyze_run(LATENCY_B32)
    assert {b.arm: b.seconds_beyond for b in time_beyond_graphs(summary)} == {
        "default": 0.0, "bi-tuned-gemm": 0.0, "bi-tuned-gemm-compiled": 0.0}
    text = render_markdown(summary)
    assert ("CUDA graphs: no metrics sample of a counted pass had more requests running than the "
            "engine's largest CUDA-graph size (512 tokens, from its logged configuration)") in text
    # an engine logged with cudagraph_mode NONE replays no graph: all its time counts
    eager = dict(summary.cudagraph_sizes)
    eager["default"] = CudaGraphSizes("NONE", 0, None)
    import dataclasses
    summary = dataclasses.replace(summary, cudagraph_sizes=tuple(eager.items()))
    b = {b.arm: b for b in time_beyond_graphs(summary)}["default"]
    assert b.share == 1.0 and b.seconds_beyond == b.seconds_total > 0
    assert "| default | NONE: no step replays a graph | 90 |" in render_markdown(summary)
