"""scripts/device/travel.sh: what of the checkout travels with a device call, and getting it back.

Session 5 lost a study to its first version, which left `.gitignore` behind: the lent machine
keeps only ignored paths of its repository copy between calls, so it wiped `runs/` under a
running study. These tests run the script on a throw-away clone of a small repository.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device" / "travel.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                                reason="needs git and bash")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _travelling(repo: Path) -> set[str]:
    """What the device tool sends: tracked plus untracked-not-ignored files."""
    out = _git(repo, "ls-files") + _git(repo, "ls-files", "--others", "--exclude-standard")
    return set(out.split())


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    files = {".gitignore": "/runs/\n/.dev/\n", "README.md": "x\n", "pyproject.toml": "x\n",
             "src/bistat/__init__.py": "", "scripts/device/travel.sh": SCRIPT.read_text(),
             "scripts/device/stage.sh": "", "scripts/test.sh": "", "experiments/a.toml": "",
             "preregistrations/a.json": "{}", "kernels/bistat_kernels/tables/t.json": "{}",
             "kernels/bistat_kernels/__init__.py": "", "kernels/device/gpu_call.py": "",
             "kernels/results/r.json": "[]", "data/h200/run/outputs.parquet": "big",
             "findings/README.md": "", "tests/test_x.py": "", "docs/A.md": ""}
    for name, text in files.items():
        (r / name).parent.mkdir(parents=True, exist_ok=True)
        (r / name).write_text(text)
    _git(r.parent, "init", "-q", str(r))
    _git(r, "add", "-A")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (r / "runs" / "study").mkdir(parents=True)          # what a device run writes: ignored
    (r / "runs" / "study" / "run.json").write_text("{}")
    return r


def _travel(repo: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/device/travel.sh", mode], cwd=repo,
                          capture_output=True, text=True)


def test_stage_sends_scripts_device_and_gitignore_only_and_restore_brings_all_back(repo):
    everything = _travelling(repo)
    assert _travel(repo, "stage").returncode == 0
    assert _travelling(repo) == {".gitignore", "scripts/device/travel.sh", "scripts/device/stage.sh"}
    assert (repo / "data" / "h200" / "run" / "outputs.parquet").read_text() == "big"  # disk intact
    assert _travel(repo, "restore").returncode == 0
    assert _travelling(repo) == everything
    assert _git(repo, "status", "--porcelain") == ""


def test_run_sends_what_a_run_needs_with_gitignore_and_not_the_data(repo):
    assert _travel(repo, "run").returncode == 0
    sent = _travelling(repo)
    assert ".gitignore" in sent       # without it the machine wipes runs/ between calls
    assert {"src/bistat/__init__.py", "scripts/device/stage.sh", "scripts/test.sh",
            "experiments/a.toml", "preregistrations/a.json", "kernels/bistat_kernels/tables/t.json",
            "kernels/bistat_kernels/__init__.py", "kernels/device/gpu_call.py",
            "README.md", "pyproject.toml"} <= sent
    assert not {f for f in sent if f.startswith(("data/", "findings/", "tests/", "docs/",
                                                 "kernels/results/", "runs/"))}
    # the copy says which commit it is (its own .git on the device can be an earlier one's)
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert "scripts/device/SOURCE_COMMIT" in sent
    assert (repo / "scripts" / "device" / "SOURCE_COMMIT").read_text() == f"{head} clean\n"
    # run again with the mode still on: its cut index and .gitignore are not changes of the tree
    assert _travel(repo, "run").returncode == 0
    assert (repo / "scripts" / "device" / "SOURCE_COMMIT").read_text() == f"{head} clean\n"
    # switching modes goes through restore; restoring twice is harmless
    assert _travel(repo, "stage").returncode == 0 and ".gitignore" in _travelling(repo)
    assert _travel(repo, "restore").returncode == 0
    assert "nothing to restore" in _travel(repo, "restore").stdout
    assert _git(repo, "status", "--porcelain") == ""


def test_a_mode_is_refused_while_changes_are_staged(repo):
    (repo / "README.md").write_text("changed\n")
    _git(repo, "add", "README.md")
    done = _travel(repo, "stage")
    assert done.returncode == 1 and "commit or unstage them first" in done.stdout
    assert _git(repo, "diff", "--cached", "--name-only").split() == ["README.md"]


def test_a_mode_leaves_other_worktrees_and_the_shared_exclude_file_alone(repo, tmp_path):
    # Worktrees share .git/info/exclude: a mode written there would hide every new file of another
    # worktree from `git add -A` while a device session runs.
    other = tmp_path / "other"
    _git(repo, "worktree", "add", "-q", "-b", "other", str(other))
    (other / "new_file.py").write_text("x\n")
    exclude = repo / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.exists() else None
    for mode in ("stage", "run"):
        assert _travel(repo, mode).returncode == 0
        assert "new_file.py" in _git(other, "status", "--porcelain", "--untracked-files=all")
        assert "data/h200/run/outputs.parquet" not in _travelling(repo)
        assert (exclude.read_text() if exclude.exists() else None) == before
    assert _travel(repo, "restore").returncode == 0
    assert _git(repo, "status", "--porcelain") == ""
    assert (repo / ".gitignore").read_text() == "/runs/\n/.dev/\n"  # as committed


def test_run_says_dirty_when_tracked_files_differ_and_restore_removes_the_note(repo):
    (repo / "README.md").write_text("edited, not committed\n")
    (repo / "new.txt").write_text("untracked\n")         # untracked files do not make it dirty
    assert _travel(repo, "run").returncode == 0
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert (repo / "scripts" / "device" / "SOURCE_COMMIT").read_text() == f"{head} dirty\n"
    assert _travel(repo, "restore").returncode == 0
    assert not (repo / "scripts" / "device" / "SOURCE_COMMIT").exists()
    assert _git(repo, "status", "--porcelain").split() == ["M", "README.md", "??", "new.txt"]
