"""The design analysis's run-time estimate (``design.time_budget_s``, ``design.cv_from``).

A synthetic earlier run is written with known engine starts and pass times; the estimate for
a declaration's own schedule is checked against figures computed by hand, and the suggested
``workload.passes`` by re-planning.
"""

from __future__ import annotations

import datetime as dt
import doctest
import gzip
import json
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import bistat.declare.design_cv as dcv
import bistat.declare.design_report as dr
from bistat.cli import cmd_register
from bistat.core.schedule import plan_schedule
from bistat.declare.design_report import (
    DesignError,
    RunTiming,
    analyse_design,
    estimate_duration,
    format_design,
    timing_from_run,
)
from bistat.declare.experiment import validate_experiment

T0 = dt.datetime(2026, 12, 3, 9, 0, 0, tzinfo=dt.timezone.utc)

DECLARATION = """\
name = "t"
hypothesis = "The invariant GEMM makes greedy continuations batch-independent."
[engine]
kind = "embedded"
model = "smollm2-135m"
engines_concurrent = false
[[arms]]
name = "blas"
role = "control"
[[arms]]
name = "invariant"
role = "treatment"
args = { gemm = "invariant" }
[workload]
source = "builtin:chat"
n_prompts = 400
max_tokens = 16
concurrency = 8
passes = 4
warmup_passes = 1
order = "abba"
[rule]
[[rule.labels]]
label = "working"
all = [ { criterion = "match_lower_bound", at_least = 0.99 } ]
"""

#: The earlier run, one engine at a time, passes = 3, ABBA: blocks blas | invariant x2 |
#: blas x2 | invariant, each a warm-up and its counted passes: (arm, seconds from the end of the
#: previous block's last pass -- the run's creation for the first -- to "started", wall_s of its
#: passes). First starts: blas 100, invariant 150 (median 125); restarts 60, 70 (median 65).
#: Per pass: blas 10, 10, 11, 9, 13 (median 10); invariant 12, 12, 14, 12, 16 (median 12).
SERIAL_BLOCKS = [("blas", 100.0, [10.0, 10.0]),
                 ("invariant", 150.0, [12.0, 12.0, 14.0]),
                 ("blas", 60.0, [11.0, 9.0, 13.0]),
                 ("invariant", 70.0, [12.0, 16.0])]
