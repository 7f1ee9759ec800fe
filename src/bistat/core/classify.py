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

This module classifies (:func:`classify`) and names the classifier's parts, each a module of its
own with its contents in its docstring; the modules of the package import the parts directly:

- :mod:`bistat.core.classify_inputs` -- what it reads: :class:`ArmStats`, :class:`PairedCounts`,
  :class:`ActivationEvidence`, :class:`RatioSummary`, :class:`ValidityCheck`,
  :class:`RunTestable`.
- :mod:`bistat.core.criteria` -- each criterion of the rule evaluated on the two arms.
- :mod:`bistat.core.cost` -- the cost rule's classifier (:func:`classify_cost`).
- :mod:`bistat.core.pairing` -- the passes the schedule ran side by side (:func:`pass_pairs`).
- :mod:`bistat.core.verdicts` -- the answers and their fixed sentences (:class:`Verdict`,
  :class:`CostVerdict`, ...).
- :mod:`bistat.core.decided` -- the one rounding of a decided value (:func:`format_decided`).
"""

from __future__ import annotations

from typing import Sequence

from bistat.core.classify_inputs import (ActivationEvidence, ArmStats, PairedCounts, RatioSummary,
                                         RunTestable, ValidityCheck)
from bistat.core.cost import classify_cost
from bistat.core.criteria import _Context
from bistat.core.decided import format_decided
from bistat.core.pairing import PassPairs, paired_values, pass_pairs
from bistat.core.rule import ACTIVATION_CRITERIA, Label, Rule
from bistat.core.verdicts import (COST_SENTENCE_NO_INTERVAL, COST_SENTENCES, SENTENCES,
                                  CostOutcome, CostVerdict, CriterionResult, LabelResult, Verdict)

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
