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

Activation criteria are the evidence that the mode *acts*, instead of a slowdown:

- ``control_diverges`` -- the control arm, under the same load, diverges: its Wilson match
  interval's upper end is at most ``at_most`` (the load could reveal batch dependence);
- ``treatment_beats_control`` -- the treatment matches more often than the control: the
  Newcombe interval of (treatment - control) has its lower end at least ``newcombe_at_least``
  and/or McNemar's paired test, with the treatment ahead, gives p below ``mcnemar_below``
  (``require = "both"`` or ``"either"`` when both are given: a sealed any-of of two tests of
  one hypothesis);
- ``probe_confirmed`` -- ``bistat probe`` confirmed the treatment bitwise against a negative
  control that showed power (*no power* is "not met", never "met"; no probe report in the run
  directory is "not evaluable", which makes the comparison *untested*);
- ``engine_log`` -- a marker in the engine's log (the batch-invariant kernels registering,
  bistat's tuned GEMM installing): circumstantial, so a label may use it only beside one of the
  three above (never sufficient alone).

The cost of the mode is a verdict of its own, sealed in ``[rule.cost]`` (:class:`CostRule`):
the ratio treatment / control of a per-pass metric (throughput, or latency) and its interval,
judged against a margin of +/- ``margin`` around 1 (``bistat.core.classify.classify_cost``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
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
    "ControlDiverges",
    "TreatmentBeatsControl",
    "ProbeConfirmed",
    "EngineLog",
    "BANDWIDTH_RULES",
    "CostRule",
    "Criterion",
    "HAC_KERNELS",
    "HacSpec",
    "speed_as_evidence_warnings",
    "CRITERION_NAMES",
    "MATCH_CRITERIA",
    "THROUGHPUT_CRITERIA",
    "ACTIVATION_CRITERIA",
    "DIRECT_ACTIVATION_CRITERIA",
    "LOG_MARKERS",
    "LabelSpec",
    "Rule",
    "needs_repeat_passes",
]


class Label(str, enum.Enum):
    """A verdict label. Each has one fixed sentence (``bistat.core.classify.SENTENCES``)."""

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


def _wilson_end(rule: "Rule", end: str) -> str:
    """``95 % Wilson match interval, lower end`` (two-sided rule), or ``one-sided 95 % Wilson
    lower bound`` when the rule's ``alternative`` is ``"greater"`` (one-sided bounds)."""
    if rule.alternative == "two-sided":
        return f"{_pct(rule.confidence_level)} Wilson match interval, {end} end"
    return f"one-sided {_pct(rule.confidence_level)} Wilson {end} bound"


