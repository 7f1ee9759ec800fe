"""The finding's ``## Throughput`` section: every pass, the ratio, and what it rests on.

Every pass of the schedule; the ratio of per-pass output tokens/s with its Welch interval; where
the cost rule pairs the passes, the interval that decided the cost (paired, or HAC with its cosine
terms and critical value) and which passes it paired; notes on engine starts, kernels compiled
during inference, host load and GPU clocks; and the passes' serial correlation (each arm's passes
and each comparison's pairs in pass order, their lag-1 autocorrelation and Ljung-Box test, and
what that correlation does to the stated coverage of the rule's interval: ``RunSummary.serial``,
:mod:`bistat.analysis.serial`).
"""

from __future__ import annotations

from bistat.analysis.results import RunSummary
from bistat.analysis.serial import MIN_PAIRS_CHECKED
from bistat.core.markdown import md_cell, md_table
from bistat.report.finding_cells import _f
from bistat.report.finding_verdict import _cost_rule


def _throughput(s: RunSummary, plot: str, serial_plot: str | None = None) -> list[str]:
    out = ["## Throughput", ""]
    rows = []
    for p in s.passes:
        rows.append((str(p.seq), p.arm, str(p.pass_index), p.kind, p.status,
                     "yes" if p.counted else "no", _f(p.wall_s, 3),
                     md_cell(p.n_requests), md_cell(p.n_failed), md_cell(p.output_tokens),
                     _f(p.output_tokens_per_s, 2), _f(p.requests_per_s, 3)))
    out += [md_table(("schedule position", "arm", "pass", "kind", "status", "counted", "wall s",
                      "requests", "failed", "output tokens", "output tokens/s", "requests/s"),
                     rows), ""]
    cl = f"{s.confidence_level * 100:g} %"
    ratio_rows = []
    for c in s.comparisons:
        r = c.ratio
        ratio_rows.append((f"{c.treatment} ÷ {c.control}", _f(c.ratio_point),
                           "—" if r is None else f"[{r.interval.low:.4f}, {r.interval.high:.4f}]",
                           "—" if r is None else f"{r.df:.2f}",
                           "—" if r is None else f"{r.n_treatment} / {r.n_control}"))
    out += ["Ratio of per-pass output tokens/s (geometric means; Welch interval on log "
            "throughput):", "",
            md_table(("ratio", "point", f"{cl} interval", "Welch df",
                      "passes (treatment / control)"), ratio_rows), "",
            *_paired_note(s), *_hac_note(s),
            "Wall time and requests/s are whole-pass figures; output tokens/s is what the rule "
            "compares.", "", *_starts_note(s), *_jit_note(s), *_host_note(s), *_gpu_note(s),
            f"![Per-pass throughput]({plot})",
            "", *_serial_note(s, serial_plot)]
    return out


def _paired_note(s: RunSummary) -> list[str]:
    """The cost rule's paired interval beside the Welch one, where the rule pairs the passes
    (``[rule.cost] interval = "paired"``): the interval that decided the cost."""
    rows = []
    for c in s.comparisons:
        cv = c.verdict.cost
        iv = None if cv is None else cv.interval
        if iv is not None and iv.method == "paired-log":
            rows.append((f"{c.treatment} ÷ {c.control}", _f(cv.ratio),
                         f"[{iv.low:.4f}, {iv.high:.4f}]", str(cv.n_pairs)))
    if not rows:
        return []
    cl = f"{s.confidence_level * 100:g} %"
    return ["The cost rule pairs the passes (`interval = \"paired\"`): the treatment's and the "
            "control's counted pass of one round of the schedule, which it ran side by side, and "
            "a paired t interval on the log differences. A drift that moved both arms alike "
            "cancels within a pair. This is the interval that decided the cost:", "",
            md_table(("ratio", "point", f"{cl} paired interval", "pairs"), rows), "",
            *_pairs_lines(s)]


