"""The committed quickstart run (examples/quickstart/: `bash scripts/main.sh` on a fresh clone of this
repository, 2-core CPU machine) regenerates its committed finding byte for byte, and holds what
the README says it holds."""

from pathlib import Path

import pytest

from bistat.analysis import analyze_run
from bistat.prereg import verify
from bistat.report import write_finding

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "examples" / "quickstart" / "quickstart-20261129T113548Z"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_the_quickstart_run_follows_its_registration():
    report = verify(ROOT / "preregistrations" / "quickstart.json", [RUN])
    assert report.ok, report.problems


def test_the_quickstart_finding_regenerates_and_says_what_the_readme_says(tmp_path):
    summary = analyze_run(RUN)
    assert {a.name: (a.n_prompts, a.n_matched) for a in summary.arms} == {
        "blas": (256, 247), "invariant": (256, 256)}
    (comparison,) = summary.comparisons
    assert str(getattr(comparison.verdict.label, "value", comparison.verdict.label)) == "working"
    files = write_finding(summary, tmp_path)
    assert files.markdown.read_text() == (ROOT / "findings" / "quickstart.md").read_text()
