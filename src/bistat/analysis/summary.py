"""Recorded run -> :class:`RunSummary`: match counts, first divergences, throughput, batching, validity.

This module reads a run directory (``bistat.store.readers``) and the sealed registration, counts what
the records show and calls the pure statistics (``bistat.core.stats``) and the mechanical classifier
(``bistat.core.classify``). It renders nothing: ``bistat.report.finding`` turns the summary into a finding.

Definitions (also in ``docs/RECORDS.md``, "How a run is analysed")
-------------------------------------------------------------------
*Counted passes* of an arm: passes recorded with ``kind = "counted"`` whose last ``end`` event in
``schedule.jsonl`` has ``status = "complete"`` or ``"failed"`` (it ran to its end with some
requests failed; their prompts are excluded) -- when the schedule has no ``end`` event for a pass,
the pass counts if it has responses (one rule: ``bistat.store.passes.pass_states`` and
``pass_counts``, shared with the anatomy and the trim). Warm-up passes and incomplete
passes are never counted; incomplete counted passes are listed as deviations. When a prompt has several responses in one
pass (a resumed run), the last one recorded counts.

*Compared prompts* of an arm: prompts with a successful response (``error`` null) in every counted
pass. A prompt with a failed request in any counted pass is excluded and counted
(``n_excluded_failed``); a prompt missing from a counted pass is excluded and counted
(``n_excluded_missing``); with unit ``token_ids+logprobs`` a response without logprobs excludes
its prompt (``n_excluded_no_logprobs``).

*Match unit*: ``token_ids`` compares ``token_sha256``; ``text`` compares ``text``;
``token_ids+logprobs`` compares ``token_sha256`` and ``logprob_sha256`` (bitwise float64).

*multi_pass*: ``all`` -- one unit per compared prompt; it matches when every counted pass gave
the same output. ``pairwise`` -- one unit per compared prompt and unordered pair of counted
passes, ``P (P - 1) / 2`` units per prompt with ``P`` counted passes; a pair matches when its two
outputs are identical. Pairs of one prompt are not independent, so a Wilson interval over pairs
is narrower than the prompt-level evidence justifies; the McNemar comparison between arms always
uses the prompt-level ``all`` outcome.

*First divergence*: for every compared prompt that does not match, each counted pass whose output
differs from the arm's reference pass (its first counted pass) gives one position: the first
token index where the token ids differ (for ``token_ids+logprobs``, where the token id or the
logprob's bits differ); when one output is a prefix of the other, the shorter length.
Token ids are loaded only for the mismatching prompts. A trimmed run (``bistat compact --trim``)
keeps the other passes' outputs only up to that position, against the reference pass and by
the unit recorded in its ``bistat.trim`` footer; ``bistat.store.readers.check_trim`` stops the analysis when
its reference pass or unit is another.

*Divergence anatomy* (``bistat.analysis.anatomy``): each first divergence labelled a near-tie flip or a
large drift by the top-1/top-2 margin there against the declared ``match.near_tie_epsilon``.
It is computed from the rows of the mismatching prompts only (read once, with the token ids),
over the same counted passes and reference pass as the match count; an arm's ``n_prompts`` in
the anatomy is its number of compared prompts. Its large drifts per arm are what the criterion
``large_drifts_at_most`` reads (``ArmStats.large_drifts``).

*Batching evidence* per pass, from ``metrics.jsonl`` samples with ``num_requests_running``, by
:func:`bistat.run.batching.batching_summary`, the function the runner wrote ``passes.jsonl``'s
``batching`` with: mean running and waiting requests weighted by the time each sample stands for
(the last until the pass's recorded wall time ended), max running, and preemptions (the
increase of ``num_preemptions_total`` over the pass). The validity check ``min_mean_running``
reads this mean, so the finding's Batching table, the validity table and ``passes.jsonl`` show
one number.

*First divergence*: :func:`bistat.core.divergence.first_divergence`, the one definition the anatomy,
the probe and the trimmed compaction use too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from bistat.analysis import activation as act
from bistat.analysis import anatomy as anat
from bistat.store.format import NOTES_FILE, OUTPUT_LENGTH
from bistat.store.passes import pass_counts, pass_states
from bistat.store.run_dir import RecordedRun
from bistat.core import stats
from bistat.run.batching import batching_summary
from bistat.core.classify import (
    ActivationEvidence,
    ArmStats,
    PairedCounts,
    RunTestable,
    ValidityCheck,
    classify,
)
from bistat.core.divergence import divergence_position
from bistat.declare.engine_version import EngineVersionReport, engine_version_report
from bistat.store.enginelog import (CudaGraphSizes, JitCompile, cudagraph_sizes, jit_compiles,
                                    kept_log_lines, kept_logs, logged_modes)
from bistat.store.format import parse_time
from bistat.engines.base import MetricsSample
from bistat.declare.experiment import DeclarationError, Experiment
from bistat.run.fingerprint import same_node, version_differences
from bistat.declare.prereg import (Registration, git_evidence, load_registration,
                                   release_log_checks)
from bistat.declare.run_registration import run_registration
from bistat.analysis.probe_report import ProbeReport, ProbeReportError, read_probe_reports

__all__ = [
    "AnalysisError",
    "BeyondGraphs",
    "PassSummary",
    "Divergence",
    "ArmSummary",
    "ArmEnvironment",
    "ArmComparison",
    "MetricsSeries",
    "RunSummary",
    "analyze_run",
    "summary_to_dict",
    "time_beyond_graphs",
    "EngineStarts",
    "GpuClocks",
    "HostLoad",
    "engine_starts",
    "gpu_clocks",
    "host_load",
]

VERSION_KEYS = ("python", "numpy", "torch", "triton", "vllm", "bistat")


class AnalysisError(Exception):
    """The run cannot be analysed (missing registration, records of another experiment...)."""


# --------------------------------------------------------------------------------------------
# Result objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassSummary:
    """One recorded pass: its place in the schedule, throughput and batching evidence."""

    arm: str
    seq: int
    pass_index: int
    kind: str                        # "warmup" | "counted"
    status: str                      # last schedule end status, or "no end event"
    counted: bool                    # used in the analysis (counted and complete)
    wall_s: float | None
    n_requests: int | None
    n_failed: int | None
    output_tokens: int | None
    output_tokens_per_s: float | None
    requests_per_s: float | None
    mean_running: float | None
    max_running: float | None
    mean_waiting: float | None
    preemptions: float | None
    n_metric_samples: int
    #: requests bistat had in flight, time-weighted over the pass: sum of (t_done - t_submit)
    #: over the pass's responses / (last t_done - first t_submit); None without the times
    client_in_flight: float | None = None
    #: seconds of the pass at each running-request count, (count, seconds) in count order (the
    #: time weights of the mean running batch; empty without metrics samples)
    running_hist: tuple[tuple[int, float], ...] = ()
    #: shares of the host's CPU time over the pass (its ``host`` record, bistat.run.hostload):
    #: busy (machine-wide, non-idle), stolen by the hypervisor, and used by other processes than
    #: bistat's own (an engine in a subprocess counts as other); None where not recorded
    host_busy_share: float | None = None
    host_steal_share: float | None = None
    host_other_share: float | None = None
    #: the GPU during the pass (its ``gpu`` record, bistat.run.gpuload): mean and lowest SM
    #: clock, hottest temperature, mean power, and the share of samples with a slowdown reason
    #: active; None where not sampled
    gpu_sm_clock_mhz: float | None = None
    gpu_sm_clock_min_mhz: float | None = None
    gpu_temperature_max_c: float | None = None
    gpu_power_w: float | None = None
    gpu_slowdown_share: float | None = None
    #: the engine-start block the pass ran in (bistat.core.schedule); None where not recorded
    block: int | None = None


@dataclass(frozen=True)
class Divergence:
    """A counted pass whose output for a prompt differs from the arm's reference pass."""

    arm: str
    prompt_id: str
    pass_index: int
    reference_pass: int
    position: int
    #: the prompt's length in tokens (the reference response's); None when not recorded
    n_prompt_tokens: int | None = None

    @property
    def kv_length(self) -> int | None:
        """Keys the first differing token's attention read: prompt tokens + its index."""
        return None if self.n_prompt_tokens is None else self.n_prompt_tokens + self.position


@dataclass(frozen=True)
class ArmEnvironment:
    """What the arm ran on, from ``environment.jsonl`` (every engine start of the arm)."""

    gpus: tuple[str, ...]            # "name (uuid, driver)"
    gpu_uuids: tuple[str, ...]
    versions: tuple[tuple[str, str | None], ...]
    engine: str
    host: str | None
    n_starts: int
    #: engine-log lines kept at its starts (``environment.jsonl`` ``log_findings``), in order,
    #: without repeats; None when no start recorded any (engines without a log)
    log_findings: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ArmSummary:
    """Match counts, divergences and throughput of one arm."""

    name: str
    role: str
    counted_passes: tuple[int, ...]
    reference_pass: int | None
    n_prompts_recorded: int
    n_prompts: int                   # compared prompts
    n_excluded_failed: int
    n_excluded_missing: int
    n_excluded_no_logprobs: int
    n_prompts_matched: int           # compared prompts identical in every counted pass
    unit: str                        # "prompt" | "prompt pair"
    n_units: int
    n_matched: int
    match_interval: stats.Interval | None    # two-sided Wilson at the rule's confidence level
    pass_throughputs: tuple[float, ...]
    n_failed_requests: int           # failed requests in counted passes
    divergences: tuple[Divergence, ...]

    @property
    def match_rate(self) -> float | None:
        return self.n_matched / self.n_units if self.n_units else None

    @property
    def n_prompts_diverged(self) -> int:
        """Compared prompts that were not identical in every counted pass."""
        return self.n_prompts - self.n_prompts_matched


@dataclass(frozen=True)
class ArmComparison:
    """One treatment against the control: paired match test, difference, ratio, verdict."""

    control: str
    treatment: str
    n_paired: int
    mcnemar: stats.McNemarResult | None
    difference: stats.Interval | None     # treatment match rate - control match rate
    ratio: stats.RatioResult | None
    ratio_point: float | None
    verdict: Any                          # bistat.core.classify.Verdict


@dataclass(frozen=True)
class MetricsSeries:
    """Running requests over time in one pass (for the plot)."""

    arm: str
    seq: int
    t: tuple[float, ...]
    running: tuple[float, ...]


