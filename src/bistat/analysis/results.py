"""What the analysis of a recorded run hands on: :class:`RunSummary` and the result objects in it.

Every number a finding states is a field here, computed once: the counts and intervals by the
analysis's phases (:mod:`bistat.analysis.summary`), and what follows from them (the views of
:mod:`bistat.analysis.timing`, where the divergences lie, the KV tiles they point at) when the
summary is made. :mod:`bistat.report` formats these fields and computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from bistat.analysis import activation as act
from bistat.analysis import anatomy as anat
from bistat.analysis import timing
from bistat.analysis.passes import MetricsSeries, PassSummary
from bistat.analysis.probe_report import ProbeReport
from bistat.analysis.serial import SerialPasses
from bistat.analysis.servers import ServerReport
from bistat.core import stats
from bistat.core.classify_inputs import RunTestable, ValidityCheck
from bistat.core.failures import ErrorGroup, describe_groups
from bistat.declare.engine_version import EngineVersionReport
from bistat.store.enginelog import CudaGraphSizes, JitCompile

__all__ = [
    "AnalysisError",
    "ArmComparison",
    "ArmEnvironment",
    "ArmSummary",
    "Divergence",
    "DivergenceSpread",
    "FailedRequests",
    "RegistrationRun",
    "KvTile",
    "KvTileArm",
    "RunSummary",
    "SiblingVerdict",
    "divergence_spread",
    "engine_name",
    "kv_tiles",
    "probe_missed",
]


class AnalysisError(Exception):
    """The run cannot be analysed (missing registration, records of another experiment...)."""


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
class DivergenceSpread:
    """Where one arm's first divergences lie: token indices (earliest, the median -- the lower of
    the two middle ones --, latest) and, where the prompts' lengths are recorded, KV lengths."""

    n_prompts: int                 # prompts with a divergence
    n_divergences: int             # diverging (prompt, pass) pairs
    earliest: int | None
    median: int | None
    latest: int | None
    kv_earliest: int | None = None
    kv_median: int | None = None


