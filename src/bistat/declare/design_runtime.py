"""The design analysis's run-time estimate: an earlier run (``design.cv_from``) times the declared
run (:func:`timing_from_run`, :func:`estimate_duration`).

Its engine starts (``events.jsonl``, ``run.json``) and passes (``passes.jsonl``) are applied to the
declaration's own schedule (:func:`bistat.core.schedule.plan_schedule`). A run must finish on one
machine (its same-GPU validity check), so a run estimated over ``design.time_budget_s`` is warned
about, with the ``workload.passes`` that fits; so are arms' engines that may not fit one GPU
together and engine restarts that a cost rule would read as the arms' speed.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat.core.schedule import Block, plan_schedule
from bistat.declare.design_cv import DesignError, read_strict
from bistat.declare.experiment import DeclarationError, Experiment, validate_experiment
from bistat.store.enginelog import CompileCache, compile_cache, kept_logs
from bistat.store.format import RecordsError, parse_time
from bistat.store.readers import read_header

__all__ = [
    "DurationEstimate",
    "RunTiming",
    "concurrency_warnings",
    "duration_lines",
    "duration_warnings",
    "engine_start_warnings",
    "estimate_duration",
    "timing_from_run",
]


@dataclass(frozen=True)
class RunTiming:
    """How long an earlier run's engine starts and passes took (:func:`timing_from_run`).

    ``first_starts``: in seconds, each start of an engine group that starts an arm for the first
    time in the run (its engine compiles; with the engines up together, the one start of them
    all), timed from ``run.json``'s ``created_utc`` for the run's first start, else from the end
    of the previous block; ``restarts``: every later start, from the end of the previous block's
    last pass (so the previous engine's stop is included) to the ``started`` event.
    ``pass_wall_s``: the ``wall_s`` of each complete pass, per arm. ``engines_concurrent``: as
    ``run.json`` records it (else whether an engine group held several engines; None when
    unknown). ``notes``: what could not be timed, and why. ``first_start_engines``: the engines
    each of ``first_starts`` started (the arms of its group). ``first_start_caches``: per arm whose
    first start's kept log (``engine-logs/ARM-1.log.gz``) says how its torch.compile went, from
    vLLM's compile cache or compiled (:func:`bistat.store.enginelog.compile_cache`).
    ``warm_first_starts``: the arms whose first start loaded all its compiled code from a cache
    that no start of the run had compiled into: what an earlier engine left on that machine,
    which a fresh machine lacks (a start that loads what another arm's start of the run compiled
    is not among them: a run on a fresh machine does the same).
    """

    run_dir: str
    first_starts: tuple[float, ...]
    restarts: tuple[float, ...]
    pass_wall_s: tuple[tuple[str, tuple[float, ...]], ...]
    engines_concurrent: bool | None
    engine_starts: int
    notes: tuple[str, ...] = ()
    first_start_engines: tuple[int, ...] = ()
    first_start_caches: tuple[tuple[str, CompileCache], ...] = ()
    warm_first_starts: tuple[str, ...] = ()

    @property
    def first_start_per_engine_s(self) -> float | None:
        """The median of the first starts, each over the engines it started: what one engine's
        start took where the engines start one at a time (None: none timed, or the engines
        are not known)."""
        if not self.first_starts or len(self.first_start_engines) != len(self.first_starts):
            return None
        return statistics.median(f / k for f, k in zip(self.first_starts,
                                                       self.first_start_engines))

    @property
    def first_start_s(self) -> float | None:
        """The median of the first starts (None: none timed)."""
        return statistics.median(self.first_starts) if self.first_starts else None

    @property
    def restart_s(self) -> float | None:
        """The median of the restarts; with fewer than two, of all starts timed (a first start
        compiles, so it is left out only when two restarts or more give a median without it)."""
        if len(self.restarts) >= 2:
            return statistics.median(self.restarts)
        starts = self.restarts + self.first_starts
        return statistics.median(starts) if starts else None

    @property
    def n_passes(self) -> int:
        return sum(len(v) for _, v in self.pass_wall_s)

    def pass_s(self, arm: str) -> float | None:
        """The median ``wall_s`` of ``arm``'s passes; of all the run's passes when the run has
        no pass of that arm (None: no pass timed)."""
        by_arm = dict(self.pass_wall_s)
        if by_arm.get(arm):
            return statistics.median(by_arm[arm])
        every = [x for _, v in self.pass_wall_s for x in v]
        return statistics.median(every) if every else None


@dataclass(frozen=True)
class DurationEstimate:
    """The declared run's wall time, estimated from an earlier run (:func:`estimate_duration`).

    The schedule is the declaration's own (:func:`bistat.core.schedule.plan_schedule`):
    ``engine_starts`` engine starts, ``first_starts`` of them an arm's first (its engine compiles;
    with the engines up together, the one start of them all), and ``passes`` passes, warm-ups
    included. ``seconds`` = ``first_starts`` × ``first_start_s`` + the other starts ×
    ``restart_s`` + each planned pass at its arm's median (``pass_s_by_arm``; ``pass_s`` is the
    mean per planned pass). ``seconds`` is None when nothing could be timed, or no earlier run was
    named (``source`` says so); ``lower_bound``: part of it could not be timed and is left out,
    or a shorter figure stands in (``notes`` say which). ``fits``: within ``budget_s`` (None: no
    budget, no estimate, or a lower bound within it); ``max_passes``: the largest
    ``workload.passes`` whose re-planned schedule fits when this one does not (None: none does,
    or it fits); ``max_passes_s`` its estimate; ``together_s``: the estimate with the arms'
    engines up together (for plans of one engine at a time).
    """

    seconds: float | None
    engines_concurrent: bool
    engine_starts: int
    first_starts: int
    passes: int
    first_start_s: float | None
    restart_s: float | None
    pass_s: float | None
    pass_s_by_arm: tuple[tuple[str, float], ...]
    source: str
    budget_s: float | None = None
    fits: bool | None = None
    max_passes: int | None = None
    max_passes_s: float | None = None
    together_s: float | None = None
    lower_bound: bool = False
    notes: tuple[str, ...] = ()
    #: engines priced per start of the engines together (one first start each, when the earlier
    #: run started one engine at a time: parallel starts contend; or when the engine kind starts
    #: its engines one at a time); 1 otherwise
    engines_per_start: int = 1
    #: why a start is priced per engine, in words (None: it is not)
    start_basis: str | None = None


#: ``events.jsonl`` events that end an engine's life (:mod:`bistat.run.runner`); a failed
#: start (``refused``, ``start_failed``) ends a group of starts too.
_ENGINE_ENDS = ("stopped", "exited")


_START_ENDS = _ENGINE_ENDS + ("refused", "start_failed")


def _time(value: Any, path: Path, line: int | None, key: str) -> dt.datetime:
    try:
        return parse_time(value)
    except (TypeError, ValueError):
        where = f"{path}:{line}" if line is not None else str(path)
        raise DesignError(f"design.cv_from: {where}: {key} {value!r} is not an ISO 8601 time; "
                          "the run's records are damaged") from None


def _wall_s(rec: dict[str, Any]) -> float | None:
    value = rec.get("wall_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def timing_from_run(run_dir: str | Path) -> RunTiming:
    """How long an earlier run's engine starts and passes took (see :class:`RunTiming`).

    Reads ``passes.jsonl`` (complete passes' ``wall_s``, ``arm``; ``started_utc`` for where each
    block's last pass ended), ``events.jsonl`` (``started`` / ``stopped`` / ``exited`` with
    ``time_utc``: ``started`` is written when an engine is ready, just before its block's first
    pass) and ``run.json`` (``created_utc``, ``engines_concurrent``). Consecutive ``started``
    events are one start of an engine group (the engines up together start at once), timed to
    its last ``started``. A start is timed from the end of the previous block's last pass, or,
    where no pass of that block is recorded, from the previous engine's ``stopped`` (or
    ``exited``); the run's first from ``created_utc``. A missing file leaves what it would time
    untimed, and :attr:`RunTiming.notes` say so; a resumed run's pause counts as one restart
    (the median keeps one from mattering).

    Raises
    ------
    DesignError
        A line that is not JSON (but a truncated last line, which is ignored), a ``run.json``
        that is not a JSON object, or a time that is not ISO 8601; the message names the file.
    """
    run_dir = Path(run_dir)
    notes: list[str] = []
    passes_path = run_dir / "passes.jsonl"
    if not passes_path.is_file():
        notes.append(f"no {passes_path}: the passes are not timed")
    walls: dict[str, list[float]] = {}
    pass_ends: list[dt.datetime] = []
    for line, rec in read_strict(passes_path):
        wall = _wall_s(rec)
        if wall is None:
            continue
        if rec.get("started_utc") is not None:
            pass_ends.append(_time(rec["started_utc"], passes_path, line, "started_utc")
                             + dt.timedelta(seconds=wall))
        if rec.get("status") == "complete":
            walls.setdefault(str(rec.get("arm")), []).append(wall)
    if passes_path.is_file() and not walls:
        notes.append(f"{passes_path} records no complete pass with its wall_s: the passes are "
                     "not timed")

    created: dt.datetime | None = None
    concurrent: bool | None = None
    run_json = run_dir / "run.json"
    if run_json.is_file():
        try:
            meta = read_header(run_dir)
        except (RecordsError, UnicodeDecodeError) as exc:
            raise DesignError(f"design.cv_from: {exc}; the run's records are damaged") from None
        if meta.get("created_utc") is not None:
            created = _time(meta["created_utc"], run_json, None, "created_utc")
        else:
            notes.append(f"{run_json} has no created_utc: the run's first engine start is not "
                         "timed")
        if isinstance(meta.get("engines_concurrent"), bool):
            concurrent = meta["engines_concurrent"]
    else:
        notes.append(f"no {run_json} (created_utc): the run's first engine start is not timed")

    events_path = run_dir / "events.jsonl"
    groups: list[dict[str, Any]] = []   # one start of an engine group each
    current: dict[str, Any] | None = None
    last_end: dt.datetime | None = None
    for line, rec in read_strict(events_path):
        event = rec.get("event")
        if event == "started":
            t = _time(rec.get("time_utc"), events_path, line, "time_utc")
            if current is None:
                current = {"first": t, "arms": [], "engine_end": last_end}
                groups.append(current)
            current["last"] = t
            current["arms"].append(str(rec.get("arm")))
        elif event in _START_ENDS:
            current = None
            if event in _ENGINE_ENDS:
                last_end = _time(rec.get("time_utc"), events_path, line, "time_utc")
    if not events_path.is_file():
        notes.append(f"no {events_path}: the engine starts are not timed")
    elif not groups:
        notes.append(f"{events_path} records no engine start: the engine starts are not timed")

    firsts: list[float] = []
    first_engines: list[int] = []
    restarts: list[float] = []
    seen: set[str] = set()
    previous: dt.datetime | None = None     # the previous group's last "started"
    for i, group in enumerate(groups):
        if i == 0:
            since = created
        else:
            ends = [e for e in pass_ends if previous < e <= group["first"]]
            engine_end = group["engine_end"]
            since = max(ends) if ends else (engine_end if engine_end is not None
                                            and engine_end >= previous else None)
        first = any(arm not in seen for arm in group["arms"])
        seen.update(group["arms"])
        previous = group["last"]
        if since is None or group["last"] < since:
            continue
        (firsts if first else restarts).append((group["last"] - since).total_seconds())
        if first:
            first_engines.append(len(group["arms"]))
    if concurrent is None and groups:
        concurrent = any(len(g["arms"]) > 1 for g in groups)
    caches, warm = _first_start_caches(run_dir)
    return RunTiming(str(run_dir), tuple(firsts), tuple(restarts),
                     tuple((arm, tuple(v)) for arm, v in walls.items()), concurrent,
                     len(groups), tuple(notes), tuple(first_engines), caches, warm)


def _first_start_caches(run_dir: Path) -> tuple[tuple[tuple[str, CompileCache], ...],
                                                tuple[str, ...]]:
    """Each arm's first start's compile cache (where its log says), and the arms whose first
    start found the cache warm from outside the run (see :class:`RunTiming`)."""
    every = [(arm, n, compile_cache(text)) for arm, starts in kept_logs(run_dir).items()
             for n, text in starts.items()]
    compiled_here = {key for _, _, c in every if c is not None and c.compiled for key in c.keys}
    firsts = tuple((arm, c) for arm, n, c in every if n == 1 and c is not None)
    warm = tuple(arm for arm, c in firsts if c.warm and not set(c.keys) & compiled_here)
    return firsts, warm


def _warm_cache_note(timing: RunTiming) -> str:
    """Why an estimate timed from first starts that found vLLM's compile cache warm is a lower
    bound, with what compiling took where the earlier run did compile."""
    warm = timing.warm_first_starts
    compiled = [(arm, c.compile_s) for arm, c in timing.first_start_caches if c.compiled]
    took = ("; where it did compile, compiling took " + ", ".join(
        f"{arm} {s:.0f} s" for arm, s in compiled)) if compiled else ""
    return (f"the earlier run's first start{'s' if len(warm) > 1 else ''} of {', '.join(warm)} "
            "loaded torch.compile's output from vLLM's compile cache (engine-logs/ARM-1.log.gz: "
            "'Directly load ...') that no engine of that run had compiled: an earlier engine "
            "left it on that machine. On a machine without it, a fresh one, each compiled "
            "engine compiles at its first start, which "
            f"this estimate does not price (it is a lower bound){took}")


def _schedule(exp: Experiment, passes: int, concurrent: bool) -> tuple[Block, ...]:
    wl = exp.workload
    return plan_schedule([a.name for a in exp.arms], passes=passes,
                         warmup_passes=wl.warmup_passes, order=wl.order, seed=wl.seed,
                         engines_concurrent=concurrent)


def _counts(blocks: tuple[Block, ...], concurrent: bool) -> tuple[int, int, list[str]]:
    """(engine starts, first starts, the arm of each planned pass)."""
    arms = [p.arm for b in blocks for p in b.passes]
    if concurrent:
        return len(blocks), len(blocks), arms
    seen: set[str] = set()
    firsts = 0
    for b in blocks:
        firsts += any(arm not in seen for arm in b.arms)
        seen.update(b.arms)
    return len(blocks), firsts, arms


def _refuses_passes(exp: Experiment, passes: int) -> str | None:
    """Why the declaration with ``workload.passes = passes`` would be refused (None: it would
    not be; e.g. a cost rule needs 2 counted passes per arm)."""
    data = exp.resolved()
    data["workload"]["passes"] = passes
    try:
        validate_experiment(data, source="")
    except DeclarationError as exc:
        return exc.messages[0].removeprefix(": ") if exc.messages else str(exc)
    return None


def estimate_duration(exp: Experiment, timing: RunTiming | None,
                      concurrent: bool | None = None) -> DurationEstimate:
    """Estimate the declared run's wall time from an earlier run's timing.

    Plans the declaration's schedule (:func:`bistat.core.schedule.plan_schedule`, with
    ``engine.engines_concurrent`` resolved as ``bistat run`` resolves it:
    :func:`bistat.declare.concurrency.resolve_engines_concurrent`) and prices it (see
    :class:`DurationEstimate`): each arm's first start at the earlier run's median first start,
    every other at its median restart, each pass at the median ``wall_s`` of its arm's passes
    there (of all its passes for an arm it lacks). The final engine stop and the writing of the
    run's tables after its last pass are not included.

    Where the engine kind starts its engines one at a time (``capabilities(kind).parallel_start``
    false: each vLLM engine sizes its KV cache from the GPU memory free when it starts), a start
    takes about as long as the engines it starts, so it is priced per engine: each of the earlier
    run's first starts over the engines it started, times the engines each planned start starts.
    On vLLM 0.34.0, h200-v034-match-smollm2's five vllm-server engines took 569 s to start, where
    the 0.33.0 run's four (h200-v033-match-smollm2) had taken 492 s: 123 s per engine prices five
    at 615 s, where the start of four as a whole priced them at 492 s.

    Parameters
    ----------
    exp : Experiment
        The declaration (``design.time_budget_s`` is the budget).
    timing : RunTiming or None
        The earlier run's timing (:func:`timing_from_run`); None: no run named, no estimate
        (the planned starts and passes are still counted).
    concurrent : bool, optional
        Whether the engines stay up together (default: resolved from the declaration).
    """
    if concurrent is None:
        from bistat.declare.concurrency import resolve_engines_concurrent
        concurrent, _ = resolve_engines_concurrent(exp)
    budget = exp.design.time_budget_s
    wl = exp.workload
    blocks = _schedule(exp, wl.passes, concurrent)
    n_starts, n_firsts, pass_arms = _counts(blocks, concurrent)
    if timing is None:
        return DurationEstimate(None, concurrent, n_starts, n_firsts, len(pass_arms), None,
                                None, None, (), "no earlier run to time it from: design.cv_from "
                                "names none", budget)

    notes = list(timing.notes)
    lower = False
    first_s, restart_s = timing.first_start_s, timing.restart_s
    if first_s is None and restart_s is not None:
        first_s, lower = restart_s, True
        notes.append("no first engine start is timed: a restart's time stands in for it (the "
                     "estimate is a lower bound)")
    elif n_starts > n_firsts and first_s is not None and len(timing.restarts) < 2:
        notes.append("the earlier run restarted no engine: its first start stands in for a "
                     "restart" if not timing.restarts else "the earlier run timed one restart: "
                     "its first starts join the restart's median")
    if first_s is None:
        lower = True
    if timing.warm_first_starts and first_s is not None:
        lower = True
        notes.append(_warm_cache_note(timing))
    # a kind whose engines start one at a time: a start is priced per engine it starts
    from bistat.engines.registry import capabilities
    per_engine_s = (timing.first_start_per_engine_s
                    if not capabilities(exp.engine.kind).parallel_start else None)
    scaled = (per_engine_s is not None and first_s is not None
              and max(timing.first_start_engines) > 1)
    basis = None
    if scaled:
        k = max(timing.first_start_engines)
        basis = (f"{exp.engine.kind} engines start one at a time (each sizes its KV cache from "
                 f"the GPU memory free when it starts): the earlier run's start of {k} engines, "
                 f"{_secs(timing.first_starts[timing.first_start_engines.index(k)])}, is "
                 f"{per_engine_s:.1f} s per engine")
        if not concurrent:   # (one engine per start here; a start of them all says it itself)
            notes.append(f"{basis}; each start here, of one engine, is priced at that")
        first_s = per_engine_s
        if len(timing.restarts) < 2:    # the restart's median would take the whole group's start
            restart_s = statistics.median(
                list(timing.restarts) + [f / n for f, n in zip(timing.first_starts,
                                                               timing.first_start_engines)])
    elif timing.engines_concurrent is True and not concurrent:
        notes.append("the earlier run kept its engines up together: the start of them all "
                     "stands in for one engine's")
    elif timing.engines_concurrent is False and concurrent:
        notes.append("the earlier run started one engine at a time: the start of the engines "
                     "together is priced as one engine's first start per engine (their starts "
                     "run in parallel but contend: vLLM 0.25.0's three engines took 299 s "
                     "together, against about 100 s for one alone), and each pass at its time "
                     "with one engine up; both can be short: on vLLM 0.34.0 two compiled Qwen3-8B "
                     "engines took about 245 s together against 2 x 105 s priced, and passes "
                     "7.87 s against 7.0 s (median; data/h200-v034/device/session4/"
                     "lost-run-progress.txt), 12 % over the estimate in all: leave that margin")

    arm_names = [a.name for a in exp.arms]
    by_arm = {arm: timing.pass_s(arm) for arm in arm_names}
    recorded = {arm for arm, v in timing.pass_wall_s if v}
    absent = [arm for arm in arm_names if arm not in recorded]
    if recorded and absent:
        notes.append(f"arm{'s' if len(absent) > 1 else ''} {', '.join(absent)} not in the "
                     "earlier run: the median of all its passes stands in")
    if not recorded:
        lower = True

    # a start of several engines together, timed from a run of one engine at a time: one first
    # start per engine (see the note above)
    per_engine = timing.engines_concurrent is False

    def seconds(blocks: tuple[Block, ...], together: bool) -> float | None:
        starts, firsts, arms = _counts(blocks, together)
        parts: list[float] = []
        if first_s is not None and together and (per_engine or scaled):
            parts.append(sum(len(b.arms) for b in blocks) * first_s)
        elif first_s is not None:
            parts.append(firsts * first_s + (starts - firsts) * (restart_s or first_s))
        if recorded:
            parts.append(sum(by_arm[arm] for arm in arms))  # type: ignore[misc]
        return math.fsum(parts) if parts else None

    total = seconds(blocks, concurrent)
    pass_s = (sum(by_arm[arm] for arm in pass_arms) / len(pass_arms)  # type: ignore[misc]
              if recorded and pass_arms else None)
    together_s = (seconds(_schedule(exp, wl.passes, True), True)
                  if not concurrent and total is not None else None)
    fits: bool | None = None
    max_passes: int | None = None
    max_s: float | None = None
    if budget is not None and total is not None:
        if total > budget:
            fits = False
        elif not lower:        # a lower bound within the budget does not tell
            fits = True
        if fits is False:
            for k in range(wl.passes - 1, 0, -1):
                got = seconds(_schedule(exp, k, concurrent), concurrent)
                if got is not None and got <= budget:
                    refused = _refuses_passes(exp, k)
                    if refused is None:
                        max_passes, max_s = k, got
                    else:   # the declaration's lower bounds on passes: fewer are refused too
                        notes.append(f"workload.passes = {k} would fit (about {_secs(got)}), "
                                     f"but the declaration refuses it: {refused}")
                    break
    n_timed = timing.n_passes
    source = (f"{timing.run_dir} ({n_timed} pass{'es' if n_timed != 1 else ''}, "
              f"{timing.engine_starts} engine start{'s' if timing.engine_starts != 1 else ''})")
    return DurationEstimate(
        total, concurrent, n_starts, n_firsts, len(pass_arms), first_s,
        restart_s if n_starts > n_firsts else None, pass_s,
        tuple((arm, v) for arm, v in by_arm.items() if v is not None), source, budget, fits,
        max_passes, max_s, together_s, lower and total is not None, tuple(notes),
        max((len(b.arms) for b in blocks), default=1) if concurrent and (per_engine or scaled)
        else 1,
        basis if scaled else ("the earlier run started one at a time" if concurrent and per_engine
                              else None))


def _secs(x: float) -> str:
    return f"{x:,.0f} s"


def _starts_text(d: DurationEstimate) -> str:
    """The engine starts of an estimate, in words (for its warning)."""
    n = d.engine_starts
    what = f"{n} engine start{'s' if n != 1 else ''}"
    if d.first_start_s is None:
        return f"{what}, not timed"
    if d.engines_concurrent:
        if d.engines_per_start > 1:
            return (f"{what} of all the arms' engines: {d.engines_per_start} x "
                    f"{_secs(d.first_start_s)}, one engine's first start each")
        return f"{what} of all the arms' engines: {_secs(d.first_start_s)}"
    first = (f"the first {_secs(d.first_start_s)}" if d.first_starts == 1 else
             f"the first of each arm {_secs(d.first_start_s)}")
    if n == d.first_starts or d.restart_s is None:
        return f"{what}: {first}" if n == 1 else f"{what}: {first} each"
    return f"{what}: {first}, then {_secs(d.restart_s)} each"


def _passes_text(d: DurationEstimate) -> str:
    what = f"{d.passes} pass{'es' if d.passes != 1 else ''}"
    return f"{what}, not timed" if d.pass_s is None else f"{what} at {d.pass_s:.1f} s"


def duration_warnings(d: DurationEstimate) -> list[str]:
    """A warning when the run is estimated over ``design.time_budget_s``, naming the
    ``workload.passes`` that fits; one when a declared budget cannot be checked."""
    if d.budget_s is None:
        return []
    budget = _secs(d.budget_s)
    if d.seconds is None:
        why = (f"{d.source} times neither its engine starts nor its passes "
               f"({'; '.join(d.notes)})" if d.notes else
               "name an earlier run of this setup in design.cv_from (it then gives the CV too, "
               "in place of design.expected_cv)")
        return [f"design.time_budget_s: the run's wall time is not estimated, so the budget of "
                f"{budget} is not checked: {why}"]
    at = f"{_secs(d.seconds)}{' or more' if d.lower_bound else ''}"
    how = f"{_starts_text(d)}; {_passes_text(d)}; timed from {d.source}"
    if d.fits is None:
        return [f"design.time_budget_s: cannot tell whether the run fits the budget of {budget}: "
                f"it is estimated at {at} ({how}), but part of it is not timed "
                f"({'; '.join(d.notes)})"]
    if d.fits:
        return []
    if d.max_passes is not None:
        assert d.max_passes_s is not None
        fix = (f"lower workload.passes to {'at most ' if d.lower_bound else ''}{d.max_passes} "
               f"(about {_secs(d.max_passes_s)})")
    else:
        fix = ("no workload.passes that the declaration allows fits: raise the budget, or "
               "shorten the passes (workload.n_prompts, workload.max_tokens)")
    if d.together_s is not None:
        fix += (f", or keep the arms' engines up together (engine.engines_concurrent: about "
                f"{_secs(d.together_s)}, if their GPU memory fractions allow it)")
    return [f"design.time_budget_s: the run is estimated at {at} ({how}), over the budget of "
            f"{budget}; a run must finish on one machine: {fix}"]


def concurrency_warnings(exp: Experiment) -> list[str]:
    """A warning when ``engines_concurrent = "auto"`` resolves to one engine at a time: engines
    then restart for every block of passes and the warm-ups repeat after each start, which costs
    device time and spreads an arm's passes over several engine starts."""
    from bistat.declare.concurrency import ENGINE_HEADROOM_FRACTION, resolve_engines_concurrent

    if getattr(exp.engine, "engines_concurrent", "auto") != "auto":
        return []
    together, why = resolve_engines_concurrent(exp)
    if together:
        return []
    return [f"engine.engines_concurrent ({why}): every block of passes restarts its engine and "
            "repeats the warm-ups; to keep the arms' engines up together, lower "
            "gpu_memory_utilization (engine.args or each arm's args) until the fractions plus "
            f"{ENGINE_HEADROOM_FRACTION:g} per engine add up to at most 1, or declare "
            "engines_concurrent = false to accept the restarts"]


