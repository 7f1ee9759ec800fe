"""The pass-to-pass coefficient of variation (CV) of an earlier run, for the design analysis
(``design.cv_from``): the pooled CV of its counted passes per arm, and, for a cost rule, the
spread and serial correlation of the pairs of passes its schedule ran side by side.

The pairs are the classifier's (:func:`pairs_from_run`): each treatment's counted passes against
the control's (the roles its registration declares), one pair per round of the schedule
(:func:`bistat.store.passes.pass_rounds`, :func:`bistat.core.pairing.pass_pairs`), of the metric
the cost rule decides on (output tokens/s or the mean request latency per pass). With several
treatments, the spread of the pairs' log differences is pooled over the comparisons
(:func:`paired_cv`) and the serial correlation is the most conservative comparison's
(:func:`serial_estimate`).

The earlier run's records are read strictly (an unreadable line is an error, not a gap: a design
planned on part of a run would mislead) and once per file version, though the CV and the run-time
estimate (:mod:`bistat.declare.design_runtime`) both read them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from bistat.core import design_rho, stats
from bistat.core.classify_inputs import ArmStats
from bistat.core.pairing import PassPairs, pass_pairs
from bistat.declare.errors import DesignError
from bistat.declare.run_registration import RunRegistrationError, run_registration
from bistat.store.format import RecordsError
from bistat.store.passes import (pass_latencies, pass_rounds, pass_states, recorded_again,
                                 schedule_order)
from bistat.store.readers import iter_jsonl_strict, load_table
from bistat.store.readers import optional_float as _opt_float
from bistat.store.run_dir import RecordedRun

__all__ = [
    "DesignError",
    "MIN_PAIRS",
    "Comparison",
    "PairedCV",
    "RunPairs",
    "cv_from_run",
    "pairs_from_run",
    "paired_cv",
    "paired_cv_from_run",
    "read_strict",
    "serial_estimate",
    "serial_from_run",
]

#: Fewest pairs of passes a comparison of the earlier run needs to plan a paired or HAC interval
#: from (the spread of their log differences).
MIN_PAIRS = 3

#: The per-pass value each metric of a cost rule reads, in words.
METRIC_WORDS = {"throughput": "output tokens/s per pass",
                "latency": "mean request latency per pass"}


def read_strict(path: Path) -> tuple[tuple[int, dict[str, Any]], ...]:
    """The records of an earlier run's JSONL file (:func:`iter_jsonl_strict`): damage is a
    :class:`DesignError` naming the file and line. One design analysis asks for ``passes.jsonl``
    three times (the CV, the paired CV, the timing): the file is read once while its size and
    modification time stay the same (the records are shared; nothing here changes them)."""
    try:
        st = path.stat()
    except OSError:
        return _read_strict_once(str(path), None, None)
    return _read_strict_once(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read_strict_once(path: str, mtime_ns: int | None, size: int | None
                      ) -> tuple[tuple[int, dict[str, Any]], ...]:
    try:
        return tuple(iter_jsonl_strict(Path(path)))
    except RecordsError as exc:
        raise DesignError(f"design.cv_from: {exc}") from None


def cv_from_run(run_dir: str | Path) -> tuple[stats.CVResult, str]:
    """Pooled pass-to-pass CV of an earlier run's counted passes, grouped by arm.

    Reads ``passes.jsonl`` (lines with ``kind == "counted"``, field ``output_tokens_per_s``,
    grouped by ``arm``); a truncated last line is ignored.

    Returns
    -------
    (stats.CVResult, str)
        The pooled CV and a description of where it came from.
    """
    path = Path(run_dir) / "passes.jsonl"
    if not path.is_file():
        raise DesignError(f"design.cv_from: {run_dir}: no passes.jsonl there; name a run "
                          "directory of an earlier run, or declare design.expected_cv instead")
    groups: dict[str, list[float]] = {}
    recs = [rec for _, rec in read_strict(path)]
    for rec in recs:
        if rec.get("kind") != "counted":
            continue
        value = rec.get("output_tokens_per_s")
        if isinstance(value, (int, float)) and value > 0:
            groups.setdefault(str(rec.get("arm")), []).append(float(value))
    try:
        res = stats.pooled_cv(list(groups.values()))
    except ValueError as exc:
        raise DesignError(f"design.cv_from: {path}: {exc}; declare design.expected_cv "
                          "instead") from exc
    n = sum(len(v) for v in groups.values())
    return res, (f"pooled from {run_dir} ({n} counted passes in {len(groups)} arms, "
                 f"{res.df} degrees of freedom)")


@dataclass(frozen=True)
class Comparison:
    """One treatment of the earlier run against its control: the classifier's pairs of passes
    (:func:`bistat.core.pairing.pass_pairs`), both values of each pair positive."""

    treatment: str
    control: str
    pairs: PassPairs

    @property
    def n(self) -> int:
        return len(self.pairs)

    @property
    def ratios(self) -> tuple[float, ...]:
        """Each pair's treatment ÷ control."""
        return tuple(t / c for t, c in zip(self.pairs.treatment_values, self.pairs.control_values))

    def label(self) -> str:
        return f"{self.treatment} ÷ {self.control}"


