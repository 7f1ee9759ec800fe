"""The mechanical classifier: (sealed rule, run summary, validity checks) -> ``Verdict``.

``classify`` is a pure function. It tries the rule's labels in order; the first label whose
criteria all hold is the verdict, else the rule's ``otherwise`` label. A run that could not test
the hypothesis (``RunStatus.testable`` false: the engine refused the setting, failed to start,
failed every request) or whose declared validity checks failed is *untested*, whatever the
criteria say; the criteria are still evaluated where the data allow, so the finding can show
them.

Every criterion is reported with its observed value, its threshold (as text) and whether it was
met. A criterion the data cannot evaluate -- a ratio interval with fewer than two counted passes
per arm, a match rate with no prompts, a large-drift cap when the summary has no count -- is
"not evaluable" (``met is None``), and a label with such a criterion cannot be met; the verdict
says so in ``notes``.

The intervals come from ``bistat.stats``: Wilson intervals for match rates, the Welch interval
on log per-pass throughput for the ratio, TOST on the log ratio for equivalence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from bistat import stats
from bistat.rule import (
    Label,
    LargeDriftsAtMost,
    MatchIntervalsOverlap,
    MatchLowerBound,
    MatchUpperBound,
    Rule,
    ThroughputNotSlower,
    ThroughputRatio,
    ThroughputSlower,
)

__all__ = [
    "ArmStats",
    "ValidityCheck",
    "RunStatus",
    "CriterionResult",
    "LabelResult",
    "Verdict",
    "SENTENCES",
    "classify",
]

#: One fixed sentence per label (a finding prints it verbatim).
SENTENCES: dict[Label, str] = {
    Label.WORKING: "Batch invariance is working by the registered rule.",
    Label.DOUBTFUL: "Batch invariance is doubtful by the registered rule.",
    Label.REPORTED_AS_OBSERVED: "The results are reported as observed: the registered rule "
                                "assigns them no other label.",
    Label.UNTESTED: "The hypothesis was not tested: the run could not test it, so its results "
                    "are evidence neither way.",
}


@dataclass(frozen=True)
class ArmStats:
    """One arm's summary, as produced by ``bistat.analysis`` from recorded data.

    Attributes
    ----------
    name, role : str
        The arm's declared name and role (``"control"`` / ``"treatment"``).
    n_prompts : int
        Prompts compared across the arm's counted passes.
    n_matched : int
        Prompts whose passes all matched (by the declared match unit and multi-pass rule).
    pass_throughputs : tuple of float
        Output tokens/s of each counted pass.
    large_drifts : int or None
        Count of "large drift" divergences, when the analysis computes it.
    """

    name: str
    role: str
    n_prompts: int
    n_matched: int
    pass_throughputs: tuple[float, ...]
    large_drifts: int | None = None


@dataclass(frozen=True)
class ValidityCheck:
    """One declared validity check; ``passed`` is None when it could not be evaluated."""

    name: str
    passed: bool | None
    observed: object
    limit: object
    detail: str


@dataclass(frozen=True)
class RunStatus:
    """Whether the run could test the hypothesis at all, and if not, why."""

    testable: bool
    reason: str | None = None


@dataclass(frozen=True)
class CriterionResult:
    """One criterion, evaluated.

    ``met`` is True / False, or None when the data cannot evaluate it (``reason`` says why).
    ``observed`` is the number (or boolean) compared with the threshold; ``observed_text`` adds
    the context a reader needs (counts, the interval, degrees of freedom).
    """

    criterion: str
    description: str
    threshold: str
    observed: float | int | bool | None
    observed_text: str
    met: bool | None
    reason: str | None
    declared: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "criterion": self.criterion, "description": self.description,
            "threshold": self.threshold, "observed": self.observed,
            "observed_text": self.observed_text, "met": self.met, "reason": self.reason,
            "declared": self.declared,
        }


@dataclass(frozen=True)
class LabelResult:
    """A declared label and its criteria; ``met`` only if every criterion was met."""

    label: str
    criteria: tuple[CriterionResult, ...]

    @property
    def met(self) -> bool:
        return all(c.met is True for c in self.criteria)

    @property
    def not_evaluable(self) -> tuple[CriterionResult, ...]:
        return tuple(c for c in self.criteria if c.met is None)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "met": self.met,
                "criteria": [c.to_dict() for c in self.criteria]}


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer.

    Attributes
    ----------
    label : Label
        The verdict.
    sentence : str
        The label's fixed sentence (``SENTENCES``).
    basis : str
        Why this label: which label's criteria all held, that none did, or why untested.
    treatment, control : str
        Arm names compared.
    labels : tuple of LabelResult
        Every declared label with every criterion evaluated, in rule order.
    untested_reasons : tuple of str
        Why the run could not test the hypothesis (empty unless ``label`` is untested).
    notes : tuple of str
        Labels that could not be met because a criterion was not evaluable; validity checks
        that could not be evaluated.
    """

    label: Label
    sentence: str
    basis: str
    treatment: str
    control: str
    labels: tuple[LabelResult, ...]
    untested_reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label.value, "sentence": self.sentence, "basis": self.basis,
            "treatment": self.treatment, "control": self.control,
            "labels": [lr.to_dict() for lr in self.labels],
            "untested_reasons": list(self.untested_reasons), "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------


