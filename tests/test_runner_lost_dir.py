"""A run whose directory is removed or replaced while it records stops before its next pass.

On the embedded engine (a tiny random model): after the second pass the run directory is renamed
away and a copy put in its place (through ``bistat run``), or removed and made again empty
(through the library). Either way the run must stop with the documented exit code and a message
naming what happened and where the open files can be read, stop its engines, and keep every
record it had made, copied from the descriptors it held into a new directory beside the old.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from click.testing import CliRunner

import helpers_runner as h
from bistat.cli import cli
from bistat.core.exitcodes import RUN_DIR_LOST
from bistat.declare.prereg import register
from bistat.engines.embedded.adapter import EmbeddedEngineAdapter
from bistat.model.testing import tiny_random_model
from bistat.run import runner, session
from bistat.run.runner import NullReporter, PlainReporter, start_run
from bistat.store.format import TABLES
from bistat.store.readers import read_jsonl

ENGINE = {"kind": "embedded", "model": "tiny", "args": {"max_batch_size": 8, "max_model_len": 256}}
ARMS = [{"name": "blas", "role": "control", "args": {"gemm": "blas"}},
        {"name": "invariant", "role": "treatment", "args": {"gemm": "invariant"}}]
WORKLOAD = {"source": "builtin:token-ids?length=6&vocab=400", "n_prompts": 8, "max_tokens": 4,
            "concurrency": 4, "passes": 2, "warmup_passes": 1, "ignore_eos": True}
REG = {"path": "p.json", "sha256": "0" * 64, "registered_utc": "2026-01-01T00:00:00Z",
       "name": "fakerun"}

started: list[str] = []
stopped: list[str] = []


class _Tracked(EmbeddedEngineAdapter):
    """The embedded engine, noting its starts and stops (the run must stop what it started)."""

    def start(self):
        started.append(self.arm_name)
        return super().start()

    def stop(self) -> None:
        stopped.append(self.arm_name)
        super().stop()


def _factory(experiment, arm):
    return _Tracked(experiment, arm, loader=lambda name: tiny_random_model(0, tokenizer="byte"))


def _files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def _new_lines(before: bytes, after: bytes) -> list[dict]:
    assert after.startswith(before)
    return [json.loads(line) for line in after[len(before):].decode().splitlines()]


def test_bistat_run_stops_when_its_directory_is_replaced_by_a_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started.clear()
    stopped.clear()
    (tmp_path / "experiments").mkdir()
    decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml",
                        h.declaration(engine=ENGINE, arms=ARMS, workload=WORKLOAD))
    register(decl, registrations_dir=tmp_path / "preregistrations", check_engine=False)
    monkeypatch.setattr(runner, "_default_factory", lambda: _factory)
    run_dir = Path("runs/r1")
    snapshot: dict[str, bytes] = {}
    finished = PlainReporter.pass_finished

    def pass_finished(self, report):
        finished(self, report)
        if report.planned.seq == 1:   # after the second pass: rename away, copy back
            os.rename(run_dir, "runs/r1.moved")
            shutil.copytree("runs/r1.moved", run_dir)
            snapshot.update(_files(run_dir))

    monkeypatch.setattr(PlainReporter, "pass_finished", pass_finished)
    result = CliRunner().invoke(cli, ["run", "preregistrations/fakerun.json", "--run-dir",
                                      str(run_dir), "--no-progress"], prog_name="bistat")

    assert result.exit_code == RUN_DIR_LOST == 3, result.output
    (rescued,) = Path("runs").glob("r1.rescued-*")
    assert re.fullmatch(r"r1\.rescued-\d{8}T\d{6}Z", rescued.name)
    lines = result.output.splitlines()
    assert lines[0] == "running fakerun into runs/r1"
    assert [line.split(":")[0] for line in lines[1:3]] == ["pass 1/6 blas warmup (seq 0)",
                                                          "pass 2/6 invariant warmup (seq 1)"]
    pid = os.getpid()
    assert re.fullmatch(r"run directory lost: runs/r1 is another directory now \(device \d+, "
                        r"inode \d+; this run opened device \d+, inode \d+\)\. Its files are "
                        r"open in this process, and readable there until it exits:", lines[3])
    held = dict(line.strip().split(": ") for line in lines[4:4 + len(snapshot)])
    assert sorted(held) == sorted(snapshot)   # run.json and every table written so far
    assert all(re.fullmatch(rf"/proc/{pid}/fd/\d+", where) for where in held.values())
    rest = lines[4 + len(snapshot):]
    assert rest[0] == f"copied them into {rescued}"
    assert rest[1] == (f"run stopped: the run directory was lost: runs/r1 is another directory "
                       f"now {lines[3].split(' now ')[1].split('. Its')[0]}; every record made "
                       f"so far was copied from the files this run held open into {rescued}")
    assert rest[2:] == [f"data kept in {rescued}; check it, then continue with: bistat run "
                        f"--resume {rescued}",
                        f"exit 3: the run directory was lost; its records are in {rescued}"]

    # nothing recorded is lost: the files the run held (renamed away) are in the copy, byte for
    # byte, with only the engines' stop events after them; the copy put in place is untouched
    moved, copy = _files(Path("runs/r1.moved")), _files(rescued)
    assert _files(run_dir) == snapshot
    assert set(copy) == set(moved) and moved == snapshot
    for name in moved:
        if name != "events.jsonl":
            assert copy[name] == moved[name], name
    assert [(e["arm"], e["event"]) for e in _new_lines(moved["events.jsonl"],
                                                       copy["events.jsonl"])] == [
        ("blas", "stopped"), ("invariant", "stopped")]
    passes, _ = read_jsonl(rescued / "passes.jsonl")
    assert [(p["seq"], p["status"]) for p in passes] == [(0, "complete"), (1, "complete")]
    assert len(read_jsonl(rescued / "responses.jsonl")[0]) == 2 * 8
    assert sorted(started) == sorted(stopped) == ["blas", "invariant"]

    # and it continues as the message says
    resumed = CliRunner().invoke(cli, ["run", "--resume", str(rescued), "--no-progress"],
                                 prog_name="bistat")
    assert resumed.exit_code == 0, resumed.output
    assert resumed.output.splitlines()[0] == f"resuming {rescued}"
    passes, _ = read_jsonl(rescued / "passes.jsonl")
    assert [(p["kind"], p["status"]) for p in passes].count(("counted", "complete")) == 4


def test_a_run_whose_directory_is_removed_and_made_again_stops_and_keeps_its_records(tmp_path):
    stopped.clear()
    run_dir = tmp_path / "runs" / "r2"
    before: dict[str, bytes] = {}

    class Replacing(NullReporter):
        messages: list[str] = []

        def pass_finished(self, report):
            if report.planned.seq == 2:   # the first counted pass
                before.update(_files(run_dir))
                shutil.rmtree(run_dir)
                run_dir.mkdir()

        def message(self, text):
            self.messages.append(text)

    reporter = Replacing()
    exp = h.experiment(engine=ENGINE, arms=ARMS, workload=WORKLOAD)
    outcome = start_run(exp, REG, run_dir, engine_factory=_factory, reporter=reporter)

    assert outcome.status == "lost" and outcome.passes_run == 3
    assert outcome.run_dir.parent == run_dir.parent
    assert outcome.run_dir.name.startswith("r2.rescued-")
    assert outcome.detail.startswith(f"{run_dir}")
    assert outcome.detail.endswith(f"every record made so far was copied from the files this "
                                   f"run held open into {outcome.run_dir}")
    assert reporter.messages[0].startswith(f"run directory lost: {run_dir}")
    assert list(run_dir.iterdir()) == []    # nothing written into the directory made again
    copy = _files(outcome.run_dir)
    assert set(copy) == set(before)
    assert copy["run.json"] == before["run.json"]
    for name in set(before) - {"run.json", "events.jsonl"}:
        assert copy[name] == before[name], name
    assert [e["event"] for e in _new_lines(before["events.jsonl"], copy["events.jsonl"])] == [
        "stopped", "stopped"]
    schedule, _ = read_jsonl(outcome.run_dir / "schedule.jsonl")
    assert [(r["seq"], r["event"]) for r in schedule] == [
        (0, "start"), (0, "end"), (1, "start"), (1, "end"), (2, "start"), (2, "end")]
    assert len(read_jsonl(outcome.run_dir / "responses.jsonl")[0]) == 3 * 8
    assert sorted(stopped) == ["blas", "invariant"]


def test_when_the_records_cannot_be_copied_the_run_says_where_they_were(tmp_path, monkeypatch):
    stopped.clear()
    run_dir = tmp_path / "runs" / "r3"
    (tmp_path / "blocked").write_text("a file where the copy's folder would go\n")
    monkeypatch.setattr(session, "_rescue_dir", lambda lost: tmp_path / "blocked" / "copy")

    class Removing(NullReporter):
        def pass_finished(self, report):
            if report.planned.seq == 0:
                shutil.rmtree(run_dir)

    exp = h.experiment(engine=ENGINE, arms=ARMS, workload=WORKLOAD)
    outcome = start_run(exp, REG, run_dir, engine_factory=_factory, reporter=Removing())
    assert (outcome.status, outcome.passes_run, outcome.run_dir) == ("lost", 1, run_dir)
    assert re.fullmatch(
        rf"{re.escape(str(run_dir))} no longer exists; its files could not be copied \(\[Errno "
        rf"20\] Not a directory: '{re.escape(str(tmp_path))}/blocked/copy'\); they were readable "
        rf"while the run's process lived: run\.json at /proc/{os.getpid()}/fd/\d+; .*",
        outcome.detail)
    assert not run_dir.exists()
    assert sorted(stopped) == ["blas", "invariant"]
