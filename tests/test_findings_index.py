import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cli
from bistat.report.index import read_finding

ROOT = Path(__file__).resolve().parents[1]


def _finding(name: str, rule: str, analysis: str, rows: list[str], engine: str = "vLLM 0.25.0",
             gpu: str = "NVIDIA H200", run: str = "r1") -> str:
    """A finding as bistat.report.finding writes its head, Summary and verdict headings."""
    title = f"# Finding: {name}" + (" — exploratory analysis, not a test of the hypothesis"
                                    if analysis == "exploratory" else "")
    heads = "".join(f"### {r.split(' | ')[0].strip('| ')} (treatment) vs "
                    f"{r.split(' | ')[1]} (control): **{r.split(' | ')[3].strip('*')}**\n\n"
                    for r in rows)
    return (f"{title}\n\nVerdict: ...\n\n## Hypothesis\n\n> It holds.\n\n## Summary\n\n"
            f"Engine: {engine} · GPU: {gpu} · model: `m` · run: `{run}` · rule: "
            f"`preregistrations/{rule}.json` ({analysis})\n\n"
            "| treatment | control | backend | invariant? | matched / compared | 95 % interval | "
            "cost | ratio | interval |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + f"\n\n## Verdict\n\n{heads}")


def test_index_has_one_table_per_engine_and_gpu_with_the_rule_in_each_row(tmp_path):
    sub = tmp_path / "h200"
    sub.mkdir()
    bi = ("| bi | default | vllm-server, TRITON_ATTN | *{label}* | 541 / 541 | [0.9929, 1.0000] | "
          "{cost} | {ratio} | {iv} |")
    (sub / "s.md").write_text(_finding("s", "s", "confirmatory", [bi.format(
        label="reported as observed", cost="— (no cost rule)", ratio="0.9690",
        iv="[0.8780, 1.0690]")]))
    (sub / "s-exploratory.md").write_text(_finding("s-exploratory", "s-exploratory",
                                                   "exploratory", [bi.format(
        label="working", cost="undecidable (throughput)", ratio="0.9690",
        iv="[0.8780, 1.0690]")]))
    (tmp_path / "q.md").write_text(_finding(
        "q", "q", "confirmatory", ["| inv | blas | embedded, gemm invariant | *working* | "
                                   "288 / 288 | [0.9868, 1.0000] | costs (throughput) | 0.7400 | "
                                   "[0.6900, 0.8000] |"], engine="embedded 0.1.0", gpu="no GPU",
        run="q1"))
    (sub / "b.md").write_text(
        "# Finding: b\n\n## Hypothesis\n\n> It holds.\n\n## Verdict\n\n"
        "### x (treatment) vs c (control): **untested**\n\n"
        "### y (treatment) vs c (control): **reported as observed**\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0
    lines = (tmp_path / "README.md").read_text().splitlines()
    body = lines[lines.index("## embedded 0.1.0 on no GPU"):]
    assert body == [
        "## embedded 0.1.0 on no GPU", "",
        "| run | model | arm vs control | backend | invariant? | matched / compared | interval | "
        "cost | ratio | interval | rule |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| `q1` | `m` | inv vs blas | embedded, gemm invariant | *working* | 288 / 288 | "
        "[0.9868, 1.0000] | costs (throughput) | 0.7400 | [0.6900, 0.8000] | [q](q.md) "
        "(confirmatory) |", "",
        "## vLLM 0.25.0 on NVIDIA H200", "",
        "| run | model | arm vs control | backend | invariant? | matched / compared | interval | "
        "cost | ratio | interval | rule |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| `r1` | `m` | bi vs default | vllm-server, TRITON_ATTN | *reported as observed* | "
        "541 / 541 | [0.9929, 1.0000] | — (no cost rule) | 0.9690 | [0.8780, 1.0690] | "
        "[s](h200/s.md) (confirmatory) |",
        "|  | `m` | bi vs default | vllm-server, TRITON_ATTN | *working* | 541 / 541 | "
        "[0.9929, 1.0000] | undecidable (throughput) | 0.9690 | [0.8780, 1.0690] | "
        "[s-exploratory](h200/s-exploratory.md) (exploratory) |", "",
        "## Findings without a summary", "",
        "Written before findings carried a Summary section; their verdicts as headed.", "",
        "| finding | treatment vs control | verdict |",
        "|---|---|---|",
        "| [b](h200/b.md) | x vs c | *untested* |",
        "|  | y vs c | *reported as observed* |"]
    assert read_finding(sub / "b.md").hypothesis == "It holds."
    assert read_finding(sub / "s-exploratory.md").name == "s-exploratory"
    assert read_finding(sub / "s-exploratory.md").summary.analysis == "exploratory"


def test_a_file_without_verdicts_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'notes.md'}: no verdict heading found; is it a "
                             "finding written by `bistat analyze`?\n")


