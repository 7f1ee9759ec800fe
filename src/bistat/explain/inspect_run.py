"""``bistat inspect``: what a run directory holds, its schema version, its registration, its gaps.

Read-only. Reports, per table of ``docs/CONTRACTS.md``: which file a reader would use (Parquet
or JSONL), the record count and the gaps (truncated or unreadable lines); the passes the
schedule started, how each ended, and the counted passes still missing against the
registration; failed requests per pass with their first errors; and engine events that make a
run *untested* (refusals, failed starts, exits).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat.core.failures import ErrorGroup, describe_groups, error_groups
from bistat.store.format import (
    ENGINE_LOGS_DIR,
    HEADER_FILE,
    NOTES_FILE,
    OUTPUTS_FILE,
    PROBE_FILE,
    PROBE_GLOB,
    TABLES,
)
from bistat.declare.run_registration import RunRegistrationError, run_registration
from bistat.store.run_dir import RecordedRun

__all__ = ["INSPECT_SCHEMA", "PassState", "RunInspection", "TableState", "inspect_run",
           "render_inspection"]

INSPECT_SCHEMA = "bistat.inspect/1"


@dataclass(frozen=True)
class TableState:
    table: str
    source: str            # "parquet" | "jsonl" | "absent"
    n_records: int
    gaps: tuple[str, ...]


@dataclass(frozen=True)
class PassState:
    arm: str
    pass_index: int
    seq: int | None
    kind: str | None
    status: str            # last end status, or "started, never ended"
    n_responses: int
    n_failed: int
    first_errors: tuple[str, ...]


@dataclass(frozen=True)
class RunInspection:
    run_dir: str
    schema: str
    run_id: str | None
    created_utc: str | None
    engine_kind: str | None
    command: tuple[str, ...]
    registration: Mapping[str, Any]
    registration_state: str     # "seal verified" | "not found: ..." | "seal broken: ..."
    tables: tuple[TableState, ...]
    passes: tuple[PassState, ...]
    missing: tuple[str, ...]     # declared counted passes not recorded complete
    events: tuple[str, ...]      # refused / start_failed / exited events
    extra_files: tuple[str, ...]
    #: every failed request's error, grouped (:func:`bistat.core.failures.error_groups`)
    error_groups: tuple[ErrorGroup, ...] = ()

    @property
    def gaps(self) -> tuple[str, ...]:
        return tuple(g for t in self.tables for g in t.gaps)

    @property
    def n_failed_requests(self) -> int:
        return sum(p.n_failed for p in self.passes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": INSPECT_SCHEMA, "run_dir": self.run_dir, "run_schema": self.schema,
            "run_id": self.run_id, "created_utc": self.created_utc,
            "engine_kind": self.engine_kind, "command": list(self.command),
            "registration": dict(self.registration),
            "registration_state": self.registration_state,
            "tables": [{"table": t.table, "source": t.source, "n_records": t.n_records,
                        "gaps": list(t.gaps)} for t in self.tables],
            "passes": [{"arm": p.arm, "pass_index": p.pass_index, "seq": p.seq, "kind": p.kind,
                        "status": p.status, "n_responses": p.n_responses,
                        "n_failed": p.n_failed, "first_errors": list(p.first_errors)}
                       for p in self.passes],
            "missing": list(self.missing), "events": list(self.events),
            "gaps": list(self.gaps), "n_failed_requests": self.n_failed_requests,
            "extra_files": list(self.extra_files),
            "error_groups": [{"first": g.first, "count": g.count} for g in self.error_groups],
        }


def _registration(run: RecordedRun) -> tuple[str, dict[str, Any] | None]:
    """The state of the run's registration (the one resolver, :func:`run_registration`) and
    its sealed declaration, None unless the seal verifies."""
    try:
        found = run_registration(run)
    except RunRegistrationError as exc:
        if exc.reason == "not named":
            return "not named: run.json has no registration.path", None
        if exc.reason == "not found":
            path = (run.header.get("registration") or {}).get("path")
            return (f"not found: {path} (pass the registration to `bistat analyze "
                    f"--registration`)"), None
        if exc.reason == "seal broken":
            return f"seal broken: {exc.__cause__ or exc}", None
        return f"{exc.reason}: {exc}", None
    reg = found.registration
    if not found.is_recorded_seal:
        return (f"seal differs: the run names {found.recorded_sha256}, {reg.path} is sealed as "
                f"{reg.sha256}"), reg.declaration
    return "seal verified", reg.declaration


def inspect_run(run_dir: str | Path | RecordedRun) -> RunInspection:
    """Inspect a run directory without analysing it.

    Raises
    ------
    bistat.store.format.RecordsError
        No readable ``run.json`` (not a run directory) or an unknown schema version.
    """
    run = RecordedRun.of(run_dir)
    run_dir, header = run.path, run.header
    tables = []
    frames = {}
    for table in TABLES:
        tr = run.load(table)
        frames[table] = tr.frame
        tables.append(TableState(table, tr.source, len(tr.frame), tr.gaps))
    sched, resp = frames["schedule"], frames["responses"]
    started: dict[tuple[str, int], dict[str, Any]] = {}
    ended: dict[tuple[str, int], str] = {}
    for rec in sched.to_dict("records") if len(sched) else []:
        key = (str(rec.get("arm")), int(rec.get("pass_index")))
        if rec.get("event") == "start":
            started[key] = rec
        elif rec.get("event") == "end":
            ended[key] = str(rec.get("status"))
    n_resp: Counter = Counter()
    n_fail: Counter = Counter()
    errors: dict[tuple[str, int], list[str]] = defaultdict(list)
    all_errors: list[str] = []
    if len(resp):
        for arm, p, err in zip(resp["arm"], resp["pass_index"], resp["error"]):
            key = (str(arm), int(p))
            n_resp[key] += 1
            if isinstance(err, str):
                n_fail[key] += 1
                all_errors.append(err)
                if len(errors[key]) < 3 and err not in errors[key]:
                    errors[key].append(err)
    keys = sorted(set(started) | set(n_resp),
                  key=lambda k: (started.get(k, {}).get("seq", 10**9), k))
    passes = tuple(PassState(
        arm=k[0], pass_index=k[1], seq=_int(started.get(k, {}).get("seq")),
        kind=started.get(k, {}).get("kind"),
        status=ended.get(k, "started, never ended" if k in started else "no schedule line"),
        n_responses=n_resp[k], n_failed=n_fail[k], first_errors=tuple(errors[k]))
        for k in keys)
    missing: list[str] = []
    registration_state, decl = _registration(run)
    if decl:
        wl = decl.get("workload") or {}
        declared = int(wl.get("passes") or 0)
        for arm in decl.get("arms") or []:
            name = str(arm.get("name"))
            done = sum(1 for p in passes if p.arm == name and p.kind == "counted"
                       and p.status == "complete")
            if done < declared:
                missing.append(f"arm {name}: {declared - done} of {declared} counted passes not "
                               "recorded complete")
    ev = frames["events"]
    events = tuple(f"arm {a}: {e} ({d})" for a, e, d in
                   zip(ev.get("arm", []), ev.get("event", []), ev.get("detail", []))
                   if e in ("refused", "start_failed", "exited")) if len(ev) else ()
    known = ({HEADER_FILE, OUTPUTS_FILE, ENGINE_LOGS_DIR,
              NOTES_FILE, PROBE_FILE}
             | {f"{t}.{x}" for t in TABLES for x in ("jsonl", "parquet")})
    extra = tuple(sorted(p.name for p in run_dir.iterdir()
                         if p.name not in known and not p.match(PROBE_GLOB)))
    reg = header.get("registration") if isinstance(header.get("registration"), Mapping) else {}
    return RunInspection(
        run_dir=str(run_dir), schema=str(header.get("schema")), run_id=header.get("run_id"),
        created_utc=header.get("created_utc"), engine_kind=header.get("engine_kind"),
        command=tuple(str(x) for x in header.get("command") or ()), registration=dict(reg),
        registration_state=registration_state, tables=tuple(tables),
        passes=passes, missing=tuple(missing), events=events, extra_files=extra,
        error_groups=error_groups(all_errors))


def _int(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


def render_inspection(ins: RunInspection) -> str:
    """Plain text for the terminal."""
    reg = ins.registration
    lines = [f"run {ins.run_id} ({ins.schema}) in {ins.run_dir}",
             f"created {ins.created_utc}; engine {ins.engine_kind}; command: "
             + " ".join(ins.command),
             f"registration {reg.get('name')} {reg.get('path')} sha256 {reg.get('sha256')}: "
             f"{ins.registration_state}", "tables:"]
    for t in ins.tables:
        gaps = f", {len(t.gaps)} gap(s)" if t.gaps else ""
        lines.append(f"  {t.table}: {t.n_records} record(s) from {t.source}{gaps}")
    if ins.error_groups:
        lines.append(f"failed requests: {ins.n_failed_requests}, by error (the same text but for "
                     "numbers):")
        lines += [f"  {line}" for line in describe_groups(ins.error_groups,
                                                          ins.n_failed_requests, limit=5)]
    lines.append("passes:")
    for p in ins.passes:
        failed = f", {p.n_failed} failed" if p.n_failed else ""
        lines.append(f"  seq {p.seq} {p.arm} pass {p.pass_index} ({p.kind}): {p.status}; "
                     f"{p.n_responses} response(s){failed}")
        lines += [f"    error: {e}" for e in p.first_errors]
    lines.append("gaps:" if ins.gaps or ins.missing or ins.events else "gaps: none")
    lines += [f"  {g}" for g in ins.gaps]
    lines += [f"  missing: {m}" for m in ins.missing]
    lines += [f"  event: {e}" for e in ins.events]
    if ins.extra_files:
        lines.append("other files: " + ", ".join(ins.extra_files))
    return "\n".join(lines) + "\n"
