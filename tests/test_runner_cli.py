"""``bistat run`` and ``bistat probe`` through CliRunner, on the fake engine (kind "fake")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import fakes
import helpers_runner as h
from bistat.cli import cli
from bistat.declare.prereg import register
from bistat.store.readers import read_jsonl


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    return tmp_path


def _register(workdir: Path, **sections) -> Path:
    (workdir / "experiments").mkdir(exist_ok=True)
    decl = h.write_toml(workdir / "experiments" / "fakerun.toml", h.declaration(**sections))
    register(decl, registrations_dir=workdir / "preregistrations")
    return Path("preregistrations") / "fakerun.json"


def _invoke(*args, **kw):
    return CliRunner().invoke(cli, list(args), prog_name="bistat", **kw)


def test_run_help():
    result = _invoke("run", "--help")
    assert result.exit_code == 0
    assert result.output.startswith("Usage: bistat run [OPTIONS] [REGISTRATION]\n\n"
                                    "  Run a sealed registration (preregistrations/NAME.json) and record everything.\n")
    for option in ("--resume DIRECTORY", "--runs-dir DIRECTORY", "--run-dir DIRECTORY", "--no-progress"):
        assert option in result.output
    assert "Exit codes: 0 the run ended" in result.output


def test_probe_help():
    result = _invoke("probe", "--help")
    assert result.exit_code == 0
    assert result.output.startswith("Usage: bistat probe [OPTIONS] DECLARATION\n")
    assert "Exit codes: 0 whatever the outcome unless --fail-on names its label" in result.output


def test_run_needs_a_registration_or_resume(workdir):
    result = _invoke("run")
    assert result.exit_code == 2
    assert result.output.endswith("Error: give either REGISTRATION or --resume RUN_DIR\n")


def test_missing_registration(workdir):
    result = _invoke("run", "preregistrations/nope.json")
    assert result.exit_code == 1
    assert result.output == (
        "Error: preregistrations/nope.json: no such registration\n"
        "refusing to run an unverified registration; check it with: bistat verify preregistrations/nope.json\n")


def test_a_missing_declaration_is_called_missing_not_a_declaration(workdir):
    """``bistat run nothere.toml`` and ``bistat verify nonexistent.toml`` once answered "is a
    declaration, not a registration" for a file that does not exist."""
    result = _invoke("run", "nothere.toml")
    assert (result.exit_code, result.output) == (1, (
        "Error: nothere.toml: no such file; run a sealed registration: bistat run "
        "preregistrations/NAME.json (bistat register experiments/NAME.toml writes it)\n"))
    result = _invoke("verify", "nonexistent.toml")
    assert (result.exit_code, result.output) == (1, (
        "Error: nonexistent.toml: no such file; give a sealed registration, "
        "preregistrations/NAME.json\n"))
    (workdir / "experiments").mkdir()
    h.write_toml(workdir / "experiments" / "there.toml", h.declaration())
    assert "is a declaration, not a registration" in _invoke("run", "experiments/there.toml").output


def test_tampered_registration_is_refused(workdir):
    path = _register(workdir)
    data = json.loads(path.read_text())
    data["sealed"]["declaration"]["workload"]["passes"] = 2
    path.write_text(json.dumps(data))
    result = _invoke("run", str(path))
    assert result.exit_code == 1
    assert result.output.startswith("Error: preregistrations/fakerun.json: seal broken: ")
    assert result.output.endswith(
        "refusing to run an unverified registration; check it with: bistat verify preregistrations/fakerun.json\n")
    assert not (workdir / "runs").exists()


def test_bad_run_dir_for_resume(workdir):
    (workdir / "empty").mkdir()
    result = _invoke("run", "--resume", "empty")
    assert result.exit_code == 1
    assert result.output == ("Error: cannot resume: empty/run.json: not found; is empty a bistat run "
                             "directory?\n")


