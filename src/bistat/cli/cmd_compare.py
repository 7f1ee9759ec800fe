"""``bistat compare``: one study on two engine releases, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import click


def _arm_map(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        earlier, sep, later = v.partition("=")
        if not sep or not earlier or not later:
            raise click.BadParameter(f"{v!r}: expected EARLIER=LATER (arm names)", param_hint="--arm")
        out[earlier] = later
    return out


def register(group: click.Group) -> None:
    @group.command("compare")
    @click.argument("earlier_run", type=click.Path(exists=True, file_okay=False))
    @click.argument("later_run", type=click.Path(exists=True, file_okay=False))
    @click.option("--earlier-registration", type=click.Path(exists=True, dir_okay=False),
                  help="The registration the earlier run is analysed against (default: the one "
                       "it was recorded under).")
    @click.option("--later-registration", type=click.Path(exists=True, dir_okay=False),
                  help="Likewise for the later run.")
    @click.option("--arm", "arms", multiple=True, metavar="EARLIER=LATER",
                  help="Map an arm of the earlier run to one of the later run (repeatable); "
                       "default: the arms both have, by name.")
    @click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
                  help="The markdown file to write  [default: print it]")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print the comparison as JSON (the markdown goes to --out when given).")
    def compare(earlier_run: str, later_run: str, earlier_registration: str | None,
                later_registration: str | None, arms: tuple[str, ...], out_path: str | None,
                as_json: bool) -> None:
        """Set two runs of one study side by side (any engine; two releases, two engines, two
        machines): per arm and run the match counts and intervals, verdicts, cost, the engine
        each run measured as its fingerprint names it, its mode, what changed by fixed rules,
        and, between two vLLM releases, the upstream changes that touch what each arm ran."""
        from bistat.analysis.summary import AnalysisError, analyze_run
        from bistat.report.version_comparison import render_version_comparison
        from bistat.analysis.version_compare import VersionCompareError, compare_versions

        from bistat.declare.errors import DeclarationError
        from bistat.declare.prereg import RegistrationError
        from bistat.store.format import RecordsError

        try:
            earlier = analyze_run(earlier_run, earlier_registration, list_runs=False)
            later = analyze_run(later_run, later_registration, list_runs=False)
            vc = compare_versions(earlier, later, _arm_map(arms))
        except (AnalysisError, VersionCompareError, RecordsError, RegistrationError,
                DeclarationError) as exc:
            raise click.ClickException(str(exc)) from exc
        text = render_version_comparison(vc)
        if out_path is not None:
            out = Path(out_path)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(text.encode("utf-8"))
        if as_json:
            click.echo(json.dumps(vc.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
        elif out_path is not None:
            click.echo(f"wrote {out_path}")
        else:
            click.echo(text, nl=False)
