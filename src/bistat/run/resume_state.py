"""What a run directory's schedule says about its progress, for ``bistat run --resume`` (see
:mod:`bistat.run.runner`, "Resume"): the counted passes done per arm and the next ``seq``, block
and pass index (:func:`read_resume_state` -> :class:`ResumeState`), and the passes a resume ends
again before it plans the rest: those a killed process left open and those the run stopped on
(:func:`_close_open_passes`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bistat.run.outcome import ALL_FAILED
from bistat.store.format import utc_now
from bistat.store.readers import read_jsonl
from bistat.store.writer import RunWriter


@dataclass(frozen=True)
class ResumeState:
    """What a run directory's schedule says about progress (see :func:`read_resume_state`)."""

    done_counted: Mapping[str, int]
    next_seq: int
    next_block: int
    next_pass_index: Mapping[str, int]
    open_passes: tuple[Mapping[str, Any], ...]  # start lines without an end line
    #: the end lines of counted passes the run stopped on (every request failed): run again
    stopped_on: tuple[Mapping[str, Any], ...] = ()


def read_resume_state(run_dir: Path) -> ResumeState:
    """Progress recorded in ``schedule.jsonl`` (and engine blocks in ``environment.jsonl``)."""
    schedule, _ = read_jsonl(Path(run_dir) / "schedule.jsonl")
    environment, _ = read_jsonl(Path(run_dir) / "environment.jsonl")
    starts: dict[int, Mapping[str, Any]] = {}
    ended: set[int] = set()
    done: Counter[str] = Counter()
    next_pass: dict[str, int] = {}
    max_seq, max_block = -1, -1
    last_end: dict[int, Mapping[str, Any]] = {}
    for rec in schedule:
        seq = int(rec["seq"])
        max_seq = max(max_seq, seq)
        max_block = max(max_block, int(rec["block"]))
        next_pass[rec["arm"]] = max(next_pass.get(rec["arm"], 0), int(rec["pass_index"]) + 1)
        if rec["event"] == "start":
            starts[seq] = rec
        elif rec["event"] == "end":
            ended.add(seq)
            last_end[seq] = rec   # a resume may end a pass again (superseding it): the last counts
    stopped_on = []
    for seq, rec in sorted(last_end.items()):
        if rec["kind"] != "counted":
            continue
        if rec.get("status") == "failed" and rec.get("stopped") == ALL_FAILED:
            stopped_on.append(rec)   # the run stopped on it: run again, not kept
        elif rec.get("status") in ("complete", "failed"):
            done[rec["arm"]] += 1
    for rec in environment:
        max_block = max(max_block, int(rec["block"]))
    open_passes = tuple(rec for seq, rec in sorted(starts.items()) if seq not in ended)
    return ResumeState(
        done_counted=dict(done),
        next_seq=max_seq + 1,
        next_block=max_block + 1,
        next_pass_index=next_pass,
        open_passes=open_passes,
        stopped_on=tuple(stopped_on),
    )


def _supersede_stopped_passes(writer: RunWriter, state: ResumeState) -> None:
    """End again, ``status = "interrupted"``, each counted pass the run stopped on because every
    request of it failed: it no longer counts, and the resumed schedule runs it again in full
    (under a new ``seq`` and ``pass_index``, as an interrupted pass)."""
    for rec in state.stopped_on:
        writer.append("schedule", {
            "event": "end", "seq": rec["seq"], "arm": rec["arm"],
            "pass_index": rec["pass_index"], "kind": rec["kind"], "block": rec["block"],
            "time_utc": utc_now(), "status": "interrupted", "n_failed": rec.get("n_failed", 0),
            "detail": "superseded on resume: every request of this pass failed and the run "
                      "stopped on it; it is run again in full"})


def _close_open_passes(writer: RunWriter, state: ResumeState) -> None:
    """End passes a killed process left open: ``status = "interrupted"`` with their failures so far."""
    _supersede_stopped_passes(writer, state)
    if not state.open_passes:
        return
    responses, _ = read_jsonl(writer.run_dir / "responses.jsonl")
    failed = Counter(int(r["seq"]) for r in responses if r.get("error") is not None)
    for rec in state.open_passes:
        seq = int(rec["seq"])
        writer.append(
            "schedule",
            {
                "event": "end",
                "seq": seq,
                "arm": rec["arm"],
                "pass_index": rec["pass_index"],
                "kind": rec["kind"],
                "block": rec["block"],
                "time_utc": utc_now(),
                "status": "interrupted",
                "n_failed": failed.get(seq, 0),
                "detail": "closed on resume: the process ended during this pass",
            },
        )