def test_run_end_to_end_then_resume_has_nothing_left(workdir):
    path = _register(workdir, arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.5}}},
                                    {"name": "invariant", "role": "treatment"}])
    result = _invoke("run", str(path), "--run-dir", "runs/r1", "--no-progress", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "running fakerun into runs/r1"
    assert [line.split(":")[0] for line in lines[1:11]] == [f"pass {i}/10 {arm} {kind} (seq {i - 1})" for i, (arm, kind) in
                                                             enumerate([("blas", "warmup"), ("invariant", "warmup"),
                                                                        ("blas", "counted"), ("invariant", "counted"),
                                                                        ("invariant", "counted"), ("blas", "counted"),
                                                                        ("blas", "counted"), ("invariant", "counted"),
                                                                        ("invariant", "counted"), ("blas", "counted")],
                                                                       start=1)]
    assert lines[11:14] == ["run complete: runs/r1 (10 pass(es) run)", "next: bistat analyze runs/r1",
                            f"bistat: fakerun run r1 (registration {json.loads(path.read_text())['sha256'][:12]})"]
    # the one-screen CI summary of the run's analysis ends the output
    assert lines[14].startswith("  arm blas (control): matched ")
    assert lines[15] == ("  arm invariant (treatment): matched 12/12, two-sided 95 % Wilson "
                         "[0.7575, 1.0000]; 0 divergence(s)")
    assert lines[16] == "VERDICT invariant vs blas: REPORTED AS OBSERVED"
    assert lines[-1] == "exit 0: no --fail-on given: every verdict exits 0"
    header = json.loads((workdir / "runs/r1/run.json").read_text())
    assert header["registration"]["path"] == "preregistrations/fakerun.json"
    assert header["registration"]["sha256"] == json.loads(path.read_text())["sha256"]

    again = _invoke("run", "--resume", "runs/r1", "--no-progress", catch_exceptions=False)
    assert again.exit_code == 0
    assert again.output.splitlines()[:4] == ["resuming runs/r1", "run complete: runs/r1 (0 pass(es) run)",
                                             "nothing left to run: the schedule is complete",
                                             "next: bistat analyze runs/r1"]
    gated = _invoke("run", "--resume", "runs/r1", "--no-progress", "--fail-on", "reported-as-observed")
    assert gated.exit_code == 11
    assert gated.output.splitlines()[-1] == ("exit 11: verdict 1 is 'reported as observed', named by "
                                             "--fail-on")
    existing = _invoke("run", str(path), "--run-dir", "runs/r1")
    assert existing.exit_code == 1
    assert existing.output == ("Error: runs/r1: a run is already recorded here; choose another --run-dir or "
                               "continue it with --resume runs/r1\n")


def test_default_run_dir_and_untested_exit_code(workdir):
    path = _register(workdir, arms=[{"name": "blas", "role": "control"},
                                    {"name": "invariant", "role": "treatment", "args": {"fake": {"refuse": "mode off"}}}])
    result = _invoke("run", str(path), "--no-progress", "--fail-on", "untested")
    assert result.exit_code == 12
    (run_dir,) = (workdir / "runs").iterdir()
    assert run_dir.name.startswith("fakerun-") and run_dir.name.endswith("Z")
    assert result.output.splitlines()[1:3] == [
        "run untested: engine for arm 'invariant' refused the setting: mode off",
        f"data kept in runs/{run_dir.name}; the finding will say untested: bistat analyze runs/{run_dir.name}"]
    assert "VERDICT invariant vs blas: UNTESTED" in result.output.splitlines()
    assert result.output.splitlines()[-1] == "exit 12: verdict 1 is 'untested', named by --fail-on"
    events, _ = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in events] == ["started", "refused", "stopped"]
    again = _invoke("run", str(path), "--no-progress", "--run-dir", "runs/second")
    assert again.exit_code == 1  # an engine that refused: non-zero without --fail-on
    assert "run untested: engine for arm 'invariant' refused the setting: mode off" in again.output


