"""A run's engines (:class:`_Engines`): each block's engines made by the run's factory
(:data:`EngineFactory`) and started, in parallel where the kind allows, each start recorded
(``events``, ``environment``: the engine's fingerprint, or this machine's), and each engine stopped
with its server log kept in the run directory (``engine-logs/``).
"""

from __future__ import annotations

import concurrent.futures
import gzip
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from bistat.engines.base import Engine, EngineError, EngineInfo, EngineRefused, ServerProcesses
from bistat.engines.registry import capabilities
from bistat.run.fingerprint import engine_fingerprint
from bistat.run.leftovers import server_event
from bistat.run.outcome import _Untested
from bistat.store.format import ENGINE_LOGS_DIR, utc_now
from bistat.store.writer import RunWriter

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Arm, Experiment


EngineFactory = Callable[["Experiment", "Arm"], Engine]


class _Engines:
    """A run's engines: started a block at a time (in parallel where the kind allows), each start
    recorded (``events``, ``environment``), stopped with their server logs kept."""

    def __init__(self, experiment: "Experiment", writer: RunWriter,
                 engine_factory: EngineFactory) -> None:
        self.experiment = experiment
        self.writer = writer
        self.engine_factory = engine_factory
        self.arms = {arm.name: arm for arm in experiment.arms}
        #: the engines up now, by arm
        self.running: dict[str, Engine] = {}
        #: the GPUs each arm's engine uses (its fingerprint's UUIDs; empty: all of them)
        self.gpu_uuids: dict[str, tuple[str, ...]] = {}
        #: an engine log's path as its engine names it -> where the run kept its copy
        self.kept_logs: dict[str, str] = {}

    def cite_kept(self, text: str) -> str:
        """``text`` with each engine log it names replaced by the copy the run directory keeps
        (``engine-logs/ARM-N.log.gz``): an adapter's own log may be a temporary file, removed
        once kept."""
        for src, dest in self.kept_logs.items():
            text = text.replace(src, dest)
        return text

    def event(self, arm: str, event: str, detail: Any = None) -> None:
        self.writer.append("events", {"arm": arm, "event": event, "time_utc": utc_now(), "detail": detail})

    def _launch(self, arm: str) -> tuple[Engine | None, EngineInfo | None, BaseException | None]:
        """Create and start one arm's engine; never raises (the caller records the outcome).
        An engine with processes of its own has each one recorded as it starts and once it is
        stopped (:func:`bistat.run.leftovers.server_event`), not after the start: a run killed
        while its server loads leaves that server in the records."""
        engine: Engine | None = None
        try:
            engine = self.engine_factory(self.experiment, self.arms[arm])
            if isinstance(engine, ServerProcesses):
                engine.report_processes(
                    lambda process, arm=arm: self.writer.append("events", server_event(arm, process)))
            return engine, engine.start(), None
        except BaseException as exc:  # recorded and re-raised by start
            return engine, None, exc

    def start(self, arms: Sequence[str], block: int) -> None:
        """Start the block's engines at once and record the outcomes in arm order.

        Where the kind allows (``capabilities.parallel_start``) the starts run in parallel threads;
        the records (events, environment) are written afterwards in the
        block's arm order, so a run directory does not depend on which start finished first.
        When a start fails, the engines that did start are stopped and the run is *untested*.
        """
        if len(arms) == 1 or not capabilities(self.experiment.engine.kind).parallel_start:
            launched = [self._launch(arm) for arm in arms]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(arms),
                                                       thread_name_prefix="bistat-start") as pool:
                launched = list(pool.map(self._launch, arms))
        failure: BaseException | None = None
        for arm, (engine, info, exc) in zip(arms, launched):
            if exc is None and failure is None:
                assert engine is not None and info is not None
                self._record_started(arm, block, engine, info)
                continue
            if exc is None:  # started, but an earlier arm failed: stop it, record nothing
                assert engine is not None
                self._stop_quietly(arm, engine)
                continue
            if engine is not None:
                self._stop_quietly(arm, engine)
            said = self.cite_kept(str(exc))
            if isinstance(exc, EngineRefused):
                self.event(arm, "refused", said)
                failure = failure or _Untested(f"engine for arm {arm!r} refused the setting: {said}")
            elif isinstance(exc, EngineError):
                self.event(arm, "start_failed", f"{type(exc).__name__}: {said}")
                what = "could not be created" if engine is None else "failed to start"
                failure = failure or _Untested(f"engine for arm {arm!r} {what}: {said}")
            elif engine is None and isinstance(exc, (ValueError, TypeError)):
                # the adapter refused the declaration's arguments (a registration sealed before
                # register checked them): a refusal, not a defect
                self.event(arm, "refused", f"{type(exc).__name__}: {exc}")
                failure = failure or _Untested(f"engine for arm {arm!r} could not be created "
                                               f"from the declaration: {exc}")
            else:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _record_started(self, arm: str, block: int, engine: Engine, info: EngineInfo) -> None:
        self.running[arm] = engine
        self.event(arm, "started", f"block {block}; {info.kind} {info.version}" + (f" ({info.commit})" if info.commit else ""))
        fingerprint = self._fingerprint(arm, engine)
        gpus = fingerprint.get("gpus") if isinstance(fingerprint, dict) else None
        self.gpu_uuids[arm] = tuple(str(g["uuid"]) for g in gpus or ()
                                    if isinstance(g, dict) and g.get("uuid"))
        self.writer.append(
            "environment",
            {
                "arm": arm,
                "block": block,
                "fingerprint": fingerprint,
                "engine": {
                    "kind": info.kind,
                    "version": info.version,
                    "commit": info.commit,
                    "args": info.args,
                    "env": info.env,
                },
                "log_findings": list(info.log_findings),
                **({"modes": dict(info.modes)} if info.modes else {}),
            },
        )

    def _fingerprint(self, arm: str, engine: Engine) -> dict[str, Any]:
        """The engine's fingerprint (:func:`~bistat.run.fingerprint.engine_fingerprint`)."""
        return engine_fingerprint(engine, self.arms[arm].env)

    def _keep_log(self, arm: str, engine: Engine) -> None:
        """Copy a stopped engine's server log (engines with a ``log_path``) into the run
        directory, gzipped, as ``engine-logs/ARM-N.log.gz`` (N counts this arm's starts); a log
        the adapter wrote to a temporary file of its own (``log_temporary``) is removed once
        kept, and the run's messages name the copy (:meth:`cite_kept`)."""
        src = getattr(engine, "log_path", None)
        if src is None or not Path(src).is_file():
            return
        if self.writer.lost() is not None:   # not into whatever now has the run directory's name
            self.event(arm, "exited", f"server log {src} not kept: the run directory is lost")
            return
        dest_dir = self.writer.run_dir / ENGINE_LOGS_DIR
        try:
            dest_dir.mkdir(exist_ok=True)
            n = 1 + sum(1 for _ in dest_dir.glob(f"{arm}-*.log.gz"))
            dest = dest_dir / f"{arm}-{n}.log.gz"
            with open(src, "rb") as fin, gzip.open(dest, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        except OSError as exc:  # a lost log must not lose the run
            self.event(arm, "exited", f"server log {src} not kept: {exc}")
            return
        self.kept_logs[str(src)] = str(dest)
        if getattr(engine, "log_temporary", False):
            Path(src).unlink(missing_ok=True)

    def _stop_quietly(self, arm: str, engine: Engine) -> bool:
        """Stop ``engine`` and keep its log; a failed stop is an ``exited`` event. True if it
        stopped cleanly."""
        try:
            engine.stop()
        except EngineError as exc:
            self.event(arm, "exited", f"stop failed: {exc}")
            self._keep_log(arm, engine)
            return False
        self._keep_log(arm, engine)
        return True

    def stop(self, arm: str) -> None:
        if self._stop_quietly(arm, self.running.pop(arm)):
            self.event(arm, "stopped")

    def stop_all(self) -> None:
        for arm in list(self.running):
            self.stop(arm)


    def discard(self, arm: str, engine: Engine) -> None:
        """An engine that failed during a pass: stopped (its log kept), no ``stopped`` event."""
        self.running.pop(arm, None)
        self._stop_quietly(arm, engine)
