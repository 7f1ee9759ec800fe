"""``bistat doctor``: which engines are usable here, GPU and driver, versions, cache, models.

Thin command over :func:`bistat.explain.doctor.doctor`. Exit code 0 (the report is informational).
"""

from __future__ import annotations

import json

import click

__all__ = ["register"]


def register(group: click.Group) -> None:
    """Add ``doctor`` to the ``bistat`` group."""

    @group.command("doctor")
    @click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
    def doctor_cmd(as_json: bool) -> None:
        """Check this machine: usable engines (vLLM is looked up, never imported), GPUs and
        driver, package versions, the model cache and which registered models it holds."""
        from bistat.explain.doctor import doctor, render_doctor

        rep = doctor()
        if as_json:
            click.echo(json.dumps(rep.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(render_doctor(rep), nl=False)