def test_interrupted_run_tells_how_to_resume_and_resume_completes(workdir):
    path = _register(workdir, arms=[{"name": "blas", "role": "control", "args": {"fake": {"crash_on_call": 1}}},
                                    {"name": "invariant", "role": "treatment"}])
    result = _invoke("run", str(path), "--run-dir", "runs/r", "--no-progress")
    assert result.exit_code == 1
    assert result.output.splitlines()[-3:] == [
        "run stopped: engine for arm 'blas' failed during pass seq 2: fake engine for 'blas' died "
        "(scripted crash on call 1)",
        "data kept in runs/r; continue with: bistat run --resume runs/r",
        "exit 1: an engine failed during a pass; resume it with: bistat run --resume runs/r"]
    # the scripted crash is on the arm's second run_pass call ever: the resumed run gets past it
    resumed = _invoke("run", "--resume", "runs/r", "--no-progress", catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    schedule, _ = read_jsonl(workdir / "runs/r/schedule.jsonl")
    ends = [(r["kind"], r["status"]) for r in schedule if r["event"] == "end"]
    # first run: 2 warm-ups, 1 interrupted pass; the resumed part: 2 warm-ups again, then all 8 counted
    assert ends.count(("counted", "interrupted")) == 1
    assert ends.count(("warmup", "complete")) == 4 and ends.count(("counted", "complete")) == 8


def test_probe_cli_confirmed_json_and_exit_codes(workdir):
    data = h.declaration(arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
                               {"name": "invariant", "role": "treatment"}])
    (workdir / "experiments").mkdir()
    decl = h.write_toml(workdir / "experiments" / "p.toml", data)
    result = _invoke("probe", str(decl), "--max-fillers", "40", "--max-tokens", "5", "--output", "probe.json")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["probing arm blas ...", "probing arm invariant ..."]  # control first
    # the default design: the needle prompt and four long needles among fillers that arrive
    assert result.stdout.splitlines()[0] == (
        "needles chat-0000 and about 112, 176, 304, 600 prompt tokens, 5 tokens each; 3 trial(s) "
        "of 32-40 fillers of 16 tokens arriving while they decode")
    assert result.stdout.splitlines()[-2:] == [
        "outcome: confirmed — every needle bitwise identical alone and in every batch (the fillers "
        "too, across trials), and the negative control differs",
        "exit 0: no --fail-on given: every verdict exits 0"]
    assert json.loads((workdir / "probe.json").read_text())["outcome"] == "confirmed"
    nopower = _invoke("probe", str(decl), "--max-fillers", "40", "--no-control", "--json")
    assert nopower.exit_code == 0  # verdict-producing commands exit 0 unless --fail-on names the label
    assert json.loads(nopower.stdout)["outcome"] == "no_power"
    nopower = _invoke("probe", str(decl), "--max-fillers", "40", "--no-control", "--json", "--fail-on", "any")
    assert nopower.exit_code == 12
    assert json.loads(nopower.stdout)["outcome"] == "no_power"
    violated = _invoke("probe", str(decl), "--arm", "blas", "--control", "invariant", "--max-fillers", "40",
                       "--fail-on", "reported-as-observed,untested")
    assert violated.exit_code == 11
    bad_label = _invoke("probe", str(decl), "--fail-on", "working")
    assert bad_label.exit_code == 2
    assert "'working' has exit code 0 and cannot fail a command" in bad_label.output
    bad = _invoke("probe", str(decl), "--arm", "nope")
    assert (bad.exit_code, bad.output) == (1, "Error: arm 'nope' is not in the declaration; arms: blas, invariant\n")


