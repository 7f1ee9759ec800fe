"""``bistat index``: the findings index."""

from __future__ import annotations

import click

from bistat.report.index import write_index


def register(group: click.Group) -> None:
    @group.command("index")
    @click.argument("findings_dir", default="findings",
                    type=click.Path(exists=True, file_okay=False))
    @click.option("--registrations", "registrations_dir",
                  type=click.Path(exists=True, file_okay=False),
                  help="Also list the sealed registrations in this folder that have no finding.")
    @click.option("--reasons", "reasons_path", type=click.Path(exists=True, dir_okay=False),
                  help="TOML file whose [not_run] table says why each of them has none "
                       "(NAME = \"reason\").")
    def index(findings_dir: str, registrations_dir: str | None, reasons_path: str | None) -> None:
        """Write FINDINGS_DIR/README.md: every finding below it with its verdicts (and, with
        --registrations, every registration still without one, and why)."""
        try:
            out = write_index(findings_dir, registrations_dir, reasons_path)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"wrote {out}")
