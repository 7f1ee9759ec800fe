"""Sealed registrations: register, never overwrite, amend before data only, verify the seal and
that the registration precedes every recorded datum (tampering and back-dating refused)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bistat import __version__
from bistat.declare.experiment import DeclarationError
from bistat.store.format import parse_time
from bistat.declare.prereg import (
    SCHEMA,
    RegistrationError,
    amend,
    canonical_json,
    find_recorded_runs,
    format_time,
    git_state,
    load_registration,
    register,
    sha256_hex,
    verify,
)

DECL = Path(__file__).resolve().parent / "data" / "declarations"
T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A project directory outside any git repository with experiments/minimal.toml."""
    (tmp_path / "experiments").mkdir()
    shutil.copy(DECL / "minimal.toml", tmp_path / "experiments" / "minimal.toml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_run(run_dir: Path, reg, created: dt.datetime, times: list[dt.datetime],
              truncated_tail: bool = False) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "schema": "bistat.run/1", "run_id": run_dir.name, "registration": reg.reference(),
        "bistat_version": __version__, "created_utc": format_time(created),
        "command": ["bistat", "run"], "engine_kind": "embedded"}))
    with open(run_dir / "schedule.jsonl", "w") as fh:
        for i, t in enumerate(times):
            fh.write(json.dumps({"schema": "bistat.schedule/1", "event": "start", "seq": i,
                                 "arm": "blas", "pass_index": i, "kind": "counted", "block": 0,
                                 "time_utc": format_time(t)}) + "\n")
        if truncated_tail:
            fh.write('{"schema": "bistat.schedule/1", "event": "end", "time_u')
    with open(run_dir / "passes.jsonl", "w") as fh:
        for i, t in enumerate(times):
            fh.write(json.dumps({"schema": "bistat.passes/1", "arm": "blas", "seq": i,
                                 "kind": "counted", "started_utc": format_time(t),
                                 "output_tokens_per_s": 100.0 + i}) + "\n")
    return run_dir


def test_canonical_form_and_hash():
    assert canonical_json({"b": 1, "a": [1.5, "é"]}) == '{"a":[1.5,"é"],"b":1}'.encode()
    assert sha256_hex({"b": 1, "a": 2}) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_times_round_trip():
    t = dt.datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)
    assert format_time(t) == "2026-03-01T12:00:00.123456Z"
    assert parse_time("2026-03-01T12:00:00.123456Z") == t
    assert parse_time("2026-03-01T12:00:00.123456") == t  # no zone: UTC
    assert parse_time("2026-03-01T13:00:00.123456+01:00") == t


def test_register_writes_a_sealed_registration(work):
    reg, report = register("experiments/minimal.toml", now=T0)
    path = work / "preregistrations" / "minimal.json"
    assert reg.path == Path("preregistrations/minimal.json") and path.is_file()
    data = json.loads(path.read_text())
    assert set(data) == {"schema", "sealed", "sha256"}
    assert data["schema"] == SCHEMA
    sealed = data["sealed"]
    assert data["sha256"] == hashlib.sha256(canonical_json(sealed)).hexdigest()
    assert sealed["name"] == "minimal"
    assert sealed["source"] == "experiments/minimal.toml"
    assert sealed["registered_utc"] == sealed["sealed_utc"] == "2026-03-01T12:00:00.000000Z"
    assert sealed["bistat_version"] == __version__
    assert sealed["git"] == {"commit": None, "declaration_state": None}
    assert sealed["amendments"] == []
    assert sealed["declaration"]["workload"]["retries"] == 2  # defaults filled in
    assert sealed["declaration_sha256"] == sha256_hex(sealed["declaration"])
    assert sealed["design"] == report.to_dict()
    assert sealed["design"]["match"][0]["min_prompts"] == 381
    # the file is pretty-printed with sorted keys, ending in a newline
    assert path.read_text() == json.dumps(data, indent=2, sort_keys=True,
                                          ensure_ascii=False) + "\n"
    assert load_registration(path).sha256 == data["sha256"]