def engine_start_warnings(exp: Experiment, speed: bool) -> list[str]:
    """A warning when a rule on speed (a cost rule or a throughput criterion) meets engines
    started one at a time: every block of passes then runs on its own engine start, the passes
    of one start share its speed, and the rule's per-pass intervals, which treat the passes as
    independent, cover less than their level when starts differ (about 89 % for 95 % in a
    simulation with start-to-start SD equal to pass-to-pass SD; tests/test_engine_starts.py)."""
    from bistat.declare.concurrency import resolve_engines_concurrent

    if not speed or exp.workload.passes < 2 or resolve_engines_concurrent(exp)[0]:
        return []
    return ["engine.engines_concurrent: one engine at a time, so the passes of each block share "
            "one engine start; the rule's speed intervals treat them as independent passes and "
            "are too narrow where starts differ (about 89 % coverage for a 95 % interval when "
            "starts vary as much as passes do). Keep the arms' engines up together "
            "(engine.engines_concurrent = true, GPU memory permitting); otherwise the finding "
            "shows the ratio with each engine start as one observation beside the rule's"]


def duration_lines(d: DurationEstimate) -> list[str]:
    """The "Run time" section of :func:`format_design`."""
    mode = "the engines up together" if d.engines_concurrent else "one engine at a time"
    plan = (f"  plan: {d.engine_starts} engine start{'s' if d.engine_starts != 1 else ''} "
            f"({mode}), {d.passes} passes (warm-ups included)")
    if d.seconds is None and not d.notes:
        return [f"Run time: not estimated ({d.source})", plan]
    lines = [f"Run time (timed from {d.source}):", plan]
    if d.first_start_s is not None and d.engines_concurrent:
        lines.append(f"  engine start: {d.first_start_s:.1f} s (all the arms' engines)"
                     if d.engines_per_start == 1 else
                     f"  engine start: {d.engines_per_start} x {d.first_start_s:.1f} s (all the "
                     "arms' engines, one engine's first start each: "
                     f"{d.start_basis or 'the earlier run started one at a time'})")
    elif d.first_start_s is not None:
        n = d.first_starts
        starts = (f"  engine starts: {n} first (one per arm: it compiles) at "
                  f"{d.first_start_s:.1f} s")
        if d.engine_starts > n and d.restart_s is not None:
            starts += (f", {d.engine_starts - n} restart{'s' if d.engine_starts - n != 1 else ''}"
                       f" at {d.restart_s:.1f} s (each from the end of the previous engine's "
                       "last pass)")
        lines.append(starts)
    if d.pass_s_by_arm:
        lines.append("  passes: " + ", ".join(f"{arm} {v:.2f} s" for arm, v in d.pass_s_by_arm)
                     + " (medians of wall_s)")
    if d.seconds is None:
        lines.append("  estimate: none")
    else:
        verdict = ""
        if d.budget_s is not None:
            verdict = {True: ", within", False: ", over", None: ", cannot tell"}[d.fits]
            verdict = f"; budget {_secs(d.budget_s)}{verdict}"
            if d.max_passes is not None:
                verdict += (f" (workload.passes = {d.max_passes} fits: about "
                            f"{_secs(d.max_passes_s or 0.0)})")
        lines.append(f"  estimate: {_secs(d.seconds)}{' or more' if d.lower_bound else ''} "
                     f"({d.seconds / 60:.1f} min){verdict}")
        if d.together_s is not None:
            lines.append(f"  with the arms' engines up together: about {_secs(d.together_s)}")
    lines.extend(f"  note: {n}" for n in d.notes)
    return lines
