"""No server outlives the bistat process that started it: a watchdog per server, a mark in the
server's environment, and the search for servers a killed run left behind (Linux ``/proc``).

A server adapter (:class:`bistat.engines.server_process.LocalServerEngine`) starts each server in
a process group of its own, and stops the group when the run ends, on errors, on Ctrl-C and at
interpreter exit. A ``kill -9`` of ``bistat run`` runs none of that, and the server, re-parented to
PID 1, would keep its port and its GPU memory. The ``vllm-offline`` engine's worker
(:class:`bistat.engines.vllm_offline.VLLMOfflineEngine`) holds the GPU the same way: it ends at
the end of its input, but not while a pass is computing. So every server, and every such worker,
gets (:func:`guard_group`):

* a **watchdog** (:func:`start_watchdog`, this module run as ``python -m
  bistat.engines.lifetime``): a small child of ``bistat run``, in a session of its own (a Ctrl-C
  or a signal to ``bistat``'s process group does not reach it), that checks every
  :data:`POLL_S` whether its parent is still ``bistat run`` (``getppid``: a dead parent's child is
  re-parented) and, once it is not, stops the server's process group as the adapter would (its
  stop signal, SIGKILL after the grace period). It exits when the group is gone. A parent-death
  signal (``prctl(PR_SET_PDEATHSIG)``) would not do: Linux sends it when the *thread* that
  started the child ends, and bistat starts engines from worker threads.
* a **mark** in its environment, :data:`SERVER_MARK` = ``"PID:START"``, naming the ``bistat``
  process that started it (its PID and start time, so a reused PID is not mistaken for it): every
  process of the server inherits it. :func:`leftover_servers` finds the servers whose marked
  owner is gone (``bistat doctor`` stops them).
* a **record** in the run directory (``events.jsonl``, event ``server``, by the runner) with its
  PID, group, start time and the machine's boot id (:func:`process_identity`), so that ``bistat
  run --resume`` stops a server of that run that is somehow still up before it starts new ones.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["POLL_S", "SERVER_MARK", "LeftoverServer", "end_watchdog", "group_alive", "group_pids",
           "guard_group", "leftover_servers", "owner_mark", "process_identity", "same_process",
           "start_watchdog", "stop_group", "watch"]

#: The environment variable marking a server's processes with the ``bistat`` process that
#: started them: ``"PID:START"`` (START: its start time in clock ticks since boot).
SERVER_MARK = "BISTAT_SERVER_OF"
#: How often the watchdog looks at its parent (seconds).
POLL_S = 0.2


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_identity(pid: int) -> dict[str, Any] | None:
    """What tells process ``pid`` apart from a later one given the same PID: its start time
    (clock ticks since boot, ``/proc/PID/stat`` field 22) and the machine's boot id; None when
    it is gone or a zombie."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return {"pid": pid, "start_ticks": int(fields[19]), "boot_id": _boot_id()}


def same_process(identity: dict[str, Any]) -> bool:
    """Whether the process ``identity`` (:func:`process_identity`) describes still runs."""
    now = process_identity(int(identity["pid"]))
    return now is not None and all(now[k] == identity.get(k) for k in ("start_ticks", "boot_id"))


