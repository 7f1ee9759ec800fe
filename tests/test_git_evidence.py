"""prereg.git_evidence: the first commit holding a registration's exact bytes,
compared with the run's first record."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess

import pytest

from bistat.declare.prereg import git_evidence

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root, *args, when):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when,
           "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def test_first_commit_of_the_exact_bytes_and_its_order_with_the_first_record(tmp_path):
    assert git_evidence(tmp_path / "nothing.json").status == "none"
    _git(tmp_path, "init", "-q", when="2026-01-01T00:00:00Z")
    reg = tmp_path / "preregistrations" / "x.json"
    reg.parent.mkdir()
    reg.write_text('{"a": 1}\n')
    assert git_evidence(reg).status == "uncommitted"
    _git(tmp_path, "add", "-A", when="2026-01-01T00:00:00Z")
    _git(tmp_path, "commit", "-qm", "one", when="2026-01-01T10:00:00Z")
    first = _git(tmp_path, "rev-parse", "HEAD", when="2026-01-01T10:00:00Z")
    (tmp_path / "other").write_text("x")
    _git(tmp_path, "add", "-A", when="2026-01-01T00:00:00Z")
    _git(tmp_path, "commit", "-qm", "two", when="2026-01-02T10:00:00Z")
    ev = git_evidence(reg, dt.datetime(2026, 1, 1, 11, tzinfo=dt.timezone.utc))
    assert (ev.status, ev.commit, ev.time_utc, ev.before) == (
        "committed", first, "2026-01-01T10:00:00Z", True)
    assert ev.line() == (f"git: first committed in {first} at 2026-01-01T10:00:00Z, before the "
                         "run's first record")
    late = git_evidence(reg, dt.datetime(2026, 1, 1, 9, tzinfo=dt.timezone.utc))
    assert late.before is False and late.refutes
    reg.write_text('{"a": 2}\n')              # same path, other bytes: changed after commit
    ev = git_evidence(reg)
    assert (ev.status, ev.commit, ev.refutes) == ("differs", first, True)
