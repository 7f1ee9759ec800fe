"""Every ending of the commands that print an exit line (``bistat run``, ``analyze``, ``probe``)
prints exactly one ``exit CODE: why`` and exits with that CODE: each exit path through the CLI
(CliRunner, on the fake engine), the printed line checked against the exit code.

Before, an engine that failed to start printed ``exit 0: no --fail-on given...`` and exited 1.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import fakes
import helpers_runner as h
from bistat.cli import cli
from bistat.declare.prereg import register

EXIT_LINE = re.compile(r"^exit (\d+): (.+)$")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    return tmp_path


def _register(workdir: Path, control=None, treatment=None, **workload) -> str:
    (workdir / "experiments").mkdir(exist_ok=True)
    arms = [{"name": "blas", "role": "control", "args": {"fake": control or {}}},
            {"name": "invariant", "role": "treatment", "args": {"fake": treatment or {}}}]
    decl = h.write_toml(workdir / "experiments" / "fakerun.toml",
                        h.declaration(arms=arms, workload=workload))
    register(decl, registrations_dir=workdir / "preregistrations")
    return "preregistrations/fakerun.json"


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="bistat")


def _exit_line(result) -> tuple[int, str]:
    """The one exit line the command printed (stdout or stderr), as (code, reason)."""
    lines = [m for line in result.output.splitlines() if (m := EXIT_LINE.match(line))]
    assert len(lines) == 1, result.output
    assert result.output.rstrip("\n").splitlines()[-1] == lines[0].group(0), result.output
    return int(lines[0].group(1)), lines[0].group(2)


def _analysis_fails(monkeypatch):
    from bistat.analysis import summary

    def fail(*args, **kwargs):
        raise summary.AnalysisError("the records say nothing (test)")

    monkeypatch.setattr(summary, "analyze_run", fail)


def _run_dir_lost(monkeypatch):
    from bistat.store.writer import RunWriter

    calls = {"n": 0}
    real = RunWriter.lost

    def lost(self):
        calls["n"] += 1
        return "runs/r was removed (test)" if calls["n"] == 3 else real(self)

    monkeypatch.setattr(RunWriter, "lost", lost)


def _disk_full(monkeypatch):
    from bistat.run import registered

    def record(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(registered, "record", record)


#: (path, the registration's fake behaviour, extra run options, setup, code, the reason's start)
RUN_PATHS = [
    ("complete", {}, [], None, 0, "no --fail-on given: every verdict exits 0"),
    ("complete, --fail-on names the verdict", {}, ["--fail-on", "any"], None, 11,
     "verdict 1 is 'reported as observed', named by --fail-on"),
    ("complete, --fail-on names another label", {}, ["--fail-on", "doubtful"], None, 0,
     "no verdict has a label named by --fail-on"),
    ("complete, the analysis fails", {}, [], _analysis_fails, 0,
     "the run ended; its analysis failed and no --fail-on was given"),
    ("complete, the analysis fails, --fail-on", {}, ["--fail-on", "any"], _analysis_fails, 1,
     "the analysis failed, so --fail-on cannot be evaluated"),
    ("an engine refused its setting", {"treatment": {"refuse": "not on this GPU"}}, [], None, 1,
     "an engine refused its setting or failed to start: the run is untested"),
    ("an engine failed to start, --fail-on untested", {"treatment": {"start_error": "no port"}},
     ["--fail-on", "untested"], None, 12, "verdict 1 is 'untested', named by --fail-on"),
    ("an engine failed to start, its analysis fails", {"treatment": {"start_error": "no port"}},
     [], _analysis_fails, 1, "an engine refused its setting or failed to start (the run is "
                             "untested), and its analysis failed"),
    ("an engine died during a pass", {"control": {"crash_on_call": 1}}, [], None, 1,
     "an engine failed during a pass; resume it with: bistat run --resume runs/r"),
    ("Ctrl-C", {"control": {"interrupt_on_call": 1, "crash_after": 3}}, [], None, 1,
     "the run was interrupted; resume it with: bistat run --resume runs/r"),
    ("every request of a pass failed",
     {"treatment": {"fail_prompts": [f"chat-{i:04d}" for i in range(12)]}}, [], None, 1,
     "every request of a pass failed; resume it with: bistat run --resume runs/r"),
    ("the run directory was lost", {}, [], _run_dir_lost, 3, "the run directory was lost"),
    ("the disk is full", {}, [], _disk_full, 1, "no space left on device; free some, then "
                                                "resume it with: bistat run --resume runs/r"),
]


@pytest.mark.parametrize("path, fake, options, setup, code, reason", RUN_PATHS,
                         ids=[p[0] for p in RUN_PATHS])
def test_every_ending_of_run_prints_the_code_it_exits_with(workdir, monkeypatch, path, fake,
                                                            options, setup, code, reason):
    reg = _register(workdir, **fake)
    if setup is not None:
        setup(monkeypatch)
    result = _invoke("run", reg, "--run-dir", "runs/r", "--no-progress", *options)
    assert "Traceback" not in result.output
    printed, why = _exit_line(result)
    assert printed == result.exit_code == code, result.output
    assert why.startswith(reason), why


def test_a_resumed_run_prints_its_exit_line_too(workdir):
    reg = _register(workdir, control={"crash_on_call": 1})
    assert _invoke("run", reg, "--run-dir", "runs/r", "--no-progress").exit_code == 1
    result = _invoke("run", "--resume", "runs/r", "--no-progress")
    assert _exit_line(result) == (0, "no --fail-on given: every verdict exits 0")
    assert result.exit_code == 0


@pytest.mark.parametrize("options, code", [([], 0), (["--fail-on", "any"], 11),
                                           (["--fail-on", "untested"], 0)])
def test_every_ending_of_analyze_prints_the_code_it_exits_with(workdir, options, code):
    reg = _register(workdir)
    assert _invoke("run", reg, "--run-dir", "runs/r", "--no-progress").exit_code == 0
    result = _invoke("analyze", "runs/r", "--out", "out", *options)
    printed, _ = _exit_line(result)
    assert printed == result.exit_code == code


@pytest.mark.parametrize("options, code", [([], 0), (["--no-control", "--fail-on", "any"], 12),
                                           (["--fail-on", "any"], 0)])
def test_every_ending_of_probe_prints_the_code_it_exits_with(workdir, options, code):
    data = h.declaration(arms=[{"name": "blas", "role": "control",
                                "args": {"fake": {"divergence": 0.9}}},
                               {"name": "invariant", "role": "treatment"}])
    (workdir / "experiments").mkdir()
    decl = h.write_toml(workdir / "experiments" / "p.toml", data)
    result = _invoke("probe", str(decl), "--max-fillers", "40", "--max-tokens", "5", *options)
    printed, _ = _exit_line(result)
    assert printed == result.exit_code == code


def test_an_interrupted_probe_prints_its_exit_line(workdir, monkeypatch):
    from bistat.analysis import probe_report as probe

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(probe, "run_probe", interrupted)
    (workdir / "experiments").mkdir()
    decl = h.write_toml(workdir / "experiments" / "p.toml", h.declaration())
    result = _invoke("probe", str(decl))
    assert _exit_line(result) == (130, "interrupted (Ctrl-C)")
    assert result.exit_code == 130
