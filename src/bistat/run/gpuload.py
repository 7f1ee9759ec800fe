"""What the GPU was doing during a pass: SM clock, temperature, power, and why it slowed down.

Passes can slow down over a run in both arms alike; the GPU's samples tell whether its clock
dropped (power or thermal limits) or something else changed. A run of engines on this machine's
GPU (``capabilities.local_gpu``) samples every GPU with ``nvidia-smi`` once a second in a
background thread, and each pass record carries ``gpu``, the samples taken while it ran, of the
GPUs its arm's engine used:

``n_samples``
    samples within the pass (0 when it was shorter than the sampling interval);
``interval_s``
    the sampling interval;
``sm_clock_mhz_mean`` / ``sm_clock_mhz_min``
    the SM clock (``clocks.sm``);
``mem_clock_mhz_mean``
    the memory clock (``clocks.mem``);
``temperature_c_max``
    the GPU's temperature (``temperature.gpu``);
``power_w_mean`` / ``power_w_max``
    the board's power draw (``power.draw``);
``utilization_pct_mean``
    the share of time a kernel ran (``utilization.gpu``);
``slowdown_share``
    the share of samples in which the driver named a reason that holds the clocks down: a
    software power cap, a hardware slowdown, thermal or power-brake slowdown
    (``clocks_event_reasons.active``; idle, application clock settings and sync boost are not
    slowdowns);
``slowdown_reasons``
    those reasons, each with the samples it was active in;
``gpus``
    the UUIDs sampled.

A field the driver does not report is left out of the means (null when no sample had it). Each
sample is one ``nvidia-smi --query-gpu`` process that exits, so no output waits in a pipe's
buffer; it costs the host some 20-50 ms of CPU a second and the GPU nothing it would notice (the
driver's counters are read, as monitoring agents read them). ``BISTAT_GPU_SAMPLE_S`` sets the
interval in seconds; ``0`` turns sampling off. Without ``nvidia-smi`` nothing is sampled and no
``gpu`` is recorded.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuMonitor", "GpuSample", "GpuSamplingError", "SLOWDOWN_REASONS", "gpu_pass_record",
           "parse_samples", "sample_interval_s"]

#: the environment variable that sets the sampling interval (seconds; 0: off)
INTERVAL_ENV = "BISTAT_GPU_SAMPLE_S"
DEFAULT_INTERVAL_S = 1.0

#: ``nvidia-smi --query-gpu`` fields, in the order :func:`parse_samples` reads them
_FIELDS = ("uuid", "clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "utilization.gpu")
#: the active clock-event reasons' bit mask: the current name, then the one drivers before 535
#: used; the first that ``nvidia-smi`` accepts is queried, neither where it accepts none
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")

#: NVML's clock-event reason bits that hold the clocks down (``nvmlClocksEventReason*``);
#: 0x1 (idle), 0x2 (application clocks setting), 0x10 (sync boost) and 0x100 (display clock
#: setting) are not slowdowns
SLOWDOWN_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown",
                    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}

_TIMEOUT_S = 5.0


class GpuSamplingError(ValueError):
    """``BISTAT_GPU_SAMPLE_S`` is not a number of seconds >= 0."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment (None: the driver did not report the field)."""

    t: float                      # time.time() midway through the query
    uuid: str
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    temperature_c: float | None
    power_w: float | None
    utilization_pct: float | None
    reasons: int | None           # the active clock-event reasons' bit mask


def sample_interval_s(environ: dict[str, str] | None = None) -> float:
    """The sampling interval: ``BISTAT_GPU_SAMPLE_S`` or :data:`DEFAULT_INTERVAL_S`.

    Raises
    ------
    GpuSamplingError
        The variable is not a number >= 0; the message names it and the fix.
    """
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise GpuSamplingError(f"{INTERVAL_ENV}={raw!r}: not a number of seconds >= 0; set it "
                               "to the GPU sampling interval (e.g. 1) or 0 to turn sampling off")
    return value


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        return None            # "[N/A]", "[Not Supported]", ""
    return value if math.isfinite(value) else None


def _mask(text: str) -> int | None:
    text = text.strip()
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


def parse_samples(text: str, t: float, with_reasons: bool) -> list[GpuSample]:
    """The GPUs of one ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` answer
    (the fields of :data:`_FIELDS`, then the reasons' mask when ``with_reasons``); a line that
    does not have them is skipped.

    Examples
    --------
    >>> s = parse_samples("GPU-1, 1980, 3201, 41, 312.50, 98, 0x0000000000000004\\n", 5.0, True)
    >>> s[0].sm_clock_mhz, s[0].power_w, s[0].reasons
    (1980.0, 312.5, 4)
    >>> parse_samples("GPU-2, [N/A], 3201, 41, [N/A], 0\\n", 5.0, False)[0].sm_clock_mhz is None
    True
    """
    width = len(_FIELDS) + int(with_reasons)
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != width or not cells[0]:
            continue
        out.append(GpuSample(
            t=t, uuid=cells[0], sm_clock_mhz=_number(cells[1]), mem_clock_mhz=_number(cells[2]),
            temperature_c=_number(cells[3]), power_w=_number(cells[4]),
            utilization_pct=_number(cells[5]),
            reasons=_mask(cells[6]) if with_reasons else None))
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(math.fsum(vals) / len(vals), 3) if vals else None


