"""The decision rule: labels, each with criteria that must all hold (part of the declaration).

A rule is a list of labels tried in order; the first label whose criteria *all* hold is the
verdict, else the rule's ``otherwise`` label. The label *untested* is never declared: the
classifier produces it when a run could not test the hypothesis (engine refused the setting,
every request failed, a validity check failed).

The published rule is expressible without anything hard-coded::

    [rule]
    confidence_level = 0.95
    otherwise = "reported as observed"
    [[rule.labels]]
    label = "working"
    all = [ { criterion = "match_lower_bound", arm = "treatment", at_least = 0.99 },
            { criterion = "throughput_ratio", statistic = "point", below = 0.90 } ]
    [[rule.labels]]
    label = "doubtful"
    all = [ { criterion = "match_intervals_overlap" },
            { criterion = "throughput_ratio", statistic = "point", at_least = 0.95 } ]

and so is the improved form, whose throughput criteria use the confidence interval of the
ratio from repeat passes (``throughput_slower``, ``throughput_not_slower``).

Every criterion model has a ``describe(rule)`` method giving the criterion in words and its
threshold as text; the classifier and the design analysis print these, so the wording of a
criterion is defined once, here.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "Label",
    "DECLARABLE_LABELS",
    "MatchLowerBound",
    "MatchUpperBound",
    "MatchIntervalsOverlap",
    "ThroughputRatio",
    "ThroughputSlower",
    "ThroughputNotSlower",
    "LargeDriftsAtMost",
    "Criterion",
    "CRITERION_NAMES",
    "MATCH_CRITERIA",
    "THROUGHPUT_CRITERIA",
    "LabelSpec",
    "Rule",
    "needs_repeat_passes",
]


class Label(str, enum.Enum):
    """A verdict label. Each has one fixed sentence (``bistat.classify.SENTENCES``)."""

    WORKING = "working"
    DOUBTFUL = "doubtful"
    REPORTED_AS_OBSERVED = "reported as observed"
    UNTESTED = "untested"

    def __str__(self) -> str:
        return self.value


#: Labels a rule may declare; *untested* is produced by bistat, never declared.
DECLARABLE_LABELS = ("working", "doubtful", "reported as observed")

Role = Literal["treatment", "control"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


def _pct(level: float) -> str:
    return f"{level * 100:g} %"


def _num(x: float) -> str:
    return f"{x:g}"


class MatchLowerBound(_Model):
    """The lower end of an arm's Wilson match interval is at least ``at_least``."""

    criterion: Literal["match_lower_bound"] = "match_lower_bound"
    arm: Role = "treatment"
    at_least: float = Field(gt=0.0, lt=1.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"{self.arm}'s {_pct(rule.confidence_level)} Wilson match interval, lower end",
                f">= {_num(self.at_least)}")


class MatchUpperBound(_Model):
    """The upper end of an arm's Wilson match interval is below ``below``."""

    criterion: Literal["match_upper_bound"] = "match_upper_bound"
    arm: Role = "treatment"
    below: float = Field(gt=0.0, le=1.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"{self.arm}'s {_pct(rule.confidence_level)} Wilson match interval, upper end",
                f"< {_num(self.below)}")


class MatchIntervalsOverlap(_Model):
    """The two arms' (two-sided) Wilson match intervals overlap (``expect = true``) or not."""

    criterion: Literal["match_intervals_overlap"] = "match_intervals_overlap"
    expect: bool = True

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"treatment's and control's {_pct(rule.confidence_level)} Wilson match intervals "
                "overlap", "= yes" if self.expect else "= no")