STOP_S = 4.0   # from a block's last pass's end to its engine's "stopped"
GAP_S = 0.05   # between passes of a block


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_run(run: Path, blocks, *, together: bool = False, run_json: bool = True,
               events: bool = True) -> Path:
    """A run directory: ``blocks`` as above; ``together``: one block whose engines all start
    (blocks[0][0] is then a tuple of arms, each "started" at its own offset in blocks[0][1])."""
    run.mkdir(parents=True)
    if run_json:
        (run / "run.json").write_text(json.dumps({"schema": "bistat.run/1",
                                                  "created_utc": _iso(T0),
                                                  "engines_concurrent": together}))
    ev = [{"arm": "*", "event": "release_check", "time_utc": _iso(T0 + dt.timedelta(seconds=1))}]
    passes = []
    end = T0
    seq = 0
    for b, (arm, start_s, walls) in enumerate(blocks):
        arms = arm if together else (arm,)
        offsets = start_s if together else (start_s,)
        for a, off in zip(arms, offsets):
            ev.append({"arm": a, "event": "started", "time_utc": _iso(end + dt.timedelta(
                seconds=off)), "detail": f"block {b}"})
        t = end + dt.timedelta(seconds=max(offsets))
        for i, (pass_arm, wall) in enumerate(walls if together else [(arm, w) for w in walls]):
            t += dt.timedelta(seconds=GAP_S)
            passes.append({"schema": "bistat.passes/1", "arm": pass_arm, "seq": seq,
                           "kind": "warmup" if i == 0 else "counted",
                           "wall_s": wall, "started_utc": _iso(t), "status": "complete",
                           "block": b, "output_tokens_per_s": 1000.0 + seq})
            seq += 1
            t += dt.timedelta(seconds=wall)
        end = t
        for a in arms:
            ev.append({"arm": a, "event": "stopped",
                       "time_utc": _iso(end + dt.timedelta(seconds=STOP_S))})
    (run / "passes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passes))
    if events:
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    return run


def _declaration(run: Path | None = None, **design) -> dict:
    data = tomllib.loads(DECLARATION)
    if run is not None:
        design["cv_from"] = str(run)
    data["design"] = design
    return data


def _report(data: dict):
    return analyse_design(validate_experiment(data))


def _seconds_with_passes(data: dict, passes: int) -> float:
    data = json.loads(json.dumps(data))
    data["workload"]["passes"] = passes
    exp = validate_experiment(data)
    return estimate_duration(exp, timing_from_run(exp.design.cv_from)).seconds


# ---- the earlier run's timing ----------------------------------------------------------------


def test_timing_of_a_serial_run(tmp_path):
    timing = timing_from_run(_write_run(tmp_path / "old", SERIAL_BLOCKS))
    assert timing.first_starts == pytest.approx((100.0, 150.0))
    assert timing.restarts == pytest.approx((60.0, 70.0))
    assert timing.first_start_s == pytest.approx(125.0)
    assert timing.restart_s == pytest.approx(65.0)
    assert timing.pass_s("blas") == 10.0 and timing.pass_s("invariant") == 12.0
    assert timing.pass_s("other") == 12.0   # median of all ten passes: 9 10 10 11 12 12 12 ...
    assert timing.engines_concurrent is False and timing.engine_starts == 4
    assert timing.n_passes == 10 and timing.notes == ()


def test_a_restart_is_timed_from_the_stop_event_when_no_pass_ends_are_recorded(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    lines = [json.loads(x) for x in (run / "passes.jsonl").read_text().splitlines()]
    (run / "passes.jsonl").write_text("".join(
        json.dumps({k: v for k, v in x.items() if k != "started_utc"}) + "\n" for x in lines))
    timing = timing_from_run(run)
    # each block's engine stopped STOP_S after its last pass: that much less per start
    assert timing.first_starts == pytest.approx((100.0, 150.0 - STOP_S))
    assert timing.restarts == pytest.approx((60.0 - STOP_S, 70.0 - STOP_S))


def test_with_fewer_than_two_restarts_the_first_starts_join_the_median():
    one = RunTiming("r", (100.0, 150.0), (60.0,), (("a", (1.0,)),), False, 3)
    assert one.restart_s == 100.0
    assert RunTiming("r", (100.0,), (), (), True, 1).restart_s == 100.0
    assert RunTiming("r", (), (), (), None, 0).restart_s is None


# ---- the estimate for the declaration's schedule --------------------------------------------


def test_serial_abba_plan_and_its_estimate(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    report = _report(_declaration(run))
    d = report.duration
    # passes = 4, ABBA, one engine at a time: blas | invariant x2 | blas x2 | invariant x2 | blas,
    # a warm-up after each of the 5 starts: 8 counted + 5 warm-ups
    blocks = plan_schedule(["blas", "invariant"], passes=4, warmup_passes=1, order="abba",
                           seed=0, engines_concurrent=False)
    assert [b.arms[0] for b in blocks] == ["blas", "invariant", "blas", "invariant", "blas"]
    assert (d.engine_starts, d.first_starts, d.passes) == (5, 2, 13)
    assert d.first_start_s == pytest.approx(125.0) and d.restart_s == pytest.approx(65.0)
    assert d.pass_s_by_arm == (("blas", 10.0), ("invariant", 12.0))
    # 2 first starts x 125 + 3 restarts x 65 + 7 blas passes x 10 + 6 invariant passes x 12
    assert d.seconds == pytest.approx(250 + 195 + 70 + 72)
    assert d.pass_s == pytest.approx(142 / 13)
    # engines up together: one start of both, priced as one first start per engine (timed from
    # a run of one engine at a time: parallel starts contend), 5 passes per arm
    assert d.together_s == pytest.approx(2 * 125 + 50 + 60)
    assert d.budget_s is None and d.fits is None and d.max_passes is None
    assert not d.lower_bound and d.notes == ()
    assert not [w for w in report.warnings if "time_budget_s" in w]
    assert report.to_dict()["duration"]["seconds"] == pytest.approx(587.0)
    assert json.loads(json.dumps(report.to_dict()))["duration"]["pass_s_by_arm"] == [
        ["blas", 10.0], ["invariant", 12.0]]
    text = format_design(report)
    assert (f"Run time (timed from {run} (10 passes, 4 engine starts)):\n"
            "  plan: 5 engine starts (one engine at a time), 13 passes (warm-ups included)\n"
            "  engine starts: 2 first (one per arm: it compiles) at 125.0 s, 3 restarts at "
            "65.0 s (each from the end of the previous engine's last pass)\n"
            "  passes: blas 10.00 s, invariant 12.00 s (medians of wall_s)\n"
            "  estimate: 587 s (9.8 min)\n"
            "  with the arms' engines up together: about 360 s\n") in text


def test_over_the_budget_warns_with_the_passes_that_fit(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    data = _declaration(run, time_budget_s=500)
    report = _report(data)
    d = report.duration
    assert d.fits is False and d.max_passes == 3
    # passes = 3: blas | invariant x2 | blas x2 | invariant: 2 x 125 + 2 x 65 + 5 x 10 + 5 x 12
    assert d.max_passes_s == pytest.approx(490.0)
    assert _seconds_with_passes(data, 3) <= 500 < _seconds_with_passes(data, 4)
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning == (
        f"design.time_budget_s: the run is estimated at 587 s (5 engine starts: the first of "
        f"each arm 125 s, then 65 s each; 13 passes at 10.9 s; timed from {run} (10 passes, 4 "
        "engine starts)), over the budget of 500 s; a run must finish on one machine: lower "
        "workload.passes to 3 (about 490 s), or keep the arms' engines up together "
        "(engine.engines_concurrent: about 360 s, if their GPU memory fractions allow it)")
    assert "  estimate: 587 s (9.8 min); budget 500 s, over (workload.passes = 3 fits: about " \
           "490 s)\n" in format_design(report)


@pytest.mark.parametrize("budget", [440, 489.9, 300, 250])
def test_the_suggested_passes_fit_and_one_more_does_not(tmp_path, budget):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    data = _declaration(run, time_budget_s=budget)
    d = _report(data).duration
    assert d.fits is False
    if d.max_passes is None:   # passes = 1: blas | invariant, 2 x 125 + 2 x 10 + 2 x 12 = 294
        assert budget < _seconds_with_passes(data, 1) == pytest.approx(294.0)
    else:
        assert _seconds_with_passes(data, d.max_passes) <= budget
        assert _seconds_with_passes(data, d.max_passes + 1) > budget


def test_within_the_budget_no_warning(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    report = _report(_declaration(run, time_budget_s=587.5))
    assert report.duration.fits is True and report.duration.max_passes is None
    assert not [w for w in report.warnings if "time_budget_s" in w]
    assert "  estimate: 587 s (9.8 min); budget 588 s, within\n" in format_design(report)


def test_passes_the_declaration_refuses_are_not_suggested(tmp_path):
    """A cost rule needs 2 counted passes per arm: passes = 1 would fit a budget of 300 s
    (294 s) but is refused, and passes = 2 (391 s) does not fit."""
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    data = _declaration(run, time_budget_s=300)
    data["rule"]["cost"] = {"metric": "throughput", "margin": 0.1}
    report = _report(data)
    d = report.duration
    assert d.fits is False and d.max_passes is None
    assert d.notes[0].startswith("workload.passes = 1 would fit (about 294 s), but the "
                                 "declaration refuses it: rule.cost: the cost rule needs at "
                                 "least 2 counted passes per arm")
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning.endswith("a run must finish on one machine: no workload.passes that the "
                            "declaration allows fits: raise the budget, or shorten the passes "
                            "(workload.n_prompts, workload.max_tokens), or keep the arms' "
                            "engines up together (engine.engines_concurrent: about 360 s, if "
                            "their GPU memory fractions allow it)")


def test_engines_up_together(tmp_path):
    """An earlier run that kept both engines up: started 30 s and 40 s after its creation (one
    start of 40 s), then a warm-up per arm and three counted passes each."""
    walls = [("blas", 10.0), ("invariant", 12.0), ("blas", 10.0), ("invariant", 12.0),
             ("invariant", 14.0), ("blas", 8.0), ("blas", 12.0), ("invariant", 12.0)]
    run = _write_run(tmp_path / "old", [(("blas", "invariant"), (30.0, 40.0), walls)],
                     together=True)
    timing = timing_from_run(run)
    assert timing.first_starts == pytest.approx((40.0,)) and timing.restarts == ()
    assert timing.engines_concurrent is True and timing.engine_starts == 1
    data = _declaration(run, time_budget_s=100)
    data["engine"]["engines_concurrent"] = True
    report = _report(data)
    d = report.duration
    # one start, then 1 warm-up + 4 counted passes per arm: 40 + 5 x 10 + 5 x 12
    assert (d.engine_starts, d.first_starts, d.passes) == (1, 1, 10)
    assert d.seconds == pytest.approx(150.0)
    assert d.restart_s is None and d.together_s is None and d.notes == ()
    # passes = 2: 40 + 3 x 10 + 3 x 12 = 106 > 100; passes = 1: 40 + 2 x 10 + 2 x 12 = 84
    assert d.fits is False and d.max_passes == 1 and d.max_passes_s == pytest.approx(84.0)
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning == (
        f"design.time_budget_s: the run is estimated at 150 s (1 engine start of all the arms' "
        f"engines: 40 s; 10 passes at 11.0 s; timed from {run} (8 passes, 1 engine start)), "
        "over the budget of 100 s; a run must finish on one machine: lower workload.passes to "
        "1 (about 84 s)")
    assert "  engine start: 40.0 s (all the arms' engines)\n" in format_design(report)


def test_a_serial_plan_timed_from_a_run_with_engines_up_together(tmp_path):
    walls = [("blas", 10.0), ("invariant", 12.0)] * 3
    run = _write_run(tmp_path / "old", [(("blas", "invariant"), (30.0, 40.0), walls)],
                     together=True)
    d = _report(_declaration(run)).duration
    # 5 starts, each at the one start timed (40 s); 7 blas passes x 10 + 6 invariant x 12
    assert d.seconds == pytest.approx(5 * 40 + 70 + 72)
    assert d.notes == ("the earlier run restarted no engine: its first start stands in for a "
                       "restart", "the earlier run kept its engines up together: the start of "
                       "them all stands in for one engine's")


def test_arms_the_earlier_run_lacks_take_the_median_of_all_its_passes(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    data = _declaration(run)
    data["arms"][1]["name"] = "tuned"
    d = _report(data).duration
    assert d.pass_s_by_arm == (("blas", 10.0), ("tuned", 12.0))
    assert d.notes == ("arm tuned not in the earlier run: the median of all its passes stands in",)


# ---- what is missing --------------------------------------------------------------------------


def test_no_events_times_the_passes_only(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS, events=False)
    report = _report(_declaration(run, time_budget_s=100))
    d = report.duration
    assert d.seconds == pytest.approx(142.0) and d.lower_bound
    assert d.first_start_s is None and d.restart_s is None
    assert d.notes == (f"no {run / 'events.jsonl'}: the engine starts are not timed",)
    # passes = 3: 5 x 10 + 5 x 12 = 110 > 100; passes = 2 (blas | invariant x2 | blas): 4 x 10
    # + 3 x 12 = 76
    assert d.fits is False and d.max_passes == 2 and d.max_passes_s == pytest.approx(76.0)
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning.startswith(f"design.time_budget_s: the run is estimated at 142 s or more (5 "
                              f"engine starts, not timed; 13 passes at 10.9 s; timed from {run}")
    assert "lower workload.passes to at most 2 (about 76 s)" in warning
    assert "  estimate: 142 s or more (2.4 min)" in format_design(report)


def test_a_lower_bound_within_the_budget_cannot_tell(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS, events=False)
    report = _report(_declaration(run, time_budget_s=1380))
    assert report.duration.fits is None
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning == (
        "design.time_budget_s: cannot tell whether the run fits the budget of 1,380 s: it is "
        f"estimated at 142 s or more (5 engine starts, not timed; 13 passes at 10.9 s; timed "
        f"from {run} (10 passes, 0 engine starts)), but part of it is not timed (no "
        f"{run / 'events.jsonl'}: the engine starts are not timed)")


def test_no_run_json_leaves_the_first_start_untimed(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS, run_json=False)
    timing = timing_from_run(run)
    assert timing.first_starts == pytest.approx((150.0,))   # invariant's, after blas's block
    assert timing.notes == (f"no {run / 'run.json'} (created_utc): the run's first engine "
                            "start is not timed",)
    d = _report(_declaration(run)).duration
    # 2 x 150 + 3 x 65 + 142
    assert d.seconds == pytest.approx(637.0) and not d.lower_bound
    assert d.notes == timing.notes


def test_a_restart_stands_in_for_an_untimed_first_start():
    exp = validate_experiment(_declaration())
    timing = RunTiming("r", (), (60.0, 70.0), (("blas", (10.0,)), ("invariant", (12.0,))),
                       False, 3, ("no r/run.json",))
    d = estimate_duration(exp, timing)
    assert d.seconds == pytest.approx(5 * 65 + 142) and d.lower_bound
    assert d.notes[-1] == ("no first engine start is timed: a restart's time stands in for it "
                           "(the estimate is a lower bound)")


def test_a_budget_without_an_earlier_run_is_not_checked():
    report = _report(_declaration(time_budget_s=1380))
    d = report.duration
    assert d.seconds is None and (d.engine_starts, d.passes) == (5, 13)
    assert [w for w in report.warnings if w.startswith("design.time_budget_s")] == [
        "design.time_budget_s: the run's wall time is not estimated, so the budget of 1,380 s "
        "is not checked: name an earlier run of this setup in design.cv_from (it then gives "
        "the CV too, in place of design.expected_cv)"]
    assert ("Run time: not estimated (no earlier run to time it from: design.cv_from names "
            "none)\n  plan: 5 engine starts (one engine at a time), 13 passes (warm-ups "
            "included)\n") in format_design(report)
    assert _report(_declaration()).duration is None


def test_records_without_times_say_so(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "passes.jsonl").write_text("".join(json.dumps(
        {"arm": a, "kind": "counted", "output_tokens_per_s": v}) + "\n"
        for a, v in (("blas", 100.0), ("blas", 110.0), ("invariant", 200.0))))
    report = _report(_declaration(run, time_budget_s=600))
    d = report.duration
    assert d.seconds is None and not d.lower_bound
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning.startswith("design.time_budget_s: the run's wall time is not estimated, so "
                              f"the budget of 600 s is not checked: {run} (0 passes, 0 engine "
                              "starts) times neither its engine starts nor its passes (")
    assert "  estimate: none\n" in format_design(report)


@pytest.mark.parametrize("name, damage, message", [
    ("events.jsonl", lambda t: t.replace("\n", "\n{oops\n", 1),
     "events.jsonl:2: not a JSON line"),
    ("passes.jsonl", lambda t: t.replace("\n", "\n{oops\n", 1),
     "passes.jsonl:2: not a JSON line"),
    ("run.json", lambda t: t[:-3], "run.json: not valid JSON"),
    ("run.json", lambda t: "[]", "run.json: expected a JSON object"),
    ("events.jsonl", lambda t: t.replace("T09:01:40", "T9h01", 1),
     "events.jsonl:2: time_utc '2026-12-03T9h01"),
])
def test_damaged_records_are_an_error_naming_the_file(tmp_path, name, damage, message):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    path = run / name
    path.write_text(damage(path.read_text()))
    with pytest.raises(DesignError) as err:
        _report(_declaration(run))
    assert str(err.value).startswith("design.cv_from: ")
    assert f"{run}/{message}" in str(err.value)


def test_a_truncated_last_line_is_ignored(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    with open(run / "events.jsonl", "a") as f:
        f.write('{"arm": "blas", "event": "sta')
    assert timing_from_run(run).restarts == pytest.approx((60.0, 70.0))


def test_the_field_is_validated():
    assert validate_experiment(_declaration(time_budget_s=1380)).design.time_budget_s == 1380.0
    for bad in (0, -1, "1380"):
        with pytest.raises(ValueError, match="design.time_budget_s"):
            validate_experiment(_declaration(time_budget_s=bad))


def test_bistat_design_json_carries_the_estimate(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    text = DECLARATION + f'[design]\ncv_from = "{run}"\ntime_budget_s = 500\n'
    (tmp_path / "t.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    group = click.Group("bistat")
    cmd_register.register(group)
    result = CliRunner().invoke(group, ["design", "t.toml", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)["duration"]
    assert (d["seconds"], d["max_passes"], d["fits"], d["budget_s"]) == (
        pytest.approx(587.0), 3, False, 500.0)
    result = CliRunner().invoke(group, ["design", "t.toml"])
    assert "design.time_budget_s: the run is estimated at 587 s" in result.output


def test_docstring_examples():
    assert doctest.testmod(dr).failed == 0


def test_a_concurrent_plan_timed_from_a_serial_run_prices_one_first_start_per_engine(tmp_path):
    # vLLM 0.25.0's three engines started together took 299 s, against about 100 s for one
    # alone: parallel starts contend, so a start of k engines is priced k first starts
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    data = _declaration(run, time_budget_s=300)
    data["engine"]["engines_concurrent"] = True
    report = _report(data)
    d = report.duration
    assert (d.engine_starts, d.engines_per_start, d.passes) == (1, 2, 10)
    # 2 x 125 + 1 warm-up and 4 counted passes per arm: 5 x 10 + 5 x 12
    assert d.seconds == pytest.approx(2 * 125 + 50 + 60)
    assert any("one engine's first start per engine" in n for n in d.notes)
    (warning,) = [w for w in report.warnings if w.startswith("design.time_budget_s")]
    assert warning.startswith(
        "design.time_budget_s: the run is estimated at 360 s (1 engine start of all the arms' "
        "engines: 2 x 125 s, one engine's first start each; 10 passes at 11.0 s;")
    assert ("  engine start: 2 x 125.0 s (all the arms' engines, one engine's first start each: "
            "the earlier run started one at a time)\n") in format_design(report)


def test_one_design_analysis_reads_each_file_of_the_earlier_run_once(tmp_path, monkeypatch):
    """The CV, the paired CV and the timing all read passes.jsonl: once per analysis while the
    file stays as it was, and again once it changes (a run that went on since)."""
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    reads: list[str] = []
    real = dcv.iter_jsonl_strict

    def counting(path):
        reads.append(Path(path).name)
        return real(path)
    monkeypatch.setattr(dcv, "iter_jsonl_strict", counting)
    dcv._read_strict_once.cache_clear()
    first = _report(_declaration(run))
    assert sorted(reads) == ["events.jsonl", "passes.jsonl"]
    assert _report(_declaration(run)) == first and len(reads) == 2      # nothing read again
    with open(run / "passes.jsonl", "a") as f:                          # the run went on
        f.write(json.dumps({"arm": "blas", "kind": "counted", "status": "complete",
                            "wall_s": 500.0, "output_tokens_per_s": 1.0,
                            "started_utc": "2026-12-03T11:00:00Z"}) + "\n")
    changed = _report(_declaration(run))
    assert reads.count("passes.jsonl") == 2 and changed.cv != first.cv


def test_a_rule_on_speed_with_one_engine_at_a_time_is_warned_of_clustered_passes():
    """Passes of one engine start share its speed; the per-pass intervals treat them as
    independent (tests/test_engine_starts.py simulates the coverage). Only a rule that reads
    speed is warned, and only when the engines run one at a time."""
    def warned(text: str) -> list[str]:
        exp = validate_experiment(tomllib.loads(text), "experiments/t.toml")
        return [w for w in analyse_design(exp).warnings
                if w.startswith("engine.engines_concurrent: one engine at a time")]
    cost = '[rule.cost]\nmetric = "throughput"\nmargin = 0.05\n'
    assert warned(DECLARATION) == []                                   # match criteria only
    (w,) = warned(DECLARATION + cost)
    assert "about 89 % coverage for a 95 % interval" in w
    assert "engine.engines_concurrent = true" in w and "each engine start as one observation" in w
    assert warned(DECLARATION.replace("engines_concurrent = false", "engines_concurrent = true")
                  + cost) == []
    throughput = DECLARATION.replace(
        'all = [ { criterion = "match_lower_bound", at_least = 0.99 } ]',
        'all = [ { criterion = "match_lower_bound", at_least = 0.99 },\n'
        '        { criterion = "throughput_slower", bound = 1.0 } ]')
    assert len(warned(throughput)) == 1


# ---- first starts that found vLLM's compile cache warm ----------------------------------------

WARM_LINE = ("(EngineCore pid=4587) INFO 12-02 18:37:59 [decorators.py:326] [backbone] Directly "
             "load AOT compilation from path /root/.cache/vllm/torch_compile_cache/torch_aot_"
             "compile/817c/rank_0_0/model\n")
COLD_LINE = ("(EngineCore pid=2123) INFO 12-07 15:57:19 [backends.py:421] [backbone] Compiling a "
             "graph for compile range (1, 8192) takes 65.48 s\n")


def _engine_log(run: Path, name: str, text: str) -> None:
    logs = run / "engine-logs"
    logs.mkdir(exist_ok=True)
    with gzip.open(logs / f"{name}.log.gz", "wt", encoding="utf-8") as fh:
        fh.write(text)


def test_first_starts_from_a_warm_compile_cache_make_the_estimate_a_lower_bound(tmp_path):
    """An earlier run whose first start loaded torch.compile's output from vLLM's cache priced
    a start a fresh machine does not have: the estimate says "or more", why, and what
    compiling took where that run did compile; a budget it is within cannot be told."""
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    _engine_log(run, "blas-1", "starting\n" + WARM_LINE)
    _engine_log(run, "invariant-1", COLD_LINE + COLD_LINE.replace("65.48", "4.52"))
    _engine_log(run, "blas-2", WARM_LINE)            # a restart: not a first start
    timing = timing_from_run(run)
    assert timing.warm_first_starts == ("blas",)
    assert dict(timing.first_start_caches)["invariant"].compile_s == pytest.approx(70.0)
    report = _report(_declaration(run, time_budget_s=1380))
    d = report.duration
    assert d.lower_bound and d.fits is None
    assert d.seconds == pytest.approx(_report(_declaration(_write_run(
        tmp_path / "plain", SERIAL_BLOCKS))).duration.seconds)    # the same figure, now a bound
    (note,) = [n for n in d.notes if "compile cache" in n]
    assert note.startswith("the earlier run's first start of blas loaded torch.compile's output")
    assert note.endswith("where it did compile, compiling took invariant 70 s")
    assert "or more" in "\n".join(format_design(report).splitlines())


def test_a_first_start_that_loads_what_another_arm_compiled_is_not_warm(tmp_path):
    """One cache entry compiled by one arm's start and loaded by the next arm's: a fresh
    machine running the same run does the same, so the estimate stays as timed."""
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    entry = "Using cache directory: /root/.cache/vllm/torch_compile_cache/96cde78d40/rank_0_0\n"
    _engine_log(run, "blas-1", entry + COLD_LINE)
    _engine_log(run, "invariant-1", entry + WARM_LINE.replace(
        "torch_aot_compile/817c/", "torch_aot_compile/96cde78d40/"))
    timing = timing_from_run(run)
    assert dict(timing.first_start_caches)["invariant"].warm
    assert timing.warm_first_starts == ()
    assert not _report(_declaration(run)).duration.lower_bound


def test_cold_first_starts_leave_the_estimate_as_it_was(tmp_path):
    run = _write_run(tmp_path / "old", SERIAL_BLOCKS)
    _engine_log(run, "blas-1", COLD_LINE)
    _engine_log(run, "invariant-1", "no torch.compile here\n")
    timing = timing_from_run(run)
    assert timing.warm_first_starts == () and [a for a, _ in timing.first_start_caches] == ["blas"]
    d = _report(_declaration(run, time_budget_s=1380)).duration
    assert not d.lower_bound and d.fits is True
    assert not [n for n in d.notes if "compile cache" in n]


def test_the_committed_runs_compile_caches():
    """The tax studies' earlier run (H200, 2026-12-02) started its compiled engines from a warm
    cache; the H100 Study 1(a) twin (a fresh machine, 2026-12-07) compiled, but for bi-fa3-pin,
    which loaded what batch-invariant's start had just compiled (one cache entry, 96cde78d40):
    a fresh machine does that too, so it is not a warm start from outside the run."""
    root = Path(__file__).resolve().parents[1]
    warm = timing_from_run(root / "data/h200-v034/h200-v034-i23-latency-qwen3-8b-b8-compiled")
    assert warm.warm_first_starts == ("bi-tuned-gemm-compiled", "default")
    fresh_run = timing_from_run(root / "data/h100-v034/h100-v034-match-smollm2")
    fresh = dict(fresh_run.first_start_caches)
    assert sorted(fresh) == ["batch-invariant", "bi-fa3-pin", "bi-plugin", "bi-triton-attn",
                             "default"]
    assert fresh_run.warm_first_starts == ()
    assert fresh["bi-fa3-pin"].warm and fresh["bi-fa3-pin"].keys == ("96cde78d40",)
    assert fresh["batch-invariant"].keys == ("96cde78d40",)
    assert fresh["default"].compile_s == pytest.approx(7.59)
    assert fresh["batch-invariant"].compile_s == pytest.approx(65.48)