def owner_mark() -> str:
    """:data:`SERVER_MARK`'s value for a server this process starts."""
    me = process_identity(os.getpid())
    return f"{os.getpid()}:{me['start_ticks'] if me else 0}"


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def stop_group(pgid: int, sig: int, grace_s: float, leader: subprocess.Popen | None = None
               ) -> None:
    """Stop process group ``pgid``: ``sig`` to the whole group, SIGKILL after ``grace_s``, then
    wait (up to 30 s) until none of its processes is left, so that its GPU memory is free.
    ``leader``: the group leader, when this process started it (it is waited for, so it leaves
    no zombie)."""
    _signal_group(pgid, sig)
    if leader is not None:
        try:
            leader.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + grace_s
    while group_pids(pgid) and time.monotonic() < deadline:   # workers shutting down
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    if leader is not None:
        leader.wait()
    deadline = time.monotonic() + 30
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def start_watchdog(pgid: int, sig: int, grace_s: float) -> subprocess.Popen:
    """Start the watchdog of the server whose process group is ``pgid`` (the module docstring):
    once this process is gone, it sends the group ``sig``, then SIGKILL after ``grace_s``."""
    return subprocess.Popen(
        [sys.executable, "-m", "bistat.engines.lifetime", "--parent", str(os.getpid()),
         "--group", str(pgid), "--signal", str(int(sig)), "--grace", f"{grace_s:g}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def guard_group(pid: int, argv: Sequence[str], sig: int, grace_s: float
                ) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Guard a process just started in a process group of its own (``pid`` = its group): start
    its watchdog, and return it with the process's record (``state`` left out): its identity
    (:func:`process_identity`), group, command line, the watchdog's PID and how it is stopped."""
    watchdog = start_watchdog(pid, sig, grace_s)
    identity = process_identity(pid) or {"pid": pid}
    return watchdog, {**identity, "pgid": pid, "argv": list(argv), "watchdog_pid": watchdog.pid,
                      "stop_signal": int(sig), "stop_grace_s": grace_s}


def end_watchdog(watchdog: subprocess.Popen | None) -> None:
    """Reap a watchdog once its group is stopped (it ends within its poll; else it is killed)."""
    if watchdog is None:
        return
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def watch(parent: int, pgid: int, sig: int, grace_s: float, poll_s: float = POLL_S) -> bool:
    """The watchdog's loop: until group ``pgid`` is gone, check every ``poll_s`` that this
    process's parent is still ``parent``; once it is not, stop the group (:func:`stop_group`).
    True when it stopped the group, False when the group ended on its own (stopped by
    ``parent``)."""
    while group_alive(pgid):
        if os.getppid() != parent:
            stop_group(pgid, sig, grace_s)
            return True
        time.sleep(poll_s)
    return False


@dataclass(frozen=True)
class LeftoverServer:
    """A server process whose ``bistat`` process is gone: its PID, process group, command line
    and the mark naming that process (:data:`SERVER_MARK`)."""

    pid: int
    pgid: int
    argv: tuple[str, ...]
    owner: str

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "pgid": self.pgid, "argv": list(self.argv), "owner": self.owner}


def _owner_gone(mark: str) -> bool:
    pid, _, ticks = mark.partition(":")
    try:
        identity = {"pid": int(pid), "start_ticks": int(ticks), "boot_id": _boot_id()}
    except ValueError:
        return False   # not a mark this module wrote: leave the process alone
    return not same_process(identity)


def leftover_servers(proc: str | os.PathLike = "/proc") -> list[LeftoverServer]:
    """The servers on this machine marked by a ``bistat`` process that is gone (one per process
    group: its leader, or its lowest PID), in PID order. Only this user's processes can be read;
    a machine without ``/proc`` has none to report."""
    found: dict[int, LeftoverServer] = {}
    try:
        entries = sorted(int(e) for e in os.listdir(proc) if e.isdigit())
    except OSError:
        return []
    prefix = f"{SERVER_MARK}=".encode()
    for pid in entries:
        try:
            environ = Path(proc, str(pid), "environ").read_bytes().split(b"\0")
            argv = Path(proc, str(pid), "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        mark = next((v[len(prefix):].decode(errors="replace") for v in environ
                     if v.startswith(prefix)), None)
        fields = _stat_fields(pid)
        if mark is None or fields is None or fields[0] == "Z" or not _owner_gone(mark):
            continue
        pgid = int(fields[2])
        if pgid == os.getpgrp() or (pgid in found and pid != pgid):
            continue
        found[pgid] = LeftoverServer(pid, pgid, tuple(a.decode(errors="replace")
                                                      for a in argv if a), mark)
    return sorted(found.values(), key=lambda s: s.pid)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bistat.engines.lifetime --parent PID --group PGID --signal N --grace S``: the
    watchdog (:func:`watch`). Ctrl-C and a hang-up of a terminal do not stop it."""
    parser = argparse.ArgumentParser(prog="python -m bistat.engines.lifetime")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--signal", type=int, default=int(signal.SIGTERM))
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch(args.parent, args.group, args.signal, args.grace)
    return 0


if __name__ == "__main__":   # pragma: no cover - run as the watchdog's process
    sys.exit(main())
