"""The ``--fail-on`` option of the verdict-producing commands: its help and its parsing.

``bistat analyze`` gates on the verdicts, ``bistat run`` and ``bistat probe`` on the outcome (the
run's verdicts, the probe's outcome mapped onto a label); :func:`bistat.report.gating.parse_fail_on`
reads the labels, and a bad one is a usage error (exit code 2).
"""

from __future__ import annotations

import click

#: ``--fail-on`` help of ``bistat analyze``.
FAIL_ON_HELP = ("Exit with the verdict's code (10 doubtful, 11 reported as observed, 12 untested) "
                "when a verdict has one of these labels: comma-separated or repeated; '-' or '_' "
                "may stand for spaces; 'any' for all. 'working' (code 0) is refused.")

#: ``--fail-on`` help of ``bistat run`` and ``bistat probe``.
OUTCOME_FAIL_ON_HELP = ("Exit non-zero when the outcome has one of these verdict labels "
                        "(comma-separated, or repeated; 'any' for all): doubtful, "
                        "reported-as-observed, untested.")


def fail_on_labels(values: tuple[str, ...]) -> frozenset[str]:
    """``--fail-on`` values as verdict labels; a bad label is a usage error (exit code 2)."""
    from bistat.report.gating import FailOnError, parse_fail_on

    try:
        return parse_fail_on(values)
    except FailOnError as exc:
        raise click.UsageError(str(exc)) from exc