@dataclass(frozen=True)
class SiblingVerdict:
    """One comparison classified under a sibling registration's rule: a registration sealed with
    the same declaration but for its name and decision rule (e.g. the published rule and its
    improved form, registered together for one run), so the finding can show what each rule
    concludes from the same data."""

    registration: str                     # its path, as displayed
    name: str
    treatment: str
    control: str
    verdict: Any                          # bistat.core.classify.Verdict
    #: sealed after the run's first record: an exploratory analysis, not a test
    exploratory: bool = False
    sealed_utc: str | None = None


@dataclass(frozen=True)
class RunSummary:
    """Everything a finding states, computed from the records and the registration."""

    name: str
    run_id: str
    created_utc: str | None
    engine_kind: str | None
    command: tuple[str, ...]
    registration_path: str | None
    registration_sha256: str
    registered_utc: str
    sealed_utc: str
    registration_bistat_version: str | None
    hypothesis: str
    declaration: Mapping[str, Any]
    amendments: tuple[Mapping[str, Any], ...]
    match_unit: str
    multi_pass: str
    confidence_level: float
    arms: tuple[ArmSummary, ...]
    passes: tuple[PassSummary, ...]
    environments: tuple[tuple[str, ArmEnvironment], ...]
    validity: tuple[ValidityCheck, ...]
    status: RunTestable
    comparisons: tuple[ArmComparison, ...]
    metrics: tuple[MetricsSeries, ...]
    events: tuple[tuple[str, str, str | None], ...]   # (arm, event, detail) of refusals/failures
    deviations: tuple[str, ...]
    not_run: tuple[str, ...]
    gaps: tuple[str, ...]
    n_response_records: int
    anatomy: anat.Anatomy | None = None   # the divergence anatomy (bistat.analysis.anatomy)
    #: the run directory's ``NOTES.md`` (what the operator states: why something was not run,
    #: what happened on the machine), quoted in the finding as written, never interpreted
    operator_notes: str | None = None
    #: per arm: what it requested and the evidence that it was on (bistat.analysis.activation)
    activation: tuple[act.ArmActivation, ...] = ()
    #: the probe report files the activation read (several: runs of one probe, merged)
    probe_files: tuple[str, ...] = ()
    #: that (merged) probe report
    probe: ProbeReport | None = None
    #: the same comparisons under each sibling registration's rule (:class:`SiblingVerdict`)
    siblings: tuple[SiblingVerdict, ...] = ()
    #: kernels the engines JIT-compiled while serving, and the passes that paid for it
    #: (vLLM's warnings in ``engine-logs/``; :mod:`bistat.store.enginelog`)
    jit_compiles: tuple[JitCompile, ...] = ()
    #: per arm, the CUDA-graph sizes its (last) engine start logged (bistat.store.enginelog)
    cudagraph_sizes: tuple[tuple[str, CudaGraphSizes], ...] = ()
    #: the engine's version against the newest release known and the required one, and each
    #: arm's compilation / CUDA-graph mode (bistat.declare.engine_version)
    engine_version: EngineVersionReport | None = None
    #: the registration analysed against was sealed after the run's first record (a sibling
    #: registered later): an exploratory analysis, never a test of the hypothesis
    exploratory: bool = False
    #: the registration the run was recorded under, when analysed against a sibling
    recorded_registration: str | None = None

    def arm(self, name: str) -> ArmSummary:
        return next(a for a in self.arms if a.name == name)


# --------------------------------------------------------------------------------------------
# Reading helpers
# --------------------------------------------------------------------------------------------


_opt_float = anat.optional_float


# --- analyze_run and its phases ---------------------------------------------------------------


def analyze_run(run_dir: str | Path | RecordedRun,
                registration: str | Path | Registration | None = None) -> RunSummary:
    """Analyse a recorded run against its sealed registration.

    In phases, each a function of this module: the registration (:func:`_registered`) and the
    tables (:func:`_load_tables`) are loaded; the passes are summarised (:func:`_pass_summaries`);
    each arm's outputs are matched over its counted passes (:func:`_match`); the run's validity,
    what was not run and why an arm cannot be tested are found (:func:`_validity`,
    :func:`_not_run`, :func:`_untestable`); the probe's and the engine logs' activation evidence
    is read; every treatment is compared with the control and classified (:func:`_comparisons`),
    and again under each sibling registration's rule (:func:`_sibling_verdicts`).

    Parameters
    ----------
    run_dir : path or RecordedRun
        The run directory (``run.json`` and the JSONL / Parquet tables), or the run opened.
    registration : path or Registration, optional
        The registration (``preregistrations/NAME.json``); default: the path ``run.json`` names
        in ``registration.path``. Found and its seal checked by the one resolver of a run's
        registration (``bistat.declare.run_registration.run_registration``).

    Returns
    -------
    RunSummary

    Raises
    ------
    AnalysisError, bistat.store.format.RecordsError, bistat.declare.prereg.RegistrationError
        With the file and field that is wrong.
    """
    run = RecordedRun.of(run_dir)
    run_dir, header = run.path, run.header
    deviations: list[str] = []   # every phase adds its departures from the declaration, in order
    registered = _registered(run, registration, deviations)
    reg, exp, hdr_reg, sibling_of = (registered.reg, registered.exp,
                                     registered.header_registration, registered.sibling_of)
    created = header.get("created_utc")
    arm_names = [a.name for a in exp.arms]

    tables = _load_tables(run, exp.match.unit)
    responses = tables.responses
    unknown_arms = sorted(set(responses["arm"].dropna().unique().tolist()) - set(arm_names))
    if unknown_arms:
        deviations.append(f"responses recorded for arm(s) not in the registration, ignored: "
                          f"{', '.join(unknown_arms)}")

    passes, series = _pass_summaries(tables, {a.name: a.role for a in exp.arms}, deviations)
    run_id = run.run_id
    matching = _match(run, exp, responses, passes, deviations)
    arm_summaries = matching.arms

    envs, fps = _environments(tables.environment, arm_names)
    bad_events, gpu_busy = _bad_events(tables.events)
    validity = _validity(exp, passes, fps, envs, reg.sealed_utc, created,
                         exploratory=registered.exploratory)
    not_run = _not_run(exp, arm_summaries, passes, envs, bad_events, gpu_busy, tables.gaps,
                       deviations)
    arm_reasons = _untestable(bad_events, arm_summaries, exp.workload.passes)
    run_status = (RunTestable(False, "; ".join(r for _, r in arm_reasons)) if arm_reasons
                  else RunTestable(True))

    # activation evidence: the probe's outcome per arm, the engine logs' markers
    try:
        probe, probe_files = read_probe_reports(run_dir)
    except ProbeReportError as exc:
        raise AnalysisError(str(exc)) from None
    engine_logs = kept_logs(run_dir)  # read once: markers, modes, JIT warnings, graph sizes
    marker_lines = {a: e.log_findings for a, e in envs.items() if e.log_findings is not None}
    for arm, lines in kept_log_lines(engine_logs).items():
        marker_lines[arm] = tuple(marker_lines.get(arm, ())) + lines
    activation = act.arm_activation(
        [a.model_dump(mode="json") for a in exp.arms], marker_lines,
        None if probe is None else probe.to_json(),
        {a.name: (a.n_prompts_diverged, a.n_prompts) for a in arm_summaries})
    evidence = {a.arm: _evidence(a, probe is not None) for a in activation}

    comparisons, pairs = _comparisons(exp, matching, validity, arm_reasons, evidence)
    siblings = _sibling_verdicts(reg, created, passes, fps, envs, pairs)

    engine_version = _engine_version(exp, reg, tables.environment, tables.events, engine_logs,
                                     created)
    deviations.extend(engine_version.deviations)
    passes_df = tables.passes
    return RunSummary(
        name=exp.name, run_id=run_id,
        created_utc=header.get("created_utc"), engine_kind=header.get("engine_kind"),
        command=tuple(str(x) for x in header.get("command") or ()),
        # the registration analysed against: the run's own as run.json names it, or the sibling
        # named on the command line (relative to the working directory when inside it; the
        # run's own is then named in the deviations)
        registration_path=(_display_path(reg.path) if sibling_of is not None else
                           hdr_reg.get("path") if isinstance(hdr_reg, Mapping) else None),
        registration_sha256=reg.sha256, registered_utc=reg.registered_utc,
        sealed_utc=reg.sealed_utc, registration_bistat_version=reg.sealed.get("bistat_version"),
        hypothesis=exp.hypothesis,
        declaration=reg.declaration, amendments=tuple(reg.amendments),
        match_unit=exp.match.unit, multi_pass=exp.match.multi_pass,
        confidence_level=exp.rule.confidence_level,
        arms=tuple(arm_summaries), passes=tuple(passes),
        environments=tuple((a, envs[a]) for a in arm_names if a in envs),
        validity=tuple(validity), status=run_status, comparisons=tuple(comparisons),
        metrics=tuple(series), events=tuple(bad_events), deviations=tuple(deviations),
        not_run=tuple(not_run), gaps=tuple(tables.gaps), n_response_records=len(responses),
        anatomy=matching.anatomy, operator_notes=_operator_notes(run_dir),
        activation=activation, probe_files=probe_files, probe=probe,
        siblings=tuple(siblings),
        jit_compiles=jit_compiles(engine_logs, header.get("created_utc"),
                                  passes_df.to_dict("records") if len(passes_df) else []),
        cudagraph_sizes=tuple(
            (arm, size) for arm, starts in engine_logs.items()
            if (size := cudagraph_sizes(starts[max(starts)])) is not None),
        exploratory=registered.exploratory, recorded_registration=(
            _display_path(sibling_of.path) if sibling_of is not None else None),
        engine_version=engine_version)


@dataclass(frozen=True)
class _Registered:
    """Phase 1 (registration): the registration analysed against and how it relates to the run's."""

    reg: Registration
    exp: Experiment
    header_registration: Mapping[str, Any]   # ``run.json``'s ``registration``
    sibling_of: Registration | None          # the run's own registration, when ``reg`` is a sibling
    exploratory: bool   # ``reg`` is a sibling sealed after the first record of the run


@dataclass(frozen=True)
class _Tables:
    """Phase 1 (load): the run's tables as read, with the lines that could not be read."""

    schedule: pd.DataFrame
    passes: pd.DataFrame
    metrics: pd.DataFrame
    environment: pd.DataFrame
    events: pd.DataFrame
    responses: pd.DataFrame
    gaps: tuple[str, ...]


@dataclass(frozen=True)
class _Matching:
    """Phase 3 (matching): the arms' match counts, their first divergences and anatomy."""

    arms: tuple[ArmSummary, ...]
    matches: Mapping[str, _ArmMatch]
    arm_passes: Mapping[str, list[int]]
    anatomy: anat.Anatomy
    last: pd.DataFrame          # the counted passes' responses
    duplicated: np.ndarray      # rows of ``last`` recorded again later (a resumed run)
    # arm -> the pass index of each of its ArmSummary.pass_throughputs (a paired cost interval)
    throughput_passes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


