"""The design analysis of a declaration: what its plan can and cannot conclude.

Composes the primitives of ``bistat.core.design`` for every criterion of the declared rule:

- match-rate criteria (``match_lower_bound``): the smallest number of prompts for which a
  perfect match clears the threshold, the mismatches tolerated at the declared number of
  prompts, and the probability that the criterion is met at the assumed true match rate;
- throughput criteria: the expected width of the ratio interval at the declared passes and
  coefficient of variation (CV), and the probability that the criterion is met at each of a set
  of true ratios (``design.true_ratios``), with the passes per arm that would reach the power
  target where the plan falls short.

- activation criteria: ``control_diverges`` -- the probability that the control's
  upper bound is at most its threshold at the assumed control match rate
  (``design.assumed_control_match_rate``); ``treatment_beats_control`` -- the power of each
  declared test (McNemar, Newcombe) at the two assumed rates; the probe and the engine log have
  no design figures (their power shows in the run: the probe's negative control);
- the cost rule (``[rule.cost]``): the probability of each outcome (*no measurable cost*,
  *costs*, *faster*, *undecidable*) at each true ratio and the passes per arm that would decide
  it at a true ratio of 1;
- **false verdicts**: each label's false-positive probability when there is no slowdown (true
  ratio 1, labels with a slowdown criterion) and, for *working*, in an A/A experiment (the
  treatment's mode doing nothing: both arms at one match rate, the worst over a grid of rates),
  with a warning naming the passes or prompts that bring it under the rule's alpha
  (``1 - confidence_level``) when it exceeds it.

The CV is declared (``design.expected_cv``, default 0.05) or read from an earlier run
(``design.cv_from``: the pooled pass-to-pass CV of its counted passes, per arm, from
``passes.jsonl``). Plans that cannot reach a verdict are warned about, saying what to change.

**Run time**: an earlier run (``design.cv_from``) also times the declared run
(:func:`timing_from_run`, :func:`estimate_duration`): its engine starts (``events.jsonl``,
``run.json``) and passes (``passes.jsonl``), applied to the declaration's own schedule
(:func:`bistat.core.schedule.plan_schedule`). A run must finish on one machine (its same-GPU
validity check), so a run estimated over ``design.time_budget_s`` is warned about, with the
``workload.passes`` that fits.

This module composes the analysis (:func:`analyse_design`) and formats it (:func:`format_design`);
each part has a module of its own: the criteria (:mod:`bistat.declare.design_power`), the false
verdicts (:mod:`bistat.declare.design_false_verdicts`), the earlier run's CV
(:mod:`bistat.declare.design_cv`) and the run-time estimate (:mod:`bistat.declare.design_runtime`).
Every public name of those modules is importable from here as well.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bistat.core import design_coverage, design_rho
from bistat.core.rule import (
    ControlDiverges,
    CostRule,
    MatchLowerBound,
    ThroughputNotSlower,
    ThroughputRatio,
    ThroughputSlower,
    TreatmentBeatsControl,
    speed_as_evidence_warnings,
)
from bistat.core import stats
from bistat.declare.design_cv import (METRIC_WORDS, DesignError, cv_from_run, paired_cv,
                                      paired_cv_from_run, pairs_from_run, serial_estimate)
from bistat.declare.design_false_verdicts import (
    AA_MATCH_RATES,
    MAX_PROMPTS_FOR_ALPHA,
    FalsePositive,
    LabelProbability,
    false_positive_warnings,
    false_positives,
    label_probabilities,
)
from bistat.declare.design_power import (
    MAX_PROMPTS_SEARCHED,
    ActivationDesign,
    CostDesign,
    MatchDesign,
    PowerAt,
    ThroughputDesign,
    activation_design,
    activation_warnings,
    cost_design,
    cost_warnings,
    match_design,
    match_warnings,
    no_design_reason,
    throughput_design,
    throughput_warnings,
)
from bistat.declare.design_runtime import (
    DurationEstimate,
    RunTiming,
    concurrency_warnings,
    duration_lines,
    duration_warnings,
    engine_start_warnings,
    estimate_duration,
    timing_from_run,
)
from bistat.declare.experiment import Experiment
from bistat.engines.registry import declaration_limits

__all__ = [
    "AA_MATCH_RATES",
    "MAX_PROMPTS_FOR_ALPHA",
    "MAX_PROMPTS_SEARCHED",
    "DesignError",
    "MatchDesign",
    "PowerAt",
    "ThroughputDesign",
    "ActivationDesign",
    "CostDesign",
    "FalsePositive",
    "LabelProbability",
    "RunTiming",
    "DurationEstimate",
    "DesignReport",
    "analyse_design",
    "cv_from_run",
    "paired_cv_from_run",
    "timing_from_run",
    "estimate_duration",
    "format_design",
]


@dataclass(frozen=True)
class DesignReport:
    """The whole design analysis of one declaration."""

    name: str
    n_prompts: int
    passes_per_arm: int
    cv: float
    cv_source: str
    confidence_level: float
    alternative: str
    assumed_match_rate: float
    true_ratios: tuple[float, ...]
    power_target: float
    match: tuple[MatchDesign, ...]
    throughput: tuple[ThroughputDesign, ...]
    labels: tuple[LabelProbability, ...]
    other: tuple[str, ...]
    warnings: tuple[str, ...]
    activation: tuple[ActivationDesign, ...] = ()
    cost: CostDesign | None = None
    false_positives: tuple[FalsePositive, ...] = ()
    assumed_control_match_rate: float | None = None
    duration: DurationEstimate | None = None
    #: what the engine's adapter cannot check at registration, in words
    #: (:func:`bistat.engines.registry.declaration_limits`)
    unchecked: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (stored in the registration)."""
        data = asdict(self)
        for key in ("true_ratios", "match", "throughput", "labels", "other", "warnings",
                    "activation", "cost", "false_positives", "duration", "unchecked"):
            data[key] = json.loads(json.dumps(data[key]))
        return data