class ThroughputRatio(_Model):
    """A statistic of the throughput ratio (treatment ÷ control) against one bound.

    ``statistic`` is the point estimate (``point``; the ratio of geometric-mean per-pass
    throughputs) or an end of its confidence interval (``interval_low`` / ``interval_high``,
    which need at least two counted passes per arm). Exactly one of ``below`` / ``at_least``.
    """

    criterion: Literal["throughput_ratio"] = "throughput_ratio"
    statistic: Literal["point", "interval_low", "interval_high"] = "point"
    below: float | None = Field(default=None, gt=0.0)
    at_least: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _one_bound(self) -> "ThroughputRatio":
        if (self.below is None) == (self.at_least is None):
            raise ValueError("give exactly one of 'below' or 'at_least' "
                             "(e.g. below = 0.90)")
        return self

    def describe(self, rule: "Rule") -> tuple[str, str]:
        what = {"point": "throughput ratio (treatment ÷ control), point estimate",
                "interval_low": f"throughput ratio {_pct(rule.confidence_level)} interval, lower end",
                "interval_high": f"throughput ratio {_pct(rule.confidence_level)} interval, upper end",
                }[self.statistic]
        if self.below is not None:
            return what, f"< {_num(self.below)}"
        return what, f">= {_num(self.at_least)}"  # type: ignore[arg-type]


class ThroughputSlower(_Model):
    """The treatment is slower: the whole ratio confidence interval lies below ``bound``."""

    criterion: Literal["throughput_slower"] = "throughput_slower"
    bound: float = Field(gt=0.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"throughput ratio {_pct(rule.confidence_level)} interval, upper end "
                "(treatment slower)", f"< {_num(self.bound)}")


class ThroughputNotSlower(_Model):
    """The treatment is not slower.

    Either TOST equivalence of the ratio within ``[margin_low, margin_high]`` at level
    ``rule.tost_alpha``, or the lower end of the ratio's confidence interval at least
    ``lower_at_least``. Exactly one of the two forms.
    """

    criterion: Literal["throughput_not_slower"] = "throughput_not_slower"
    margin_low: float | None = Field(default=None, gt=0.0)
    margin_high: float | None = Field(default=None, gt=0.0)
    lower_at_least: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _one_form(self) -> "ThroughputNotSlower":
        tost = (self.margin_low is not None, self.margin_high is not None)
        if self.lower_at_least is not None:
            if any(tost):
                raise ValueError("give either margin_low and margin_high (TOST equivalence) "
                                 "or lower_at_least, not both")
            return self
        if not all(tost):
            raise ValueError("give margin_low and margin_high (TOST equivalence, e.g. "
                             "margin_low = 0.95, margin_high = 1.05) or lower_at_least")
        if not self.margin_low < self.margin_high:  # type: ignore[operator]
            raise ValueError(f"margin_low ({self.margin_low:g}) must be below margin_high "
                             f"({self.margin_high:g})")
        if not self.margin_low <= 1.0 <= self.margin_high:  # type: ignore[operator]
            raise ValueError(f"the equivalence margins [{self.margin_low:g}, "
                             f"{self.margin_high:g}] must contain 1 (no difference)")
        return self

    @property
    def is_tost(self) -> bool:
        return self.lower_at_least is None

    def describe(self, rule: "Rule") -> tuple[str, str]:
        if self.is_tost:
            return ("throughput ratio equivalent (TOST on log ratio, "
                    f"alpha {_num(rule.tost_alpha)})",
                    f"within [{_num(self.margin_low)}, {_num(self.margin_high)}]")  # type: ignore[arg-type]
        return (f"throughput ratio {_pct(rule.confidence_level)} interval, lower end "
                "(treatment not slower)", f">= {_num(self.lower_at_least)}")  # type: ignore[arg-type]


