"""``bistat analyze`` (recorded run -> finding) and ``bistat compact`` (JSONL -> Parquet).

Thin commands: ``analyze`` calls ``bistat.analysis.analyze_run`` then
``bistat.report.write_finding``; ``compact`` calls ``bistat.records.compact``. Library errors
reach the user as ``Error: <message>`` with exit code 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bistat.analysis import AnalysisError, analyze_run, summary_to_dict
from bistat.cli.exitcodes import VERDICT_CODES
from bistat.experiment import DeclarationError
from bistat.prereg import RegistrationError
from bistat.records import RecordsError, compact
from bistat.report import write_finding

_ERRORS = (AnalysisError, RecordsError, RegistrationError, DeclarationError)


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def register(group: click.Group) -> None:
    """Add ``analyze`` and ``compact`` to the ``bistat`` group."""

    @group.command("analyze")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--registration", type=click.Path(dir_okay=False, path_type=Path),
                  default=None,
                  help="The registration to analyse against [default: the path run.json names].")
    @click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
                  default=Path("findings"), show_default=True,
                  help="Folder for NAME.md and its plots NAME-*.png.")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print the summary and the verdicts as JSON instead of text.")
    @click.option("--fail-on", "fail_on", multiple=True,
                  type=click.Choice(sorted(VERDICT_CODES)),
                  help="Exit with the verdict's code (10 doubtful, 11 reported as observed, "
                       "12 untested) when a verdict has this label; repeatable.")
    def analyze(run_dir: Path, registration: Path | None, out_dir: Path, as_json: bool,
                fail_on: tuple[str, ...]) -> None:
        """Analyse the recorded run RUN_DIR and write the finding OUT/NAME.md with its plots.

        Every number is recomputed from the records; regenerating from the same data gives
        byte-identical files. Exit code 0 whatever the verdict, unless --fail-on names it.
        """
        try:
            summary = analyze_run(run_dir, registration)
            files = write_finding(summary, out_dir)
        except _ERRORS as exc:
            raise _fail(exc) from exc
        if as_json:
            data = summary_to_dict(summary)
            data["finding"] = {"markdown": str(files.markdown),
                               "plots": [str(p) for p in files.plots]}
            click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(f"wrote {files.markdown} and {len(files.plots)} plots")
            for c in summary.comparisons:
                click.echo(f"{c.treatment} vs {c.control}: {c.verdict.label.value}")
                click.echo(f"  {c.verdict.sentence}")
        for c in summary.comparisons:
            if c.verdict.label.value in fail_on:
                raise SystemExit(VERDICT_CODES[c.verdict.label.value])

    @group.command("compact")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    def compact_cmd(run_dir: Path) -> None:
        """Write RUN_DIR/<table>.parquet beside each JSONL table (the JSONL files are kept).

        Readers use a Parquet file while its JSONL has not grown since compaction.
        """
        try:
            written = compact(run_dir)
        except RecordsError as exc:
            raise _fail(exc) from exc
        for path in written:
            click.echo(f"wrote {path}")
        if not written:
            click.echo(f"{run_dir}: no records to compact")
