"""How to get a damaged or edited file back, in the words an error message gives: from git only
where git has it.

``git checkout -- PATH`` restores a file only from a commit that holds it; suggesting it for a
file git never committed (a registration sealed and not yet committed, a run directory kept
outside the repository) sends the reader to a command that fails. :func:`restore_hint` asks git
which commit, if any, holds the path, and falls back to the reader's own copy.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["last_commit_of", "restore_hint"]


def last_commit_of(path: str | Path) -> tuple[str, bool] | None:
    """``(commit, at_head)``: the newest commit holding ``path`` and whether ``HEAD`` still holds
    it; None when git never committed it (or there is no git repository or no git)."""
    p = Path(path).resolve()
    where = p.parent if p.parent.is_dir() else Path.cwd()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              check=False)

    try:
        top = git("rev-parse", "--show-toplevel")
    except OSError:
        return None
    if top.returncode != 0:
        return None
    try:
        rel = p.relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    except ValueError:
        return None
    # the last commit that added or changed it holds it (a later one may have deleted it)
    log = git("log", "-1", "--format=%H", "--diff-filter=AM", "--", f":(top){rel}")
    commit = log.stdout.strip()
    if log.returncode != 0 or not commit:
        return None
    at_head = git("cat-file", "-e", f"HEAD:{rel}").returncode == 0
    return commit, at_head


def restore_hint(path: str | Path, *, otherwise: str = "from your own copy of it") -> str:
    """How to restore ``path``, as a clause: ``with `git checkout -- PATH``` where ``HEAD`` holds
    it, ``with `git checkout COMMIT -- PATH``` where only an older commit does, else
    ``otherwise`` with the reason git cannot (it never committed the file).

    Examples
    --------
    >>> restore_hint("/nonexistent/dir/x.json")
    'from your own copy of it (git never committed /nonexistent/dir/x.json, so git cannot restore it)'
    """
    found = last_commit_of(path)
    if found is None:
        return f"{otherwise} (git never committed {path}, so git cannot restore it)"
    commit, at_head = found
    return (f"with `git checkout -- {path}`" if at_head
            else f"with `git checkout {commit[:12]} -- {path}`")
