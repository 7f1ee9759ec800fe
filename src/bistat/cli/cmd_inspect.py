"""``bistat inspect RUN_DIR``: what a run holds, its schema version, its registration, its gaps.

Thin command over :func:`bistat.explain.inspect_run.inspect_run`. Exit code 0; 1 when RUN_DIR is not a
readable run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bistat.store.format import RecordsError

__all__ = ["register"]


def register(group: click.Group) -> None:
    """Add ``inspect`` to the ``bistat`` group."""

    @group.command("inspect")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON.")
    def inspect_cmd(run_dir: Path, as_json: bool) -> None:
        """Show what the run RUN_DIR holds: tables, passes, registration, gaps, failed requests."""
        from bistat.explain.inspect_run import inspect_run, render_inspection

        try:
            ins = inspect_run(run_dir)
        except RecordsError as exc:
            raise click.ClickException(str(exc)) from exc
        if as_json:
            click.echo(json.dumps(ins.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(render_inspection(ins), nl=False)
