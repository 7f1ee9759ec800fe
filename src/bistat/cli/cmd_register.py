"""``bistat register``, ``bistat verify``, ``bistat check-release`` and ``bistat design``: sealed
pre-registration.

Thin commands: each parses its arguments, calls one function of ``bistat.declare.prereg`` or
``bistat.declare.design_report`` and formats the result. Library errors reach the user as
``Error: <message>`` with exit code 1 (``bistat.cli.exitcodes.ERROR``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bistat.core.lazy import lazy_function
from bistat.declare import prereg
from bistat.declare.errors import DeclarationError, DesignError
from bistat.declare.prereg_signature import NAMESPACE, signature_path
from bistat.declare.release_log import LoggedCheck, release_log_path

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.design_report import DesignReport
# the design analysis (pydantic models, scipy) loads when a command runs, not for --help
analyse_design = lazy_function("bistat.declare.design_report", "analyse_design")
format_design = lazy_function("bistat.declare.design_report", "format_design")


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def _json_out(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))


def _registration_text(reg: prereg.Registration, report: DesignReport, amended: bool) -> str:
    git = reg.sealed["git"]
    if git["commit"] is None and git["declaration_state"] is None:
        git_text = "not in a git repository"
    else:
        git_text = f"commit {git['commit'] or '(none yet)'}, declaration {git['declaration_state']}"
    lines = [
        f"{'Amended' if amended else 'Registered'} '{reg.name}' in {reg.path}",
        f"  sha256:     {reg.sha256}",
        f"  registered: {reg.registered_utc}",
    ]
    if amended:
        last = reg.amendments[-1]
        lines.append(f"  amended:    {last['time_utc']} ({len(reg.amendments)} amendment"
                     f"{'' if len(reg.amendments) == 1 else 's'}; reason: {last['reason']})")
    lines.append(f"  bistat:     {reg.sealed['bistat_version']}")
    lines.append(f"  git:        {git_text}")
    sig = signature_path(reg.path)
    if sig.exists():
        lines.append(f"  signature:  {sig} (ssh-keygen -Y sign, namespace {NAMESPACE}); "
                     f"check it with: bistat verify {reg.path} --allowed-signers FILE")
    release = reg.sealed.get("engine_release")
    if not amended and isinstance(release, dict):
        lines.append(f"  release:    {_release_text(release)}")
    if amended:
        logged = [c for c in prereg.release_log_checks(reg)
                  if c.by == "amend" and c.registration_sha256 == reg.sha256]
        if logged:
            lines.append(f"  release:    {_release_text(logged[-1].check.to_dict())}; "
                         f"appended to {release_log_path(reg.path)}")
    return "\n".join(lines) + "\n\n" + format_design(report) + "\n" + _next_steps(reg)


def _next_steps(reg: prereg.Registration) -> str:
    """What to do with a new (or amended) registration: commit it, so that git dates it before
    any datum, then run it."""
    git = reg.sealed["git"]
    if git["commit"] is None and git["declaration_state"] is None:
        commit = ("  1. keep it where its time can be shown: this is not a git repository, so only "
                  "the seal's own hash shows its integrity (--sign KEY adds who sealed it)")
    else:
        commit = (f"  1. commit it, so that git dates it before the run's first record: git add "
                  f"{reg.path} && git commit -m \"Register {reg.name}\"")
    return f"Next:\n{commit}\n  2. run it: bistat run {reg.path}\n"


def _release_text(check: dict[str, Any]) -> str:
    """``vllm 0.33.0 newest (INDEX, checked TIME)`` or why the newest release is unknown."""
    newest = (f"newest {check['package']} {check['newest']}" if check.get("newest") else
              f"newest {check['package']} unknown ({check.get('error')})")
    return f"{newest} ({check.get('index')}, checked {check.get('checked_utc')})"


def _verify_text(report: prereg.VerifyReport) -> str:
    """``bistat verify``'s lines for a registration that verified."""
    evidence = report.git.line()
    lines = [f"OK: {report.path} is intact (sha256 {report.sha256})",
             f"  registered: {report.registered_utc}"]
    if report.amendments:
        lines.append(f"  amended {report.amendments} time"
                     f"{'' if report.amendments == 1 else 's'}, last sealed "
                     f"{report.sealed_utc}")
    if report.runs:
        lines.append(f"  {len(report.runs)} run{'' if len(report.runs) == 1 else 's'} of this "
                     f"registration, {report.n_data} timed records, all after the registration "
                     f"(earliest {report.earliest_datum})")
        if len(report.runs) > 1:
            lines.extend(f"    {run}" for run in report.runs)
    else:
        lines.append("  no recorded runs checked (none in its run ledger or --runs-dir)")
    if report.ledger_missing:
        lines.append(f"  its run ledger lists {len(report.ledger_missing)} more run "
                     f"director{'y' if len(report.ledger_missing) == 1 else 'ies'} no longer "
                     f"there: {', '.join(report.ledger_missing)}")
    lines.append(f"  {evidence}")
    if report.release_checks:
        lines.append(f"  release log: {report.release_checks} later newest-release check"
                     f"{'' if report.release_checks == 1 else 's'} in "
                     f"{release_log_path(report.path)}, chain intact")
    if report.signature.line():
        lines.append(f"  {report.signature.line()}")
    return "\n".join(lines)


