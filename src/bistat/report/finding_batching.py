"""How the engine batched, as a finding shows it: ``## Batch latency`` and ``## Batching``.

For workloads of one batch per pass, each arm's batch latency and time per output token with the
latency ratio; for every run, each pass's engine metrics (requests running, waiting, preempted)
against the requests bistat had in flight, whether the front end rather than the engine set the
batch, and the steps whose batch outgrew the engine's CUDA graphs.
"""

from __future__ import annotations

from bistat.analysis.results import RunSummary
from bistat.analysis.timing import MIN_SAMPLES_FOR_SHARE
from bistat.core.markdown import md_table
from bistat.engines.registry import capabilities
from bistat.report.finding_cells import _f


def _batching(s: RunSummary, plot: str) -> list[str]:
    out = ["## Batching", "",
           "From the engine's metrics samples of each pass; *in flight* is what bistat had "
           "submitted and not yet received back (time-weighted, from the responses' times).", ""]
    rows = [(str(p.seq), p.arm, str(p.pass_index), p.kind, str(p.n_metric_samples),
             _f(p.client_in_flight, 2), _f(p.mean_running, 2), _f(p.max_running, 0),
             _f(p.mean_waiting, 2), _f(p.preemptions, 0)) for p in s.passes]
    out += [md_table(("schedule position", "arm", "pass", "kind", "samples", "mean in flight",
                      "mean running", "max running", "mean waiting", "preemptions"), rows), ""]
    share = s.running_share
    if share is not None and not share.compared:
        out += [f"Too few engine metric samples to tell how the engine batched: every counted "
                f"pass has at most {share.most_samples} (at least {MIN_SAMPLES_FOR_SHARE} are needed; the "
                "first and last samples of a pass read the engine's gauges before and after "
                "its work), so the running batch is not compared with the requests in flight.",
                ""]
    # an engine without a front end takes requests straight into its scheduler: the front-end
    # diagnosis does not apply to it
    if share is not None and share.compared and not capabilities(s.engine_kind or "").front_end:
        out += [f"Engine kind {s.engine_kind}: bistat hands requests straight to the engine "
                "(no API server), so no front end stands between the requests in flight and "
                "the running batch; the gauges are read between engine steps and lag them.", ""]
    elif share is not None and share.compared:
        low, high, at = share.low, share.high, share.lowest
        where = f"{at.arm} pass {at.pass_index} (schedule position {at.seq})"
        if share.front_end_bound:
            out += [f"**The front end, not the engine, set the batch:** in counted passes the "
                    f"engine's running batch was {low:.0%}–{high:.0%} of the requests in flight "
                    f"(lowest: {where})"
                    + (", with none waiting in its scheduler, so the others sat in the server's "
                       "front end (API server, tokenization, output processing) or the client."
                       if share.none_waiting else "; the rest waited in its scheduler.")
                    + " The throughput ratios then compare front ends as much as engines.", ""]
        else:
            out += [f"In counted passes the engine's running batch was {low:.0%}–{high:.0%} of "
                    f"the requests in flight (lowest: {where}).", ""]
    out += _beyond_graphs(s)
    out += [f"![Running requests over time]({plot})", ""]
    return out


def _beyond_graphs(s: RunSummary) -> list[str]:
    """Where the running batch outgrew the engine's CUDA graphs (steps beyond the CUDA-graph
    sizes launch every kernel from the host, where a launcher's per-call cost shows)."""
    found = s.beyond_graphs
    if not found:
        return []
    if all(b.seconds_beyond == 0 for b in found):
        sizes = sorted({b.sizes.max_capture_size for b in found})
        return [f"CUDA graphs: no metrics sample of a counted pass had more requests running "
                f"than the engine's largest CUDA-graph size ({' / '.join(map(str, sizes))} "
                "tokens, from its logged configuration), so no decode step outgrew the graphs "
                "(a prefill step can, in tokens).", ""]
    rows = []
    for b in found:
        t, beyond = b.per_pass
        decode = (f"; full decode graphs to {b.sizes.max_decode_requests} requests"
                  if b.sizes.max_decode_requests is not None else "")
        graphs = ("NONE: no step replays a graph" if b.sizes.cudagraph_mode == "NONE" else
                  f"{b.sizes.cudagraph_mode or 'unknown'}, {b.sizes.max_capture_size} "
                  f"tokens{decode}")
        rows.append((b.arm, graphs, str(b.n_passes), _f(t, 3), _f(beyond, 3),
                     f"{b.share:.1%}"))
    out = ["**Steps beyond the CUDA-graph sizes.** A step with more requests running than the "
           "engine's largest CUDA-graph size has more tokens than any captured graph and runs "
           "without one, every kernel launched from the host. Time-weighted from the metrics "
           "samples of the counted passes, so a lower bound (a prefill step outgrows the graphs "
           "with fewer requests) read at the samples' resolution:", "",
           md_table(("arm", "CUDA graphs (logged: mode, largest size)", "counted passes",
                     "seconds per pass", "of them beyond the largest size", "share"), rows), ""]
    by_arm = {b.arm: b for b in found}
    roles = {a.name: a.role for a in s.arms}
    controls = [a for a, r in roles.items() if r == "control" and a in by_arm]
    for arm in (a for a, r in roles.items() if r == "treatment" and a in by_arm):
        for control in controls:
            extra, extra_beyond = by_arm[arm].extra_over(by_arm[control])
            if extra > 0:
                out.append(f"- {arm} took {extra:.3f} s more per counted pass than {control}, "
                           f"{extra_beyond:.3f} s of it with more requests running than the "
                           "largest graph size.")
    if out[-1] != "":
        out.append("")
    return out


def _latency(s: RunSummary) -> list[str]:
    """Batch latency, for workloads of one batch per pass (``n_prompts == concurrency``: the
    published latency workload, as ``vllm bench latency --batch-size`` measures it)."""
    lat = s.batch_latency
    if lat is None:
        return []
    rows = [(a.arm, str(a.n_passes), _f(a.median_s, 4), _f(a.p90_s, 4),
             _f(a.median_ms_per_token, 3)) for a in lat.arms]
    cl = f"{s.confidence_level * 100:g} %"
    ratio_rows = [(f"{r.treatment} ÷ {r.control}", _f(r.point), f"[{r.low:.4f}, {r.high:.4f}]")
                  for r in lat.ratios]
    return ["## Batch latency", "",
            f"One batch of {lat.n_prompts} requests per pass: a pass's wall time is the "
            "batch latency; time per output token is that latency divided by the tokens each "
            "request generated. Counted passes with a failed request are left out (their wall "
            "time is not a batch's latency).", "",
            md_table(("arm", "counted passes", "median latency s", "p90 latency s",
                      "median ms per output token"), rows), "",
            "Latency ratio (the inverse of the throughput ratio and of its interval):", "",
            md_table(("ratio", "point", f"{cl} interval"), ratio_rows), ""]
