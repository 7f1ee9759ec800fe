"""The design analysis per criterion: what each criterion of the declared rule can conclude at
the declared prompts and passes, and the prompts or passes that would reach the power target.

- match-rate criteria (``match_lower_bound``): the smallest number of prompts for which a perfect
  match clears the threshold, the mismatches tolerated at the declared number of prompts, and the
  probability that the criterion is met at the assumed true match rate;
- throughput criteria: the expected width of the ratio interval at the declared passes and CV, and
  the probability that the criterion is met at each true ratio (``design.true_ratios``);
- activation criteria: ``control_diverges`` and ``treatment_beats_control`` at the assumed match
  rates (the probe and the engine log have no design figures: their power shows in the run);
- the cost rule (``[rule.cost]``): the probability of each outcome at each true ratio and the
  passes per arm that would decide it at a true ratio of 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from bistat.core import design_coverage, design_match, design_ratio, design_rho
from bistat.core.serial import cosine_terms
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
    ThroughputRatio,
    ThroughputSlower,
    needs_repeat_passes,
)

__all__ = [
    "ActivationDesign",
    "CostDesign",
    "MAX_PROMPTS_SEARCHED",
    "MatchDesign",
    "PowerAt",
    "ThroughputDesign",
    "activation_design",
    "activation_warnings",
    "cost_design",
    "cost_warnings",
    "criterion_holds",
    "lower_alt",
    "match_design",
    "match_warnings",
    "no_design_reason",
    "power_fn",
    "throughput_design",
    "throughput_warnings",
    "upper_alt",
]


#: Prompts searched at most when suggesting a number of prompts.
MAX_PROMPTS_SEARCHED = 1_000_000


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
    #: the declared interval (``"welch"``, ``"paired"``, ``"hac"``), which the figures plan
    interval: str = "welch"
    #: ``"hac"``: the cosine terms ``B`` at the declared pairs (its t's degrees of freedom)
    hac_terms: int | None = None
    #: the lag-1 autocorrelation of the pairs' log differences the interval is planned at (a
    #: HAC interval: the earlier run's, bias-corrected; 0: pairs taken as independent)
    rho: float = 0.0
    #: the earlier run's serial correlation (``design.cv_from``; None: no comparison of enough
    #: pairs), the run, and the two arms of the comparison it is of (the estimate's
    #: ``treatment`` and ``control``, in that order: the most conservative comparison,
    #: :func:`bistat.declare.design_cv.serial_estimate`)
    serial: design_rho.SerialEstimate | None = None
    serial_from: str | None = None
    serial_arms: tuple[str, ...] = ()
    #: what it does to the declared interval (its coverage there; contradicted, at risk)
    check: design_coverage.AssumptionCheck | None = None
    #: the earlier run's comparisons whose pairs of passes planned the cost, ``(treatment,
    #: control, pairs)`` each (:func:`bistat.declare.design_cv.pairs_from_run`); empty when no
    #: pairs were read
    pairs: tuple[tuple[str, str, int], ...] = ()


def no_design_reason(crit: Any) -> str:
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


def upper_alt(rule: Rule) -> str:
    """The Wilson upper bound's sidedness under the rule (one-sided: alternative "less")."""
    return "two-sided" if rule.alternative == "two-sided" else "less"


def lower_alt(rule: Rule) -> str:
    return "two-sided" if rule.alternative == "two-sided" else "greater"


