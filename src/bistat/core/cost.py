"""The cost rule's classifier (``[rule.cost]``; pure: no I/O, no clock, no printing).

:func:`classify_cost` gives one of *no measurable cost*, *costs*, *faster*, *undecidable* (with the
passes that would decide it) or *untested*, each with one fixed sentence
(:data:`bistat.core.verdicts.COST_SENTENCES`); :func:`bistat.core.classify.classify` attaches it to
the verdict. It asks what the mode costs (a non-inferiority test on the ratio's interval, not
equivalence), so a faster treatment never gets a worse cost outcome. The interval is Welch's or
the paired one (:mod:`bistat.core.throughput`), or the serial-correlation-robust (HAC) one
(:func:`bistat.core.serial.hac_ratio`), of the passes :func:`bistat.core.pairing.pass_pairs`
pairs; the passes that would decide an undecidable cost come from the design analysis
(:func:`bistat.core.design_ratio.passes_to_decide`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from bistat.core import design_ratio, design_rho, serial, stat_results, throughput
from bistat.core.classify_inputs import ArmStats, RatioSummary
from bistat.core.decided import format_decided
from bistat.core.pairing import paired_values
from bistat.core.rule import CostRule
from bistat.core.verdicts import (COST_SENTENCE_NO_INTERVAL, COST_SENTENCES, CostOutcome,
                                  CostVerdict)

__all__ = ["COST_DIGITS", "classify_cost"]


#: Decimals of the ratio and its interval in a cost statement (more where a margin needs them).
COST_DIGITS = 2


def classify_cost(cost: CostRule, control: ArmStats, treatment: ArmStats, *,
                  untested: Sequence[str] = (), ratio: RatioSummary | None = None
                  ) -> CostVerdict:
    """Classify the cost of one treatment against the control by the sealed cost rule.

    Parameters
    ----------
    cost : bistat.core.rule.CostRule
        The registered cost rule (``[rule.cost]``).
    control, treatment : ArmStats
        The arms' per-pass values: ``pass_throughputs`` (metric ``throughput``) or
        ``pass_latencies`` (``latency``).
    untested : sequence of str
        Why the comparison is *untested*, if it is: the cost is then *untested* too.
    ratio : RatioSummary, optional
        A published ratio (``bistat classify``): its interval decides when it is at the cost
        rule's confidence level; else the cost is *undecidable* from the summary.

    Returns
    -------
    CostVerdict

    Notes
    -----
    The question is what the mode costs, so the test is one of non-inferiority, not of
    equivalence: a treatment faster than the control never gets a worse outcome than one as fast
    as it. With ``lo = 1 - margin``, ``hi = 1 + margin`` and the ratio's two-sided Welch interval
    ``[L, U]`` at ``cost.confidence_level`` (``stats.throughput_ratio`` on the metric's per-pass
    values), its *slower end* being ``L`` for throughput (below 1 is slower) and ``U`` for
    latency (above 1 is slower):

    - *costs*: the interval lies wholly beyond the margin on the slower side (``U < lo`` for
      throughput, ``L > hi`` for latency);
    - *faster*: it lies wholly beyond the margin on the faster side (``L > hi`` for throughput,
      ``U < lo`` for latency);
    - *no measurable cost*: otherwise, when its slower end lies within the margin (``L >= lo``
      for throughput, ``U <= hi`` for latency): the one-sided Welch test that the treatment is
      not slower by more than the margin rejects at ``(1 - confidence_level) / 2``. When the
      interval also reaches beyond the margin on the faster side the statement ends with
      "possibly faster";
    - *undecidable*: otherwise (the interval reaches across the margin on the slower side), with
      the passes per arm that would decide it at the observed ratio and CV
      (``bistat.core.design.passes_to_decide``).

    The outcomes are ordered *costs* < *undecidable* < *no measurable cost* < *faster*, and
    moving the interval to the faster side never moves the outcome down that order.

    With ``cost.interval == "paired"`` the interval is ``stats.paired_ratio`` of the passes the
    schedule ran side by side, one pair per round both arms have (:func:`pass_pairs`:
    ``ArmStats.throughput_rounds`` / ``latency_rounds``; by pass index, then by position, where
    those are not known), and the ratio its point; the same decision follows.
    With ``cost.interval == "hac"`` the same pairs, in schedule order, give
    ``serial.hac_ratio``'s interval (robust to serial correlation of the pairs, with the rule's
    ``hac_kernel`` and ``hac_bandwidth``); an undecidable cost's pairs to decide it are then
    planned for that interval at the pairs' spread and their lag-1 autocorrelation
    (:func:`bistat.core.design.planning_rho`).

    Examples
    --------
    >>> from bistat.core.rule import CostRule
    >>> c = ArmStats("off", "control", 0, 0, (100.0, 101.0, 99.0, 100.5))
    >>> t = ArmStats("on", "treatment", 0, 0, (97.0, 98.0, 96.5, 97.5))
    >>> classify_cost(CostRule(margin=0.10), c, t).statement
    'no measurable cost (ratio 0.97, 95 % interval 0.96–0.98)'
    >>> quick = ArmStats("on", "treatment", 0, 0, (105.0, 112.0, 101.0, 109.0))
    >>> classify_cost(CostRule(margin=0.05), c, quick).statement
    'no measurable cost (ratio 1.07, 95 % interval 0.99–1.14; possibly faster)'
    """
    metric = cost.metric
    key = "pass_throughputs" if metric == "throughput" else "pass_latencies"
    tv, cv_ = tuple(getattr(treatment, key)), tuple(getattr(control, key))
    cl = cost.confidence_level
    pct = f"{cl * 100:g} %"

    def verdict(outcome: CostOutcome, statement: str, point=None, iv=None, cvv=None,
                need=None, reason=None) -> CostVerdict:
        sentence = (COST_SENTENCE_NO_INTERVAL if outcome is CostOutcome.UNDECIDABLE and iv is None
                    else COST_SENTENCES[outcome])
        return CostVerdict(outcome, sentence, statement, metric, cost.margin,
                           point, iv, len(tv), len(cv_), cvv, need, reason)

    if untested:
        return verdict(CostOutcome.UNTESTED, "cost not assessed (untested)",
                       reason="; ".join(untested))
    bounds = (cost.low, cost.high)
    if ratio is not None:
        iv = ratio.interval
        point = ratio.point
        shown = "" if point is None else f"ratio {format_decided(point, bounds, COST_DIGITS)}"
        if iv is None or not math.isclose(iv.confidence_level, cl):
            why = ("the published summary gives no interval" if iv is None else
                   f"the published interval is at {iv.confidence_level * 100:g} %, the cost "
                   f"rule's at {pct}")
            return verdict(CostOutcome.UNDECIDABLE,
                           f"cost undecidable from the published summary ({shown or 'no ratio'})",
                           point=point, reason=why)
        return _decide_cost(cost, iv, point, verdict, None, None, f"published {shown}".strip())
    if len(tv) < 2 or len(cv_) < 2:
        point = None
        if tv and cv_:
            try:
                point = throughput.ratio_of_geometric_means(tv, cv_)
            except ValueError:
                point = None
        n = min(len(tv), len(cv_))
        return verdict(CostOutcome.UNDECIDABLE,
                       f"cost undecidable at {n} pass{'' if n == 1 else 'es'} (needs at least 2 "
                       "counted passes per arm for an interval)", point=point,
                       reason=f"needs at least 2 counted passes per arm with a {metric}, got "
                              f"{len(tv)} (treatment) and {len(cv_)} (control)")
    paired = cost.interval in ("paired", "hac")
    if paired:
        pt, pc = paired_values(treatment, control, metric)
        if len(pt) < 2:
            return dataclasses.replace(verdict(
                CostOutcome.UNDECIDABLE,
                f"cost undecidable at {len(pt)} pair{'' if len(pt) == 1 else 's'} of passes "
                f"(needs at least 2 for a {'paired' if cost.hac is None else 'HAC'} interval)",
                reason=f"needs at least 2 passes paired across the arms with a {metric}, got "
                       f"{len(pt)}"), n_pairs=len(pt))
    rho = 0.0
    try:
        pooled = throughput.pooled_cv([tv, cv_]).cv
        if cost.hac is not None:
            rr = serial.hac_ratio(pt, pc, cl, cost.hac)
            # planned at the pairs' own spread and lag-1 autocorrelation (bias-corrected, at
            # least 0), as design.estimate_serial_correlation plans from an earlier run
            need_cv = rr.sd_log_diff / math.sqrt(2.0)
            rho = design_rho.planning_rho(pt, pc)
        elif paired:
            rr = throughput.paired_ratio(pt, pc, cl)
            # a pair difference's SD s_d gives the Welch design's per-pass CV s_d / sqrt(2): the
            # same standard error at the same passes per arm
            need_cv = rr.se * math.sqrt(rr.n_treatment) / math.sqrt(2.0)
        else:
            rr = throughput.throughput_ratio(tv, cv_, cl)
            need_cv = pooled
        if paired:
            point, n_passes, what = rr.ratio, rr.n_treatment, "pairs of passes"
        else:
            point = throughput.ratio_of_geometric_means(tv, cv_)
            n_passes, what = min(len(tv), len(cv_)), "passes"
    except ValueError as exc:
        return verdict(CostOutcome.UNDECIDABLE, "cost undecidable (a per-pass value is not a "
                       "positive number)", reason=str(exc))
    decided = _decide_cost(cost, rr.interval, point, verdict, pooled, n_passes,
                           f"ratio {format_decided(point, bounds, COST_DIGITS)}", need_cv, what,
                           rho)
    return dataclasses.replace(decided, n_pairs=rr.n_treatment) if paired else decided


def _decide_cost(cost: CostRule, iv: stat_results.Interval, point: float | None, verdict,
                 pooled, n_passes: int | None, shown: str, need_cv: float | None = None,
                 what: str = "passes", rho: float = 0.0) -> CostVerdict:
    lo, hi = cost.low, cost.high
    bounds = (lo, hi)
    pct = f"{iv.confidence_level * 100:g} %"

    def f(x: float) -> str:
        return format_decided(x, bounds, COST_DIGITS)

    nums = f"{shown}, {pct} interval {f(iv.low)}–{f(iv.high)}".lstrip(", ")
    slower_below = cost.metric == "throughput"
    below, above = iv.high < lo, iv.low > hi
    if below or above:
        costs = below if slower_below else above
        a, b = iv.low, iv.high
        if cost.metric == "throughput":
            what = (f"{_pct_of(1 - b, cost.margin)}–{_pct_of(1 - a, cost.margin)} of throughput"
                    if costs else
                    f"throughput {f(a)}×–{f(b)}× the control's")
        else:
            what = (f"{f(a)}×–{f(b)}× the control's latency" if costs else
                    f"latency {f(a)}×–{f(b)}× the control's")
        if costs:
            return verdict(CostOutcome.COSTS, f"costs {what} ({nums})", point, iv, pooled)
        return verdict(CostOutcome.FASTER, f"faster: {what} ({nums})", point, iv, pooled)
    # non-inferiority: the slower end within the margin (the one-sided test at (1 - level) / 2)
    slower_end_within = lo <= iv.low if slower_below else iv.high <= hi
    if slower_end_within:
        reaches_faster = iv.high > hi if slower_below else iv.low < lo
        maybe = "; possibly faster" if reaches_faster else ""
        return verdict(CostOutcome.NO_MEASURABLE_COST, f"no measurable cost ({nums}{maybe})",
                       point, iv, pooled)
    need = None
    need_cv = pooled if need_cv is None else need_cv
    if need_cv is not None and point is not None and need_cv > 0:
        need = design_ratio.passes_to_decide(cost.margin, point, need_cv, iv.confidence_level,
                                             cost.metric, hac=cost.hac, rho=rho)
    at = "" if n_passes is None else f" at {n_passes} {what}"
    if n_passes is None:
        tail = ""
    elif need is not None:
        tail = (f"; about {need} passes per arm would decide it" if what == "passes" else
                f"; about {need} pairs would decide it")
    else:
        tail = f"; no number of {what} up to 200 would decide it at this ratio"
    return verdict(CostOutcome.UNDECIDABLE, f"cost undecidable{at} ({nums}{tail})", point, iv,
                   pooled, need)


def _pct_of(x: float, margin: float) -> str:
    """A share as a percentage for a cost statement, whole unless the margin needs decimals
    (``0.132 -> '13 %'``; ``0.1004`` against a 10 % margin -> ``'10.04 %'``)."""
    return f"{format_decided(x * 100, [margin * 100], 0)} %"