#: one control-treatment pair as the classifier takes it: the statistics of both arms, whether
#: the pair can be tested, the paired counts (McNemar) and the activation evidence of the treatment
_Pair = tuple[ArmStats, ArmStats, RunTestable, PairedCounts | None, ActivationEvidence]


def _registered(run: RecordedRun, registration: str | Path | Registration | None,
                deviations: list[str]) -> _Registered:
    """Phase 1 (registration): the run's registration, or the one given, its seal checked
    (:func:`bistat.declare.run_registration.run_registration`)."""
    run_dir, header = run.path, run.header
    if not isinstance(registration, Registration):
        registration = run_registration(run, registration).registration
    reg = registration
    hdr_reg = header.get("registration") or {}
    recorded_sha = hdr_reg.get("sha256") if isinstance(hdr_reg, Mapping) else None
    sibling_of = (_sibling_registration(hdr_reg, reg)
                  if recorded_sha is not None and recorded_sha != reg.sha256 else None)
    created = header.get("created_utc")
    exploratory = sibling_of is not None and sealed_after_data(reg, created)
    if exploratory:
        deviations.append(
            f"analysed under {reg.path} ({reg.sha256[:12]}), a sibling of the registration the run "
            f"was recorded under, {sibling_of.path} ({sibling_of.sha256[:12]}): the two declarations "
            f"differ only in their name and decision rule, and this one was sealed at "
            f"{reg.sealed_utc}, after the run's first record ({created}): an exploratory "
            "analysis, not a test of the hypothesis")
    elif sibling_of is not None:
        deviations.append(
            f"analysed under {reg.path} ({reg.sha256[:12]}), a sibling of the registration the run "
            f"was recorded under, {sibling_of.path} ({sibling_of.sha256[:12]}): the two declarations "
            "differ only in their name and decision rule, and both were sealed before the run")
    elif recorded_sha is not None and recorded_sha != reg.sha256:
        earlier = recorded_sha in reg.previous_sha256s
        raise AnalysisError(
            f"{run_dir / 'run.json'}: registration.sha256 {recorded_sha} is not the seal of "
            f"{reg.path} ({reg.sha256})"
            + ("; the run was recorded under an earlier seal, before an amendment"
               if earlier else "; the run was recorded under another registration"))
    return _Registered(reg, reg.experiment(), hdr_reg, sibling_of, exploratory)


def _load_tables(run: RecordedRun, unit: str) -> _Tables:
    """Phase 1 (load): every table the analysis reads, from the run opened once."""
    gaps: list[str] = []
    sched_read = run.load("schedule")
    gaps.extend(sched_read.gaps)
    pass_read = run.load("passes")
    gaps.extend(pass_read.gaps)
    met_read = run.load("metrics", ["arm", "seq", "t", "num_requests_running",
                                    "num_requests_waiting", "num_preemptions_total", "source"])
    gaps.extend(met_read.gaps)
    env_read = run.load("environment", ["arm", "block", "fingerprint", "engine", "log_findings",
                                        "modes"])
    gaps.extend(env_read.gaps)
    ev_read = run.load("events", ["arm", "event", "time_utc", "detail", "release_check"])
    gaps.extend(ev_read.gaps)
    resp_cols = ["arm", "kind", "pass_index", "prompt_id", "error", "t_submit", "t_done"]
    resp_cols += {"token_ids": ["token_sha256"], "text": ["text"],
                  "token_ids+logprobs": ["token_sha256", "logprob_sha256"]}[unit]
    resp_read = run.load("responses", resp_cols)
    gaps.extend(resp_read.gaps)
    return _Tables(sched_read.frame, pass_read.frame, met_read.frame, env_read.frame,
                   ev_read.frame, resp_read.frame, tuple(gaps))


def _pass_summaries(tables: _Tables, roles: Mapping[str, str],
                    deviations: list[str]) -> tuple[list[PassSummary], list[MetricsSeries]]:
    """Phase 2 (passes): every recorded pass, whether it counts, and its batching evidence."""
    passes_df, schedule, responses = tables.passes, tables.schedule, tables.responses
    walls = {(str(r["arm"]), int(r["seq"])): _opt_float(r.get("wall_s"))
             for r in (passes_df.to_dict("records") if not passes_df.empty else [])
             if _opt_int(r.get("seq")) is not None}
    batching, series = _batching(tables.metrics, walls)
    in_flight = _client_in_flight(responses)
    counted_keys = responses.loc[responses["kind"] == "counted", ["arm", "pass_index"]]
    with_responses = {(str(a), int(p)) for a, p in counted_keys.drop_duplicates().itertuples(
        index=False)}
    states = pass_states(passes_df, schedule, with_responses)   # kind, end status
    pass_rows: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in passes_df.to_dict("records") if not passes_df.empty else []:
        pass_rows[(str(rec["arm"]), int(rec["pass_index"]))] = rec
    starts: dict[tuple[str, int], dict[str, Any]] = {}
    if not schedule.empty:
        for rec in schedule[schedule["event"] == "start"].to_dict("records"):
            starts[(str(rec["arm"]), int(rec["pass_index"]))] = rec
    all_keys = sorted(states,
                      key=lambda k: (int((pass_rows.get(k) or starts.get(k) or {"seq": 10**9})
                                         .get("seq", 10**9)), k))
    passes: list[PassSummary] = []
    for arm, pidx in all_keys:
        rec = pass_rows.get((arm, pidx), {})
        st = starts.get((arm, pidx), {})
        kind, end = states[(arm, pidx)]
        seq = _opt_int(rec.get("seq", st.get("seq")))
        stat = end or "no end event"
        # "failed" = the pass ran to its end with some requests failed: it counts, and its failed
        # prompts are excluded from matching below; "interrupted" passes were re-run in full.
        counted = arm in roles and pass_counts(kind, end, (arm, pidx) in with_responses)
        b = batching.get((arm, seq if seq is not None else -1), {})
        batch_rec = rec.get("batching") if isinstance(rec.get("batching"), Mapping) else {}
        passes.append(PassSummary(
            arm=arm, seq=seq if seq is not None else -1, pass_index=pidx, kind=kind, status=stat,
            counted=counted, wall_s=_opt_float(rec.get("wall_s")),
            n_requests=_opt_int(rec.get("n_requests")), n_failed=_opt_int(rec.get("n_failed")),
            output_tokens=_opt_int(rec.get("output_tokens")),
            output_tokens_per_s=_opt_float(rec.get("output_tokens_per_s")),
            requests_per_s=_opt_float(rec.get("requests_per_s")),
            mean_running=b.get("mean_running", _opt_float(batch_rec.get("mean_running"))),
            max_running=b.get("max_running", _opt_float(batch_rec.get("max_running"))),
            mean_waiting=b.get("mean_waiting", _opt_float(batch_rec.get("mean_waiting"))),
            preemptions=b.get("preemptions", _opt_float(batch_rec.get("preemptions"))),
            n_metric_samples=int(b.get("n", 0)), client_in_flight=in_flight.get((arm, pidx)),
            running_hist=b.get("running_hist", _hist_pairs(batch_rec.get("running_hist"))),
            **_host_shares(rec.get("host"), _opt_float(rec.get("wall_s"))),
            **_gpu_fields(rec.get("gpu")), block=_opt_int(rec.get("block"))))
        if kind == "counted" and not counted and arm in roles:
            deviations.append(f"{arm} counted pass {pidx} (schedule position {seq}) ended "
                              f"'{stat}'; not counted")
    return passes, series


def _match(run: RecordedRun, exp: Experiment, responses: pd.DataFrame,
           passes: Sequence[PassSummary], deviations: list[str]) -> _Matching:
    """Phase 3 (matching): each arm's outputs over its counted passes, compared by the unit."""
    unit, multi = exp.match.unit, exp.match.multi_pass
    cl = exp.rule.confidence_level
    arm_names = [a.name for a in exp.arms]
    roles = {a.name: a.role for a in exp.arms}
    counted_rows = (responses["kind"] == "counted").to_numpy()
    last = responses[counted_rows]
    prompt_codes, prompt_ids = pd.factorize(last["prompt_id"], sort=True)
    arm_codes, arm_uniques = pd.factorize(last["arm"])
    arm_code = {str(a): i for i, a in enumerate(arm_uniques)}
    pass_idx = last["pass_index"].to_numpy(dtype=np.int64)
    row_key = ((arm_codes.astype(np.int64) * (int(pass_idx.max(initial=0)) + 1) + pass_idx)
               * (len(prompt_ids) + 1) + prompt_codes)
    dup = pd.Series(row_key).duplicated(keep="last").to_numpy()
    if dup.any():
        deviations.append(f"{int(dup.sum())} response(s) recorded twice for one prompt and pass "
                          "(resumed run); the last recorded counts")
    key_codes, _ = pd.factorize(_match_key(last, unit))
    failed_rows = last["error"].notna().to_numpy()
    prompt_ids = np.asarray(prompt_ids, dtype=object)
    arm_summaries: list[ArmSummary] = []
    matches: dict[str, _ArmMatch] = {}
    arm_passes: dict[str, list[int]] = {}
    thr_passes: dict[str, tuple[int, ...]] = {}
    for arm in arm_names:
        cpasses = sorted(p.pass_index for p in passes if p.arm == arm and p.counted)
        sel = (arm_codes == arm_code.get(arm, -2)) & np.isin(pass_idx, cpasses) & ~dup
        matches[arm] = _match_arm(prompt_codes[sel], key_codes[sel], failed_rows[sel],
                                  prompt_ids, len(cpasses), multi)
        arm_passes[arm] = cpasses
    # a trimmed run keeps other passes' outputs only to their first divergence from the
    # reference pass it assumed: refuse another reference or a unit that needs more
    run.check_trim({a: ps[0] if ps else None for a, ps in arm_passes.items()}, unit)
    outputs = _load_outputs(run, {a: m.mismatched for a, m in matches.items()}, unit)
    anatomy = _anatomy(outputs, run.run_id, unit, exp.match.near_tie_epsilon, arm_passes,
                       {a: m.mismatched for a, m in matches.items()},
                       {a: int(m.ok.sum()) for a, m in matches.items()})
    for arm in arm_names:
        m, cpasses = matches[arm], arm_passes[arm]
        divs = _divergences(outputs, arm, m.mismatched, cpasses, unit)
        interval = None
        if m.n_units > 0:
            interval = stats.wilson_interval(m.n_matched, m.n_units, cl, "two-sided")
        timed = [p for p in passes
                 if p.arm == arm and p.counted and p.output_tokens_per_s is not None]
        thr = tuple(float(p.output_tokens_per_s) for p in timed)
        thr_passes[arm] = tuple(int(p.pass_index) for p in timed)
        arm_summaries.append(ArmSummary(
            name=arm, role=roles[arm], counted_passes=tuple(cpasses),
            reference_pass=cpasses[0] if cpasses else None, n_prompts_recorded=m.n_recorded,
            n_prompts=int(m.ok.sum()), n_excluded_failed=m.n_failed_prompts,
            n_excluded_missing=m.n_missing, n_excluded_no_logprobs=m.n_no_logprobs,
            n_prompts_matched=int(m.matched.sum()),
            unit="prompt" if multi == "all" else "prompt pair",
            n_units=m.n_units, n_matched=m.n_matched, match_interval=interval,
            pass_throughputs=thr, n_failed_requests=m.n_failed_requests,
            divergences=tuple(divs)))
    return _Matching(tuple(arm_summaries), matches, arm_passes, anatomy, last, dup, thr_passes)


