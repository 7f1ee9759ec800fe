"""The serial correlation of a run's passes, and what it does to the cost interval the rule used.

Passes on one resident engine are not independent: the allocator, caches, clocks and host state
carry over from one pass to the next. Welch's interval takes each arm's passes as independent, the
paired one the pairs of passes; when they are not, the interval states a coverage it does not have
(``docs/COST-INTERVALS.md``). This phase of the analysis (:func:`serial_passes`) measures the
correlation on the values the cost rule reads -- each arm's per-pass metric in pass order and the
pairs' log differences (the treatment's and the control's pass of one round of the schedule) -- with the
pure functions of :mod:`bistat.core.serial`, and puts a number on the coverage of the rule's
interval at the correlation the run shows (:func:`bistat.core.design.check_interval_assumptions`).
For a rule whose interval is ``"hac"`` it keeps that interval's make-up (cosine terms, critical
value), which the finding states beside the interval.

The result, :class:`SerialPasses`, is the ``serial`` field of
:class:`bistat.analysis.results.RunSummary`; ``bistat.report.finding`` formats it and computes
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bistat.core import design_coverage, design_rho, serial
from bistat.core.classify_inputs import ArmStats
from bistat.core.pairing import pass_pairs
from bistat.core.rule import Rule

__all__ = ["ArmSerial", "PairSerial", "SERIAL_ALPHA", "SerialPasses", "serial_passes"]

#: The level at which a Ljung-Box test of a series in pass order counts as significant.
SERIAL_ALPHA = 0.05

#: Values a series needs for the lag-1 autocorrelation and the Ljung-Box test
#: (:func:`bistat.core.serial.serial_correlation`).
MIN_SERIES = 3

#: Pairs the coverage check needs (:data:`bistat.core.design.MIN_PAIRS_TO_CHECK`).
MIN_PAIRS_CHECKED = design_rho.MIN_PAIRS_TO_CHECK


@dataclass(frozen=True)
class ArmSerial:
    """One arm's per-pass metric in pass order (its counted passes with a value): ``passes`` the
    pass indices, ``values`` the metric. ``correlation`` is None with fewer than
    :data:`MIN_SERIES` passes."""

    arm: str
    role: str
    passes: tuple[int, ...]
    values: tuple[float, ...]
    correlation: serial.SerialCorrelation | None

    @property
    def n(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class PairSerial:
    """One treatment against the control: the pairs' log differences in pass order, the rule's
    interval's coverage at the correlation they show, and, for a HAC interval, its make-up.

    Attributes
    ----------
    treatment, control : str
    passes : tuple of int
        The control's pass index of each pair, in schedule order (the pairs are
        :func:`bistat.core.classify.pass_pairs`'s: one per round of the schedule both arms ran).
    log_differences : tuple of float
        ``log treatment - log control`` of each pair.
    differences : SerialCorrelation or None
        Lag-1 autocorrelation and Ljung-Box test of the pairs' log differences; None with fewer
        than :data:`MIN_SERIES` pairs.
    check : AssumptionCheck or None
        :func:`bistat.core.design.check_interval_assumptions` of the rule's interval at the run's
        passes (Welch: passes per arm; paired and HAC: pairs) and the run's own correlation
        (bias-corrected; for Welch the larger of the arms'); None with fewer than
        :data:`MIN_PAIRS_CHECKED` pairs.
    hac : HacRatioResult or None
        :func:`bistat.core.serial.hac_ratio` of the pairs, when the rule's interval is ``"hac"``:
        the interval that decided the cost, with its cosine terms and critical value.
    treatment_passes : tuple of int
        The treatment's pass index of each pair.
    rounds : tuple of int
        The round of the schedule of each pair.
    paired_by : str
        What paired them (:attr:`bistat.core.classify.PassPairs.by`).
    """

    treatment: str
    control: str
    passes: tuple[int, ...]
    log_differences: tuple[float, ...]
    differences: serial.SerialCorrelation | None
    check: design_coverage.AssumptionCheck | None
    hac: serial.HacRatioResult | None = None
    treatment_passes: tuple[int, ...] = ()
    rounds: tuple[int, ...] = ()
    paired_by: str = "round"

    @property
    def n_pairs(self) -> int:
        """Pairs of passes: rounds of the schedule both arms have a value in."""
        return len(self.passes)


@dataclass(frozen=True)
class SerialPasses:
    """The serial correlation of a run's passes (:func:`serial_passes`).

    Attributes
    ----------
    metric : str
        ``"throughput"`` (output tokens/s per pass) or ``"latency"`` (mean request latency per
        pass): the cost rule's metric, throughput without a cost rule.
    interval : str
        The interval the rule decides the cost on (``"welch"``, ``"paired"``, ``"hac"``); without
        a cost rule ``"welch"``, the throughput ratio's interval the finding shows.
    cost_rule : bool
        The rule has a cost rule.
    confidence_level : float
        That interval's nominal coverage.
    alpha : float
        The Ljung-Box tests' level (:data:`SERIAL_ALPHA`).
    arms : tuple of ArmSerial
        The control, then the treatments, in comparison order.
    pairs : tuple of PairSerial
        One per comparison.
    """

    metric: str
    interval: str
    cost_rule: bool
    confidence_level: float
    alpha: float
    arms: tuple[ArmSerial, ...]
    pairs: tuple[PairSerial, ...]

    @property
    def significant(self) -> tuple[str, ...]:
        """The series whose Ljung-Box test rejects at ``alpha``: arm names, and
        ``"TREATMENT ÷ CONTROL"`` for pair differences, in the finding's order."""
        out = [a.arm for a in self.arms
               if a.correlation is not None and a.correlation.significant(self.alpha)]
        out += [f"{p.treatment} ÷ {p.control}" for p in self.pairs
                if p.differences is not None and p.differences.significant(self.alpha)]
        return tuple(out)


def _arm_values(arm: ArmStats, metric: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The arm's pass indices and values of the metric, sorted by pass index (by position,
    ``0, 1, ...``, when the indices are not known)."""
    values, passes = ((arm.pass_throughputs, arm.throughput_passes) if metric == "throughput"
                      else (arm.pass_latencies, arm.latency_passes))
    if len(passes) != len(values) or not passes:
        passes = tuple(range(len(values)))
    ordered = sorted(zip(passes, values))
    return tuple(k for k, _ in ordered), tuple(v for _, v in ordered)


def _correlation(values: Sequence[float]) -> serial.SerialCorrelation | None:
    if len(values) < MIN_SERIES or not all(v > 0 for v in values):
        return None
    return serial.log_serial_correlation(values)


def serial_passes(rule: Rule, comparisons: Sequence[tuple[ArmStats, ArmStats]]
                  ) -> SerialPasses | None:
    """The serial correlation of each arm's passes and of each comparison's pairs.

    Parameters
    ----------
    rule : Rule
        The rule analysed under: its cost rule gives the metric, the interval and its level.
    comparisons : sequence of (control, treatment) ArmStats
        As the classifier takes them (their per-pass values and pass indices).

    Returns
    -------
    SerialPasses or None
        None when there is no comparison.

    Notes
    -----
    Each arm's series is its counted passes with a value of the metric, in pass order; the pairs
    are :func:`bistat.core.classify.pass_pairs`'s, the ones a paired or HAC interval reads.
    The coverage of the rule's interval is that of the AR(1) planning model at the run's
    bias-corrected lag-1 autocorrelation (:func:`bistat.core.design.interval_coverage`): an
    estimate from one run, which says how far the stated coverage may be off, not a correction.
    """
    if not comparisons:
        return None
    cost = rule.cost
    metric = cost.metric if cost is not None else "throughput"
    interval = cost.interval if cost is not None else "welch"
    cl = cost.confidence_level if cost is not None else rule.confidence_level
    hac = cost.hac if cost is not None else None
    arms: dict[str, ArmSerial] = {}
    pairs: list[PairSerial] = []
    for control, treatment in comparisons:
        for a in (control, treatment):
            if a.name not in arms:
                passes, values = _arm_values(a, metric)
                arms[a.name] = ArmSerial(a.name, a.role, passes, values, _correlation(values))
        pp = pass_pairs(treatment, control, metric)
        pt, pc = pp.treatment_values, pp.control_values
        positive = all(v > 0 for v in pt + pc)
        logs = tuple(math.log(t) - math.log(c) for t, c in zip(pt, pc)) if positive else ()
        ok = positive and len(pt) >= MIN_SERIES
        diffs = serial.paired_serial_correlation(pt, pc) if ok else None
        check = None
        if ok and len(pt) >= MIN_PAIRS_CHECKED:
            estimate = design_rho.estimate_serial_correlation(pt, pc, SERIAL_ALPHA)
            n = (min(arms[treatment.name].n, arms[control.name].n) if interval == "welch"
                 else len(pt))
            check = design_coverage.check_interval_assumptions(interval, n, estimate, cl, hac)
        ratio = (serial.hac_ratio(pt, pc, cl, hac)
                 if interval == "hac" and positive and len(pt) >= 2 else None)
        pairs.append(PairSerial(treatment.name, control.name, pp.control_passes, logs, diffs,
                                check, ratio, pp.treatment_passes, pp.rounds, pp.by))
    return SerialPasses(metric, interval, cost is not None, cl, SERIAL_ALPHA,
                        tuple(arms.values()), tuple(pairs))
