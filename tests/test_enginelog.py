"""bistat.store.enginelog: vLLM's JIT-compilation warnings in a run's engine logs, placed in passes."""

from __future__ import annotations

import gzip
from pathlib import Path

from bistat.store.enginelog import jit_compiles

WARN = ("(EngineCore pid=4574) WARNING {stamp} [jit_monitor.py:129] Triton kernel JIT compilation "
        "during inference: {kernel}. This causes a latency spike; consider extending warmup to "
        "cover this shape/config.\n")


def _log(run: Path, name: str, *lines: str) -> None:
    (run / "engine-logs").mkdir(parents=True, exist_ok=True)
    with gzip.open(run / "engine-logs" / name, "wt") as fh:
        fh.write("INFO 12-01 16:55:50 [core.py:337] init engine took 26.41 s\n")
        fh.writelines(lines)


def _pass(arm, i, kind, started, wall):
    return {"arm": arm, "pass_index": i, "kind": kind, "started_utc": started, "wall_s": wall}


PASSES = [_pass("bi-tuned-gemm", 0, "warmup", "2026-12-01T16:56:03.846569Z", 0.47),
          _pass("bi-tuned-gemm", 1, "counted", "2026-12-01T16:56:07.632708Z", 1.106),
          _pass("bi-tuned-gemm", 2, "counted", "2026-12-01T16:56:08.740503Z", 0.469),
          _pass("bi-tuned-gemm", 3, "counted", "2026-12-01T16:56:20.000000Z", 0.4),
          _pass("default", 0, "warmup", "2026-12-01T16:56:08.100000Z", 0.5)]


def test_each_warning_is_placed_in_the_passes_of_its_own_arm_running_in_that_second(tmp_path):
    """As in h200-cost-qwen3-1_7b-latency-b8: the second 16:56:08 overlaps the end of one counted
    pass and the start of the next; the default arm's pass in that second is not named."""
    _log(tmp_path, "bi-tuned-gemm-1.log.gz",
         WARN.format(stamp="12-01 16:56:04", kernel="_topk_log_softmax_kernel"),
         WARN.format(stamp="12-01 16:56:08", kernel="_matmul_persistent_kernel"),
         WARN.format(stamp="12-01 16:56:15", kernel="other_kernel"))
    found = jit_compiles(tmp_path, "2026-12-01T16:52:05.004836Z", PASSES)
    assert [(j.arm, j.start, j.time_utc, j.kernel, j.passes, j.in_counted_pass) for j in found] == [
        ("bi-tuned-gemm", 1, "2026-12-01T16:56:04Z", "_topk_log_softmax_kernel",
         ((0, "warmup"),), False),
        ("bi-tuned-gemm", 1, "2026-12-01T16:56:08Z", "_matmul_persistent_kernel",
         ((1, "counted"), (2, "counted")), True),
        ("bi-tuned-gemm", 1, "2026-12-01T16:56:15Z", "other_kernel", (), False)]
    # the analysis reads the kept logs once and hands the text over: the same warnings
    from bistat.store.enginelog import kept_logs
    assert jit_compiles(kept_logs(tmp_path), "2026-12-01T16:52:05.004836Z", PASSES) == found


def test_the_year_comes_from_the_run_and_rolls_over_at_new_year(tmp_path):
    _log(tmp_path, "a-b-c-2.log.gz", WARN.format(stamp="01-01 00:00:03", kernel="k"))
    (j,) = jit_compiles(tmp_path, "2026-12-31T23:59:00Z",
                        [_pass("a-b-c", 4, "counted", "2027-01-01T00:00:02.5Z", 1.0),
                         _pass("a-b-c", 5, "counted", "2026-01-01T00:00:03Z", 1.0)])
    assert (j.arm, j.start, j.time_utc, j.passes) == ("a-b-c", 2, "2027-01-01T00:00:03Z",
                                                      ((4, "counted"),))


def test_nothing_without_engine_logs_or_warnings_and_passes_without_times_are_skipped(tmp_path):
    assert jit_compiles(tmp_path, "2026-12-01T16:52:05Z", PASSES) == ()
    _log(tmp_path, "default-1.log.gz", "INFO 12-01 16:56:08 [core.py:1] nothing compiled\n")
    assert jit_compiles(tmp_path, "2026-12-01T16:52:05Z", PASSES) == ()
    _log(tmp_path, "default-1.log.gz", WARN.format(stamp="12-01 16:56:08", kernel="k"))
    (j,) = jit_compiles(tmp_path, "2026-12-01T16:52:05Z",
                        [_pass("default", 0, "warmup", float("nan"), 0.5),
                         _pass("default", 1, "counted", "2026-12-01T16:56:08Z", float("nan")),
                         _pass("default", 2, "counted", "2026-12-01T16:56:07.9Z", 0.2)])
    assert j.passes == ((2, "counted"),)
    assert jit_compiles(tmp_path, None, PASSES) == ()


def test_sglang_modes_from_its_logged_server_args():
    """SGLang logs its resolved arguments once per start as a Python literal (``server_args=``):
    torch.compile and its CUDA graphs read from there, in the committed H100 runs' logs and in
    the other shapes the arguments can take."""
    from bistat.store.enginelog import engine_modes, logged_modes

    root = Path(__file__).resolve().parents[1] / "data" / "h100-sglang"
    s1 = {arm: [m.describe() for m in starts]
          for arm, starts in logged_modes(root / "h100-sglang-match-smollm2").items()}
    graphs = "decode full (≤ 128 requests), prefill breakable (≤ 8192 tokens)"
    assert s1 == {arm: [("no torch.compile (SGLang)", graphs)] for arm in (
        "default", "deterministic-fa3", "deterministic-triton", "deterministic-flashinfer")}
    s3 = logged_modes(root / "h100-sglang-latency-qwen3-8b-b8")
    assert {m.cudagraph_mode for starts in s3.values() for m in starts} == {
        "decode full (≤ 256 requests), prefill breakable (≤ 8192 tokens)"}
    line = "[t] server_args={'enable_torch_compile': True, 'torch_compile_max_bs': 16, %s}"
    assert engine_modes(line % "'disable_cuda_graph': True").describe() == (
        "torch.compile (SGLang, batch ≤ 16)", "none (disable_cuda_graph)")
    assert engine_modes(line % ("'cuda_graph_config': {'decode': {'backend': 'disabled'}, "
                                "'prefill': {'backend': 'full', 'max_bs': 512}}")).cudagraph_mode \
        == "prefill full (≤ 512 tokens)"
    assert engine_modes(line % "'cuda_graph_max_bs': 160").cudagraph_mode == \
        "decode (≤ 160 requests)"
    # a line that is not a literal, or no server_args at all: nothing stated
    assert engine_modes("[t] server_args={'a': <object at 0x1>}") is None
    assert engine_modes("[t] Sampling backend is set to pytorch") is None
