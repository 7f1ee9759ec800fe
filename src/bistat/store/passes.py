"""Which recorded passes count: one rule for the analysis, the anatomy, diagnose and the trim.

A pass counts when it was recorded ``counted`` and ended in :data:`COUNTING_STATUSES`
(:func:`pass_counts`); its kind and end status come from the ``passes`` and ``schedule`` tables
(:func:`pass_states`). A pass with no ``end`` event never counts: the run stopped during it (a
killed process), its responses are a partial sample, and ``bistat run --resume`` closes it
``interrupted`` and runs it again in full (docs/CONTRACTS.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from bistat.store.readers import read_table

__all__ = ["COUNTING_STATUSES", "pass_counts", "pass_states", "counted_passes", "counted_passes_of"]

#: How a ``counted`` pass may end (its last ``end`` event in ``schedule``) and still count:
#: ``failed`` = it ran to its end with some requests failed (their prompts are excluded from
#: matching); ``interrupted`` passes were re-run in full and do not count.
COUNTING_STATUSES = ("complete", "failed")


def pass_counts(kind: str | None, status: str | None) -> bool:
    """Whether a pass counts: recorded ``counted`` and ended in :data:`COUNTING_STATUSES`. A pass
    with no ``end`` event (``status`` None) is unfinished and never counts, whatever responses it
    recorded."""
    return kind == "counted" and status in COUNTING_STATUSES


def _field(value: Any) -> str | None:
    """A string field as recorded: None when missing (pandas reads NaN / NA) or empty."""
    return value if isinstance(value, str) and value else None


def pass_states(passes: pd.DataFrame, schedule: pd.DataFrame,
                with_responses: set[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, str | None]]:
    """``(kind, status)`` of every pass the records mention, by ``(arm, pass_index)``.

    The kind is the pass record's (``passes``), else its ``start`` event's (``schedule``), else
    ``counted`` when it has counted responses (``with_responses``), else ``unknown``; the status
    is its last ``end`` event's (``no status`` when that has none), or None without an ``end``
    event. :func:`pass_counts` of the two says whether it counts.
    """
    pass_kind: dict[tuple[str, int], str | None] = {}
    if not passes.empty and {"arm", "pass_index"} <= set(passes.columns):
        for rec in passes.to_dict("records"):
            pass_kind[(str(rec.get("arm")), int(rec.get("pass_index")))] = _field(rec.get("kind"))
    start_kind: dict[tuple[str, int], str | None] = {}
    status: dict[tuple[str, int], str] = {}
    if not schedule.empty and {"event", "arm", "pass_index"} <= set(schedule.columns):
        for rec in schedule.to_dict("records"):
            key = (str(rec.get("arm")), int(rec.get("pass_index")))
            if rec.get("event") == "end":
                status[key] = _field(rec.get("status")) or "no status"
            elif rec.get("event") == "start":
                start_kind[key] = _field(rec.get("kind"))
    return {key: (pass_kind.get(key) or start_kind.get(key)
                  or ("counted" if key in with_responses else "unknown"), status.get(key))
            for key in set(pass_kind) | set(start_kind) | with_responses | set(status)}


def counted_passes(run_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Counted passes per arm (:func:`pass_states`, :func:`pass_counts`), as ``bistat.analysis.summary``
    counts them (which also leaves out arms its registration does not declare)."""
    run_dir = Path(run_dir)
    return counted_passes_of(read_table(run_dir, "responses", ["arm", "pass_index", "kind"]),
                             read_table(run_dir, "passes"), read_table(run_dir, "schedule"))


def counted_passes_of(responses: pd.DataFrame, passes: pd.DataFrame,
                      schedule: pd.DataFrame) -> dict[str, list[int]]:
    """:func:`counted_passes` from the tables as read (``responses``: ``arm``, ``pass_index``
    and ``kind`` at least; ``passes`` and ``schedule`` whole)."""
    resp = responses[responses["kind"] == "counted"]
    with_responses = {(str(a), int(p)) for a, p in zip(resp["arm"], resp["pass_index"])}
    out: dict[str, set[int]] = {}
    states = pass_states(passes, schedule, with_responses)
    for key, (kind, status) in states.items():
        if pass_counts(kind, status):
            out.setdefault(key[0], set()).add(key[1])
    return {arm: sorted(ps) for arm, ps in sorted(out.items())}
