"""The ``bistat`` command line: a thin click group whose commands live one module each.

Every command parses its arguments, calls one library function and formats the result; no
statistics or engine logic lives here. Exit codes are documented in ``bistat.cli.exitcodes``.
Every command module is imported to build the group, so each imports the library it calls inside
the command: ``bistat --help`` and every ``--help`` load no heavy library (``bistat.core.lazy``).
"""

from __future__ import annotations

import importlib

import click

from bistat import __version__   # Each module in this list defines ``register(group: click.Group) -> None``.
_COMMAND_MODULES = (
    "bistat.cli.cmd_new",        # new (a declaration with the default rule)
    "bistat.cli.cmd_register",   # register, verify, design
    "bistat.cli.cmd_analyze",    # analyze, compact
    "bistat.cli.cmd_model",      # model fetch / export / info / path
    "bistat.cli.cmd_serve",      # serve
    "bistat.cli.cmd_run",        # run
    "bistat.cli.cmd_probe",      # probe (the bitwise invariance probe)
    "bistat.cli.cmd_kernels",    # kernels probe / sweep / bench / results
    "bistat.cli.cmd_synth",      # synth-model (random-weight Hugging Face folders)
    "bistat.cli.cmd_diagnose",   # diagnose
    "bistat.cli.cmd_replay",     # replay, reproduce
    "bistat.cli.cmd_inspect",    # inspect
    "bistat.cli.cmd_doctor",     # doctor
    "bistat.cli.cmd_index",      # index (findings/README.md)
    "bistat.cli.cmd_classify",   # classify (published summary numbers)
    "bistat.cli.cmd_compare",    # compare (one study on two engine releases)
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bistat")
def cli() -> None:
    """bistat: does batch invariance hold, and what does it cost? Register, run, classify, report."""


for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(cli)


def main() -> None:
    cli(prog_name="bistat")