def _hac_note(s: RunSummary) -> list[str]:
    """The cost rule's HAC interval and its make-up (``[rule.cost] interval = "hac"``): the
    interval that decided the cost, its cosine terms and critical value."""
    sp = s.serial
    rows = []
    for c in s.comparisons:
        cv = c.verdict.cost
        iv = None if cv is None else cv.interval
        hac = None if sp is None else next((p.hac for p in sp.pairs if p.treatment == c.treatment
                                            and p.control == c.control), None)
        if iv is not None and iv.method == "hac-cosine-log" and hac is not None:
            rows.append((f"{c.treatment} ÷ {c.control}", _f(cv.ratio),
                         f"[{iv.low:.4f}, {iv.high:.4f}]", str(hac.n_treatment), str(hac.terms),
                         f"{hac.critical_value:.3f}", _f(hac.variance_ratio, 2)))
    if not rows:
        return []
    rule = _cost_rule(s)
    bandwidth = "" if rule is None or rule.hac is None else (
        f", `hac_kernel = \"{rule.hac.kernel}\"`, `hac_bandwidth = "
        + (f'\"{rule.hac.bandwidth}\"`' if isinstance(rule.hac.bandwidth, str)
           else f"{rule.hac.bandwidth}`"))
    cl = f"{s.confidence_level * 100:g} %"
    return [f"The cost rule pairs the passes and allows for their serial correlation (`interval "
            f"= \"hac\"`{bandwidth}): the treatment's and the control's counted pass of one "
            "round of the schedule, and an equal-weighted cosine (EWC) interval on the log "
            "differences in schedule order "
            "(`bistat.core.serial.hac_ratio`): the mean ± t_B · √(Ω / n), Ω the mean square of "
            "the first *B* cosine transforms of the differences, t_B Student's t quantile with *B* "
            "degrees of freedom. This is the interval that decided the cost:", "",
            md_table(("ratio", "point", f"{cl} HAC interval", "pairs", "cosine terms B",
                      "critical value t_B", "long-run ÷ plain variance"), rows), "",
            *_pairs_lines(s)]


def _pairs_lines(s: RunSummary) -> list[str]:
    """Which passes the cost rule's paired or HAC interval paired, comparison by comparison: each
    pair's treatment and control pass (and their schedule positions), and the pairs whose two
    passes ran on different engine starts (``RunSummary.serial``'s pairs)."""
    if s.serial is None:
        return []
    where = {(p.arm, p.pass_index): p for p in s.passes}
    out = []
    for pair in s.serial.pairs:
        if not pair.passes:
            continue
        cells, split = [], []
        for tp, cp in zip(pair.treatment_passes, pair.passes):
            t, c = where.get((pair.treatment, tp)), where.get((pair.control, cp))
            at = "" if t is None or c is None else f" ({t.seq} / {c.seq})"
            cells.append(f"{tp} / {cp}{at}")
            if t is not None and c is not None and t.block != c.block:
                split.append(f"{tp} / {cp} (blocks {t.block} / {c.block})")
        by = {"round": "one per round of the schedule",
              "pass index": "by pass index", "position": "by position"}[pair.paired_by]
        line = (f"{pair.treatment} ÷ {pair.control}: {len(cells)} pair"
                f"{'' if len(cells) == 1 else 's'} of passes, {by} (treatment pass / control "
                f"pass, their schedule positions in parentheses): {', '.join(cells)}.")
        if split and len(split) == len(cells):
            line += (" The two passes of every pair ran on different engine starts (one engine "
                     "up at a time).")
        elif split:
            line += (f" The two passes of {len(split)} pair{'' if len(split) == 1 else 's'} ran "
                     f"on different engine starts (the run was resumed between them): "
                     f"{', '.join(split)}.")
        out += [line, ""]
    return out


_INTERVAL_NAMES = {"welch": "Welch's interval", "paired": "the paired interval",
                   "hac": "the HAC interval"}
_ASSUMES = {"welch": "each arm's passes", "paired": "the pairs of passes"}


def _coverage_cell(check) -> str:
    """What the run's correlation does to the interval's stated coverage, in words."""
    if check.interval == "hac":
        if not check.at_risk:
            return "holds at this estimate"
        more = (f"about {check.pairs_to_hold} pairs would keep it" if check.pairs_to_hold
                is not None else "no number of pairs up to 200 would keep it")
        return f"too few pairs for this correlation: {more}"
    p = "" if check.pvalue is None else f" (Ljung–Box p = {check.pvalue:.3g})"
    if check.contradicted:
        return f"contradicted: significant serial correlation{p} where it assumes none"
    if check.at_risk:
        return (f"at risk: no significant correlation{p}, but at this estimate it covers more "
                f"than {check.tolerance * 100:g} points less than stated")
    return f"holds at this estimate{p}"


