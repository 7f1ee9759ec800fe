"""The README's determinism-tax table: tax studies found by their arms, costs and modes read from
their findings, studies without a finding listed as registered and not run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bistat.report.index_findings import IndexedFinding, FindingSummary, SummaryRow, read_findings
from bistat.report.index_registrations import load_registrations, newest_releases
from bistat.report.index_tax import render_tax, tax_arms, tax_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def committed():
    registrations = load_registrations(ROOT / "preregistrations")
    findings, _ = read_findings(ROOT / "findings")
    return findings, registrations, newest_releases(registrations)


@pytest.mark.parametrize("name, arms", [
    ("h200-v034-tax-qwen3-8b-b8", ("batch-invariant", "bi-plugin")),
    ("h100-v034-tax-qwen3-17b-b8", ("batch-invariant", "bi-plugin")),
    ("h200-v034-match-smollm2", ("batch-invariant", "bi-plugin")),
    # the tuned GEMM compiled, no FA3 pin at head size 128: still the plugin as recommended
    ("h200-v034-match-qwen3-8b-synth", ("batch-invariant", "bi-tuned-gemm-compiled")),
    # no arm as vLLM ships it: not a tax study
    ("h200-v034-i23-latency-qwen3-8b-b8-compiled", None),
    # SGLang: its deterministic mode is not vLLM's
    ("h100-sglang-match-smollm2", None),
])
def test_tax_studies_are_found_by_their_arms(committed, name, arms):
    assert tax_arms(committed[1][name].experiment()) == arms


def test_the_committed_tax_rows(committed):
    findings, registrations, newest = committed
    rows = tax_rows(findings, registrations, newest)
    ran = {r.registration: r for r in rows if r.finding is not None}
    assert set(ran) == {"h100-v034-match-smollm2", "h200-v034-match-smollm2"}
    h100 = ran["h100-v034-match-smollm2"]
    assert (h100.gpu, h100.shipped_row.ratio, h100.plugin_row.ratio) == (
        "NVIDIA H100 80GB HBM3", "1.0121", "0.9341")
    assert h100.shipped_mode == h100.plugin_mode == "torch.compile (VLLM_COMPILE), FULL_AND_PIECEWISE"
    waiting = [r.registration for r in rows if r.finding is None]
    # every tax study on 0.34.0 without a finding, and none with one (the -hac sibling's
    # exploratory finding means it ran); no older release
    assert sorted(waiting) == sorted(
        [f"{c}-v034-tax-{w}" for c in ("h100", "h200")
         for w in ("qwen3-8b-b8", "qwen3-8b-b32", "qwen3-17b-b8")]
        + ["h200-v034-tax-qwen3-8b-throughput", "h100-v034-match-qwen3-8b-synth",
           "h200-v034-match-qwen3-8b-synth"])
    # one batch before changing batches, smaller loads first
    assert [r.under_load for r in rows] == sorted(r.under_load for r in rows)


def test_a_tax_study_with_a_finding_shows_its_costs_and_modes(committed, tmp_path):
    """A finding of h200-v034-tax-qwen3-8b-b8 (made here): its two treatments' costs and each
    arm's logged mode fill its row; the study leaves the not-run list."""
    findings, registrations, newest = committed
    row = lambda arm, cost, ratio, iv: SummaryRow(arm, "default", "vllm-offline, FLASH_ATTN (FA3)",
                                                  "*reported as observed*", "8 / 8", "[0.6, 1]",
                                                  cost, ratio, iv)
    fake = IndexedFinding(
        tmp_path / "h200-v034-tax-qwen3-8b-b8.md", "h200-v034-tax-qwen3-8b-b8",
        (("batch-invariant", "default", "reported as observed"),), "h",
        FindingSummary("vLLM 0.34.0", "NVIDIA H200", "/tmp/model/qwen3-8b-config", "tax-b8",
                       "r", "confirmatory",
                       (row("batch-invariant", "costs (latency)", "1.0800", "[1.0700, 1.0900]"),
                        row("bi-plugin", "no measurable cost (latency)", "0.9800",
                            "[0.9700, 0.9900]"))),
        "2026-12-08T00:00:00Z", 1,
        (("default", "torch.compile (VLLM_COMPILE), FULL_AND_PIECEWISE"),
         ("batch-invariant", "no torch.compile (NONE), FULL_AND_PIECEWISE, breakable"),
         ("bi-plugin", "torch.compile (VLLM_COMPILE), FULL_AND_PIECEWISE")))
    rows = tax_rows([*findings, fake], registrations, newest)
    mine = next(r for r in rows if r.registration == "h200-v034-tax-qwen3-8b-b8")
    assert mine.finding is fake and mine.shipped_mode.endswith("breakable")
    text = "\n".join(render_tax(rows, tmp_path, newest["vllm"]))
    assert ("| [h200-v034-tax-qwen3-8b-b8](h200-v034-tax-qwen3-8b-b8.md) | NVIDIA H200 | Qwen3-8B "
            "shape (36 layers, dummy weights) | one batch of 8, 128 tokens | costs (latency): "
            "1.0800 [1.0700, 1.0900] | no torch.compile (NONE), FULL_AND_PIECEWISE, breakable | "
            "no measurable cost (latency): 0.9800 [0.9700, 0.9900] | torch.compile "
            "(VLLM_COMPILE), FULL_AND_PIECEWISE |") in text
    not_run = text[text.index("Registered before any data, not run yet"):]
    assert "h200-v034-tax-qwen3-8b-b8]" not in not_run and "h100-v034-tax-qwen3-8b-b8]" in not_run
    # on a newer vLLM release, studies of 0.34.0 no longer answer: the table is empty
    newer = {**newest, "vllm": dataclasses.replace(newest["vllm"], version="0.35.0")}
    assert tax_rows([*findings, fake], registrations, newer) == []
    assert render_tax([], tmp_path, newer["vllm"]) == []


def test_the_readme_holds_the_tax_table():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("**The determinism tax on vLLM 0.34.0"):
                 text.index("<!-- end of the results at a glance -->")]
    assert "| [h200-v034-match-smollm2](findings/h200/h200-v034-match-smollm2.md) | NVIDIA H200 |" \
        in block
    assert "[h200-v034-tax-qwen3-8b-throughput](preregistrations/" in block
