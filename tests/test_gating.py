"""CI gating: --fail-on parsing, an exit code for every verdict and probe outcome, the CI summary."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from helpers_explain import blas_run, validate

from bistat.analysis.summary import analyze_run
from bistat.cli.exitcodes import VERDICT_CODES
from bistat.report.gating import (
    FAILABLE_LABELS,
    FailOnError,
    GateResult,
    ci_summary,
    gate,
    parse_fail_on,
    probe_gate,
)


def test_failable_labels_are_every_verdict_with_a_nonzero_code():
    assert FAILABLE_LABELS == ("doubtful", "reported as observed", "untested")


@pytest.mark.parametrize("value,expected", [
    ("doubtful", {"doubtful"}),
    ("reported-as-observed", {"reported as observed"}),
    ("reported_as_observed", {"reported as observed"}),
    ("Reported As Observed", {"reported as observed"}),
    ("doubtful, untested", {"doubtful", "untested"}),
    (["doubtful", "untested,doubtful"], {"doubtful", "untested"}),
    ("any", {"doubtful", "reported as observed", "untested"}),
    (None, set()),
    ("", set()),
])
def test_parse_fail_on(value, expected):
    assert parse_fail_on(value) == frozenset(expected)


def test_parse_fail_on_refuses_unknown_labels_and_working():
    with pytest.raises(FailOnError) as e:
        parse_fail_on("doubtfull")
    assert str(e.value) == ("--fail-on: unknown verdict label 'doubtfull'; expected one of "
                            "'doubtful', 'reported as observed', 'untested' or 'any' "
                            "(comma-separated; '-' or '_' may stand for spaces)")
    with pytest.raises(FailOnError, match="'working' has exit code 0 and cannot fail a command"):
        parse_fail_on("working")


@pytest.mark.parametrize("label", sorted(VERDICT_CODES))
def test_every_verdict_exits_0_without_fail_on_and_its_code_with_it(label):
    assert gate([label], set()) == GateResult(0, "no --fail-on given: every verdict exits 0")
    code = {"working": 0, "doubtful": 10, "reported as observed": 11, "untested": 12}[label]
    if label != "working":
        assert gate([label], {label}) == GateResult(
            code, f"verdict 1 is {label!r}, named by --fail-on")
        other = set(FAILABLE_LABELS) - {label}
        assert gate([label], other) == GateResult(0, "no verdict has a label named by --fail-on")


def test_the_first_named_verdict_sets_the_code():
    assert gate(["working", "untested", "doubtful"], {"doubtful", "untested"}).exit_code == 12
    assert gate(["doubtful", "untested"], {"doubtful", "untested"}).exit_code == 10


def test_unknown_verdict_label_is_an_error():
    with pytest.raises(ValueError, match="unknown verdict label 'maybe'"):
        gate(["maybe"], set())


@pytest.mark.parametrize("outcome,code", [("confirmed", 0), ("violated", 11), ("no_power", 12),
                                          ("untested", 12)])
def test_probe_outcomes_share_the_verdict_codes(outcome, code):
    assert probe_gate(outcome, parse_fail_on("any")).exit_code == code
    assert probe_gate(outcome, set()).exit_code == 0


def _cli():
    @click.command("verdicts")
    @click.argument("labels", nargs=-1)
    @click.option("--fail-on", "fail_on", multiple=True)
    def verdicts(labels, fail_on):
        try:
            named = parse_fail_on(fail_on)
        except FailOnError as exc:
            raise click.UsageError(str(exc)) from exc
        raise SystemExit(gate(list(labels), named).exit_code)

    return verdicts


@pytest.mark.parametrize("label,code", sorted(VERDICT_CODES.items()))
def test_exit_codes_through_click(label, code):
    result = CliRunner().invoke(_cli(), [label, "--fail-on", "any"])
    assert result.exit_code == code
    assert CliRunner().invoke(_cli(), [label]).exit_code == 0


def test_bad_fail_on_is_a_usage_error_through_click():
    result = CliRunner().invoke(_cli(), ["doubtful", "--fail-on", "bad"])
    assert result.exit_code == 2
    assert "Error: --fail-on: unknown verdict label 'bad'" in result.output


def test_ci_summary_of_a_real_run(tmp_path_factory):
    summary = analyze_run(blas_run(tmp_path_factory))
    (comparison,) = summary.comparisons
    validate(comparison.verdict.to_dict(), "verdict.schema.json")
    label = comparison.verdict.label.value
    text = ci_summary(summary, {"doubtful", "reported as observed", "untested"})
    lines = text.splitlines()
    assert lines[0] == (f"bistat: blasrun run blasrun (registration "
                        f"{summary.registration_sha256[:12]})")
    assert lines[1].startswith("  arm blas (control): matched ")
    assert lines[2].startswith("  arm invariant (treatment): matched 32/32, two-sided 95 % Wilson [")
    assert lines[2].endswith("; 0 divergence(s)")
    assert f"VERDICT invariant vs blas: {label.upper()}" in lines
    assert len(lines) <= 40 and all(len(ln) <= 100 for ln in lines)
    code = 0 if label == "working" else VERDICT_CODES[label]
    assert lines[-1].startswith(f"exit {code}: ")
