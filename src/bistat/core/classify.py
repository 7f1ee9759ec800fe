"""The mechanical classifier: (sealed rule, run summary, validity checks) -> ``Verdict``.

``classify`` is a pure function. It tries the rule's labels in order; the first label whose
criteria all hold is the verdict, else the rule's ``otherwise`` label. A run that could not test
the hypothesis (``RunTestable.testable`` false: the engine refused the setting, failed to start,
failed every request) or whose declared validity checks failed is *untested*, whatever the
criteria say; the criteria are still evaluated where the data allow, so the finding can show
them.

Every criterion is reported with its observed value, its threshold (as text) and whether it was
met. A criterion the data cannot evaluate -- a ratio interval with fewer than two counted passes
per arm, a match rate with no prompts, a large-drift cap when the summary has no count -- is
"not evaluable" (``met is None``), and a label with such a criterion cannot be met; the verdict
says so in ``notes``.

Activation criteria (``control_diverges``, ``treatment_beats_control``, ``probe_confirmed``,
``engine_log``) read the paired counts (:class:`PairedCounts`) and the activation
evidence (:class:`ActivationEvidence`: the probe's outcome for the treatment arm, the engine
log's markers). A label whose criteria are all met or not evaluable, with an *activation*
criterion among the not evaluable (no probe report in the run directory, no engine log), does not
fall through to the next label: the comparison is *untested*, with the reason, never *working*.

``classify_cost`` is the cost rule's classifier (``[rule.cost]``): one of *no measurable cost*,
*costs*, *faster*, *undecidable* (with the passes that would decide it) or *untested*, each with
one fixed sentence; ``classify`` attaches it to the verdict. It asks what the mode costs (a
non-inferiority test on the ratio's interval, not equivalence), so a faster treatment never gets
a worse cost outcome.

A ratio published without its passes (:class:`RatioSummary`: a point, an interval or both)
stands in for the per-pass values, so a paper's verdict can be reproduced from its summary
numbers (``bistat classify``) without inventing passes.

The intervals come from ``bistat.core.stats``: Wilson intervals for match rates, the Welch interval
on log per-pass throughput for the ratio, TOST on the log ratio for equivalence, Newcombe's
interval and McNemar's test for treatment against control; the cost rule's paired interval from
``bistat.core.stats`` too, its serial-correlation-robust (HAC) interval from ``bistat.core.serial``.

Every decided value a verdict shows is formatted by :func:`format_decided`: one rounding, with
more digits only where fewer would put the shown number on the other side of (or onto) the
bound it was compared with.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from bistat.core import design, serial, stats   # design: the passes that would decide an undecidable cost
from bistat.core.rule import (
    ACTIVATION_CRITERIA,
    ControlDiverges,
    CostRule,
    EngineLog,
    Label,
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

__all__ = [
    "ActivationEvidence",
    "COST_SENTENCES",
    "COST_SENTENCE_NO_INTERVAL",
    "CostOutcome",
    "CostVerdict",
    "PairedCounts",
    "RatioSummary",
    "classify_cost",
    "PassPairs",
    "pass_pairs",
    "paired_values",
    "format_decided",
    "ArmStats",
    "ValidityCheck",
    "RunTestable",
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
    """One arm's summary, as produced by ``bistat.analysis.summary`` from recorded data.

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
    pass_latencies : tuple of float
        Mean request latency (seconds, submission to last token, answered requests) of each
        counted pass; what a cost rule on ``latency`` reads. Empty when not computed.
    throughput_passes, latency_passes : tuple of int
        The pass index of each value of ``pass_throughputs`` / ``pass_latencies`` (which passes
        a pair holds). Empty when not known.
    throughput_rounds, latency_rounds : tuple of int
        The round of the schedule each value's pass ran in (an arm's *k*-th counted pass runs
        in round *k*): a cost rule with ``interval = "paired"`` or ``"hac"`` pairs the arms'
        passes of one round (:func:`pass_pairs`). Empty when not known (the values are then
        paired by pass index, else by position).
    """

    name: str
    role: str
    n_prompts: int
    n_matched: int
    pass_throughputs: tuple[float, ...]
    large_drifts: int | None = None
    pass_latencies: tuple[float, ...] = ()
    throughput_passes: tuple[int, ...] = ()
    latency_passes: tuple[int, ...] = ()
    throughput_rounds: tuple[int, ...] = ()
    latency_rounds: tuple[int, ...] = ()


@dataclass(frozen=True)
class PairedCounts:
    """The two arms compared prompt by prompt (McNemar's table without its concordant cells).

    Attributes
    ----------
    n_paired : int
        Prompts compared in both arms.
    control_only : int
        Prompts identical in every counted pass of the control, not of the treatment (``b``).
    treatment_only : int
        Prompts identical in every counted pass of the treatment, not of the control (``c``).
    """

    n_paired: int
    control_only: int
    treatment_only: int


@dataclass(frozen=True)
class ActivationEvidence:
    """Evidence that the treatment's mode was on, besides the match counts.

    Attributes
    ----------
    probe : str or None
        The probe's outcome for the treatment arm (``confirmed``, ``no_power``, ``violated``,
        ``vacuous``, ``untested``; :mod:`bistat.analysis.activation`), or None.
    probe_recorded : bool
        A probe report was in the run directory (``probe`` None then means the report did not
        probe this arm).
    log_markers : mapping or None
        Engine-log marker name (``bistat.core.rule.LOG_MARKERS``) -> seen at the treatment's engine
        starts; None when the treatment's engine kept no log.
    """

    probe: str | None = None
    probe_recorded: bool = False
    log_markers: Mapping[str, bool] | None = None


@dataclass(frozen=True)
class RatioSummary:
    """A ratio treatment / control published without its passes (``bistat classify``).

    ``point``: the point estimate; ``interval``: its two-sided confidence interval, when
    published (its ``confidence_level`` must be the rule's for interval criteria to use it).
    """

    point: float | None
    interval: stats.Interval | None = None


@dataclass(frozen=True)
class ValidityCheck:
    """One declared validity check; ``passed`` is None when it could not be evaluated."""

    name: str
    passed: bool | None
    observed: object
    limit: object
    detail: str


@dataclass(frozen=True)
class RunTestable:
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
    #: the cost rule's verdict (:func:`classify_cost`), when the rule has ``[rule.cost]``
    cost: "CostVerdict | None" = None

    @property
    def headline(self) -> str:
        """``working — no measurable cost (ratio 0.97, 95 % interval 0.91–1.04)``: the label
        and, with a cost rule, the cost statement (a finding's verdict line)."""
        return self.label.value + ("" if self.cost is None else f" — {self.cost.statement}")

    def to_dict(self) -> dict[str, Any]:
        out = {
            "label": self.label.value, "sentence": self.sentence, "basis": self.basis,
            "treatment": self.treatment, "control": self.control,
            "labels": [lr.to_dict() for lr in self.labels],
            "untested_reasons": list(self.untested_reasons), "notes": list(self.notes),
        }
        if self.cost is not None:
            out["cost"] = self.cost.to_dict()
        return out


# --------------------------------------------------------------------------------------------
# One rounding


def format_decided(x: float, bounds: Sequence[float] = (), digits: int = 4,
                   significant: bool = False) -> str:
    """A decided value as a finding shows it: ``digits`` decimals, more where needed.

    Parameters
    ----------
    x : float
        The value the classifier compared.
    bounds : sequence of float
        The bounds it was compared with.
    digits : int, default 4
        Decimals shown when they are enough.
    significant : bool, default False
        Count ``digits`` as significant digits instead (``g`` format: p-values such as
        ``3.018e-119``).

    Returns
    -------
    str
        ``x`` rounded once, to the fewest decimals (``digits`` or more, up to 17 significant
        digits) at which the shown number sits on the same side of every bound as ``x`` itself,
        and equals a bound only when ``x`` does. So a reader comparing the shown number with the
        threshold reaches the classifier's answer.

    Examples
    --------
    >>> format_decided(0.98996, [0.99])
    '0.98996'
    >>> format_decided(0.9, [0.9])
    '0.9000'
    >>> format_decided(0.8999999999999996, [0.9])
    '0.8999999999999996'
    >>> format_decided(3.0183e-119, [0.05], significant=True)
    '3.018e-119'
    """
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    for d in range(digits, 18):
        shown = f"{x:.{d}g}" if significant else f"{x:.{d}f}"
        y = float(shown)
        if all((y < b) == (x < b) and (y == b) == (x == b) for b in bounds):
            return shown
    return repr(x)


# --------------------------------------------------------------------------------------------


def classify(
    rule: Rule,
    control: ArmStats,
    treatment: ArmStats,
    validity: Sequence[ValidityCheck] = (),
    status: RunTestable = RunTestable(True),
    *,
    paired: PairedCounts | None = None,
    evidence: ActivationEvidence | None = None,
    ratio: RatioSummary | None = None,
) -> Verdict:
    """Classify one treatment arm against the control by the sealed rule.

    Parameters
    ----------
    rule : bistat.core.rule.Rule
        The registered decision rule.
    control, treatment : ArmStats
        The two arms' summaries.
    validity : sequence of ValidityCheck
        The declared validity checks, evaluated by the analysis. Any ``passed is False`` makes
        the verdict *untested*; ``passed is None`` is noted.
    status : RunTestable
        Whether the run could test the hypothesis at all.
    paired : PairedCounts, optional
        The arms compared prompt by prompt (McNemar's discordant counts); without it a
        McNemar criterion is not evaluable.
    evidence : ActivationEvidence, optional
        The probe's outcome for the treatment and its engine log's markers; without it
        ``probe_confirmed`` and ``engine_log`` are not evaluable.
    ratio : RatioSummary, optional
        A published ratio standing in for the per-pass values (``bistat classify``): the point
        criteria read its point, the interval criteria its interval (at the rule's confidence
        level), the cost rule its interval at the cost rule's level; TOST needs per-pass values.

    Returns
    -------
    Verdict
        With ``cost`` set when the rule has a cost rule (:func:`classify_cost`).

    Notes
    -----
    The rule is applied mechanically, in the manner of criterion.rs' ``compare_to_threshold``:
    no criterion is weighed against another, and no label is given unless all its criteria
    were evaluated and met. Criteria referring to an arm by role use ``treatment`` / ``control``.
    Labels are tried in order; a label none of whose criteria failed but with an *activation*
    criterion not evaluable stops the search: the comparison is *untested* (the evidence that
    would decide it is missing), never another label.

    Examples
    --------
    The published rule on its published example (541 of 541 prompts matching under the mode,
    78 of 541 without it, throughput 0.5 of the control):

    >>> from bistat.core.rule import Rule
    >>> rule = Rule.model_validate({"labels": [
    ...     {"label": "working", "all": [
    ...         {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
    ...         {"criterion": "throughput_ratio", "statistic": "point", "below": 0.90}]}]})
    >>> v = classify(rule, ArmStats("off", "control", 541, 78, (100.0,)),
    ...              ArmStats("on", "treatment", 541, 541, (50.0,)))
    >>> v.label.value
    'working'
    """
    ctx = _Context(rule, control, treatment, paired, evidence, ratio)
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
    if not reasons:
        undecided = _undecided_label(label_results)
        if undecided is not None:
            lr, missing = undecided
            reasons.extend(f"'{lr.label}' could not be decided: {c.description} is not "
                           f"evaluable ({c.reason})" for c in missing)

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
    cost = None
    if rule.cost is not None:
        cost = classify_cost(rule.cost, control, treatment,
                             untested=tuple(reasons) if label is Label.UNTESTED else (),
                             ratio=ratio)
    return Verdict(
        label=label, sentence=SENTENCES[label], basis=basis, treatment=treatment.name,
        control=control.name, labels=label_results, untested_reasons=tuple(reasons),
        notes=tuple(notes), cost=cost,
    )


_ACTIVATION_NAMES = frozenset(c.model_fields["criterion"].default for c in ACTIVATION_CRITERIA)


def _undecided_label(label_results: Sequence[LabelResult]
                     ) -> tuple[LabelResult, tuple[CriterionResult, ...]] | None:
    """The first label, in rule order, that no criterion ruled out but that an activation
    criterion left undecided (not evaluable), with those criteria; None when the labels before
    the first met one were each ruled out by a criterion, or left open only by criteria of the
    kinds the published rule knew (a label those cannot evaluate is simply not met, as before)."""
    for lr in label_results:
        if lr.met:
            return None
        if any(c.met is False for c in lr.criteria):
            continue
        missing = tuple(c for c in lr.not_evaluable if c.criterion in _ACTIVATION_NAMES)
        if missing:
            return lr, missing
    return None


def _unmet(lr: LabelResult) -> str:
    """The criteria that kept a label from being met, each with its observed value."""
    def value(c: CriterionResult) -> str:
        if isinstance(c.observed, bool):
            return "yes" if c.observed else "no"
        if isinstance(c.observed, float):
            return c.observed_text.split(" (")[0]   # one rounding: as the criteria table shows it
        return str(c.observed)

    return " and ".join(
        f"{c.description} not evaluable" if c.met is None
        else f"{c.description}: {value(c)} (needs {c.threshold.removeprefix('= ')})"
        if isinstance(c.observed, bool)
        else f"{c.description} {value(c)} (needs {c.threshold})"
        for c in lr.criteria if c.met is not True)


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
        if self.summary is not None:
            if self.summary.point is None:
                return _NotEvaluable("the published summary gives no point estimate of the ratio")
            return float(self.summary.point)
        t, c = self.arms["treatment"].pass_throughputs, self.arms["control"].pass_throughputs
        if not t or not c:
            return _NotEvaluable("an arm has no counted pass")
        try:
            return stats.ratio_of_geometric_means(t, c)
        except ValueError:
            return _NotEvaluable("a pass throughput is not a positive number")

    def ratio(self) -> "stats.RatioResult | RatioSummary | _NotEvaluable":
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
                lambda t, c: stats.throughput_ratio(t, c, self.rule.confidence_level))
        return self._cache["ratio"]

    def tost(self, low: float, high: float) -> "stats.TostResult | _NotEvaluable":
        if self.summary is not None:
            return _NotEvaluable("TOST needs the per-pass throughputs, not a published summary")
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

    def newcombe(self) -> "stats.Interval | _NotEvaluable":
        t, c = self.arms["treatment"], self.arms["control"]
        for role, arm in (("treatment", t), ("control", c)):
            if arm.n_prompts <= 0:
                return _NotEvaluable(f"{role} arm '{arm.name}' compared no prompts")
        return stats.newcombe_difference(t.n_matched, t.n_prompts, c.n_matched, c.n_prompts,
                                         self.rule.confidence_level)

    def mcnemar(self) -> "stats.McNemarResult | _NotEvaluable":
        if self.paired is None:
            return _NotEvaluable("no paired counts: the arms were not compared prompt by prompt")
        return stats.mcnemar_test(self.paired.control_only, self.paired.treatment_only)

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
            overlap = stats.intervals_overlap(ivs["treatment"], ivs["control"])
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


def _iv(iv: stats.Interval) -> str:
    return f"[{iv.low:.4f}, {iv.high:.4f}]"


def _ratio_text(rr: "stats.RatioResult | RatioSummary") -> str:
    if isinstance(rr, RatioSummary):
        point = "—" if rr.point is None else f"{rr.point:.4f}"
        return (f"published ratio {point}, {rr.interval.confidence_level * 100:g} % interval "
                f"{_iv(rr.interval)}")
    return (f"ratio {rr.ratio:.4f}, {rr.interval.confidence_level * 100:g} % interval "
            f"{_iv(rr.interval)}, Welch df {rr.df:.1f}")


# --------------------------------------------------------------------------------------------
# The cost rule


class CostOutcome(str, enum.Enum):
    """An outcome of the cost rule. Each has one fixed sentence (:data:`COST_SENTENCES`)."""

    NO_MEASURABLE_COST = "no measurable cost"
    COSTS = "costs"
    FASTER = "faster"
    UNDECIDABLE = "undecidable"
    UNTESTED = "untested"

    def __str__(self) -> str:
        return self.value


#: One fixed sentence per cost outcome (a finding prints it verbatim).
COST_SENTENCES: dict[CostOutcome, str] = {
    CostOutcome.NO_MEASURABLE_COST: "The mode has no measurable cost by the registered cost rule: "
                                    "the ratio's interval does not reach beyond the margin on "
                                    "the slower side.",
    CostOutcome.COSTS: "The mode costs by the registered cost rule: the ratio's interval lies "
                       "wholly beyond the margin, on the slower side.",
    CostOutcome.FASTER: "The mode is faster by the registered cost rule: the ratio's interval "
                        "lies wholly beyond the margin, on the faster side.",
    CostOutcome.UNDECIDABLE: "The cost is undecidable at these passes: the ratio's interval "
                             "reaches across the margin on the slower side.",
    CostOutcome.UNTESTED: "The cost was not assessed: the comparison is untested.",
}
#: The sentence of an undecidable cost that has no interval to decide on (too few passes or
#: pairs, a published summary without one): the ratio's interval, which the undecidable
#: sentence speaks of, does not exist.
COST_SENTENCE_NO_INTERVAL = ("The cost is undecidable at these passes: there is no interval of "
                             "the ratio to decide it on.")


@dataclass(frozen=True)
class CostVerdict:
    """The cost rule's answer for one comparison.

    Attributes
    ----------
    outcome : CostOutcome
    sentence : str
        The outcome's fixed sentence (:data:`COST_SENTENCES`).
    statement : str
        The short form a finding's verdict line shows, e.g. ``no measurable cost (ratio 0.97,
        95 % interval 0.91–1.04)``; its numbers are the ones that decided.
    metric : str
        ``"throughput"`` or ``"latency"``.
    margin : float
        The rule's margin: the interval is judged against ``[1 - margin, 1 + margin]``.
    ratio : float or None
        Treatment / control of the metric's per-pass geometric means.
    interval : stats.Interval or None
        Its interval at the cost rule's confidence level: Welch's, the paired one where the rule
        pairs the passes (``interval = "paired"``), the serial-correlation-robust one of the
        same pairs (``interval = "hac"``), or the published one.
    n_treatment, n_control : int
        Counted passes with a value, per arm.
    cv : float or None
        The metric's pooled pass-to-pass CV (``stats.pooled_cv`` over both arms).
    passes_to_decide : int or None
        *Undecidable* only: passes per arm at which the design analysis
        (``bistat.core.design.passes_to_decide``) decides with 80 % probability, at the observed ratio
        and CV (and, for a HAC interval, the pairs' lag-1 autocorrelation); None when no number
        up to 200 does (or the CV is unknown).
    reason : str or None
        Why the cost could not be assessed, or was undecidable without an interval.
    n_pairs : int or None
        Passes paired across the arms, where the rule's interval is ``"paired"`` or ``"hac"``
        (None else).
    """

    outcome: CostOutcome
    sentence: str
    statement: str
    metric: str
    margin: float
    ratio: float | None
    interval: stats.Interval | None
    n_treatment: int
    n_control: int
    cv: float | None = None
    passes_to_decide: int | None = None
    reason: str | None = None
    n_pairs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        iv = self.interval
        out = {"outcome": self.outcome.value, "sentence": self.sentence,
               "statement": self.statement, "metric": self.metric, "margin": self.margin,
               "ratio": self.ratio,
               "interval": None if iv is None else {
                   "low": iv.low, "high": iv.high, "confidence_level": iv.confidence_level,
                   "method": iv.method},
               "n_treatment": self.n_treatment, "n_control": self.n_control, "cv": self.cv,
               "passes_to_decide": self.passes_to_decide, "reason": self.reason}
        if self.n_pairs is not None:
            out["n_pairs"] = self.n_pairs
        return out


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
                point = stats.ratio_of_geometric_means(tv, cv_)
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
        pooled = stats.pooled_cv([tv, cv_]).cv
        if cost.hac is not None:
            rr = serial.hac_ratio(pt, pc, cl, cost.hac)
            # planned at the pairs' own spread and lag-1 autocorrelation (bias-corrected, at
            # least 0), as design.estimate_serial_correlation plans from an earlier run
            need_cv = rr.sd_log_diff / math.sqrt(2.0)
            rho = design.planning_rho(pt, pc)
        elif paired:
            rr = stats.paired_ratio(pt, pc, cl)
            # a pair difference's SD s_d gives the Welch design's per-pass CV s_d / sqrt(2): the
            # same standard error at the same passes per arm
            need_cv = rr.se * math.sqrt(rr.n_treatment) / math.sqrt(2.0)
        else:
            rr = stats.throughput_ratio(tv, cv_, cl)
            need_cv = pooled
        if paired:
            point, n_passes, what = rr.ratio, rr.n_treatment, "pairs of passes"
        else:
            point = stats.ratio_of_geometric_means(tv, cv_)
            n_passes, what = min(len(tv), len(cv_)), "passes"
    except ValueError as exc:
        return verdict(CostOutcome.UNDECIDABLE, "cost undecidable (a per-pass value is not a "
                       "positive number)", reason=str(exc))
    decided = _decide_cost(cost, rr.interval, point, verdict, pooled, n_passes,
                           f"ratio {format_decided(point, bounds, COST_DIGITS)}", need_cv, what,
                           rho)
    return dataclasses.replace(decided, n_pairs=rr.n_treatment) if paired else decided


@dataclass(frozen=True)
class PassPairs:
    """The passes of two arms a paired or HAC cost interval reads, one pair per round of the
    schedule both arms have a value in (:func:`pass_pairs`).

    Attributes
    ----------
    by : str
        What paired them: ``"round"`` (the schedule's rounds, as recorded runs give them),
        ``"pass index"`` (arms built with pass indices but no rounds) or ``"position"`` (neither).
    rounds : tuple of int
        The round of each pair (the pass index or the position when ``by`` says so), in schedule
        order.
    treatment_passes, control_passes : tuple of int
        Each pair's pass index in the treatment and in the control (positions when not known).
    treatment_values, control_values : tuple of float
        Each pair's values of the metric.
    """

    by: str
    rounds: tuple[int, ...]
    treatment_passes: tuple[int, ...]
    control_passes: tuple[int, ...]
    treatment_values: tuple[float, ...]
    control_values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.rounds)


