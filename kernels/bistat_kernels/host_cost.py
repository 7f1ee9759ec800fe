"""Host cost per GEMM call in eager mode: the tuned launcher against torch.mm, side by side.

vLLM runs a step eagerly (no CUDA-graph replay) above its largest captured batch size, and then
every linear layer pays its launcher's host time: Python, argument binding, the driver call. When
that exceeds the kernel's GPU time the GPU idles between kernels, whatever the kernel's speed.

:func:`per_call_us` measures that host time: after a synchronisation, ``calls`` back-to-back
calls are issued with no synchronisation between them and the wall time of issuing them is
divided by ``calls``. The GPU works through the queue meanwhile; as long as the queue does not
fill (the CUDA launch queue holds about a thousand launches, ``calls`` stays well below), issuing
never waits for the GPU, so the figure is host time alone. It also returns the time per call
with the final synchronisation: what the GPU and the host together allow. Each is the median of
``repeats`` runs. ``bistat kernels bench`` and ``kernels/device/gpu_call.py hostcost`` use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def per_call_us(fn: Callable[[], Any], calls: int = 400, repeats: int = 7,
                warmup: int = 20) -> tuple[float, float]:
    """(host us to issue one call, wall us per call with the final synchronisation); medians.

    Each repeat starts from an empty queue (the previous one ended synchronised), issues ``calls``
    back-to-back calls and then synchronises: the issue time is host time alone while the queue
    does not fill (see the module docstring), the wall time is what the GPU and the host together
    allow.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)
