"""Classify published summary numbers by a registered rule (``bistat classify``).

A paper reports matched / compared prompts per arm and a throughput ratio, perhaps with its
interval; it does not publish its passes. :func:`classify_summary` applies a declaration's (or a
registration's) sealed rule to exactly those numbers through :func:`bistat.core.classify.classify`,
standing the published ratio in for the per-pass throughputs (:class:`bistat.core.classify.RatioSummary`)
instead of inventing passes. What the numbers cannot decide is *not evaluable* and says so: a
ratio interval that was not published, TOST (it needs per-pass values), McNemar without the
discordant counts, the probe and the engine log.

The published protocol's seed 003 -- 78/541 prompts identical without the mode, 541/541 with it,
throughput ratio 0.979 -- is *reported as observed* by its rule
(``bistat classify experiments/published-protocol.toml --arm default=78/541
--arm batch-invariant=541/541 --ratio 0.979``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bistat.core import stats
from bistat.core.classify import ArmStats, PairedCounts, RatioSummary, Verdict, classify
from bistat.declare.experiment import Experiment

__all__ = ["SummaryError", "PublishedComparison", "parse_named", "parse_counts",
           "classify_summary"]


class SummaryError(ValueError):
    """Published numbers that cannot be classified (an unknown arm, a malformed count...)."""


@dataclass(frozen=True)
class PublishedComparison:
    """One treatment against the control, from published numbers, and its verdict."""

    treatment: str
    control: str
    verdict: Verdict


_COUNT = re.compile(r"^(?P<k>\d+)/(?P<n>\d+)$")


def parse_named(values: Sequence[str], option: str, treatments: Sequence[str]
                ) -> dict[str, str]:
    """``NAME=VALUE`` items of a repeatable option as {arm: value}; a bare ``VALUE`` names the
    only treatment."""
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep:
            if len(treatments) != 1:
                raise SummaryError(f"{option} {item!r}: name the treatment arm (NAME=VALUE); "
                                   f"the declaration has {len(treatments)}: "
                                   + ", ".join(treatments))
            name, value = treatments[0], item
        if name not in treatments:
            raise SummaryError(f"{option} {item!r}: {name!r} is not a treatment arm of the "
                               f"declaration; expected one of " + ", ".join(treatments))
        if name in out:
            raise SummaryError(f"{option}: arm {name!r} is given twice")
        out[name] = value
    return out


def parse_counts(values: Sequence[str], arms: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``--arm NAME=K/N`` items as {arm: (matched, compared)}."""
    out: dict[str, tuple[int, int]] = {}
    for item in values:
        name, sep, value = item.partition("=")
        m = _COUNT.match(value.strip())
        if not sep or m is None:
            raise SummaryError(f"--arm {item!r}: expected NAME=K/N, the prompts matched and "
                               "compared, e.g. default=78/541")
        if name not in arms:
            raise SummaryError(f"--arm {item!r}: {name!r} is not an arm of the declaration; "
                               "expected one of " + ", ".join(arms))
        k, n = int(m["k"]), int(m["n"])
        if n < 1 or k > n:
            raise SummaryError(f"--arm {item!r}: need 0 <= K <= N and N >= 1")
        out[name] = (k, n)
    return out


def _number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SummaryError(f"{option} {text!r}: not a number") from None
    if not value > 0:
        raise SummaryError(f"{option} {text!r}: a ratio must be > 0")
    return value


def classify_summary(exp: Experiment, counts: Mapping[str, tuple[int, int]],
                     ratios: Mapping[str, str] | None = None,
                     intervals: Mapping[str, str] | None = None,
                     discordant: Mapping[str, str] | None = None) -> list[PublishedComparison]:
    """Classify each treatment named in ``counts`` against the control by ``exp``'s rule.

    Parameters
    ----------
    exp : Experiment
        The declaration whose rule (and arm roles) apply.
    counts : mapping
        Arm -> (matched, compared) prompts; the control and at least one treatment.
    ratios, intervals, discordant : mapping, optional
        Per treatment: its throughput ratio to the control (``"0.979"``), that ratio's interval
        at the rule's confidence level (``"0.95:1.01"``), McNemar's discordant counts
        (``"B,C"``: matched only in the control, only in the treatment).

    Returns
    -------
    list of PublishedComparison
        In the declaration's arm order.
    """
    control = exp.control.name
    if control not in counts:
        raise SummaryError(f"--arm: give the control arm's counts ({control}=K/N)")
    treatments = [a.name for a in exp.treatments if a.name in counts]
    if not treatments:
        raise SummaryError("--arm: give at least one treatment arm's counts ("
                           + ", ".join(f"{a.name}=K/N" for a in exp.treatments) + ")")
    kc, nc = counts[control]
    ctl = ArmStats(control, "control", nc, kc, ())
    out = []
    for name in treatments:
        k, n = counts[name]
        point = None if not ratios or name not in ratios else _number(ratios[name], "--ratio")
        iv = None
        if intervals and name in intervals:
            low, sep, high = intervals[name].partition(":")
            if not sep:
                raise SummaryError(f"--interval {intervals[name]!r}: expected LOW:HIGH, e.g. "
                                   "0.95:1.01")
            lo, hi = _number(low, "--interval"), _number(high, "--interval")
            if not lo <= hi:
                raise SummaryError(f"--interval {intervals[name]!r}: LOW must not exceed HIGH")
            iv = stats.Interval(lo, hi, exp.rule.confidence_level, "published")
        pairs = None
        if discordant and name in discordant:
            b, sep, c = discordant[name].partition(",")
            if not sep or not (b.strip().isdigit() and c.strip().isdigit()):
                raise SummaryError(f"--discordant {discordant[name]!r}: expected B,C (prompts "
                                   "matched only in the control, only in the treatment)")
            pairs = PairedCounts(min(n, nc), int(b), int(c))
        summary = RatioSummary(point, iv) if point is not None or iv is not None else \
            RatioSummary(None)
        out.append(PublishedComparison(name, control, classify(
            exp.rule, ctl, ArmStats(name, "treatment", n, k, ()), paired=pairs, ratio=summary)))
    return out