@dataclass(frozen=True)
class RunPairs:
    """An earlier run's passes paired as the classifier pairs them (:func:`pairs_from_run`).

    Attributes
    ----------
    run_dir : str
    metric : {"throughput", "latency"}
        The per-pass metric paired (:data:`METRIC_WORDS`).
    control : str or None
        The control arm (None when no arm could be taken as it).
    comparisons : tuple of Comparison
        Each treatment against the control, in the registration's arm order, with
        :data:`MIN_PAIRS` pairs or more.
    arm_values : mapping
        Arm -> the metric's positive values of its counted passes, in schedule order (the
        registered arms, every arm recorded without the registration): a Welch interval's
        pooled per-arm CV of the metric.
    roles_from : str
        Where the roles came from: ``"registration"``, or why it could not say (the two arms of
        a run whose registration is not here are paired all the same: a log difference's spread
        and serial correlation do not depend on which arm is the control).
    unpaired : str or None
        Why no comparison plans the cost (None when one does).
    """

    run_dir: str
    metric: str
    control: str | None
    comparisons: tuple[Comparison, ...]
    arm_values: Mapping[str, tuple[float, ...]]
    roles_from: str
    unpaired: str | None = None

    @property
    def n(self) -> int:
        """Pairs of passes over all comparisons."""
        return sum(c.n for c in self.comparisons)

    def describe(self) -> str:
        """Which passes were paired, in words (for the design's CV source)."""
        comps = self.comparisons
        by = {c.pairs.by for c in comps}
        how = ("one pair per round of its schedule" if by == {"round"} else
               "paired by " + " and ".join(sorted(by)))
        what = f"{self.n} pairs of passes of {self.run_dir} ({METRIC_WORDS[self.metric]}, {how}"
        if self.roles_from != "registration":
            return (f"{what}: {comps[0].label()}; which arm is the control is not known here "
                    f"({self.roles_from}), and the spread of a pair's log difference does not "
                    "depend on it)")
        if len(comps) == 1:
            return f"{what}: {comps[0].label()})"
        return (f"{what}: each treatment against the control {self.control}, "
                + ", ".join(f"{c.treatment} {c.n}" for c in comps) + ")")


def _roles(run_dir: Path, base_dir: Path | None) -> tuple[dict[str, str] | None, str]:
    """The arms' roles as the earlier run's registration declares them, or None and why not.

    The registration is the one ``run.json`` names, found as the analysis finds it
    (:func:`bistat.declare.run_registration.run_registration`: from the working directory, then
    from the run directory), else under ``base_dir`` (where ``design.cv_from`` is relative to)
    or a folder above the run directory (where ``bistat run`` started, as a rule) with the seal
    the run recorded."""
    try:
        run = RecordedRun.open(run_dir)
    except RecordsError as exc:
        return None, str(exc)
    try:
        found = run_registration(run)
    except RunRegistrationError as exc:
        named = (run.header.get("registration") or {}).get("path")
        if exc.reason != "not found" or not isinstance(named, str) or Path(named).is_absolute():
            return None, str(exc).splitlines()[0]
        above = [] if base_dir is None else [Path(base_dir)]
        for folder in [*above, *Path(run_dir).resolve().parents]:
            try:
                again = run_registration(run, folder / named) if (folder / named).is_file() \
                    else None
            except RunRegistrationError:
                again = None
            if again is not None and (again.is_recorded_seal or again.recorded_earlier_seal):
                found = again
                break
        else:
            return None, str(exc).splitlines()[0]
    arms = found.registration.declaration.get("arms") or []
    return {str(a["name"]): str(a["role"]) for a in arms}, "registration"


