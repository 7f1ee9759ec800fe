"""How busy the host was during a pass: machine-wide CPU time, CPU steal, bistat's own share.

Pass-to-pass variation is large (FIELD-NOTES), and part of it can be the host rather than the
engine: another job on the same machine, or a hypervisor taking CPU time from a shared VM
(*steal*). An engine on the CPU slows down when other work shares its cores, and nothing else in
a run would say so; each pass record therefore carries ``host``, what the machine's CPUs did
while it ran:

``n_cpus``
    logical CPUs (``psutil.cpu_count()``);
``busy_s``
    machine-wide non-idle CPU seconds over the pass (``psutil.cpu_times()``: every field but
    ``idle`` and ``iowait``, summed over CPUs; steal included);
``steal_s``
    CPU seconds the hypervisor gave to other guests (Linux; 0 elsewhere);
``own_cpu_s``
    user + system seconds of bistat's own process (in-process engines included; an engine in a
    subprocess, such as vLLM's workers, is not in it);
``load_1m``
    the 1-minute load average at the pass's end.

Reading the counters costs microseconds. Without psutil (it is a core dependency, but a device
image may run bistat from source) no ``host`` is recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HostSample", "host_sample", "host_record"]


@dataclass(frozen=True)
class HostSample:
    """Counters at one moment (:func:`host_sample`)."""

    total_s: float       # every CPU-time field summed over CPUs
    idle_s: float        # idle + iowait
    steal_s: float
    own_s: float         # this process's user + system

    @property
    def busy_s(self) -> float:
        """Every CPU-time field but idle and iowait, summed over CPUs."""
        return self.total_s - self.idle_s


def host_sample() -> HostSample | None:
    """The host's CPU counters now, or None where psutil is missing or cannot read them."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        t = psutil.cpu_times()
        own = psutil.Process().cpu_times()
    except (OSError, psutil.Error):
        return None
    fields = t._asdict()
    # guest and guest_nice are already counted in user and nice (Linux's /proc/stat)
    total = sum(v for k, v in fields.items() if k not in ("guest", "guest_nice"))
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    return HostSample(total_s=float(total), idle_s=float(idle),
                      steal_s=float(fields.get("steal", 0.0)), own_s=float(own.user + own.system))


def host_record(before: HostSample | None, after: HostSample | None) -> dict[str, Any] | None:
    """The ``host`` record of a pass from the counters at its start and end (None if either is
    missing)."""
    if before is None or after is None:
        return None
    import psutil

    try:
        load_1m: float | None = float(os.getloadavg()[0])
    except (AttributeError, OSError):
        load_1m = None
    return {
        "n_cpus": int(psutil.cpu_count() or 1),
        "busy_s": round(max(0.0, after.busy_s - before.busy_s), 3),
        "steal_s": round(max(0.0, after.steal_s - before.steal_s), 3),
        "own_cpu_s": round(max(0.0, after.own_s - before.own_s), 3),
        "load_1m": None if load_1m is None else round(load_1m, 2),
    }
