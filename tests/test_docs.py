"""The CLI reference (docs/CLI.md) is generated from the real --help and must be current."""

import subprocess
import sys
from pathlib import Path

import click

from bistat.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    result = subprocess.run([sys.executable, "-m", "cogapp", "--check", "docs/CLI.md"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        "docs/CLI.md is out of date; run `cog -r docs/CLI.md`\n" + result.stdout + result.stderr)


def test_declaration_reference_is_current():
    result = subprocess.run([sys.executable, "-m", "cogapp", "--check", "docs/DECLARATION.md"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (
        "docs/DECLARATION.md is out of date; run `cog -r docs/DECLARATION.md`\n" + result.stdout
        + result.stderr)
    text = (ROOT / "docs" / "DECLARATION.md").read_text()
    assert "| `passes` | int | **required** | counted passes per arm |" in text
    assert '## rule.labels.all: criterion = "match_lower_bound"' in text


def test_every_command_has_help():
    def walk(group, prefix):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            yield " ".join(prefix + [name]), cmd
            if isinstance(cmd, click.Group):
                yield from walk(cmd, prefix + [name])

    missing = [name for name, cmd in walk(cli, []) if not (cmd.help or "").strip()]
    assert missing == []