def _table(run_dir: Path, table: str, columns: list[str] | None = None) -> pd.DataFrame:
    """One table of the earlier run, strictly: a gap is an error but a truncated last line (a
    run stopped while writing it), as :func:`read_strict` reads."""
    try:
        read = load_table(run_dir, table, columns)
    except RecordsError as exc:
        raise DesignError(f"design.cv_from: {exc}") from None
    damage = [g for g in read.gaps if "truncated line" not in g]
    if damage:
        raise DesignError(f"design.cv_from: {run_dir}: " + "; ".join(damage))
    return read.frame


def _arm_stats(run_dir: Path, arms: set[str] | None, metric: str) -> dict[str, ArmStats]:
    """Each arm's counted passes as the classifier takes them (``bistat.analysis``'s phases 2
    and 3): which passes count and their rounds (:func:`bistat.store.passes.pass_rounds`), the
    output tokens/s of each pass's record, the mean request latency of its last recorded
    responses (:func:`bistat.store.passes.pass_latencies`). ``arms``: the registered arms (None:
    every arm recorded)."""
    passes = _table(run_dir, "passes")
    schedule = _table(run_dir, "schedule")
    timed = ["prompt_id", "error", "t_submit", "t_done"] if metric == "latency" else []
    responses = _table(run_dir, "responses", ["arm", "kind", "pass_index", *timed])
    counted_rows = responses[responses["kind"] == "counted"]
    with_responses = {(str(a), int(p)) for a, p in zip(counted_rows["arm"],
                                                       counted_rows["pass_index"])}
    states = pass_states(passes, schedule, with_responses)
    order = schedule_order(passes, schedule, states)
    if arms is None:
        arms = {arm for arm, _ in states}
    rounds = pass_rounds(order, states, arms)
    out: dict[str, ArmStats] = {}
    if metric == "throughput":
        value: dict[tuple[str, int], float | None] = {}
        keyed = not passes.empty and {"arm", "pass_index"} <= set(passes.columns)
        for rec in passes.to_dict("records") if keyed else []:
            value[(str(rec["arm"]), int(rec["pass_index"]))] = _opt_float(
                rec.get("output_tokens_per_s"))
        for arm in sorted(arms):
            timed = [(k[1], rounds[k], value.get(k)) for k in order if k in rounds and k[0] == arm]
            timed = [(p, r, v) for p, r, v in timed
                     if v is not None and math.isfinite(v) and v > 0]
            out[arm] = ArmStats(arm, "", 0, 0, tuple(v for _, _, v in timed),
                                throughput_passes=tuple(p for p, _, _ in timed),
                                throughput_rounds=tuple(r for _, r, _ in timed))
        return out
    arm_passes = {arm: sorted(p for a, p in rounds if a == arm) for arm in sorted(arms)}
    dup = recorded_again(counted_rows) if not counted_rows.empty else None
    timed_lat = pass_latencies(counted_rows if dup is None else counted_rows[~dup], arm_passes)
    for arm in sorted(arms):
        pv = timed_lat.get(arm, ())
        out[arm] = ArmStats(arm, "", 0, 0, (), pass_latencies=tuple(v for _, v in pv),
                            latency_passes=tuple(p for p, _ in pv),
                            latency_rounds=tuple(rounds[(arm, p)] for p, _ in pv))
    return out


