"""``bistat diagnose RUN_DIR``: rank the likely causes of a run's divergences, with evidence.

Thin command over :func:`bistat.explain.diagnose.diagnose_run`. Exit code 0 (also when there is nothing
to diagnose); 1 when the run cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bistat.store.format import RecordsError

__all__ = ["register"]


def register(group: click.Group) -> None:
    """Add ``diagnose`` to the ``bistat`` group."""

    @group.command("diagnose")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--probe", "probes", multiple=True,
                  type=click.Path(exists=True, dir_okay=False, path_type=Path),
                  help="A `bistat probe --output` report to weigh (repeatable; RUN_DIR/probe*.json "
                       "are read too).")
    @click.option("--epsilon", type=click.FloatRange(min=0.0), default=None,
                  help="Near-tie ε in nats [default: the registration's match.near_tie_epsilon, "
                       "else 0.125].")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print the diagnosis (with the divergence anatomy) as JSON.")
    def diagnose(run_dir: Path, probes: tuple[Path, ...], epsilon: float | None,
                 as_json: bool) -> None:
        """Rank the likely causes of RUN_DIR's divergences, with the evidence for each.

        Causes weighed: the engine refusing the setting, environment or version differences,
        batch-shape dependence, the setting not taking effect, near-tie instability,
        prefix-cache state, tokenization, the attention kernel's KV tile changing with the
        batch (first divergences all one key past a power-of-two KV length). A run in which
        nothing diverged has nothing to diagnose, and the command says so.
        """
        from bistat.explain.diagnose import diagnose_run, render_diagnosis

        try:
            result = diagnose_run(run_dir, probe_reports=probes, epsilon=epsilon)
        except (RecordsError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        if as_json:
            click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(render_diagnosis(result), nl=False)
