"""Batching evidence of one pass from the engine's metrics samples: the one batching summary.

The runner writes it into ``passes.jsonl`` at the end of every pass, and the analysis recomputes
it from ``metrics.jsonl`` with the same function, so the mean running batch the validity check
``min_mean_running`` reads is the one the runner recorded (time-weighted, not an unweighted mean
of the samples). Pure: samples in, a dict out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

from bistat.engines.base import MetricsSample

__all__ = ["INTERVAL_MEAN_SOURCES", "batching_summary"]

#: Sample sources whose ``num_requests_running`` is the mean over the interval *since the
#: previous sample* (the embedded adapter's step-log figure), not a reading at the sample's time:
#: each such sample stands for the time before it.
INTERVAL_MEAN_SOURCES = frozenset({"embedded"})


def batching_summary(samples: Sequence[MetricsSample], wall_s: float) -> dict[str, Any]:
    """Batching evidence of one pass from the engine's metrics samples.

    Each sample stands for the time it describes, and the mean and the histogram of running
    requests are weighted by that time, so a burst of samples does not outweigh a long steady
    stretch: a reading at its time (vLLM's gauges) stands for the time until the next sample (the
    last for the time until the pass ended, when its ``t`` is on the pass clock, else the mean
    sampling interval); a mean since the previous sample (:data:`INTERVAL_MEAN_SOURCES`, the
    embedded engine's step-log figure) stands for the time since that sample (the first for the
    time since the pass began), so the embedded engine's reading at the pass's start, before any
    step, weighs nothing. ``preemptions`` is the increase of the engine's cumulative
    preemption counter over the pass (the counter's maximum minus its minimum). Without samples
    every value is null and the histogram empty.

    Returns
    -------
    dict
        ``mean_running``, ``max_running``, ``mean_waiting``, ``preemptions`` and
        ``running_hist`` ({running count (str): seconds}).
    """
    empty = {"mean_running": None, "max_running": None, "mean_waiting": None, "preemptions": None, "running_hist": {}}
    points = sorted(
        (s for s in samples if math.isfinite(s.t) and math.isfinite(s.num_requests_running)), key=lambda s: s.t
    )
    if not points:
        return empty
    gaps = [b.t - a.t for a, b in zip(points, points[1:])]
    if all(s.source in INTERVAL_MEAN_SOURCES for s in points):
        weights = [max(points[0].t, 0.0)] + gaps
    else:
        last = points[-1].t
        if 0.0 <= last <= wall_s:
            tail = wall_s - last
        else:
            tail = math.fsum(gaps) / len(gaps) if gaps else 0.0
        weights = gaps + [tail]
    if math.fsum(weights) <= 0.0:
        weights = [1.0] * len(points)
    total = math.fsum(weights)
    mean_running = math.fsum(s.num_requests_running * w for s, w in zip(points, weights)) / total
    waiting = [(s.num_requests_waiting, w) for s, w in zip(points, weights) if math.isfinite(s.num_requests_waiting)]
    wsum = math.fsum(w for _, w in waiting)
    mean_waiting = (math.fsum(v * w for v, w in waiting) / wsum) if wsum > 0 else None
    hist: dict[int, float] = defaultdict(float)
    for s, w in zip(points, weights):
        hist[int(round(s.num_requests_running))] += w
    pre = [s.num_preemptions_total for s in points if math.isfinite(s.num_preemptions_total)]
    return {
        "mean_running": mean_running,
        "max_running": max(s.num_requests_running for s in points),
        "mean_waiting": mean_waiting,
        "preemptions": (max(pre) - min(pre)) if pre else None,
        "running_hist": {str(k): round(v, 6) for k, v in sorted(hist.items())},
    }
