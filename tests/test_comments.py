"""Code and its comments name no issue of this project's tracker.

Comments explain the code; the history of why it changed belongs in commit messages and docs/. So
no ``.py`` or ``.sh`` file under src/, kernels/, tests/, benchmarks/ or scripts/ mentions one of
the project's own issues by number -- in a comment, a docstring, a string, an identifier or its
own file name ("issue N", "Issue N's", "issues N and M", "issue-N", "issueN_support",
"ISSUEN_...", N a number: the forms :data:`OWN_ISSUE` matches). A citation of another project's tracker
stays: a mention right after the upstream project's name ("vLLM issue #51902", "triton issue
N") or "upstream" is an external fact, not our history.

The pattern and the examples below are assembled from pieces so that this file does not match
itself. ``python tests/test_comments.py`` prints every mention found.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "kernels", "tests", "benchmarks", "scripts")
SUFFIXES = (".py", ".sh")

_WORD = "iss" + "ue"
#: "issue N", "Issues N", "issue-N", "issue #N", "issueN", "ISSUE_N" (N a number): the word (not
#: inside another word), an optional separator and '#', then a digit.
OWN_ISSUE = re.compile(r"(?<![A-Za-z])" + _WORD + r"s?[ _-]?#?\d", re.IGNORECASE)
#: Other projects whose trackers the code may cite, by the name written just before the mention.
UPSTREAM = re.compile(r"(vllm|sglang|sgl-project|flash-attention|flash_attn|triton|pytorch|torch|"
                      r"upstream)\S*\s+(\S+\s+)?$", re.IGNORECASE)


def own_issue_mentions(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each line of ``text`` that names one of our own issues: a match
    of :data:`OWN_ISSUE` not preceded (within two words) by an upstream project's name."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if any(not UPSTREAM.search(line[:m.start()]) for m in OWN_ISSUE.finditer(line)):
            found.append((number, line.strip()))
    return found


def source_files() -> list[Path]:
    """Every ``.py`` and ``.sh`` file under :data:`FOLDERS`, caches and hidden folders aside."""
    files = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if (path.suffix in SUFFIXES and path.is_file()
                    and not any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                                for p in parts)):
                files.append(path)
    return files


def all_mentions() -> list[str]:
    """``path:line: text`` of every own-issue mention in a file name or a file's text."""
    out = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        if own_issue_mentions(rel):
            out.append(f"{rel}: its name")
        text = path.read_text(encoding="utf-8", errors="replace")
        out += [f"{rel}:{n}: {line}" for n, line in own_issue_mentions(text)]
    return out


def test_no_source_file_names_one_of_our_issues():
    assert len(source_files()) > 300   # the walk found the code (a wrong ROOT would pass vacuously)
    assert all_mentions() == []


def _lines(*pieces: str) -> str:
    return "\n".join(pieces)


def test_the_check_catches_each_form_and_keeps_upstream_citations():
    w, W = _WORD, _WORD.capitalize()
    own = [f"# activation criteria ({w} 18)", f'"""{W} 23\'s goals: tuned / torch.mm"""',
           f"x = 1  # since {w} 19", f"# the newest vLLM ({w}s 19 and 22)", f"# see {w}-20",
           f"import {w}20_support as s", f"{W.upper()}34_V034 = {{}}", f"def _{w}23_bench():",
           f"def test_goals_are_{w}_23s():", f"# {w} #36", f"# {w} 23's latency goal on vLLM 0.34.0"]
    upstream = [f"# so the flip stays: vLLM {w} #51902 (H100)", f"# triton {w} 123",
                f"# pytorch/pytorch {w} #4567", f"# an upstream {w} 99", "# no mention at all",
                f"# 10 us to {w} one call", f"# the {w} time is host time", f"t{w} 5"]
    text = _lines(*own, *upstream)
    assert own_issue_mentions(text) == [(i, line.strip()) for i, line in enumerate(own, start=1)]


def test_a_planted_mention_in_a_scanned_file_is_reported(tmp_path, monkeypatch):
    """The whole check, run over a copy of one folder with one line planted: it names the file,
    the line and the text; the same folder without it passes."""
    (tmp_path / "src").mkdir()
    good = tmp_path / "src" / "mod.py"
    good.write_text('"""A module."""\n\nX = 1  # vLLM ' + _WORD + " #51902\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [p.name for p in source_files()] == ["mod.py"]
    assert all_mentions() == []
    planted = "X = 2  # " + _WORD + " 18's rule"
    good.write_text(good.read_text() + planted + "\n")
    assert all_mentions() == [f"src/mod.py:4: {planted}"]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / (_WORD + "20_support.sh")).write_text("true\n")
    assert all_mentions() == [f"src/mod.py:4: {planted}", f"scripts/{_WORD}20_support.sh: its name"]


if __name__ == "__main__":
    found = all_mentions()
    print("\n".join(found) or "no mentions")
    raise SystemExit(1 if found else 0)