def _bad_events(events: pd.DataFrame) -> tuple[list[tuple[str, str, str | None]], list[str]]:
    """The engines' refusals and failed starts, and what else held the GPU, from the events."""
    bad_events: list[tuple[str, str, str | None]] = []
    gpu_busy: list[str] = []
    if not events.empty:
        for arm, event, detail in zip(events["arm"], events["event"], events["detail"]):
            if event in ("refused", "start_failed"):
                bad_events.append((str(arm), str(event), _opt_str(detail)))
            elif event == "gpu_busy":
                gpu_busy.append(_opt_str(detail) or "processes not named")
    return bad_events, gpu_busy


def _not_run(exp: Experiment, arms: Sequence[ArmSummary], passes: Sequence[PassSummary],
             envs: Mapping[str, ArmEnvironment], bad_events: Sequence[tuple[str, str, str | None]],
             gpu_busy: Sequence[str], gaps: Sequence[str], deviations: list[str]) -> list[str]:
    """Phase 4 (validity): what the declaration asked for and the run did not do; the
    departures from it go into ``deviations``."""
    not_run: list[str] = []
    wl = exp.workload
    for a in arms:
        n_counted = len(a.counted_passes)
        if n_counted == 0:
            not_run.append(f"arm {a.name}: no counted pass recorded (declared {wl.passes})")
        elif n_counted < wl.passes:
            not_run.append(f"arm {a.name}: {wl.passes - n_counted} of {wl.passes} declared "
                           "counted passes not recorded")
        elif n_counted > wl.passes:
            deviations.append(f"arm {a.name}: {n_counted} counted passes recorded, "
                              f"{wl.passes} declared")
        mine = [p for p in passes if p.arm == a.name and p.counted]
        if mine and all(p.n_requests and p.n_failed == p.n_requests for p in mine):
            not_run.append(f"arm {a.name}: its {len(mine)} counted pass(es) ran, but the engine "
                           "answered none of their requests (every request failed)")
        # Warm-ups run after every engine start (restarts per block, resumes), so the declared
        # count applies per start of the arm's engine.
        n_warm = len({p.pass_index for p in passes if p.arm == a.name and p.kind == "warmup"
                      and p.status != "interrupted"})
        n_starts = envs[a.name].n_starts if a.name in envs else 1
        if n_warm != wl.warmup_passes * max(n_starts, 1):
            deviations.append(f"arm {a.name}: {n_warm} warm-up pass(es) recorded, "
                              f"{wl.warmup_passes} declared per engine start "
                              f"({max(n_starts, 1)} start(s))")
        if a.n_excluded_failed:
            deviations.append(f"arm {a.name}: {a.n_failed_requests} failed request(s) in counted "
                              f"passes; {a.n_excluded_failed} prompt(s) excluded from matching")
        if a.n_excluded_missing:
            deviations.append(f"arm {a.name}: {a.n_excluded_missing} prompt(s) missing from a "
                              "counted pass; excluded from matching")
        if a.n_excluded_no_logprobs:
            deviations.append(f"arm {a.name}: {a.n_excluded_no_logprobs} prompt(s) without "
                              "logprobs; excluded from matching")
        if a.n_prompts_recorded and a.n_prompts_recorded != wl.n_prompts:
            deviations.append(f"arm {a.name}: {a.n_prompts_recorded} prompts recorded, "
                              f"{wl.n_prompts} declared")
    for p in passes:
        if p.counted and p.n_requests is not None and p.n_requests != wl.n_prompts:
            deviations.append(f"{p.arm} pass {p.pass_index}: {p.n_requests} requests, "
                              f"{wl.n_prompts} declared")
    for arm, event, detail in bad_events:
        not_run.append(f"arm {arm}: engine {event.replace('_', ' ')}" +
                       (f" ({detail})" if detail else ""))
    for detail in gpu_busy:
        deviations.append(f"other processes held the GPU when the run (or a resume) started, "
                          f"allowed with --allow-busy-gpu: {detail}; they shared its memory and "
                          f"time with the arms' engines")
    if gaps:
        deviations.append(f"{len(gaps)} unreadable record line(s) ignored (see Data gaps)")
    return not_run


def _untestable(bad_events: Sequence[tuple[str, str, str | None]],
                arms: Sequence[ArmSummary], declared_passes: int) -> list[tuple[str, str]]:
    """Phase 4 (validity): why an arm cannot be tested, each reason with its arm (a comparison is
    untested only for reasons of its own two arms: an arm whose engine died does not make the
    comparisons of the other arms untestable).

    An arm with fewer counted passes than registered did not run the registered test: with
    ``multi_pass = "all"`` fewer passes give fewer chances to diverge (a lenient test), and a cost
    decided on them was not the one planned. Its numbers are still reported (a pilot); the
    comparison's label is *untested*."""
    arm_reasons: list[tuple[str, str]] = []
    for arm, event, detail in bad_events:
        arm_reasons.append((arm, f"arm {arm}: engine {event.replace('_', ' ')}"
                            + (f": {detail}" if detail else "")))
    for a in arms:
        if not a.counted_passes:
            arm_reasons.append((a.name, f"arm {a.name}: no counted pass recorded"))
        elif len(a.counted_passes) < 2:
            # one pass always matches itself: comparing it would report "identical" for nothing
            arm_reasons.append((a.name, f"arm {a.name}: only {len(a.counted_passes)} counted pass "
                                "recorded; a comparison needs at least 2 counted passes per arm"))
        elif len(a.counted_passes) < declared_passes:
            arm_reasons.append((a.name, f"arm {a.name}: stopped early, {len(a.counted_passes)} "
                                f"of {declared_passes} registered counted passes recorded (a "
                                "pilot: the registered test did not run in full)"))
        elif a.n_prompts_recorded and a.n_prompts == 0 and a.n_excluded_failed == \
                a.n_prompts_recorded:
            arm_reasons.append((a.name, f"arm {a.name}: every prompt had a failed request"))
        elif a.n_units == 0:
            arm_reasons.append((a.name, f"arm {a.name}: no prompt could be compared"))
    return arm_reasons


def _comparisons(exp: Experiment, matching: _Matching, validity: Sequence[ValidityCheck],
                 arm_reasons: Sequence[tuple[str, str]],
                 evidence: Mapping[str, ActivationEvidence],
                 ) -> tuple[list[ArmComparison], list[_Pair]]:
    """Phase 5 (comparisons): every treatment against the control, classified under the rule."""
    rule = exp.rule
    cl = rule.confidence_level
    arm_summaries, matches = matching.arms, matching.matches
    large_drifts = matching.anatomy.large_drifts()
    timed = _pass_latencies(matching.last[~matching.duplicated], matching.arm_passes)
    latencies = {arm: tuple(v for _, v in pv) for arm, pv in timed.items()}
    latency_passes = {arm: tuple(k for k, _ in pv) for arm, pv in timed.items()}
    thr_passes = matching.throughput_passes
    control = next(a for a in arm_summaries if a.role == "control")
    comparisons: list[ArmComparison] = []
    pairs: list[_Pair] = []
    for treat in (a for a in arm_summaries if a.role == "treatment"):
        mc, mt = matches[control.name], matches[treat.name]
        paired = mc.ok & mt.ok
        n_paired = int(paired.sum())
        mcn = None
        counts = None
        if n_paired:
            b = int((paired & mc.matched & ~mt.matched).sum())
            c = int((paired & ~mc.matched & mt.matched).sum())
            mcn = stats.mcnemar_test(b, c)
            counts = PairedCounts(n_paired, b, c)
        diff = None
        if treat.n_units and control.n_units:
            diff = stats.newcombe_difference(treat.n_matched, treat.n_units, control.n_matched,
                                             control.n_units, cl)
        ratio = None
        point = None
        tt, ct = treat.pass_throughputs, control.pass_throughputs
        if tt and ct and all(x > 0 for x in tt + ct):
            point = stats.ratio_of_geometric_means(tt, ct)   # the classifier's point, exactly
            if len(tt) >= 2 and len(ct) >= 2:
                ratio = stats.throughput_ratio(tt, ct, cl)
        pair = (ArmStats(control.name, "control", control.n_units, control.n_matched, ct,
                         large_drifts=large_drifts.get(control.name),
                         pass_latencies=latencies.get(control.name, ()),
                         throughput_passes=thr_passes.get(control.name, ()),
                         latency_passes=latency_passes.get(control.name, ())),
                ArmStats(treat.name, "treatment", treat.n_units, treat.n_matched, tt,
                         large_drifts=large_drifts.get(treat.name),
                         pass_latencies=latencies.get(treat.name, ()),
                         throughput_passes=thr_passes.get(treat.name, ()),
                         latency_passes=latency_passes.get(treat.name, ())),
                _pair_status(arm_reasons, control.name, treat.name), counts,
                evidence[treat.name])
        pairs.append(pair)
        verdict = classify(rule, pair[0], pair[1], validity=tuple(validity), status=pair[2],
                           paired=counts, evidence=pair[4])
        comparisons.append(ArmComparison(control.name, treat.name, n_paired, mcn, diff, ratio,
                                         point, verdict))
    return comparisons, pairs