def _serial_row(name: str, n: int, c) -> tuple[str, ...]:
    """A series' row: its lag-1 autocorrelation, bias-corrected only from
    :data:`MIN_PAIRS_CHECKED` values on (below, the correction says nothing), and Ljung-Box."""
    if c is None or c.lag1 is None:
        return (name, str(n), "—", "—", "—", "—", "—")
    return (name, str(n), f"{c.lag1:.2f}",
            "—" if c.lag1_corrected is None or n < MIN_PAIRS_CHECKED else
            f"{c.lag1_corrected:.2f}",
            f"{c.statistic:.2f}", str(c.lags), f"{c.pvalue:.3g}")


def _serial_note(s: RunSummary, plot: str | None) -> list[str]:
    """Each arm's passes and each comparison's pairs in pass order: their lag-1 autocorrelation
    and Ljung-Box test, what the correlation does to the stated coverage of the rule's interval,
    and a warning where it is significant (``RunSummary.serial``)."""
    sp = s.serial
    if sp is None:
        return []
    metric = ("log output tokens/s" if sp.metric == "throughput" else
              "log mean request latency")
    rows = [_serial_row(f"{a.arm} ({a.role})", a.n, a.correlation) for a in sp.arms]
    rows += [_serial_row(f"{p.treatment} ÷ {p.control}, pair differences", p.n_pairs,
                         p.differences) for p in sp.pairs]
    out = ["**Serial correlation.** Passes on one engine are not independent of the passes before "
           "them: the allocator, caches, clocks and host state carry over. Each arm's "
           f"{metric} per counted pass in pass order, and the pairs' log differences (the "
           "treatment's and the control's pass of one round of the schedule), with the lag-1 "
           "autocorrelation (and, "
           f"from {MIN_PAIRS_CHECKED} values on, with its small-sample bias removed) and the "
           "Ljung–Box test of no serial correlation (`bistat.core.serial`; significant below "
           f"p = {sp.alpha:g}):", "",
           md_table(("series", "passes", "lag-1 autocorrelation", "bias-corrected",
                     "Ljung–Box Q", "lags", "p"), rows), ""]
    name = _INTERVAL_NAMES[sp.interval]
    pct = f"{sp.confidence_level * 100:g} %"
    if sp.cost_rule:
        whose = f"The cost rule decides on {name} (`interval = \"{sp.interval}\"`)"
    else:
        whose = f"The rule has no cost rule; the throughput ratio above has {name}"
    if sp.interval == "hac":
        assumes = ("it allows for serial correlation of the pairs, up to a correlation that "
                   "depends on the number of pairs (docs/COST-INTERVALS.md)")
    else:
        assumes = f"it takes {_ASSUMES[sp.interval]} as independent"
    checked = [p for p in sp.pairs if p.check is not None]
    if checked:
        at = ("the larger of the two arms' lag-1 autocorrelations" if sp.interval == "welch"
              else "the pairs' lag-1 autocorrelation")
        cov_rows = [(f"{p.treatment} ÷ {p.control}", f"{p.check.rho:.2f}",
                     str(p.check.passes), f"{p.check.coverage * 100:.1f} %",
                     _coverage_cell(p.check)) for p in checked]
        unit = "passes per arm" if sp.interval == "welch" else "pairs"
        out += [f"{whose}: {assumes}. Its coverage at the correlation this run shows ({at}, "
                "bias-corrected, at least 0), by the AR(1) planning model "
                "(`bistat.core.design.interval_coverage`): an estimate from one run, which says "
                "how far the stated coverage may be off, not a correction:", "",
                md_table(("ratio", "lag-1 checked at", unit, f"coverage of its stated {pct}",
                          "its assumption"), cov_rows), ""]
    else:
        out += [f"{whose}: {assumes}. Too few pairs of passes (fewer than "
                f"{MIN_PAIRS_CHECKED}) to put a number on its coverage at this run's correlation: "
                "the lag-1 autocorrelation of so few says next to nothing.", ""]
    significant = sp.significant
    if significant:
        worst = min((p.check for p in checked), key=lambda c: c.coverage, default=None)
        if worst is None:
            effect = (f"With fewer than {MIN_PAIRS_CHECKED} pairs, what it does to the coverage "
                      f"of {name} cannot be put in numbers.")
        elif sp.interval == "hac":
            but = ", but not fully at these pairs" if worst.at_risk else ""
            effect = (f"The HAC interval allows for it{but}: at the correlation this run shows "
                      f"its stated {pct} covers about {worst.coverage * 100:.0f} % (the least of "
                      "the table above).")
        elif worst.at_risk:
            effect = (f"{name[0].upper()}{name[1:]} takes {_ASSUMES[sp.interval]} as independent:"
                      f" at the correlation this run shows its stated {pct} covers about "
                      f"{worst.coverage * 100:.0f} % (the least of the table above), so "
                      + ("the cost verdict rests on an interval narrower than stated"
                         if sp.cost_rule else "the ratio's interval is narrower than stated")
                      + ". `[rule.cost] interval = \"hac\"` allows for serial correlation "
                        "(docs/COST-INTERVALS.md).")
        else:
            effect = (f"{name[0].upper()}{name[1:]} takes {_ASSUMES[sp.interval]} as independent:"
                      f" at the correlation this run shows (bias-corrected, at least 0) its "
                      f"stated {pct} still covers about {worst.coverage * 100:.0f} % (the least "
                      "of the table above).")
        out += [f"**Warning: significant serial correlation** (Ljung–Box p < {sp.alpha:g}) in "
                f"{', '.join(significant)}. {effect}", ""]
    if plot is not None:
        out += [f"![Passes in pass order]({plot})", ""]
    return out


