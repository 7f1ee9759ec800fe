"""The worked example: the committed synthetic run regenerates the committed finding byte for byte."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.image
import numpy as np
import pytest

from bistat.analysis.summary import analyze_run
from bistat.report.finding import write_finding
from bistat.report.seal import run_seal_evidence
from finding_seal import assert_same_finding

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "synthetic"
FINDINGS = ROOT / "findings"
NAME = "synthetic-example"
PLOTS = ("match", "throughput", "serial", "divergence", "running", "anatomy")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out1 = tmp_path_factory.mktemp("finding1")
    out2 = tmp_path_factory.mktemp("finding2")
    summary = analyze_run(EXAMPLE / "run", EXAMPLE / f"{NAME}.json")
    seal = run_seal_evidence(EXAMPLE / "run", EXAMPLE / f"{NAME}.json", summary.created_utc)
    write_finding(summary, out1, seal=seal)
    write_finding(analyze_run(EXAMPLE / "run", EXAMPLE / f"{NAME}.json"), out2, seal=seal)
    return summary, out1, out2


def test_committed_finding_is_regenerated_byte_for_byte(regenerated):
    """Every byte, and the seal line as this clone can state it (finding_seal)."""
    _, out, out2 = regenerated
    fresh = (out / f"{NAME}.md").read_bytes()
    assert fresh == (out2 / f"{NAME}.md").read_bytes()
    assert_same_finding(fresh.decode("utf-8"), (FINDINGS / f"{NAME}.md").read_text(encoding="utf-8"),
                        "findings/synthetic-example.md (bistat analyze examples/synthetic/run "
                        "--registration examples/synthetic/synthetic-example.json --out findings)")


#: the matplotlib release that drew the committed plots: with it they regenerate byte for byte
DRAWN_WITH = "3.11.2"
#: with another release, glyph edges and antialiasing may move (matplotlib bundles its own
#: FreeType build and hinting, which change between releases): at most this share of the pixels
#: may differ by more than PIXEL_STEP, and the images must have the same size. Two of these plots
#: of other data differ in about 10 % of their pixels (the test below), 20 times this share.
MAX_CHANGED_SHARE = 0.005
PIXEL_STEP = 16 / 255


def test_plots_are_byte_identical_when_regenerated(regenerated):
    _, out1, out2 = regenerated
    for plot in PLOTS:
        name = f"{NAME}-{plot}.png"
        fresh = (out1 / name).read_bytes()
        assert fresh == (out2 / name).read_bytes(), name
        if matplotlib.__version__ == DRAWN_WITH:
            assert fresh == (FINDINGS / name).read_bytes(), (
                f"findings/{name} is stale: regenerate it with "
                "`bistat analyze examples/synthetic/run --out findings`")
            continue
        committed = matplotlib.image.imread(FINDINGS / name)
        drawn = matplotlib.image.imread(out1 / name)
        assert committed.shape == drawn.shape, name
        changed = float((np.abs(committed - drawn).max(axis=-1) > PIXEL_STEP).mean())
        assert changed <= MAX_CHANGED_SHARE, (name, changed)


def test_the_pixel_tolerance_tells_another_plot_apart(regenerated):
    """The tolerance used with another matplotlib release still fails a plot of other data."""
    _, out, _ = regenerated
    a = matplotlib.image.imread(out / f"{NAME}-match.png")
    b = matplotlib.image.imread(out / f"{NAME}-throughput.png")
    assert a.shape == b.shape
    assert float((np.abs(a - b).max(axis=-1) > PIXEL_STEP).mean()) > 10 * MAX_CHANGED_SHARE


def test_finding_states_what_the_issue_requires(regenerated):
    summary, out, _ = regenerated
    text = (out / f"{NAME}.md").read_text(encoding="utf-8")
    for heading in ("## Hypothesis", "## Verdict", "## Decision rule (as registered)",
                    "## Amendments", "## Environment", "## Match", "## Throughput",
                    "## First divergences", "## Divergence anatomy", "## Batching", "## Validity checks",
                    "## Deviations", "## Not run"):
        assert f"\n{heading}\n" in text, heading
    assert f"| Registration SHA-256 | `{summary.registration_sha256}` |" in text
    assert "Verdict: **working** (batch-invariant vs default)." in text
    assert ("- arm default: 1 failed request(s) in counted passes; 1 prompt(s) excluded from "
            "matching") in text
    assert str(out) not in text and str(ROOT) not in text   # no machine-specific paths
    # the synthetic records hold no top-k logprobs: every divergence is located, none labelled
    assert ("| default | 16 | 0 (0 %) | 0 (0 %) | 0 (0 %) | 16 (100 %) | — | 6 [2, 10] | 50 % |"
            in text)
    assert "![Margins and positions at first divergence](synthetic-example-anatomy.png)" in text


def test_generator_reproduces_the_committed_records(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_run.py"),
                    "--out", str(tmp_path)], check=True, capture_output=True, cwd=ROOT)
    for table in ("schedule", "responses", "passes", "metrics", "environment", "events"):
        assert filecmp.cmp(tmp_path / "run" / f"{table}.jsonl",
                           EXAMPLE / "run" / f"{table}.jsonl", shallow=False), table
    assert (tmp_path / f"{NAME}.toml").read_bytes() == (EXAMPLE / f"{NAME}.toml").read_bytes()


def test_operator_notes_are_quoted_in_the_finding(tmp_path):
    """NOTES.md in a run directory appears, quoted line by line, after "Not run"; absent, no section."""
    import shutil

    from bistat.analysis.summary import analyze_run
    from bistat.report.finding import render_markdown

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    plain = render_markdown(analyze_run(run, reg))
    assert "## Operator's notes" not in plain
    (run / "NOTES.md").write_text("Stopped after 2 of 8 passes: device time ran out.\n\nSecond line.\n",
                                  encoding="utf-8")
    noted = render_markdown(analyze_run(run, reg))
    section = noted.split("## Operator's notes\n", 1)[1].split("## Data gaps", 1)[0]
    assert "> Stopped after 2 of 8 passes: device time ran out.\n>\n> Second line.\n" in section
    assert noted.index("## Not run") < noted.index("## Operator's notes") < noted.index("## Data gaps")
    assert noted.replace(noted[noted.index("## Operator's notes"):noted.index("## Data gaps")], "") == plain


def test_client_in_flight_is_the_time_weighted_mean_of_submitted_requests():
    import pandas as pd

    from bistat.analysis.passes import _client_in_flight

    frame = pd.DataFrame({"arm": ["a", "a", "a", "b"], "pass_index": [0, 0, 0, 0],
                          "t_submit": [0.0, 0.0, 1.0, 0.0], "t_done": [2.0, 1.0, 2.0, None]})
    # a: 2 + 1 + 1 = 4 request-seconds over a span of 2 s; b has no complete times
    assert _client_in_flight(frame) == {("a", 0): 2.0}
    assert _client_in_flight(frame.drop(columns=["t_done"])) == {}


def test_front_end_bound_runs_are_named_in_the_batching_section():
    """The committed first H200 attempt: ~60 in flight, 25-41 running (time-weighted, as the
    runner records it), none waiting."""
    text = (ROOT / "findings" / "h200" / "h200-match-smollm2.md").read_text()
    assert ("**The front end, not the engine, set the batch:** in counted passes the engine's "
            "running batch was 43%–69% of the requests in flight (lowest: batch-invariant pass 3 "
            "(schedule position 15)), with none waiting in its scheduler") in text
    quick = (ROOT / "findings" / "quickstart.md").read_text()
    assert "In counted passes the engine's running batch was 96%–98% of the requests in flight" in quick
    assert "front end, not the engine" not in quick


def test_offline_engine_runs_get_no_front_end_diagnosis():
    """vllm-offline has no API server: the latency study's 8-request passes must not be called
    front-end bound (its gauges read 0 before and after a short pass)."""
    text = (ROOT / "findings" / "h200" / "h200-cost-qwen3-8b-latency-b8.md").read_text()
    assert "front end, not the engine" not in text
    assert ("Engine kind vllm-offline: bistat hands requests straight to the engine (no API server)"
            in text)


def test_too_few_metric_samples_are_not_compared_with_requests_in_flight():
    import dataclasses

    from bistat.analysis.summary import analyze_run
    from bistat.report.finding import MIN_SAMPLES_FOR_SHARE, _batching

    s = analyze_run(ROOT / "examples" / "synthetic" / "run",
                    ROOT / "examples" / "synthetic" / "synthetic-example.json")
    assert any("running batch was" in line for line in _batching(s, "p.png"))
    few = dataclasses.replace(s, passes=tuple(dataclasses.replace(p, n_metric_samples=2)
                                              for p in s.passes))
    text = "\n".join(_batching(few, "p.png"))
    assert MIN_SAMPLES_FOR_SHARE == 4
    assert ("Too few engine metric samples to tell how the engine batched: every counted pass "
            "has at most 2 (at least 4 are needed;") in text
    assert "running batch was" not in text


def test_one_markdown_table_builder_serves_findings_anatomy_and_index():
    # the three generated pages used three builders; one now, so a cell reads alike everywhere
    from bistat.core.markdown import md_cell, md_row, md_table
    from bistat.report import anatomy, finding, index

    assert finding.md_table is md_table and finding.md_cell is md_cell
    assert anatomy.md_table is md_table and index.md_row is md_row
    assert md_table(("a", "b"), [(None, 0.5), ("x|y", False)]) == (
        "| a | b |\n|---|---|\n| — | 0.5 |\n| x\\|y | no |")