def _keyed(arm: ArmStats, metric: str) -> tuple[dict[int, tuple[int, float]], str]:
    """Round (or pass index, or position) -> (pass index, value) of one arm's metric, and what
    the key is: rounds where every value has one, else pass indices, else positions."""
    if metric == "throughput":
        values, passes, rounds = arm.pass_throughputs, arm.throughput_passes, arm.throughput_rounds
    else:
        values, passes, rounds = arm.pass_latencies, arm.latency_passes, arm.latency_rounds
    idx = passes if len(passes) == len(values) and passes else tuple(range(len(values)))
    if len(rounds) == len(values) and rounds:
        return {r: (p, v) for r, p, v in zip(rounds, idx, values)}, "round"
    if len(passes) == len(values) and passes:
        return {p: (p, v) for p, v in zip(passes, values)}, "pass index"
    return {i: (i, v) for i, v in enumerate(values)}, "position"


def pass_pairs(treatment: ArmStats, control: ArmStats, metric: str) -> PassPairs:
    """The metric's values (``"throughput"`` or ``"latency"``) of the passes the schedule ran
    side by side: the treatment's and the control's counted pass of one round, for every round
    in which both have a value, in schedule order.

    A round of the schedule (``bistat.core.schedule``) runs one counted pass of every arm next to
    the others (``A B | B A | ...``); an arm's *k*-th counted pass belongs to round *k* however
    the run was interrupted and resumed, since a resume plans only the rounds an arm has not
    completed (:func:`bistat.core.schedule.plan_schedule`). Pass indices do not pair passes: a
    resume gives its new warm-ups pass indices, so after a resume the arms' indices of one round
    differ. Arms without rounds (built by hand) are paired by pass index, and without pass
    indices by position.

    Examples
    --------
    >>> c = ArmStats("c", "control", 0, 0, (100.0, 90.0, 95.0), throughput_passes=(1, 4, 5),
    ...              throughput_rounds=(0, 1, 2))
    >>> t = ArmStats("t", "treatment", 0, 0, (99.0, 89.0), throughput_passes=(1, 5),
    ...              throughput_rounds=(0, 2))
    >>> p = pass_pairs(t, c, "throughput")
    >>> p.rounds, p.control_passes, p.treatment_passes, p.control_values
    ((0, 2), (1, 5), (1, 5), (100.0, 95.0))
    """
    tk, by = _keyed(treatment, metric)
    ck, c_by = _keyed(control, metric)
    if by != c_by:   # one arm keyed otherwise than the other: pair by position
        by, tk, ck = "position", dict(enumerate(tk.values())), dict(enumerate(ck.values()))
    keys = sorted(set(tk) & set(ck))
    return PassPairs(by, tuple(keys), tuple(tk[k][0] for k in keys), tuple(ck[k][0] for k in keys),
                     tuple(tk[k][1] for k in keys), tuple(ck[k][1] for k in keys))


def paired_values(treatment: ArmStats, control: ArmStats, metric: str
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`pass_pairs`' values: the treatment's and the control's, pair by pair."""
    pairs = pass_pairs(treatment, control, metric)
    return pairs.treatment_values, pairs.control_values


def _decide_cost(cost: CostRule, iv: stats.Interval, point: float | None, verdict, pooled,
                 n_passes: int | None, shown: str, need_cv: float | None = None,
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
        need = design.passes_to_decide(cost.margin, point, need_cv, iv.confidence_level,
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