class MatchLowerBound(_Model):
    """The lower end of an arm's Wilson match interval is at least ``at_least``."""

    criterion: Literal["match_lower_bound"] = "match_lower_bound"
    arm: Role = "treatment"
    at_least: float = Field(gt=0.0, lt=1.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return f"{self.arm}'s {_wilson_end(rule, 'lower')}", f">= {_num(self.at_least)}"


class MatchUpperBound(_Model):
    """The upper end of an arm's Wilson match interval is below ``below``."""

    criterion: Literal["match_upper_bound"] = "match_upper_bound"
    arm: Role = "treatment"
    below: float = Field(gt=0.0, le=1.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return f"{self.arm}'s {_wilson_end(rule, 'upper')}", f"< {_num(self.below)}"


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


class ControlDiverges(_Model):
    """The control diverges under the same load: the upper end of its Wilson match interval is
    at most ``at_most``.

    Activation evidence: a load under which the control (the mode off) demonstrably diverges
    could have revealed batch dependence in the treatment too. The bound's sidedness follows the
    rule's ``alternative`` (one-sided: the Wilson bound with alternative "less"). Needs two or
    more counted passes per arm (one pass always matches itself); refused at registration
    otherwise.
    """

    criterion: Literal["control_diverges"] = "control_diverges"
    at_most: float = Field(gt=0.0, lt=1.0)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"control diverges under the same load: control's {_wilson_end(rule, 'upper')}",
                f"<= {_num(self.at_most)}")


class TreatmentBeatsControl(_Model):
    """The treatment matches more often than the control (activation evidence).

    ``newcombe_at_least``: the lower end of Newcombe's hybrid score interval (at the rule's
    confidence level) for treatment - control match rate is at least this. ``mcnemar_below``:
    McNemar's paired test on the prompts both arms compared (exact below 25 discordant prompts)
    gives p below this, with more prompts matching only in the treatment than only in the
    control. Give one or both; with both, ``require`` says whether both tests must pass
    (``"both"``, the default) or one suffices (``"either"``): a sealed any-of of two tests of the
    same hypothesis, not an ad hoc one. Needs two or more counted passes per arm.
    """

    criterion: Literal["treatment_beats_control"] = "treatment_beats_control"
    newcombe_at_least: float | None = Field(default=None, gt=-1.0, lt=1.0)
    mcnemar_below: float | None = Field(default=None, gt=0.0, lt=1.0)
    require: Literal["both", "either"] = "both"

    @model_validator(mode="after")
    def _one_test(self) -> "TreatmentBeatsControl":
        if self.newcombe_at_least is None and self.mcnemar_below is None:
            raise ValueError("give newcombe_at_least (e.g. 0.0), mcnemar_below (e.g. 0.05) or "
                             "both")
        return self

    @property
    def tests(self) -> tuple[str, ...]:
        """The tests declared: ``"newcombe"``, ``"mcnemar"``, in that order."""
        return tuple(t for t, v in (("newcombe", self.newcombe_at_least),
                                    ("mcnemar", self.mcnemar_below)) if v is not None)

    def describe(self, rule: "Rule") -> tuple[str, str]:
        parts = []
        if self.newcombe_at_least is not None:
            parts.append((f"Newcombe {_pct(rule.confidence_level)} interval of treatment − "
                          "control match rate, lower end", f">= {_num(self.newcombe_at_least)}"))
        if self.mcnemar_below is not None:
            parts.append(("McNemar p, paired by prompt, treatment ahead",
                          f"< {_num(self.mcnemar_below)}"))
        joint = " and " if self.require == "both" else " or "
        return ("treatment beats control: " + joint.join(d for d, _ in parts),
                joint.join(t for _, t in parts))


class ProbeConfirmed(_Model):
    """``bistat probe`` confirmed the treatment: bitwise invariant alone and in batches, with a
    negative control that differed (the probe had power).

    The probe's outcome for the arm is read from the run directory's probe report(s)
    (``bistat probe REGISTRATION --output RUN_DIR/probe.json``). *confirmed* meets it; *no power*,
    *violated*, *vacuous* and *untested* do not; no probe report makes it not evaluable, and the
    comparison *untested* with that reason (never *working*).
    """

    criterion: Literal["probe_confirmed"] = "probe_confirmed"

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return ("the probe confirmed the treatment (bitwise, with a negative control that showed "
                "power)", "= confirmed")


#: Engine-log markers ``engine_log`` can name, with what each shows (``bistat.analysis.activation``).
LOG_MARKERS: dict[str, str] = {
    "batch_invariant_kernels": "the batch-invariant kernels registering",
    "tuned_gemm": "bistat's tuned GEMM installing itself",
}


class EngineLog(_Model):
    """The engine's log shows ``marker`` for the treatment at its starts: circumstantial
    evidence, reported but never sufficient alone (a label using it must also hold one of
    ``control_diverges``, ``treatment_beats_control``, ``probe_confirmed``). Only engines that
    keep a log (``vllm-server``, ``vllm-offline``) can evaluate it; refused at registration for
    others."""

    criterion: Literal["engine_log"] = "engine_log"
    marker: Literal["batch_invariant_kernels", "tuned_gemm"]

    def describe(self, rule: "Rule") -> tuple[str, str]:
        return (f"engine log shows {LOG_MARKERS[self.marker]} (circumstantial)", "= yes")


Criterion = Annotated[
    Union[MatchLowerBound, MatchUpperBound, MatchIntervalsOverlap, ThroughputRatio,
          ThroughputSlower, ThroughputNotSlower, LargeDriftsAtMost, ControlDiverges,
          TreatmentBeatsControl, ProbeConfirmed, EngineLog],
    Field(discriminator="criterion"),
]

CRITERION_NAMES = ("match_lower_bound", "match_upper_bound", "match_intervals_overlap",
                   "throughput_ratio", "throughput_slower", "throughput_not_slower",
                   "large_drifts_at_most", "control_diverges", "treatment_beats_control",
                   "probe_confirmed", "engine_log")
MATCH_CRITERIA = (MatchLowerBound, MatchUpperBound, MatchIntervalsOverlap)
THROUGHPUT_CRITERIA = (ThroughputRatio, ThroughputSlower, ThroughputNotSlower)
#: Evidence that the mode acts; a label whose activation criterion cannot be
#: evaluated makes the comparison *untested* rather than falling through to the next label.
ACTIVATION_CRITERIA = (ControlDiverges, TreatmentBeatsControl, ProbeConfirmed, EngineLog)
#: The activation criteria that can carry a label; ``engine_log`` is circumstantial only.
DIRECT_ACTIVATION_CRITERIA = (ControlDiverges, TreatmentBeatsControl, ProbeConfirmed)
#: Criteria that compare counted passes with each other (one counted pass matches itself).
NEEDS_REPEAT_MATCH = (ControlDiverges, TreatmentBeatsControl)


def needs_repeat_passes(criterion: object) -> bool:
    """Whether a criterion needs a ratio interval, hence >= 2 counted passes per arm."""
    if isinstance(criterion, ThroughputRatio):
        return criterion.statistic != "point"
    return isinstance(criterion, (ThroughputSlower, ThroughputNotSlower))


class LabelSpec(_Model):
    """One label of the rule and the criteria that must all hold for it."""

    label: str
    criteria: list[Criterion] = Field(alias="all", min_length=1)


#: Kernels the robust cost interval can use. ``"cosine"``: the equal-weighted cosine (EWC)
#: estimator of the long-run variance, whose t statistic has Student's t distribution with as many
#: degrees of freedom as cosine terms (Mueller 2007; Lazarus, Lewis, Stock and Watson 2018).
HAC_KERNELS = ("cosine",)
#: Named bandwidth rules. ``"llsw"``: ``B = max(2, floor(0.4 n**(2/3)))`` cosine terms for ``n``
#: pairs, at most ``n - 1`` (``bistat.core.serial.cosine_terms``). A declared integer fixes ``B``.
BANDWIDTH_RULES = ("llsw",)


@dataclass(frozen=True)
class HacSpec:
    """The declared robust interval's parameters (``[rule.cost] hac_kernel``, ``hac_bandwidth``;
    :func:`bistat.core.serial.hac_ratio` computes the interval, ``cosine_terms`` resolves the
    bandwidth rule at a number of pairs).

    Attributes
    ----------
    kernel : str
        One of :data:`HAC_KERNELS`.
    bandwidth : str or int
        A rule of :data:`BANDWIDTH_RULES`, or a fixed number of cosine terms ``>= 1``.
    """

    kernel: str = "cosine"
    bandwidth: str | int = "llsw"

    def __post_init__(self) -> None:
        if self.kernel not in HAC_KERNELS:
            allowed = ", ".join(repr(k) for k in HAC_KERNELS)
            raise ValueError(f"kernel must be one of {allowed}, got {self.kernel!r}")
        if isinstance(self.bandwidth, str):
            if self.bandwidth not in BANDWIDTH_RULES:
                allowed = ", ".join(repr(b) for b in BANDWIDTH_RULES)
                raise ValueError(f"bandwidth must be one of {allowed} or a number of cosine "
                                 f"terms >= 1, got {self.bandwidth!r}")
        elif isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, int) \
                or self.bandwidth < 1:
            raise ValueError(f"bandwidth must be one of 'llsw' or a number of cosine terms >= 1, "
                             f"got {self.bandwidth!r}")

    def describe(self) -> str:
        """The parameters in words, e.g. ``equal-weighted cosine, B = max(2, ⌊0.4 n^(2/3)⌋)
        terms``."""
        if self.bandwidth == "llsw":
            return "equal-weighted cosine, B = max(2, ⌊0.4 n^(2/3)⌋) terms"
        return f"equal-weighted cosine, B = {self.bandwidth} terms"


