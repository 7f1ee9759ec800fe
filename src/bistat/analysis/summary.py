"""Recorded run -> :class:`RunSummary`: match counts, first divergences, throughput, batching, validity.

This module runs the analysis of a recorded run (:func:`analyze_run`) in phases, each in a module of
its own: which registration (:mod:`bistat.analysis.siblings`), the passes
(:mod:`bistat.analysis.passes`), matching (:mod:`bistat.analysis.matching`), validity
(:mod:`bistat.analysis.validity`), the comparisons (here) and the sibling rules' verdicts; the
result is a :class:`~bistat.analysis.results.RunSummary` (:mod:`bistat.analysis.results`), whose
timing views (:mod:`bistat.analysis.timing`) are computed once when it is made. It reads a run
directory (``bistat.store.readers``) and the sealed registration, counts what the records show and
calls the pure statistics (``bistat.core.stats``) and the mechanical classifier
(``bistat.core.classify``). It renders nothing: ``bistat.report.finding`` turns the summary into a
finding. Every public name of those modules is importable from here as well.

Definitions (also in ``docs/RECORDS.md``, "How a run is analysed")
-------------------------------------------------------------------
*Counted passes* of an arm: passes recorded with ``kind = "counted"`` whose last ``end`` event in
``schedule.jsonl`` has ``status = "complete"`` or ``"failed"`` (it ran to its end with some
requests failed; their prompts are excluded); a pass with no ``end`` event (the run stopped
during it) never counts (one rule: ``bistat.store.passes.pass_states`` and ``pass_counts``,
shared with the anatomy and the trim). Warm-up passes and incomplete
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
from dataclasses import dataclass, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from bistat.analysis import activation as act
from bistat.analysis import siblings
from bistat.analysis import validity as valid
from bistat.analysis.matching import Matching, match_arms
from bistat.analysis.passes import MetricsSeries, PassSummary, pass_latencies, pass_summaries
from bistat.analysis.probe_report import ProbeReportError, read_probe_reports
from bistat.analysis.serial import serial_passes
from bistat.analysis.results import (AnalysisError, ArmComparison, ArmEnvironment, ArmSummary,
                                     Divergence, FailedRequests, RegistrationRun, RunSummary,
                                     SiblingVerdict)
from bistat.analysis.registration_runs import recorded_state, registration_runs, verdict_text
from bistat.analysis.servers import ServerReport, server_reports
from bistat.analysis.siblings import display_path, sealed_after_data, sibling_registrations
from bistat.analysis.timing import (BeyondGraphs, EngineStarts, GpuClocks, HostLoad, engine_starts,
                                    gpu_clocks, host_load, time_beyond_graphs)
from bistat.analysis.validity import VERSION_KEYS
from bistat.core import stats
from bistat.core.failures import error_groups
from bistat.core.classify import (ActivationEvidence, ArmStats, PairedCounts, RunTestable,
                                  ValidityCheck, classify)
from bistat.declare.engine_version import EngineVersionReport, engine_version_report
from bistat.declare.experiment import Experiment
from bistat.declare.prereg import Registration, release_log_checks
from bistat.declare.run_ledger import ledger_path
from bistat.engines.registry import capabilities
from bistat.store.enginelog import (cudagraph_sizes, jit_compiles, kept_log_lines, kept_logs,
                                    logged_modes)
from bistat.store.format import NOTES_FILE, command_words
from bistat.store.run_dir import RecordedRun

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
    "SiblingVerdict",
    "VERSION_KEYS",
    "analyze_run",
    "sealed_after_data",
    "sibling_registrations",
    "summary_to_dict",
    "time_beyond_graphs",
    "EngineStarts",
    "GpuClocks",
    "HostLoad",
    "engine_starts",
    "gpu_clocks",
    "host_load",
]


def analyze_run(run_dir: str | Path | RecordedRun,
                registration: str | Path | Registration | None = None, *,
                list_runs: bool = True, run_ledger: bool = True) -> RunSummary:
    """Analyse a recorded run against its sealed registration.

    In phases: the registration (:func:`bistat.analysis.siblings.registered`) and the tables
    (:func:`_load_tables`) are loaded; the passes are summarised
    (:func:`bistat.analysis.passes.pass_summaries`); each arm's outputs are matched over its
    counted passes (:func:`bistat.analysis.matching.match_arms`); the run's validity, what was not
    run and why an arm cannot be tested are found (:mod:`bistat.analysis.validity`); the probe's
    and the engine logs' activation evidence is read; every treatment is compared with the
    control and classified (:func:`_comparisons`), and again under each sibling registration's
    rule (:func:`_sibling_verdicts`); the passes' serial correlation is measured on the values the
    cost rule reads (:func:`bistat.analysis.serial.serial_passes`).

    Parameters
    ----------
    run_dir : path or RecordedRun
        The run directory (``run.json`` and the JSONL / Parquet tables), or the run opened.
    registration : path or Registration, optional
        The registration (``preregistrations/NAME.json``); default: the path ``run.json`` names
        in ``registration.path``. Found and its seal checked by the one resolver of a run's
        registration (``bistat.declare.run_registration.run_registration``).
    list_runs : bool
        Also find every other run of the registration the run was recorded under (its run
        ledger and the run's folder: :mod:`bistat.analysis.registration_runs`) and analyse each
        for its verdict (``RunSummary.registration_runs``).
    run_ledger : bool
        Read that registration's run ledger (``preregistrations/.NAME.runs``, a file of the
        machine that ran it, never committed) to find them. False: only the run's folder is
        searched, and the finding says the ledger is not here, as on a machine that recorded
        none of its runs: a committed finding regenerates from committed files so, whatever
        this machine has run again under the registration.

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
    registered = siblings.registered(run, registration, deviations)
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

    passes, series = pass_summaries(tables.passes, tables.schedule, responses, tables.metrics,
                                    {a.name: a.role for a in exp.arms}, deviations)
    run_id = run.run_id
    matching = match_arms(run, exp, responses, passes, deviations)
    arm_summaries = matching.arms

    servers = server_reports(tables.environment, arm_names)
    caps = capabilities(exp.engine.kind)
    remote = caps.declared_server and not caps.local_gpu   # servers started elsewhere
    envs, fps = valid.environments(tables.environment, arm_names, servers,
                                   declared_server=caps.declared_server)
    bad_events, gpu_busy = valid.bad_events(tables.events)
    validity = valid.validity_checks(exp, passes, fps, envs, reg.sealed_utc, created,
                                     exploratory=registered.exploratory, servers=servers,
                                     remote=remote)
    not_run = valid.not_run(exp, arm_summaries, passes, envs, bad_events, gpu_busy, tables.gaps,
                            deviations)
    arm_reasons = valid.untestable(bad_events, arm_summaries, exp.workload.passes)
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
        {a.name: (a.n_prompts_diverged, a.n_prompts) for a in arm_summaries},
        servers={r.arm: r for r in servers}, compare_servers=caps.declared_server)
    evidence = {a.arm: _evidence(a, probe is not None) for a in activation}

    comparisons, pairs = _comparisons(exp, matching, validity, arm_reasons, evidence)
    sib_verdicts = _sibling_verdicts(reg, created, passes, fps, envs, pairs, servers, remote)

    engine_version = _engine_version(exp, reg, tables.environment, tables.events, engine_logs,
                                     created)
    recorded = sibling_of if sibling_of is not None else reg
    runs: tuple[RegistrationRun, ...] = ()
    if list_runs:
        state = recorded_state({a.name: a.counted_passes for a in arm_summaries}, exp,
                               [f"engine {e.replace('_', ' ')} (arm {a})"
                                for a, e, _ in bad_events])
        runs = registration_runs(
            run_dir, run.run_id, created, recorded, exp, state, verdict_text(comparisons),
            lambda d: analyze_run(d, reg, list_runs=False), run_ledger=run_ledger)
    deviations.extend(engine_version.deviations)
    passes_df = tables.passes
    return RunSummary(
        name=exp.name, run_id=run_id,
        created_utc=header.get("created_utc"), engine_kind=header.get("engine_kind"),
        command=command_words(header.get("command") or ()),
        # the registration analysed against: the run's own as run.json names it, or the sibling
        # named on the command line (relative to the working directory when inside it; the
        # run's own is then named in the deviations)
        registration_path=(display_path(reg.path) if sibling_of is not None else
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
        siblings=tuple(sib_verdicts),
        jit_compiles=jit_compiles(engine_logs, header.get("created_utc"),
                                  passes_df.to_dict("records") if len(passes_df) else []),
        cudagraph_sizes=tuple(
            (arm, size) for arm, starts in engine_logs.items()
            if (size := cudagraph_sizes(starts[max(starts)])) is not None),
        exploratory=registered.exploratory, recorded_registration=(
            display_path(sibling_of.path) if sibling_of is not None else None),
        engine_version=engine_version,
        serial=serial_passes(exp.rule, [(control, treatment)
                                        for control, treatment, *_ in pairs]),
        failed_requests=failed_requests(responses, arm_names), servers=servers,
        registration_runs=runs,
        runs_ledger_found=(run_ledger and ledger_path(recorded.path).exists()) if list_runs
        else None,
        runs_registration=(display_path(recorded.path) if sibling_of is not None else
                           hdr_reg.get("path") if isinstance(hdr_reg, Mapping) else None))


def failed_requests(responses: pd.DataFrame, arm_names: Sequence[str]) -> FailedRequests:
    """The failed requests among ``responses`` (the records as read, in order), grouped by their
    error and counted per arm."""
    if responses.empty or "error" not in responses:
        return FailedRequests(0, len(responses), tuple((a, 0) for a in arm_names), ())
    failed = responses[responses["error"].notna()]
    errors = [str(e) for e in failed["error"]]
    per_arm = failed["arm"].value_counts()
    return FailedRequests(len(errors), len(responses),
                          tuple((a, int(per_arm.get(a, 0))) for a in arm_names),
                          error_groups(errors))


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


def _load_tables(run: RecordedRun, unit: str) -> _Tables:
    """Phase 1 (load): every table the analysis reads, from the run opened once."""
    gaps: list[str] = []
    sched_read = run.load("schedule")
    gaps.extend(sched_read.gaps)
    pass_read = run.load("passes")
    gaps.extend(pass_read.gaps)
    met_read = run.load("metrics", ["arm", "seq", "t", "num_requests_running",
                                    "num_requests_waiting", "num_preemptions_total", "source",
                                    "step_batch_size"])
    gaps.extend(met_read.gaps)
    env_read = run.load("environment", ["arm", "block", "fingerprint", "engine", "log_findings",
                                        "modes"])
    gaps.extend(env_read.gaps)
    ev_read = run.load("events", ["arm", "event", "time_utc", "detail", "release_check"])
    gaps.extend(ev_read.gaps)
    resp_cols = ["arm", "kind", "pass_index", "prompt_id", "error", "t_submit", "t_done",
                 "preemptions"]
    resp_cols += {"token_ids": ["token_sha256"], "text": ["text"],
                  "token_ids+logprobs": ["token_sha256", "logprob_sha256"]}[unit]
    resp_read = run.load("responses", resp_cols)
    gaps.extend(resp_read.gaps)
    return _Tables(sched_read.frame, pass_read.frame, met_read.frame, env_read.frame,
                   ev_read.frame, resp_read.frame, tuple(gaps))


#: one control-treatment pair as the classifier takes it: the statistics of both arms, whether
#: the pair can be tested, the paired counts (McNemar) and the activation evidence of the treatment
_Pair = tuple[ArmStats, ArmStats, RunTestable, PairedCounts | None, ActivationEvidence]


def _comparisons(exp: Experiment, matching: Matching, validity: Sequence[ValidityCheck],
                 arm_reasons: Sequence[tuple[str, str]],
                 evidence: Mapping[str, ActivationEvidence],
                 ) -> tuple[list[ArmComparison], list[_Pair]]:
    """Phase 5 (comparisons): every treatment against the control, classified under the rule."""
    rule = exp.rule
    cl = rule.confidence_level
    arm_summaries, matches = matching.arms, matching.matches
    large_drifts = matching.anatomy.large_drifts()
    timed = pass_latencies(matching.last[~matching.duplicated], matching.arm_passes)
    latencies = {arm: tuple(v for _, v in pv) for arm, pv in timed.items()}
    latency_passes = {arm: tuple(k for k, _ in pv) for arm, pv in timed.items()}
    latency_rounds = {arm: tuple(matching.rounds[(arm, k)] for k, _ in pv
                                 if (arm, k) in matching.rounds) for arm, pv in timed.items()}
    thr_passes, thr_rounds = matching.throughput_passes, matching.throughput_rounds
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
                         latency_passes=latency_passes.get(control.name, ()),
                         throughput_rounds=thr_rounds.get(control.name, ()),
                         latency_rounds=latency_rounds.get(control.name, ())),
                ArmStats(treat.name, "treatment", treat.n_units, treat.n_matched, tt,
                         large_drifts=large_drifts.get(treat.name),
                         pass_latencies=latencies.get(treat.name, ()),
                         throughput_passes=thr_passes.get(treat.name, ()),
                         latency_passes=latency_passes.get(treat.name, ()),
                         throughput_rounds=thr_rounds.get(treat.name, ()),
                         latency_rounds=latency_rounds.get(treat.name, ())),
                valid.pair_status(arm_reasons, control.name, treat.name), counts,
                evidence[treat.name])
        pairs.append(pair)
        verdict = classify(rule, pair[0], pair[1], validity=tuple(validity), status=pair[2],
                           paired=counts, evidence=pair[4])
        comparisons.append(ArmComparison(control.name, treat.name, n_paired, mcn, diff, ratio,
                                         point, verdict))
    return comparisons, pairs


