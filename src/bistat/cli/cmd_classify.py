"""``bistat classify``: a registered rule applied to published summary numbers."""

from __future__ import annotations

import json
from pathlib import Path

import click


def register(group: click.Group) -> None:
    """Add ``classify`` to the ``bistat`` group."""

    @group.command("classify")
    @click.argument("rule_source", metavar="DECLARATION_OR_REGISTRATION",
                    type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--arm", "arms", multiple=True, required=True,
                  help="NAME=K/N: prompts matched (identical in every pass) and compared in an "
                       "arm; the control and at least one treatment (repeatable).")
    @click.option("--ratio", "ratios", multiple=True,
                  help="[NAME=]POINT: a treatment's throughput ratio to the control, as "
                       "published (repeatable; NAME may be left out with one treatment).")
    @click.option("--interval", "intervals", multiple=True,
                  help="[NAME=]LOW:HIGH: that ratio's published interval, at the rule's "
                       "confidence level.")
    @click.option("--discordant", "discordant", multiple=True,
                  help="[NAME=]B,C: prompts matched only in the control (B) and only in the "
                       "treatment (C), for McNemar's test.")
    @click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
    def classify_cmd(rule_source: Path, arms: tuple[str, ...], ratios: tuple[str, ...],
                     intervals: tuple[str, ...], discordant: tuple[str, ...],
                     as_json: bool) -> None:
        """Classify published summary numbers by the rule of DECLARATION_OR_REGISTRATION.

        For reproducing a paper's verdict without inventing passes: the published ratio stands
        in for the per-pass throughputs. A criterion the numbers cannot decide (an interval not
        published, TOST, McNemar without --discordant, the probe) is not evaluable, and the
        output says so. Example, the published protocol's seed 003:

          bistat classify experiments/published-protocol.toml --arm default=78/541
          --arm batch-invariant=541/541 --ratio 0.979
        """
        from bistat.analysis.published import (SummaryError, classify_summary, parse_counts,
                                               parse_named)
        from bistat.declare.errors import DeclarationError
        from bistat.declare.experiment import load_experiment
        from bistat.declare.prereg import RegistrationError, load_registration

        try:
            if rule_source.suffix == ".json":
                exp = load_registration(rule_source).experiment()
            else:
                exp = load_experiment(rule_source)
            treatments = [a.name for a in exp.treatments]
            counts = parse_counts(arms, [a.name for a in exp.arms])
            results = classify_summary(
                exp, counts, parse_named(ratios, "--ratio", treatments),
                parse_named(intervals, "--interval", treatments),
                parse_named(discordant, "--discordant", treatments))
        except (SummaryError, DeclarationError, RegistrationError) as exc:
            raise click.ClickException(str(exc)) from exc
        if as_json:
            click.echo(json.dumps([r.verdict.to_dict() for r in results], indent=2,
                                  ensure_ascii=False, sort_keys=True))
            return
        click.echo(f"{exp.name}: its rule applied to published summary numbers")
        for r in results:
            v = r.verdict
            click.echo(f"{r.treatment} vs {r.control}: {v.headline}")
            click.echo(f"  {v.sentence}")
            click.echo(f"  Basis: {v.basis}.")
            for lr in v.labels:
                for cr in lr.criteria:
                    mark = {True: "met", False: "not met", None: "not evaluable"}[cr.met]
                    why = f"; {cr.reason}" if cr.reason else ""
                    click.echo(f"  [{mark}] {lr.label}: {cr.description}: {cr.observed_text} "
                               f"(needs {cr.threshold}{why})")