class LargeDriftsAtMost(_Model):
    """At most ``count`` "large drift" divergences in an arm (when the summary counts them)."""

    criterion: Literal["large_drifts_at_most"] = "large_drifts_at_most"
    arm: Role = "treatment"
    count: int = Field(ge=0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return f"{self.arm}'s large-drift divergences", f"<= {self.count}"


Criterion = Annotated[
    Union[MatchLowerBound, MatchUpperBound, MatchIntervalsOverlap, ThroughputRatio,
          ThroughputSlower, ThroughputNotSlower, LargeDriftsAtMost],
    Field(discriminator="criterion"),
]

CRITERION_NAMES = ("match_lower_bound", "match_upper_bound", "match_intervals_overlap",
                   "throughput_ratio", "throughput_slower", "throughput_not_slower",
                   "large_drifts_at_most")
MATCH_CRITERIA = (MatchLowerBound, MatchUpperBound, MatchIntervalsOverlap)
THROUGHPUT_CRITERIA = (ThroughputRatio, ThroughputSlower, ThroughputNotSlower)


def needs_repeat_passes(criterion: object) -> bool:
    """Whether a criterion needs a ratio interval, hence >= 2 counted passes per arm."""
    if isinstance(criterion, ThroughputRatio):
        return criterion.statistic != "point"
    return isinstance(criterion, (ThroughputSlower, ThroughputNotSlower))


class LabelSpec(_Model):
    """One label of the rule and the criteria that must all hold for it."""

    label: str
    criteria: list[Criterion] = Field(alias="all", min_length=1)


class Rule(_Model):
    """The decision rule. ``confidence_level`` applies to every interval (match and ratio).

    ``alternative`` is the sidedness of the Wilson bounds used by ``match_lower_bound`` /
    ``match_upper_bound``: "two-sided" (the ends of the two-sided interval, as in the
    published rule) or "greater" (one-sided bounds at ``confidence_level``: the Wilson
    interval with alternative "greater" for a lower bound, "less" for an upper bound).
    ``match_intervals_overlap`` always compares two-sided intervals.
    ``tost_alpha`` is the level of each one-sided test in TOST equivalence.
    """

    confidence_level: float = Field(default=0.95, gt=0.5, lt=1.0)
    alternative: Literal["two-sided", "greater"] = "two-sided"
    tost_alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    otherwise: str = "reported as observed"
    labels: list[LabelSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _labels_known(self) -> "Rule":
        issues: list[tuple[str, str]] = []
        allowed = ", ".join(repr(x) for x in DECLARABLE_LABELS)
        seen: dict[str, int] = {}
        for i, spec in enumerate(self.labels):
            field = f"labels[{i}].label"
            if spec.label == Label.UNTESTED.value:
                issues.append((field, "'untested' cannot be declared: bistat gives it when a run "
                                      f"could not test the hypothesis; use one of {allowed}"))
            elif spec.label not in DECLARABLE_LABELS:
                issues.append((field, f"{spec.label!r} is not allowed; expected one of {allowed}"))
            elif spec.label in seen:
                issues.append((field, f"{spec.label!r} is already declared at "
                                      f"labels[{seen[spec.label]}]; declare each label once"))
            elif spec.label == self.otherwise:
                issues.append((field, f"{spec.label!r} is also the 'otherwise' label; the fallback "
                                      "label must not have criteria"))
            seen.setdefault(spec.label, i)
        if self.otherwise == Label.UNTESTED.value:
            issues.append(("otherwise", "'untested' cannot be declared: bistat gives it when a run "
                                        f"could not test the hypothesis; use one of {allowed}"))
        elif self.otherwise not in DECLARABLE_LABELS:
            issues.append(("otherwise", f"{self.otherwise!r} is not allowed; expected one of "
                                        f"{allowed}"))
        if issues:
            raise semantic_error(issues)
        return self


def semantic_error(issues: list[tuple[str, str]]) -> PydanticCustomError:
    """A validation error carrying several ``(field path, message)`` pairs.

    Model validators that check several fields at once raise this; ``bistat.experiment``
    prefixes the model's own location and prints one line per pair.
    """
    summary = "; ".join(f"{field}: {msg}" for field, msg in issues)
    return PydanticCustomError("bistat_semantic", "{summary}",
                               {"summary": summary, "issues": tuple(issues)})
