"""``bistat register`` / ``verify`` / ``design`` through CliRunner: exact output and exit codes."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bistat.declare import prereg
from bistat.cli import cmd_register

DECL = Path(__file__).resolve().parent / "data" / "declarations"
T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def cli() -> click.Group:
    # The commands of this module on a bare group, so these tests do not depend on the other
    # command modules; test_real_cli_has_the_commands checks the real group.
    group = click.Group("bistat", context_settings={"help_option_names": ["-h", "--help"]})
    cmd_register.register(group)
    return group


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "experiments").mkdir()
    shutil.copy(DECL / "minimal.toml", tmp_path / "experiments" / "minimal.toml")
    monkeypatch.chdir(tmp_path)
    clock = {"now": T0}
    monkeypatch.setattr(prereg, "_utcnow", lambda: clock["now"])
    return clock


def invoke(cli, args, ok=True):
    result = CliRunner().invoke(cli, args, catch_exceptions=not ok)
    return result


SPEED = ("takes a slowdown as evidence that the mode acts: a faster invariant kernel with the "
         "same outputs can lose 'working'. Whether the mode acts is shown by control_diverges "
         "with treatment_beats_control, or by probe_confirmed, which read no speed; state the "
         "cost in [rule.cost] (bistat new NAME writes such a rule)")

DESIGN_MINIMAL = """\
Design analysis of 'minimal': 400 prompts, 3 counted passes per arm, CV 0.05 (assumed; none declared)

Match criteria (95 % Wilson, two-sided; assumed true match rate 0.999):
  working: treatment's 95 % Wilson match interval, lower end >= 0.99
    prompts needed for a perfect match to clear it: 381
    mismatches tolerated at 400 prompts: 0
    P(met) at a true match rate of 0.999: 0.670

Throughput criteria (Welch's interval and TOST of the throughput ratio, each arm's passes unpaired; 3 counted passes per arm, CV 0.05):
  working: throughput ratio (treatment ÷ control), point estimate < 0.9
    expected ratio interval: estimate ×/÷ 1.120 (log half-width 0.1133)
    P(met) at true ratio 0.8: 0.998, 0.9: 0.500, 1: 0.005

False verdicts (a label met when what it asserts is false):
  working, no slowdown (true ratio 1): P = 0.003 (alpha 0.05)
  working, A/A (both arms at match rate 1, the worst tried): P <= 0.005 (alpha 0.05)