def _sibling_verdicts(reg: Registration, created: str | None, passes: Sequence[PassSummary],
                      fps: Any, envs: Mapping[str, ArmEnvironment],
                      pairs: Sequence[_Pair], servers: Sequence[ServerReport] = (),
                      remote: bool = False) -> list[SiblingVerdict]:
    """Phase 6 (siblings): the same comparisons under the sibling registrations' rules."""
    siblings: list[SiblingVerdict] = []
    for sib in sibling_registrations(reg):
        sib_exp = sib.experiment()
        sib_later = sealed_after_data(sib, created)
        sib_validity = tuple(valid.validity_checks(sib_exp, passes, fps, envs, sib.sealed_utc,
                                                   created, exploratory=sib_later,
                                                   servers=servers, remote=remote))
        for ctl_stats, trt_stats, pair_status, counts, ev in pairs:
            siblings.append(SiblingVerdict(
                display_path(sib.path), sib_exp.name, trt_stats.name, ctl_stats.name,
                classify(sib_exp.rule, ctl_stats, trt_stats, validity=sib_validity,
                         status=pair_status, paired=counts, evidence=ev),
                exploratory=sib_later, sealed_utc=sib.sealed_utc))
    return siblings


def _evidence(a: act.ArmActivation, probe_recorded: bool) -> ActivationEvidence:
    """The classifier's activation evidence for one arm: its probe outcome (through
    ``bistat.analysis.activation``) and the engine log's markers (None without a log)."""
    markers = (None if a.bi_kernels_logged is None else
               {"batch_invariant_kernels": bool(a.bi_kernels_logged),
                "tuned_gemm": bool(a.tuned_gemm_logged)})
    return ActivationEvidence(probe=a.probe, probe_recorded=probe_recorded, log_markers=markers)


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
    """The summary (with verdicts) as JSON-ready data; the bulky parts are optional. The timing
    views (``beyond_graphs``, ``host_load``, ``gpu_clocks``, ``engine_starts``, ...) are the
    summary's own fields, in each view's ``to_dict`` form."""
    data = _jsonable(summary)
    for arm in data["arms"]:
        arm["match_rate"] = arm["n_matched"] / arm["n_units"] if arm["n_units"] else None
        if not divergences:
            arm["divergences"] = len(arm["divergences"])
    if not divergences and data.get("anatomy"):
        data["anatomy"]["divergences"] = len(data["anatomy"]["divergences"])
    if not metrics:
        data.pop("metrics")
    return data
