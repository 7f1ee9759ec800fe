"""The design analysis of a declaration: what its plan can and cannot conclude.

Composes the primitives of ``bistat.core.design`` for every criterion of the declared rule:

- match-rate criteria (``match_lower_bound``): the smallest number of prompts for which a
  perfect match clears the threshold, the mismatches tolerated at the declared number of
  prompts, and the probability that the criterion is met at the assumed true match rate;
- throughput criteria: the expected width of the ratio interval at the declared passes and
  coefficient of variation (CV), and the probability that the criterion is met at each of a set
  of true ratios (``design.true_ratios``), with the passes per arm that would reach the power
  target where the plan falls short.

- activation criteria (issue 18): ``control_diverges`` -- the probability that the control's
  upper bound is at most its threshold at the assumed control match rate
  (``design.assumed_control_match_rate``); ``treatment_beats_control`` -- the power of each
  declared test (McNemar, Newcombe) at the two assumed rates; the probe and the engine log have
  no design figures (their power shows in the run: the probe's negative control);
- the cost rule (``[rule.cost]``): the probability of each outcome (*no measurable cost*,
  *costs*, *faster*, *undecidable*) at each true ratio and the passes per arm that would decide
  it at a true ratio of 1;
- **false verdicts**: each label's false-positive probability when there is no slowdown (true
  ratio 1, labels with a slowdown criterion) and, for *working*, in an A/A experiment (the
  treatment's mode doing nothing: both arms at one match rate, the worst over a grid of rates),
  with a warning naming the passes or prompts that bring it under the rule's alpha
  (``1 - confidence_level``) when it exceeds it.

The CV is declared (``design.expected_cv``, default 0.05) or read from an earlier run
(``design.cv_from``: the pooled pass-to-pass CV of its counted passes, per arm, from
``passes.jsonl``). Plans that cannot reach a verdict are warned about, saying what to change.

**Run time**: an earlier run (``design.cv_from``) also times the declared run
(:func:`timing_from_run`, :func:`estimate_duration`): its engine starts (``events.jsonl``,
``run.json``) and passes (``passes.jsonl``), applied to the declaration's own schedule
(:func:`bistat.core.schedule.plan_schedule`). A run must finish on one machine (its same-GPU
validity check), so a run estimated over ``design.time_budget_s`` is warned about, with the
``workload.passes`` that fits.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from bistat.core.lazy import lazy_module

_sps = lazy_module("scipy.stats")

from bistat.core import design, stats
from bistat.declare.experiment import DeclarationError, Experiment, validate_experiment
from bistat.core.schedule import Block, plan_schedule
from bistat.store.format import RecordsError, parse_time
from bistat.store.readers import iter_jsonl_strict, read_header
from bistat.core.rule import (
    ControlDiverges,
    CostRule,
    EngineLog,
    LargeDriftsAtMost,
    MatchIntervalsOverlap,
    MatchLowerBound,
    MatchUpperBound,
    ProbeConfirmed,
    Rule,
    ThroughputNotSlower,
    ThroughputRatio,
    ThroughputSlower,
    TreatmentBeatsControl,
    needs_repeat_passes,
    speed_as_evidence_warnings,
)

__all__ = [
    "DesignError",
    "MatchDesign",
    "PowerAt",
    "ThroughputDesign",
    "ActivationDesign",
    "CostDesign",
    "FalsePositive",
    "LabelProbability",
    "RunTiming",
    "DurationEstimate",
    "DesignReport",
    "analyse_design",
    "cv_from_run",
    "timing_from_run",
    "estimate_duration",
    "format_design",
]

#: Prompts searched at most when suggesting a number of prompts.
MAX_PROMPTS_SEARCHED = 1_000_000


class DesignError(ValueError):
    """The design analysis cannot be made (e.g. ``design.cv_from`` names no usable run)."""


@dataclass(frozen=True)
class MatchDesign:
    """Design figures of one match criterion (None where they do not apply)."""

    label: str
    field: str                      # e.g. "rule.labels[0].all[0]"
    criterion: str
    description: str
    threshold: str
    n_prompts: int
    min_prompts: int | None          # prompts for a perfect match to clear it
    mismatches_tolerated: int | None  # at n_prompts; -1: even a perfect match falls short
    assumed_match_rate: float
    prob_met: float | None           # at the assumed match rate
    note: str | None = None


@dataclass(frozen=True)
class PowerAt:
    """P(criterion met) at one true ratio; ``holds``: the criterion is true at that ratio."""

    true_ratio: float
    prob_met: float | None
    holds: bool
    passes_for_target: int | None = None  # passes per arm reaching the power target (if short)


@dataclass(frozen=True)
class ThroughputDesign:
    """Design figures of one throughput criterion."""

    label: str
    field: str
    criterion: str
    description: str
    threshold: str
    passes_per_arm: int
    cv: float
    halfwidth_log: float | None      # expected half-width of the log-ratio interval
    interval_factor: float | None    # exp(halfwidth_log): interval ratio ×/÷ factor
    power: tuple[PowerAt, ...]
    note: str | None = None


@dataclass(frozen=True)
class ActivationDesign:
    """Design figures of one activation criterion: P(met) at the assumed match rates.

    ``tests``: ``(test, P(met))`` for each test of ``treatment_beats_control`` (``"mcnemar"``,
    ``"newcombe"``); ``prob_met`` is the criterion's (for two tests: the smaller, a bound, with
    ``require = "both"``; their sum capped at 1 with ``"either"``). ``prompts_for_target``: the
    prompts that would reach the power target when short (None: not short, or none would).
    """

    label: str
    field: str
    criterion: str
    description: str
    threshold: str
    n_prompts: int
    assumed_match_rate: float
    assumed_control_match_rate: float
    prob_met: float | None
    tests: tuple[tuple[str, float], ...] = ()
    prompts_for_target: int | None = None
    note: str | None = None


@dataclass(frozen=True)
class CostDesign:
    """Design figures of the cost rule: the probability of each outcome at each true ratio.

    ``outcomes``: ``(true ratio, {outcome: probability})``; ``passes_to_decide``: ``(true ratio,
    passes per arm that decide it with the power target's probability, None if none up to 200)``.
    """

    description: str
    metric: str
    margin: float
    confidence_level: float
    passes_per_arm: int
    cv: float
    interval_factor: float | None
    outcomes: tuple[tuple[float, dict[str, float]], ...]
    passes_to_decide: tuple[tuple[float, int | None], ...]


@dataclass(frozen=True)
class FalsePositive:
    """A label's probability of being met when what it asserts is false.

    ``scenario``: ``"no slowdown"`` (true ratio 1, the assumed match rates) or ``"A/A"`` (the
    treatment's mode does nothing: both arms at ``match_rate``, true ratio 1; the worst rate of
    the grid). ``prob`` is exact or an upper bound (``bound``); ``fix`` what brings it under
    alpha when it exceeds it.
    """

    label: str
    scenario: str
    match_rate: float | None
    prob: float
    bound: bool
    alpha: float
    fix: str | None = None

    @property
    def exceeds(self) -> bool:
        return self.prob > self.alpha


@dataclass(frozen=True)
class LabelProbability:
    """P(label's criteria all met) at a true ratio, when the criteria are independent."""

    label: str
    true_ratio: float
    prob: float | None
    note: str | None = None


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
    unknown). ``notes``: what could not be timed, and why.
    """

    run_dir: str
    first_starts: tuple[float, ...]
    restarts: tuple[float, ...]
    pass_wall_s: tuple[tuple[str, tuple[float, ...]], ...]
    engines_concurrent: bool | None
    engine_starts: int
    notes: tuple[str, ...] = ()

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
    #: run started one engine at a time: parallel starts contend); 1 otherwise
    engines_per_start: int = 1


@dataclass(frozen=True)
class DesignReport:
    """The whole design analysis of one declaration."""

    name: str
    n_prompts: int
    passes_per_arm: int
    cv: float
    cv_source: str
    confidence_level: float
    alternative: str
    assumed_match_rate: float
    true_ratios: tuple[float, ...]
    power_target: float
    match: tuple[MatchDesign, ...]
    throughput: tuple[ThroughputDesign, ...]
    labels: tuple[LabelProbability, ...]
    other: tuple[str, ...]
    warnings: tuple[str, ...]
    activation: tuple[ActivationDesign, ...] = ()
    cost: CostDesign | None = None
    false_positives: tuple[FalsePositive, ...] = ()
    assumed_control_match_rate: float | None = None
    duration: DurationEstimate | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (stored in the registration)."""
        data = asdict(self)
        for key in ("true_ratios", "match", "throughput", "labels", "other", "warnings",
                    "activation", "cost", "false_positives", "duration"):
            data[key] = json.loads(json.dumps(data[key]))
        return data


# --------------------------------------------------------------------------------------------


def _read_strict(path: Path) -> tuple[tuple[int, dict[str, Any]], ...]:
    """The records of an earlier run's JSONL file (:func:`iter_jsonl_strict`): damage is a
    :class:`DesignError` naming the file and line. One design analysis asks for ``passes.jsonl``
    three times (the CV, the paired CV, the timing): the file is read once while its size and
    modification time stay the same (the records are shared; nothing here changes them)."""
    try:
        st = path.stat()
    except OSError:
        return _read_strict_once(str(path), None, None)
    return _read_strict_once(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read_strict_once(path: str, mtime_ns: int | None, size: int | None
                      ) -> tuple[tuple[int, dict[str, Any]], ...]:
    try:
        return tuple(iter_jsonl_strict(Path(path)))
    except RecordsError as exc:
        raise DesignError(f"design.cv_from: {exc}") from None


def cv_from_run(run_dir: str | Path) -> tuple[stats.CVResult, str]:
    """Pooled pass-to-pass CV of an earlier run's counted passes, grouped by arm.

    Reads ``passes.jsonl`` (lines with ``kind == "counted"``, field ``output_tokens_per_s``,
    grouped by ``arm``); a truncated last line is ignored.

    Returns
    -------
    (stats.CVResult, str)
        The pooled CV and a description of where it came from.
    """
    path = Path(run_dir) / "passes.jsonl"
    if not path.is_file():
        raise DesignError(f"design.cv_from: {run_dir}: no passes.jsonl there; name a run "
                          "directory of an earlier run, or declare design.expected_cv instead")
    groups: dict[str, list[float]] = {}
    recs = [rec for _, rec in _read_strict(path)]
    for rec in recs:
        if rec.get("kind") != "counted":
            continue
        value = rec.get("output_tokens_per_s")
        if isinstance(value, (int, float)) and value > 0:
            groups.setdefault(str(rec.get("arm")), []).append(float(value))
    try:
        res = stats.pooled_cv(list(groups.values()))
    except ValueError as exc:
        raise DesignError(f"design.cv_from: {path}: {exc}; declare design.expected_cv "
                          "instead") from exc
    n = sum(len(v) for v in groups.values())
    return res, (f"pooled from {run_dir} ({n} counted passes in {len(groups)} arms, "
                 f"{res.df} degrees of freedom)")


def paired_cv_from_run(run_dir: str | Path) -> tuple[float, str] | None:
    """The per-pass CV that plans a paired cost interval (``[rule.cost] interval = "paired"``),
    from an earlier run of two arms: the standard deviation of the log differences of its passes
    paired by pass index, over ``sqrt(2)``, as a CV (``sqrt(expm1(s**2))``, the inverse of
    :func:`bistat.core.design.log_sd_from_cv`): the per-arm CV at which two independent arms'
    passes would differ as much, which is what the paired planning of
    :func:`bistat.core.design.cost_outcome_probabilities` takes (with the paired t's ``n - 1``
    degrees of freedom). None when the run does not have exactly two arms with three or more
    passes of the same index."""
    path = Path(run_dir) / "passes.jsonl"
    by_arm: dict[str, dict[int, float]] = {}
    for _, rec in _read_strict(path):
        value, index = rec.get("output_tokens_per_s"), rec.get("pass_index")
        if (rec.get("kind") == "counted" and rec.get("status", "complete") == "complete"
                and isinstance(value, (int, float)) and value > 0 and isinstance(index, int)):
            by_arm.setdefault(str(rec.get("arm")), {})[index] = float(value)
    if len(by_arm) != 2:
        return None
    (a, va), (b, vb) = sorted(by_arm.items())
    common = sorted(set(va) & set(vb))
    if len(common) < 3:
        return None
    diffs = [math.log(va[k]) - math.log(vb[k]) for k in common]
    sd = statistics.stdev(diffs)
    cv = math.sqrt(math.expm1((sd / math.sqrt(2.0)) ** 2))
    return cv, (f"{len(common)} pass pairs of {run_dir} ({a} / {b}), the SD of their log "
                f"differences {sd:.4f} over sqrt(2), as a CV: {cv:.4f}")


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
    for line, rec in _read_strict(passes_path):
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
    for line, rec in _read_strict(events_path):
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
    if concurrent is None and groups:
        concurrent = any(len(g["arms"]) > 1 for g in groups)
    return RunTiming(str(run_dir), tuple(firsts), tuple(restarts),
                     tuple((arm, tuple(v)) for arm, v in walls.items()), concurrent,
                     len(groups), tuple(notes))


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
    if timing.engines_concurrent is True and not concurrent:
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
        if first_s is not None and together and per_engine:
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
        max((len(b.arms) for b in blocks), default=1) if concurrent and per_engine else 1)


def analyse_design(exp: Experiment, *, base_dir: str | Path | None = None) -> DesignReport:
    """Design analysis of a declaration (see the module docstring).

    Parameters
    ----------
    exp : Experiment
        The declaration.
    base_dir : path, optional
        Directory ``design.cv_from`` is relative to (default: the current directory).
    """
    rule, wl, des = exp.rule, exp.workload, exp.design
    duration: DurationEstimate | None = None
    if des.cv_from is not None:
        run_dir = Path(des.cv_from)
        if not run_dir.is_absolute() and base_dir is not None:
            run_dir = Path(base_dir) / run_dir
        cv_res, cv_source = cv_from_run(run_dir)
        cv = cv_res.cv
        duration = estimate_duration(exp, timing_from_run(run_dir))
    else:
        cv = des.resolved_cv()
        cv_source = "declared" if des.expected_cv is not None else "assumed; none declared"
        if des.time_budget_s is not None:
            duration = estimate_duration(exp, None)
    assert cv is not None
    n, passes, cl = wl.n_prompts, wl.passes, rule.confidence_level
    alt = "greater" if rule.alternative == "greater" else "two-sided"
    ratios = tuple(des.true_ratios)
    target = des.power_target

    match: list[MatchDesign] = []
    through: list[ThroughputDesign] = []
    activation: list[ActivationDesign] = []
    other: list[str] = []
    warnings: list[str] = []
    labels: list[LabelProbability] = []
    control_rate = des.assumed_control_match_rate

    for li, spec in enumerate(rule.labels):
        label_match: list[float | None] = []
        label_through: list[ThroughputDesign] = []
        independent = True
        activation_in_label = False
        for ci, crit in enumerate(spec.criteria):
            field = f"rule.labels[{li}].all[{ci}]"
            description, threshold = crit.describe(rule)
            where = f"{field} ('{spec.label}': {description} {threshold})"
            if isinstance(crit, (ControlDiverges, TreatmentBeatsControl)):
                activation_in_label = True   # the same prompts as the match criteria
                ad = _activation_design(spec.label, field, crit, description, threshold, n,
                                        rule, des.assumed_match_rate, control_rate, target)
                activation.append(ad)
                warnings.extend(_activation_warnings(ad, where, target))
            elif isinstance(crit, MatchLowerBound):
                md = _match_design(spec.label, field, crit, description, threshold, n, cl, alt,
                                   des.assumed_match_rate)
                match.append(md)
                warnings.extend(_match_warnings(md, where, crit, cl, alt, target))
                label_match.append(md.prob_met)
            elif isinstance(crit, (ThroughputRatio, ThroughputSlower, ThroughputNotSlower)):
                td = _throughput_design(spec.label, field, crit, description, threshold, passes,
                                        cv, cl, rule.tost_alpha, ratios, target)
                through.append(td)
                warnings.extend(_throughput_warnings(td, where, crit, ratios, target))
                label_through.append(td)
            else:
                independent = False
                other.append(f"{field} ('{spec.label}': {description} {threshold}): "
                             + _no_design_reason(crit))
        labels.extend(_label_probabilities(spec.label, label_match, label_through, ratios,
                                           independent, activation_in_label))

    cost = None
    if rule.cost is not None:
        cost_cv = cv
        if rule.cost.interval == "paired":
            paired = (paired_cv_from_run(run_dir) if des.cv_from is not None else None)
            if paired is not None:
                cost_cv = paired[0]
                cv_source += f"; the cost's paired interval: {paired[1]}"
            else:
                cv_source += ("; the cost's paired interval planned at this CV, as if unpaired "
                              "(an earlier run of two arms in design.cv_from gives the pairs' "
                              "spread; a drift common to both arms only makes this CV larger)")
        cost = _cost_design(rule.cost, passes, cost_cv, ratios, target)
        warnings.extend(_cost_warnings(cost, target))
    fps = _false_positives(rule, n, passes, cv, des.assumed_match_rate, control_rate)
    warnings.extend(_false_positive_warnings(fps))
    warnings.extend(speed_as_evidence_warnings(rule))
    warnings.extend(_concurrency_warnings(exp))
    warnings.extend(_engine_start_warnings(exp, bool(through) or cost is not None))
    if duration is not None:
        warnings.extend(_duration_warnings(duration))
    return DesignReport(
        name=exp.name, n_prompts=n, passes_per_arm=passes, cv=cv, cv_source=cv_source,
        confidence_level=cl, alternative=rule.alternative,
        assumed_match_rate=des.assumed_match_rate, true_ratios=ratios, power_target=target,
        match=tuple(match), throughput=tuple(through), labels=tuple(labels),
        other=tuple(other), warnings=tuple(warnings), activation=tuple(activation), cost=cost,
        false_positives=tuple(fps), assumed_control_match_rate=control_rate,
        duration=duration,
    )


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


def _duration_warnings(d: DurationEstimate) -> list[str]:
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


def _concurrency_warnings(exp: Experiment) -> list[str]:
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


def _engine_start_warnings(exp: Experiment, speed: bool) -> list[str]:
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


def _no_design_reason(crit: Any) -> str:
    if isinstance(crit, ProbeConfirmed):
        return ("no design figures (the probe's power depends on the engine; the run shows it: "
                "the probe's negative control must differ)")
    if isinstance(crit, EngineLog):
        return "no design figures (circumstantial evidence from the engine's log)"
    if isinstance(crit, MatchUpperBound):
        return "no design figures (an upper bound on the match rate is not planned for)"
    if isinstance(crit, MatchIntervalsOverlap):
        return "no design figures (depends on the control arm's unknown match rate)"
    if isinstance(crit, LargeDriftsAtMost):
        return "no design figures (depends on the drift distribution)"
    return "no design figures"


def _upper_alt(rule: Rule) -> str:
    """The Wilson upper bound's sidedness under the rule (one-sided: alternative "less")."""
    return "two-sided" if rule.alternative == "two-sided" else "less"


def _lower_alt(rule: Rule) -> str:
    return "two-sided" if rule.alternative == "two-sided" else "greater"


def _activation_design(label, field, crit, description, threshold, n, rule: Rule, rate: float,
                       control_rate: float, target: float) -> ActivationDesign:
    cl = rule.confidence_level
    if isinstance(crit, ControlDiverges):
        def prob(k: int) -> float:
            return design.prob_upper_bound_at_most(k, control_rate, crit.at_most, cl,
                                                   _upper_alt(rule))
        p = prob(n)
        need = None
        note = None
        if p < target:
            if control_rate >= crit.at_most:
                note = (f"at an assumed control match rate of {control_rate:g}, at or above the "
                        "threshold, no number of prompts shows the control diverging")
            else:
                need = _prompts_for_power(prob, n, target)
        return ActivationDesign(label, field, crit.criterion, description, threshold, n, rate,
                                control_rate, p, (), need, note)
    tests: list[tuple[str, float]] = []

    def combined(k: int) -> tuple[float, list[tuple[str, float]]]:
        got = []
        if crit.newcombe_at_least is not None:
            got.append(("newcombe", design.power_newcombe(k, rate, control_rate,
                                                          crit.newcombe_at_least, cl)))
        if crit.mcnemar_below is not None:
            got.append(("mcnemar", design.power_mcnemar(k, rate, control_rate,
                                                        crit.mcnemar_below)))
        probs = [q for _, q in got]
        return (min(probs) if crit.require == "both" else min(1.0, sum(probs))), got

    p, tests = combined(n)
    note = None
    if len(tests) > 1:
        note = ("with both tests required, P(met) is at most the smaller figure" if
                crit.require == "both" else "with either test enough, P(met) is at least the "
                "larger figure and at most their sum")
    need = None
    if p < target:
        if rate <= control_rate:
            note = (f"the assumed match rates ({rate:g} treatment, {control_rate:g} control) give "
                    "the treatment no lead to detect; check design.assumed_match_rate and "
                    "design.assumed_control_match_rate")
        else:
            need = _prompts_for_power(lambda k: combined(k)[0], n, target)
    return ActivationDesign(label, field, crit.criterion, description, threshold, n, rate,
                            control_rate, p, tuple(tests), need, note)


def _activation_warnings(ad: ActivationDesign, where: str, target: float) -> list[str]:
    if ad.prob_met is None or ad.prob_met >= target:
        return []
    fix = (f"about {ad.prompts_for_target} prompts would give {target:.0%} (set "
           "workload.n_prompts)" if ad.prompts_for_target is not None else
           ad.note or f"no number of prompts up to {MAX_PROMPTS_SEARCHED} reaches {target:.0%}")
    return [f"{where}: P(met) = {ad.prob_met:.3f} with {ad.n_prompts} prompts at assumed match "
            f"rates of {ad.assumed_match_rate:g} (treatment) and "
            f"{ad.assumed_control_match_rate:g} (control), below the power target "
            f"{target:.0%}; {fix}"]


def _cost_design(cost: CostRule, passes: int, cv: float, ratios, target: float) -> CostDesign:
    grid = tuple(dict.fromkeys((1.0, *ratios)))
    paired = cost.interval == "paired"
    factor = (design.expected_ratio_interval_factor(passes, cv, cost.confidence_level, paired)
              if passes >= 2 else None)
    outcomes = tuple((r, design.cost_outcome_probabilities(
        cost.margin, r, passes, cv, cost.confidence_level, cost.metric, paired))
        for r in grid) if passes >= 2 else ()
    decide = tuple((r, design.passes_to_decide(cost.margin, r, cv, cost.confidence_level,
                                               cost.metric, target, paired=paired))
                   for r in grid)
    return CostDesign(cost.describe(), cost.metric, cost.margin, cost.confidence_level, passes,
                      cv, factor, outcomes, decide)


def _cost_warnings(cd: CostDesign, target: float) -> list[str]:
    at_one = dict(cd.outcomes).get(1.0)
    if at_one is None or at_one["no measurable cost"] >= target:
        return []
    need = dict(cd.passes_to_decide).get(1.0)
    fix = (f"{need} passes per arm would give {target:.0%}; set workload.passes >= {need}"
           if need is not None else "no number of passes up to 200 does; widen the margin or "
                                    "reduce the pass-to-pass variation")
    return [f"rule.cost ({cd.description}): with no cost at all (true ratio 1), P(no measurable "
            f"cost) = {at_one['no measurable cost']:.3f} with {cd.passes_per_arm} passes per arm "
            f"at CV {cd.cv:.3g}, below the power target {target:.0%}; {fix}"]


#: A/A match rates the false-positive analysis tries, beside the declared assumed rates.
AA_MATCH_RATES = (0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


def _k_bounds(n: int, crits: list[Any], role: str, rule: Rule) -> tuple[int, int] | None:
    """The matched counts ``k`` (out of ``n``) at which every match criterion on ``role``'s arm
    holds, as ``(k_min, k_max)``; None when no ``k`` does. Each bound is monotone in ``k``."""
    from bistat.core.stats import wilson_interval

    cl = rule.confidence_level
    lo, hi = 0, n
    for c in crits:
        if isinstance(c, MatchLowerBound) and c.arm == role:
            tol = design.max_mismatches_tolerated(n, c.at_least, cl, _lower_alt(rule))
            if tol < 0:
                return None
            lo = max(lo, n - tol)
        elif (isinstance(c, MatchUpperBound) and c.arm == role) or (
                isinstance(c, ControlDiverges) and role == "control"):
            def ok(k: int, c=c) -> bool:
                high = wilson_interval(k, n, cl, _upper_alt(rule)).high
                return high < c.below if isinstance(c, MatchUpperBound) else high <= c.at_most
            if not ok(0):
                return None
            top = n
            if not ok(n):
                a, b = 0, n
                while b - a > 1:
                    mid = (a + b) // 2
                    a, b = (mid, b) if ok(mid) else (a, mid)
                top = a
            hi = min(hi, top)
    return (lo, hi) if lo <= hi else None


def _arm_prob(n: int, crits: list[Any], role: str, rule: Rule, rate: float) -> float:
    from scipy import stats as sps

    bounds = _k_bounds(n, crits, role, rule)
    if bounds is None:
        return 0.0
    lo, hi = bounds
    return float(sps.binom.cdf(hi, n, rate) - (sps.binom.cdf(lo - 1, n, rate) if lo > 0 else 0.0))


def _throughput_prob_at_one(crits: list[Any], passes: int, cv: float, rule: Rule
                            ) -> float | None:
    """P(all throughput criteria met | true ratio 1): exact for one, the smallest for several
    (a bound); None without throughput criteria; 1 with one counted pass (no power figure)."""
    through = [c for c in crits if isinstance(c, (ThroughputRatio, ThroughputSlower,
                                                  ThroughputNotSlower))]
    if not through:
        return None
    if passes < 2:
        # one pass per arm: the point estimate still has its planning-model spread (log ratio
        # ~ N(0, 2 sigma^2)); a criterion on an interval cannot be evaluated, hence never met
        sigma = design.log_sd_from_cv(cv)
        probs = []
        for c in through:
            if isinstance(c, ThroughputRatio) and c.statistic == "point":
                z = math.log(c.below if c.below is not None else c.at_least) / (sigma * math.sqrt(2))
                probs.append(float(_sps.norm.cdf(z) if c.below is not None else _sps.norm.sf(z)))
            else:
                probs.append(0.0)
        return min(probs)
    return min(_power_fn(c, cv, rule.confidence_level, rule.tost_alpha)(1.0, passes)
               for c in through)


def _pair_bound(crits: list[Any], n: int, rate: float, rule: Rule) -> float:
    """An upper bound on P(the criteria comparing the arms are met) when both arms match at
    ``rate``: the tests' own false-positive rates (exact under the planning model), 1 for
    criteria without one."""
    bound = 1.0
    for c in crits:
        if isinstance(c, TreatmentBeatsControl):
            probs = []
            if c.newcombe_at_least is not None:
                probs.append(design.power_newcombe(n, rate, rate, c.newcombe_at_least,
                                                   rule.confidence_level))
            if c.mcnemar_below is not None:
                probs.append(design.power_mcnemar(n, rate, rate, c.mcnemar_below))
            bound = min(bound, min(probs) if c.require == "both" else min(1.0, sum(probs)))
    return bound


def _false_positives(rule: Rule, n: int, passes: int, cv: float, rate: float,
                     control_rate: float) -> list[FalsePositive]:
    """Each label's false-positive probability (see :class:`FalsePositive`)."""
    alpha = rule.alpha
    out: list[FalsePositive] = []
    for spec in rule.labels:
        crits = list(spec.criteria)
        p_thr = _throughput_prob_at_one(crits, passes, cv, rule)
        slowdown = [c for c in crits if isinstance(c, (ThroughputRatio, ThroughputSlower,
                                                       ThroughputNotSlower))
                    and not _holds(c, 1.0)]
        if slowdown and p_thr is not None:
            p_t = _arm_prob(n, crits, "treatment", rule, rate)
            p_c = _arm_prob(n, crits, "control", rule, control_rate)
            prob = p_t * p_c * p_thr
            bound = len(slowdown) > 1 or any(
                not isinstance(c, (ThroughputRatio, ThroughputSlower, ThroughputNotSlower,
                                   MatchLowerBound, MatchUpperBound, ControlDiverges))
                for c in crits)
            fix = None
            if prob > alpha:
                fix = _passes_fix(lambda k: p_t * p_c * _throughput_prob_at_one(
                    crits, k, cv, rule), alpha)
            out.append(FalsePositive(spec.label, "no slowdown", None, prob, bound, alpha, fix))
        if spec.label != "working":
            continue
        rates = sorted({*AA_MATCH_RATES, rate, control_rate})

        def aa_worst(k: int) -> tuple[float, float]:
            """(the worst A/A match rate, the label's bound there) with ``k`` prompts."""
            out = (rates[0], -1.0)
            for q in rates:
                arms = (_arm_prob(k, crits, "treatment", rule, q)
                        * _arm_prob(k, crits, "control", rule, q))
                prob = min(arms, _pair_bound(crits, k, q, rule)) * (1.0 if p_thr is None
                                                                    else p_thr)
                if prob > out[1]:
                    out = (q, prob)
            return out

        p, prob = aa_worst(n)
        fix = None
        if prob > alpha:
            compares = any(isinstance(c, (ControlDiverges, TreatmentBeatsControl)) for c in crits)
            fix = ("" if compares else
                   "the label never compares the arms' match rates, so a mode that does nothing "
                   "meets it as often as the treatment matches; add control_diverges and "
                   "treatment_beats_control to it")
            if p_thr is not None and p_thr < 1.0:
                arms_p = prob / p_thr
                passes_fix = _passes_fix(lambda k: arms_p * _throughput_prob_at_one(
                    crits, k, cv, rule), alpha)
                fix = "; ".join(x for x in (passes_fix, fix) if x)
            if not fix:
                need = _prompts_under_alpha(lambda k: aa_worst(k)[1], n, alpha)
                fix = (f"about {need} prompts bring it under alpha (set workload.n_prompts >= "
                       f"{need})" if need is not None else
                       "no number of prompts up to 100000 brings it under alpha; tighten the "
                       "activation criteria's thresholds")
        out.append(FalsePositive(spec.label, "A/A", p, prob, True, alpha, fix))
    return out


#: Prompts searched at most when suggesting how many bring a false-positive rate under alpha.
MAX_PROMPTS_FOR_ALPHA = 100_000


def _prompts_under_alpha(prob: Callable[[int], float], start: int, alpha: float) -> int | None:
    """About how many prompts bring ``prob(prompts)`` under ``alpha`` (doubling from ``start``,
    then bisection to 1 %: Wilson-bound probabilities saw-tooth in the number of prompts, so
    the answer is approximate, and the warning says "about")."""
    lo, hi = start, start * 2
    while prob(hi) > alpha:
        lo, hi = hi, hi * 2
        if hi > MAX_PROMPTS_FOR_ALPHA:
            return None
    return design.bisect_power(lambda k: 1.0 if prob(k) <= alpha else 0.0, 0.5, lo, hi,
                               divisor=100)


def _passes_fix(prob: Callable[[int], float], alpha: float) -> str:
    """The passes per arm at which ``prob(passes) <= alpha``, in words."""
    need = design.min_passes_for_power(lambda k: 1.0 if prob(k) <= alpha else 0.0, 0.5)
    if need is None:
        return "no number of passes up to 200 brings it under alpha"
    return f"{need} passes per arm bring it under alpha (set workload.passes >= {need})"


def _false_positive_warnings(fps: list[FalsePositive]) -> list[str]:
    out = []
    for fp in fps:
        if not fp.exceeds:
            continue
        what = ("when there is no slowdown at all (true ratio 1)" if fp.scenario == "no slowdown"
                else f"in an A/A experiment (the treatment's mode doing nothing: both arms at a "
                     f"match rate of {fp.match_rate:g}, true ratio 1)")
        out.append(f"rule label '{fp.label}' is met {what} with probability "
                   f"{'up to ' if fp.bound else ''}{fp.prob:.3f}, above the rule's alpha "
                   f"{fp.alpha:.3g}: a false '{fp.label}'; {fp.fix}")
    return out


def _match_design(label, field, crit, description, threshold, n, cl, alt, rate) -> MatchDesign:
    min_n = design.min_prompts_for_threshold(crit.at_least, cl, alt)
    tolerated = design.max_mismatches_tolerated(n, crit.at_least, cl, alt)
    prob = design.prob_lower_bound_at_least(n, rate, crit.at_least, cl, alt)
    return MatchDesign(label, field, crit.criterion, description, threshold, n, min_n, tolerated,
                       rate, prob)


def _match_warnings(md: MatchDesign, where: str, crit: MatchLowerBound, cl: float, alt: str,
                    target: float) -> list[str]:
    if md.min_prompts is not None and md.n_prompts < md.min_prompts:
        return [f"{where} cannot be met even if every prompt matches: {md.n_prompts} prompts "
                f"give at best a lower bound below {crit.at_least:g}; set workload.n_prompts >= "
                f"{md.min_prompts}"]
    if md.prob_met is not None and md.prob_met < target:
        rate = md.assumed_match_rate
        if rate <= crit.at_least:
            fix = (f"at an assumed match rate of {rate:g}, at or below the threshold, no number "
                   "of prompts reaches it; check design.assumed_match_rate or the threshold")
        else:
            needed = _prompts_for_power(lambda k: design.prob_lower_bound_at_least(
                k, rate, crit.at_least, cl, alt), md.n_prompts, target)
            fix = (f"about {needed} prompts would give {target:.0%} (set workload.n_prompts)"
                   if needed is not None else
                   f"no number of prompts up to {MAX_PROMPTS_SEARCHED} reaches {target:.0%}")
        return [f"{where}: P(met) = {md.prob_met:.3f} at an assumed match rate of {rate:g} "
                f"with {md.n_prompts} prompts ({md.mismatches_tolerated} mismatches tolerated), "
                f"below the power target {target:.0%}; {fix}"]
    return []


def _prompts_for_power(power: Callable[[int], float], start: int, target: float) -> int | None:
    # P(lower bound clears) saw-tooths in n; search the doubling grid, then bisect the last
    # interval: the answer is approximate ("about"), which the warning says.
    lo, hi = start, start * 2
    while power(hi) < target:
        lo, hi = hi, hi * 2
        if hi > MAX_PROMPTS_SEARCHED:
            return None
    return design.bisect_power(power, target, lo, hi, divisor=100)


def _holds(crit: Any, r: float) -> bool:
    """Whether the criterion is true of the true ratio ``r`` (what it is meant to detect)."""
    if isinstance(crit, ThroughputRatio):
        return r < crit.below if crit.below is not None else r >= crit.at_least
    if isinstance(crit, ThroughputSlower):
        return r < crit.bound
    if crit.is_tost:
        return crit.margin_low < r < crit.margin_high
    return r >= crit.lower_at_least


def _power_fn(crit: Any, cv: float, cl: float, tost_alpha: float) -> Callable[[float, int], float]:
    """``(true_ratio, passes_per_arm) -> P(criterion met)``."""
    if isinstance(crit, ThroughputRatio):
        bound = crit.below if crit.below is not None else crit.at_least
        if crit.statistic == "point":
            fn = design.power_ratio_point_below if crit.below is not None \
                else design.power_ratio_point_at_least
            return lambda r, p: fn(bound, r, p, cv)
        # interval_high < b: the whole interval below b; interval_low >= b: the whole above.
        # The two mixed forms are complements of those.
        if crit.statistic == "interval_high":
            if crit.below is not None:
                return lambda r, p: design.power_ratio_interval_below(bound, r, p, cv, cl)
            return lambda r, p: 1.0 - design.power_ratio_interval_below(bound, r, p, cv, cl)
        if crit.at_least is not None:
            return lambda r, p: design.power_ratio_interval_above(bound, r, p, cv, cl)
        return lambda r, p: 1.0 - design.power_ratio_interval_above(bound, r, p, cv, cl)
    if isinstance(crit, ThroughputSlower):
        return lambda r, p: design.power_ratio_interval_below(crit.bound, r, p, cv, cl)
    if crit.is_tost:
        return lambda r, p: design.power_tost(crit.margin_low, crit.margin_high, r, p, cv,
                                              tost_alpha)
    return lambda r, p: design.power_ratio_interval_above(crit.lower_at_least, r, p, cv, cl)


def _throughput_design(label, field, crit, description, threshold, passes, cv, cl, tost_alpha,
                       ratios, target) -> ThroughputDesign:
    if passes < 2:
        why = ("1 counted pass per arm gives no estimate of pass-to-pass variation, so no "
               "ratio interval" if needs_repeat_passes(crit) else
               "1 counted pass per arm: the ratio's sampling error cannot be estimated")
        fn = _power_fn(crit, cv, cl, tost_alpha)
        power = tuple(PowerAt(r, None, _holds(crit, r),
                              design.min_passes_for_power(lambda p, r=r: fn(r, p), target)
                              if _holds(crit, r) else None) for r in ratios)
        return ThroughputDesign(label, field, crit.criterion, description, threshold, passes, cv,
                                None, None, power, note=why)
    half = design.expected_ratio_halfwidth(passes, cv, cl)
    fn = _power_fn(crit, cv, cl, tost_alpha)
    power = []
    for r in ratios:
        prob = fn(r, passes)
        holds = _holds(crit, r)
        need = None
        if holds and prob < target:
            need = design.min_passes_for_power(lambda p, r=r: fn(r, p), target)
        power.append(PowerAt(r, prob, holds, need))
    return ThroughputDesign(label, field, crit.criterion, description, threshold, passes, cv,
                            half, math.exp(half), tuple(power))


def _throughput_warnings(td: ThroughputDesign, where: str, crit: Any, ratios, target) -> list[str]:
    out: list[str] = []
    if td.passes_per_arm < 2:
        need = max((p.passes_for_target or 2 for p in td.power if p.holds), default=2)
        verb = "cannot be evaluated" if needs_repeat_passes(crit) else "has no power analysis"
        out.append(f"{where} {verb} with workload.passes = {td.passes_per_arm}: {td.note}; "
                   f"set workload.passes >= {need}")
        return out
    for p in td.power:
        if not p.holds or p.prob_met is None or p.prob_met >= target:
            continue
        fix = (f"{p.passes_for_target} passes per arm would give {target:.0%} power; set "
               f"workload.passes >= {p.passes_for_target}" if p.passes_for_target is not None
               else "no number of passes up to 200 reaches it; move the bound away from this "
                    "ratio or reduce the pass-to-pass variation")
        out.append(f"{where}: at a true ratio of {p.true_ratio:g}, P(met) = {p.prob_met:.3f} with "
                   f"{td.passes_per_arm} passes per arm at CV {td.cv:.3g}, below the power target "
                   f"{target:.0%}; {fix}")
    if not any(p.holds for p in td.power):
        out.append(f"{where}: none of design.true_ratios ({', '.join(f'{r:g}' for r in ratios)}) "
                   "makes this criterion true, so its power is not assessed; add a ratio it "
                   "should detect to design.true_ratios")
    return out


def _label_probabilities(label: str, match: list[float | None],
                         through: list[ThroughputDesign], ratios, independent: bool,
                         activation: bool = False) -> list[LabelProbability]:
    out: list[LabelProbability] = []
    for i, r in enumerate(ratios):
        if activation:
            note = ("not computed: its activation criteria read the same prompts as its match "
                    "criteria (each criterion's figure is above)")
        elif not independent:
            note = "not computed: a criterion of this label has no design figures"
        elif len(match) > 1 or len(through) > 1:
            note = "not computed: criteria on the same data are not independent"
        else:
            note = None
        prob: float | None = None
        if note is None:
            parts = list(match) + [td.power[i].prob_met for td in through]
            if any(p is None for p in parts):
                note = "not computed: a criterion has no probability"
            else:
                prob = math.prod(parts)  # type: ignore[arg-type]
        out.append(LabelProbability(label, r, prob, note))
    return out


# --------------------------------------------------------------------------------------------


def _p(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _duration_lines(d: DurationEstimate) -> list[str]:
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
                     "arms' engines, one engine's first start each: the earlier run started "
                     "one at a time)")
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


def format_design(report: DesignReport) -> str:
    """Plain-text rendering of a design analysis (``bistat design``, ``bistat register``)."""
    lines = [f"Design analysis of '{report.name}': {report.n_prompts} prompts, "
             f"{report.passes_per_arm} counted passes per arm, CV {report.cv:.3g} "
             f"({report.cv_source})"]
    if report.match:
        lines.append("")
        lines.append(f"Match criteria ({report.confidence_level * 100:g} % Wilson, "
                     f"{report.alternative}; assumed true match rate "
                     f"{report.assumed_match_rate:g}):")
        for md in report.match:
            lines.append(f"  {md.label}: {md.description} {md.threshold}")
            lines.append(f"    prompts needed for a perfect match to clear it: {md.min_prompts}")
            tol = ("none (even a perfect match falls short)" if md.mismatches_tolerated == -1
                   else str(md.mismatches_tolerated))
            lines.append(f"    mismatches tolerated at {md.n_prompts} prompts: {tol}")
            lines.append(f"    P(met) at a true match rate of {md.assumed_match_rate:g}: "
                         f"{_p(md.prob_met)}")
    if report.throughput:
        lines.append("")
        lines.append(f"Throughput criteria ({report.passes_per_arm} counted passes per arm, "
                     f"CV {report.cv:.3g}):")
        for td in report.throughput:
            lines.append(f"  {td.label}: {td.description} {td.threshold}")
            if td.interval_factor is not None:
                lines.append(f"    expected ratio interval: estimate ×/÷ {td.interval_factor:.3f}"
                             f" (log half-width {td.halfwidth_log:.4f})")
            if td.note:
                lines.append(f"    {td.note}")
            probs = ", ".join(f"{p.true_ratio:g}: {_p(p.prob_met)}" for p in td.power)
            lines.append(f"    P(met) at true ratio {probs}")
    if report.activation:
        lines.append("")
        lines.append(f"Activation criteria ({report.n_prompts} prompts; assumed match rates "
                     f"{report.assumed_match_rate:g} treatment, "
                     f"{report.assumed_control_match_rate:g} control):")
        for ad in report.activation:
            lines.append(f"  {ad.label}: {ad.description} {ad.threshold}")
            if ad.tests:
                lines.append("    " + ", ".join(f"P({t}) = {_p(q)}" for t, q in ad.tests))
            lines.append(f"    P(met): {_p(ad.prob_met)}"
                         + (f" ({ad.note})" if ad.note else ""))
    if report.cost is not None:
        cd = report.cost
        lines.append("")
        lines.append(f"Cost rule ({cd.description}; {cd.passes_per_arm} counted passes per arm, "
                     f"CV {cd.cv:.3g}):")
        if cd.interval_factor is not None:
            lines.append(f"  expected ratio interval: estimate ×/÷ {cd.interval_factor:.3f}")
        for r, probs in cd.outcomes:
            lines.append(f"  at true ratio {r:g}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in probs.items()))
        lines.append("  passes per arm that decide it with the power target: " + ", ".join(
            f"at {r:g}: {'none up to 200' if k is None else k}" for r, k in cd.passes_to_decide))
    if report.false_positives:
        lines.append("")
        lines.append("False verdicts (a label met when what it asserts is false):")
        for fp in report.false_positives:
            what = ("no slowdown (true ratio 1)" if fp.scenario == "no slowdown" else
                    f"A/A (both arms at match rate {fp.match_rate:g}, the worst tried)")
            lines.append(f"  {fp.label}, {what}: P {'<=' if fp.bound else '='} {fp.prob:.3f}"
                         f" (alpha {fp.alpha:.3g})")
    if report.labels:
        lines.append("")
        lines.append("P(label's criteria all met), match and throughput independent:")
        by_label: dict[str, list[LabelProbability]] = {}
        for lp in report.labels:
            by_label.setdefault(lp.label, []).append(lp)
        for label, lps in by_label.items():
            if all(lp.prob is None for lp in lps):
                lines.append(f"  {label}: {lps[0].note}")
            else:
                lines.append(f"  {label}: " + ", ".join(
                    f"at true ratio {lp.true_ratio:g}: {_p(lp.prob)}" for lp in lps))
    if report.other:
        lines.append("")
        lines.append("Other criteria:")
        lines.extend(f"  {o}" for o in report.other)
    if report.duration is not None:
        lines.append("")
        lines.extend(_duration_lines(report.duration))
    lines.append("")
    if report.warnings:
        lines.append(f"Warnings ({len(report.warnings)}):")
        lines.extend(f"  - {w}" for w in report.warnings)
    else:
        lines.append("Warnings: none")
    return "\n".join(lines) + "\n"