def activation_design(label, field, crit, description, threshold, n, rule: Rule, rate: float,
                       control_rate: float, target: float) -> ActivationDesign:
    cl = rule.confidence_level
    if isinstance(crit, ControlDiverges):
        def prob(k: int) -> float:
            return design_match.prob_upper_bound_at_most(k, control_rate, crit.at_most, cl,
                                                         upper_alt(rule))
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
            got.append(("newcombe", design_match.power_newcombe(k, rate, control_rate,
                                                                crit.newcombe_at_least, cl)))
        if crit.mcnemar_below is not None:
            got.append(("mcnemar", design_match.power_mcnemar(k, rate, control_rate,
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


def activation_warnings(ad: ActivationDesign, where: str, target: float) -> list[str]:
    if ad.prob_met is None or ad.prob_met >= target:
        return []
    fix = (f"about {ad.prompts_for_target} prompts would give {target:.0%} (set "
           "workload.n_prompts)" if ad.prompts_for_target is not None else
           ad.note or f"no number of prompts up to {MAX_PROMPTS_SEARCHED} reaches {target:.0%}")
    return [f"{where}: P(met) = {ad.prob_met:.3f} with {ad.n_prompts} prompts at assumed match "
            f"rates of {ad.assumed_match_rate:g} (treatment) and "
            f"{ad.assumed_control_match_rate:g} (control), below the power target "
            f"{target:.0%}; {fix}"]


def cost_design(cost: CostRule, passes: int, cv: float, ratios, target: float, *,
                rho: float = 0.0, serial: design_rho.SerialEstimate | None = None,
                serial_from: str | None = None, serial_arms: tuple[str, ...] = (),
                check: design_coverage.AssumptionCheck | None = None,
                pairs: tuple[tuple[str, str, int], ...] = ()) -> CostDesign:
    """The cost rule's figures for the interval it declares: Welch's, the paired one (for
    independent pairs) or the HAC one (at the pairs' lag-1 autocorrelation ``rho``)."""
    grid = tuple(dict.fromkeys((1.0, *ratios)))
    paired, hac = cost.interval == "paired", cost.hac
    rho = rho if hac is not None else 0.0
    factor = (design_ratio.expected_ratio_interval_factor(passes, cv, cost.confidence_level, paired,
                                                          hac=hac)
              if passes >= 2 else None)
    outcomes = tuple((r, design_ratio.cost_outcome_probabilities(
        cost.margin, r, passes, cv, cost.confidence_level, cost.metric, paired, hac=hac,
        rho=rho)) for r in grid) if passes >= 2 else ()
    decide = tuple((r, design_ratio.passes_to_decide(cost.margin, r, cv, cost.confidence_level,
                                                     cost.metric, target, paired=paired, hac=hac,
                                                     rho=rho))
                   for r in grid)
    terms = cosine_terms(passes, hac.bandwidth) if hac is not None and passes >= 2 else None
    return CostDesign(cost.describe(), cost.metric, cost.margin, cost.confidence_level, passes,
                      cv, factor, outcomes, decide, cost.interval, terms, rho, serial,
                      serial_from, serial_arms, check, pairs)


def cost_warnings(cd: CostDesign, target: float) -> list[str]:
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


def match_design(label, field, crit, description, threshold, n, cl, alt, rate) -> MatchDesign:
    min_n = design_match.min_prompts_for_threshold(crit.at_least, cl, alt)
    tolerated = design_match.max_mismatches_tolerated(n, crit.at_least, cl, alt)
    prob = design_match.prob_lower_bound_at_least(n, rate, crit.at_least, cl, alt)
    return MatchDesign(label, field, crit.criterion, description, threshold, n, min_n, tolerated,
                       rate, prob)


def match_warnings(md: MatchDesign, where: str, crit: MatchLowerBound, cl: float, alt: str,
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
            needed = _prompts_for_power(lambda k: design_match.prob_lower_bound_at_least(
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
    return design_ratio.bisect_power(power, target, lo, hi, divisor=100)


def criterion_holds(crit: Any, r: float) -> bool:
    """Whether the criterion is true of the true ratio ``r`` (what it is meant to detect)."""
    if isinstance(crit, ThroughputRatio):
        return r < crit.below if crit.below is not None else r >= crit.at_least
    if isinstance(crit, ThroughputSlower):
        return r < crit.bound
    if crit.is_tost:
        return crit.margin_low < r < crit.margin_high
    return r >= crit.lower_at_least


def power_fn(crit: Any, cv: float, cl: float, tost_alpha: float) -> Callable[[float, int], float]:
    """``(true_ratio, passes_per_arm) -> P(criterion met)``."""
    if isinstance(crit, ThroughputRatio):
        bound = crit.below if crit.below is not None else crit.at_least
        if crit.statistic == "point":
            fn = design_ratio.power_ratio_point_below if crit.below is not None \
                else design_ratio.power_ratio_point_at_least
            return lambda r, p: fn(bound, r, p, cv)
        # interval_high < b: the whole interval below b; interval_low >= b: the whole above.
        # The two mixed forms are complements of those.
        if crit.statistic == "interval_high":
            if crit.below is not None:
                return lambda r, p: design_ratio.power_ratio_interval_below(bound, r, p, cv, cl)
            return lambda r, p: 1.0 - design_ratio.power_ratio_interval_below(bound, r, p, cv, cl)
        if crit.at_least is not None:
            return lambda r, p: design_ratio.power_ratio_interval_above(bound, r, p, cv, cl)
        return lambda r, p: 1.0 - design_ratio.power_ratio_interval_above(bound, r, p, cv, cl)
    if isinstance(crit, ThroughputSlower):
        return lambda r, p: design_ratio.power_ratio_interval_below(crit.bound, r, p, cv, cl)
    if crit.is_tost:
        return lambda r, p: design_ratio.power_tost(crit.margin_low, crit.margin_high, r, p, cv,
                                                    tost_alpha)
    return lambda r, p: design_ratio.power_ratio_interval_above(crit.lower_at_least, r, p, cv, cl)


def throughput_design(label, field, crit, description, threshold, passes, cv, cl, tost_alpha,
                       ratios, target) -> ThroughputDesign:
    if passes < 2:
        why = ("1 counted pass per arm gives no estimate of pass-to-pass variation, so no "
               "ratio interval" if needs_repeat_passes(crit) else
               "1 counted pass per arm: the ratio's sampling error cannot be estimated")
        fn = power_fn(crit, cv, cl, tost_alpha)
        power = tuple(PowerAt(r, None, criterion_holds(crit, r),
                              design_ratio.min_passes_for_power(lambda p, r=r: fn(r, p), target)
                              if criterion_holds(crit, r) else None) for r in ratios)
        return ThroughputDesign(label, field, crit.criterion, description, threshold, passes, cv,
                                None, None, power, note=why)
    half = design_ratio.expected_ratio_halfwidth(passes, cv, cl)
    fn = power_fn(crit, cv, cl, tost_alpha)
    power = []
    for r in ratios:
        prob = fn(r, passes)
        holds = criterion_holds(crit, r)
        need = None
        if holds and prob < target:
            need = design_ratio.min_passes_for_power(lambda p, r=r: fn(r, p), target)
        power.append(PowerAt(r, prob, holds, need))
    return ThroughputDesign(label, field, crit.criterion, description, threshold, passes, cv,
                            half, math.exp(half), tuple(power))


def throughput_warnings(td: ThroughputDesign, where: str, crit: Any, ratios, target) -> list[str]:
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
