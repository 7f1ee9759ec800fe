"""The finding's seal line (bistat.report.seal): each form word for word, in a full
clone, a shallow clone, a deepened one, outside git and uncommitted; and the regeneration
comparison (tests/finding_seal.py) that accepts only the forms a clone can state."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bistat.declare.prereg import GitEvidence, git_evidence
from bistat.report.seal import SEAL_PREFIX, SealEvidence, seal_evidence
from finding_seal import assert_same_finding, clone_kind, split_seal

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

FIRST_RECORD = "2026-01-01T12:00:00.000000Z"
NO_TIME = "the seal proves integrity, not time"


def _git(root: Path, *args: str, when: str = "2026-01-01T00:00:00Z") -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when,
           "PATH": "/usr/bin:/bin", "HOME": str(root)}
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def history(tmp_path):
    """A repository of three commits: c1 (README), c2 (the registration, 10:00), c3 (another
    file, 14:00). Returns (root, registration, sha of c2)."""
    root = tmp_path / "origin"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "README").write_text("x\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "c1", when="2026-01-01T09:00:00Z")
    reg = root / "preregistrations" / "x.json"
    reg.parent.mkdir()
    reg.write_text('{"a": 1}\n')
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "c2", when="2026-01-01T10:00:00Z")
    c2 = _git(root, "rev-parse", "HEAD")
    (root / "other").write_text("y\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "c3", when="2026-01-01T14:00:00Z")
    return root, reg, c2


def test_committed_before_and_after_the_first_record(history):
    root, reg, c2 = history
    before = seal_evidence(reg, FIRST_RECORD)
    assert before.line() == (f"Seal: content hash verified; git: first committed in {c2} at "
                             "2026-01-01T10:00:00Z, before the run's first record "
                             "(2026-01-01T12:00:00.000000Z).")
    assert before.refutations() == []
    after = seal_evidence(reg, "2026-01-01T09:30:00Z")
    assert after.line() == (f"Seal: content hash verified; git: first committed in {c2} at "
                            "2026-01-01T10:00:00Z, after the run's first record "
                            f"(2026-01-01T09:30:00Z): {NO_TIME}.")
    assert after.refutations() == []   # the finding says what it leaves; not a forgery
    unknown = seal_evidence(reg, None)
    assert unknown.line() == (f"Seal: content hash verified; git: first committed in {c2} at "
                              "2026-01-01T10:00:00Z; the run records no start time to compare: "
                              f"{NO_TIME}.")


def test_changed_after_commit_is_refuted(history):
    root, reg, c2 = history
    reg.write_text('{"a": 2}\n')
    ev = seal_evidence(reg, FIRST_RECORD)
    assert ev.refutations() == [f"git: the registration differs from the blob committed in {c2}; "
                                "it was changed after it was committed"]


def test_outside_git_and_uncommitted(tmp_path, history):
    loose = tmp_path / "loose.json"
    loose.write_text("{}\n")
    assert seal_evidence(loose, FIRST_RECORD).line() == (
        "Seal: content hash verified; git: not in git history here (not a git checkout, or git "
        f"is not installed): {NO_TIME}.")
    root, _, _ = history
    new = root / "preregistrations" / "y.json"
    new.write_text("{}\n")
    assert seal_evidence(new, FIRST_RECORD).line() == (
        "Seal: content hash verified; git: not in git history here (the registration is not "
        f"committed): {NO_TIME}.")


def test_a_shallow_clone_says_so_until_its_history_reaches_the_commit(tmp_path, history):
    """--depth 1 and 2 cut the history at c3 / c2, both of which hold the registration: the
    first commit cannot be told (c2's boundary shows every file as new). --depth 3 reaches c1
    (without it), so c2 is seen introducing it: the same line as the full clone; so does
    `git fetch --unshallow`."""
    origin, reg, c2 = history
    full = seal_evidence(reg, FIRST_RECORD).line()
    shallow_line = ("Seal: content hash verified; git: not in git history here (a shallow clone: "
                    f"`git fetch --unshallow` to look further back): {NO_TIME}.")
    for depth, expected in ((1, shallow_line), (2, shallow_line), (3, full)):
        clone = tmp_path / f"depth{depth}"
        _git(tmp_path, "clone", "-q", f"--depth={depth}", f"file://{origin}", str(clone))
        assert clone_kind(clone) == "shallow"
        ev = seal_evidence(clone / "preregistrations" / "x.json", FIRST_RECORD)
        assert ev.line() == expected, depth
        assert ev.refutations() == []
    shallow = tmp_path / "depth1"
    assert git_evidence(shallow / "preregistrations" / "x.json").status == "shallow"
    _git(shallow, "fetch", "-q", "--unshallow")
    assert clone_kind(shallow) == "full"
    assert seal_evidence(shallow / "preregistrations" / "x.json", FIRST_RECORD).line() == full
    assert clone_kind(tmp_path / "nowhere") == "none"


# --------------------------------------------------------------------------------------------
# the regeneration comparison


def _finding(seal: str, body: str = "| a | 1 |\n") -> str:
    return f"# Finding: x\n\nVerdict: **working**.\n\n{seal}\n\n{body}"


SHA = "d2bd635c58d99e6487f271705b62980bf1261765"
COMMITTED = (f"{SEAL_PREFIX}git: first committed in {SHA} at 2026-11-29T11:48:36Z, before the "
             "run's first record (2026-11-29T12:28:35.005816Z).")


def _line(status: str) -> str:
    return SealEvidence("", GitEvidence(status), None).line()


def test_regeneration_accepts_only_the_forms_this_clone_can_state():
    committed = _finding(COMMITTED)
    for kind in ("full", "shallow", "none"):
        assert_same_finding(committed, committed, "x", kind)
    assert_same_finding(_finding(_line("shallow")), committed, "x", "shallow")
    assert_same_finding(_finding(_line("none")), committed, "x", "none")
    refused = [
        (_finding(_line("shallow")), committed, "full"),          # a full clone must match
        (_finding(_line("none")), committed, "shallow"),          # not this clone's form
        (_finding(_line("uncommitted")), committed, "shallow"),
        (_finding(COMMITTED.replace(SHA[:7], "0000000")), committed, "full"),
        (_finding(COMMITTED, "| a | 2 |\n"), committed, "none"),   # any other byte
        (_finding(_line("none")), _finding(_line("none")), "none"),  # committed names no commit
        (_finding(COMMITTED) + COMMITTED + "\n", committed, "full"),  # two seal lines
        ("# Finding: x\n", committed, "full"),                     # none
    ]
    for fresh, comm, kind in refused:
        with pytest.raises(AssertionError):
            assert_same_finding(fresh, comm, "x", kind)


def test_split_seal_keeps_every_other_byte():
    line, rest = split_seal(_finding(COMMITTED))
    assert line == COMMITTED
    assert rest == _finding("<seal line>")