def _starts_note(s: RunSummary) -> list[str]:
    """Where an arm's counted passes ran in more than one start of its engine: whether passes of
    one start were more alike than passes of different starts, and the ratio with each start as
    one observation beside the per-pass one (a sensitivity analysis; the sealed rule decides)."""
    starts = s.engine_starts
    if starts is None:
        return []
    out = ["**Engine starts.** The counted passes ran in more than one start of their arm's "
           "engine (one engine at a time, or a resumed run). The intervals above treat every "
           "pass as independent; passes of one start share that start's speed, so where starts "
           "differ those intervals are too narrow:", "",
           md_table(("arm", "counted passes", "engine starts"),
                    [(arm, str(n), str(k)) for arm, n, k in starts.arms]), ""]
    e = starts.effect
    if e is None:
        out += ["No start held two counted passes of one arm: whether starts differ cannot be "
                "told from the passes' own scatter.", ""]
    else:
        verdict = ("passes of one start were more alike than passes of different starts: the "
                   "starts, not the passes, are the independent units here" if starts.starts_differ
                   else "no sign that passes of one start were more alike than passes of "
                        "different starts")
        out += [f"Starts within each arm, nested F test on log throughput: F({e.df_blocks}, "
                f"{e.df_resid}) = {e.f_stat:.2f}, p = {e.p_value:.3g}: {verdict}.", ""]
    cl = f"{s.confidence_level * 100:g} %"

    def iv(r) -> str:
        return ("—" if r is None else
                f"{r.ratio:.4f} [{r.interval.low:.4f}, {r.interval.high:.4f}]")
    rows = [(f"{t} ÷ {c}", iv(per_pass), iv(per_start),
             "—" if per_start is None else f"{per_start.n_treatment} / {per_start.n_control}")
            for t, c, per_pass, per_start in starts.ratios]
    out += [f"The throughput ratio with each start's geometric mean as one observation (Welch, "
            f"{cl}), beside the per-pass one; a sensitivity analysis, the sealed rule's interval "
            "still decides:", "",
            md_table(("ratio", "per pass", "per engine start", "starts (treatment / control)"),
                     rows), ""]
    return out


