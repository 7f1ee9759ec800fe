"""bistat's analysis, verification and explanation tools on real vLLM runs recorded on the H200.

The fixtures (tests/data/vllm-h200/, provenance in its README) were recorded by ``bistat run`` through
the vllm-server engine. These tests pin what they hold, so any change in how bistat reads or judges
recorded vLLM data shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bistat.analysis.summary import analyze_run
from bistat.declare.prereg import verify

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "vllm-h200"
FIXTURE = DATA / "h200-fixture-smollm2"
ATTEMPT1 = DATA / "h200-fixture-smollm2-attempt1"
TRITON = DATA / "h200-fixture-triton-attn"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    # run.json names its registration relative to the repository root.
    monkeypatch.chdir(ROOT)


def _arms(summary):
    return {a.name: (a.n_prompts, a.n_matched) for a in summary.arms}


def test_registrations_precede_the_recorded_vllm_data():
    report = verify(ROOT / "preregistrations" / "h200-fixture-smollm2.json", [FIXTURE, ATTEMPT1])
    assert report.ok, report.problems
    report = verify(ROOT / "preregistrations" / "h200-fixture-triton-attn.json", [TRITON])
    assert report.ok, report.problems


def test_the_fixture_run_is_analysed_from_its_records():
    s = analyze_run(FIXTURE)
    assert _arms(s) == {"default": (192, 86), "batch-invariant": (192, 97),
                        "bi-tuned-gemm": (192, 57)}
    # The registered validity floor (16 mean running requests) was not reached: untested.
    labels = [c.verdict.label for c in s.comparisons]
    assert [str(getattr(l, "value", l)) for l in labels] == ["untested", "untested"]
    failed = [v for v in s.validity if v.passed is False]
    assert [v.name for v in failed] == ["mean running requests"]
    fingerprints = [fp for _, env in s.environments for fp in env.gpu_uuids]
    assert set(fingerprints) == {"GPU-7958d391-6995-70fa-cbea-3c911cfca52b"}


def test_triton_attention_is_bitwise_invariant_where_flash_attention_3_is_not():
    s = analyze_run(TRITON)
    assert _arms(s) == {"bi-flash-attn": (192, 74), "bi-triton-attn": (192, 192)}
    (comparison,) = s.comparisons
    assert str(getattr(comparison.verdict.label, "value", comparison.verdict.label)) == \
        "reported as observed"


def test_a_run_whose_engines_failed_to_start_is_untested():
    s = analyze_run(ATTEMPT1)
    assert all(n == 0 for n, _ in _arms(s).values())
    labels = [str(getattr(c.verdict.label, "value", c.verdict.label)) for c in s.comparisons]
    assert labels == ["untested", "untested"]
    reasons = " ".join(r for c in s.comparisons for r in c.verdict.untested_reasons)
    assert "engine start failed" in reasons


def test_diagnose_and_inspect_work_on_a_recorded_vllm_run():
    from bistat.explain.diagnose import diagnose_run, render_diagnosis
    from bistat.explain.inspect_run import inspect_run, render_inspection

    d = diagnose_run(TRITON)
    text = render_diagnosis(d)
    assert "bi-flash-attn" in text
    ins = render_inspection(inspect_run(FIXTURE))
    assert "responses" in ins


@pytest.mark.parametrize("name", ["h200-fixture-smollm2", "h200-fixture-triton-attn"])
@pytest.mark.parametrize("suffix", ["", "-exploratory"])
def test_committed_h200_findings_regenerate_byte_for_byte(name, suffix, tmp_path, monkeypatch):
    """As scripts/regenerate_findings.sh writes them: under the registration the run was
    recorded under, and under its exploratory sibling (the default rule, sealed after the data)."""
    from finding_seal import assert_regenerates

    monkeypatch.chdir(ROOT)
    run, reg = DATA.relative_to(ROOT) / name, Path("preregistrations") / f"{name}{suffix}.json"
    assert_regenerates(analyze_run(run, reg), run, reg,
                       ROOT / "findings" / "h200" / f"{name}{suffix}.md", tmp_path)