def test_an_interrupted_probe_keeps_its_finished_arms(workdir, monkeypatch):
    import bistat.run.probe

    data = h.declaration(arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
                               {"name": "inv-a", "role": "treatment"}, {"name": "inv-b", "role": "treatment"}])
    (workdir / "experiments").mkdir()
    decl = h.write_toml(workdir / "experiments" / "p.toml", data)
    real = bistat.run.probe.probe_arm

    def stopped_at_inv_b(engine, name, role, *args):
        if name == "inv-b":   # what `timeout -s INT` does to a probe past its budget
            raise KeyboardInterrupt
        return real(engine, name, role, *args)

    monkeypatch.setattr(bistat.run.probe, "probe_arm", stopped_at_inv_b)
    result = _invoke("probe", str(decl), "--max-fillers", "40", "--max-tokens", "5", "--output",
                     "run/probe.json")
    assert result.exit_code == 130
    assert result.stderr.splitlines()[-1] == ("interrupted: the report of the 2 finished arm(s) is "
                                              "in run/probe.json")
    kept = json.loads((workdir / "run" / "probe.json").read_text())
    # the negative control ran first, so the finished part keeps its power
    assert [a["arm"] for a in kept["arms"]] == ["inv-a", "blas"] and kept["pending"] == ["inv-b"]
    assert kept["outcome"] == "confirmed" and kept["reason"].startswith("partial: inv-b not probed yet")
    assert not list((workdir / "run").glob(".*.tmp"))
    one = _invoke("probe", str(decl), "--arm", "inv-b", "--max-fillers", "40", "--output",
                  "run/probe-2.json")
    assert one.exit_code == 130
    part = json.loads((workdir / "run" / "probe-2.json").read_text())
    assert [a["arm"] for a in part["arms"]] == ["blas"] and part["pending"] == ["inv-b"]
    assert part["outcome"] == "untested"
    monkeypatch.setattr(bistat.run.probe, "probe_arm", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    none = _invoke("probe", str(decl), "--max-fillers", "40", "--output", "run/probe-3.json")
    assert none.exit_code == 130 and not (workdir / "run" / "probe-3.json").exists()
    assert none.stderr.splitlines()[-1] == "interrupted: no arm had finished, nothing was written"


def test_probe_cli_vacuous_and_mode(workdir):
    data = h.declaration(arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
                               {"name": "invariant", "role": "treatment"}])
    (workdir / "experiments").mkdir()
    decl = h.write_toml(workdir / "experiments" / "p.toml", data)
    # one filler at most, submitted with the needle: the fake runs them as one batch of 2, so
    # the needle shares its step; the prefix-cache mode on the fake (no cache) is unsupported
    result = _invoke("probe", str(decl), "--mode", "prefix-cache", "--min-fillers", "1",
                     "--max-fillers", "1", "--fail-on", "untested")
    assert result.exit_code == 12
    assert result.stdout.splitlines()[-2:] == [
        "outcome: untested — invariant: unsupported: engine kind 'fake' has no prefix cache",
        "exit 12: verdict 1 is 'untested', named by --fail-on"]
    bad = _invoke("probe", str(decl), "--mode", "sideways")
    assert bad.exit_code == 2 and "Invalid value for '--mode'" in bad.output


def _rule(otherwise, at_least=0.999999):
    return {"confidence_level": 0.95, "otherwise": otherwise,
            "labels": [{"label": "working", "all": [
                {"criterion": "match_lower_bound", "arm": "treatment", "at_least": at_least}]}]}


@pytest.mark.parametrize("label,code,sections", [
    ("working", 0, {"rule": _rule("doubtful", at_least=0.5)}),
    ("doubtful", 10, {"rule": _rule("doubtful")}),
    ("reported as observed", 11, {"rule": _rule("reported as observed")}),
    # the fake runs a final sample with 0 running: a mean of 4 running is never reached
    ("untested", 12, {"validity": {"min_mean_running": 4.0}}),
])
def test_run_exit_code_for_every_verdict(workdir, label, code, sections):
    """Every verdict label reaches the exit code through `bistat run --fail-on any`."""
    path = _register(workdir, **sections)
    result = _invoke("run", str(path), "--run-dir", f"runs/{code}", "--no-progress", "--fail-on", "any")
    assert result.exit_code == code, result.output
    assert f"VERDICT invariant vs blas: {label.upper()}" in result.output.splitlines()
    assert result.output.splitlines()[-1] == (
        f"exit {code}: verdict 1 is {label!r}, named by --fail-on" if code else
        "exit 0: no verdict has a label named by --fail-on")
    assert _invoke("run", "--resume", f"runs/{code}", "--no-progress").exit_code == 0


