"""Kernel compilations during inference, read from the engine logs a run kept.

Field lesson: warm-up is not steady state. An M-bucketed Triton kernel compiles again for each new
configuration, and a compilation inside a counted pass makes that pass slow for a reason that is
not the arm's steady-state cost. vLLM 0.25.0 watches for it and warns in its log
(``jit_monitor.py``: ``Triton kernel JIT compilation during inference: NAME. This causes a latency
spike; ...``). bistat keeps every engine start's log (``engine-logs/ARM-N.log.gz``); this module
finds those warnings and places each in the passes of its arm that were running in that second,
so that a finding can say which pass (warm-up or counted) paid for a compilation.

vLLM stamps its log lines with the host's clock to the second and without a year
(``12-01 16:56:08``): the year is the run's (``run.json`` ``created_utc``, the next one when the
month is earlier than the run's), the clock is taken as UTC (the GPU machines bistat's runs came
from keep UTC), and a second can overlap two passes of the same arm, which are then both named.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import math
import re
from dataclasses import dataclass
from pathlib import Path

from bistat.prereg import parse_time
from bistat.records import ENGINE_LOGS_DIR

__all__ = ["JIT_WARNING", "JitCompile", "jit_compiles"]

#: vLLM's warning (``vllm/.../jit_monitor.py``), with its log stamp ``MM-DD HH:MM:SS``
JIT_WARNING = re.compile(
    r"(?P<month>\d\d)-(?P<day>\d\d) (?P<time>\d\d:\d\d:\d\d)(?:[.,]\d+)? \[jit_monitor\.py:\d+\] "
    r"Triton kernel JIT compilation during inference: (?P<kernel>[\w.]+?)\.?(?:\s|$)")


@dataclass(frozen=True)
class JitCompile:
    """One warning: which arm's engine compiled which kernel, when, and during which passes."""

    arm: str
    start: int                             # the arm's engine start (``ARM-N.log.gz``)
    time_utc: str                          # the log's second, ``YYYY-MM-DDTHH:MM:SSZ``
    kernel: str
    passes: tuple[tuple[int, str], ...]    # (pass_index, kind) of the arm's passes in that second

    @property
    def in_counted_pass(self) -> bool:
        return any(kind == "counted" for _, kind in self.passes)


def jit_compiles(run_dir: str | Path, created_utc: str | None,
                 passes: list[dict]) -> tuple[JitCompile, ...]:
    """The JIT-compilation warnings in ``run_dir``'s engine logs, in time order.

    Parameters
    ----------
    run_dir : path
        The recorded run (its ``engine-logs/`` folder; none: no warnings).
    created_utc : str or None
        ``run.json``'s ``created_utc``, for the year the log stamps leave out (None: none found).
    passes : list of dict
        The run's passes (``passes.jsonl`` rows: ``arm``, ``pass_index``, ``kind``,
        ``started_utc``, ``wall_s``).
    """
    logs = Path(run_dir) / ENGINE_LOGS_DIR
    if created_utc is None or not logs.is_dir():
        return ()
    created = parse_time(created_utc)
    spans: dict[str, list[tuple[_dt.datetime, _dt.datetime, int, str]]] = {}
    for p in passes:
        started, wall = p.get("started_utc"), p.get("wall_s")
        if isinstance(started, str) and isinstance(wall, (int, float)) and math.isfinite(wall):
            t0 = parse_time(started)
            spans.setdefault(str(p["arm"]), []).append(
                (t0, t0 + _dt.timedelta(seconds=float(wall)), int(p["pass_index"]),
                 str(p["kind"])))
    found: list[JitCompile] = []
    for path in sorted(logs.glob("*.log.gz")):
        arm, _, start = path.name[: -len(".log.gz")].rpartition("-")
        if not arm or not start.isdigit():
            continue
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = JIT_WARNING.search(line)
                if m is None:
                    continue
                month = int(m["month"])
                year = created.year + (1 if month < created.month else 0)
                second = _dt.datetime.fromisoformat(
                    f"{year:04d}-{month:02d}-{m['day']}T{m['time']}+00:00")
                during = tuple((i, kind) for t0, t1, i, kind in spans.get(arm, ())
                               if t0 < second + _dt.timedelta(seconds=1) and t1 >= second)
                found.append(JitCompile(arm, int(start), second.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                        m["kernel"], during))
    return tuple(sorted(found, key=lambda j: (j.time_utc, j.arm, j.kernel)))