def analyse_design(exp: Experiment, *, base_dir: str | Path | None = None) -> DesignReport:
    """Design analysis of a declaration (see the module docstring).

    Parameters
    ----------
    exp : Experiment
        The declaration.
    base_dir : path, optional
        Directory ``design.cv_from`` is relative to (default: the current directory).
    """
    rule, wl, des = exp.rule, exp.workload, exp.design
    duration: DurationEstimate | None = None
    if des.cv_from is not None:
        run_dir = Path(des.cv_from)
        if not run_dir.is_absolute() and base_dir is not None:
            run_dir = Path(base_dir) / run_dir
        cv_res, cv_source = cv_from_run(run_dir)
        cv = cv_res.cv
        duration = estimate_duration(exp, timing_from_run(run_dir))
    else:
        cv = des.resolved_cv()
        cv_source = "declared" if des.expected_cv is not None else "assumed; none declared"
        if des.time_budget_s is not None:
            duration = estimate_duration(exp, None)
    assert cv is not None
    n, passes, cl = wl.n_prompts, wl.passes, rule.confidence_level
    alt = "greater" if rule.alternative == "greater" else "two-sided"
    ratios = tuple(des.true_ratios)
    target = des.power_target

    match: list[MatchDesign] = []
    through: list[ThroughputDesign] = []
    activation: list[ActivationDesign] = []
    other: list[str] = []
    warnings: list[str] = []
    labels: list[LabelProbability] = []
    control_rate = des.assumed_control_match_rate

    for li, spec in enumerate(rule.labels):
        label_match: list[float | None] = []
        label_through: list[ThroughputDesign] = []
        independent = True
        activation_in_label = False
        for ci, crit in enumerate(spec.criteria):
            field = f"rule.labels[{li}].all[{ci}]"
            description, threshold = crit.describe(rule)
            where = f"{field} ('{spec.label}': {description} {threshold})"
            if isinstance(crit, (ControlDiverges, TreatmentBeatsControl)):
                activation_in_label = True   # the same prompts as the match criteria
                ad = activation_design(spec.label, field, crit, description, threshold, n,
                                        rule, des.assumed_match_rate, control_rate, target)
                activation.append(ad)
                warnings.extend(activation_warnings(ad, where, target))
            elif isinstance(crit, MatchLowerBound):
                md = match_design(spec.label, field, crit, description, threshold, n, cl, alt,
                                   des.assumed_match_rate)
                match.append(md)
                warnings.extend(match_warnings(md, where, crit, cl, alt, target))
                label_match.append(md.prob_met)
            elif isinstance(crit, (ThroughputRatio, ThroughputSlower, ThroughputNotSlower)):
                td = throughput_design(spec.label, field, crit, description, threshold, passes,
                                        cv, cl, rule.tost_alpha, ratios, target)
                through.append(td)
                warnings.extend(throughput_warnings(td, where, crit, ratios, target))
                label_through.append(td)
            else:
                independent = False
                other.append(f"{field} ('{spec.label}': {description} {threshold}): "
                             + no_design_reason(crit))
        labels.extend(label_probabilities(spec.label, label_match, label_through, ratios,
                                           independent, activation_in_label))

    cost = None
    if rule.cost is not None:
        cost, cost_cv_source, cost_warn = _cost(rule.cost, passes, cv, ratios, target,
                                                run_dir if des.cv_from is not None else None,
                                                base_dir)
        cv_source += cost_cv_source
        warnings.extend(cost_warn)
    fps = false_positives(rule, n, passes, cv, des.assumed_match_rate, control_rate)
    warnings.extend(false_positive_warnings(fps))
    warnings.extend(speed_as_evidence_warnings(rule))
    warnings.extend(concurrency_warnings(exp))
    warnings.extend(engine_start_warnings(exp, bool(through) or cost is not None))
    if duration is not None:
        warnings.extend(duration_warnings(duration))
    return DesignReport(
        name=exp.name, n_prompts=n, passes_per_arm=passes, cv=cv, cv_source=cv_source,
        confidence_level=cl, alternative=rule.alternative,
        assumed_match_rate=des.assumed_match_rate, true_ratios=ratios, power_target=target,
        match=tuple(match), throughput=tuple(through), labels=tuple(labels),
        other=tuple(other), warnings=tuple(warnings), activation=tuple(activation), cost=cost,
        false_positives=tuple(fps), assumed_control_match_rate=control_rate,
        duration=duration, unchecked=tuple(declaration_limits(exp)),
    )