@functools.lru_cache(maxsize=8)
def _pairs_once(run_dir: str, metric: str, base_dir: str | None, stamp: tuple) -> RunPairs:
    path = Path(run_dir)
    roles, roles_from = _roles(path, None if base_dir is None else Path(base_dir))
    stats_by_arm = _arm_stats(path, None if roles is None else set(roles), metric)
    key = "pass_throughputs" if metric == "throughput" else "pass_latencies"
    values = {arm: tuple(getattr(a, key)) for arm, a in stats_by_arm.items()}

    def unpaired(why: str, control: str | None = None) -> RunPairs:
        return RunPairs(run_dir, metric, control, (), values, roles_from, why)

    recorded = sorted(a for a, v in values.items() if v)
    if not recorded:
        return unpaired(f"no counted pass of it has a {METRIC_WORDS[metric]} (a pass counts "
                        "once its end is in the schedule's records)")
    if roles is not None:
        control = next((a for a, r in roles.items() if r == "control"), None)
        treatments = [a for a, r in roles.items() if r == "treatment"]
        if control is None or not treatments:
            return unpaired("its registration declares no control and treatment to pair")
    else:
        if len(recorded) != 2:
            return unpaired(f"its {len(recorded)} arms cannot be paired without knowing which "
                            f"is the control, and its registration is not found ({roles_from})")
        treatments, control = recorded[:1], recorded[1]
    comparisons = []
    for treat in treatments:
        pairs = pass_pairs(stats_by_arm[treat], stats_by_arm[control], metric)
        if len(pairs) >= MIN_PAIRS:
            comparisons.append(Comparison(treat, control, pairs))
    if not comparisons:
        return unpaired(f"no treatment has {MIN_PAIRS} or more counted passes paired with the "
                        f"control {control}'s (one per round of the schedule, each with a "
                        f"{METRIC_WORDS[metric]})", control)
    return RunPairs(run_dir, metric, control, tuple(comparisons), values, roles_from)


