"""What git says about a registration: the commit and the file's clean or dirty state as it is
sealed (:func:`git_state`), and the first commit holding its exact bytes, older than a run's first
record or not (:func:`git_evidence`): evidence of the seal's time that whoever can rewrite the
file cannot recompute. A shallow clone that cannot see that commit says so.
"""

from __future__ import annotations

import datetime as dt
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def git_state(path: str | Path) -> dict[str, Any]:
    """Git commit of the repository holding ``path`` and the file's state there.

    Returns ``{"commit": sha or None, "declaration_state": "clean" | "dirty" | "untracked" |
    None}``; both None outside a git repository or without git.
    """
    p = Path(path).resolve()
    none = {"commit": None, "declaration_state": None}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(p.parent), *args], capture_output=True,
                              text=True, check=False)

    try:
        head = git("rev-parse", "HEAD")
    except OSError:  # git is not installed
        return none
    if head.returncode != 0:
        inside = git("rev-parse", "--is-inside-work-tree")
        if inside.returncode != 0:
            return none
        commit = None  # a repository without commits yet
    else:
        commit = head.stdout.strip()
    status = git("status", "--porcelain", "--", p.name)
    if status.returncode != 0:
        return {"commit": commit, "declaration_state": None}
    out = status.stdout.strip()
    state = "clean" if not out else ("untracked" if out.startswith("??") else "dirty")
    return {"commit": commit, "declaration_state": state}


@dataclass(frozen=True)
class GitEvidence:
    """What git says about a registration file's current bytes (its blob).

    ``status``: ``"none"`` (not in a git repository, or git missing), ``"uncommitted"`` (no
    commit holds the path), ``"differs"`` (commits hold the path, none with these bytes:
    ``commit`` is the newest that holds it), ``"committed"`` (``commit`` is the first commit
    holding these exact bytes, ``time_utc`` its committer time), ``"shallow"`` (a shallow
    clone whose first commit holding these bytes is a boundary commit, ``commit``: its history
    is cut there, so the bytes may be older and no time can be told). ``before`` compares
    that time with the run's first record when one is given (None otherwise).
    """

    status: str
    commit: str | None = None
    time_utc: str | None = None
    before: bool | None = None

    def line(self) -> str:
        """The one line ``verify`` and the finding print."""
        if self.status == "none":
            return "no git evidence (not in a git repository): only the seal's integrity is shown"
        if self.status == "uncommitted":
            return "no git evidence: the registration is not committed"
        if self.status == "shallow":
            return (f"no git evidence: a shallow clone, cut at {self.commit} which holds the "
                    "registration; its first commit is not here (git fetch --unshallow)")
        if self.status == "differs":
            return (f"git: the registration differs from the blob committed in {self.commit}; "
                    "it was changed after it was committed")
        when = "" if self.before is None else (
            ", before the run's first record" if self.before else ", after the run's first record")
        return f"git: first committed in {self.commit} at {self.time_utc}{when}"

    @property
    def refutes(self) -> bool:
        """The evidence contradicts the seal (changed after commit, or committed after data)."""
        return self.status == "differs" or self.before is False


def _shallow_boundary(git: Callable[..., subprocess.CompletedProcess]) -> frozenset[str]:
    """The commits where a shallow clone's history is cut (empty for a full clone)."""
    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "true":
        return frozenset()
    shallow = git("rev-parse", "--path-format=absolute", "--git-path", "shallow").stdout.strip()
    try:
        return frozenset(Path(shallow).read_text(encoding="ascii").split())
    except OSError:
        return frozenset()


def git_evidence(path: str | Path, first_record: dt.datetime | None = None) -> GitEvidence:
    """The first commit holding ``path``'s exact current bytes, and whether it is older than
    ``first_record`` (the run's first record): evidence of time the user cannot rewrite after
    the fact, unlike the self-computed seal."""
    p = Path(path).resolve()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(p.parent), *args], capture_output=True,
                              text=True, check=False)

    try:
        top = git("rev-parse", "--show-toplevel")
    except OSError:
        return GitEvidence("none")
    if top.returncode != 0 or not p.is_file():
        return GitEvidence("none")
    rel = p.relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    blob = git("hash-object", "--", str(p)).stdout.strip()
    log = git("log", "--format=%H %ct", "--reverse", "--", f":(top){rel}")
    commits = [line.split() for line in log.stdout.splitlines() if line.strip()]
    if log.returncode != 0 or not commits:
        return GitEvidence("uncommitted")
    for sha, ct in commits:
        if git("rev-parse", f"{sha}:{rel}").stdout.strip() == blob:
            if sha in _shallow_boundary(git):  # every file appears in a boundary commit
                return GitEvidence("shallow", sha)
            when = dt.datetime.fromtimestamp(int(ct), dt.timezone.utc)
            before = None if first_record is None else when < first_record
            return GitEvidence("committed", sha, when.strftime("%Y-%m-%dT%H:%M:%SZ"), before)
    return GitEvidence("differs", commits[-1][0])
