"""bistat compare: one study on two vLLM releases side by side."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.core import stats
from bistat.analysis.summary import analyze_run
from bistat.cli import cli
from bistat.analysis.version_compare import (ArmChange, ArmSide, UpstreamChange, VersionCompareError,
                                    compare_versions, load_upstream_changes)

ROOT = Path(__file__).resolve().parents[1]
R2 = ROOT / "data" / "h200" / "h200-match-smollm2-r2"
V033 = ROOT / "data" / "h200-v033" / "h200-v033-match-smollm2"
REG = ROOT / "preregistrations"
COMMITTED = ROOT / "findings" / "h200" / "compare-h200-match-smollm2-r2-v033.md"


@pytest.fixture(scope="module")
def runs():
    return (analyze_run(R2, REG / "h200-match-smollm2-r2-exploratory.json"),
            analyze_run(V033, REG / "h200-v033-match-smollm2.json"))


def test_study_1a_on_two_releases(runs):
    vc = compare_versions(*runs)
    assert (vc.earlier_version, vc.later_version, vc.same_rule, vc.earlier_exploratory) == (
        "0.25.0", "0.33.0", True, True)
    rows = {c.later.arm: c for c in vc.arms}
    assert set(rows) == {"default", "batch-invariant", "bi-triton-attn"}
    assert (vc.only_earlier, vc.only_later) == (("bi-tuned-gemm",), ("bi-fa3-pin",))
    counts = {a: ((c.earlier.n_matched, c.earlier.n_units), (c.later.n_matched, c.later.n_units))
              for a, c in rows.items()}
    assert counts == {"default": ((83, 541), (82, 541)), "batch-invariant": ((84, 541), (83, 541)),
                      "bi-triton-attn": ((541, 541), (541, 541))}
    # the Newcombe interval of (later - earlier) is statsmodels', and none excludes 0
    bi = rows["batch-invariant"]
    assert bi.match_difference == stats.newcombe_difference(83, 541, 84, 541, 0.95)
    assert not any(c.match_changed or c.verdict_changed or c.cost_changed or c.mode_changed
                   for c in vc.arms)
    assert (bi.earlier.verdict, bi.later.verdict) == ("doubtful", "doubtful")
    assert [u.key for u in bi.upstream] == ["determinism-module", "hopper-cublas-workspace",
                                            "fa3-head-size-64"]
    assert bi.explanation() == ("unchanged, as the upstream problem left open implies: "
                                "vllm-project/vllm#51902 (open)")
    # TRITON_ATTN: SmolLM2's shapes are not tuned (no breakable graphs), so only the GEMM entries
    tri = rows["bi-triton-attn"]
    assert [u.key for u in tri.upstream] == ["determinism-module", "hopper-cublas-workspace"]
    assert rows["default"].upstream == () and rows["default"].explanation().startswith("the control")
    assert any("workload.passes: 8" in n for n in vc.notes)
    assert any("different GPUs of one model (NVIDIA H200" in n for n in vc.notes)
    # one engine, two releases: no setups side by side; each side's first divergences
    assert vc.same_engine and vc.setups == ()
    assert (bi.earlier.spread.n_prompts, bi.later.spread.n_prompts) == (457, 458)
    assert (bi.later.spread.earliest, bi.later.spread.median, bi.later.spread.kv_median) == (
        79, 91, 133)


def test_different_rules_are_not_compared_verdict_by_verdict():
    earlier = analyze_run(R2, REG / "h200-match-smollm2-r2.json")  # the published rule
    later = analyze_run(V033, REG / "h200-v033-match-smollm2.json")
    vc = compare_versions(earlier, later)
    assert not vc.same_rule and all(c.verdict_changed is None for c in vc.arms)
    assert any("different decision rules" in n for n in vc.notes)


def test_the_committed_comparison_regenerates_byte_for_byte(tmp_path, monkeypatch):
    """As generated: bistat compare data/h200/h200-match-smollm2-r2
    data/h200-v033/h200-v033-match-smollm2 --earlier-registration
    preregistrations/h200-match-smollm2-r2-exploratory.json --out findings/h200/compare-...md"""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "c.md"
    result = CliRunner().invoke(cli, [
        "compare", "data/h200/h200-match-smollm2-r2", "data/h200-v033/h200-v033-match-smollm2",
        "--earlier-registration", "preregistrations/h200-match-smollm2-r2-exploratory.json",
        "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert out.read_text() == COMMITTED.read_text()


def test_bad_arm_maps_and_units_get_clear_errors(runs, tmp_path, monkeypatch):
    with pytest.raises(VersionCompareError, match=r"--arm nope=default: the earlier run "
                                                  r"h200-match-smollm2-r2 has no arm 'nope'"):
        compare_versions(*runs, {"nope": "default"})
    with pytest.raises(VersionCompareError, match=r"the later run h200-v033-match-smollm2 has no "
                                                  r"arm 'bi-tuned-gemm'"):
        compare_versions(*runs, {"bi-tuned-gemm": "bi-tuned-gemm"})
    other = dataclasses.replace(runs[1], match_unit="token_ids")
    with pytest.raises(VersionCompareError, match="different things"):
        compare_versions(runs[0], other)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(cli, ["compare", str(R2), str(V033), "--arm", "default",
                                      "--out", str(tmp_path / "x.md")])
    assert result.exit_code == 2 and "expected EARLIER=LATER" in result.output


def _side(arm="a", role="treatment", verdict="working", modes="m"):
    return ArmSide(arm, role, "0.33.0", modes, "vllm-server, TRITON_ATTN", 10, 10, None, verdict,
                   None, None, None)


def test_explanations_are_fixed_sentences():
    fix = UpstreamChange("k", "0.33.0", ("gemm",), "changed", "s", "#1", "src")
    open_ = UpstreamChange("o", "0.33.0", ("attention:TRITON_ATTN",), "unchanged", "s", "#2", "src")
    base = ArmChange(_side(), _side(), None, False, False, False, False, ())
    assert base.explanation() == "unchanged"
    assert dataclasses.replace(base, match_changed=True).explanation() == (
        "changed; no upstream change in bistat's table touches what it ran: unexplained")
    assert dataclasses.replace(base, match_changed=True, upstream=(fix,)).explanation() == (
        "changed; upstream changes touching what it ran: #1 (a candidate explanation, not a "
        "tested one)")
    assert dataclasses.replace(base, upstream=(fix,)).explanation() == (
        "unchanged although upstream changed what it ran (#1): no visible effect here")
    assert dataclasses.replace(base, upstream=(fix, open_)).explanation() == (
        "unchanged, as the upstream problem left open implies: #2")


def test_the_upstream_table_is_well_formed_and_bad_entries_are_refused():
    table = load_upstream_changes()
    assert [u.key for u in table] == ["determinism-module", "hopper-cublas-workspace",
                                      "hopper-tuned-tables", "breakable-cudagraphs",
                                      "fa3-head-size-64"]
    assert all(u.source and u.reference for u in table)
    assert [u.kind for u in table] == ["changed", "changed", "changed", "changed", "unchanged"]
    with pytest.raises(VersionCompareError, match=r"change\[0\]: missing 'source'"):
        load_upstream_changes('[[change]]\nkey="a"\nintroduced="1"\ncomponents=[]\nkind="changed"\n'
                              'summary="s"\nreference="r"\n')
    with pytest.raises(VersionCompareError, match=r"change\[0\].kind: 'fixed'"):
        load_upstream_changes('[[change]]\nkey="a"\nintroduced="1"\ncomponents=[]\nkind="fixed"\n'
                              'summary="s"\nreference="r"\nsource="x"\n')


def test_two_runs_without_a_gpu_are_not_said_to_be_on_gpus_of_the_same_model():
    """A comparison of two CPU runs (here the committed quickstart-r2 run with itself: no
    difference of design) says they ran without a GPU, not "on GPUs of the same model"."""
    from bistat.report.finding import render_version_comparison

    run = ROOT / "examples" / "quickstart" / "quickstart-r2-20261202T132827Z"
    s = analyze_run(run, ROOT / "preregistrations" / "quickstart-r2.json")
    vc = compare_versions(s, s)
    assert vc.earlier_gpus == vc.later_gpus == () and vc.notes == ()
    text = render_version_comparison(vc)
    section = text[text.index("## Differences of design"):]
    assert section.splitlines()[2] == "None: the same workload, both runs without a GPU."
    assert "GPUs of the same model" not in text
