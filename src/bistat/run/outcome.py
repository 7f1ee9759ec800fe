"""How a run ends: :class:`RunOutcome`, and the stops that end it before its schedule does, each
raised where the run stops and turned into the outcome by the session (:mod:`bistat.run.session`):
an engine that refused the setting or failed to start (*untested*), one that died mid-pass
(*incomplete*), a pass whose every request failed (*stopped*; :data:`ALL_FAILED` on its ``end``
line), a run directory lost (*lost*), and a signal (:class:`SignalInterrupt`, *interrupted*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bistat.core.failures import ErrorGroup


RunCompletion = Literal["complete", "untested", "incomplete", "interrupted", "lost", "stopped"]


@dataclass(frozen=True)
class RunOutcome:
    """How a run (or a resumed part of it) ended.

    ``status``: ``complete`` (the whole schedule ran), ``untested`` (an engine refused the
    setting or failed to start: the hypothesis could not be tested), ``incomplete`` (an engine
    died mid-pass; resumable), ``interrupted`` (Ctrl-C; resumable), ``stopped`` (every request
    of a pass failed: the pass is recorded ``failed``, the engines are stopped and the run ends
    there; resumable, and the resume runs that pass again), ``lost`` (the run directory was
    removed or replaced while the run recorded: stopped before the next pass, its files copied
    from the descriptors the run held into ``run_dir``, a new directory beside the old;
    ``detail`` says what happened and where each file could be read).

    ``errors``: the failed requests of this execution grouped by their error
    (:func:`bistat.core.failures.error_groups`), in the order each first appeared.
    """

    run_dir: Path
    status: RunCompletion
    passes_run: int
    failed_requests: int
    failed_passes: int
    detail: str | None = None
    errors: tuple[ErrorGroup, ...] = ()


#: the ``stopped`` field of the ``end`` line of a pass the run stopped on
ALL_FAILED = "every request failed"


class SignalInterrupt(KeyboardInterrupt):
    """A signal other than SIGINT that stops the run as Ctrl-C does (``bistat run`` raises it
    for SIGTERM): the run ends ``interrupted``, saying which signal."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"signal {signal_name}")
        self.signal_name = signal_name


class _Stop(Exception):
    """A stop that ends the run before its schedule does; ``detail`` says why, as the outcome
    will."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _Untested(_Stop):
    """An engine refused the setting or failed to start: the run ends *untested*."""


class _EngineDied(_Stop):
    """An engine failed during a pass: the run ends *incomplete* (resumable)."""


class _AllFailed(_Stop):
    """Every request of a pass failed: the run stops on it (see :class:`RunOutcome`)."""


class _RunDirLost(_Stop):
    """The run directory was removed or replaced while the run recorded: it ends *lost*."""
