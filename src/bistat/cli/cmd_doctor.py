"""``bistat doctor``: which engines are usable here, GPU and driver, versions, cache, models, and
the servers a killed run left running (stopped unless ``--leave-servers``).

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
    @click.option("--leave-servers", is_flag=True,
                  help="List the servers a killed bistat run left running without stopping "
                       "them.")
    def doctor_cmd(as_json: bool, leave_servers: bool) -> None:
        """Check this machine: usable engines (vLLM is looked up, never imported), GPUs and
        driver, package versions, the model cache and which registered models it holds.

        Servers that a bistat run started and that outlived it (its process killed, and its
        servers' watchdogs too) are found by the mark bistat puts in their environment and
        stopped (their process group: SIGTERM, then SIGKILL), unless --leave-servers.
        """
        from bistat.explain.doctor import doctor, render_doctor

        rep = doctor(stop_leftovers=not leave_servers)
        if as_json:
            click.echo(json.dumps(rep.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(render_doctor(rep), nl=False)
