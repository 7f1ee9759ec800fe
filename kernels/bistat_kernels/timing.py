"""GPU timing as a model's decode step sees it: CUDA-graph replays over rotating weights.

``triton.testing.do_bench`` records a CUDA event, *then* launches the function from Python, so a
kernel shorter than its launcher's CPU time is timed as that CPU time (a Triton launch from
Python costs tens of microseconds; cuBLAS through torch.mm a few). vLLM runs decode steps as CUDA
graph replays, where no Python runs, so we time the same way (METHOD.md: "for many small launches,
capture a graph and time its replays"). Each call in the graph reads a different copy of the
weight, and the copies together exceed the L2 cache several times, so every call reads its weight
from HBM as consecutive layers of a model do; the activation is shared, as a layer's input
usually is hot.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

L2_MULTIPLE = 3  # rotate through at least this many L2 caches' worth of weights
MAX_COPIES = 512
TARGET_MS = 10.0  # total replay time to aim for per measurement


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """``w`` followed by clones of it, enough to exceed the L2 cache ``L2_MULTIPLE`` times."""
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    nbytes = w.numel() * w.element_size()
    n = min(MAX_COPIES, max(2, math.ceil(L2_MULTIPLE * l2 / max(nbytes, 1))))
    return [w] + [w.clone() for _ in range(n - 1)]


def graph_time_ms(calls: Sequence[Callable[[], Any]], max_replays: int = 10) -> float:
    """Median GPU time per call, ms, of ``calls`` captured back to back in one CUDA graph.

    Every call must have run once outside the capture (JIT compilation, cuBLAS handles).
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end)
    replays = max(3, min(max_replays, math.ceil(TARGET_MS / max(first, 1e-3))))
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / len(calls)


def wall_time_ms(calls: Sequence[Callable[[], Any]], repeats: int = 3) -> float:
    """Median host time per call, ms, of ``calls`` run back to back ``repeats`` times: for the
    Triton interpreter on the CPU, where there is no GPU to time (such times rank nothing a GPU
    would; they let the tuner's path run in tests)."""
    import time

    for call in calls:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) / len(calls)
