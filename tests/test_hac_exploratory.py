"""The HAC interval applied to the committed cost studies as exploratory analyses: the
declarations scripts/hac_declarations.py writes, the findings they give, where a cost verdict
would change (docs/COST-INTERVALS.md's and docs/STUDIES.md's tables), and how the index shows
them (``bistat.report.index.interval_readings``: the per-run listing names each HAC reading and
marks a verdict that changes)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cli
from bistat.report.index import (interval_readings, load_registrations, read_finding,
                                 read_findings)

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = ROOT / "findings"


def _script():
    spec = importlib.util.spec_from_file_location("hac_declarations",
                                                  ROOT / "scripts" / "hac_declarations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def committed():
    findings, _ = read_findings(FINDINGS)
    registrations = load_registrations(ROOT / "preregistrations")
    return {f.name: f for f in findings}, interval_readings(findings, registrations)


def _outcome(cost: str) -> str:
    return cost.rsplit(" (", 1)[0]


def test_the_script_writes_the_committed_declarations():
    """Each experiments/NAME-hac.toml is what scripts/hac_declarations.py writes, and passes its
    check (a sibling of the run's declaration with the varied rule's cost interval hac)."""
    hac = _script()
    assert len(hac.STUDIES) == 19
    for run, base in hac.STUDIES.items():
        path = ROOT / "experiments" / f"{run}-hac.toml"
        assert path.read_text(encoding="utf-8") == hac.hac_text(run, base), path.name
        assert hac.check(run, base) is None
        cost = tomllib.loads(path.read_text(encoding="utf-8"))["rule"]["cost"]
        assert (cost["interval"], cost["hac_kernel"], cost["hac_bandwidth"]) == (
            "hac", "cosine", "llsw")


def test_each_hac_finding_is_exploratory_and_read_against_the_rule_it_varies(committed):
    by_name, readings = committed
    hac = _script()
    assert {name: r.base for name, r in readings.items()} == {
        f"{run}-hac": base for run, base in hac.STUDIES.items()}
    for name, r in readings.items():
        f = by_name[name]
        assert f.summary.analysis == "exploratory" and r.interval == "hac"
        assert r.base_interval == ("paired" if r.base in (
            "h200-v034-i23-throughput-qwen3-8b-paired", "h200-v034-match-smollm2") else "welch")
        first = f.path.read_text(encoding="utf-8").split("\n", 1)[0]
        assert first == f"# Finding: {name} — exploratory analysis, not a test of the hypothesis"
        assert f.summary.run == by_name[r.base].summary.run


def test_the_paired_runs_hac_reading_states_its_interval_and_its_make_up(committed):
    by_name, _ = committed
    text = by_name["h200-v034-i23-throughput-qwen3-8b-paired-hac"].path.read_text(encoding="utf-8")
    assert ("Exploratory verdict: **reported as observed** — cost undecidable at 32 pairs of "
            "passes (ratio 0.954, 95 % interval 0.90–1.01; no number of pairs of passes up to 200 "
            "would decide it at this ratio) (bi-tuned-gemm-compiled vs default).") in text
    assert ("| bi-tuned-gemm-compiled ÷ default | 0.9544 | [0.9043, 1.0073] | 32 | 4 | 2.776 | "
            "1.66 |") in text
    assert ("| bi-tuned-gemm-compiled ÷ default | 0.36 | 32 | 94.4 % | holds at this estimate |"
            in text)


def _doc_rows(path: Path, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with ``first_header``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first_header))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip().startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _cell(row) -> str:
    """A Summary row's cost as the docs' table gives it: its outcome and interval."""
    o = _outcome(row.cost)
    return o if row.cost_interval == "—" else f"{o} {row.cost_interval}"


def test_the_cost_intervals_doc_table_is_the_findings(committed):
    """docs/COST-INTERVALS.md, "On the committed studies": every comparison of every HAC reading,
    its pairs (the finding's serial-correlation table), the varied rule's cost and the HAC cost
    (the two findings' Summary rows), and the 9 changes among 34 assessed comparisons."""
    by_name, readings = committed
    rows = _doc_rows(ROOT / "docs" / "COST-INTERVALS.md", "| run | treatment vs control | pairs")
    run = None
    seen = []
    for cells in rows:
        run = cells[0].strip("`") or run
        treatment, control = cells[1].split(" vs ")
        hac = by_name[f"{run}-hac"]
        base = by_name[readings[hac.name].base]
        mine = next(r for r in hac.summary.rows if (r.treatment, r.control) == (treatment, control))
        theirs = next(r for r in base.summary.rows
                      if (r.treatment, r.control) == (treatment, control))
        text = hac.path.read_text(encoding="utf-8")
        pairs = re.search(rf"^\| {re.escape(treatment)} ÷ {re.escape(control)}, pair differences"
                          rf" \| (\d+) \|", text, re.M)[1]
        kind = ("exploratory default rule" if base.name.endswith("-exploratory")
                else "its own rule")
        interval = {"welch": "Welch", "paired": "paired"}[readings[hac.name].base_interval]
        changes = "**changes**" if _outcome(mine.cost) != _outcome(theirs.cost) else ""
        assert cells[2:] == [pairs, f"{interval} ({kind})", _cell(theirs), _cell(mine), changes]
        seen.append((hac.name, treatment, control))
    assert sorted(seen) == sorted((name, r.treatment, r.control) for name in readings
                                  for r in by_name[name].summary.rows)
    assessed = [c for c in rows if c[4] != "untested"]
    assert (len(rows), len(assessed), sum(c[6] == "**changes**" for c in rows)) == (37, 34, 9)


def test_the_studies_doc_lists_the_nine_changes(committed):
    by_name, readings = committed
    rows = _doc_rows(ROOT / "docs" / "STUDIES.md", "| run | treatment vs control | pairs")
    assert len(rows) == 9
    run = None
    for cells in rows:
        run = cells[0].split("`")[1] if cells[0] else run
        treatment, control = cells[1].split(" vs ")
        mine = next(r for r in by_name[f"{run}-hac"].summary.rows
                    if (r.treatment, r.control) == (treatment, control))
        theirs = next(r for r in by_name[readings[f"{run}-hac"].base].summary.rows
                      if (r.treatment, r.control) == (treatment, control))
        assert cells[4].startswith(_outcome(theirs.cost) + " (")
        assert cells[5].startswith(_outcome(mine.cost) + " (")
        assert _outcome(mine.cost) != _outcome(theirs.cost)


def test_the_index_lists_each_hac_reading_and_marks_the_changes():
    text = (FINDINGS / "README.md").read_text(encoding="utf-8")
    marked = [line for line in text.splitlines() if "**changes**" in line]
    assert len(marked) == 9
    assert ("|  | `/tmp/model/smollm2` | bi-triton-attn vs default | vllm-server, TRITON_ATTN | "
            "*working* | 541 / 541 | [0.9929, 1.0000] | no measurable cost (throughput): "
            "**changes** (was undecidable with the Welch interval) | 0.9486 | [0.9241, 0.9737] | "
            "[h200-v033-match-smollm2-hac](h200/h200-v033-match-smollm2-hac.md) (exploratory; HAC "
            "reading of [h200-v033-match-smollm2](h200/h200-v033-match-smollm2.md)) |") in marked
    assert sum("(exploratory; HAC reading of [" in line for line in text.splitlines()) == 37
    # the answers keep the newest confirmatory rule: no HAC reading among them
    answers = text[:text.index("## Every run under every rule")]
    assert "-hac.md)" not in answers and "-hac](" not in answers


def test_a_reading_under_another_interval_is_marked_only_where_the_outcome_differs(tmp_path):
    """Two registrations of one declaration whose rules differ only in the cost interval, and a
    third whose rule differs otherwise: the HAC one reads the Welch one; rows whose cost outcome
    differs say so, rows whose outcome is the same do not."""
    from bistat.declare.prereg import register

    regs = tmp_path / "preregistrations"
    regs.mkdir()
    text = (ROOT / "experiments" / "quickstart-r2.toml").read_text(encoding="utf-8")
    assert 'interval = "hac"' not in text and "[rule.cost]" in text
    variants = {"s": "", "s-hac": 'interval = "hac"\n',
                "s-other": 'interval = "hac"\n'}
    for name, extra in variants.items():
        body = text.replace('name = "quickstart-r2"', f'name = "{name}"')
        body = body.replace("[rule.cost]\n", f"[rule.cost]\n{extra}")
        if name == "s-other":
            body = body.replace("margin = 0.10", "margin = 0.20")
        (tmp_path / f"{name}.toml").write_text(body, encoding="utf-8")
        register(tmp_path / f"{name}.toml", registrations_dir=regs)
    findings = tmp_path / "findings"
    findings.mkdir()
    row = ("| invariant | blas | embedded, gemm invariant | *working* | 288 / 288 | "
           "[0.9868, 1.0000] | {} | 1.3335 | [1.1309, 1.5723] |")
    from test_findings_index import _finding
    (findings / "s.md").write_text(_finding("s", "s", "confirmatory",
                                            [row.format("undecidable (throughput)")], run="q"))
    (findings / "s-hac.md").write_text(_finding("s-hac", "s-hac", "exploratory",
                                                [row.format("faster (throughput)")], run="q"))
    (findings / "s-other.md").write_text(_finding("s-other", "s-other", "exploratory",
                                                  [row.format("faster (throughput)")], run="q"))
    found, _ = read_findings(findings)
    readings = interval_readings(found, load_registrations(regs))
    assert {n: (r.base, r.base_interval, r.interval) for n, r in readings.items()} == {
        "s-hac": ("s", "welch", "hac")}
    result = CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = (findings / "README.md").read_text(encoding="utf-8").splitlines()
    hac_row = next(line for line in lines if "[s-hac](s-hac.md)" in line)
    assert hac_row.endswith("| faster (throughput): **changes** (was undecidable with the Welch "
                            "interval) | 1.3335 | [1.1309, 1.5723] | [s-hac](s-hac.md) "
                            "(exploratory; HAC reading of [s](s.md)) |")
    other = next(line for line in lines if "[s-other](s-other.md)" in line)
    assert "**changes**" not in other and other.endswith("[s-other](s-other.md) (exploratory) |")
    # the same outcome is not marked
    (findings / "s.md").write_text(_finding("s", "s", "confirmatory",
                                            [row.format("faster (throughput)")], run="q"))
    CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs)],
                       catch_exceptions=False)
    hac_row = next(line for line in (findings / "README.md").read_text().splitlines()
                   if "[s-hac](s-hac.md)" in line)
    assert "**changes**" not in hac_row and "(exploratory; HAC reading of [s](s.md))" in hac_row
