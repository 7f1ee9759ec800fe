"""``bistat index``: the findings index, and the README's results at a glance."""

from __future__ import annotations

import click

from bistat.report.index import index_options, write_index


def register(group: click.Group) -> None:
    @group.command("index")
    @click.argument("findings_dir", default="findings",
                    type=click.Path(exists=True, file_okay=False))
    @click.option("--registrations", "registrations_dir",
                  type=click.Path(exists=True, file_okay=False),
                  help="The sealed registrations' folder: the answers above the listing (each "
                       "run's setting and workload come from its registration), and the "
                       "registrations that have no finding.")
    @click.option("--reasons", "reasons_path", type=click.Path(exists=True, dir_okay=False),
                  help="TOML file whose [not_run] table says why each of them has none "
                       "(NAME = \"reason\").")
    @click.option("--readme", "readme", type=click.Path(exists=True, dir_okay=False),
                  help="Also rewrite this file's results at a glance (at most 8 of the answers' "
                       "rows, between its two marker lines); needs --registrations.")
    def index(findings_dir: str, registrations_dir: str | None, reasons_path: str | None,
              readme: str | None) -> None:
        """Write FINDINGS_DIR/README.md: every finding below it with its verdicts (and, with
        --registrations, the answers first: one table per engine release and GPU, one row per
        model, head size, attention backend, setting and workload; then every registration
        still without a finding, and why).

        The index records the options it was written with; without options, bistat index
        writes it whole again with those (and refuses an index that has the answers but
        records no options, rather than delete them). Findings under FINDINGS_DIR/local (a
        machine's own runs, where bistat analyze writes by default) are never indexed.
        """
        try:
            if registrations_dir is None and reasons_path is None and readme is None:
                recorded = index_options(findings_dir)
                if recorded is not None and recorded.flags():
                    click.echo(f"with the options {findings_dir}/README.md was written with: "
                               f"{recorded.flags()}")
                    registrations_dir, reasons_path, readme = (
                        recorded.registrations_dir, recorded.reasons_path, recorded.readme)
            out = write_index(findings_dir, registrations_dir, reasons_path, readme)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"wrote {out}")
        if readme is not None:
            click.echo(f"wrote {readme}: the results at a glance")