#: The cost rule's HAC parameters: present only with ``interval = "hac"``.
_HAC_FIELDS = ("hac_kernel", "hac_bandwidth")


class CostRule(_Model):
    """The cost of the mode as a verdict of its own (``[rule.cost]``).

    ``metric``: ``"throughput"`` (output tokens/s of each counted pass; a cost is a ratio below
    1) or ``"latency"`` (each counted pass's mean request latency, submission to last token, over
    its answered requests; a cost is a ratio above 1). The ratio is treatment / control of the
    per-pass values' geometric means, with the Welch interval on their logs at
    ``confidence_level`` (``bistat.core.stats.throughput_ratio``). Outcomes
    (``bistat.core.classify.classify_cost``), decided on that interval, the one the finding shows:

    - *costs*: the interval lies wholly beyond the margin on the slower side;
    - *faster*: the interval lies wholly beyond the margin on the faster side;
    - *no measurable cost*: otherwise, when the interval's slower end (its lower end for
      throughput, its upper end for latency) lies within ``[1 - margin, 1 + margin]`` -- the
      one-sided (non-inferiority) Welch test at ``(1 - confidence_level) / 2``; "possibly
      faster" when the interval also reaches beyond the margin on the faster side;
    - *undecidable*: the interval reaches across the margin on the slower side, with the passes
      per arm the design analysis says would decide it at the observed ratio and CV.

    A treatment faster than another never gets a worse cost outcome (*costs* < *undecidable* <
    *no measurable cost* < *faster*).

    Needs two or more counted passes per arm (refused at registration otherwise).

    ``interval``: ``"welch"`` (the default, above) treats the passes as independent;
    ``"paired"`` pairs pass ``i`` of the treatment with pass ``i`` of the control, which the ABBA
    schedule runs side by side, and takes the paired t interval of the log differences
    (``bistat.core.stats.paired_ratio``). A drift of the machine over the run that moves both
    arms alike then cancels within each pair instead of widening the interval; the ratio is the
    same. ``"hac"`` pairs the passes the same way and takes an interval of the log differences
    that stays valid when the pairs are serially correlated, as passes on one resident engine
    are (``bistat.core.serial.hac_ratio``: the equal-weighted cosine interval), with its
    parameters sealed beside it: ``hac_kernel`` (``"cosine"``) and ``hac_bandwidth`` (the rule
    ``"llsw"``, or a fixed number of cosine terms). Both are filled in at registration when
    ``interval = "hac"`` and refused otherwise; a rule without them serializes exactly as before
    they existed. ``docs/COST-INTERVALS.md`` says what each interval assumes and its coverage.
    Chosen at registration, like every other part of the rule, never after the data.
    """

    metric: Literal["throughput", "latency"] = "throughput"
    margin: float = Field(gt=0.0, lt=1.0)
    confidence_level: float = Field(default=0.95, gt=0.5, lt=1.0)
    interval: Literal["welch", "paired", "hac"] = "welch"
    hac_kernel: Literal["cosine"] | None = Field(
        default=None, description='interval = "hac" only, where it is filled in as "cosine" '
                                  "(equal-weighted cosine transforms, t with B degrees of freedom)")
    hac_bandwidth: Literal["llsw"] | int | None = Field(
        default=None, description='interval = "hac" only, where it is filled in as "llsw": '
                                  "B = max(2, floor(0.4 n^(2/3))) cosine terms for n pairs; or a "
                                  "fixed number of terms >= 1")

    @model_validator(mode="before")
    @classmethod
    def _hac_parameters(cls, data: Any) -> Any:
        """Fill in the HAC parameters for ``interval = "hac"`` (so the seal holds them) and
        refuse them for any other interval; name a bad bandwidth with what is allowed."""
        if not isinstance(data, dict):
            return data
        given = [k for k in _HAC_FIELDS if data.get(k) is not None]
        if data.get("interval") != "hac":
            if given:
                raise semantic_error([(k, f"applies only to interval = \"hac\", not "
                                          f"{data.get('interval', 'welch')!r}; remove it or set "
                                          "interval = \"hac\"") for k in given])
            return data
        bandwidth = data.get("hac_bandwidth", "llsw")
        if not (bandwidth == "llsw" or (type(bandwidth) is int and bandwidth >= 1)):
            raise semantic_error([("hac_bandwidth", f"{bandwidth!r} is not allowed; expected "
                                   "\"llsw\" (B = max(2, floor(0.4 n^(2/3))) cosine terms for n "
                                   "pairs) or a number of cosine terms >= 1, e.g. 4")])
        return {**data, "hac_kernel": data.get("hac_kernel", "cosine"),
                "hac_bandwidth": bandwidth}

    @model_serializer(mode="wrap")
    def _omit_unset_hac(self, handler: Any) -> Any:
        """Leave the HAC parameters out where they are unset (every interval but ``"hac"``):
        a rule that does not use them serializes, and so seals and hashes, as it did before
        they existed."""
        data = handler(self)
        if isinstance(data, dict):
            for key in _HAC_FIELDS:
                if data.get(key, 0) is None:
                    del data[key]
        return data

    @property
    def hac(self) -> HacSpec | None:
        """The declared robust interval's parameters (``interval = "hac"``), else None."""
        if self.interval != "hac":
            return None
        return HacSpec(kernel=self.hac_kernel or "cosine", bandwidth=self.hac_bandwidth or "llsw")

    @property
    def low(self) -> float:
        """The lower margin on the ratio scale, ``1 - margin``."""
        return 1.0 - self.margin

    @property
    def high(self) -> float:
        """The upper margin on the ratio scale, ``1 + margin``."""
        return 1.0 + self.margin

    def describe(self) -> str:
        """The cost rule in words."""
        what = {"throughput": "throughput ratio (treatment ÷ control, output tokens/s per pass)",
                "latency": "latency ratio (treatment ÷ control, mean request latency per pass)"}
        if self.hac is not None:
            return (f"{what[self.metric]}, {_pct(self.confidence_level)} HAC interval of the "
                    f"paired passes ({self.hac.describe()}) against "
                    f"[{_num(self.low)}, {_num(self.high)}]")
        kind = " paired" if self.interval == "paired" else ""
        return (f"{what[self.metric]}, {_pct(self.confidence_level)}{kind} interval against "
                f"[{_num(self.low)}, {_num(self.high)}]")


