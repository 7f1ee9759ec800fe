"""What the passes' times say: the engine starts they ran in, the host's load and the GPU's clocks
beside them, the time the running batch outgrew the CUDA graphs, batch latency, and how much of
the requests in flight the engine ran.

Each view is computed once from the passes (:mod:`bistat.analysis.passes`) when a
:class:`~bistat.analysis.results.RunSummary` is made, and kept in its fields of the same name;
the finding formats those fields and ``bistat analyze --json`` writes them (each view's
``to_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from bistat.analysis.passes import PassSummary
from bistat.core import stats
from bistat.store.enginelog import CudaGraphSizes

__all__ = [
    "FRONT_END_BOUND_SHARE",
    "MIN_SAMPLES_FOR_SHARE",
    "ArmLatency",
    "BatchLatency",
    "BeyondGraphs",
    "EngineStarts",
    "GpuClocks",
    "HostLoad",
    "LatencyRatio",
    "Run",
    "RunningShare",
    "batch_latency",
    "engine_starts",
    "gpu_clocks",
    "host_load",
    "running_share",
    "time_beyond_graphs",
]

#: Below this share of the client's in-flight requests running in the engine, the front end, not
#: the engine, set the batch.
FRONT_END_BOUND_SHARE = 0.75

#: Fewest engine metric samples a counted pass needs before its mean running batch is compared
#: with the requests in flight. vLLM's gauges lag: the offline engine's first sample of a pass,
#: read after its first step, says 0 running, and so does the last, read after the pass; a pass
#: shorter than two sampling periods (h200-cost-qwen3-8b-latency-b8: 0.75 s passes, 1 s
#: sampling) has only those two, and its "mean running" of 0 says nothing about the batch.
MIN_SAMPLES_FOR_SHARE = 4

class Run(Protocol):
    """What the views read of a :class:`~bistat.analysis.results.RunSummary` (which computes them
    when it is made, so it cannot be named here)."""

    passes: Sequence[PassSummary]
    arms: Sequence[Any]                     # each with its ``name``, in declaration order
    comparisons: Sequence[Any]              # each with ``treatment``, ``control``, ``ratio``, ``ratio_point``
    confidence_level: float
    cudagraph_sizes: Sequence[tuple[str, CudaGraphSizes]]
    declaration: Mapping[str, Any]


def _arm_names(summary: Run) -> list[str]:
    return [a.name for a in summary.arms]


#: Below this many requests waiting in the engine's scheduler (the most over the compared
#: passes), none waited there: the requests not running sat in the front end or the client.
NONE_WAITING = 0.5


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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``bistat analyze --json``'s ``beyond_graphs``)."""
        return {"arm": self.arm, "max_capture_size": self.sizes.max_capture_size,
                "cudagraph_mode": self.sizes.cudagraph_mode, "n_passes": self.n_passes,
                "seconds_total": self.seconds_total, "seconds_beyond": self.seconds_beyond,
                "share": self.share}


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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``bistat analyze --json``'s ``gpu_clocks``)."""
        return {"arms": [{"arm": a, "n_passes": n, "sm_clock_mhz_median": c, "sm_clock_mhz_min": lo,
                          "temperature_c_max": t, "power_w_median": w, "passes_slowed": k}
                         for a, n, c, lo, t, w, k in self.arms],
                "rho": self.rho, "p_value": self.p_value, "n": self.n,
                "slow_at_lower_clock": self.slow_at_lower_clock}


def gpu_clocks(summary: Run) -> GpuClocks | None:
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

    groups = _by_arm(_arm_names(summary), rows)
    arms = tuple((arm, len(mine), median([p.gpu_sm_clock_mhz for p in mine]),
                  extreme([p.gpu_sm_clock_min_mhz for p in mine], min),
                  extreme([p.gpu_temperature_max_c for p in mine], max),
                  median([p.gpu_power_w for p in mine]),
                  sum(1 for p in mine if (p.gpu_slowdown_share or 0.0) > 0))
                 for arm, mine in groups)
    return GpuClocks(arms, *_pass_time_against(groups, lambda p: p.gpu_sm_clock_mhz))


def _by_arm(arms: Sequence[str], rows: list[PassSummary]) -> list[tuple[str, list[PassSummary]]]:
    """``rows`` grouped by arm, in declaration order (arms without a row left out)."""
    groups = [(arm, [p for p in rows if p.arm == arm]) for arm in arms]
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``bistat analyze --json``'s ``host_load``)."""
        return {"arms": [{"arm": a, "n_passes": n, "busy_share": b, "steal_share": st,
                          "other_share": o} for a, n, b, st, o in self.arms],
                "rho": self.rho, "p_value": self.p_value, "n": self.n,
                "slow_when_busy": self.slow_when_busy}


def host_load(summary: Run) -> HostLoad | None:
    """The host's load over the counted passes (None when no pass recorded one).

    Within each arm a pass's log wall time is taken relative to the arm's mean, so that the
    arms' own speeds do not make a correlation; Spearman's rho (``scipy.stats.spearmanr``) of
    those residuals against the share of CPU time used by processes other than bistat's own.
    """
    rows = [p for p in summary.passes if p.counted and p.host_busy_share is not None
            and p.wall_s and p.wall_s > 0]
    if not rows:
        return None
    groups = _by_arm(_arm_names(summary), rows)
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``bistat analyze --json``'s ``engine_starts``)."""
        return {"arms": [{"arm": a, "n_passes": n, "n_starts": k} for a, n, k in self.arms],
                "effect": self.effect, "starts_differ": self.starts_differ,
                "ratios": [{"treatment": t, "control": c, "per_pass": rp, "per_start": rs}
                           for t, c, rp, rs in self.ratios]}


