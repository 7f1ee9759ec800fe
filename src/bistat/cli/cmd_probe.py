"""``bistat probe``: the bitwise invariance probe on a declaration's engines.

The command parses its options, records the probe (:func:`bistat.run.probe.record_probe`) and has
its outcome decided (:func:`bistat.analysis.probe_report.run_probe` does both), keeps the report
on disk after every arm (``--output``) and maps the outcome onto an exit code
(:mod:`bistat.report.gating`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from bistat.cli.fail_on import OUTCOME_FAIL_ON_HELP, fail_on_labels
from bistat.run.probe_records import FILLER_TOKENS, LONG_NEEDLES, NEEDLE_TOKENS

PROBE_EXIT_CODES = """\b
Exit codes: 0 whatever the outcome unless --fail-on names its label;
1 error. Outcomes map to labels: confirmed (bitwise invariant and the
negative control differs) -> working; violated (a probed arm gave the
needle different bits) -> 'reported as observed' (11); no_power (the
negative control did not differ either), vacuous (the engine's batching
evidence does not show the needle sharing a step with other requests)
and untested (an engine could not run, or the mode is unsupported)
-> untested (12)."""


@click.command("probe", epilog=PROBE_EXIT_CODES)
@click.argument("declaration", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--arm", "arms", multiple=True,
              help="Arm to probe (repeatable; default: every treatment arm).")
@click.option("--control", default=None,
              help="Negative-control arm, which must show a difference (default: the control arm).")
@click.option("--no-control", is_flag=True, help="Run no negative control (the outcome is then at best no_power).")
@click.option("--trials", default=3, show_default=True, type=click.IntRange(min=1),
              help="Placements of the needle among fillers.")
@click.option("--min-fillers", default=32, show_default=True, type=click.IntRange(min=1),
              help="Fewest filler prompts around the needle.")
@click.option("--max-fillers", default=128, show_default=True, type=click.IntRange(min=1),
              help="Most filler prompts around the needle.")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1),
              help="Tokens per needle [default: 128 in the kv-sweep design, else the "
                   "declaration's workload.max_tokens].")
@click.option("--design", default="kv-sweep", show_default=True,
              type=click.Choice(["kv-sweep", "single"]),
              help="batch mode: kv-sweep runs needles of several lengths (the needle prompt, then "
                   "--long-needles) among fillers that arrive while they decode, and gives a "
                   "verdict per needle; single runs one needle among fillers submitted at once.")
@click.option("--long-needles", default=",".join(map(str, LONG_NEEDLES)), show_default=True,
              callback=lambda ctx, param, value: _lengths(value),
              help="kv-sweep: approximate prompt tokens of the needles added to the needle prompt "
                   "(comma-separated; '' for none).")
@click.option("--filler-tokens", default=FILLER_TOKENS, show_default=True,
              type=click.IntRange(min=1), help="kv-sweep: tokens each filler generates.")
@click.option("--needle", "needle_index", default=0, show_default=True, type=click.IntRange(min=0),
              help="Index of the needle prompt in the declaration's prompt source.")
@click.option("--needle-from", "needle_from", type=click.Path(path_type=Path, file_okay=False),
              help="Choose the needle from this recorded run of the same workload: the prompt "
                   "whose outputs first diverged earliest (bitwise, any arm and counted pass; "
                   "ties: the lowest index). Excludes --needle.")
@click.option("--seed", default=None, type=int, help="Placement seed [default: the declaration's workload.seed].")
@click.option("--output", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write the JSON report to this file.")
@click.option("--mode", default="batch", show_default=True,
              type=click.Choice(["batch", "prefill-decode", "prefix-cache"]),
              help="batch: the needle alone and among fillers; prefill-decode: decode logprobs "
                   "against prefilling the same prefix; prefix-cache: prefix cache cold vs warm.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the summary.")
@click.option("--fail-on", "fail_on", multiple=True, help=OUTCOME_FAIL_ON_HELP)
def probe_command(declaration: Path, arms: tuple[str, ...], control: str | None, no_control: bool,
                  trials: int, min_fillers: int, max_fillers: int, max_tokens: int | None,
                  design: str, long_needles: tuple[int, ...], filler_tokens: int,
                  needle_index: int, needle_from: Path | None, seed: int | None, mode: str,
                  output: Path | None, as_json: bool, fail_on: tuple[str, ...]) -> None:
    """Bitwise invariance probe: needle prompts alone, then among fillers, on a declaration's engine.

    DECLARATION is an experiments/NAME.toml or a preregistrations/NAME.json. Token ids and
    logprobs are compared bitwise: each needle alone against the needle in each batch, and each
    filler that ran in two or more trials across them. The default design (kv-sweep) runs the
    needle prompt and needles of about 112, 176, 304 and 600 prompt tokens, 128 tokens each,
    while fillers of 16 tokens keep arriving, so that their attention crosses the KV tiles of
    attention kernels (64 to 640 keys) beside prefills, and gives a verdict per needle. The
    negative control (invariance off) runs first and must differ, or the probe is reported as
    lacking power. With --needle-from RUN_DIR the needle is the prompt a recorded run of the
    same workload saw diverge first.
    """
    from click.core import ParameterSource

    from bistat.declare.experiment import DeclarationError, load_experiment
    from bistat.analysis.probe_needle import needle_from_run
    from bistat.analysis.probe_report import ProbeReport, ProbeSettings, run_probe
    from bistat.store.format import RecordsError
    from bistat.run.workload import WorkloadError

    if no_control and control is not None:
        raise click.UsageError("--control and --no-control exclude each other")
    needle_given = (click.get_current_context().get_parameter_source("needle_index")
                    not in (ParameterSource.DEFAULT, None))
    if needle_from is not None and needle_given:
        raise click.UsageError("--needle and --needle-from exclude each other")
    fail_labels = fail_on_labels(fail_on)
    try:
        if declaration.suffix == ".json":
            from bistat.declare.prereg import RegistrationError, load_registration

            try:
                experiment = load_registration(declaration).experiment()
            except RegistrationError as exc:
                raise click.ClickException(str(exc)) from exc
        else:
            experiment = load_experiment(declaration)
        source = None
        if needle_from is not None:
            source = needle_from_run(needle_from, experiment, declaration=str(declaration))
            needle_index = source.prompt_index
            click.echo(f"needle: {source.describe()}", err=True)
        sweep = mode == "batch" and design == "kv-sweep"
        settings = ProbeSettings(
            trials=trials,
            min_fillers=min_fillers,
            max_fillers=max_fillers,
            needle_index=needle_index,
            max_tokens=max_tokens or (NEEDLE_TOKENS if sweep else experiment.workload.max_tokens),
            seed=experiment.workload.seed if seed is None else seed,
            mode=mode,
            design=design,
            long_needles=long_needles,
            filler_tokens=filler_tokens,
        )
        saved: list[int] = []

        def keep(partial: ProbeReport) -> None:
            # every finished arm goes to disk at once: an interrupted probe loses only its
            # current arm
            if output is not None:
                _write_json_atomic(output, partial.to_json())
                saved.append(len(partial.arms))

        try:
            report = run_probe(
                experiment,
                arms=list(arms) or None,
                control="" if no_control else control,
                settings=settings,
                on_arm=None if as_json else (lambda name: click.echo(f"probing arm {name} ...", err=True)),
                on_report=keep,
                needle_source=source,
            )
        except KeyboardInterrupt:
            kept = (f"the report of the {saved[-1]} finished arm(s) is in {output}" if saved
                    else "no arm had finished, nothing was written")
            click.echo(f"interrupted: {kept}", err=True)
            click.echo("exit 130: interrupted (Ctrl-C)", err=as_json)
            sys.exit(130)
    except DeclarationError as exc:
        raise click.ClickException(str(exc)) from exc
    except (ValueError, WorkloadError, RecordsError) as exc:
        raise click.ClickException(str(exc)) from exc
    data = report.to_json()
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        for line in report.summary_lines():
            click.echo(line)
    from bistat.report.gating import PROBE_OUTCOME_LABELS, gate

    result = gate([PROBE_OUTCOME_LABELS[report.outcome]], fail_labels)
    click.echo(f"exit {result.exit_code}: {result.reason}", err=as_json)
    sys.exit(result.exit_code)


def _lengths(value: str) -> tuple[int, ...]:
    """``--long-needles``: comma-separated positive, increasing prompt lengths."""
    try:
        out = tuple(int(x) for x in value.replace(" ", "").split(",") if x)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated token counts, e.g. "
                                 "112,176,304,600") from None
    if any(x < 1 for x in out) or list(out) != sorted(set(out)):
        raise click.BadParameter(f"{value!r}: expected increasing token counts of at least 1")
    return out


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def register(group: click.Group) -> None:
    group.add_command(probe_command)
