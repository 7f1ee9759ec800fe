"""Host cost per GEMM call in eager mode: the tuned launcher against torch.mm, side by side.

vLLM runs a step eagerly (no CUDA-graph replay) above its largest captured batch size, and then
every linear layer pays its launcher's host time: Python, argument binding, the driver call. When
that exceeds the kernel's GPU time the GPU idles between kernels, whatever the kernel's speed.

:func:`enqueue_us` measures that host time: after a synchronisation, ``calls`` back-to-back
calls are issued with no synchronisation between them and the wall time of issuing them is
divided by ``calls``. The GPU works through the queue meanwhile; as long as the queue does not
fill (the CUDA launch queue holds about a thousand launches, ``calls`` stays well below), issuing
never waits for the GPU, so the figure is host time alone. :func:`wall_us` adds the final
synchronisation: the time per call the GPU and the host together allow. Each is the median of
``repeats`` runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def enqueue_us(fn: Callable[[], Any], calls: int = 400, repeats: int = 7,
               warmup: int = 20) -> float:
    """Median host microseconds to issue one call of ``fn`` (see the module docstring)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def wall_us(fn: Callable[[], Any], calls: int = 400, repeats: int = 7, warmup: int = 20) -> float:
    """Median microseconds per call of ``fn``, issue and execution, synchronised at the end."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)