def _cost(cost_rule: CostRule, passes: int, cv: float, ratios: tuple[float, ...],
          target: float, run_dir: Path | None, base_dir: str | Path | None = None
          ) -> tuple[CostDesign, str, list[str]]:
    """The cost rule planned for the interval it declares, on the metric it decides on, what the
    CV's source adds for it, and its warnings.

    Welch's interval is planned as independent passes at the pooled CV of the metric: the CV
    above for throughput; for latency, the earlier run's pooled CV of its mean request latency
    per pass, where it has one. The paired and the HAC interval at the per-arm CV the earlier
    run's pairs of passes give (``design.cv_from``): each treatment's against the control's, one
    pair per round of the schedule, as the classifier pairs them (:func:`pairs_from_run`), the
    spread of their log differences pooled over the treatments (:func:`paired_cv`). The HAC
    interval at their lag-1 autocorrelation as well (bias-corrected; the most conservative
    comparison's, :func:`serial_estimate`), the paired one as independent pairs -- what it
    assumes. Whatever the interval, the earlier run's serial correlation is checked against what
    it assumes (:func:`bistat.core.design.check_interval_assumptions`): each check that finds it
    contradicted or at risk is a warning."""
    interval, metric = cost_rule.interval, cost_rule.metric
    source, warnings = "", []
    rho, serial, check = 0.0, None, None
    pairs = pairs_from_run(run_dir, metric, base_dir=base_dir) if run_dir is not None else None
    cost_cv, at = cv, "this CV"
    if metric == "latency" and pairs is not None:
        groups = [v for v in pairs.arm_values.values() if len(v) >= 2]
        if groups:
            res = stats.pooled_cv(groups)
            cost_cv = res.cv
            at = (f"the pooled CV of its {METRIC_WORDS[metric]} ({sum(map(len, groups))} counted "
                  f"passes in {len(groups)} arms, {res.df} degrees of freedom): {res.cv:.4f}")
            if interval == "welch":
                source += f"; the cost's Welch interval: {at}"
    if interval in ("paired", "hac"):
        what = "paired" if interval == "paired" else "HAC"
        pcv = paired_cv(pairs) if pairs is not None else None
        if pcv is not None:
            cost_cv = pcv.cv
            spread = (f"the SD of their log differences {pcv.sd_log_diff:.4f}"
                      if len(pairs.comparisons) == 1 else
                      f"the SD of their log differences pooled over the "
                      f"{len(pairs.comparisons)} comparisons (each about its own mean, "
                      f"{pcv.df} degrees of freedom) {pcv.sd_log_diff:.4f}")
            source += (f"; the cost's {what} interval: {pairs.describe()}, {spread} over "
                       f"sqrt(2), as a CV: {pcv.cv:.4f}")
        else:
            why = (f"{run_dir} gives no pairs of passes: {pairs.unpaired}" if pairs is not None
                   else "an earlier run in design.cv_from gives the pairs' spread")
            source += (f"; the cost's {what} interval planned at {at}, as if unpaired ({why}; "
                       "a drift common to both arms only makes this CV larger)")
    found = serial_estimate(pairs, interval) if pairs is not None else None
    if found is not None:
        serial, comp = found
        if interval == "hac":
            rho = serial.rho
            diffs = serial.diagnostics.differences
            among = sum(1 for c in pairs.comparisons if c.n >= design_rho.MIN_PAIRS_TO_CHECK)
            over = (f"{comp.n} pairs" if among == 1 else
                    f"the {comp.n} pairs of {comp.label()}, the largest of {among} comparisons: "
                    "the most conservative")
            source += (f", at their lag-1 autocorrelation {rho:.2f} (bias-corrected; "
                       f"{diffs.lag1:.2f} over {over})" if diffs.lag1 is not None
                       else ", as independent pairs (their differences do not vary)")
        if passes >= 2:
            check = design_coverage.check_interval_assumptions(
                interval, passes, serial, cost_rule.confidence_level, cost_rule.hac)
            if check.message is not None:
                warnings.append(f"rule.cost ({cost_rule.describe()}): {check.message}")
    elif interval == "hac":
        source += (", as independent pairs (no serial correlation estimated: a treatment with "
                   f"{design_rho.MIN_PAIRS_TO_CHECK} pairs of passes or more with the control in "
                   "the earlier run of design.cv_from gives it)")
    compared = (() if pairs is None else
                tuple((c.treatment, c.control, c.n) for c in pairs.comparisons))
    cd = cost_design(cost_rule, passes, cost_cv, ratios, target, rho=rho, serial=serial,
                     serial_from=None if found is None else pairs.run_dir,
                     serial_arms=() if found is None else (found[1].treatment, found[1].control),
                     check=check, pairs=compared)
    return cd, source, warnings + cost_warnings(cd, target)