def classify(
    rule: Rule,
    control: ArmStats,
    treatment: ArmStats,
    validity: Sequence[ValidityCheck] = (),
    status: RunStatus = RunStatus(True),
) -> Verdict:
    """Classify one treatment arm against the control by the sealed rule.

    Parameters
    ----------
    rule : bistat.rule.Rule
        The registered decision rule.
    control, treatment : ArmStats
        The two arms' summaries.
    validity : sequence of ValidityCheck
        The declared validity checks, evaluated by the analysis. Any ``passed is False`` makes
        the verdict *untested*; ``passed is None`` is noted.
    status : RunStatus
        Whether the run could test the hypothesis at all.

    Returns
    -------
    Verdict

    Notes
    -----
    The rule is applied mechanically, in the manner of criterion.rs' ``compare_to_threshold``:
    no criterion is weighed against another, and no label is given unless all its criteria
    were evaluated and met. Criteria referring to an arm by role use ``treatment`` / ``control``.

    Examples
    --------
    The published rule on its published example (541 of 541 prompts matching under the mode,
    78 of 541 without it, throughput 0.5 of the control):

    >>> from bistat.rule import Rule
    >>> rule = Rule.model_validate({"labels": [
    ...     {"label": "working", "all": [
    ...         {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
    ...         {"criterion": "throughput_ratio", "statistic": "point", "below": 0.90}]}]})
    >>> v = classify(rule, ArmStats("off", "control", 541, 78, (100.0,)),
    ...              ArmStats("on", "treatment", 541, 541, (50.0,)))
    >>> v.label.value
    'working'
    """
    ctx = _Context(rule, control, treatment)
    label_results = tuple(
        LabelResult(spec.label, tuple(ctx.evaluate(c) for c in spec.criteria))
        for spec in rule.labels
    )
    notes: list[str] = []
    for lr in label_results:
        for c in lr.not_evaluable:
            notes.append(f"'{lr.label}' cannot be met: {c.description} is not evaluable "
                         f"({c.reason})")
    reasons: list[str] = []
    if not status.testable:
        reasons.append(status.reason or "the run could not test the hypothesis")
    for check in validity:
        if check.passed is False:
            reasons.append(f"validity check {check.name} failed: observed {check.observed}, "
                           f"limit {check.limit}" + (f" ({check.detail})" if check.detail else ""))
        elif check.passed is None:
            notes.append(f"validity check {check.name} could not be evaluated"
                         + (f": {check.detail}" if check.detail else ""))

    if reasons:
        label = Label.UNTESTED
        basis = "untested: " + "; ".join(reasons)
    else:
        first = next((lr for lr in label_results if lr.met), None)
        if first is not None:
            label = Label(first.label)
            basis = f"every criterion declared for '{first.label}' was met"
        else:
            label = Label(rule.otherwise)
            why = "; ".join(f"'{lr.label}': {_unmet(lr)}" for lr in label_results)
            basis = (f"no declared label had all its criteria met ({why}); the rule's "
                     "'otherwise' label applies" if why else
                     "no declared label had all its criteria met; the rule's 'otherwise' label "
                     "applies")
    return Verdict(
        label=label, sentence=SENTENCES[label], basis=basis, treatment=treatment.name,
        control=control.name, labels=label_results, untested_reasons=tuple(reasons),
        notes=tuple(notes),
    )