def test_register_never_overwrites(work):
    register("experiments/minimal.toml", now=T0)
    before = (work / "preregistrations" / "minimal.json").read_bytes()
    with pytest.raises(RegistrationError) as info:
        register("experiments/minimal.toml", now=at(5))
    assert str(info.value) == (
        "preregistrations/minimal.json already exists; a registration is never overwritten. To "
        "change the declaration before any data is recorded: bistat register "
        "experiments/minimal.toml --amend --reason \"...\"; otherwise register it under a new "
        "name")
    assert (work / "preregistrations" / "minimal.json").read_bytes() == before


def test_register_requires_the_file_name_to_match(work):
    shutil.copy(DECL / "minimal.toml", work / "experiments" / "other.toml")
    with pytest.raises(DeclarationError) as info:
        register("experiments/other.toml", now=T0)
    assert info.value.messages == [
        "experiments/other.toml: name: 'minimal' differs from the file name 'other'; rename the "
        "file to minimal.toml or set name = \"other\""]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_state_clean_dirty_untracked(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    git("config", "user.email", "t@example.org")
    git("config", "user.name", "t")
    f = tmp_path / "minimal.toml"
    f.write_text("x = 1\n")
    assert git_state(f) == {"commit": None, "declaration_state": "untracked"}
    git("add", "minimal.toml")
    git("commit", "-q", "-m", "c")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert git_state(f) == {"commit": head, "declaration_state": "clean"}
    f.write_text("x = 2\n")
    assert git_state(f) == {"commit": head, "declaration_state": "dirty"}


def test_git_state_outside_a_repository(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text("")
    assert git_state(f) == {"commit": None, "declaration_state": None}


# ---- verify


def test_verify_intact_with_runs(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    run = write_run(work / "runs" / "minimal-1", reg, at(1), [at(2), at(3)],
                    truncated_tail=True)
    report = verify(reg.path, [run], now=at(10))
    assert report.ok, report.problems
    assert report.n_data == 5  # created_utc, two schedule lines, two passes lines
    assert report.earliest_datum == "2026-03-01T12:01:00.000000Z"
    # without RUN_DIRs, the runs naming the registration are found under runs/
    found = verify(reg.path, now=at(10))
    assert found.runs == (str(Path("runs/minimal-1")),) and found.ok


def test_verify_detects_tampering(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    path = work / reg.path
    data = json.loads(path.read_text())
    data["sealed"]["declaration"]["rule"]["labels"][0]["all"][0]["at_least"] = 0.9
    path.write_text(json.dumps(data))
    report = verify(reg.path, now=at(10))
    assert not report.ok
    assert report.problems[0].startswith(
        "preregistrations/minimal.json: seal broken: the sealed content hashes to ")
    assert report.problems[0].endswith(
        f", but the seal is {reg.sha256}; the registration was changed after it was sealed")
    assert report.problems[1] == (
        "preregistrations/minimal.json: declaration_sha256 does not match the declaration; the "
        "declaration was changed after it was sealed")
    with pytest.raises(RegistrationError, match="seal broken"):
        load_registration(reg.path)


def test_verify_detects_a_resealed_back_dated_registration(work):
    # Someone moves the registration time back and recomputes the seal; the log no longer
    # agrees with itself.
    reg, _ = register("experiments/minimal.toml", now=T0)
    path = work / reg.path
    data = json.loads(path.read_text())
    data["sealed"]["registered_utc"] = "2026-02-01T12:00:00.000000Z"
    data["sha256"] = sha256_hex(data["sealed"])
    path.write_text(json.dumps(data))
    report = verify(reg.path, now=at(10))
    assert report.problems == (
        "preregistrations/minimal.json: sealed_utc 2026-03-01T12:00:00.000000Z is not the time "
        "of the last sealing (2026-02-01T12:00:00.000000Z)",)


def test_verify_refuses_data_older_than_the_registration(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    run = write_run(work / "runs" / "minimal-1", reg, at(-30), [at(-29), at(1)])
    report = verify(reg.path, [run], now=at(10))
    assert report.problems == (
        f"{run}: 3 recorded datum(s) are not later than the registration (sealed "
        f"2026-03-01T12:00:00.000000Z), e.g. {run / 'run.json'} created_utc = "
        "2026-03-01T11:30:00.000000Z; the registration does not precede the data (back-dated "
        "data or a registration made after the run)",)


def test_verify_refuses_a_future_registration_and_foreign_runs(work):
    reg, _ = register("experiments/minimal.toml", now=at(60))
    assert verify(reg.path, now=T0).problems == (
        "preregistrations/minimal.json: sealed at 2026-03-01T13:00:00.000000Z, which is in the "
        "future; the registration is forward-dated or the clock is wrong",)
    run = write_run(work / "runs" / "x", reg, at(61), [at(62)])
    info = json.loads((run / "run.json").read_text())
    info["registration"]["sha256"] = "0" * 64
    (run / "run.json").write_text(json.dumps(info))
    assert verify(reg.path, [run], now=at(70)).problems == (
        f"{run}: recorded against registration sha256 '{'0' * 64}', not {reg.sha256} "
        "(preregistrations/minimal.json)",)
    assert verify(reg.path, [work / "runs"], now=at(70)).problems == (
        f"{work / 'runs'}: no readable run.json; not a run directory",)


def test_verify_unreadable_registrations(work):
    assert verify("preregistrations/none.json").problems == (
        "preregistrations/none.json: no such registration",)
    (work / "bad.json").write_text('{"schema": "other/1"}')
    assert verify("bad.json").problems == (
        "bad.json: schema 'other/1' is not 'bistat.registration/1'; not a bistat registration, "
        "or written by an incompatible version",)


# ---- amend


def _change_threshold(work: Path, value: str) -> None:
    f = work / "experiments" / "minimal.toml"
    f.write_text(re.sub(r"at_least = 0\.9\d", f"at_least = {value}", f.read_text()))


def test_amend_before_data_appends_to_the_log(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    _change_threshold(work, "0.98")
    new, _ = amend("experiments/minimal.toml", "threshold was a typo", now=at(5))
    assert new.registered_utc == "2026-03-01T12:00:00.000000Z"
    assert new.sealed_utc == "2026-03-01T12:05:00.000000Z"
    assert new.amendments == [{
        "time_utc": "2026-03-01T12:05:00.000000Z", "reason": "threshold was a typo",
        "old_declaration_sha256": reg.declaration_sha256,
        "new_declaration_sha256": new.declaration_sha256, "previous_sha256": reg.sha256,
        "git": {"commit": None, "declaration_state": None}}]
    assert new.declaration["rule"]["labels"][0]["all"][0]["at_least"] == 0.98
    assert new.sha256 == sha256_hex(new.sealed)
    _change_threshold(work, "0.97")
    newer, _ = amend("experiments/minimal.toml", "second thoughts", now=at(6))
    assert [a["reason"] for a in newer.amendments] == ["threshold was a typo", "second thoughts"]
    assert newer.amendments[0] == new.amendments[0]
    assert verify(newer.path, now=at(10)).ok
    # a run recorded after the last amendment is fine; one dated between the two is not
    run = write_run(work / "runs" / "r", newer, at(7), [at(8)])
    assert verify(newer.path, [run], now=at(10)).ok
    early = write_run(work / "runs" / "early", newer, at(5.5), [at(8)])
    assert verify(newer.path, [early], now=at(10)).problems[0].startswith(
        f"{early}: 1 recorded datum(s) are not later than the registration (sealed "
        "2026-03-01T12:06:00.000000Z)")


def test_amend_refused_after_data(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    write_run(work / "runs" / "minimal-1", reg, at(1), [at(2)])
    _change_threshold(work, "0.98")
    before = (work / reg.path).read_bytes()
    with pytest.raises(RegistrationError) as info:
        amend("experiments/minimal.toml", "after the fact", now=at(5))
    assert str(info.value) == (
        f"cannot amend preregistrations/minimal.json: data has been recorded for it "
        f"({Path('runs/minimal-1')}); a registration cannot change after data exists. Register "
        "the changed declaration under a new name")
    assert (work / reg.path).read_bytes() == before


def test_amend_refused_when_a_run_names_it_elsewhere_or_by_name(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    run = write_run(work / "elsewhere" / "r1", reg, at(1), [at(2)])
    info = json.loads((run / "run.json").read_text())
    info["registration"]["sha256"] = "f" * 64  # names it by name only
    (run / "run.json").write_text(json.dumps(info))
    _change_threshold(work, "0.98")
    assert find_recorded_runs(reg, ["runs"]) == []
    assert find_recorded_runs(reg, ["elsewhere"]) == [Path("elsewhere/r1")]
    with pytest.raises(RegistrationError, match="data has been recorded"):
        amend("experiments/minimal.toml", "x", runs_dirs=["elsewhere"], now=at(5))


def test_run_recorded_before_an_amendment_voids_it(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    _change_threshold(work, "0.98")
    new, _ = amend("experiments/minimal.toml", "typo", now=at(5))
    run = write_run(work / "stale", reg, at(6), [at(7)])  # names the pre-amendment seal
    assert verify(new.path, [run], now=at(10)).problems == (
        f"{run}: recorded against preregistrations/minimal.json as sealed before an amendment "
        f"(sha256 {reg.sha256}); data recorded before an amendment voids it",)


def test_amend_refusals(work):
    with pytest.raises(RegistrationError) as info:
        amend("experiments/minimal.toml", "x", now=T0)
    assert str(info.value) == (
        "preregistrations/minimal.json does not exist; there is nothing to amend. Register it "
        "first: bistat register experiments/minimal.toml")
    register("experiments/minimal.toml", now=T0)
    with pytest.raises(RegistrationError, match="nothing to amend"):
        amend("experiments/minimal.toml", "x", now=at(1))
    with pytest.raises(RegistrationError, match="an amendment needs a reason"):
        amend("experiments/minimal.toml", "  ", now=at(1))
    _change_threshold(work, "0.98")
    with pytest.raises(RegistrationError, match="the clock reads"):
        amend("experiments/minimal.toml", "x", now=at(-1))


def test_amend_refused_on_a_tampered_registration(work):
    reg, _ = register("experiments/minimal.toml", now=T0)
    data = json.loads((work / reg.path).read_text())
    data["sealed"]["amendments"].append({"reason": "forged"})
    (work / reg.path).write_text(json.dumps(data))
    _change_threshold(work, "0.98")
    with pytest.raises(RegistrationError, match="seal broken"):
        amend("experiments/minimal.toml", "x", now=at(1))


def _reseal(path: Path, mutate) -> None:
    """Rewrite a registration as an older (or forged) bistat would have sealed it."""
    data = json.loads(path.read_text())
    mutate(data["sealed"]["declaration"])
    data["sealed"]["declaration_sha256"] = sha256_hex(data["sealed"]["declaration"])
    data["sha256"] = sha256_hex(data["sealed"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_a_registration_sealed_before_a_new_schema_field_stays_readable(work):
    register("experiments/minimal.toml", now=T0)
    path = work / "preregistrations" / "minimal.json"
    # An older schema had no workload.max_tokens_min: its registration lacks the key.
    _reseal(path, lambda d: d["workload"].pop("max_tokens_min"))
    reg = load_registration(path)
    assert "max_tokens_min" not in reg.declaration["workload"]
    assert reg.experiment().workload.max_tokens_min is None


def test_a_sealed_value_the_schema_resolves_differently_is_refused(work):
    register("experiments/minimal.toml", now=T0)
    path = work / "preregistrations" / "minimal.json"
    # Resealed with a value bistat register never writes: the CV left unresolved (it resolves
    # to the declared default, 0.05).
    _reseal(path, lambda d: d["design"].update(expected_cv=None))
    with pytest.raises(RegistrationError, match="is not in resolved form"):
        load_registration(path)
