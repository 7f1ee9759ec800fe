"""A decision rule's criteria evaluated on two arms (pure: no I/O, no clock, no printing).

:func:`bistat.core.classify.classify` evaluates every criterion of every declared label here.
Each criterion (its model: :mod:`bistat.core.rule`) gives a
:class:`~bistat.core.verdicts.CriterionResult`: its observed value, its threshold as text and
whether it was met, or ``met`` None and the reason where the data cannot evaluate it.

The statistics one classification needs are computed once and shared by its criteria
(:class:`_Context`): Wilson intervals for match rates, the Welch interval on log per-pass
throughput for the ratio, TOST on the log ratio for equivalence, Newcombe's interval and McNemar's
test for treatment against control (:mod:`bistat.core.proportions`,
:mod:`bistat.core.throughput`). Activation criteria read the paired counts and the activation
evidence (:mod:`bistat.core.classify_inputs`); a published ratio
(:class:`~bistat.core.classify_inputs.RatioSummary`) stands in for the per-pass values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bistat.core import proportions, stat_results, throughput
from bistat.core.classify_inputs import ActivationEvidence, ArmStats, PairedCounts, RatioSummary
from bistat.core.decided import format_decided
from bistat.core.rule import (
    ControlDiverges,
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
)
from bistat.core.verdicts import CriterionResult


class _Context:
    """Statistics shared by the criteria of one classification, computed on demand."""

    def __init__(self, rule: Rule, control: ArmStats, treatment: ArmStats,
                 paired: PairedCounts | None = None, evidence: ActivationEvidence | None = None,
                 summary: RatioSummary | None = None):
        self.rule = rule
        self.arms = {"control": control, "treatment": treatment}
        self.paired = paired
        self.evidence = evidence
        self.summary = summary
        self._cache: dict[Any, Any] = {}

    # ---- statistics (each either a value or a ``_NotEvaluable``)

    def wilson(self, role: str, alternative: str) -> "stat_results.Interval | _NotEvaluable":
        key = ("wilson", role, alternative)
        if key not in self._cache:
            arm = self.arms[role]
            if arm.n_prompts <= 0:
                self._cache[key] = _NotEvaluable(f"{role} arm '{arm.name}' compared no prompts")
            else:
                self._cache[key] = proportions.wilson_interval(
                    arm.n_matched, arm.n_prompts, self.rule.confidence_level, alternative)
        return self._cache[key]

    def ratio_point(self) -> "float | _NotEvaluable":
        if self.summary is not None:
            if self.summary.point is None:
                return _NotEvaluable("the published summary gives no point estimate of the ratio")
            return float(self.summary.point)
        t, c = self.arms["treatment"].pass_throughputs, self.arms["control"].pass_throughputs
        if not t or not c:
            return _NotEvaluable("an arm has no counted pass")
        try:
            return throughput.ratio_of_geometric_means(t, c)
        except ValueError:
            return _NotEvaluable("a pass throughput is not a positive number")

    def ratio(self) -> "stat_results.RatioResult | RatioSummary | _NotEvaluable":
        if self.summary is not None:
            iv = self.summary.interval
            if iv is None:
                return _NotEvaluable("the published summary gives no interval for the ratio")
            if not math.isclose(iv.confidence_level, self.rule.confidence_level):
                return _NotEvaluable(
                    f"the published interval is at {iv.confidence_level * 100:g} %, the rule's "
                    f"criteria at {self.rule.confidence_level * 100:g} %")
            return self.summary
        if "ratio" not in self._cache:
            self._cache["ratio"] = self._repeat_passes(
                lambda t, c: throughput.throughput_ratio(t, c, self.rule.confidence_level))
        return self._cache["ratio"]

    def tost(self, low: float, high: float) -> "stat_results.TostResult | _NotEvaluable":
        if self.summary is not None:
            return _NotEvaluable("TOST needs the per-pass throughputs, not a published summary")
        return self._repeat_passes(
            lambda t, c: throughput.tost_ratio(t, c, low, high, self.rule.tost_alpha))

    def _repeat_passes(self, fn):
        t, c = self.arms["treatment"].pass_throughputs, self.arms["control"].pass_throughputs
        if len(t) < 2 or len(c) < 2:
            return _NotEvaluable(f"needs at least 2 counted passes per arm, got {len(t)} "
                                 f"(treatment) and {len(c)} (control)")
        try:
            return fn(t, c)
        except ValueError as exc:  # non-positive or non-finite throughputs
            return _NotEvaluable(str(exc))

    def newcombe(self) -> "stat_results.Interval | _NotEvaluable":
        t, c = self.arms["treatment"], self.arms["control"]
        for role, arm in (("treatment", t), ("control", c)):
            if arm.n_prompts <= 0:
                return _NotEvaluable(f"{role} arm '{arm.name}' compared no prompts")
        return proportions.newcombe_difference(t.n_matched, t.n_prompts, c.n_matched,
                                               c.n_prompts, self.rule.confidence_level)

    def mcnemar(self) -> "stat_results.McNemarResult | _NotEvaluable":
        if self.paired is None:
            return _NotEvaluable("no paired counts: the arms were not compared prompt by prompt")
        return proportions.mcnemar_test(self.paired.control_only, self.paired.treatment_only)

    # ---- criteria

    def evaluate(self, crit: Any) -> CriterionResult:
        description, threshold = crit.describe(self.rule)
        declared = crit.model_dump(mode="json", by_alias=True)

        def result(observed, text, met, reason=None):
            return CriterionResult(crit.criterion, description, threshold, observed, text, met,
                                   reason, declared)

        def not_evaluable(ne: _NotEvaluable):
            return result(None, "not evaluable", None, ne.reason)

        if isinstance(crit, (MatchLowerBound, MatchUpperBound, ControlDiverges)):
            alternative = self.rule.alternative
            if alternative != "two-sided":  # one-sided: the bound on the criterion's side
                alternative = "greater" if isinstance(crit, MatchLowerBound) else "less"
            role = "control" if isinstance(crit, ControlDiverges) else crit.arm
            iv = self.wilson(role, alternative)
            if isinstance(iv, _NotEvaluable):
                return not_evaluable(iv)
            arm = self.arms[role]
            # the interval named by its kind: a finding also shows the two-sided one
            sided = "two-sided" if alternative == "two-sided" else "one-sided"
            ctx = f"{arm.n_matched} of {arm.n_prompts} matched; {sided} interval {_iv(iv)}"
            if isinstance(crit, MatchLowerBound):
                return result(iv.low, f"{format_decided(iv.low, [crit.at_least])} ({ctx})",
                              iv.low >= crit.at_least)
            if isinstance(crit, ControlDiverges):
                return result(iv.high, f"{format_decided(iv.high, [crit.at_most])} ({ctx})",
                              iv.high <= crit.at_most)
            return result(iv.high, f"{format_decided(iv.high, [crit.below])} ({ctx})",
                          iv.high < crit.below)

        if isinstance(crit, MatchIntervalsOverlap):
            ivs = {r: self.wilson(r, "two-sided") for r in ("treatment", "control")}
            for iv in ivs.values():
                if isinstance(iv, _NotEvaluable):
                    return not_evaluable(iv)
            overlap = proportions.intervals_overlap(ivs["treatment"], ivs["control"])
            text = (f"{'yes' if overlap else 'no'} (treatment {_iv(ivs['treatment'])}, "
                    f"control {_iv(ivs['control'])})")
            return result(overlap, text, overlap == crit.expect)

        if isinstance(crit, ThroughputRatio):
            bound = crit.below if crit.below is not None else crit.at_least
            if crit.statistic == "point":
                point = self.ratio_point()
                if isinstance(point, _NotEvaluable):
                    return not_evaluable(point)
                if self.summary is not None:
                    where = "published point estimate"
                else:
                    t = self.arms["treatment"].pass_throughputs
                    c = self.arms["control"].pass_throughputs
                    where = f"{len(t)} vs {len(c)} counted passes"
                value, text = point, f"{format_decided(point, [bound])} ({where})"
            else:
                rr = self.ratio()
                if isinstance(rr, _NotEvaluable):
                    return not_evaluable(rr)
                iv = rr.interval
                value = iv.low if crit.statistic == "interval_low" else iv.high
                text = f"{format_decided(value, [bound])} ({_ratio_text(rr)})"
            if crit.below is not None:
                return result(value, text, value < crit.below)
            return result(value, text, value >= crit.at_least)

        if isinstance(crit, ThroughputSlower):
            rr = self.ratio()
            if isinstance(rr, _NotEvaluable):
                return not_evaluable(rr)
            high = rr.interval.high
            return result(high, f"{format_decided(high, [crit.bound])} ({_ratio_text(rr)})",
                          high < crit.bound)

        if isinstance(crit, ThroughputNotSlower):
            if crit.is_tost:
                res = self.tost(crit.margin_low, crit.margin_high)
                if isinstance(res, _NotEvaluable):
                    return not_evaluable(res)
                if math.isnan(res.pvalue):
                    return result(None, "not evaluable", None,
                                  "TOST p-value undefined (no pass-to-pass variation)")
                a = self.rule.tost_alpha
                text = (f"p = {format_decided(res.pvalue, [a])} (ratio {res.ratio:.4f}, df "
                        f"{res.df:.1f}; equivalent if p < {a:g})")
                return result(res.pvalue, text, bool(res.equivalent))
            rr = self.ratio()
            if isinstance(rr, _NotEvaluable):
                return not_evaluable(rr)
            low = rr.interval.low
            return result(low, f"{format_decided(low, [crit.lower_at_least])} "
                               f"({_ratio_text(rr)})", low >= crit.lower_at_least)

        if isinstance(crit, LargeDriftsAtMost):
            arm = self.arms[crit.arm]
            if arm.large_drifts is None:
                return not_evaluable(_NotEvaluable(
                    f"the summary has no large-drift count for {crit.arm} arm '{arm.name}'"))
            return result(arm.large_drifts, str(arm.large_drifts), arm.large_drifts <= crit.count)

        if isinstance(crit, TreatmentBeatsControl):
            return self._beats(crit, result, not_evaluable)

        if isinstance(crit, ProbeConfirmed):
            ev = self.evidence
            arm = self.arms["treatment"].name
            if ev is None or not ev.probe_recorded:
                return not_evaluable(_NotEvaluable(
                    "no probe report in the run directory; record one with `bistat probe "
                    "REGISTRATION --output RUN_DIR/probe.json`, then analyse again"))
            if ev.probe is None:
                return not_evaluable(_NotEvaluable(
                    f"the probe report does not probe arm '{arm}'; probe it (`bistat probe "
                    f"REGISTRATION --arm {arm} --output RUN_DIR/probe-{arm}.json`)"))
            return result(ev.probe == "confirmed", _PROBE_TEXT.get(ev.probe, ev.probe),
                          ev.probe == "confirmed")

        if isinstance(crit, EngineLog):
            ev = self.evidence
            if ev is None or ev.log_markers is None:
                return not_evaluable(_NotEvaluable(
                    f"no engine log was kept for the treatment arm "
                    f"'{self.arms['treatment'].name}'"))
            seen = bool(ev.log_markers.get(crit.marker, False))
            return result(seen, "yes" if seen else "no", seen)

        raise TypeError(f"unknown criterion model {type(crit).__name__}")

    def _beats(self, crit: TreatmentBeatsControl, result, not_evaluable) -> CriterionResult:
        """``treatment_beats_control``: each declared test, then ``require`` over them."""
        parts: list[tuple[float | None, str, bool | None, str | None]] = []
        if crit.newcombe_at_least is not None:
            iv = self.newcombe()
            if isinstance(iv, _NotEvaluable):
                parts.append((None, "Newcombe not evaluable", None, iv.reason))
            else:
                shown = format_decided(iv.low, [crit.newcombe_at_least])
                parts.append((iv.low, f"{shown} (Newcombe interval [{iv.low:+.4f}, "
                                      f"{iv.high:+.4f}])", iv.low >= crit.newcombe_at_least, None))
        if crit.mcnemar_below is not None:
            mc = self.mcnemar()
            if isinstance(mc, _NotEvaluable):
                parts.append((None, "McNemar not evaluable", None, mc.reason))
            else:
                ahead = mc.c > mc.b
                shown = format_decided(mc.pvalue, [crit.mcnemar_below], significant=True)
                parts.append((mc.pvalue, f"{shown} (McNemar: {mc.b} control only / {mc.c} "
                                         f"treatment only, {mc.method}; treatment "
                                         f"{'ahead' if ahead else 'not ahead'})",
                              bool(mc.pvalue < crit.mcnemar_below and ahead), None))
        mets = [m for _, _, m, _ in parts]
        if crit.require == "both":
            met = False if False in mets else (None if None in mets else True)
        else:
            met = True if True in mets else (None if None in mets else False)
        if met is None:
            return not_evaluable(_NotEvaluable("; ".join(r for *_, r in parts if r)))
        if len(parts) == 1:
            value, text, _, _ = parts[0]
            return result(value, text, met)
        names = ("Newcombe lower end", "McNemar p")
        return result(met, ("yes" if met else "no") + " (" + "; ".join(
            f"{name} {t}" for name, (_, t, _, _) in zip(names, parts)) + ")", met)


_PROBE_TEXT = {
    "confirmed": "confirmed (bitwise invariant; the negative control differed)",
    "no_power": "no power (the negative control showed no difference, or none was run)",
    "violated": "violated (the probe saw the treatment differ)",
    "vacuous": "vacuous (the needle never shared an engine step)",
    "untested": "untested (the probe could not run)",
}


@dataclass(frozen=True)
class _NotEvaluable:
    reason: str


def _iv(iv: stat_results.Interval) -> str:
    return f"[{iv.low:.4f}, {iv.high:.4f}]"


def _ratio_text(rr: "stat_results.RatioResult | RatioSummary") -> str:
    if isinstance(rr, RatioSummary):
        point = "—" if rr.point is None else f"{rr.point:.4f}"
        return (f"published ratio {point}, {rr.interval.confidence_level * 100:g} % interval "
                f"{_iv(rr.interval)}")
    return (f"ratio {rr.ratio:.4f}, {rr.interval.confidence_level * 100:g} % interval "
            f"{_iv(rr.interval)}, Welch df {rr.df:.1f}")
