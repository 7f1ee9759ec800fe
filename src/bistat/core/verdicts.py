"""The classifier's answers, each label and cost outcome with one fixed sentence (pure).

:class:`Verdict` is :func:`bistat.core.classify.classify`'s answer: the label, its fixed sentence
(:data:`SENTENCES`) and every declared label (:class:`LabelResult`) with every criterion evaluated
(:class:`CriterionResult`). :class:`CostVerdict` is :func:`bistat.core.cost.classify_cost`'s: the
cost rule's outcome (:class:`CostOutcome`), its fixed sentence (:data:`COST_SENTENCES`) and the
numbers that decided it. A finding prints the sentences verbatim.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from bistat.core import stat_results
from bistat.core.rule import Label

__all__ = ["COST_SENTENCES", "COST_SENTENCE_NO_INTERVAL", "CostOutcome", "CostVerdict",
           "CriterionResult", "LabelResult", "SENTENCES", "Verdict"]

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
    interval: stat_results.Interval | None
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