def _stamp(run_dir: Path) -> tuple:
    """What the cached pairs of a run depend on: its tables' files as they are now."""
    out = []
    for name in ("run.json", "passes.jsonl", "passes.parquet", "schedule.jsonl",
                 "schedule.parquet", "responses.jsonl", "responses.parquet"):
        try:
            st = (run_dir / name).stat()
            out.append((name, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((name, None, None))
    return tuple(out)


def pairs_from_run(run_dir: str | Path, metric: str = "throughput", *,
                   base_dir: str | Path | None = None) -> RunPairs:
    """An earlier run's counted passes paired as the classifier pairs them, for a cost rule on
    ``metric`` (``"throughput"``: output tokens/s per pass; ``"latency"``: the mean request
    latency per pass).

    Each treatment is paired with the control (the roles of the run's registration): its and
    the control's counted pass of one round of the schedule make a pair
    (:func:`bistat.core.pairing.pass_pairs`, the rounds of
    :func:`bistat.store.passes.pass_rounds`), in schedule order; a run whose counted passes
    have no rounds is paired as the classifier pairs such arms. Without its registration (not
    here, or not verifying) a run of two arms is still paired, in name order, the second as the
    control (a log difference's spread and serial correlation do not depend on its sign); one of
    three or more arms is not.
    :attr:`RunPairs.unpaired` says why no comparison has :data:`MIN_PAIRS` pairs or more.
    ``base_dir``: where ``design.cv_from`` is relative to, where the registration is looked for
    last.
    """
    if metric not in METRIC_WORDS:
        raise ValueError(f"metric must be 'throughput' or 'latency', got {metric!r}")
    path = Path(run_dir)
    return _pairs_once(str(run_dir), metric, None if base_dir is None else str(base_dir),
                       _stamp(path))


@dataclass(frozen=True)
class PairedCV:
    """The per-arm CV that plans a paired or HAC interval (:func:`paired_cv`): ``sd_log_diff``
    the standard deviation of the pairs' log differences (pooled over the comparisons, each
    about its own mean, with ``df`` degrees of freedom), ``cv`` the CV of a lognormal whose log
    SD is ``sd_log_diff / sqrt(2)``."""

    cv: float
    sd_log_diff: float
    df: int
    pairs: RunPairs


def paired_cv(pairs: RunPairs) -> PairedCV | None:
    """The per-pass CV that plans a paired or HAC cost interval from an earlier run's pairs
    (:func:`pairs_from_run`), None when it has none.

    The standard deviation of the pairs' log differences ``log treatment - log control``: with
    several treatments, pooled over the comparisons, each about its own mean (the pooled
    variance :func:`bistat.core.stats.pooled_cv` takes, one group per comparison, ``sum(n_i -
    1)`` degrees of freedom; the comparisons share the control's passes, so these overstate the
    independent information, but the estimate of a common spread is unbiased). Over ``sqrt(2)``,
    as a CV (``sqrt(expm1(s**2))``, the inverse of :func:`bistat.core.design.log_sd_from_cv`):
    the per-arm CV at which two independent arms' passes would differ as much, which is what the
    paired planning of :func:`bistat.core.design.cost_outcome_probabilities` takes (with the
    paired t's ``n - 1`` degrees of freedom)."""
    if not pairs.comparisons:
        return None
    pooled = stats.pooled_cv([c.ratios for c in pairs.comparisons])
    sd = pooled.sd_log
    return PairedCV(math.sqrt(math.expm1((sd / math.sqrt(2.0)) ** 2)), sd, pooled.df, pairs)


def paired_cv_from_run(run_dir: str | Path, metric: str = "throughput", *,
                       base_dir: str | Path | None = None) -> tuple[float, str] | None:
    """:func:`paired_cv` of :func:`pairs_from_run`, with where it came from in words; None when
    the run has no pairs to plan from."""
    pcv = paired_cv(pairs_from_run(run_dir, metric, base_dir=base_dir))
    if pcv is None:
        return None
    spread = (f"the SD of their log differences {pcv.sd_log_diff:.4f}"
              if len(pcv.pairs.comparisons) == 1 else
              f"the SD of their log differences pooled over the {len(pcv.pairs.comparisons)} "
              f"comparisons (each about its own mean, {pcv.df} degrees of freedom) "
              f"{pcv.sd_log_diff:.4f}")
    return pcv.cv, f"{pcv.pairs.describe()}, {spread} over sqrt(2), as a CV: {pcv.cv:.4f}"


def serial_estimate(pairs: RunPairs, interval: str = "hac"
                    ) -> tuple[design_rho.SerialEstimate, Comparison] | None:
    """The serial correlation to plan and check a cost interval at, from an earlier run's pairs
    (:func:`pairs_from_run`), and the comparison it is of.

    Each comparison of :data:`bistat.core.design.MIN_PAIRS_TO_CHECK` pairs or more is estimated
    (:func:`bistat.core.design.estimate_serial_correlation`: each arm's lag-1 autocorrelation
    and the pairs' log differences', bias-corrected, in schedule order), and the most
    conservative for ``interval`` is taken: the largest autocorrelation of the pairs'
    differences for a paired or HAC interval (it widens the HAC interval, and takes coverage
    from the paired one), of an arm's passes for Welch's (:attr:`SerialEstimate.rho_arms`); the
    first such in the registration's arm order on a tie. None when no comparison has that many
    pairs."""
    found = [(design_rho.estimate_serial_correlation(c.pairs.treatment_values,
                                                     c.pairs.control_values), c)
             for c in pairs.comparisons if c.n >= design_rho.MIN_PAIRS_TO_CHECK]
    if not found:
        return None
    key = (lambda f: f[0].rho_arms) if interval == "welch" else (lambda f: f[0].rho)
    return max(found, key=key)


def serial_from_run(run_dir: str | Path, metric: str = "throughput", interval: str = "hac", *,
                    base_dir: str | Path | None = None
                    ) -> tuple[design_rho.SerialEstimate, Comparison] | None:
    """:func:`serial_estimate` of :func:`pairs_from_run`."""
    return serial_estimate(pairs_from_run(run_dir, metric, base_dir=base_dir), interval)