def engine_starts(summary: Run) -> EngineStarts | None:
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
    groups = _by_arm(_arm_names(summary), rows)
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

    def per_start(c: Any) -> stats.RatioResult | None:
        t, k = ([stats.geometric_mean(v) for v in blocks.get(arm, {}).values()]
                for arm in (c.treatment, c.control))
        return (stats.throughput_ratio(t, k, summary.confidence_level)
                if len(t) >= 2 and len(k) >= 2 else None)
    # beside each comparison's own per-pass ratio, the one its Throughput table shows
    ratios = tuple((c.treatment, c.control, c.ratio, per_start(c)) for c in summary.comparisons)
    return EngineStarts(arms, effect, ratios)


def time_beyond_graphs(summary: Run) -> list[BeyondGraphs]:
    """Per arm whose engine logged its CUDA-graph sizes: the time-weighted share of its counted
    passes with more requests running than ``max_cudagraph_capture_size``.

    A decode step takes one token per running request and a prefill more, so each such step had
    more tokens than any captured graph and ran without one: the share is a lower bound on the
    time spent in such steps (all of it where the logged ``cudagraph_mode`` is ``NONE``). Arms in
    declaration order; those without sizes or samples left out.
    """
    sizes = dict(summary.cudagraph_sizes)
    out = []
    for arm in _arm_names(summary):
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


@dataclass(frozen=True)
class ArmLatency:
    """One arm's batch latency over its counted passes that answered every request."""

    arm: str
    n_passes: int
    median_s: float | None
    p90_s: float | None
    median_ms_per_token: float | None     # the latency over the tokens each request generated


@dataclass(frozen=True)
class LatencyRatio:
    """A comparison's latency ratio: the inverse of its throughput ratio and of its interval."""

    treatment: str
    control: str
    point: float
    low: float
    high: float


@dataclass(frozen=True)
class BatchLatency:
    """Batch latency, for workloads of one batch per pass (``n_prompts == concurrency``: the
    published latency workload, as ``vllm bench latency --batch-size`` measures it)."""

    n_prompts: int | None                 # requests per batch
    arms: tuple[ArmLatency, ...]          # in the order the arms' passes were recorded
    ratios: tuple[LatencyRatio, ...]


def batch_latency(summary: Run) -> BatchLatency | None:
    """Each arm's batch latency, when the declared workload is one batch per pass (else None):
    a pass's wall time is the batch latency, and over the tokens each request generated its time
    per output token. A counted pass with a failed request is left out (its wall time is not a
    batch's latency). The latency ratios are the inverses of the comparisons' throughput ratios
    and of their intervals."""
    workload = summary.declaration.get("workload", {})
    if workload.get("n_prompts") != workload.get("concurrency"):
        return None
    passes = summary.passes
    arms = []
    for arm in dict.fromkeys(p.arm for p in passes):
        whole = [p for p in passes if p.arm == arm and p.counted and p.wall_s and not p.n_failed]
        walls = [p.wall_s for p in whole]
        per_token = [p.wall_s / (p.output_tokens / p.n_requests) for p in whole
                     if p.output_tokens and p.n_requests]
        if not walls:
            arms.append(ArmLatency(arm, 0, None, None, None))
            continue
        arms.append(ArmLatency(arm, len(walls), float(np.median(walls)),
                               float(np.percentile(walls, 90)),
                               float(np.median(per_token)) * 1e3 if per_token else None))
    ratios = tuple(LatencyRatio(c.treatment, c.control, 1.0 / c.ratio_point,
                                1.0 / c.ratio.interval.high, 1.0 / c.ratio.interval.low)
                   for c in summary.comparisons if c.ratio is not None and c.ratio_point)
    return BatchLatency(workload.get("n_prompts"), tuple(arms), ratios)


@dataclass(frozen=True)
class RunningShare:
    """How much of the requests bistat had in flight the engine ran, over the counted passes with
    both figures (:func:`running_share`)."""

    n_passes: int                    # counted passes with a mean running batch and requests in flight
    most_samples: int                # the most engine metric samples one of them has
    #: the lowest and highest share of the requests in flight running, over the passes with at
    #: least MIN_SAMPLES_FOR_SHARE samples (None: no pass has that many)
    low: float | None
    high: float | None
    lowest: PassSummary | None       # the pass of the lowest share
    max_waiting: float | None        # the most requests waiting in the scheduler over those passes

    @property
    def compared(self) -> bool:
        """Some pass had enough samples to compare its running batch with the requests in flight."""
        return self.low is not None

    @property
    def front_end_bound(self) -> bool:
        """The engine ran under :data:`FRONT_END_BOUND_SHARE` of the requests in flight."""
        return self.low is not None and self.low < FRONT_END_BOUND_SHARE

    @property
    def none_waiting(self) -> bool:
        """No request waited in the engine's scheduler (:data:`NONE_WAITING`)."""
        return self.max_waiting is not None and self.max_waiting < NONE_WAITING


def running_share(summary: Run) -> RunningShare | None:
    """The engine's mean running batch over the client's mean requests in flight, per counted pass
    (None when no counted pass has both)."""
    counted = [p for p in summary.passes if p.counted and p.mean_running is not None
               and p.client_in_flight]
    if not counted:
        return None
    shares = [(p.mean_running / p.client_in_flight, p) for p in counted
              if p.n_metric_samples >= MIN_SAMPLES_FOR_SHARE]
    most = max(p.n_metric_samples for p in counted)
    if not shares:
        return RunningShare(len(counted), most, None, None, None, None)
    low, lowest = min(shares, key=lambda x: (x[0], x[1].seq))
    return RunningShare(len(counted), most, low, max(x[0] for x in shares), lowest,
                        max((p.mean_waiting or 0.0) for _, p in shares))
