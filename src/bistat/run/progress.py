"""Progress of a run as it records: what the runner tells (:class:`Reporter`) when a pass starts,
as each response arrives and when a pass ends (:class:`PassReport`), and the three reporters:
:class:`NullReporter` (library use, tests), :class:`PlainReporter` (one line per pass on a text
stream) and :class:`RichReporter` (a progress bar per pass).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from bistat.core.schedule import PlannedPass


@dataclass(frozen=True)
class PassReport:
    """What the reporter is told when a pass ends (the ``passes.jsonl`` line, typed)."""

    planned: PlannedPass
    status: str
    wall_s: float
    n_requests: int
    n_failed: int
    output_tokens: int
    output_tokens_per_s: float | None


class Reporter(Protocol):
    """Receives progress; may be called from engine threads (``result``)."""

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None: ...

    def result(self, n_tokens: int, failed: bool) -> None: ...

    def pass_finished(self, report: PassReport) -> None: ...

    def message(self, text: str) -> None: ...


class NullReporter:
    """Reports nothing (library use, tests)."""

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        return None

    def result(self, n_tokens: int, failed: bool) -> None:
        return None

    def pass_finished(self, report: PassReport) -> None:
        return None

    def message(self, text: str) -> None:
        return None


def _pass_line(report: PassReport, position: int, total: int) -> str:
    p = report.planned
    rate = "n/a" if report.output_tokens_per_s is None else f"{report.output_tokens_per_s:.1f} tok/s"
    flag = "" if report.status == "complete" else f" [{report.status}]"
    return (
        f"pass {position}/{total} {p.arm} {p.kind} (seq {p.seq}): {report.n_requests} requests, "
        f"{report.n_failed} failed, {report.wall_s:.2f} s, {rate}{flag}"
    )


class PlainReporter:
    """One line per pass and per message on a text stream (logs, pipes, CliRunner)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._position = 0
        self._total = 0

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        self._position, self._total = position, total

    def result(self, n_tokens: int, failed: bool) -> None:
        return None

    def pass_finished(self, report: PassReport) -> None:
        self._write(_pass_line(report, self._position, self._total))

    def message(self, text: str) -> None:
        self._write(text)


class RichReporter:
    """A rich progress bar per pass (requests done, failures, output tokens/s), then its summary line."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self._console = console or Console(stderr=True)
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self._tokens = 0
        self._failed = 0
        self._t0 = 0.0
        self._position = 0
        self._total = 0

    def pass_started(self, planned: PlannedPass, n_requests: int, position: int, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._position, self._total = position, total
        self._tokens, self._failed, self._t0 = 0, 0, time.perf_counter()
        self._progress = Progress(
            TextColumn(f"[bold]pass {position}/{total}[/] {planned.arm} {planned.kind}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=self._console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("pass", total=n_requests, rate="0.0", failed=0)

    def result(self, n_tokens: int, failed: bool) -> None:
        with self._lock:
            self._tokens += n_tokens
            self._failed += int(failed)
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            if self._progress is not None:
                self._progress.update(
                    self._task, advance=1, rate=f"{self._tokens / elapsed:.1f}", failed=self._failed
                )

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def pass_finished(self, report: PassReport) -> None:
        self._stop()
        self._console.print(_pass_line(report, self._position, self._total), highlight=False)

    def message(self, text: str) -> None:
        self._stop()
        self._console.print(text, highlight=False)
