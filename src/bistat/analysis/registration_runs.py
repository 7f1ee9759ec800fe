"""Every run of a registration, for its finding: pre-registration means nothing if a study can be
run until its result looks good and only that run reported.

The runs are those recorded under the registration the analysed run was recorded under that its
run ledger (``preregistrations/.NAME.runs``, appended by ``bistat run`` as each run starts:
:func:`bistat.declare.prereg.ledger_entries`) and the analysed run's own folder (its sibling
directories: a data folder of committed runs) know. Each is listed with its id, when it was
created, how much of the declared schedule it recorded and its verdict under the rule the finding
analyses (each other run analysed as ``bistat analyze`` would, without listing its own runs); a
directory the ledger lists that is gone is listed too, as gone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from bistat.analysis.results import AnalysisError, RegistrationRun
from bistat.declare.registration import Registration, RegistrationError
from bistat.declare.run_ledger import find_recorded_runs, ledger_entries
from bistat.store.format import RecordsError

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment

__all__ = ["RegistrationRun", "recorded_state", "registration_runs", "verdict_text"]


def verdict_text(comparisons: Sequence[Any]) -> str:
    """``working (invariant vs blas); doubtful (fa3 vs blas)``; ``—`` without comparisons."""
    return "; ".join(f"{c.verdict.label.value} ({c.treatment} vs {c.control})"
                     for c in comparisons) or "—"


def recorded_state(counted: Mapping[str, Sequence[int]], exp: "Experiment",
                   events: Sequence[str] = ()) -> tuple[str, bool]:
    """How much of ``exp``'s schedule a run recorded, from its counted passes per arm, and
    whether that is all of it; ``events``: its engines' refusals and failed starts."""
    declared = exp.workload.passes
    n = {a.name: len(counted.get(a.name, ())) for a in exp.arms}
    if not any(n.values()):
        why = f": {events[0]}" if events else ""
        return f"no counted pass recorded{why}", False
    if all(v >= declared for v in n.values()):
        return f"complete ({declared} of {declared} counted passes per arm)", True
    return ("stopped early (" + ", ".join(f"{a} {v}" for a, v in n.items())
            + f" of {declared} counted passes)"), False


def _engine_failures(run_dir: Path) -> list[str]:
    from bistat.store.readers import read_table

    try:
        ev = read_table(run_dir, "events", ["arm", "event"])
    except RecordsError:
        return []
    if ev.empty:
        return []
    return [f"engine {e.replace('_', ' ')} (arm {a})" for a, e in zip(ev["arm"], ev["event"])
            if e in ("refused", "start_failed")]


def registration_runs(run_dir: Path, run_id: str, created_utc: str | None,
                      recorded: Registration, exp: "Experiment",
                      this_state: tuple[str, bool], this_verdict: str,
                      analyse: Callable[[Path], Any], *,
                      run_ledger: bool = True) -> tuple[RegistrationRun, ...]:
    """The runs of ``recorded`` (the registration ``run_dir`` was recorded under) that its run
    ledger and ``run_dir``'s folder know, ``run_dir`` included (with ``this_state`` and
    ``this_verdict``), ordered by creation time; ``analyse(path)`` gives another run's summary
    under the finding's rule (its failure is stated as the verdict). ``run_ledger=False``: the
    folder's alone, the ledger (a file of this machine's) unread."""
    from bistat.declare.errors import DeclarationError
    from bistat.store.passes import counted_passes
    from bistat.store.run_dir import RecordedRun

    here = run_dir.resolve()
    found: dict[Path, tuple[Path, set[str]]] = {here: (run_dir, {"this run"})}
    for d in find_recorded_runs(recorded, [run_dir.parent]):
        if d.resolve() != run_dir.parent.resolve():
            found.setdefault(d.resolve(), (d, set()))[1].add("its folder")
    gone: list[RegistrationRun] = []
    for d, still in (ledger_entries(recorded) if run_ledger else ()):
        if still:
            found.setdefault(d.resolve(), (d, set()))[1].add("the run ledger")
        elif d.resolve() not in found:
            gone.append(RegistrationRun(d.name, None, "directory gone (listed in the run "
                                        "ledger)", False, "—", False, "the run ledger"))
    out = []
    for key, (d, where) in found.items():
        found_in = "this run" if key == here else "; ".join(sorted(where))
        if key == here:
            out.append(RegistrationRun(run_id, created_utc, this_state[0], this_state[1],
                                       this_verdict, True, found_in))
            continue
        try:
            other = RecordedRun.open(d)
            state = recorded_state(counted_passes(d), exp, _engine_failures(d))
            try:
                verdict = verdict_text(analyse(d).comparisons)
            except (AnalysisError, RecordsError, RegistrationError, DeclarationError,
                    ValueError) as exc:
                verdict = "not analysed: " + (str(exc).splitlines() or [""])[0][:200]
            out.append(RegistrationRun(other.run_id, other.header.get("created_utc"), state[0],
                                       state[1], verdict, False, found_in))
        except RecordsError as exc:
            out.append(RegistrationRun(d.name, None, f"unreadable ({str(exc)[:120]})", False,
                                       "—", False, found_in))
    out.sort(key=lambda r: (r.created_utc is None, r.created_utc or "", r.run_id))
    return tuple(out + gone)

