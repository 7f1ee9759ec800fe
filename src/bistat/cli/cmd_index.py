"""``bistat index``: the findings index."""

from __future__ import annotations

import click

from bistat.findings_index import write_index


def register(group: click.Group) -> None:
    @group.command("index")
    @click.argument("findings_dir", default="findings",
                    type=click.Path(exists=True, file_okay=False))
    def index(findings_dir: str) -> None:
        """Write FINDINGS_DIR/README.md: every finding below it with its verdicts."""
        try:
            out = write_index(findings_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"wrote {out}")
