"""The servers of a run in its records, and the ones a killed run left up.

An engine that starts processes of its own (:class:`bistat.engines.base.ServerProcesses`: the
server adapters) reports each one as it starts and once it is stopped; the runner records both as
``server`` events in ``events.jsonl`` (:func:`server_event`), with the process's PID, process
group, start time, the machine's boot id, its command line, and how its adapter stops it.

A server's watchdog stops it when ``bistat run`` dies (:mod:`bistat.engines.lifetime`). Should one
still be up when the run is resumed (its watchdog killed too, say), :func:`stop_left_servers`
finds it from those records -- started, never recorded stopped, and still the same process (PID,
start time and boot id, so a reused PID is never taken for it) -- stops its process group as its
adapter would, and records that, before the resume checks the GPU and starts new servers.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bistat.engines.lifetime import same_process, stop_group
from bistat.store.format import utc_now
from bistat.store.readers import read_jsonl
from bistat.store.writer import RunWriter

__all__ = ["LeftServer", "SERVER_EVENT", "left_servers", "server_event", "stop_left_servers"]

#: The ``event`` of an ``events.jsonl`` line recording a server process (its ``process`` field).
SERVER_EVENT = "server"
#: How a server is stopped when its record does not say (SIGTERM, 10 s to SIGKILL).
_DEFAULT_STOP = (int(signal.SIGTERM), 10.0)


def server_event(arm: str, process: Mapping[str, Any], note: str | None = None) -> dict[str, Any]:
    """The ``events.jsonl`` line recording one of ``arm``'s server processes (``process``: as the
    adapter reports it, with ``state`` ``"started"`` or ``"stopped"``)."""
    state = process.get("state", "?")
    detail = f"pid {process.get('pid')} (process group {process.get('pgid')}) {state}"
    if state == "started" and process.get("argv"):
        detail += ": " + " ".join(str(a) for a in process["argv"])
    if note:
        detail += f"; {note}"
    return {"arm": arm, "event": SERVER_EVENT, "time_utc": utc_now(), "detail": detail,
            "process": dict(process)}


@dataclass(frozen=True)
class LeftServer:
    """A server of the run still up although its ``bistat run`` process is gone."""

    arm: str
    pid: int
    pgid: int
    argv: tuple[str, ...]
    stop_signal: int
    stop_grace_s: float

    def sentence(self) -> str:
        return (f"stopped the {self.arm} server an earlier process of this run left running "
                f"(pid {self.pid}, process group {self.pgid})")


def left_servers(run_dir: str | Path) -> list[LeftServer]:
    """The run's servers recorded as started, never as stopped, and still running: the same
    process (PID, start time, boot id) as recorded."""
    events, _ = read_jsonl(Path(run_dir) / "events.jsonl")
    started: dict[int, tuple[str, Mapping[str, Any]]] = {}
    for rec in events:
        process = rec.get("process")
        if rec.get("event") != SERVER_EVENT or not isinstance(process, Mapping):
            continue
        try:
            pid = int(process["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        if process.get("state") == "started":
            started[pid] = (str(rec.get("arm")), process)
        else:
            started.pop(pid, None)
    out = []
    for pid, (arm, process) in started.items():
        if "start_ticks" not in process or not same_process(process):
            continue
        sig, grace = _DEFAULT_STOP
        out.append(LeftServer(arm, pid, int(process.get("pgid", pid)),
                              tuple(str(a) for a in process.get("argv") or ()),
                              int(process.get("stop_signal", sig)),
                              float(process.get("stop_grace_s", grace))))
    return out


def stop_left_servers(run_dir: str | Path) -> tuple[LeftServer, ...]:
    """Stop every server :func:`left_servers` finds (its process group: its adapter's stop
    signal, SIGKILL after its grace period) and record each as stopped in the run directory."""
    left = left_servers(run_dir)
    if not left:
        return ()
    with RunWriter.open_existing(Path(run_dir)) as writer:
        for s in left:
            stop_group(s.pgid, s.stop_signal, s.stop_grace_s)
            writer.append("events", server_event(
                s.arm, {"state": "stopped", "pid": s.pid, "pgid": s.pgid},
                "left running by an earlier process of this run; stopped by the resume"))
    return tuple(left)
