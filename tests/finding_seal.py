"""Regenerating a committed finding where git history may differ from the clone it was made in.

A finding's ``Seal: ...`` line (bistat.report.seal) is computed from the repository the run is
analysed in. The committed findings are generated in a full clone, so theirs names the commit
that first holds each registration. CI may run on a shallow clone (``actions/checkout`` fetches
one commit) or a tarball, which cannot see that commit. :func:`assert_regenerates` therefore
compares every other byte exactly and, for the seal line, accepts only:

* in a full clone: the committed line, byte for byte;
* in a shallow clone: the committed line (the history reaches far enough) or the shallow form;
* outside a git checkout: the "not a git checkout" form.

It also checks that the committed line names a commit (committed findings carry git evidence).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bistat.analysis.summary import RunSummary
from bistat.report.finding import write_finding
from bistat.declare.prereg import GitEvidence
from bistat.report.seal import SEAL_PREFIX, SealEvidence, run_seal_evidence

ROOT = Path(__file__).resolve().parents[1]

#: a committed line: the first commit holding the registration, before or after the first record
COMMITTED = re.compile(re.escape(SEAL_PREFIX) + r"git: first committed in [0-9a-f]{40} at "
                       r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ, (before|after) the run's first record ")


def clone_kind(root: Path = ROOT) -> str:
    """``"full"``, ``"shallow"`` (``git rev-parse --is-shallow-repository``) or ``"none"``."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-shallow-repository"],
                              capture_output=True, text=True, check=False)
    except OSError:
        return "none"
    if proc.returncode != 0:
        return "none"
    return "shallow" if proc.stdout.strip() == "true" else "full"


def split_seal(text: str) -> tuple[str, str]:
    """(the one seal line, the text with that line's bytes replaced by a marker)."""
    lines = text.split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith(SEAL_PREFIX)]
    assert len(at) == 1, f"expected exactly one line starting {SEAL_PREFIX!r}, found {len(at)}"
    line = lines[at[0]]
    lines[at[0]] = "<seal line>"
    return line, "\n".join(lines)


def allowed_here(kind: str) -> str | None:
    """The seal line a clone of this kind states for an unsigned registration when it cannot
    see the commit (test_seal_evidence checks these forms word for word)."""
    status = {"shallow": "shallow", "none": "none"}.get(kind)
    return None if status is None else SealEvidence("", GitEvidence(status), None).line()


def assert_same_finding(fresh: str, committed: str, name: str, kind: str | None = None) -> None:
    """``fresh`` (regenerated here) equals ``committed`` but for the seal line, which is one of
    the forms this clone (``kind``, default :func:`clone_kind`) may state."""
    kind = kind or clone_kind()
    fresh_line, fresh_rest = split_seal(fresh)
    committed_line, committed_rest = split_seal(committed)
    assert fresh_rest == committed_rest, f"{name}: stale; run bash scripts/regenerate_findings.sh"
    assert COMMITTED.match(committed_line), (
        f"{name}: the committed seal line names no commit ({committed_line!r}); commit the "
        "registration, then regenerate the finding in a full clone")
    if fresh_line == committed_line:
        return
    fallback = allowed_here(kind)
    assert fresh_line == fallback, (
        f"{name}: in this {kind} clone the seal line is {fresh_line!r}, the committed one "
        f"{committed_line!r}; regenerate the finding (bash scripts/regenerate_findings.sh)")


def assert_regenerates(summary: RunSummary, run: Path, registration: Path | None,
                       committed: Path, out: Path) -> None:
    """Write the finding as ``bistat analyze RUN [--registration REGISTRATION]`` does (with
    its seal line) into ``out`` and compare it with ``committed`` (:func:`assert_same_finding`)."""
    seal = run_seal_evidence(run, registration, summary.created_utc)
    files = write_finding(summary, out, seal=seal)
    assert_same_finding(files.markdown.read_text(), committed.read_text(), committed.name)
