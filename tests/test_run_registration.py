"""One resolver of a run's registration, with the seal checked:
``bistat run --resume``, ``analyze``, ``inspect``, ``diagnose`` and ``replay`` find the same
registration the same way and refuse one whose seal does not verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import fakes
import helpers_runner as h
from helpers_analysis import declaration, make_run, register_tiny

from bistat.analysis.summary import analyze_run
from bistat.cli import cli
from bistat.declare.prereg import register, sha256_hex
from bistat.declare.run_registration import (
    RunRegistrationError,
    run_declaration,
    run_registration,
)
from bistat.explain.diagnose import diagnose_run
from bistat.explain.inspect_run import inspect_run
from bistat.explain.replay import ReplayError, replay_prompt
from bistat.store.run_dir import RecordedRun


def _invoke(*args, **kw):
    return CliRunner().invoke(cli, list(args), prog_name="bistat", **kw)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A complete run of the fake engine, recorded by ``bistat run`` (relative paths)."""
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    (tmp_path / "experiments").mkdir()
    decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml", h.declaration(
        arms=[{"name": "blas", "role": "control"}, {"name": "invariant", "role": "treatment"}]))
    register(decl, registrations_dir=tmp_path / "preregistrations")
    reg = Path("preregistrations") / "fakerun.json"
    result = _invoke("run", str(reg), "--run-dir", "runs/r1", "--no-progress")
    assert result.exit_code == 0, result.output
    return Path("runs/r1"), reg


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file()}


def test_a_resume_under_a_tampered_registration_is_refused(recorded):
    run, reg = recorded
    before = _files(run)
    data = json.loads(reg.read_text())
    data["sealed"]["declaration"]["workload"]["passes"] = 3   # one more pass, seal not redone
    reg.write_text(json.dumps(data))
    result = _invoke("run", "--resume", str(run), "--no-progress")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0].startswith(f"Error: cannot resume: {reg}: seal broken: the sealed content "
                               "hashes to ")
    assert lines[-1] == (f"restore the registration as it was sealed from your own copy of it "
                         f"(git never committed {reg}, so git cannot restore it), and check it "
                         f"with `bistat verify {reg} {run}`")
    assert _files(run) == before   # nothing was appended


def test_a_resume_under_another_valid_seal_is_refused(recorded):
    run, reg = recorded
    before = _files(run)
    data = json.loads(reg.read_text())
    recorded_seal = data["sha256"]
    data["sealed"]["bistat_version"] = "0.0.0"   # sealed again: verifies, but is not the run's
    data["sha256"] = sha256_hex(data["sealed"])
    reg.write_text(json.dumps(data))
    assert run_registration(run).registration.sha256 == data["sha256"] != recorded_seal
    result = _invoke("run", "--resume", str(run), "--no-progress")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {run / 'run.json'}: recorded against registration seal {recorded_seal}, but "
        f"{reg} is now sealed as {data['sha256']}; a run cannot continue under another "
        "registration\n")
    assert _files(run) == before


def test_resume_finds_the_registration_relative_to_the_run_directory(recorded, tmp_path,
                                                                       monkeypatch):
    """A run moved with its registration beside it (``RUN/preregistrations/NAME.json``): the
    resume finds it as the analysis does, from the run directory."""
    run, reg = recorded
    moved = tmp_path / "elsewhere" / "r1"
    shutil.copytree(run, moved)
    (moved / "preregistrations").mkdir()
    shutil.copy(reg, moved / reg)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_registration(moved).path == moved / reg
    result = _invoke("run", "--resume", str(moved), "--no-progress")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:2] == [f"resuming {moved}",
                                              f"run complete: {moved} (0 pass(es) run)"]


@pytest.fixture
def moved_run(tmp_path, monkeypatch):
    """A synthetic run whose ``run.json`` names its registration by a path that resolves only
    from the run directory (the working directory is elsewhere)."""
    reg = register_tiny(tmp_path, declaration(n_prompts=6, passes=2))
    run = make_run(tmp_path, reg, lambda arm, p, i: [1, 2, 3] if arm == "trt" or p == 0
                   else [1, 2, 4 + i % 2])
    (run / "preregistrations").mkdir()
    shutil.copy(reg.path, run / "preregistrations" / "tiny.json")
    header = json.loads((run / "run.json").read_text())
    header["registration"]["path"] = "preregistrations/tiny.json"
    (run / "run.json").write_text(json.dumps(header))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return run, reg