def _host_note(s: RunSummary) -> list[str]:
    """How busy the host was over the counted passes, and whether the slow passes were the busy
    ones (nothing for runs recorded before passes carried their host's load)."""
    load = s.host_load
    if load is None:
        return []
    rows = [(arm, str(n), f"{busy:.0%}", f"{steal:.1%}", f"{other:.0%}")
            for arm, n, busy, steal, other in load.arms]
    out = ["**Host load.** The host's CPU time during the counted passes (median per pass; "
           "*other* is CPU time used by processes other than bistat's own, where an engine "
           "running in its own process counts as other, and *stolen* is time the hypervisor "
           "gave to other guests):", "",
           md_table(("arm", "passes", "busy", "stolen", "other"), rows), ""]
    if load.rho is None:
        out += [f"Too few counted passes ({load.n}) or no spread in the load to relate pass "
                "times to it.", ""]
    else:
        verdict = ("the slower passes were the ones with more CPU time taken by other "
                   "processes: part of the pass-to-pass variation came from the host, not the "
                   "engine" if load.slow_when_busy else
                   "no sign that the host's other load set the pass times")
        out += [f"Pass time (within each arm, relative to its mean) against the *other* share, "
                f"Spearman's rho over {load.n} counted passes: {load.rho:.2f} (p = "
                f"{load.p_value:.3g}): {verdict}.", ""]
    return out


def _gpu_note(s: RunSummary) -> list[str]:
    """The GPU's SM clock, temperature and power over the counted passes, and whether the slow
    passes ran at a lower clock (nothing for runs recorded before passes sampled the GPU)."""
    clocks = s.gpu_clocks
    if clocks is None:
        return []

    def num(x: float | None, unit: str) -> str:
        return "—" if x is None else f"{x:,.0f} {unit}"
    rows = [(arm, str(n), num(med, "MHz"), num(low, "MHz"), num(hot, "°C"), num(watts, "W"),
             str(slowed)) for arm, n, med, low, hot, watts, slowed in clocks.arms]
    out = ["**GPU clocks.** The GPU the engine ran on, sampled with `nvidia-smi` during the "
           "counted passes (*SM clock* the median of the passes' means, *lowest* its lowest "
           "sample; *slowed* counts the passes in which the driver named a power or thermal "
           "reason holding the clocks down):", "",
           md_table(("arm", "passes", "SM clock", "lowest", "hottest", "power", "slowed"), rows),
           ""]
    if clocks.rho is None:
        out += [f"Too few counted passes ({clocks.n}) or no spread in the SM clock to relate "
                "pass times to it.", ""]
    else:
        verdict = ("the slower passes ran at lower SM clocks: part of the pass-to-pass variation "
                   "came from the GPU's clock, not the kernels" if clocks.slow_at_lower_clock
                   else "no sign that the SM clock set the pass times")
        out += [f"Pass time (within each arm, relative to its mean) against the pass's mean SM "
                f"clock, Spearman's rho over {clocks.n} counted passes: {clocks.rho:.2f} (p = "
                f"{clocks.p_value:.3g}): {verdict}.", ""]
    return out


def _jit_note(s: RunSummary) -> list[str]:
    """The kernels an engine JIT-compiled while serving, and in which passes (nothing when the
    logs show none): a counted pass that compiled measures the compilation too."""
    if not s.jit_compiles:
        return []
    seq = {(p.arm, p.pass_index): p.seq for p in s.passes}

    def where(j) -> str:
        if not j.passes:
            return "outside every pass of its arm"
        named = [(f"**counted pass {i}**" if kind == "counted" else
                  f"{kind.replace('warmup', 'warm-up')} pass {i}")
                 + (f" (schedule position {seq[(j.arm, i)]})" if (j.arm, i) in seq else "")
                 for i, kind in j.passes]
        return "in " + " or ".join(named)

    items = [f"{j.arm} `{j.kernel}` at {j.time_utc[11:19]} UTC, {where(j)}" for j in s.jit_compiles]
    counted = [j for j in s.jit_compiles if j.in_counted_pass]
    tail = (f" {len(counted)} of them fell in a counted pass, whose time then includes a "
            "compilation, not only the arm's steady state (warm up longer, or compile every "
            "bucket at start-up)." if counted else
            " None fell in a counted pass.")
    return ["Kernels compiled during inference (vLLM's JIT-monitor warnings in the engine logs, "
            "placed by the second they were logged): " + "; ".join(items) + "." + tail, ""]