class Rule(_Model):
    """The decision rule. ``confidence_level`` applies to every interval (match and ratio).

    ``alternative`` is the sidedness of the Wilson bounds used by ``match_lower_bound`` /
    ``match_upper_bound``: "two-sided" (the ends of the two-sided interval, as in the
    published rule) or "greater" (one-sided bounds at ``confidence_level``: the Wilson
    interval with alternative "greater" for a lower bound, "less" for an upper bound).
    ``match_intervals_overlap`` always compares two-sided intervals.
    ``tost_alpha`` is the level of each one-sided test in TOST equivalence.
    ``cost`` is the sealed cost rule (:class:`CostRule`); without it a finding states no cost.
    """

    confidence_level: float = Field(default=0.95, gt=0.5, lt=1.0)
    alternative: Literal["two-sided", "greater"] = "two-sided"
    tost_alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    otherwise: str = "reported as observed"
    labels: list[LabelSpec] = Field(min_length=1)
    cost: CostRule | None = None

    @property
    def alpha(self) -> float:
        """The rule's error rate, ``1 - confidence_level``: the false-positive probability the
        design analysis warns above."""
        return 1.0 - self.confidence_level

    @model_validator(mode="after")
    def _labels_known(self) -> "Rule":
        issues: list[tuple[str, str]] = []
        for i, spec in enumerate(self.labels):
            logs = [j for j, c in enumerate(spec.criteria) if isinstance(c, EngineLog)]
            direct = any(isinstance(c, DIRECT_ACTIVATION_CRITERIA) for c in spec.criteria)
            if logs and not direct:
                issues.append((f"labels[{i}].all[{logs[0]}]",
                               "engine_log is circumstantial evidence, never sufficient alone; "
                               "add control_diverges, treatment_beats_control or probe_confirmed "
                               f"to '{spec.label}', or remove engine_log"))
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

    Model validators that check several fields at once raise this; ``bistat.declare.experiment``
    prefixes the model's own location and prints one line per pair.
    """
    summary = "; ".join(f"{field}: {msg}" for field, msg in issues)
    return PydanticCustomError("bistat_semantic", "{summary}",
                               {"summary": summary, "issues": tuple(issues)})


def speed_as_evidence_warnings(rule: Rule) -> list[str]:
    """A warning for every criterion through which a faster treatment gets a worse label.

    A *working* label that needs the treatment to be slower (``throughput_ratio ... below``,
    ``throughput_slower``) takes a slowdown as evidence that the mode acts; a *doubtful* label
    that needs it not to be slower (``throughput_ratio ... at_least``, ``throughput_not_slower``)
    takes the absence of one as evidence that it does not. Under either, a faster invariant
    kernel, with the same outputs, can only turn the verdict worse. Whether the mode acts is what
    the activation criteria show, and they read no speed; the cost is ``[rule.cost]``'s own
    verdict. Sealed rules keep their criteria: the warning says how to read them.

    >>> r = Rule.model_validate({"labels": [{"label": "working", "all": [
    ...     {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99},
    ...     {"criterion": "throughput_slower", "bound": 0.9}]}]})
    >>> print(speed_as_evidence_warnings(r)[0][:64])
    rule.labels[0].all[1] ('working': throughput ratio 95 % interval
    """
    out = []
    for li, spec in enumerate(rule.labels):
        for ci, crit in enumerate(spec.criteria):
            slowdown = (isinstance(crit, ThroughputSlower)
                        or (isinstance(crit, ThroughputRatio) and crit.below is not None))
            no_slowdown = (isinstance(crit, ThroughputNotSlower)
                           or (isinstance(crit, ThroughputRatio) and crit.at_least is not None))
            if spec.label == Label.WORKING and slowdown:
                what = ("takes a slowdown as evidence that the mode acts: a faster invariant "
                        "kernel with the same outputs can lose 'working'")
            elif spec.label == Label.DOUBTFUL and no_slowdown:
                what = ("takes the absence of a slowdown as evidence that the mode does not "
                        "act: a faster invariant kernel with the same outputs can become "
                        "'doubtful'")
            else:
                continue
            description, threshold = crit.describe(rule)
            out.append(f"rule.labels[{li}].all[{ci}] ('{spec.label}': {description} "
                       f"{threshold}) {what}. Whether the mode acts is shown by control_diverges "
                       "with treatment_beats_control, or by probe_confirmed, which read no "
                       "speed; state the cost in [rule.cost] (bistat new NAME writes such a "
                       "rule)")
    return out
