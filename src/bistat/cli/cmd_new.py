"""``bistat new NAME``: write a commented declaration that uses the default decision rule."""

from __future__ import annotations

from pathlib import Path

import click


def register(group: click.Group) -> None:
    """Add ``new`` to the ``bistat`` group."""

    @group.command("new")
    @click.argument("name")
    @click.option("--experiments-dir", default="experiments", show_default=True,
                  type=click.Path(file_okay=False, path_type=Path),
                  help="Where the declaration is written.")
    def new_cmd(name: str, experiments_dir: Path) -> None:
        """Write EXPERIMENTS_DIR/NAME.toml: a commented declaration with the default rule.

        The default rule calls batch invariance working from evidence that the mode acts (the
        control diverges under the same load, the treatment beats it prompt by prompt), never
        from a slowdown, and states the cost (throughput ratio against +/- 10 %) as a verdict of
        its own. As written the declaration runs on any CPU (the embedded engine); edit it, then
        `bistat design` and `bistat register` it. An existing file is never overwritten.
        """
        from bistat.declare.template import write_declaration

        try:
            path = write_declaration(name, experiments_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        except FileExistsError as exc:
            raise click.ClickException(
                f"{Path(experiments_dir) / f'{name}.toml'} already exists; a declaration is never "
                "overwritten: choose another NAME or edit the file") from exc
        click.echo(f"wrote {path}\nnext: bistat design {path}  (then: bistat register {path})")
