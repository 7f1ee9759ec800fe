"""The recorded passes: what each pass was (its place in the schedule, whether it counts) and how it
ran (throughput, the engine's batching, the requests in flight, the host's and the GPU's records).

:func:`pass_summaries` is the analysis's phase 2 (:func:`bistat.analysis.summary.analyze_run`): one
:class:`PassSummary` per recorded pass, with the batching evidence recomputed from the metrics
samples by the function the runner wrote it with (:func:`bistat.run.batching.batching_summary`).
What the passes' times say about the engine starts, the host and the GPU is
:mod:`bistat.analysis.timing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pandas as pd

from bistat.engines.base import MetricsSample
from bistat.run.batching import batching_summary
from bistat.store.passes import (pass_counts, pass_latencies, pass_rounds, pass_states,
                                 schedule_order)
from bistat.store.readers import optional_float as _opt_float
from bistat.store.readers import optional_int as _opt_int
from bistat.store.readers import optional_str as _opt_str

__all__ = ["MetricsSeries", "PassSummary", "pass_latencies", "pass_summaries"]


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
    #: preemptions over the pass: the increase of the engine's counter, or the sum of the
    #: per-request counts its answers gave (SGLang's ``num_retractions``) where that is larger
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
    #: the round of the schedule a counted pass ran in: an arm's k-th counted pass in schedule
    #: order runs in round k, beside the other arms' k-th (bistat.core.schedule), however the
    #: run was interrupted and resumed; None for a pass that does not count
    round: int | None = None


@dataclass(frozen=True)
class MetricsSeries:
    """Running requests over time in one pass (for the plot): the engine's samples and, where it
    recorded them (the embedded engine), the batch of every engine step (``step_t``: when the
    step ended; ``step_batch``: the requests it computed), the exact evidence the per-second
    samples summarise."""

    arm: str
    seq: int
    t: tuple[float, ...]
    running: tuple[float, ...]
    step_t: tuple[float, ...] = ()
    step_batch: tuple[float, ...] = ()


def pass_summaries(passes_df: pd.DataFrame, schedule: pd.DataFrame, responses: pd.DataFrame,
                   metrics: pd.DataFrame, roles: Mapping[str, str], deviations: list[str]
                   ) -> tuple[list[PassSummary], list[MetricsSeries]]:
    """Every recorded pass, whether it counts, and its batching evidence (the analysis's phase 2).

    ``roles``: the registered arms' roles (a pass of another arm never counts); a counted pass
    that did not end is added to ``deviations``.
    """
    walls = {(str(r["arm"]), int(r["seq"])): _opt_float(r.get("wall_s"))
             for r in (passes_df.to_dict("records") if not passes_df.empty else [])
             if _opt_int(r.get("seq")) is not None}
    batching, series = _batching(metrics, walls)
    in_flight = _client_in_flight(responses)
    per_request = _request_preemptions(responses)
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
    all_keys = schedule_order(passes_df, schedule, states)
    rounds = pass_rounds(all_keys, states, roles)
    passes: list[PassSummary] = []
    for arm, pidx in all_keys:
        rec = pass_rows.get((arm, pidx), {})
        st = starts.get((arm, pidx), {})
        kind, end = states[(arm, pidx)]
        seq = _opt_int(rec.get("seq", st.get("seq")))
        stat = end or "no end event"
        # "failed" = the pass ran to its end with some requests failed: it counts, and its failed
        # prompts are excluded from matching below; "interrupted" passes were re-run in full.
        counted = arm in roles and pass_counts(kind, end)
        rnd = rounds.get((arm, pidx))
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
            preemptions=_larger(b.get("preemptions", _opt_float(batch_rec.get("preemptions"))),
                                per_request.get((arm, pidx))),
            n_metric_samples=int(b.get("n", 0)), client_in_flight=in_flight.get((arm, pidx)),
            running_hist=b.get("running_hist", _hist_pairs(batch_rec.get("running_hist"))),
            **_host_shares(rec.get("host"), _opt_float(rec.get("wall_s"))),
            **_gpu_fields(rec.get("gpu")), block=_opt_int(rec.get("block")), round=rnd))
        if kind == "counted" and not counted and arm in roles:
            deviations.append(
                f"{arm} counted pass {pidx} (schedule position {seq}) has no end: the run "
                "stopped during it; its responses are a partial sample, not counted (bistat run "
                "--resume runs it again)" if end is None else
                f"{arm} counted pass {pidx} (schedule position {seq}) ended '{stat}'; not counted")
    return passes, series


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
    steps: dict[tuple[str, int], tuple[tuple[float, ...], tuple[float, ...]]] = {}
    if "step_batch_size" in metrics:
        s = metrics[metrics["step_batch_size"].notna()].sort_values(["arm", "seq", "t"],
                                                                     kind="stable")
        for (arm, seq), grp in s.groupby(["arm", "seq"], sort=True):
            steps[(str(arm), int(seq))] = (tuple(grp["t"].astype(float).tolist()),
                                           tuple(grp["step_batch_size"].astype(float).tolist()))
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
                                    tuple(running.tolist()), *steps.get((str(arm), int(seq)),
                                                                       ((), ()))))
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


def _request_preemptions(responses: pd.DataFrame) -> dict[tuple[str, int], float]:
    """(arm, pass_index) -> the preemptions the pass's answers reported, summed over its requests
    (``preemptions`` in ``responses.jsonl``; passes none of whose answers carry one are left out).

    The engine's counter, sampled about once a second, can miss a preemption near a pass's end, and
    SGLang's series exists only from its first retraction on; the answers' own counts cannot."""
    if responses.empty or "preemptions" not in responses.columns:
        return {}
    frame = responses[["arm", "pass_index", "preemptions"]].copy()
    frame["preemptions"] = pd.to_numeric(frame["preemptions"], errors="coerce")
    frame = frame.dropna()
    return {(str(arm), int(pidx)): float(g["preemptions"].sum())
            for (arm, pidx), g in frame.groupby(["arm", "pass_index"], sort=True)}


def _larger(counter: float | None, answers: float | None) -> float | None:
    """The larger of the two readings of a pass's preemptions, where either exists."""
    known = [x for x in (counter, answers) if x is not None and not math.isnan(x)]
    return max(known) if known else counter


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
