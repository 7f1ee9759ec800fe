"""A pass in which every request failed stops the run, saying why; a run with any failed request
shows its first errors in the run's output, in ``bistat inspect`` and in the finding (through the
CLI, on the fake engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import fakes
import helpers_runner as h
from bistat.cli import cli
from bistat.core.failures import describe_groups, error_groups, error_key
from bistat.declare.prereg import register
from bistat.store.readers import read_jsonl

ALL = [f"chat-{i:04d}" for i in range(12)]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fakes.install(fakes.FakeScript())
    return tmp_path


def _register(workdir: Path, treatment: dict) -> str:
    (workdir / "experiments").mkdir(exist_ok=True)
    arms = [{"name": "blas", "role": "control"},
            {"name": "invariant", "role": "treatment", "args": {"fake": treatment}}]
    decl = h.write_toml(workdir / "experiments" / "fakerun.toml", h.declaration(arms=arms))
    register(decl, registrations_dir=workdir / "preregistrations")
    return "preregistrations/fakerun.json"


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="bistat")


def test_errors_are_grouped_when_they_differ_only_in_numbers():
    texts = ["request chat-0012: prompt (57 tokens) + max_tokens (10000000) exceeds "
             "max_model_len=2048; lower max_tokens or raise max_model_len",
             "HTTP 503: busy",
             "request chat-0003: prompt (48 tokens) + max_tokens (10000000) exceeds "
             "max_model_len=2048; lower max_tokens or raise max_model_len"]
    assert error_key(texts[0]) == error_key(texts[2])
    groups = error_groups(texts)
    assert [(g.count, g.first) for g in groups] == [(2, texts[0]), (1, "HTTP 503: busy")]
    assert describe_groups(groups, 3) == [f"2 of 3 failed requests: {texts[0]}",
                                          "1 of 3 failed requests: HTTP 503: busy"]


def test_a_pass_in_which_every_request_failed_stops_the_run(workdir):
    reg = _register(workdir, {"fail_prompts": ALL})
    result = _invoke("run", reg, "--run-dir", "runs/r", "--no-progress")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    stop = lines.index(next(x for x in lines if x.startswith("run stopped: ")))
    assert lines[stop:] == [
        "run stopped: every request of pass 0 of arm 'invariant' (warmup, schedule position 1) "
        "failed: the pass is recorded failed and the engines are stopped. 12 of 12 requests "
        "failed with this error (numbers aside): HTTP 500: Internal Server Error",
        "first errors:",
        "  12 of 12 failed requests: HTTP 500: Internal Server Error",
        "data kept in runs/r; continue with: bistat run --resume runs/r",
        "exit 1: every request of a pass failed; resume it with: bistat run --resume runs/r"]
    events = read_jsonl(workdir / "runs/r/events.jsonl")[0]
    assert [(e["arm"], e["event"]) for e in events][-2:] == [("blas", "stopped"),
                                                             ("invariant", "stopped")]
    ends = [r for r in read_jsonl(workdir / "runs/r/schedule.jsonl")[0] if r["event"] == "end"]
    assert [(r["arm"], r["status"], r["n_failed"], r.get("stopped")) for r in ends] == [
        ("blas", "complete", 0, None), ("invariant", "failed", 12, "every request failed")]


def test_a_complete_run_with_failed_requests_shows_its_first_errors_everywhere(workdir):
    reg = _register(workdir, {"fail_prompts": ["chat-0003", "chat-0007"]})
    result = _invoke("run", reg, "--run-dir", "runs/r", "--no-progress")
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    start = out.index("run complete: runs/r (10 pass(es) run; 10 failed request(s) in 5 flagged "
                      "pass(es))")
    assert out[start + 1:start + 3] == [
        "first errors:", "  10 of 10 failed requests: HTTP 500: Internal Server Error"]
    # the CI summary at the end says it too
    assert "  failed requests: 10" in out
    assert "    10 of 10 failed requests: HTTP 500: Internal Server Error" in out

    inspected = _invoke("inspect", "runs/r")
    assert inspected.exit_code == 0
    assert ("failed requests: 10, by error (the same text but for numbers):\n"
            "  10 of 10 failed requests: HTTP 500: Internal Server Error\n") in inspected.output
    as_json = json.loads(_invoke("inspect", "runs/r", "--json").output)
    assert as_json["error_groups"] == [{"first": "HTTP 500: Internal Server Error", "count": 10}]

    analyzed = _invoke("analyze", "runs/r", "--out", "out")
    assert analyzed.exit_code == 0
    finding = (workdir / "out" / "fakerun.md").read_text()
    assert ("## Failed requests\n\n"
            "10 of 120 recorded requests failed (every pass, warm-ups included; by arm: "
            "invariant 10). Their errors, grouped where the texts agree but for numbers (ids, "
            "lengths, counts), each with its first text as recorded:\n\n"
            "| requests | first error |\n|---|---|\n"
            "| 10 | HTTP 500: Internal Server Error |\n") in finding


def test_a_run_without_failures_has_no_failed_requests_section(workdir):
    reg = _register(workdir, {})
    assert _invoke("run", reg, "--run-dir", "runs/r", "--no-progress").exit_code == 0
    assert _invoke("analyze", "runs/r", "--out", "out").exit_code == 0
    assert "## Failed requests" not in (workdir / "out" / "fakerun.md").read_text()
