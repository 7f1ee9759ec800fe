"""What the classifier reads (pure: no I/O, no clock, no printing).

One arm's summary (:class:`ArmStats`), the two arms compared prompt by prompt
(:class:`PairedCounts`), the evidence that the treatment's mode was on
(:class:`ActivationEvidence`), a ratio published without its passes (:class:`RatioSummary`), the
declared validity checks (:class:`ValidityCheck`) and whether the run could test the hypothesis
at all (:class:`RunTestable`). ``bistat.analysis`` builds them from recorded data;
``bistat classify`` builds them from published numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from bistat.core import stat_results

__all__ = ["ActivationEvidence", "ArmStats", "PairedCounts", "RatioSummary", "RunTestable",
           "ValidityCheck"]


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
    interval: stat_results.Interval | None = None


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
