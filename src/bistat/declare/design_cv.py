"""The pass-to-pass coefficient of variation (CV) of an earlier run, for the design analysis
(``design.cv_from``): the pooled CV of its counted passes per arm, and the spread and serial
correlation of the pairs of passes the schedule ran side by side (for a cost rule's paired or HAC
interval).

The earlier run's records are read strictly (an unreadable line is an error, not a gap: a design
planned on part of a run would mislead) and once per file version, though the CV and the run-time
estimate (:mod:`bistat.declare.design_runtime`) both read them.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat.core import design_rho, stats
from bistat.declare.errors import DesignError
from bistat.store.format import RecordsError
from bistat.store.readers import iter_jsonl_strict

__all__ = [
    "DesignError",
    "RunPairs",
    "cv_from_run",
    "pairs_from_run",
    "paired_cv_from_run",
    "read_strict",
    "serial_from_run",
]


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
class RunPairs:
    """An earlier run's passes paired by pass index (:func:`pairs_from_run`): ``arms`` its two
    arms (by name), ``passes`` the pass indices both have, in pass order, and ``first``,
    ``second`` each arm's output tokens/s of those passes."""

    run_dir: str
    arms: tuple[str, str]
    passes: tuple[int, ...]
    first: tuple[float, ...]
    second: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.passes)


def pairs_from_run(run_dir: str | Path) -> RunPairs | None:
    """An earlier run's counted, complete passes paired by pass index across its two arms, in
    pass order (``passes.jsonl``: ``arm``, ``pass_index``, ``output_tokens_per_s``): the pairs
    a paired or HAC cost interval reads, and whose serial correlation plans it. None when the
    run does not have exactly two arms with three or more passes of the same index."""
    path = Path(run_dir) / "passes.jsonl"
    by_arm: dict[str, dict[int, float]] = {}
    for _, rec in read_strict(path):
        value, index = rec.get("output_tokens_per_s"), rec.get("pass_index")
        if (rec.get("kind") == "counted" and rec.get("status", "complete") == "complete"
                and isinstance(value, (int, float)) and value > 0 and isinstance(index, int)):
            by_arm.setdefault(str(rec.get("arm")), {})[index] = float(value)
    if len(by_arm) != 2:
        return None
    (a, va), (b, vb) = sorted(by_arm.items())
    common = tuple(sorted(set(va) & set(vb)))
    if len(common) < 3:
        return None
    return RunPairs(str(run_dir), (a, b), common, tuple(va[k] for k in common),
                    tuple(vb[k] for k in common))


def paired_cv_from_run(run_dir: str | Path) -> tuple[float, str] | None:
    """The per-pass CV that plans a paired cost interval (``[rule.cost] interval = "paired"``),
    from an earlier run of two arms: the standard deviation of the log differences of its passes
    paired by pass index (:func:`pairs_from_run`), over ``sqrt(2)``, as a CV
    (``sqrt(expm1(s**2))``, the inverse of :func:`bistat.core.design.log_sd_from_cv`): the
    per-arm CV at which two independent arms' passes would differ as much, which is what the
    paired planning of :func:`bistat.core.design.cost_outcome_probabilities` takes (with the
    paired t's ``n - 1`` degrees of freedom). None when the run does not have exactly two arms
    with three or more passes of the same index."""
    pairs = pairs_from_run(run_dir)
    if pairs is None:
        return None
    diffs = [math.log(x) - math.log(y) for x, y in zip(pairs.first, pairs.second)]
    sd = statistics.stdev(diffs)
    cv = math.sqrt(math.expm1((sd / math.sqrt(2.0)) ** 2))
    a, b = pairs.arms
    return cv, (f"{pairs.n} pass pairs of {run_dir} ({a} / {b}), the SD of their log "
                f"differences {sd:.4f} over sqrt(2), as a CV: {cv:.4f}")


def serial_from_run(run_dir: str | Path) -> tuple[design_rho.SerialEstimate, RunPairs] | None:
    """The serial correlation of an earlier run's pairs of passes, to plan a cost interval at
    (:func:`bistat.core.design.estimate_serial_correlation` of :func:`pairs_from_run`'s pairs:
    each arm's lag-1 autocorrelation and the pairs' log differences', bias-corrected). None when
    the run has no pairs (:func:`pairs_from_run`) or fewer than
    :data:`bistat.core.design.MIN_PAIRS_TO_CHECK`, too few to estimate it from."""
    pairs = pairs_from_run(run_dir)
    if pairs is None or pairs.n < design_rho.MIN_PAIRS_TO_CHECK:
        return None
    return design_rho.estimate_serial_correlation(pairs.first, pairs.second), pairs
