"""Every run of a registration is visible: ``analyze`` never replaces another run's finding
without ``--force``, every finding lists every run its registration's run ledger and the run's
folder know (id, date, how much it recorded, its verdict), the index marks a registration run
more than once, and ``bistat verify`` counts them. Through the CLI, on the fake engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import fakes
import helpers_runner as h
from bistat.cli import cli
from bistat.declare.prereg import register


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    (tmp_path / "experiments").mkdir()
    decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml", h.declaration(
        arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
              {"name": "invariant", "role": "treatment"}]))
    register(decl, registrations_dir=tmp_path / "preregistrations")
    return tmp_path


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="bistat")


def _run(name: str, *extra: str) -> None:
    result = _invoke("run", "preregistrations/fakerun.json", "--run-dir", f"runs/{name}",
                     "--no-progress", *extra)
    assert result.exit_code == 0, result.output


def _created(name: str) -> str:
    return json.loads(Path(f"runs/{name}/run.json").read_text())["created_utc"]


def test_a_second_run_does_not_replace_the_first_run_s_finding(workdir):
    _run("first")
    assert _invoke("analyze", "runs/first", "--out", "findings").exit_code == 0
    first = Path("findings/fakerun.md").read_text()
    _run("second")
    refused = _invoke("analyze", "runs/second", "--out", "findings")
    assert refused.exit_code == 1
    assert refused.output == (
        "Error: findings/fakerun.md is the finding of run first; this is run second, and writing "
        "its finding there would replace that run's. Write it elsewhere (--out DIR), or replace "
        "it with --force (both runs stay listed under 'Runs of this registration')\n")
    assert Path("findings/fakerun.md").read_text() == first
    # the same run again is a regeneration, not a replacement
    assert _invoke("analyze", "runs/first", "--out", "findings").exit_code == 0
    forced = _invoke("analyze", "runs/second", "--out", "findings", "--force")
    assert forced.exit_code == 0, forced.output
    assert "| Run | `second` |" in Path("findings/fakerun.md").read_text()


def test_every_finding_lists_every_run_of_its_registration(workdir):
    _run("first")
    _run("second")
    _run("third")
    shutil.rmtree("runs/third")   # started, then its directory removed: the ledger still says so
    assert _invoke("analyze", "runs/second", "--out", "findings").exit_code == 0
    finding = Path("findings/fakerun.md").read_text()
    assert ("| Runs of its registration | 3 (this one and 2 others: see Runs of this "
            "registration) |") in finding
    section = finding.split("## Runs of this registration\n\n")[1].split("\n## ")[0]
    assert section == (
        "3 runs were recorded under `preregistrations/fakerun.json` that its run ledger "
        "(`preregistrations/.fakerun.runs`, written by `bistat run` as each run starts) and this "
        "run's folder know. Every run of a registration is listed with its verdict under this "
        "finding's rule, so that none can be left out for its result.\n\n"
        "| run | created (UTC) | recorded | verdict | found in |\n"
        "|---|---|---|---|---|\n"
        f"| `first` | {_created('first')} | complete (4 of 4 counted passes per arm) | "
        "reported as observed (invariant vs blas) | its folder; the run ledger |\n"
        f"| `second` | {_created('second')} | complete (4 of 4 counted passes per arm) | "
        "reported as observed (invariant vs blas) | this run |\n"
        "| `third` | — | directory gone (listed in the run ledger) | — | the run ledger |\n")

    # the index marks the registration run more than once
    index = _invoke("index", "findings")
    assert index.exit_code == 0, index.output
    readme = Path("findings/README.md").read_text()
    assert "| `second` (one of 3 runs of its registration) |" in readme

    # bistat verify counts them (and names the ledger's run that is gone)
    verify = _invoke("verify", "preregistrations/fakerun.json")
    assert verify.exit_code == 0, verify.output
    lines = verify.output.splitlines()
    assert lines[2].startswith("  2 runs of this registration, ")
    assert lines[3:5] == ["    runs/first", "    runs/second"]
    assert lines[5] == ("  its run ledger lists 1 more run directory no longer there: "
                        "runs/third")
    as_json = json.loads(_invoke("verify", "preregistrations/fakerun.json", "--json").output)
    assert (as_json["n_runs"], as_json["ledger_missing"]) == (2, ["runs/third"])


def test_a_run_whose_ledger_stayed_on_another_machine_says_so(workdir):
    """A run recorded on a lent GPU comes back as its data folder, without the registration's
    run ledger: the finding lists what the folder knows and says the ledger is not there."""
    _run("first")
    _run("second")
    Path("preregistrations/.fakerun.runs").unlink()
    assert _invoke("analyze", "runs/second", "--out", "findings").exit_code == 0
    section = (Path("findings/fakerun.md").read_text()
               .split("## Runs of this registration\n\n")[1].split("\n\n")[0])
    assert section == (
        "2 runs were recorded under `preregistrations/fakerun.json` that this run's folder knows. "
        "Its run ledger (`preregistrations/.fakerun.runs`, written by `bistat run` as each run "
        "starts) is not here: the run was recorded on another machine, so a run recorded there "
        "and not brought back cannot be listed. Every run of a registration is listed with its "
        "verdict under this finding's rule, so that none can be left out for its result.")
    assert "| `first` |" in Path("findings/fakerun.md").read_text()


def test_a_run_stopped_early_is_listed_as_such_with_its_verdict(workdir):
    _run("whole")
    (workdir / "experiments" / "fakerun.toml").write_text(
        (workdir / "experiments" / "fakerun.toml").read_text())
    result = _invoke("run", "preregistrations/fakerun.json", "--run-dir", "runs/cut",
                     "--no-progress")
    assert result.exit_code == 0
    # cut the second run's schedule after its first counted passes: as a run stopped early
    sched = [json.loads(x) for x in Path("runs/cut/schedule.jsonl").read_text().splitlines()]
    keep = [r for r in sched if r["seq"] < 4]
    Path("runs/cut/schedule.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    for t in ("passes", "responses"):
        rows = [json.loads(x) for x in Path(f"runs/cut/{t}.jsonl").read_text().splitlines()]
        Path(f"runs/cut/{t}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows if r["seq"] < 4))
    for p in Path("runs/cut").glob("*.parquet"):
        p.unlink()
    assert _invoke("analyze", "runs/whole", "--out", "findings").exit_code == 0
    finding = Path("findings/fakerun.md").read_text()
    assert (f"| `cut` | {_created('cut')} | stopped early (blas 1, invariant 1 of 4 counted "
            "passes) | untested (invariant vs blas) | its folder; the run ledger |") in finding


def test_compare_sets_any_two_runs_side_by_side_labelled_by_run(workdir):
    """``bistat compare`` on two runs of an engine that is not vLLM: the engine named from each
    run's fingerprint (never "vLLM ?"), each row labelled by its run, and --json."""
    _run("first")
    _run("second")
    result = _invoke("compare", "runs/first", "runs/second")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "vLLM ?" not in out
    assert out.startswith("# Release comparison: first (fake fake-1.0) → second (fake fake-1.0)\n")
    assert "| arm | run | engine | backend | mode | matched / compared |" in out
    assert "| invariant | `first` | fake fake-1.0 | fake | — | 12 / 12 |" in out
    assert "| invariant | `second` | fake fake-1.0 | fake | — | 12 / 12 |" in out
    assert ("Not looked up: `src/bistat/data/vllm_changes.toml` lists vLLM's changes, and these "
            "runs are not both on vLLM.") in out
    data = json.loads(_invoke("compare", "runs/first", "runs/second", "--json").output)
    assert (data["earlier_run"], data["later_run"]) == ("first", "second")
    assert (data["earlier_engine"], data["later_engine"]) == ("fake fake-1.0", "fake fake-1.0")
    assert (data["earlier_version"], data["later_version"]) == (None, None)
    (inv,) = [a for a in data["arms"] if a["later"]["arm"] == "invariant"]
    assert (inv["earlier"]["n_matched"], inv["later"]["n_units"]) == (12, 12)
    assert inv["explanation"] == ("unchanged (bistat's table of upstream changes is vLLM's; not "
                                  "looked up)")
    written = _invoke("compare", "runs/first", "runs/second", "--out", "cmp.md")
    assert written.output == "wrote cmp.md\n"
    assert Path("cmp.md").read_text() == out
