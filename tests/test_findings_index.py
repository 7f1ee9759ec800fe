from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cli
from bistat.findings_index import read_finding

ROOT = Path(__file__).resolve().parents[1]


def test_index_lists_every_finding_with_its_verdicts(tmp_path):
    (tmp_path / "a.md").write_text((ROOT / "findings" / "synthetic-example.md").read_text())
    sub = tmp_path / "h200"
    sub.mkdir()
    (sub / "b.md").write_text(
        "# Finding: b\n\n## Hypothesis\n\n> It holds.\n\n## Verdict\n\n"
        "### x (treatment) vs c (control): **untested**\n\n"
        "### y (treatment) vs c (control): **reported as observed**\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0
    assert (tmp_path / "README.md").read_text().splitlines()[4:] == [
        "| finding | treatment vs control | verdict |",
        "|---|---|---|",
        "| [synthetic-example](a.md) | batch-invariant vs default | *working* |",
        "| [b](h200/b.md) | x vs c | *untested* |",
        "|  | y vs c | *reported as observed* |",
    ]
    assert read_finding(sub / "b.md").hypothesis == "It holds."


def test_a_file_without_verdicts_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\n")
    result = CliRunner().invoke(cli, ["index", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'notes.md'}: no verdict heading found; is it a "
                             "finding written by `bistat analyze`?\n")