def _unmet(lr: LabelResult) -> str:
    """The criteria that kept a label from being met, each with its observed value."""
    def value(x: float | int | bool | None) -> str:
        if isinstance(x, bool):
            return "yes" if x else "no"
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    return " and ".join(
        f"{c.description} not evaluable" if c.met is None
        else f"{c.description}: {value(c.observed)} (needs {c.threshold.removeprefix('= ')})"
        if isinstance(c.observed, bool)
        else f"{c.description} {value(c.observed)} (needs {c.threshold})"
        for c in lr.criteria if c.met is not True)


class _Context:
    """Statistics shared by the criteria of one classification, computed on demand."""

    def __init__(self, rule: Rule, control: ArmStats, treatment: ArmStats):
        self.rule = rule
        self.arms = {"control": control, "treatment": treatment}
        self._cache: dict[Any, Any] = {}

    # ---- statistics (each either a value or a ``_NotEvaluable``)

    def wilson(self, role: str, alternative: str) -> "stats.Interval | _NotEvaluable":
        key = ("wilson", role, alternative)
        if key not in self._cache:
            arm = self.arms[role]
            if arm.n_prompts <= 0:
                self._cache[key] = _NotEvaluable(f"{role} arm '{arm.name}' compared no prompts")
            else:
                self._cache[key] = stats.wilson_interval(
                    arm.n_matched, arm.n_prompts, self.rule.confidence_level, alternative)
        return self._cache[key]

    def ratio_point(self) -> "float | _NotEvaluable":
        t, c = self.arms["treatment"].pass_throughputs, self.arms["control"].pass_throughputs
        if not t or not c:
            return _NotEvaluable("an arm has no counted pass")
        if any(not (math.isfinite(x) and x > 0) for x in (*t, *c)):
            return _NotEvaluable("a pass throughput is not a positive number")
        # The ratio of geometric means, the point estimate of stats.throughput_ratio, which
        # needs two passes per arm for its interval; the point estimate needs only one.
        return _geometric_mean(t) / _geometric_mean(c)

    def ratio(self) -> "stats.RatioResult | _NotEvaluable":
        if "ratio" not in self._cache:
            self._cache["ratio"] = self._repeat_passes(
                lambda t, c: stats.throughput_ratio(t, c, self.rule.confidence_level))
        return self._cache["ratio"]

    def tost(self, low: float, high: float) -> "stats.TostResult | _NotEvaluable":
        return self._repeat_passes(
            lambda t, c: stats.tost_ratio(t, c, low, high, self.rule.tost_alpha))

    def _repeat_passes(self, fn):
        t, c = self.arms["treatment"].pass_throughputs, self.arms["control"].pass_throughputs
        if len(t) < 2 or len(c) < 2:
            return _NotEvaluable(f"needs at least 2 counted passes per arm, got {len(t)} "
                                 f"(treatment) and {len(c)} (control)")
        try:
            return fn(t, c)
        except ValueError as exc:  # non-positive or non-finite throughputs
            return _NotEvaluable(str(exc))

    # ---- criteria

    def evaluate(self, crit: Any) -> CriterionResult:
        description, threshold = crit.describe(self.rule)
        declared = crit.model_dump(mode="json", by_alias=True)

        def result(observed, text, met, reason=None):
            return CriterionResult(crit.criterion, description, threshold, observed, text, met,
                                   reason, declared)

        def not_evaluable(ne: _NotEvaluable):
            return result(None, "not evaluable", None, ne.reason)

        if isinstance(crit, (MatchLowerBound, MatchUpperBound)):
            alternative = self.rule.alternative
            if alternative != "two-sided":  # one-sided: the bound on the criterion's side
                alternative = "greater" if isinstance(crit, MatchLowerBound) else "less"
            iv = self.wilson(crit.arm, alternative)
            if isinstance(iv, _NotEvaluable):
                return not_evaluable(iv)
            arm = self.arms[crit.arm]
            ctx = f"{arm.n_matched} of {arm.n_prompts} matched; interval {_iv(iv)}"
            if isinstance(crit, MatchLowerBound):
                return result(iv.low, f"{iv.low:.4f} ({ctx})", iv.low >= crit.at_least)
            return result(iv.high, f"{iv.high:.4f} ({ctx})", iv.high < crit.below)

        if isinstance(crit, MatchIntervalsOverlap):
            ivs = {r: self.wilson(r, "two-sided") for r in ("treatment", "control")}
            for iv in ivs.values():
                if isinstance(iv, _NotEvaluable):
                    return not_evaluable(iv)
            overlap = stats.intervals_overlap(ivs["treatment"], ivs["control"])
            text = (f"{'yes' if overlap else 'no'} (treatment {_iv(ivs['treatment'])}, "
                    f"control {_iv(ivs['control'])})")
            return result(overlap, text, overlap == crit.expect)

        if isinstance(crit, ThroughputRatio):
            if crit.statistic == "point":
                point = self.ratio_point()
                if isinstance(point, _NotEvaluable):
                    return not_evaluable(point)
                t = self.arms["treatment"].pass_throughputs
                c = self.arms["control"].pass_throughputs
                value, text = point, f"{point:.4f} ({len(t)} vs {len(c)} counted passes)"
            else:
                rr = self.ratio()
                if isinstance(rr, _NotEvaluable):
                    return not_evaluable(rr)
                value = rr.interval.low if crit.statistic == "interval_low" else rr.interval.high
                text = f"{value:.4f} ({_ratio_text(rr)})"
            if crit.below is not None:
                return result(value, text, value < crit.below)
            return result(value, text, value >= crit.at_least)

        if isinstance(crit, ThroughputSlower):
            rr = self.ratio()
            if isinstance(rr, _NotEvaluable):
                return not_evaluable(rr)
            high = rr.interval.high
            return result(high, f"{high:.4f} ({_ratio_text(rr)})", high < crit.bound)

        if isinstance(crit, ThroughputNotSlower):
            if crit.is_tost:
                res = self.tost(crit.margin_low, crit.margin_high)
                if isinstance(res, _NotEvaluable):
                    return not_evaluable(res)
                if math.isnan(res.pvalue):
                    return result(None, "not evaluable", None,
                                  "TOST p-value undefined (no pass-to-pass variation)")
                text = (f"p = {res.pvalue:.4f} (ratio {res.ratio:.4f}, df {res.df:.1f}; "
                        f"equivalent if p < {self.rule.tost_alpha:g})")
                return result(res.pvalue, text, bool(res.equivalent))
            rr = self.ratio()
            if isinstance(rr, _NotEvaluable):
                return not_evaluable(rr)
            low = rr.interval.low
            return result(low, f"{low:.4f} ({_ratio_text(rr)})", low >= crit.lower_at_least)

        if isinstance(crit, LargeDriftsAtMost):
            arm = self.arms[crit.arm]
            if arm.large_drifts is None:
                return not_evaluable(_NotEvaluable(
                    f"the summary has no large-drift count for {crit.arm} arm '{arm.name}'"))
            return result(arm.large_drifts, str(arm.large_drifts), arm.large_drifts <= crit.count)

        raise TypeError(f"unknown criterion model {type(crit).__name__}")


@dataclass(frozen=True)
class _NotEvaluable:
    reason: str


def _geometric_mean(values: Sequence[float]) -> float:
    # A single pass (or identical passes) is its own geometric mean, exactly: exp(log(x))
    # may be off by an ulp, which would move a ratio of exactly 0.90 below a bound of 0.90.
    if all(v == values[0] for v in values):
        return float(values[0])
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def _iv(iv: stats.Interval) -> str:
    return f"[{iv.low:.4f}, {iv.high:.4f}]"


def _ratio_text(rr: stats.RatioResult) -> str:
    return (f"ratio {rr.ratio:.4f}, {rr.interval.confidence_level * 100:g} % interval "
            f"{_iv(rr.interval)}, Welch df {rr.df:.1f}")
