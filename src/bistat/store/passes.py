"""Which recorded passes count: one rule for the analysis, the anatomy, diagnose and the trim.

A pass counts when it was recorded ``counted`` and ended in :data:`COUNTING_STATUSES`
(:func:`pass_counts`); its kind and end status come from the ``passes`` and ``schedule`` tables
(:func:`pass_states`). A pass with no ``end`` event never counts: the run stopped during it (a
killed process), its responses are a partial sample, and ``bistat run --resume`` closes it
``interrupted`` and runs it again in full (docs/CONTRACTS.md).

What the counted passes hold, as the analysis and the design analysis of a later declaration
(``design.cv_from``) both read it: the round of the schedule each ran in (:func:`schedule_order`,
:func:`pass_rounds`), which responses a resumed run recorded again (:func:`recorded_again`) and
each pass's mean request latency (:func:`pass_latencies`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Container, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from bistat.store.readers import read_table

__all__ = ["COUNTING_STATUSES", "pass_counts", "pass_states", "counted_passes", "counted_passes_of",
           "schedule_order", "pass_rounds", "recorded_again", "pass_latencies"]

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


def schedule_order(passes: pd.DataFrame, schedule: pd.DataFrame,
                   keys: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``keys`` (``(arm, pass_index)``) in the order the schedule ran them: by the ``seq`` of the
    pass's record (``passes``, the last one of a pass), else of its ``start`` event
    (``schedule``), passes with neither last; ties by arm and pass index."""
    pass_rows: dict[tuple[str, int], dict[str, Any]] = {}
    if not passes.empty and {"arm", "pass_index"} <= set(passes.columns):
        for rec in passes.to_dict("records"):
            pass_rows[(str(rec["arm"]), int(rec["pass_index"]))] = rec
    starts: dict[tuple[str, int], dict[str, Any]] = {}
    if not schedule.empty and {"event", "arm", "pass_index"} <= set(schedule.columns):
        for rec in schedule[schedule["event"] == "start"].to_dict("records"):
            starts[(str(rec["arm"]), int(rec["pass_index"]))] = rec
    return sorted(keys, key=lambda k: (int((pass_rows.get(k) or starts.get(k) or {"seq": 10**9})
                                           .get("seq", 10**9)), k))


def pass_rounds(order: Iterable[tuple[str, int]],
                states: Mapping[tuple[str, int], tuple[str, str | None]],
                arms: Container[str]) -> dict[tuple[str, int], int]:
    """The round of the schedule of every counted pass (``(arm, pass_index) -> round``).

    ``order``: the passes in schedule order (:func:`schedule_order`); ``states``: their kind and
    end status (:func:`pass_states`); ``arms``: the registered arms (a pass of another arm never
    counts). An arm's *k*-th counted pass in schedule order runs in round *k*, beside the other
    arms' *k*-th (:mod:`bistat.core.schedule`), however the run was interrupted and resumed: a
    resume plans only the rounds an arm has not completed, and gives its passes new indices, so
    rounds, not pass indices, pair the arms' passes (:func:`bistat.core.pairing.pass_pairs`).
    """
    done: dict[str, int] = {}   # arm -> its counted passes so far
    out: dict[tuple[str, int], int] = {}
    for arm, pidx in order:
        kind, end = states[(arm, pidx)]
        if arm in arms and pass_counts(kind, end):
            out[(arm, pidx)] = done.get(arm, 0)
            done[arm] = out[(arm, pidx)] + 1
    return out


def recorded_again(responses: pd.DataFrame) -> np.ndarray:
    """Which rows of ``responses`` (columns ``arm``, ``pass_index``, ``prompt_id``) are recorded
    again later for the same arm, pass and prompt (a resumed run): the last recorded counts, the
    rows marked True do not."""
    prompt_codes, prompt_ids = pd.factorize(responses["prompt_id"], sort=True)
    arm_codes, _ = pd.factorize(responses["arm"])
    pass_idx = responses["pass_index"].to_numpy(dtype=np.int64)
    row_key = ((arm_codes.astype(np.int64) * (int(pass_idx.max(initial=0)) + 1) + pass_idx)
               * (len(prompt_ids) + 1) + prompt_codes)
    return pd.Series(row_key).duplicated(keep="last").to_numpy()


def pass_latencies(counted: pd.DataFrame, arm_passes: Mapping[str, Sequence[int]]
                    ) -> dict[str, tuple[tuple[int, float], ...]]:
    """Arm -> (pass index, mean request latency) of each counted pass (``t_done - t_submit``,
    seconds, over its answered requests), in pass order: what a cost rule on ``latency`` reads.
    ``counted``: the counted responses, the last recorded per prompt and pass
    (:func:`recorded_again`). A pass without a timed answered request is left out."""
    if counted.empty or not {"t_submit", "t_done"} <= set(counted.columns):
        return {}
    frame = counted[["arm", "pass_index", "error", "t_submit", "t_done"]].copy()
    frame = frame[frame["error"].isna()]
    frame["latency"] = (pd.to_numeric(frame["t_done"], errors="coerce")
                        - pd.to_numeric(frame["t_submit"], errors="coerce"))
    frame = frame[frame["latency"].notna()]
    means = frame.groupby(["arm", "pass_index"], sort=True)["latency"].mean()
    out: dict[str, tuple[tuple[int, float], ...]] = {}
    for arm, plist in arm_passes.items():
        vals = [(int(p), float(means[(arm, p)])) for p in sorted(plist)
                if (arm, p) in means.index]
        out[arm] = tuple((p, v) for p, v in vals if v > 0)
    return out