def _sibling_verdicts(reg: Registration, created: str | None, passes: Sequence[PassSummary],
                      fps: Any, envs: Mapping[str, ArmEnvironment],
                      pairs: Sequence[_Pair]) -> list[SiblingVerdict]:
    """Phase 6 (siblings): the same comparisons under the sibling registrations' rules."""
    siblings: list[SiblingVerdict] = []
    for sib in sibling_registrations(reg):
        sib_exp = sib.experiment()
        sib_later = sealed_after_data(sib, created)
        sib_validity = tuple(_validity(sib_exp, passes, fps, envs, sib.sealed_utc, created,
                                       exploratory=sib_later))
        for ctl_stats, trt_stats, pair_status, counts, ev in pairs:
            siblings.append(SiblingVerdict(
                _display_path(sib.path), sib_exp.name, trt_stats.name, ctl_stats.name,
                classify(sib_exp.rule, ctl_stats, trt_stats, validity=sib_validity,
                         status=pair_status, paired=counts, evidence=ev),
                exploratory=sib_later, sealed_utc=sib.sealed_utc))
    return siblings


# --- the phases' helpers ----------------------------------------------------------------------


def _opt_str(x: Any) -> str | None:
    """A string field as read (pandas gives NaN / NA for a missing string), or None."""
    if x is None or (not isinstance(x, str) and pd.isna(x)):
        return None
    return str(x)


def _opt_int(x: Any) -> int | None:
    v = _opt_float(x)
    return None if v is None else int(v)


# --------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------


def _match_key(resp: pd.DataFrame, unit: str) -> pd.Series:
    if unit == "token_ids":
        return resp["token_sha256"]
    if unit == "text":
        return resp["text"]
    if unit == "token_ids+logprobs":
        tok, lp = resp["token_sha256"], resp["logprob_sha256"]
        both = tok.notna() & lp.notna()
        key = pd.Series(None, index=resp.index, dtype=object)
        key[both] = tok[both].astype(str) + "|" + lp[both].astype(str)
        return key
    raise AnalysisError(f"match unit {unit!r} is not known; expected 'token_ids', 'text' or "
                        "'token_ids+logprobs'")


@dataclass
class _ArmMatch:
    ok: np.ndarray             # bool per prompt code: compared
    matched: np.ndarray        # bool per prompt code: identical in every counted pass
    mismatched: list[str]      # prompt ids compared and not identical, sorted
    n_recorded: int
    n_failed_prompts: int
    n_missing: int
    n_no_logprobs: int
    n_units: int
    n_matched: int
    n_failed_requests: int


