"""``bistat analyze`` (recorded run -> finding) and ``bistat compact`` (JSONL -> Parquet).

Thin commands: ``analyze`` calls ``bistat.analysis.summary.analyze_run``, computes the seal's
evidence of the registration it analysed (``bistat.report.seal.seal_evidence``: git and the
signature; a registration they refute is refused) and calls
``bistat.report.finding.write_finding``, prints ``bistat.report.gating.ci_summary`` and exits with
``bistat.report.gating.gate``'s code (``--fail-on``); ``compact`` calls ``bistat.store.compact.compact``
(``--slim``/``--top-k``: its ``slim``/``top_k``) and, with ``--trim``, ``bistat.analysis.trim.trim``
(``--unit``: its ``unit``).
Library errors reach the user as ``Error: <message>`` with exit code 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bistat.cli.fail_on import FAIL_ON_HELP, fail_on_labels
from bistat.report.index_findings import LOCAL_FINDINGS
from bistat.store.format import TRIM_SERVES

# The analysis, the report and the store's readers (pandas, pyarrow, matplotlib) are imported by
# the commands that use them, so that `bistat --help` does not load them.


ANALYZE_EXIT_CODES = """\b
Exit codes: 0 whatever the verdicts, unless --fail-on names one: then the
code of the first verdict (in comparison order) whose label it names:
10 doubtful, 11 reported as observed, 12 untested; 1 error (unreadable
records, a broken registration, one whose bytes differ from those git
committed or whose signature fails, OUT/NAME.md the finding of another run
without --force); 2 usage error (a bad --fail-on label)."""


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def register(group: click.Group) -> None:
    """Add ``analyze`` and ``compact`` to the ``bistat`` group."""

    @group.command("analyze", epilog=ANALYZE_EXIT_CODES)
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--registration", type=click.Path(dir_okay=False, path_type=Path),
                  default=None,
                  help="The registration to analyse against [default: the path run.json names].")
    @click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
                  default=Path("findings") / LOCAL_FINDINGS, show_default=True,
                  help="Folder for NAME.md and its plots NAME-*.png. The default is this "
                       "machine's own findings, which bistat index never lists: a run of yours "
                       "never rewrites the project's findings or its README's results; give "
                       "--out findings to add the finding to them.")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print the summary and the verdicts as JSON instead of text.")
    @click.option("--fail-on", "fail_on", multiple=True, help=FAIL_ON_HELP)
    @click.option("--allowed-signers", "allowed_signers", default=None,
                  type=click.Path(dir_okay=False, path_type=Path),
                  help="The allowed-signers file a signed registration (NAME.json.sig) is "
                       "checked against  [default: git config gpg.ssh.allowedSignersFile]")
    @click.option("--force", is_flag=True,
                  help="Replace OUT/NAME.md although it is the finding of another run of the "
                       "registration (refused without it).")
    @click.option("--no-run-ledger", "no_run_ledger", is_flag=True,
                  help="List only the runs of the registration that RUN_DIR's folder holds, not "
                       "those its run ledger (preregistrations/.NAME.runs, this machine's, never "
                       "committed) lists: a committed finding regenerates so "
                       "(scripts/regenerate_findings.sh), whatever this machine has run again "
                       "under the registration.")
    def analyze(run_dir: Path, registration: Path | None, out_dir: Path, as_json: bool,
                fail_on: tuple[str, ...], allowed_signers: Path | None, force: bool,
                no_run_ledger: bool) -> None:
        """Analyse the recorded run RUN_DIR and write the finding OUT/NAME.md with its plots.

        Every number is recomputed from the records; regenerating from the same data gives
        byte-identical files. The finding lists every run of the registration its run ledger
        and RUN_DIR's folder know, with each one's verdict; a finding of another run of the
        same registration is not replaced without --force. A line under the verdict says which evidence the registration's
        seal has: git's first commit of its exact bytes, before or after the run's first
        record (or that this checkout has no such history), and its signature when signed.
        Prints a one-screen plain-text summary for CI logs: each verdict with its sentence, every
        criterion and the cost (on stderr with --json). Exit code 0 whatever the verdict,
        unless --fail-on names it.
        """
        from bistat.analysis.summary import AnalysisError, analyze_run, summary_to_dict
        from bistat.declare.errors import DeclarationError
        from bistat.declare.prereg import RegistrationError
        from bistat.declare.prereg_signature import SignatureError
        from bistat.report.finding import FindingExistsError, write_finding
        from bistat.report.gating import ci_summary, gate
        from bistat.report.seal import run_seal_evidence
        from bistat.store.format import RecordsError

        labels = fail_on_labels(fail_on)
        try:
            summary = analyze_run(run_dir, registration, run_ledger=not no_run_ledger)
            seal = run_seal_evidence(run_dir, registration, summary.created_utc,
                                     allowed_signers=allowed_signers)
            refuted = seal.refutations()
            if refuted:
                raise RegistrationError(f"{seal.registration}: {'; '.join(refuted)}; check it "
                                        f"with: bistat verify {seal.registration} {run_dir}")
            files = write_finding(summary, out_dir, seal=seal, force=force)
        except (AnalysisError, RecordsError, RegistrationError, DeclarationError,
                SignatureError, FindingExistsError) as exc:
            raise _fail(exc) from exc
        if as_json:
            data = summary_to_dict(summary)
            data["finding"] = {"markdown": str(files.markdown),
                               "plots": [str(p) for p in files.plots]}
            data["seal"] = seal.to_dict()
            click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))
        else:
            click.echo(f"wrote {files.markdown} and {len(files.plots)} plots")
        click.echo(ci_summary(summary, labels), nl=False, err=as_json)   # the verdicts, once
        raise SystemExit(gate([c.verdict.label.value for c in summary.comparisons],
                              labels).exit_code)

    @group.command("compact")
    @click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--slim", is_flag=True,
                  help="Store each distinct output once: responses.parquet without token_ids, "
                       "text, logprobs and top_logprobs, and outputs.parquet with each "
                       "distinct output in the narrowest exact types. Readers rejoin them.")
    @click.option("--top-k", "top_k", type=click.IntRange(min=1), default=None,
                  show_default="all recorded",
                  help="With --slim: keep only the first K top_logprobs alternatives per "
                       "position (recorded in the Parquet footers as bistat.top_k).")
    @click.option("--trim", "do_trim", is_flag=True,
                  help="Lossy, for a repository's data budget: of a slim run's outputs keep "
                       "each arm's reference pass in full, empty those only warm-ups gave, and "
                       "cut every other one after its first divergence from the reference "
                       "(docs/RECORDS.md, 'Trimmed compaction'). Alone: trims an already slim "
                       "run; with --slim: compacts, then trims.")
    @click.option("--unit", type=click.Choice(sorted(TRIM_SERVES)), default=None,
                  show_default="the registration's match.unit",
                  help="With --trim: the match unit whose divergences must stay computable.")
    def compact_cmd(run_dir: Path, slim: bool, top_k: int | None, do_trim: bool,
                    unit: str | None) -> None:
        """Write RUN_DIR/<table>.parquet beside each JSONL table (the JSONL files are kept).

        Readers use a Parquet file while its JSONL has not grown since compaction. --trim
        rewrites a slim run's outputs.parquet keeping only what the analysis reads; findings
        regenerate byte for byte, other uses of the full outputs are lost.
        """
        from bistat.analysis.trim import trim
        from bistat.store.compact import compact
        from bistat.store.format import RecordsError
        from bistat.store.readers import trim_info

        if top_k is not None and not slim:
            raise click.UsageError("--top-k applies to a slim compaction only; add --slim")
        if unit is not None and not do_trim:
            raise click.UsageError("--unit applies to --trim only; add --trim")
        try:
            written = compact(run_dir, slim=slim, top_k=top_k) if slim or not do_trim else []
            trimmed = trim(run_dir, unit=unit) if do_trim else None
        except RecordsError as exc:
            raise _fail(exc) from exc
        for path in written:
            click.echo(f"wrote {path}")
        if trimmed is not None:
            info = trim_info(run_dir) or {}
            n = info.get("outputs") or {}
            refs = ", ".join(f"{a} pass {p}" for a, p in (info.get("reference_passes") or {})
                             .items()) or "none"
            what = (f"for match unit {info.get('unit')!r}: {n.get('full', 0)} output(s) kept in "
                    f"full, {n.get('cut', 0)} cut after their first divergence, "
                    f"{n.get('emptied', 0)} emptied (warm-up only); reference passes: {refs}")
            if trimmed:
                for path in trimmed:
                    click.echo(f"wrote {path}")
                click.echo(f"trimmed {run_dir} {what}")
            else:
                click.echo(f"{run_dir}: already trimmed {what}; nothing to do")
        elif not written:
            click.echo(f"{run_dir}: no records to compact")