def _check_text(reg: prereg.Registration, line: LoggedCheck) -> str:
    c = line.check
    sealed = reg.sealed.get("engine_release")
    at_registration = (_release_text(sealed) if isinstance(sealed, dict)
                       else "no check (sealed before checks were recorded)")
    return "\n".join([
        f"Newest {c.package} release for '{reg.name}': {c.newest}",
        f"  index:        {c.index}",
        f"  checked:      {c.checked_utc}",
        f"  recorded in:  {release_log_path(reg.path)}, line {line.line} (sha256 {line.sha256})",
        f"  seal:         {reg.path} unchanged (sha256 {reg.sha256}); at registration: "
        f"{at_registration}",
        f"  findings state it with its time; regenerate them: bistat analyze RUN_DIR "
        f"--registration {reg.path}",
    ]) + "\n"


@click.command("register")
@click.argument("declaration", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--amend", is_flag=True,
              help="Replace an existing registration's declaration (only while no data has "
                   "been recorded for it); needs --reason.")
@click.option("--reason", default=None, help="Why the declaration changes (with --amend).")
@click.option("--registrations-dir", default=prereg.DEFAULT_REGISTRATIONS_DIR,
              show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where registrations are written.")
@click.option("--runs-dir", "runs_dirs", multiple=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Where recorded runs are searched before an amendment (repeatable; "
                   "default: runs).")
@click.option("--sign", "sign_key", default=None, metavar="KEY",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Also sign the registration with this SSH key (ssh-keygen -Y sign, "
                   "namespace bistat) into NAME.json.sig; a signed registration is amended "
                   "only with --sign.")
@click.option("--json", "as_json", is_flag=True, help="Print the registration as JSON.")
def register_cmd(declaration: Path, amend: bool, reason: str | None,
                 registrations_dir: Path, runs_dirs: tuple[Path, ...],
                 sign_key: Path | None, as_json: bool) -> None:
    """Seal DECLARATION (experiments/NAME.toml) into preregistrations/NAME.json.

    The registration holds the fully resolved declaration, its SHA-256, the UTC time, the
    bistat version, the git commit and state of the declaration file, and the design
    analysis (printed, with its warnings). A registration is never overwritten; change it
    with --amend --reason "..." before any data is recorded.

    The seal proves integrity only: commit the registration before the run (git then
    dates it) and, with --sign KEY, sign it (the signature names who sealed it).
    """
    if reason is not None and not amend:
        raise click.UsageError("--reason is only used with --amend")
    try:
        if amend:
            if reason is None:
                raise click.UsageError("--amend needs --reason \"why the declaration "
                                       "changes\"")
            reg, report = prereg.amend(
                declaration, reason, registrations_dir=registrations_dir,
                runs_dirs=runs_dirs or (prereg.DEFAULT_RUNS_DIR,), sign_key=sign_key)
        else:
            reg, report = prereg.register(declaration, registrations_dir=registrations_dir,
                                          sign_key=sign_key)
    except (DeclarationError, prereg.RegistrationError, DesignError) as exc:
        raise _fail(exc) from exc
    if as_json:
        _json_out({"path": str(reg.path), **reg.data})
    else:
        click.echo(_registration_text(reg, report, amend), nl=False)


@click.command("verify")
@click.argument("registration", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("run_dirs", nargs=-1, metavar="[RUN_DIR]...",
                type=click.Path(file_okay=False, path_type=Path))
@click.option("--runs-dir", "runs_dirs", multiple=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Where runs recorded against the registration are searched when no "
                   "RUN_DIR is given (repeatable; default: runs).")
@click.option("--allowed-signers", "allowed_signers", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The allowed-signers file (ssh-keygen(1), ALLOWED SIGNERS) that "
                   "NAME.json.sig is checked against  [default: git config "
                   "gpg.ssh.allowedSignersFile]")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_cmd(registration: Path, run_dirs: tuple[Path, ...],
               runs_dirs: tuple[Path, ...], allowed_signers: Path | None,
               as_json: bool) -> None:
    """Re-check REGISTRATION's seal, and that it precedes every datum of its runs.

    Says which evidence of time and authorship holds besides the seal's own hash: the
    first git commit of its exact bytes, and its signature (NAME.json.sig) when signed.

    Checks the RUN_DIRs given, or else every run of the registration its run ledger
    (.NAME.runs, written by bistat run) or --runs-dir knows, and says how many there are. Exits 1 if the seal is broken, the amendment log was edited, any
    recorded datum is not later than the registration, the registration's bytes differ
    from those git committed or were first committed after the run's first record, or
    its signature (NAME.json.sig) is not of these bytes or by a key the allowed signers
    list.
    """
    report = prereg.verify(registration, run_dirs,
                           runs_dirs=runs_dirs or (prereg.DEFAULT_RUNS_DIR,),
                           allowed_signers=allowed_signers)
    if as_json:
        _json_out(report.to_dict())
        if not report.ok:
            click.get_current_context().exit(1)
        return
    if not report.ok:
        raise click.ClickException("\n".join(report.problems))
    click.echo(_verify_text(report))


@click.command("check-release")
@click.argument("registration", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the appended check as JSON.")
def check_release_cmd(registration: Path, as_json: bool) -> None:
    """Check the newest release of REGISTRATION's engine now, and record it beside it.

    Asks the package index ($BISTAT_PACKAGE_INDEX, default PyPI's JSON API) for the
    engine's newest release (vLLM engines) and appends the answer, timestamped and hashed
    into a chain, to NAME.releases.jsonl beside NAME.json. The sealed registration is not
    touched and verifies as before; its engine_release stays the check made at
    registration. A finding states the newest release of the latest check with its time,
    before or after the run's first record. Exits 1, appending nothing, when the index gives
    no newest release (switched off, unreachable, unreadable answer).
    """
    try:
        reg, line = prereg.check_release(registration)
    except prereg.RegistrationError as exc:
        raise _fail(exc) from exc
    if as_json:
        _json_out({"registration": str(reg.path), "log": str(release_log_path(reg.path)),
                   "line": line.line, "by": line.by, "sha256": line.sha256,
                   "registration_sha256": line.registration_sha256,
                   "check": line.check.to_dict()})
    else:
        click.echo(_check_text(reg, line), nl=False)


@click.command("design")
@click.argument("declaration", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the analysis as JSON.")
def design_cmd(declaration: Path, as_json: bool) -> None:
    """Print DECLARATION's design analysis: prompts and passes needed, power, warnings."""
    try:
        report = analyse_design(prereg.load_declaration(declaration))
    except (DeclarationError, DesignError) as exc:
        raise _fail(exc) from exc
    if as_json:
        _json_out(report.to_dict())
    else:
        click.echo(format_design(report), nl=False)


def register(group: click.Group) -> None:
    """Add ``register``, ``verify``, ``check-release`` and ``design`` to the ``bistat`` group."""
    for command in (register_cmd, verify_cmd, check_release_cmd, design_cmd):
        group.add_command(command)
