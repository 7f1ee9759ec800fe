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
``repeats`` runs. :func:`side_by_side_us` measures several operators that way with their runs
interleaved (run r of each, in an order that rotates with r), so that a change of the host's
speed during the measurement (clock, another process) reaches all of them alike rather than
whichever ran at the time; ``bistat kernels bench`` and ``kernels/device/gpu_call.py hostcost``
use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
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
    return side_by_side_us({"fn": fn}, calls, repeats, warmup)["fn"]


def _issue(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """One repeat: (host us per call, wall us per call) of ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def side_by_side_us(fns: Mapping[str, Callable[[], Any]], calls: int = 400, repeats: int = 9,
                    warmup: int = 20) -> dict[str, tuple[float, float]]:
    """:func:`per_call_us` of each operator, their runs interleaved: name -> (host, wall) medians.

    Run ``r`` of every operator comes before run ``r + 1`` of any, and the order within a round
    rotates by one each round, so no operator always runs first after another's queue drained.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    host: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            h, w = _issue(fns[name], calls)
            host[name].append(h)
            wall[name].append(w)
    return {name: (statistics.median(host[name]), statistics.median(wall[name])) for name in names}
