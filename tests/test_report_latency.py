"""The batch-latency section of findings for one-batch-per-pass workloads (workload ii)."""

from types import SimpleNamespace

from bistat.analysis.timing import batch_latency
from bistat.report.finding import _latency as _format_latency
from bistat.core.stats import throughput_ratio


def _latency(summary):
    """The section, with the summary's batch latency computed as the analysis computes it."""
    summary.batch_latency = batch_latency(summary)
    return _format_latency(summary)


def _pass(arm, wall, counted=True, n_failed=0):
    return SimpleNamespace(arm=arm, counted=counted, wall_s=wall, output_tokens=8 * 128,
                           n_requests=8, n_failed=n_failed)


def _summary(n_prompts, concurrency):
    passes = ([_pass("default", w) for w in (0.70, 0.71, 0.72, 0.73, 0.80)]
              + [_pass("bi", w) for w in (2.38, 2.40, 2.41, 2.42, 2.50)]
              + [_pass("bi", 9.0, counted=False), _pass("bi", 0.05, n_failed=8)])
    tput = lambda arm: [1024 / p.wall_s for p in passes if p.arm == arm and p.counted]  # noqa: E731
    ratio = throughput_ratio(tput("bi"), tput("default"))
    comparison = SimpleNamespace(treatment="bi", control="default", ratio=ratio,
                                 ratio_point=ratio.ratio)
    return SimpleNamespace(declaration={"workload": {"n_prompts": n_prompts,
                                                     "concurrency": concurrency}},
                           passes=passes, comparisons=[comparison], confidence_level=0.95), ratio


def test_latency_section_reports_median_p90_per_token_and_the_inverted_ratio():
    summary, ratio = _summary(8, 8)
    text = "\n".join(_latency(summary))
    # numpy: median(0.70..0.80) = 0.72, p90 (linear) = 0.73 + 0.6 * 0.07 = 0.772
    assert "| default | 5 | 0.7200 | 0.7720 | 5.625 |" in text
    # left out: the uncounted 9.0 s pass and the 0.05 s counted pass whose requests all failed
    assert "| bi | 5 | 2.4100 | 2.4680 | 18.828 |" in text
    low, high = 1 / ratio.interval.high, 1 / ratio.interval.low
    assert f"| bi ÷ default | {1 / ratio.ratio:.4f} | [{low:.4f}, {high:.4f}] |" in text


def test_no_latency_section_for_many_batches_per_pass():
    summary, _ = _summary(541, 64)
    assert _latency(summary) == []


def test_an_arm_without_a_whole_batch_gets_a_row_of_dashes():
    # h200-cost-qwen3-8b-throughput: the batch-invariant engine died; every pass failed at once
    summary, _ = _summary(8, 8)
    summary.passes = [p for p in summary.passes if p.arm == "default"] + [
        _pass("bi", 0.05, n_failed=8), _pass("bi", 0.06, n_failed=8)]
    summary.comparisons = []
    text = "\n".join(_latency(summary))
    assert "| bi | 0 | — | — | — |" in text and "| default | 5 | 0.7200 | 0.7720 | 5.625 |" in text