def _cost_lines(cd: CostDesign, report: DesignReport) -> list[str]:
    """The "Cost rule" section of :func:`format_design`."""
    unit = "pairs" if cd.interval in ("paired", "hac") else "counted passes per arm"
    lines = [f"Cost rule ({cd.description}; {cd.passes_per_arm} {unit}, CV {cd.cv:.3g}):"]
    if cd.interval in ("paired", "hac") and cd.pairs:
        lines.append("  CV from the earlier run's pairs of passes: " + ", ".join(
            f"{t} ÷ {c} {n}" for t, c, n in cd.pairs)
            + ("; the spread of their log differences pooled over the comparisons"
               if len(cd.pairs) > 1 else ""))
    if cd.interval == "hac" and cd.hac_terms is not None:
        lines.append(f"  interval: HAC, equal-weighted cosine, {cd.hac_terms} cosine terms at "
                     f"{cd.passes_per_arm} pairs (t with {cd.hac_terms} degrees of freedom), "
                     f"planned at the pairs' lag-1 autocorrelation {cd.rho:.2f}")
    if cd.serial is not None:
        diag = cd.serial.diagnostics

        def said(c) -> str:
            return ("does not vary" if c.lag1 is None else
                    f"{c.lag1:.2f} (Ljung-Box p = {c.pvalue:.3g} over {c.lags} lags)")
        first, second = cd.serial_arms
        among = sum(1 for *_, n in cd.pairs if n >= design_rho.MIN_PAIRS_TO_CHECK)
        which = (f" ({first} ÷ {second}, the most conservative of {among} comparisons)"
                 if among > 1 else "")
        lines.append(f"  serial correlation of {cd.serial.pairs} pairs of passes of "
                     f"{cd.serial_from}{which}, lag-1 autocorrelation: pair differences "
                     f"{said(diag.differences)}, bias-corrected {cd.serial.rho:.2f}; "
                     f"{first} {said(diag.treatment)}; {second} {said(diag.control)}")
    if cd.check is not None:
        c = cd.check
        state = ("contradicted" if c.contradicted else "at risk" if c.at_risk else
                 "within its tolerance")
        lines.append(f"  the declared {c.interval} interval's coverage at {c.rho:.2f}: "
                     f"{c.coverage * 100:.1f} % of its stated {c.confidence_level * 100:g} % "
                     f"({state})")
    if cd.interval_factor is not None:
        lines.append(f"  expected ratio interval: estimate ×/÷ {cd.interval_factor:.3f}"
                     + (" (pairs independent)" if cd.interval == "hac" else ""))
    for r, probs in cd.outcomes:
        lines.append(f"  at true ratio {r:g}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in probs.items()))
    lines.append(f"  {unit} that decide it with the power target: " + ", ".join(
        f"at {r:g}: {'none up to 200' if k is None else k}" for r, k in cd.passes_to_decide))
    return lines


def _p(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_design(report: DesignReport) -> str:
    """Plain-text rendering of a design analysis (``bistat design``, ``bistat register``)."""
    lines = [f"Design analysis of '{report.name}': {report.n_prompts} prompts, "
             f"{report.passes_per_arm} counted passes per arm, CV {report.cv:.3g} "
             f"({report.cv_source})"]
    if report.match:
        lines.append("")
        lines.append(f"Match criteria ({report.confidence_level * 100:g} % Wilson, "
                     f"{report.alternative}; assumed true match rate "
                     f"{report.assumed_match_rate:g}):")
        for md in report.match:
            lines.append(f"  {md.label}: {md.description} {md.threshold}")
            lines.append(f"    prompts needed for a perfect match to clear it: {md.min_prompts}")
            tol = ("none (even a perfect match falls short)" if md.mismatches_tolerated == -1
                   else str(md.mismatches_tolerated))
            lines.append(f"    mismatches tolerated at {md.n_prompts} prompts: {tol}")
            lines.append(f"    P(met) at a true match rate of {md.assumed_match_rate:g}: "
                         f"{_p(md.prob_met)}")
    if report.throughput:
        lines.append("")
        other = ("" if report.cost is None or report.cost.interval == "welch" else
                 f", not the cost rule's {'HAC' if report.cost.interval == 'hac' else 'paired'}"
                 " interval")
        lines.append(f"Throughput criteria (Welch's interval and TOST of the throughput ratio, "
                     f"each arm's passes unpaired{other}; {report.passes_per_arm} counted "
                     f"passes per arm, CV {report.cv:.3g}):")
        for td in report.throughput:
            lines.append(f"  {td.label}: {td.description} {td.threshold}")
            if td.interval_factor is not None:
                lines.append(f"    expected ratio interval: estimate ×/÷ {td.interval_factor:.3f}"
                             f" (log half-width {td.halfwidth_log:.4f})")
            if td.note:
                lines.append(f"    {td.note}")
            probs = ", ".join(f"{p.true_ratio:g}: {_p(p.prob_met)}" for p in td.power)
            lines.append(f"    P(met) at true ratio {probs}")
    if report.activation:
        lines.append("")
        lines.append(f"Activation criteria ({report.n_prompts} prompts; assumed match rates "
                     f"{report.assumed_match_rate:g} treatment, "
                     f"{report.assumed_control_match_rate:g} control):")
        for ad in report.activation:
            lines.append(f"  {ad.label}: {ad.description} {ad.threshold}")
            if ad.tests:
                lines.append("    " + ", ".join(f"P({t}) = {_p(q)}" for t, q in ad.tests))
            lines.append(f"    P(met): {_p(ad.prob_met)}"
                         + (f" ({ad.note})" if ad.note else ""))
    if report.cost is not None:
        lines.append("")
        lines.extend(_cost_lines(report.cost, report))
    if report.false_positives:
        lines.append("")
        lines.append("False verdicts (a label met when what it asserts is false):")
        for fp in report.false_positives:
            what = ("no slowdown (true ratio 1)" if fp.scenario == "no slowdown" else
                    f"A/A (both arms at match rate {fp.match_rate:g}, the worst tried)")
            lines.append(f"  {fp.label}, {what}: P {'<=' if fp.bound else '='} {fp.prob:.3f}"
                         f" (alpha {fp.alpha:.3g})")
    if report.labels:
        lines.append("")
        lines.append("P(label's criteria all met), match and throughput independent:")
        by_label: dict[str, list[LabelProbability]] = {}
        for lp in report.labels:
            by_label.setdefault(lp.label, []).append(lp)
        for label, lps in by_label.items():
            if all(lp.prob is None for lp in lps):
                lines.append(f"  {label}: {lps[0].note}")
            else:
                lines.append(f"  {label}: " + ", ".join(
                    f"at true ratio {lp.true_ratio:g}: {_p(lp.prob)}" for lp in lps))
    if report.other:
        lines.append("")
        lines.append("Other criteria:")
        lines.extend(f"  {o}" for o in report.other)
    if report.duration is not None:
        lines.append("")
        lines.extend(duration_lines(report.duration))
    if report.unchecked:
        lines.append("")
        lines.append("Not checked at registration (the engine tells only when it runs):")
        lines.extend(f"  - {u}" for u in report.unchecked)
    lines.append("")
    if report.warnings:
        lines.append(f"Warnings ({len(report.warnings)}):")
        lines.extend(f"  - {w}" for w in report.warnings)
    else:
        lines.append("Warnings: none")
    return "\n".join(lines) + "\n"
