"""Newest-release checks after the seal (``bistat check-release``, ``register --amend``): appended
to ``NAME.releases.jsonl`` beside the registration, hashed and chained, the sealed bytes untouched;
a finding states the latest check's release with its time against the run's first record. The
package index is faked (``httpx.MockTransport``, or a loopback server for the CLI): no network."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import helpers_runner as h
import httpx
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bistat.cli import cli
from bistat.declare import prereg, releases
from bistat.declare.engine_version import engine_version_report
from bistat.declare.release_log import LOG_SCHEMA, release_log_path
from bistat.engines.serve.server import BackgroundServer


@pytest.fixture(autouse=True)
def _no_fake_kind_left_behind(monkeypatch):
    """helpers_runner registers the fake engine kind; later test files must not see it."""
    from bistat.engines import registry

    monkeypatch.setitem(vars(registry), "ENGINE_KINDS", dict(registry.ENGINE_KINDS))
    monkeypatch.setitem(vars(registry), "ADAPTERS", dict(registry.ADAPTERS))


PYPI = "https://pypi.org/pypi"
REGISTERED = dt.datetime(2026, 12, 2, 12, 7, 23, 933803, tzinfo=dt.timezone.utc)
LATER = dt.datetime(2026, 12, 2, 15, 10, 0, tzinfo=dt.timezone.utc)
OFF = releases.ReleaseCheck("vllm", None, "2026-12-02T12:07:23Z", "off",
                            "not checked (BISTAT_PACKAGE_INDEX=off)")


def _index(version="0.34.0", status=200, exc=None):
    """A fake PyPI JSON API answering ``info.version``."""
    def handle(request: httpx.Request) -> httpx.Response:
        if exc is not None:
            raise exc
        assert str(request.url) == f"{PYPI}/vllm/json"
        return httpx.Response(status, json={"info": {"name": "vllm", "version": version}})
    return httpx.MockTransport(handle)


def _checker(when=LATER, **kw):
    return lambda package: releases.check_newest_release(package, index=PYPI,
                                                         transport=_index(**kw), now=when)


def _register(tmp_path, name="i23", kind="vllm-offline", check=OFF):
    decl = h.declaration()
    decl["name"] = name
    decl["engine"] = ({"kind": kind, "model": "/tmp/model/m"} if kind != "fake"
                      else decl["engine"])
    reg, _ = prereg.register(h.write_toml(tmp_path / f"{name}.toml", decl),
                             registrations_dir=tmp_path / "p", base_dir=tmp_path,
                             now=REGISTERED, release_check=lambda p: check)
    return reg


def _lines(reg):
    return [json.loads(x) for x in release_log_path(reg.path).read_text().splitlines()]


# -- the log ----------------------------------------------------------------------------------

def test_a_check_is_appended_beside_the_registration_and_the_seal_is_untouched(tmp_path):
    reg = _register(tmp_path)
    sealed = reg.path.read_bytes()
    got, line = prereg.check_release(reg.path, release_check=_checker())
    assert reg.path.read_bytes() == sealed
    assert release_log_path(reg.path) == tmp_path / "p" / "i23.releases.jsonl"
    assert (line.line, line.by, line.registration_sha256) == (1, "check-release", reg.sha256)
    assert line.check == releases.ReleaseCheck("vllm", "0.34.0", "2026-12-02T15:10:00Z", PYPI)
    (rec,) = _lines(reg)
    assert rec == {"schema": LOG_SCHEMA, "registration": "i23", "registration_sha256": reg.sha256,
                   "by": "check-release", "previous_sha256": None, "sha256": line.sha256,
                   "check": {"package": "vllm", "newest": "0.34.0",
                             "checked_utc": "2026-12-02T15:10:00Z", "index": PYPI,
                             "error": None}}
    assert line.sha256 == prereg.sha256_hex({k: v for k, v in rec.items() if k != "sha256"})
    # a second check chains to the first; the seal still verifies, the log with it
    _, second = prereg.check_release(reg.path, release_check=_checker(
        LATER + dt.timedelta(hours=1), version="0.34.1"))
    assert _lines(reg)[1]["previous_sha256"] == line.sha256
    assert [c.check.newest for c in prereg.release_log_checks(reg)] == ["0.34.0", "0.34.1"]
    assert prereg.load_registration(reg.path).data == reg.data
    report = prereg.verify(reg.path, now=LATER + dt.timedelta(days=1))
    assert report.ok and report.release_checks == 2


@pytest.mark.parametrize("checker,error", [
    (lambda p: releases.check_newest_release(p, index="off"),
     "not checked (BISTAT_PACKAGE_INDEX=off) (index off); nothing was appended to {log}: unset "
     "BISTAT_PACKAGE_INDEX (it is 'off') and run again"),
    (_checker(exc=httpx.ConnectError("[Errno -3] Temporary failure in name resolution")),
     "the index could not be reached (ConnectError: [Errno -3] Temporary failure in name "
     "resolution) (index https://pypi.org/pypi); nothing was appended to {log}: run it on a "
     "machine that reaches https://pypi.org/pypi, or set BISTAT_PACKAGE_INDEX to a reachable "
     "copy of PyPI's JSON API"),
    (_checker(status=503), "the index answered HTTP 503 (index https://pypi.org/pypi)"),
])
def test_a_check_that_found_no_release_is_an_error_and_appends_nothing(tmp_path, checker, error):
    reg = _register(tmp_path)
    log = release_log_path(reg.path)
    with pytest.raises(prereg.RegistrationError) as err:
        prereg.check_release(reg.path, release_check=checker)
    assert str(err.value).startswith(f"{reg.path}: cannot check the newest vllm release: ")
    assert error.format(log=log) in str(err.value)
    assert not log.exists()


def test_no_registration_or_no_released_engine_is_an_error_naming_the_fix(tmp_path):
    with pytest.raises(prereg.RegistrationError) as err:
        prereg.check_release(tmp_path / "p" / "nope.json", release_check=_checker())
    assert str(err.value) == (f"{tmp_path / 'p' / 'nope.json'}: no such registration; fix the "
                              "path, or register the declaration first (bistat register "
                              "experiments/nope.toml)")
    fake = _register(tmp_path, "embedded-ish", kind="fake")
    with pytest.raises(prereg.RegistrationError) as err:
        prereg.check_release(fake.path, release_check=_checker())
    assert str(err.value) == (f"{fake.path}: engine.kind: 'fake' is not released on a package "
                              "index, so there is no newest release to check (only sglang-server, "
                              "vllm-offline, vllm-server are)")


def _tamper(reg, edit):
    log = release_log_path(reg.path)
    lines = log.read_text().splitlines()
    log.write_text("".join(x + "\n" for x in edit(lines)))
    return log


def _edited_newest(lines):
    rec = json.loads(lines[0])
    rec["check"]["newest"] = "0.33.0"
    return [json.dumps(rec, sort_keys=True)] + lines[1:]


def _from(other):
    return lambda lines: [other.read_text().splitlines()[0]]


@pytest.mark.parametrize("edit,message", [
    (_edited_newest, "{log}:1: sha256: the line hashes to "),
    (lambda lines: lines[1:], "{log}:1: previous_sha256: '"),
    (lambda lines: lines[::-1], "{log}:1: previous_sha256: '"),
    (lambda lines: lines + ["{\"schema\": \"bistat.release-check/1\""], "{log}:3: not JSON ("),
    (lambda lines: [json.dumps({**json.loads(lines[0]), "schema": "x/9"})],
     "{log}:1: schema: 'x/9' is not 'bistat.release-check/1'"),
    (lambda lines: [json.dumps({k: v for k, v in json.loads(lines[0]).items() if k != "by"})],
     "{log}:1: lacks by; the log was edited"),
])
def test_a_tampered_log_is_refused_naming_the_line_the_field_and_the_fix(tmp_path, edit, message):
    reg = _register(tmp_path)
    prereg.check_release(reg.path, release_check=_checker())
    prereg.check_release(reg.path, release_check=_checker(LATER + dt.timedelta(minutes=5)))
    log = _tamper(reg, edit)
    with pytest.raises(prereg.RegistrationError) as err:
        prereg.release_log_checks(reg)
    assert str(err.value).startswith(message.format(log=log))
    if "schema" not in message:
        assert str(err.value).endswith(f"restore the log from your own copy of it (git never "
                                       f"committed {log}, so git cannot restore it), or "
                                       "move it aside and check again (bistat check-release "
                                       f"{reg.path})")
    # nothing more is appended to it, verify fails, and the seal itself is still intact
    before = log.read_bytes()
    with pytest.raises(prereg.RegistrationError):
        prereg.check_release(reg.path, release_check=_checker(LATER + dt.timedelta(hours=2)))
    assert log.read_bytes() == before
    report = prereg.verify(reg.path, now=LATER + dt.timedelta(days=1))
    assert not report.ok and report.problems[0].startswith(message.format(log=log))
    assert prereg.load_registration(reg.path).sha256 == reg.sha256


def test_a_log_of_another_registration_or_dated_before_it_is_refused(tmp_path):
    reg, other = _register(tmp_path), _register(tmp_path, "other")
    prereg.check_release(other.path, release_check=_checker())
    log = release_log_path(reg.path)
    log.write_text(release_log_path(other.path).read_text())
    with pytest.raises(prereg.RegistrationError) as err:
        prereg.release_log_checks(reg)
    assert str(err.value) == (f"{log}:1: registration_sha256: '{other.sha256}' ('other') is not a "
                              f"seal of {reg.path}; the log belongs to another registration: "
                              "move it aside")
    log.unlink()
    with pytest.raises(prereg.RegistrationError) as err:   # a clock behind the registration
        prereg.check_release(reg.path, release_check=_checker(REGISTERED - dt.timedelta(hours=1)))
    assert str(err.value) == ("the clock reads 2026-12-02T11:07:23Z, before "
                              "2026-12-02T12:07:23.933803Z (the registration); nothing was "
                              "recorded: fix the system clock")
    assert not log.exists()
    # the same second as the registration is not before it (checks are dated to the second)
    _, line = prereg.check_release(reg.path, release_check=_checker(REGISTERED))
    assert line.check.checked_utc == "2026-12-02T12:07:23Z"


def test_amend_records_its_own_check_against_the_new_seal(tmp_path):
    reg = _register(tmp_path)
    prereg.check_release(reg.path, release_check=_checker(LATER))
    decl = h.declaration()
    decl["name"] = "i23"
    decl["engine"] = {"kind": "vllm-offline", "model": "/tmp/model/m"}
    decl["hypothesis"] = "amended hypothesis"
    toml = h.write_toml(tmp_path / "i23.toml", decl)
    amended, _ = prereg.amend(toml, "reword", registrations_dir=tmp_path / "p",
                              runs_dirs=[tmp_path / "runs"], base_dir=tmp_path,
                              now=LATER + dt.timedelta(minutes=1),
                              release_check=_checker(LATER + dt.timedelta(minutes=1)))
    assert amended.sealed["engine_release"] == OFF.to_dict()   # the seal keeps its own check
    checks = prereg.release_log_checks(amended)
    assert [(c.by, c.registration_sha256, c.check.checked_utc) for c in checks] == [
        ("check-release", reg.sha256, "2026-12-02T15:10:00Z"),
        ("amend", amended.sha256, "2026-12-02T15:11:00Z")]
    assert prereg.verify(amended.path, now=LATER + dt.timedelta(days=1)).ok
    # an amendment whose release log is broken is refused before anything is written
    decl["hypothesis"] = "amended again"
    h.write_toml(toml, decl)
    log = _tamper(amended, _edited_newest)
    sealed = amended.path.read_bytes()
    with pytest.raises(prereg.RegistrationError, match=f"{log}:1: sha256: "):
        prereg.amend(toml, "again", registrations_dir=tmp_path / "p",
                     runs_dirs=[tmp_path / "runs"], base_dir=tmp_path,
                     now=LATER + dt.timedelta(minutes=2), release_check=_checker())
    assert amended.path.read_bytes() == sealed


def test_a_leftover_log_without_its_registration_blocks_a_new_one(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "i23.releases.jsonl").write_text("")
    with pytest.raises(prereg.RegistrationError, match="i23.releases.jsonl exists without its "
                                                       "registration .*: move it aside"):
        _register(tmp_path)


# -- what a finding says ----------------------------------------------------------------------

ARMS = [{"name": "default", "role": "control"}, {"name": "bi-tuned-gemm", "role": "treatment"}]
ENV = [{"arm": a["name"], "engine": {"kind": "vllm-offline", "version": "0.33.0",
                                     "commit": "g4ba787ec9"}} for a in ARMS]
RUN_OFF = [{"event": "release_check", "release_check": {**OFF.to_dict(),
                                                        "checked_utc": "2026-12-02T12:14:00Z"}}]
FIRST = "2026-12-02T12:13:58.500000Z"


def _logged(tmp_path, *checks):
    reg = _register(tmp_path)
    for when, version in checks:
        prereg.check_release(reg.path, release_check=_checker(when, version=version))
    return reg, prereg.release_log_checks(reg)


def test_the_finding_states_the_later_check_with_its_time_after_the_run(tmp_path):
    reg, logged = _logged(tmp_path, (LATER, "0.34.0"))
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, reg.sealed, ENV, RUN_OFF,
                                later_checks=logged, first_record_utc=FIRST)
    assert rep.comparison == (
        "vllm 0.33.0 (g4ba787ec9) is older than the newest release known, 0.34.0 "
        "(https://pypi.org/pypi, checked 2026-12-02T15:10:00Z by `bistat check-release`, after "
        "the run's first record (2026-12-02T12:13:58.500000Z)); the newest release was unknown "
        "at registration and when the run started.",)
    assert [rep.label(w, c) for w, c in rep.checks] == [
        "registration", "run", "bistat check-release, after the run"]
    # the same release found the same way at the run's start would be stated as such
    run_found = [{"event": "release_check", "release_check": releases.ReleaseCheck(
        "vllm", "0.33.0", "2026-12-02T12:14:00Z", PYPI).to_dict()}]
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, reg.sealed, ENV, run_found,
                                first_record_utc=FIRST)
    assert rep.comparison == ("vllm 0.33.0 (g4ba787ec9) is the newest release known (0.33.0) "
                              "(https://pypi.org/pypi, checked 2026-12-02T12:14:00Z when the run "
                              "started).",)


def test_the_latest_check_that_found_a_release_wins_and_a_before_run_check_says_so(tmp_path):
    reg, logged = _logged(tmp_path, (dt.datetime(2026, 12, 2, 12, 10, tzinfo=dt.timezone.utc),
                                     "0.33.0"))
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, reg.sealed, ENV, RUN_OFF,
                                later_checks=logged, first_record_utc=FIRST)
    assert [w for w, _ in rep.checks] == ["registration", "check-release", "run"]
    assert rep.used == ("check-release", logged[0].check)
    assert rep.comparison[0].endswith(
        "is the newest release known (0.33.0) (https://pypi.org/pypi, checked "
        "2026-12-02T12:10:00Z by `bistat check-release`, before the run's first record "
        "(2026-12-02T12:13:58.500000Z)); the newest release was unknown at registration and "
        "when the run started.")


# -- the command ------------------------------------------------------------------------------

def test_the_cli_checks_a_fake_index_over_http_and_reports_the_line(tmp_path, monkeypatch):
    reg = _register(tmp_path)
    seen = []

    async def vllm_json(request: Request) -> JSONResponse:
        seen.append(request.url.path)
        return JSONResponse({"info": {"name": "vllm", "version": "0.34.0"}})

    app = Starlette(routes=[Route("/pypi/vllm/json", vllm_json)])
    with BackgroundServer(app) as srv:
        monkeypatch.setenv("BISTAT_PACKAGE_INDEX", f"{srv.url}/pypi")
        result = CliRunner().invoke(cli, ["check-release", str(reg.path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    (line,) = prereg.release_log_checks(reg)
    assert seen == ["/pypi/vllm/json"]
    assert out == {"registration": str(reg.path), "log": str(release_log_path(reg.path)),
                   "line": 1, "by": "check-release", "sha256": line.sha256,
                   "registration_sha256": reg.sha256, "check": line.check.to_dict()}
    assert (line.check.newest, line.check.index) == ("0.34.0", f"{srv.url}/pypi")
    with BackgroundServer(app) as srv:
        monkeypatch.setenv("BISTAT_PACKAGE_INDEX", f"{srv.url}/pypi")
        result = CliRunner().invoke(cli, ["check-release", str(reg.path)])
    assert result.exit_code == 0, result.output
    second = prereg.release_log_checks(reg)[1]
    assert result.output.splitlines()[:4] == [
        "Newest vllm release for 'i23': 0.34.0",
        f"  index:        {srv.url}/pypi",
        f"  checked:      {second.check.checked_utc}",
        f"  recorded in:  {release_log_path(reg.path)}, line 2 (sha256 {second.sha256})"]
    assert result.output.splitlines()[4] == (
        f"  seal:         {reg.path} unchanged (sha256 {reg.sha256}); at registration: newest "
        "vllm unknown (not checked (BISTAT_PACKAGE_INDEX=off)) (off, checked 2026-12-02T12:07:23Z)")

    monkeypatch.setenv("BISTAT_PACKAGE_INDEX", "off")
    result = CliRunner().invoke(cli, ["check-release", str(reg.path)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {reg.path}: cannot check the newest vllm release: "
                                    "not checked (BISTAT_PACKAGE_INDEX=off)")
    assert len(prereg.release_log_checks(reg)) == 2