def test_probe_needle_from_a_recorded_run(workdir):
    """--needle-from RUN_DIR: the prompt the run saw diverge first is the needle (h200-match-
    smollm2-r2's needle, prompt 0, stayed identical while 457 of 541 prompts diverged)."""
    diverging = {"fake": {"divergence": 0.3}}
    path = _register(workdir, arms=[{"name": "blas", "role": "control", "args": diverging},
                                    {"name": "invariant", "role": "treatment", "args": diverging}],
                     workload={"seed": 4})
    assert _invoke("run", str(path), "--run-dir", "runs/r", "--no-progress").exit_code == 0
    # another declaration of the same workload (the probe's arms are its own)
    decl = h.write_toml(workdir / "experiments" / "p.toml", h.declaration(
        arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
              {"name": "invariant", "role": "treatment"}], workload={"seed": 4}))
    result = _invoke("probe", str(decl), "--needle-from", "runs/r", "--max-fillers", "11",
                     "--min-fillers", "8", "--design", "single", "--output", "probe.json")
    assert result.exit_code == 0, result.output
    # prompts 3 and 4 both first diverged at token 0: the lower index wins
    why = ("prompt 3 (chat-0003) first diverged at token 0 in arm invariant, pass 4 of runs/r "
           "(against pass 1), the earliest of 11 diverging prompt(s)")
    assert result.stderr.splitlines()[0] == f"needle: {why}"
    assert result.stdout.splitlines()[:2] == ["needle chat-0003, 3 trial(s) of 8-11 fillers, 6 tokens",
                                              f"needle chosen: {why}"]
    data = json.loads((workdir / "probe.json").read_text())
    assert data["needle_prompt_id"] == "chat-0003" and data["settings"]["needle_index"] == 3
    assert data["needle_source"] == {
        "run": "runs/r", "run_id": "r", "prompt_id": "chat-0003", "prompt_index": 3,
        "arm": "invariant", "pass_index": 4, "reference_pass": 1, "position": 0, "kind": "token",
        "n_prompts_diverged": 11}

    both = _invoke("probe", str(decl), "--needle-from", "runs/r", "--needle", "0")
    assert both.exit_code == 2
    assert both.output.endswith("Error: --needle and --needle-from exclude each other\n")

    other = h.write_toml(workdir / "experiments" / "other.toml", h.declaration(workload={"seed": 4, "n_prompts": 16}))
    mismatched = _invoke("probe", str(other), "--needle-from", "runs/r")
    assert mismatched.exit_code == 1
    assert mismatched.output.startswith(
        "Error: runs/r/run.json: the run was recorded with other prompts than "
        f"{other}'s workload (workload.n_prompts 12 in the run, 16 in {other}; workload_sha256 ")
    assert mismatched.output.endswith(
        "a prompt index names another prompt in each; choose the needle from a run of this "
        "declaration's workload, or give the needle's index with --needle INDEX\n")

    missing = _invoke("probe", str(decl), "--needle-from", "runs/nope")
    assert (missing.exit_code, missing.output) == (
        1, "Error: runs/nope/run.json: not found; is runs/nope a bistat run directory?\n")


def test_probe_needle_from_a_run_where_nothing_diverged(workdir):
    path = _register(workdir)
    assert _invoke("run", str(path), "--run-dir", "runs/quiet", "--no-progress").exit_code == 0
    result = _invoke("probe", str(path), "--needle-from", "runs/quiet")
    assert (result.exit_code, result.output) == (
        1, "Error: runs/quiet: no prompt diverged in the run (prompts compared across the counted "
           "passes per arm, bitwise: blas 12, invariant 12), so it cannot choose the needle; give "
           "the needle's index with --needle INDEX instead\n")


def test_run_refuses_a_busy_gpu_with_its_own_message(workdir, monkeypatch):
    """The refusal lives in the runner; `bistat run` says it as before, naming its flag, when it
    looks first and when only the runner's look finds the GPU busy (a process that came since)."""
    busy = [{"gpu_uuid": "GPU-x", "pid": 1105, "name": "VLLM::EngineCore", "used_memory_mib": 28930}]
    message = ("Error: other processes hold the GPU: pid 1105 VLLM::EngineCore (28930 MiB on "
               "GPU-x). They would share its memory and time with the engines this run starts "
               "(and a leftover run's engines are among them). Stop them, or record the run "
               "anyway with --allow-busy-gpu (its finding will list this as a deviation)\n")
    path = _register(workdir, engine={"kind": "vllm-server", "model": "/tmp/m"})
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: busy)
    result = _invoke("run", str(path), "--run-dir", "runs/busy", "--no-progress")
    assert (result.exit_code, result.output) == (1, message)
    looks = iter([[], busy])
    monkeypatch.setattr("bistat.run.fingerprint.gpu_processes", lambda: next(looks))
    result = _invoke("run", str(path), "--run-dir", "runs/busy", "--no-progress")
    assert (result.exit_code, result.output) == (1, "running fakerun into runs/busy\n" + message)
    assert not (workdir / "runs").exists()