def divergence_spread(divergences: Sequence[Divergence]) -> DivergenceSpread:
    """The spread of ``divergences`` (None where there is none)."""
    pos = sorted(d.position for d in divergences)
    kv = sorted(d.kv_length for d in divergences if d.kv_length is not None)
    n = len(pos)
    return DivergenceSpread(
        len({d.prompt_id for d in divergences}), n,
        pos[0] if n else None, pos[(n - 1) // 2] if n else None, pos[-1] if n else None,
        kv[0] if kv else None, kv[(len(kv) - 1) // 2] if kv else None)


@dataclass(frozen=True)
class KvTileArm:
    """An arm whose every first divergence read more keys than one attention tile."""

    arm: str
    n_divergences: int             # first divergences with a KV length
    n_at_boundary: int             # of them exactly one key past the tile
    min_prompt_tokens: int
    max_prompt_tokens: int


@dataclass(frozen=True)
class KvTile:
    """A KV tile (:func:`bistat.analysis.anatomy.kv_tile_boundary`) past which every first
    divergence of these arms lies, although their outputs began at fewer keys."""

    tile: int
    arms: tuple[KvTileArm, ...]

    @property
    def min_prompt_tokens(self) -> int:
        return min(a.min_prompt_tokens for a in self.arms)

    @property
    def max_prompt_tokens(self) -> int:
        return max(a.max_prompt_tokens for a in self.arms)


def kv_tiles(arms: Sequence[ArmSummary]) -> tuple[KvTile, ...]:
    """The arms whose every first divergence lies just past a power-of-two KV length, by tile.

    Below one KV tile of the attention kernel any tile width reduces a row the same way, so
    divergences that start exactly at tile + 1 point at the attention kernel's KV tile changing
    with the batch (FlashAttention 3 on Hopper picks its tile from the batch's longest query).
    """
    by_tile: dict[int, list[KvTileArm]] = {}
    for a in arms:
        kv = [d.kv_length for d in a.divergences if d.kv_length is not None]
        tile = anat.kv_tile_boundary(kv)
        if tile is None:
            continue
        prompts = [d.n_prompt_tokens for d in a.divergences if d.n_prompt_tokens is not None]
        by_tile.setdefault(tile, []).append(
            KvTileArm(a.name, len(kv), sum(k == tile + 1 for k in kv), min(prompts), max(prompts)))
    return tuple(KvTile(tile, tuple(found)) for tile, found in sorted(by_tile.items()))


def probe_missed(probe: ProbeReport | None, arms: Sequence[ArmSummary]) -> tuple[str, ...]:
    """The arms a probe ran on and saw no difference in, although prompts diverged across the
    study's counted passes there: the probe and the study disagree (the study decides)."""
    if probe is None:
        return ()
    study = {a.name: a for a in arms}
    return tuple(a.arm for a in probe.arms
                 if not a.error and a.trials and not a.differs and a.arm in study
                 and study[a.arm].n_prompts_diverged)



@dataclass(frozen=True)
class FailedRequests:
    """The run's failed requests (every recorded pass: warm-ups, counted, interrupted), grouped
    by their error (:func:`bistat.core.failures.error_groups`: the same text but for numbers).

    Attributes
    ----------
    total : int
        Failed requests recorded.
    n_records : int
        Response records read.
    by_arm : tuple of (arm, failed)
        Per arm, in the declaration's order.
    groups : tuple of ErrorGroup
        The errors, each with its first text and how many requests shared it, in the order they
        first appear in the records.
    """

    total: int
    n_records: int
    by_arm: tuple[tuple[str, int], ...]
    groups: tuple[ErrorGroup, ...]

    def lines(self, limit: int = 3) -> list[str]:
        """The first ``limit`` errors in words (:func:`bistat.core.failures.describe_groups`)."""
        return describe_groups(self.groups, self.total, limit=limit)


@dataclass(frozen=True)
class RegistrationRun:
    """One run of a registration, as its finding lists it.

    Attributes
    ----------
    run_id : str
    created_utc : str or None
        ``run.json``'s; None for a directory that is gone.
    recorded : str
        How much of the declared schedule it recorded: ``complete (8 of 8 counted passes per
        arm)``, ``stopped early (blas 3, invariant 2 of 8 counted passes)``, ``no pass recorded``,
        ``directory gone``.
    complete : bool
        Every arm recorded its declared counted passes.
    verdict : str
        Each comparison's label under the finding's rule, or why there is none.
    this : bool
        The run the finding analyses.
    found_in : str
        ``this run``, ``its folder`` (a sibling directory), ``the run ledger``, or both.
    """

    run_id: str
    created_utc: str | None
    recorded: str
    complete: bool
    verdict: str
    this: bool
    found_in: str


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
    #: where the divergences lie (computed from ``divergences``)
    spread: DivergenceSpread = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spread", divergence_spread(self.divergences))

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
    #: each arm's passes and each comparison's pairs in pass order: their serial correlation,
    #: and the coverage of the rule's cost interval at it (bistat.analysis.serial)
    serial: SerialPasses | None = None
    #: the failed requests of every recorded pass, grouped by their error
    failed_requests: FailedRequests | None = None
    #: what each arm's server declared about itself (bistat.analysis.servers); empty for
    #: engines that run in bistat's process and runs recorded before servers were asked
    servers: tuple[ServerReport, ...] = ()
    #: every run of the registration this run was recorded under that its run ledger and this
    #: run's folder know, this one included (bistat.analysis.registration_runs)
    registration_runs: tuple[RegistrationRun, ...] = ()
    #: that registration's path, as run.json names it (or as displayed, for a sibling's)
    runs_registration: str | None = None
    #: whether that registration's run ledger was there when the runs were listed (a run recorded
    #: on another machine, its data folder committed, leaves its ledger there); None: not listed
    runs_ledger_found: bool | None = None

    # What the fields above show, computed once when the summary is made (and made again by
    # ``dataclasses.replace``); the finding and ``bistat analyze --json`` read these.
    #: per arm with logged CUDA-graph sizes: its counted time beyond the largest (timing)
    beyond_graphs: tuple[timing.BeyondGraphs, ...] = field(init=False, default=())
    #: the host's load over the counted passes, related to their times (timing)
    host_load: timing.HostLoad | None = field(init=False, default=None)
    #: the GPU's clocks over the counted passes, related to their times (timing)
    gpu_clocks: timing.GpuClocks | None = field(init=False, default=None)
    #: the engine starts behind the counted passes and the ratios per start (timing)
    engine_starts: timing.EngineStarts | None = field(init=False, default=None)
    #: batch latency, where the workload is one batch per pass (timing)
    batch_latency: timing.BatchLatency | None = field(init=False, default=None)
    #: how much of the requests in flight the engine ran (timing)
    running_share: timing.RunningShare | None = field(init=False, default=None)
    #: arms whose every first divergence lies just past one attention KV tile
    kv_tiles: tuple[KvTile, ...] = field(init=False, default=())
    #: arms the probe saw invariant although prompts diverged across the study's counted passes
    probe_missed: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        derived = {
            "beyond_graphs": tuple(timing.time_beyond_graphs(self)),
            "host_load": timing.host_load(self),
            "gpu_clocks": timing.gpu_clocks(self),
            "engine_starts": timing.engine_starts(self),
            "batch_latency": timing.batch_latency(self),
            "running_share": timing.running_share(self),
            "kv_tiles": kv_tiles(self.arms),
            "probe_missed": probe_missed(self.probe, self.arms),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def arm(self, name: str) -> ArmSummary:
        return next(a for a in self.arms if a.name == name)


def engine_name(s: "RunSummary") -> str:
    """The engine a run measured, named from its fingerprints: ``vLLM 0.25.0`` for vLLM engines
    (server or offline alike), ``SGLang 0.5.23`` for SGLang, the servers as they declare
    themselves for engines that drive any server (``openai → bistat serve 0.1.0``, ``unknown``
    where one declares nothing), else the engine as recorded (``embedded 0.1.0``)."""
    from bistat.engines.registry import capabilities

    envs = [e for _, e in s.environments]
    vllm = sorted({dict(e.versions).get("vllm") for e in envs} - {None})
    if (s.engine_kind or "").startswith("vllm") and vllm:
        return "vLLM " + ", ".join(vllm)
    if s.servers and capabilities(s.engine_kind or "").declared_server:
        return f"{s.engine_kind} → " + ", ".join(sorted({r.describe() for r in s.servers}))
    if s.servers and all(r.name == "SGLang" for r in s.servers):
        return ", ".join(sorted({r.describe() for r in s.servers}))
    return ", ".join(sorted({e.engine for e in envs})) or (s.engine_kind or "—")

