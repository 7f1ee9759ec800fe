"""The H200 study data committed under data/h200/ (issue 6): sealed before the data, analysed from
the slim-compacted records, and the committed findings regenerate byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from bistat.analysis import analyze_run
from bistat.prereg import verify
from bistat.report import write_finding

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "data" / "h200" / "h200-match-smollm2"
REG = ROOT / "preregistrations"
GPU = "GPU-5a063f7e-dba3-0564-e90e-802315aa3708"


@pytest.fixture(scope="module")
def smol():
    return analyze_run(SMOL, REG / "h200-match-smollm2.json")


def test_registration_precedes_the_data():
    report = verify(REG / "h200-match-smollm2.json", [SMOL])
    assert report.ok, report.problems


def test_first_attempt_match_counts_and_verdicts(smol):
    assert {a.name: (a.n_prompts, a.n_matched, len(a.counted_passes)) for a in smol.arms} == {
        "default": (541, 107, 2), "batch-invariant": (541, 168, 2),
        "bi-tuned-gemm": (541, 176, 2), "bi-triton-attn": (541, 541, 2)}
    assert [str(getattr(c.verdict.label, "value", c.verdict.label)) for c in smol.comparisons] == \
        ["untested"] * 3
    assert [v.name for v in smol.validity if v.passed is False] == ["mean running requests"]
    assert {u for _, env in smol.environments for u in env.gpu_uuids} == {GPU}
    assert smol.not_run == tuple(f"arm {a}: 6 of 8 declared counted passes not recorded"
                                 for a in ("default", "batch-invariant", "bi-tuned-gemm",
                                           "bi-triton-attn"))
    assert smol.operator_notes.startswith("First attempt of Study 1(a), stopped early")


@pytest.mark.parametrize("name", ["h200-match-smollm2", "h200-match-smollm2-improved"])
def test_committed_findings_regenerate_byte_for_byte(name, tmp_path, monkeypatch):
    """As generated: bistat analyze data/h200/h200-match-smollm2 --registration
    preregistrations/NAME.json --out findings/h200 (from the repository root)."""
    monkeypatch.chdir(ROOT)
    files = write_finding(analyze_run(SMOL.relative_to(ROOT), Path("preregistrations") / f"{name}.json"),
                          tmp_path)
    committed = (ROOT / "findings" / "h200" / f"{name}.md").read_text()
    assert files.markdown.read_text() == committed
    # the registration analysed against: run.json's for the run's own, the named sibling's else
    row = ("/work/main/preregistrations/h200-match-smollm2.json" if name == "h200-match-smollm2"
           else "preregistrations/h200-match-smollm2-improved.json")
    assert f"| Registration | `{row}` |" in committed