def _match_arm(pid: np.ndarray, key: np.ndarray, failed: np.ndarray, prompt_ids: np.ndarray,
               n_passes: int, multi_pass: str) -> _ArmMatch:
    """Count matches of one arm from its counted responses (one row per prompt x pass).

    ``pid`` and ``key`` are integer codes (prompt, match key; ``key < 0``: no key), ``failed``
    marks failed requests, ``prompt_ids`` maps prompt codes back to ids. Vectorised with
    ``np.bincount`` / ``np.unique`` so that 10^6 responses take well under a second.
    """
    n = len(prompt_ids)
    n_rows = np.bincount(pid, minlength=n)
    present = n_rows > 0
    any_failed = np.bincount(pid, weights=failed, minlength=n) > 0
    no_key_row = (key < 0) & ~failed
    any_no_key = np.bincount(pid, weights=no_key_row, minlength=n) > 0
    is_failed = present & any_failed
    is_missing = present & (n_rows < n_passes) & ~is_failed
    is_no_key = present & any_no_key & ~is_failed & ~is_missing
    ok = present & ~is_failed & ~is_missing & ~is_no_key
    rows = ok[pid]
    n_keys = int(key.max()) + 2 if key.size else 1
    pairs = pid[rows].astype(np.int64) * n_keys + (key[rows].astype(np.int64) + 1)
    uniq, counts = np.unique(pairs, return_counts=True)
    n_unique = np.bincount(uniq // n_keys, minlength=n)
    matched = ok & (n_unique == 1)
    mismatched = [str(x) for x in prompt_ids[ok & ~matched]]
    if multi_pass == "all":
        n_units, n_matched = int(ok.sum()), int(matched.sum())
    elif multi_pass == "pairwise":
        n_matched = int((counts * (counts - 1) // 2).sum())
        n_units = int(ok.sum()) * n_passes * (n_passes - 1) // 2
    else:
        raise AnalysisError(f"multi_pass {multi_pass!r} is not known; expected 'all' or 'pairwise'")
    return _ArmMatch(
        ok=ok, matched=matched, mismatched=sorted(mismatched), n_recorded=int(present.sum()),
        n_failed_prompts=int(is_failed.sum()), n_missing=int(is_missing.sum()),
        n_no_logprobs=int(is_no_key.sum()), n_units=n_units, n_matched=n_matched,
        n_failed_requests=int(failed.sum()),
    )


#: Columns read for the mismatching prompts: first divergences and their anatomy.
_OUTPUT_COLUMNS = ["arm", "seq", "kind", "pass_index", "prompt_id", "token_ids", "text",
                   "logprobs", "top_logprobs", "finish_reason", "n_prompt_tokens", "t_submit",
                   "t_done", "error", OUTPUT_LENGTH]


def _load_outputs(run: RecordedRun, mismatched: Mapping[str, Sequence[str]], unit: str
                  ) -> pd.DataFrame:
    """Outputs (token ids, logprobs, top-k...) of the mismatching prompts only, in one read."""
    cols = list(_OUTPUT_COLUMNS)
    arms = [a for a, ids in mismatched.items() if ids]
    if not arms:
        return pd.DataFrame({c: [] for c in cols})
    prompts = sorted({p for a in arms for p in mismatched[a]})
    return run.table("responses", cols, filters={"arm": arms, "prompt_id": prompts})


def _divergences(got: pd.DataFrame, arm: str, mismatched: Sequence[str], passes: Sequence[int],
                 unit: str) -> list[Divergence]:
    """First-divergence positions of the mismatching prompts of one arm."""
    if not mismatched:
        return []
    got = got[got["arm"] == arm]
    counted = set(passes)
    outputs: dict[tuple[str, int], tuple[list, list | None, int | None]] = {}
    lps = (got["logprobs"].tolist() if unit == "token_ids+logprobs" and "logprobs" in got
           else [None] * len(got))
    n_prompt = (got["n_prompt_tokens"].tolist() if "n_prompt_tokens" in got
                else [None] * len(got))
    # the last response recorded per (prompt, pass) counts, as in the match count
    for kind, p, pid, ids, lp, npt in zip(got["kind"].tolist(), got["pass_index"].tolist(),
                                          got["prompt_id"].tolist(), got["token_ids"].tolist(),
                                          lps, n_prompt):
        if kind == "counted" and int(p) in counted:
            outputs[(pid, int(p))] = (ids or [], lp, _opt_int(npt))
    ref_pass = min(passes)
    others = sorted(counted - {ref_pass})
    out: list[Divergence] = []
    for pid in mismatched:
        ref = outputs.get((pid, ref_pass))
        if ref is None:
            continue
        for p in others:
            cur = outputs.get((pid, p))
            if cur is None:
                continue
            pos = divergence_position(ref[0], cur[0], ref[1], cur[1], unit)
            if pos is not None:
                out.append(Divergence(arm=arm, prompt_id=str(pid), pass_index=p,
                                      reference_pass=ref_pass, position=pos,
                                      n_prompt_tokens=ref[2]))
    return out


def _pass_outputs(got: pd.DataFrame, arm: str, passes: Sequence[int]
                  ) -> dict[tuple[int, str], anat.PassOutput]:
    """Successful responses of one arm's counted passes by (pass, prompt); the last recorded wins."""
    out: dict[tuple[int, str], anat.PassOutput] = {}
    if got.empty:
        return out
    counted = {int(p) for p in passes}
    rows = got[(got["arm"] == arm) & (got["kind"] == "counted")]
    for row in rows.itertuples(index=False):
        key = (int(row.pass_index), str(row.prompt_id))
        if key[0] not in counted:
            continue
        if _opt_str(row.error) is not None:
            out.pop(key, None)
            continue
        ids = row.token_ids if row.token_ids is not None else ()
        lps, top = row.logprobs, row.top_logprobs
        out[key] = anat.PassOutput(
            arm=arm, pass_index=key[0], seq=_opt_int(row.seq), prompt_id=key[1],
            token_ids=tuple(int(t) for t in ids), text=_opt_str(row.text),
            logprobs=None if lps is None else tuple(_opt_float(x) for x in lps),
            top_logprobs=None if top is None else tuple(
                tuple(sorted(((int(t), _opt_float(lp)) for t, lp in pos),  # as bistat.analysis.anatomy
                             key=lambda e: (math.inf if e[1] is None else -e[1], e[0])))
                for pos in top),
            finish_reason=_opt_str(row.finish_reason), n_prompt_tokens=_opt_int(row.n_prompt_tokens),
            t_submit=_opt_float(row.t_submit), t_done=_opt_float(row.t_done),
            n_output_tokens=_opt_int(getattr(row, OUTPUT_LENGTH)))
    return out


def _anatomy(got: pd.DataFrame, run_id: str, unit: str, epsilon: float,
             arm_passes: Mapping[str, Sequence[int]], mismatched: Mapping[str, Sequence[str]],
             n_compared: Mapping[str, int]) -> anat.Anatomy:
    """The divergence anatomy over the mismatching prompts (what ``bistat.analysis.anatomy`` defines).

    Only mismatching prompts can diverge, so reading their rows alone gives every divergence;
    each counted pass is compared with the arm's reference pass (its first counted pass).
    """
    divs: list[anat.DivergenceAnatomy] = []
    arms: list[anat.ArmAnatomy] = []
    top_k: int | None = None
    for arm, plist in arm_passes.items():
        plist = sorted(plist)
        outputs = _pass_outputs(got, arm, plist) if mismatched.get(arm) else {}
        for o in outputs.values():
            for pos in o.top_logprobs or ():
                top_k = max(top_k or 0, len(pos))
        ref_pass = plist[0] if plist else None
        arm_divs: list[anat.DivergenceAnatomy] = []
        for pid in sorted(mismatched.get(arm, ())):
            ref = outputs.get((ref_pass, pid)) if ref_pass is not None else None
            if ref is None:
                continue
            for p in plist[1:]:
                other = outputs.get((p, pid))
                if other is None:
                    continue
                d = anat.anatomy_of_pair(arm, ref, other, unit, epsilon)
                if d is not None:
                    arm_divs.append(d)
        arms.append(anat.arm_anatomy(arm, ref_pass, plist, int(n_compared.get(arm, 0)),
                                     arm_divs))
        divs.extend(arm_divs)
    return anat.Anatomy(run_id=run_id, unit=unit, epsilon=float(epsilon), top_k=top_k,
                        arms=tuple(arms), divergences=tuple(divs))


# --------------------------------------------------------------------------------------------
# Batching evidence
# --------------------------------------------------------------------------------------------


def _batching(metrics: pd.DataFrame, walls: Mapping[tuple[str, int], float | None]
              ) -> tuple[dict[tuple[str, int], dict[str, Any]], list[MetricsSeries]]:
    """Per (arm, seq): the batching summary of :func:`bistat.run.batching.batching_summary` -- the
    runner's own, time-weighted, recomputed from the metrics samples -- with the sample count,
    and the running requests over time for the plot. ``walls``: each pass's wall time (the last
    sample stands for the time until the pass ended)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    series: list[MetricsSeries] = []
    if metrics.empty:
        return out, series
    m = metrics[metrics["num_requests_running"].notna()]
    m = m.sort_values(["arm", "seq", "t"], kind="stable")
    for (arm, seq), grp in m.groupby(["arm", "seq"], sort=True):
        t = grp["t"].to_numpy(dtype=float)
        running = grp["num_requests_running"].to_numpy(dtype=float)
        waiting = grp["num_requests_waiting"].to_numpy(dtype=float)
        pre = grp["num_preemptions_total"].to_numpy(dtype=float)
        sources = (grp["source"].tolist() if "source" in grp else [""] * len(grp))
        samples = [MetricsSample(t=a, num_requests_running=b, num_requests_waiting=c,
                                 num_preemptions_total=d, generation_tokens_total=math.nan,
                                 prompt_tokens_total=math.nan, source=_opt_str(src) or "")
                   for a, b, c, d, src in zip(t.tolist(), running.tolist(), waiting.tolist(),
                                              pre.tolist(), sources)]
        wall = walls.get((str(arm), int(seq)))
        summary = batching_summary(samples, -1.0 if wall is None else float(wall))
        out[(str(arm), int(seq))] = {
            "mean_running": summary["mean_running"], "max_running": summary["max_running"],
            "mean_waiting": summary["mean_waiting"], "preemptions": summary["preemptions"],
            "n": int(running.size), "running_hist": _hist_pairs(summary["running_hist"])}
        series.append(MetricsSeries(str(arm), int(seq), tuple(t.tolist()),
                                    tuple(running.tolist())))
    return out, series


def _hist_pairs(hist: Any) -> tuple[tuple[int, float], ...]:
    """``running_hist`` ({count (str): seconds}) as (count, seconds) pairs in count order."""
    if not isinstance(hist, Mapping):
        return ()
    pairs = []
    for k, v in hist.items():
        count, secs = _opt_int(k), _opt_float(v)
        if count is not None and secs is not None:
            pairs.append((count, secs))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class BeyondGraphs:
    """How much of an arm's counted time ran more requests than its largest CUDA-graph size."""

    arm: str
    sizes: CudaGraphSizes
    seconds_total: float          # counted passes' time with metrics samples
    seconds_beyond: float         # of it, with more requests running than sizes.max_capture_size
    n_passes: int                 # counted passes with samples

    @property
    def share(self) -> float:
        return self.seconds_beyond / self.seconds_total if self.seconds_total > 0 else 0.0

    @property
    def per_pass(self) -> tuple[float, float]:
        """(seconds, of them beyond the largest graph size) per counted pass, on average."""
        return self.seconds_total / self.n_passes, self.seconds_beyond / self.n_passes

    def extra_over(self, control: "BeyondGraphs") -> tuple[float, float]:
        """Per counted pass, this arm's extra seconds over ``control``'s: (in all, of them with
        more requests running than the largest graph size)."""
        (t, b), (ct, cb) = self.per_pass, control.per_pass
        return t - ct, b - cb


def _host_shares(host: Any, wall_s: float | None) -> dict[str, float | None]:
    """A pass's ``host`` record as shares of its CPU time (n_cpus x wall_s); {} if unusable."""
    if not isinstance(host, Mapping) or not wall_s or wall_s <= 0:
        return {}
    try:
        capacity = float(host["n_cpus"]) * wall_s
        busy, steal, own = (float(host[k]) for k in ("busy_s", "steal_s", "own_cpu_s"))
    except (KeyError, TypeError, ValueError):
        return {}
    if not capacity > 0 or not all(math.isfinite(x) for x in (busy, steal, own)):
        return {}
    return {"host_busy_share": min(1.0, busy / capacity),
            "host_steal_share": min(1.0, steal / capacity),
            "host_other_share": min(1.0, max(0.0, busy - own) / capacity)}


def _gpu_fields(gpu: Any) -> dict[str, float | None]:
    """A pass's ``gpu`` record as PassSummary fields; {} without one or without samples."""
    if not isinstance(gpu, Mapping) or not _opt_int(gpu.get("n_samples")):
        return {}
    return {"gpu_sm_clock_mhz": _opt_float(gpu.get("sm_clock_mhz_mean")),
            "gpu_sm_clock_min_mhz": _opt_float(gpu.get("sm_clock_mhz_min")),
            "gpu_temperature_max_c": _opt_float(gpu.get("temperature_c_max")),
            "gpu_power_w": _opt_float(gpu.get("power_w_mean")),
            "gpu_slowdown_share": _opt_float(gpu.get("slowdown_share"))}


@dataclass(frozen=True)
class GpuClocks:
    """The GPU's clock, temperature and power over the counted passes, and whether the slow
    passes were the ones at a lower SM clock (:func:`gpu_clocks`)."""

    #: per arm: (arm, counted passes with samples, median SM clock, lowest SM clock, hottest
    #: temperature, median power, passes with a slowdown reason active in any sample);
    #: None where the driver did not report the field
    arms: tuple[tuple[str, int, float | None, float | None, float | None, float | None, int],
                ...]
    #: Spearman's rank correlation over the counted passes between each pass's log wall time
    #: less its arm's mean and its mean SM clock; None with < 5 passes or no spread
    rho: float | None
    p_value: float | None
    n: int

    @property
    def slow_at_lower_clock(self) -> bool:
        """The slower passes ran at lower SM clocks (rho < 0, p < 0.05)."""
        return self.rho is not None and self.rho < 0 and (self.p_value or 1.0) < 0.05


def gpu_clocks(summary: "RunSummary") -> GpuClocks | None:
    """The GPU over the counted passes (None when no pass was sampled).

    As :func:`host_load` does for the host: within each arm a pass's log wall time less the
    arm's mean, against its mean SM clock (``scipy.stats.spearmanr``), so that a clock that fell
    as the GPU warmed shows beside a drift that slowed both arms alike.
    """
    rows = [p for p in summary.passes if p.counted and p.wall_s and p.wall_s > 0
            and any(v is not None for v in (p.gpu_sm_clock_mhz, p.gpu_temperature_max_c,
                                            p.gpu_power_w, p.gpu_slowdown_share))]
    if not rows:
        return None

    def median(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return float(np.median(vals)) if vals else None

    def extreme(values: list[float | None], pick: Callable[..., float]) -> float | None:
        vals = [v for v in values if v is not None]
        return float(pick(vals)) if vals else None

    groups = _by_arm(summary, rows)
    arms = tuple((arm, len(mine), median([p.gpu_sm_clock_mhz for p in mine]),
                  extreme([p.gpu_sm_clock_min_mhz for p in mine], min),
                  extreme([p.gpu_temperature_max_c for p in mine], max),
                  median([p.gpu_power_w for p in mine]),
                  sum(1 for p in mine if (p.gpu_slowdown_share or 0.0) > 0))
                 for arm, mine in groups)
    return GpuClocks(arms, *_pass_time_against(groups, lambda p: p.gpu_sm_clock_mhz))


def _by_arm(summary: "RunSummary", rows: list[PassSummary]
            ) -> list[tuple[str, list[PassSummary]]]:
    """``rows`` grouped by arm, in declaration order (arms without a row left out)."""
    groups = [(arm, [p for p in rows if p.arm == arm]) for arm in [a.name for a in summary.arms]]
    return [(arm, mine) for arm, mine in groups if mine]


def _pass_time_against(groups: list[tuple[str, list[PassSummary]]],
                       value: Callable[[PassSummary], float | None]
                       ) -> tuple[float | None, float | None, int]:
    """Spearman's rho (``scipy.stats.spearmanr``) and its p-value of each pass's log wall time
    less its arm's mean against ``value(pass)``, over the passes with a value, and how many
    there were; no rho with fewer than 5 or without spread on either side. Within each arm, so
    that the arms' own speeds do not make a correlation."""
    from scipy import stats as sps

    resid: list[float] = []
    xs: list[float] = []
    for _, mine in groups:
        timed = [p for p in mine if value(p) is not None]
        if timed:
            logs = np.log([p.wall_s for p in timed])
            resid += list(logs - logs.mean())
            xs += [float(value(p)) for p in timed]
    if len(resid) >= 5 and len(set(xs)) > 1 and np.ptp(resid) > 0:
        res = sps.spearmanr(resid, xs)
        return float(res.statistic), float(res.pvalue), len(resid)
    return None, None, len(resid)


@dataclass(frozen=True)
class HostLoad:
    """How busy the host was during the counted passes, and whether the slow ones were the busy
    ones (:func:`host_load`)."""

    #: per arm: (arm, counted passes with a host record, median busy, steal, other shares)
    arms: tuple[tuple[str, int, float, float, float], ...]
    #: Spearman's rank correlation over the counted passes between each pass's log wall time
    #: less its arm's mean and the share of CPU time other processes used; None with < 5 passes
    rho: float | None
    p_value: float | None
    n: int

    @property
    def slow_when_busy(self) -> bool:
        """The slower passes coincided with more CPU time used by other processes (p < 0.05)."""
        return self.rho is not None and self.rho > 0 and (self.p_value or 1.0) < 0.05


def host_load(summary: "RunSummary") -> HostLoad | None:
    """The host's load over the counted passes (None when no pass recorded one).

    Within each arm a pass's log wall time is taken relative to the arm's mean, so that the
    arms' own speeds do not make a correlation; Spearman's rho (``scipy.stats.spearmanr``) of
    those residuals against the share of CPU time used by processes other than bistat's own.
    """
    rows = [p for p in summary.passes if p.counted and p.host_busy_share is not None
            and p.wall_s and p.wall_s > 0]
    if not rows:
        return None
    groups = _by_arm(summary, rows)
    arms = tuple((arm, len(mine),
                  float(np.median([p.host_busy_share for p in mine])),
                  float(np.median([p.host_steal_share for p in mine])),
                  float(np.median([p.host_other_share for p in mine])))
                 for arm, mine in groups)
    return HostLoad(arms, *_pass_time_against(groups, lambda p: p.host_other_share))


@dataclass(frozen=True)
class EngineStarts:
    """The counted passes of a run whose arms' engines started more than once (one engine at a
    time, or a resumed run): whether passes of one start were more alike than passes of
    different starts, and each comparison's ratio with each start as one observation
    (:func:`engine_starts`)."""

    #: per arm: (arm, counted passes, engine starts they ran in)
    arms: tuple[tuple[str, int, int], ...]
    #: the nested F test of the starts within each arm on log throughput
    #: (``bistat.core.stats.block_effect_test``); None when no start held two counted passes
    effect: stats.BlockEffect | None
    #: per comparison: (treatment, control, its per-pass Welch ratio (``ArmComparison.ratio``),
    #: the ratio of the starts' geometric means with its Welch interval); either None with
    #: fewer than 2 of its units per arm
    ratios: tuple[tuple[str, str, stats.RatioResult | None, stats.RatioResult | None], ...]

    @property
    def starts_differ(self) -> bool:
        """Passes of one start were more alike than passes of different starts (p < 0.05)."""
        return self.effect is not None and self.effect.p_value < 0.05


def engine_starts(summary: "RunSummary") -> EngineStarts | None:
    """The engine starts behind the counted passes; None unless an arm's counted passes ran in
    two or more starts of its engine.

    A pass-level interval (Welch's or the paired one) treats the passes as independent. Passes
    of one engine start share that start's speed (what was compiled, where memory landed, the
    GPU's state then): where starts differ, the passes are clustered and the interval covers
    less than its level (simulated for ABBA one engine at a time, a start-to-start SD equal to
    the pass-to-pass SD: 89 % for a 95 % interval; tests/test_engine_starts.py). Each start's
    geometric mean as one observation gives an interval that holds its level; it is shown as a
    sensitivity analysis beside the sealed rule's, which still decides.
    """
    rows = [p for p in summary.passes if p.counted and p.block is not None
            and p.output_tokens_per_s is not None and p.output_tokens_per_s > 0]
    groups = _by_arm(summary, rows)
    blocks = {arm: {} for arm, _ in groups}
    for arm, mine in groups:
        for p in mine:
            blocks[arm].setdefault(p.block, []).append(float(p.output_tokens_per_s))
    if not any(len(b) >= 2 for b in blocks.values()):
        return None
    arms = tuple((arm, len(mine), len(blocks[arm])) for arm, mine in groups)
    try:
        effect = stats.block_effect_test([list(b.values()) for b in blocks.values()])
    except ValueError:                       # no start held two counted passes
        effect = None

    def per_start(c: ArmComparison) -> stats.RatioResult | None:
        t, k = ([stats.geometric_mean(v) for v in blocks.get(arm, {}).values()]
                for arm in (c.treatment, c.control))
        return (stats.throughput_ratio(t, k, summary.confidence_level)
                if len(t) >= 2 and len(k) >= 2 else None)
    # beside each comparison's own per-pass ratio, the one its Throughput table shows
    ratios = tuple((c.treatment, c.control, c.ratio, per_start(c)) for c in summary.comparisons)
    return EngineStarts(arms, effect, ratios)


def time_beyond_graphs(summary: "RunSummary") -> list[BeyondGraphs]:
    """Per arm whose engine logged its CUDA-graph sizes: the time-weighted share of its counted
    passes with more requests running than ``max_cudagraph_capture_size``.

    A decode step takes one token per running request and a prefill more, so each such step had
    more tokens than any captured graph and ran without one: the share is a lower bound on the
    time spent in such steps (all of it where the logged ``cudagraph_mode`` is ``NONE``). Arms in
    declaration order; those without sizes or samples left out.
    """
    sizes = dict(summary.cudagraph_sizes)
    out = []
    for arm in [a.name for a in summary.arms]:
        size = sizes.get(arm)
        if size is None or size.max_capture_size is None:
            continue
        hists = [p.running_hist for p in summary.passes
                 if p.arm == arm and p.counted and p.running_hist]
        if not hists:
            continue
        total = math.fsum(sec for h in hists for _, sec in h)
        beyond = (total if size.cudagraph_mode == "NONE" else   # no step replays a graph
                  math.fsum(sec for h in hists for n, sec in h if n > size.max_capture_size))
        out.append(BeyondGraphs(arm, size, total, beyond, len(hists)))
    return out


# --------------------------------------------------------------------------------------------
# Environment and validity
# --------------------------------------------------------------------------------------------


def _environments(env: pd.DataFrame, arm_names: Sequence[str]) -> tuple[
        dict[str, ArmEnvironment], dict[str, list[Mapping[str, Any]]]]:
    envs: dict[str, ArmEnvironment] = {}
    fps: dict[str, list[Mapping[str, Any]]] = {}
    if env.empty:
        return envs, fps
    for arm in arm_names:
        rows = env[env["arm"] == arm]
        if rows.empty:
            continue
        prints = [fp if isinstance(fp, Mapping) else {} for fp in rows["fingerprint"]]
        fps[arm] = prints
        gpus: dict[str, None] = {}
        uuids: dict[str, None] = {}
        for fp in prints:
            for g in fp.get("gpus") or []:
                gpus.setdefault(f"{g.get('name')} ({g.get('uuid')}, driver {g.get('driver')})")
                uuids.setdefault(str(g.get("uuid")))
        last = prints[-1]
        versions = last.get("versions") or {}
        engine = rows["engine"].iloc[-1] if "engine" in rows else None
        engine = engine if isinstance(engine, Mapping) else {}
        engine_text = " ".join(str(x) for x in (engine.get("kind"), engine.get("version"))
                               if x is not None) or "unknown"
        logs: dict[str, None] | None = None
        if "log_findings" in rows:
            for found in rows["log_findings"]:
                if isinstance(found, (list, tuple)):
                    logs = logs if logs is not None else {}
                    for line in found:
                        logs.setdefault(_strip_pid(str(line)))
        envs[arm] = ArmEnvironment(
            gpus=tuple(gpus), gpu_uuids=tuple(uuids),
            versions=tuple((k, None if versions.get(k) is None else str(versions.get(k)))
                           for k in VERSION_KEYS),
            engine=engine_text, host=last.get("host"), n_starts=len(prints),
            log_findings=None if logs is None else tuple(logs))
    return envs, fps


_LOG_PREFIX = re.compile(r"^\((?:EngineCore|APIServer|Worker|MainProcess)[^)]*pid=\d+\)\s*")
_LOG_STAMP = re.compile(r"^(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d ")


def _strip_pid(line: str) -> str:
    """A log line without vLLM's process prefix and time stamp (so starts compare equal)."""
    return _LOG_STAMP.sub(r"\1 ", _LOG_PREFIX.sub("", line.strip()))


def _validity(exp: Experiment, passes: Sequence[PassSummary],
              fps: Mapping[str, list[Mapping[str, Any]]], envs: Mapping[str, ArmEnvironment],
              registered_utc: str, created_utc: str | None, *, exploratory: bool = False
              ) -> list[ValidityCheck]:
    """The declared validity checks. ``exploratory``: the rule was sealed after the data (a
    sibling registered later): the order is then stated as the analysis's nature, not checked."""
    checks: list[ValidityCheck] = []
    v = exp.validity
    counted = [p for p in passes if p.counted]
    if created_utc is not None and not exploratory:
        try:
            ok: bool | None = parse_time(registered_utc) <= parse_time(created_utc)
        except (TypeError, ValueError):
            ok = None
        checks.append(ValidityCheck(
            name="registration precedes data", passed=ok, observed=created_utc,
            limit=f"after {registered_utc}",
            detail={True: "run created after the registration (its last sealing)",
                    False: "the run was created before the registration was sealed: not a "
                           "pre-registered test",
                    None: "a time is not ISO 8601"}[ok]))
    if v.min_mean_running is not None:
        measured = [p for p in counted if p.mean_running is not None]
        if measured:
            low = min(measured, key=lambda p: (p.mean_running, p.seq))
            checks.append(ValidityCheck(
                name="mean running requests", passed=bool(low.mean_running >= v.min_mean_running),
                observed=round(low.mean_running, 6), limit=v.min_mean_running,
                detail=f"lowest over counted passes: {low.arm} pass {low.pass_index} "
                       f"(schedule position {low.seq})"))
        else:
            checks.append(ValidityCheck(
                name="mean running requests", passed=None, observed=None,
                limit=v.min_mean_running, detail="no engine metrics recorded for counted passes"))
    if v.max_preemptions is not None:
        measured = [p for p in counted if p.preemptions is not None]
        if measured:
            per_arm: dict[str, float] = {}
            for p in measured:
                per_arm[p.arm] = per_arm.get(p.arm, 0.0) + float(p.preemptions or 0.0)
            worst = max(sorted(per_arm), key=lambda a: per_arm[a])
            checks.append(ValidityCheck(
                name="preemptions", passed=bool(per_arm[worst] <= v.max_preemptions),
                observed=per_arm[worst], limit=v.max_preemptions,
                detail=f"most in one arm's counted passes: {worst}"))
        else:
            checks.append(ValidityCheck(
                name="preemptions", passed=None, observed=None, limit=v.max_preemptions,
                detail="no preemption counter recorded for counted passes"))
    arms = [a.name for a in exp.arms]
    all_fps = [fp for a in arms for fp in fps.get(a, [])]
    missing = [a for a in arms if a not in fps]
    if v.same_gpu:
        if missing or not all_fps:
            checks.append(ValidityCheck("same GPU", None, None, "identical GPU UUIDs",
                                        f"no fingerprint for arm(s) {', '.join(missing)}"))
        else:
            ok = same_node(all_fps)
            observed = "; ".join(f"{a}: {', '.join(envs[a].gpu_uuids) or 'no GPU'}" for a in arms)
            checks.append(ValidityCheck(
                "same GPU", ok, observed, "identical GPU UUIDs (host and CPU without a GPU)",
                "one physical device set for every arm" if ok else
                "arms ran on different devices (or a GPU UUID was unreadable)"))
    if v.same_versions:
        if missing or not all_fps:
            checks.append(ValidityCheck("same versions", None, None, "identical versions",
                                        f"no fingerprint for arm(s) {', '.join(missing)}"))
        else:
            differing = version_differences(all_fps, VERSION_KEYS)
            ok = not differing
            coded = any(fp.get("code") for fp in all_fps)   # runs recorded since code digests
            checks.append(ValidityCheck(
                "same versions", ok, "; ".join(differing) or "identical",
                "identical python, numpy, torch, triton, vllm, bistat, git commit, driver"
                + (", bistat code" if coded else ""),
                "every engine start of every arm" if ok else "software differs between arms"))
    return checks


# --------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------


def _sibling_registration(hdr_reg: Mapping[str, Any], reg: Registration) -> Registration | None:
    """The registration a run was recorded under, when ``reg`` is its sibling: the same resolved
    declaration but for ``name`` and ``rule`` (several rules registered together for one run,
    e.g. the published rule and its improved form). None otherwise."""
    path = hdr_reg.get("path")
    if not isinstance(path, str):
        return None
    # Beside the sibling first (registrations are sealed together in one folder, so a clone
    # elsewhere -- CI, a notebook's folder -- finds it and names it the same way on every
    # machine), else as run.json names it (relative to where `bistat run` ran, or absolute on
    # the machine that ran it). The seal is checked either way.
    recorded = None
    for candidate in dict.fromkeys((Path(reg.path).parent / Path(path).name, Path(path))):
        try:
            found = load_registration(candidate)
        except (OSError, ValueError):
            continue
        if found.sha256 == hdr_reg.get("sha256") and git_evidence(candidate).status != "differs":
            recorded = found
            break
    if recorded is None:
        return None
    # Compare as the current schema resolves them: a registration sealed before a field was
    # added lacks it, with its default meant.
    return recorded if _strip_name_and_rule(recorded) == _strip_name_and_rule(reg) else None


def _strip_name_and_rule(reg: Registration) -> dict[str, Any]:
    """The declaration as the current schema resolves it, without ``name`` and ``rule``."""
    return {k: v for k, v in reg.experiment().resolved().items() if k not in ("name", "rule")}


def sibling_registrations(reg: Registration) -> list[Registration]:
    """The other registrations in ``reg``'s folder sealed with the same declaration but for
    ``name`` and ``rule`` (several decision rules registered together for one run), by path.
    Files that are not readable registrations are skipped."""
    here = Path(reg.path)
    try:
        mine = _strip_name_and_rule(reg)
    except (ValueError, DeclarationError):
        return []
    found = []
    for path in sorted(here.parent.glob("*.json")):
        if path.name == here.name:
            continue
        try:
            other = load_registration(path)
            if (other.sha256 != reg.sha256 and _strip_name_and_rule(other) == mine
                    and git_evidence(path).status != "differs"):   # a forged one is no sibling
                found.append(other)
        except (OSError, ValueError, DeclarationError):
            continue
    return found


def _engine_version(exp: Experiment, reg: Registration, env: pd.DataFrame, events: pd.DataFrame,
                    engine_logs: dict[str, dict[int, str]], created_utc: str | None,
                    ) -> EngineVersionReport:
    """The engine's version against the newest release and the required one, and each arm's
    execution mode (:mod:`bistat.declare.engine_version`; modes from the kept logs,
    ``engine_logs`` as :func:`~bistat.store.enginelog.kept_logs` read them, where not recorded
    or where the record missed breakable graphs). The newest-release checks are the seal's, the run's and those of the
    registration's release log (``NAME.releases.jsonl``, verified: a broken log raises
    ``RegistrationError``)."""
    env_rows = env.to_dict("records") if len(env) else []
    return engine_version_report(
        exp.engine.kind, reg.declaration, reg.sealed, env_rows,
        events.to_dict("records") if len(events) else [],
        logged_modes(engine_logs),
        later_checks=release_log_checks(reg), first_record_utc=created_utc)


def sealed_after_data(reg: Registration, created_utc: str | None) -> bool:
    """Whether ``reg`` was last sealed after a run's first record (``run.json``'s
    ``created_utc``): a rule applied to data it had seen, so only an exploratory analysis.
    False when a time is missing or unreadable (the validity check then reports it)."""
    if created_utc is None:
        return False
    try:
        return parse_time(reg.sealed_utc) > parse_time(created_utc)
    except (TypeError, ValueError):
        return False


def _evidence(a: act.ArmActivation, probe_recorded: bool) -> ActivationEvidence:
    """The classifier's activation evidence for one arm: its probe outcome (through
    ``bistat.analysis.activation``) and the engine log's markers (None without a log)."""
    markers = (None if a.bi_kernels_logged is None else
               {"batch_invariant_kernels": bool(a.bi_kernels_logged),
                "tuned_gemm": bool(a.tuned_gemm_logged)})
    return ActivationEvidence(probe=a.probe, probe_recorded=probe_recorded, log_markers=markers)


def _pass_latencies(counted: pd.DataFrame, arm_passes: Mapping[str, Sequence[int]]
                    ) -> dict[str, tuple[tuple[int, float], ...]]:
    """Arm -> (pass index, mean request latency) of each counted pass (``t_done - t_submit``,
    seconds, over its answered requests), in pass order: what a cost rule on ``latency`` reads.
    ``counted``: the counted responses, the last recorded per prompt and pass. A pass without a
    timed answered request is left out."""
    if counted.empty or not {"t_submit", "t_done"} <= set(counted.columns):
        return {}
    frame = counted[["arm", "pass_index", "error", "t_submit", "t_done"]].copy()
    frame = frame[frame["error"].isna()]
    frame["latency"] = (pd.to_numeric(frame["t_done"], errors="coerce")
                        - pd.to_numeric(frame["t_submit"], errors="coerce"))
    frame = frame[frame["latency"].notna()]
    means = frame.groupby(["arm", "pass_index"], sort=True)["latency"].mean()
    out: dict[str, tuple[tuple[int, float], ...]] = {}
    for arm, plist in arm_passes.items():
        vals = [(int(p), float(means[(arm, p)])) for p in sorted(plist)
                if (arm, p) in means.index]
        out[arm] = tuple((p, v) for p, v in vals if v > 0)
    return out


def _pair_status(arm_reasons: Sequence[tuple[str, str]], control: str, treatment: str) -> RunTestable:
    """The run status one comparison is classified under: untestable only for the reasons that
    concern its own control or treatment arm."""
    mine = [r for arm, r in arm_reasons if arm in (control, treatment)]
    return RunTestable(False, "; ".join(mine)) if mine else RunTestable(True)


def _client_in_flight(responses: pd.DataFrame) -> dict[tuple[str, int], float]:
    """(arm, pass_index) -> the time-weighted mean number of requests in flight client-side:
    the requests' total time in flight divided by the pass's span (first submit to last answer).

    Compared with the engine's mean running batch it shows where requests waited: far fewer
    running than in flight means they sat outside the scheduler (the server's front end or the
    client), as in the first H200 SmolLM2 attempt (docs/STUDIES.md).
    """
    if responses.empty or not {"t_submit", "t_done"} <= set(responses.columns):
        return {}
    frame = responses[["arm", "pass_index", "t_submit", "t_done"]].copy()
    frame["t_submit"] = pd.to_numeric(frame["t_submit"], errors="coerce")
    frame["t_done"] = pd.to_numeric(frame["t_done"], errors="coerce")
    frame = frame.dropna()
    frame = frame[frame["t_done"] >= frame["t_submit"]]
    out: dict[tuple[str, int], float] = {}
    for (arm, pidx), g in frame.groupby(["arm", "pass_index"], sort=True):
        span = float(g["t_done"].max() - g["t_submit"].min())
        if span > 0:
            out[(str(arm), int(pidx))] = float((g["t_done"] - g["t_submit"]).sum()) / span
    return out


def _display_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies inside it, else as given."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve())) if p.is_absolute() else str(p)
    except ValueError:
        return str(p)


def _operator_notes(run_dir: Path) -> str | None:
    """The text of ``run_dir/NOTES.md``, stripped; None when absent or empty."""
    path = run_dir / NOTES_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as exc:
        raise AnalysisError(f"{path}: not UTF-8 text ({exc}); save the operator's notes as "
                            "UTF-8 markdown") from None
    return text or None


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict") and callable(x.to_dict):
        return _jsonable(x.to_dict())
    if is_dataclass(x) and not isinstance(x, type):
        return {k: _jsonable(getattr(x, k)) for k in x.__dataclass_fields__}
    if hasattr(x, "model_dump"):
        return x.model_dump(mode="json")
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def summary_to_dict(summary: RunSummary, *, divergences: bool = True,
                    metrics: bool = False) -> dict[str, Any]:
    """The summary (with verdicts) as JSON-ready data; the bulky parts are optional."""
    data = _jsonable(summary)
    for arm in data["arms"]:
        arm["match_rate"] = arm["n_matched"] / arm["n_units"] if arm["n_units"] else None
        if not divergences:
            arm["divergences"] = len(arm["divergences"])
    if not divergences and data.get("anatomy"):
        data["anatomy"]["divergences"] = len(data["anatomy"]["divergences"])
    if not metrics:
        data.pop("metrics")
    # derived from the passes' histograms and the logged sizes (time_beyond_graphs)
    data["beyond_graphs"] = [
        {"arm": b.arm, "max_capture_size": b.sizes.max_capture_size,
         "cudagraph_mode": b.sizes.cudagraph_mode, "n_passes": b.n_passes,
         "seconds_total": b.seconds_total, "seconds_beyond": b.seconds_beyond, "share": b.share}
        for b in time_beyond_graphs(summary)]
    load = host_load(summary)
    data["host_load"] = None if load is None else {
        "arms": [{"arm": a, "n_passes": n, "busy_share": b, "steal_share": st, "other_share": o}
                 for a, n, b, st, o in load.arms],
        "rho": load.rho, "p_value": load.p_value, "n": load.n,
        "slow_when_busy": load.slow_when_busy}
    clocks = gpu_clocks(summary)
    data["gpu_clocks"] = None if clocks is None else {
        "arms": [{"arm": a, "n_passes": n, "sm_clock_mhz_median": c, "sm_clock_mhz_min": lo,
                  "temperature_c_max": t, "power_w_median": w, "passes_slowed": k}
                 for a, n, c, lo, t, w, k in clocks.arms],
        "rho": clocks.rho, "p_value": clocks.p_value, "n": clocks.n,
        "slow_at_lower_clock": clocks.slow_at_lower_clock}
    starts = engine_starts(summary)
    data["engine_starts"] = None if starts is None else {
        "arms": [{"arm": a, "n_passes": n, "n_starts": k} for a, n, k in starts.arms],
        "effect": _jsonable(starts.effect), "starts_differ": starts.starts_differ,
        "ratios": [{"treatment": t, "control": c, "per_pass": _jsonable(rp),
                    "per_start": _jsonable(rs)} for t, c, rp, rs in starts.ratios]}
    return data