P(label's criteria all met), match and throughput independent:
  working: at true ratio 0.8: 0.669, at true ratio 0.9: 0.335, at true ratio 1: 0.003

Warnings (2):
  - rule.labels[0].all[0] ('working': treatment's 95 % Wilson match interval, lower end >= 0.99): P(met) = 0.670 at an assumed match rate of 0.999 with 400 prompts (0 mismatches tolerated), below the power target 80%; about 565 prompts would give 80% (set workload.n_prompts)
  - rule.labels[0].all[1] ('working': throughput ratio (treatment ÷ control), point estimate < 0.9) takes a slowdown as evidence that the mode acts: a faster invariant kernel with the same outputs can lose 'working'. Whether the mode acts is shown by control_diverges with treatment_beats_control, or by probe_confirmed, which read no speed; state the cost in [rule.cost] (bistat new NAME writes such a rule)
"""


def test_register_prints_the_seal_and_the_design(cli, work):
    result = invoke(cli, ["register", "experiments/minimal.toml"])
    assert result.exit_code == 0
    sha = json.loads(Path("preregistrations/minimal.json").read_text())["sha256"]
    assert result.output == (
        "Registered 'minimal' in preregistrations/minimal.json\n"
        f"  sha256:     {sha}\n"
        "  registered: 2026-03-01T12:00:00.000000Z\n"
        "  bistat:     0.1.0\n"
        "  git:        not in a git repository\n"
        "\n" + DESIGN_MINIMAL + "\n" + NEXT_NO_GIT.format(path="preregistrations/minimal.json"))


NEXT_NO_GIT = """\
Next:
  1. keep it where its time can be shown: this is not a git repository, so only the seal's own hash shows its integrity (--sign KEY adds who sealed it)
  2. run it: bistat run {path}
"""


def test_register_prints_the_next_steps_commit_then_run(cli, work):
    """Inside a git repository the next steps name the commit that dates the registration,
    then the run."""
    import subprocess

    subprocess.run(["git", "init", "-q", "."], check=True)
    result = invoke(cli, ["register", "experiments/minimal.toml"])
    assert result.exit_code == 0
    assert result.output.endswith(
        "\nNext:\n"
        "  1. commit it, so that git dates it before the run's first record: git add "
        "preregistrations/minimal.json && git commit -m \"Register minimal\"\n"
        "  2. run it: bistat run preregistrations/minimal.json\n")


def test_register_twice_is_an_error(cli, work):
    invoke(cli, ["register", "experiments/minimal.toml"])
    result = invoke(cli, ["register", "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output == (
        "Error: preregistrations/minimal.json already exists; a registration is never "
        "overwritten. To change the declaration before any data is recorded: bistat register "
        "experiments/minimal.toml --amend --reason \"...\"; otherwise register it under a new "
        "name\n")


def test_register_json(cli, work):
    result = invoke(cli, ["register", "--json", "--registrations-dir", "regs",
                          "experiments/minimal.toml"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["path"] == "regs/minimal.json"
    assert data["sha256"] == prereg.sha256_hex(data["sealed"])
    assert data["sealed"]["design"]["warnings"][0].startswith("rule.labels[0].all[0]")


def test_register_bad_declaration(cli, work):
    shutil.copy(DECL / "bad-role.toml", "experiments/bad-role.toml")
    result = invoke(cli, ["register", "experiments/bad-role.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output == (
        "Error: experiments/bad-role.toml: arms[1].role: 'treatmnt' is not allowed; expected "
        "one of 'control', 'treatment'\n")
    assert not Path("preregistrations").exists()


def test_amend_and_the_refusals(cli, work):
    invoke(cli, ["register", "experiments/minimal.toml"])
    result = invoke(cli, ["register", "--amend", "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 2
    assert result.output.endswith("Error: --amend needs --reason \"why the declaration "
                                  "changes\"\n")
    result = invoke(cli, ["register", "--reason", "x", "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 2
    assert result.output.endswith("Error: --reason is only used with --amend\n")
    result = invoke(cli, ["register", "--amend", "--reason", "x",
                          "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output.startswith("Error: experiments/minimal.toml is unchanged since "
                                    "preregistrations/minimal.json was sealed")

    f = Path("experiments/minimal.toml")
    f.write_text(f.read_text().replace("n_prompts = 400", "n_prompts = 600"))
    work["now"] = T0 + dt.timedelta(minutes=5)
    result = invoke(cli, ["register", "--amend", "--reason", "more prompts for power",
                          "experiments/minimal.toml"])
    assert result.exit_code == 0
    reg = prereg.load_registration("preregistrations/minimal.json")
    assert result.output.startswith(
        "Amended 'minimal' in preregistrations/minimal.json\n"
        f"  sha256:     {reg.sha256}\n"
        "  registered: 2026-03-01T12:00:00.000000Z\n"
        "  amended:    2026-03-01T12:05:00.000000Z (1 amendment; reason: more prompts for "
        "power)\n"
        "  bistat:     0.1.0\n"
        "  git:        not in a git repository\n"
        "\n"
        "Design analysis of 'minimal': 600 prompts,")

    # a run naming the registration with no response yet (its engine never started) does not
    # block an amendment; one recorded response does
    run = Path("runs/minimal-1")
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "schema": "bistat.run/1", "registration": reg.reference(),
        "created_utc": "2026-03-01T12:10:00.000000Z"}))
    assert prereg._has_data(run) is False
    (run / "responses.jsonl").write_text('{"schema": "bistat.responses/1"}\n')
    assert prereg._has_data(run) is True
    f.write_text(f.read_text().replace("n_prompts = 600", "n_prompts = 700"))
    result = invoke(cli, ["register", "--amend", "--reason", "even more",
                          "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output == (
        "Error: cannot amend preregistrations/minimal.json: data has been recorded for it "
        "(runs/minimal-1); a registration cannot change after data exists. Register the "
        "changed declaration under a new name\n")


def test_verify_ok_tampered_and_back_dated(cli, work):
    invoke(cli, ["register", "experiments/minimal.toml"])
    reg = prereg.load_registration("preregistrations/minimal.json")
    work["now"] = T0 + dt.timedelta(hours=1)
    result = invoke(cli, ["verify", "preregistrations/minimal.json"])
    assert result.exit_code == 0
    assert result.output == (
        f"OK: preregistrations/minimal.json is intact (sha256 {reg.sha256})\n"
        "  registered: 2026-03-01T12:00:00.000000Z\n"
        "  no recorded runs checked (none in its run ledger or --runs-dir)\n"
        "  no git evidence (not in a git repository): only the seal's integrity is shown\n")

    run = Path("runs/minimal-1")
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "schema": "bistat.run/1", "registration": reg.reference(),
        "created_utc": "2026-03-01T12:10:00.000000Z"}))
    (run / "schedule.jsonl").write_text(json.dumps(
        {"event": "start", "time_utc": "2026-03-01T12:11:00.000000Z"}) + "\n")
    result = invoke(cli, ["verify", "preregistrations/minimal.json", "runs/minimal-1"])
    assert result.exit_code == 0
    assert result.output == (
        f"OK: preregistrations/minimal.json is intact (sha256 {reg.sha256})\n"
        "  registered: 2026-03-01T12:00:00.000000Z\n"
        "  1 run of this registration, 2 timed records, all after the registration (earliest "
        "2026-03-01T12:10:00.000000Z)\n"
        "  no git evidence (not in a git repository): only the seal's integrity is shown\n")

    # back-dated: a datum older than the registration
    (run / "schedule.jsonl").write_text(json.dumps(
        {"event": "start", "time_utc": "2026-03-01T11:00:00.000000Z"}) + "\n")
    result = invoke(cli, ["verify", "preregistrations/minimal.json"], ok=False)
    assert result.exit_code == 1
    assert result.output == (
        "Error: runs/minimal-1: 1 recorded datum(s) are not later than the registration (sealed "
        "2026-03-01T12:00:00.000000Z), e.g. runs/minimal-1/schedule.jsonl:1 time_utc = "
        "2026-03-01T11:00:00.000000Z; the registration does not precede the data (back-dated "
        "data or a registration made after the run)\n")
    result = invoke(cli, ["verify", "--json", "preregistrations/minimal.json"], ok=False)
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False and data["runs"] == ["runs/minimal-1"]
    assert data["n_data"] == 2

    # tampered: the threshold edited in place
    path = Path("preregistrations/minimal.json")
    path.write_text(path.read_text().replace('"at_least": 0.99', '"at_least": 0.9'))
    result = invoke(cli, ["verify", "preregistrations/minimal.json", "runs/minimal-1"],
                    ok=False)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0].startswith("Error: preregistrations/minimal.json: seal broken: the sealed "
                               "content hashes to ")
    assert lines[1] == ("preregistrations/minimal.json: declaration_sha256 does not match the "
                        "declaration; the declaration was changed after it was sealed")


def test_verify_missing_registration(cli, work):
    result = invoke(cli, ["verify", "preregistrations/nope.json"], ok=False)
    assert result.exit_code == 1
    assert result.output == "Error: preregistrations/nope.json: no such registration\n"


def test_design_text_and_json(cli, work):
    result = invoke(cli, ["design", "experiments/minimal.toml"])
    assert result.exit_code == 0
    assert result.output == DESIGN_MINIMAL
    result = invoke(cli, ["design", "--json", "experiments/minimal.toml"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["match"][0]["min_prompts"] == 381
    assert data["match"][0]["mismatches_tolerated"] == 0
    assert [p["true_ratio"] for p in data["throughput"][0]["power"]] == [0.8, 0.9, 1.0]
    assert data["cv_source"] == "assumed; none declared"
    assert not Path("preregistrations").exists()  # design writes nothing


def test_design_warns_when_the_plan_cannot_reach_a_verdict(cli, work):
    # two passes per arm at 10 % CV cannot tell 0.90 from 1.00 with an interval criterion
    f = Path("experiments/minimal.toml")
    f.write_text(f.read_text()
                 .replace("passes = 3", "passes = 2")
                 .replace('{ criterion = "throughput_ratio", below = 0.90 }',
                          '{ criterion = "throughput_slower", bound = 1.0 }')
                 .replace("[rule]", "[design]\nexpected_cv = 0.10\ntrue_ratios = [0.9, 1.0]\n"
                                    "assumed_match_rate = 1.0\n\n[rule]"))
    result = invoke(cli, ["design", "experiments/minimal.toml"])
    assert result.exit_code == 0
    assert "    P(met) at true ratio 0.9: 0.046, 1: 0.012\n" in result.output
    # the fixture's rule reads a slowdown as evidence that the mode acts: named too
    assert result.output.endswith(
        "Warnings (2):\n"
        "  - rule.labels[0].all[1] ('working': throughput ratio 95 % interval, upper end "
        "(treatment slower) < 1): at a true ratio of 0.9, P(met) = 0.046 with 2 passes per arm "
        "at CV 0.1, below the power target 80%; 16 passes per arm would give 80% power; set "
        "workload.passes >= 16\n"
        "  - rule.labels[0].all[1] ('working': throughput ratio 95 % interval, upper end "
        "(treatment slower) < 1) " + SPEED + "\n")


def test_design_cv_from_an_earlier_run(cli, work):
    f = Path("experiments/minimal.toml")
    f.write_text(f.read_text().replace("[rule]", "[design]\ncv_from = \"runs/old\"\n\n[rule]"))
    result = invoke(cli, ["design", "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output == ("Error: design.cv_from: runs/old: no passes.jsonl there; name a run "
                             "directory of an earlier run, or declare design.expected_cv "
                             "instead\n")
    Path("runs/old").mkdir(parents=True)
    lines = [{"arm": "a", "kind": "warmup", "output_tokens_per_s": 10.0},
             {"arm": "a", "kind": "counted", "output_tokens_per_s": 100.0},
             {"arm": "a", "kind": "counted", "output_tokens_per_s": 110.0},
             {"arm": "b", "kind": "counted", "output_tokens_per_s": 200.0},
             {"arm": "b", "kind": "counted", "output_tokens_per_s": 220.0}]
    Path("runs/old/passes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines)
                                             + '{"arm": "b", "ki')
    result = invoke(cli, ["design", "experiments/minimal.toml"])
    assert result.exit_code == 0
    # stats.pooled_cv([[100, 110], [200, 220]]).cv = 0.0675 (its docstring example)
    assert result.output.splitlines()[0] == (
        "Design analysis of 'minimal': 400 prompts, 3 counted passes per arm, CV 0.0675 "
        "(pooled from runs/old (4 counted passes in 2 arms, 2 degrees of freedom))")


def test_help_everywhere(cli):
    for args in (["--help"], ["register", "--help"], ["verify", "--help"],
                 ["design", "--help"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0
        assert result.output.startswith("Usage: bistat")
    out = CliRunner().invoke(cli, ["verify", "--help"]).output
    assert out.startswith("Usage: bistat verify [OPTIONS] REGISTRATION [RUN_DIR]...\n")


def test_real_cli_has_the_commands():
    from bistat.cli import cli as real
    assert {"register", "verify", "design", "check-release"} <= set(real.commands)


def test_design_single_pass_and_uncomputable_labels(cli, work):
    f = Path("experiments/minimal.toml")
    f.write_text(f.read_text()
                 .replace("passes = 3", "passes = 1")
                 .replace('{ criterion = "throughput_ratio", below = 0.90 }',
                          '{ criterion = "throughput_slower", bound = 0.95 }, '
                          '{ criterion = "match_intervals_overlap", expect = false }')
                 .replace("[rule]", "[design]\nexpected_cv = 0.05\ntrue_ratios = [1.0]\n"
                                    "assumed_match_rate = 1.0\n\n[rule]"))
    result = invoke(cli, ["design", "--json", "experiments/minimal.toml"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["throughput"][0]["power"] == [
        {"true_ratio": 1.0, "prob_met": None, "holds": False, "passes_for_target": None}]
    assert data["labels"] == [{"label": "working", "true_ratio": 1.0, "prob": None,
                               "note": "not computed: a criterion of this label has no design "
                                       "figures"}]
    assert data["other"] == [
        "rule.labels[0].all[2] ('working': treatment's and control's 95 % Wilson match "
        "intervals overlap = no): no design figures (depends on the control arm's unknown match "
        "rate)"]
    assert data["warnings"] == [
        "rule.labels[0].all[1] ('working': throughput ratio 95 % interval, upper end (treatment "
        "slower) < 0.95) cannot be evaluated with workload.passes = 1: 1 counted pass per arm "
        "gives no estimate of pass-to-pass variation, so no ratio interval; set "
        "workload.passes >= 2",
        "rule.labels[0].all[1] ('working': throughput ratio 95 % interval, upper end (treatment "
        "slower) < 0.95) " + SPEED]


def test_verify_of_a_declaration_says_to_give_the_sealed_json(cli, work):
    """``bistat verify experiments/x.toml`` names the registration to give instead of failing to
    parse TOML as JSON."""
    result = invoke(cli, ["verify", "experiments/minimal.toml"], ok=False)
    assert result.exit_code == 1
    assert result.output == (
        "Error: experiments/minimal.toml is a declaration, not a registration; give the sealed "
        ".json (preregistrations/minimal.json, which `bistat register experiments/minimal.toml` "
        "writes)\n")
