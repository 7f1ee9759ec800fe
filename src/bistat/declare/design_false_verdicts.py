"""The design analysis's false verdicts: each label's false-positive probability when there is no
slowdown (true ratio 1, labels with a slowdown criterion) and, for *working*, in an A/A
experiment (the treatment's mode doing nothing: both arms at one match rate, the worst over a grid
of rates), with a warning naming the passes or prompts that bring it under the rule's alpha
(``1 - confidence_level``) when it exceeds it; and the probability of each label at the assumed
rates and true ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from bistat.core import design_match, design_ratio
from bistat.core.lazy import lazy_module
from bistat.core.rule import (
    ControlDiverges,
    MatchLowerBound,
    MatchUpperBound,
    Rule,
    ThroughputNotSlower,
    ThroughputRatio,
    ThroughputSlower,
    TreatmentBeatsControl,
)
from bistat.declare.design_power import (ThroughputDesign, criterion_holds, lower_alt, power_fn,
                                         upper_alt)

_sps = lazy_module("scipy.stats")

__all__ = [
    "AA_MATCH_RATES",
    "FalsePositive",
    "LabelProbability",
    "MAX_PROMPTS_FOR_ALPHA",
    "false_positive_warnings",
    "false_positives",
    "label_probabilities",
]


@dataclass(frozen=True)
class FalsePositive:
    """A label's probability of being met when what it asserts is false.

    ``scenario``: ``"no slowdown"`` (true ratio 1, the assumed match rates) or ``"A/A"`` (the
    treatment's mode does nothing: both arms at ``match_rate``, true ratio 1; the worst rate of
    the grid). ``prob`` is exact or an upper bound (``bound``); ``fix`` what brings it under
    alpha when it exceeds it.
    """

    label: str
    scenario: str
    match_rate: float | None
    prob: float
    bound: bool
    alpha: float
    fix: str | None = None

    @property
    def exceeds(self) -> bool:
        return self.prob > self.alpha


@dataclass(frozen=True)
class LabelProbability:
    """P(label's criteria all met) at a true ratio, when the criteria are independent."""

    label: str
    true_ratio: float
    prob: float | None
    note: str | None = None


#: A/A match rates the false-positive analysis tries, beside the declared assumed rates.
AA_MATCH_RATES = (0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


def _k_bounds(n: int, crits: list[Any], role: str, rule: Rule) -> tuple[int, int] | None:
    """The matched counts ``k`` (out of ``n``) at which every match criterion on ``role``'s arm
    holds, as ``(k_min, k_max)``; None when no ``k`` does. Each bound is monotone in ``k``."""
    from bistat.core.stats import wilson_interval

    cl = rule.confidence_level
    lo, hi = 0, n
    for c in crits:
        if isinstance(c, MatchLowerBound) and c.arm == role:
            tol = design_match.max_mismatches_tolerated(n, c.at_least, cl, lower_alt(rule))
            if tol < 0:
                return None
            lo = max(lo, n - tol)
        elif (isinstance(c, MatchUpperBound) and c.arm == role) or (
                isinstance(c, ControlDiverges) and role == "control"):
            def ok(k: int, c=c) -> bool:
                high = wilson_interval(k, n, cl, upper_alt(rule)).high
                return high < c.below if isinstance(c, MatchUpperBound) else high <= c.at_most
            if not ok(0):
                return None
            top = n
            if not ok(n):
                a, b = 0, n
                while b - a > 1:
                    mid = (a + b) // 2
                    a, b = (mid, b) if ok(mid) else (a, mid)
                top = a
            hi = min(hi, top)
    return (lo, hi) if lo <= hi else None


def _arm_prob(n: int, crits: list[Any], role: str, rule: Rule, rate: float) -> float:
    from scipy import stats as sps

    bounds = _k_bounds(n, crits, role, rule)
    if bounds is None:
        return 0.0
    lo, hi = bounds
    return float(sps.binom.cdf(hi, n, rate) - (sps.binom.cdf(lo - 1, n, rate) if lo > 0 else 0.0))


def _throughput_prob_at_one(crits: list[Any], passes: int, cv: float, rule: Rule
                            ) -> float | None:
    """P(all throughput criteria met | true ratio 1): exact for one, the smallest for several
    (a bound); None without throughput criteria; 1 with one counted pass (no power figure)."""
    through = [c for c in crits if isinstance(c, (ThroughputRatio, ThroughputSlower,
                                                  ThroughputNotSlower))]
    if not through:
        return None
    if passes < 2:
        # one pass per arm: the point estimate still has its planning-model spread (log ratio
        # ~ N(0, 2 sigma^2)); a criterion on an interval cannot be evaluated, hence never met
        sigma = design_ratio.log_sd_from_cv(cv)
        probs = []
        for c in through:
            if isinstance(c, ThroughputRatio) and c.statistic == "point":
                z = math.log(c.below if c.below is not None else c.at_least) / (sigma * math.sqrt(2))
                probs.append(float(_sps.norm.cdf(z) if c.below is not None else _sps.norm.sf(z)))
            else:
                probs.append(0.0)
        return min(probs)
    return min(power_fn(c, cv, rule.confidence_level, rule.tost_alpha)(1.0, passes)
               for c in through)


def _pair_bound(crits: list[Any], n: int, rate: float, rule: Rule) -> float:
    """An upper bound on P(the criteria comparing the arms are met) when both arms match at
    ``rate``: the tests' own false-positive rates (exact under the planning model), 1 for
    criteria without one."""
    bound = 1.0
    for c in crits:
        if isinstance(c, TreatmentBeatsControl):
            probs = []
            if c.newcombe_at_least is not None:
                probs.append(design_match.power_newcombe(n, rate, rate, c.newcombe_at_least,
                                                         rule.confidence_level))
            if c.mcnemar_below is not None:
                probs.append(design_match.power_mcnemar(n, rate, rate, c.mcnemar_below))
            bound = min(bound, min(probs) if c.require == "both" else min(1.0, sum(probs)))
    return bound


def false_positives(rule: Rule, n: int, passes: int, cv: float, rate: float,
                     control_rate: float) -> list[FalsePositive]:
    """Each label's false-positive probability (see :class:`FalsePositive`)."""
    alpha = rule.alpha
    out: list[FalsePositive] = []
    for spec in rule.labels:
        crits = list(spec.criteria)
        p_thr = _throughput_prob_at_one(crits, passes, cv, rule)
        slowdown = [c for c in crits if isinstance(c, (ThroughputRatio, ThroughputSlower,
                                                       ThroughputNotSlower))
                    and not criterion_holds(c, 1.0)]
        if slowdown and p_thr is not None:
            p_t = _arm_prob(n, crits, "treatment", rule, rate)
            p_c = _arm_prob(n, crits, "control", rule, control_rate)
            prob = p_t * p_c * p_thr
            bound = len(slowdown) > 1 or any(
                not isinstance(c, (ThroughputRatio, ThroughputSlower, ThroughputNotSlower,
                                   MatchLowerBound, MatchUpperBound, ControlDiverges))
                for c in crits)
            fix = None
            if prob > alpha:
                fix = _passes_fix(lambda k: p_t * p_c * _throughput_prob_at_one(
                    crits, k, cv, rule), alpha)
            out.append(FalsePositive(spec.label, "no slowdown", None, prob, bound, alpha, fix))
        if spec.label != "working":
            continue
        rates = sorted({*AA_MATCH_RATES, rate, control_rate})

        def aa_worst(k: int) -> tuple[float, float]:
            """(the worst A/A match rate, the label's bound there) with ``k`` prompts."""
            out = (rates[0], -1.0)
            for q in rates:
                arms = (_arm_prob(k, crits, "treatment", rule, q)
                        * _arm_prob(k, crits, "control", rule, q))
                prob = min(arms, _pair_bound(crits, k, q, rule)) * (1.0 if p_thr is None
                                                                    else p_thr)
                if prob > out[1]:
                    out = (q, prob)
            return out

        p, prob = aa_worst(n)
        fix = None
        if prob > alpha:
            compares = any(isinstance(c, (ControlDiverges, TreatmentBeatsControl)) for c in crits)
            fix = ("" if compares else
                   "the label never compares the arms' match rates, so a mode that does nothing "
                   "meets it as often as the treatment matches; add control_diverges and "
                   "treatment_beats_control to it")
            if p_thr is not None and p_thr < 1.0:
                arms_p = prob / p_thr
                passes_fix = _passes_fix(lambda k: arms_p * _throughput_prob_at_one(
                    crits, k, cv, rule), alpha)
                fix = "; ".join(x for x in (passes_fix, fix) if x)
            if not fix:
                need = _prompts_under_alpha(lambda k: aa_worst(k)[1], n, alpha)
                fix = (f"about {need} prompts bring it under alpha (set workload.n_prompts >= "
                       f"{need})" if need is not None else
                       "no number of prompts up to 100000 brings it under alpha; tighten the "
                       "activation criteria's thresholds")
        out.append(FalsePositive(spec.label, "A/A", p, prob, True, alpha, fix))
    return out


#: Prompts searched at most when suggesting how many bring a false-positive rate under alpha.
MAX_PROMPTS_FOR_ALPHA = 100_000


def _prompts_under_alpha(prob: Callable[[int], float], start: int, alpha: float) -> int | None:
    """About how many prompts bring ``prob(prompts)`` under ``alpha`` (doubling from ``start``,
    then bisection to 1 %: Wilson-bound probabilities saw-tooth in the number of prompts, so
    the answer is approximate, and the warning says "about")."""
    lo, hi = start, start * 2
    while prob(hi) > alpha:
        lo, hi = hi, hi * 2
        if hi > MAX_PROMPTS_FOR_ALPHA:
            return None
    return design_ratio.bisect_power(lambda k: 1.0 if prob(k) <= alpha else 0.0, 0.5, lo, hi,
                                     divisor=100)


def _passes_fix(prob: Callable[[int], float], alpha: float) -> str:
    """The passes per arm at which ``prob(passes) <= alpha``, in words."""
    need = design_ratio.min_passes_for_power(lambda k: 1.0 if prob(k) <= alpha else 0.0, 0.5)
    if need is None:
        return "no number of passes up to 200 brings it under alpha"
    return f"{need} passes per arm bring it under alpha (set workload.passes >= {need})"


def false_positive_warnings(fps: list[FalsePositive]) -> list[str]:
    out = []
    for fp in fps:
        if not fp.exceeds:
            continue
        what = ("when there is no slowdown at all (true ratio 1)" if fp.scenario == "no slowdown"
                else f"in an A/A experiment (the treatment's mode doing nothing: both arms at a "
                     f"match rate of {fp.match_rate:g}, true ratio 1)")
        out.append(f"rule label '{fp.label}' is met {what} with probability "
                   f"{'up to ' if fp.bound else ''}{fp.prob:.3f}, above the rule's alpha "
                   f"{fp.alpha:.3g}: a false '{fp.label}'; {fp.fix}")
    return out


def label_probabilities(label: str, match: list[float | None],
                         through: list[ThroughputDesign], ratios, independent: bool,
                         activation: bool = False) -> list[LabelProbability]:
    out: list[LabelProbability] = []
    for i, r in enumerate(ratios):
        if activation:
            note = ("not computed: its activation criteria read the same prompts as its match "
                    "criteria (each criterion's figure is above)")
        elif not independent:
            note = "not computed: a criterion of this label has no design figures"
        elif len(match) > 1 or len(through) > 1:
            note = "not computed: criteria on the same data are not independent"
        else:
            note = None
        prob: float | None = None
        if note is None:
            parts = list(match) + [td.power[i].prob_met for td in through]
            if any(p is None for p in parts):
                note = "not computed: a criterion has no probability"
            else:
                prob = math.prod(parts)  # type: ignore[arg-type]
        out.append(LabelProbability(label, r, prob, note))
    return out