def test_analyze_inspect_diagnose_and_replay_find_the_same_registration(moved_run):
    run, reg = moved_run
    found = run_registration(run)
    assert found.path == run / "preregistrations" / "tiny.json" and found.is_recorded_seal
    assert found.registration.sha256 == reg.sha256
    assert analyze_run(run).registration_sha256 == reg.sha256
    assert inspect_run(run).registration_state == "seal verified"
    assert run_declaration(run) == reg.declaration
    assert {a.arm for a in diagnose_run(run).anatomy.arms} == {"ctl", "trt"}
    # replay reads the registered workload before it starts an engine: a prompt it lacks is
    # refused naming the registration's experiment and workload
    with pytest.raises(ReplayError, match=r"--prompt 'nope' is not a prompt of tiny's workload "
                                          r"\(builtin:token-ids\)"):
        replay_prompt(run, "nope")
    # opened once, resolved once
    opened = RecordedRun.open(run)
    assert run_registration(opened) is run_registration(opened)


def test_a_tampered_registration_stops_every_reader(moved_run):
    run, _ = moved_run
    path = run / "preregistrations" / "tiny.json"
    data = json.loads(path.read_text())
    data["sealed"]["declaration"]["match"]["unit"] = "text"
    path.write_text(json.dumps(data))
    seal = rf"{path}: seal broken: the sealed content hashes to "
    fix = (rf"git never committed {path}, so git cannot restore it\), and check it with "
           rf"`bistat verify {path} {run}`")
    for read in (analyze_run, run_declaration, diagnose_run, lambda r: replay_prompt(r, "p0")):
        with pytest.raises(RunRegistrationError, match=rf"(?s)^{seal}.*{fix}$") as err:
            read(run)
        assert err.value.reason == "seal broken"
    assert inspect_run(run).registration_state.startswith(f"seal broken: {seal[:-2]}")
    assert inspect_run(run).missing == ()
    # analyze --registration names the file to use: its seal is checked the same way
    with pytest.raises(RunRegistrationError, match="seal broken"):
        analyze_run(run, path)


def test_a_run_that_names_no_registration_or_one_not_here(moved_run):
    run, _ = moved_run
    header = json.loads((run / "run.json").read_text())
    header["registration"]["path"] = "preregistrations/gone.json"
    (run / "run.json").write_text(json.dumps(header))
    with pytest.raises(RunRegistrationError, match=r"registration.path 'preregistrations/gone"
                                                   r"\.json' does not exist here .* pass "
                                                   r"--registration PATH") as err:
        run_registration(run)
    assert err.value.reason == "not found"
    assert run_declaration(run) is None   # readers that have defaults use them
    assert inspect_run(run).registration_state.startswith("not found: preregistrations/gone.json")
    del header["registration"]
    (run / "run.json").write_text(json.dumps(header))
    with pytest.raises(RunRegistrationError, match=r"run\.json: field 'registration\.path' "
                                                   r"missing; pass --registration PATH"):
        run_registration(run)
    assert inspect_run(run).registration_state == "not named: run.json has no registration.path"


def test_the_restore_hint_names_git_only_where_git_has_the_file(tmp_path):
    """A tampered file is restored with ``git checkout -- PATH`` only where a commit holds it
    (at HEAD, or by its commit once deleted); a file git never committed is restored from the
    reader's own copy, and the hint says why git cannot."""
    import subprocess

    from bistat.store.restore import restore_hint

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                        "user.email=t@t", *args], check=True, capture_output=True)

    git("init", "-q")
    kept, never, gone = tmp_path / "kept.json", tmp_path / "never.json", tmp_path / "gone.json"
    for p in (kept, never, gone):
        p.write_text("{}")
    git("add", "kept.json", "gone.json")
    git("commit", "-q", "-m", "one")
    first = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
    git("rm", "-q", "gone.json")
    git("commit", "-q", "-m", "two")
    gone.write_text("{}")
    assert restore_hint(kept) == f"with `git checkout -- {kept}`"
    assert restore_hint(gone) == f"with `git checkout {first[:12]} -- {gone}`"
    assert restore_hint(never) == (f"from your own copy of it (git never committed {never}, so "
                                   "git cannot restore it)")