def _extreme(values: Sequence[float | None], pick: Callable[..., float]) -> float | None:
    vals = [v for v in values if v is not None]
    return pick(vals) if vals else None


def gpu_pass_record(samples: Sequence[GpuSample], interval_s: float,
                    uuids: Sequence[str] = ()) -> dict[str, Any]:
    """A pass's ``gpu`` record from the samples taken while it ran, of the GPUs in ``uuids``
    (all of them when empty); see the module notes for the fields.

    Examples
    --------
    >>> a = GpuSample(1.0, "GPU-1", 1980.0, 3201.0, 40.0, 300.0, 99.0, 0x0)
    >>> b = GpuSample(2.0, "GPU-1", 1500.0, 3201.0, 44.0, 700.0, 99.0, 0x4)
    >>> r = gpu_pass_record([a, b], 1.0)
    >>> r["sm_clock_mhz_mean"], r["sm_clock_mhz_min"], r["slowdown_share"], r["slowdown_reasons"]
    (1740.0, 1500.0, 0.5, {'sw_power_cap': 1})
    """
    wanted = set(uuids)
    mine = [s for s in samples if not wanted or s.uuid in wanted]
    record: dict[str, Any] = {"n_samples": len(mine), "interval_s": interval_s}
    if not mine:
        return record
    reasons: dict[str, int] = {}
    slowed = 0
    with_mask = [s for s in mine if s.reasons is not None]
    for s in with_mask:
        active = [name for bit, name in SLOWDOWN_REASONS.items() if s.reasons & bit]
        slowed += bool(active)
        for name in active:
            reasons[name] = reasons.get(name, 0) + 1
    record.update({
        "sm_clock_mhz_mean": _mean([s.sm_clock_mhz for s in mine]),
        "sm_clock_mhz_min": _extreme([s.sm_clock_mhz for s in mine], min),
        "mem_clock_mhz_mean": _mean([s.mem_clock_mhz for s in mine]),
        "temperature_c_max": _extreme([s.temperature_c for s in mine], max),
        "power_w_mean": _mean([s.power_w for s in mine]),
        "power_w_max": _extreme([s.power_w for s in mine], max),
        "utilization_pct_mean": _mean([s.utilization_pct for s in mine]),
        "slowdown_share": round(slowed / len(with_mask), 4) if with_mask else None,
        "slowdown_reasons": dict(sorted(reasons.items())),
        "gpus": sorted({s.uuid for s in mine}),
    })
    return record


class GpuMonitor:
    """Samples the GPUs with ``nvidia-smi`` every ``interval_s`` in a daemon thread.

    ``start()`` asks ``nvidia-smi`` once which fields it answers and returns False (sampling
    nothing) where there is no ``nvidia-smi``, it fails, or the interval is 0. ``record(t0, t1,
    uuids)`` is a pass's ``gpu`` record (:func:`gpu_pass_record`) from the samples taken between
    ``t0`` and ``t1`` (``time.time()``); samples older than the last pass asked for are dropped.
    ``stop()`` ends the thread; a failing query is skipped, never raised.
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, smi: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval_s = float(interval_s)
        self._smi = smi
        self._clock = clock
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._query: list[str] | None = None
        self._with_reasons = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_query(self, fields: Sequence[str]) -> str | None:
        assert self._smi is not None
        try:
            done = subprocess.run([self._smi, "--query-gpu=" + ",".join(fields),
                                   "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    def start(self) -> bool:
        if self.interval_s <= 0:
            return False
        self._smi = self._smi or shutil.which("nvidia-smi")
        if self._smi is None:
            return False
        for reason in (*_REASON_FIELDS, None):
            fields = [*_FIELDS, *([reason] if reason else [])]
            out = self._run_query(fields)
            if out is not None and parse_samples(out, 0.0, reason is not None):
                self._query, self._with_reasons = fields, reason is not None
                break
        else:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bistat-gpu-sampler",
                                        daemon=True)
        self._thread.start()
        return True

    def sample_once(self) -> list[GpuSample]:
        """Query the GPUs now and keep the samples (what the thread does each interval)."""
        if self._query is None:
            return []
        before = self._clock()
        out = self._run_query(self._query)
        if out is None:
            return []
        got = parse_samples(out, (before + self._clock()) / 2.0, self._with_reasons)
        with self._lock:
            self._samples.extend(got)
        return got

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def record(self, t0: float, t1: float, uuids: Sequence[str] = ()) -> dict[str, Any]:
        with self._lock:
            window = [s for s in self._samples if t0 <= s.t <= t1]
            self._samples = [s for s in self._samples if s.t >= t0]
        return gpu_pass_record(window, self.interval_s, uuids)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_TIMEOUT_S + self.interval_s + 1.0)
            self._thread = None