@pytest.fixture(scope="module")
def regs(tmp_path_factory):
    """Sealed registrations of the quickstart declaration named done, later and silent."""
    import tomllib

    from bistat.declare.prereg import register

    tmp = tmp_path_factory.mktemp("regs")
    regs = tmp / "preregistrations"
    regs.mkdir()
    text = (ROOT / "experiments" / "quickstart.toml").read_text()
    for name in ["done", "later", "silent"]:
        decl = tmp / f"{name}.toml"
        decl.write_text(text.replace('name = "quickstart"', f'name = "{name}"'))
        assert tomllib.loads(decl.read_text())["name"] == name
        register(decl, registrations_dir=regs)
    return regs


def _findings(tmp_path, regs):
    """A findings folder holding a finding named done, beside a copy of ``regs``."""
    import shutil

    findings = tmp_path / "findings"
    findings.mkdir()
    (findings / "a.md").write_text(
        "# Finding: done\n\n## Verdict\n\n### x (treatment) vs c (control): **working**\n")
    shutil.copytree(regs, tmp_path / "preregistrations")
    return findings, tmp_path / "preregistrations"


def test_registrations_without_a_finding_are_listed_with_their_reasons(tmp_path, regs):
    findings, regs = _findings(tmp_path, regs)
    reasons = tmp_path / "not-run.toml"
    reasons.write_text('[not_run]\nlater = "device time"\n')
    result = CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs),
                                      "--reasons", str(reasons)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = (findings / "README.md").read_text().splitlines()
    tail = lines[lines.index("## Registered, no finding yet"):]
    assert tail[2] == ("Sealed before any data and not run (or not analysed) so far; the reason as "
                       f"stated by the people running the studies (`{reasons.as_posix()}`).")
    assert [row.split(" | ")[0::2] for row in tail[6:]] == [
        ["| [later](../preregistrations/later.json)", "device time |"],
        ["| [silent](../preregistrations/silent.json)", "*no reason stated* |"]]
    # without --registrations the index is as before
    CliRunner().invoke(cli, ["index", str(findings)], catch_exceptions=False)
    assert "## Registered, no finding yet" not in (findings / "README.md").read_text()


@pytest.mark.parametrize("toml, message", [
    ('[not_run]\ndone = "x"\n', "not_run.done is stated, but done has a finding; remove the line"),
    ('[not_run]\nnope = "x"\n', "not_run.nope names no registration in {regs}; fix the name or "
                                "remove the line"),
    ('[not_run]\nlater = ""\n', "field not_run.later must be a non-empty string"),
    ('later = "x"\n', "expected one table [not_run] of NAME = \"reason\" lines, got later"),
    ("[not_run\n", "not a readable TOML file"),
])
def test_bad_reasons_name_the_file_and_the_field(tmp_path, regs, toml, message):
    findings, regs = _findings(tmp_path, regs)
    reasons = tmp_path / "not-run.toml"
    reasons.write_text(toml)
    result = CliRunner().invoke(cli, ["index", str(findings), "--registrations", str(regs),
                                      "--reasons", str(reasons)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {reasons.as_posix()}: ")
    assert message.format(regs=regs) in result.output


def test_the_committed_index_is_current(tmp_path, monkeypatch):
    """findings/README.md as `bistat index findings --registrations preregistrations --reasons
    findings/not-run.toml` writes it (from the repository root)."""
    import shutil

    from bistat.report.index import write_index

    monkeypatch.chdir(ROOT)
    copy = tmp_path / "findings"
    shutil.copytree(ROOT / "findings", copy, ignore=shutil.ignore_patterns("*.png", "local"))
    out = write_index(copy, "preregistrations", "findings/not-run.toml")
    fresh = out.read_text().replace(Path(os.path.relpath(ROOT / "preregistrations", copy)).as_posix(),
                                    "../preregistrations")
    assert fresh == (ROOT / "findings" / "README.md").read_text()
