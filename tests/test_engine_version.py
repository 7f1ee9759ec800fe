"""The version gap: the newest release from the package index (mock transport, never
the network), recorded at registration and at a run's start, set against the version each arm
measured in the finding; the required version; each arm's compilation / CUDA-graph mode."""

from __future__ import annotations

import dataclasses
import datetime as dt

import json
import types
from pathlib import Path

import fakes
import helpers_runner as h
import httpx
import pytest

from bistat.declare import releases
from bistat.analysis.summary import analyze_run
from bistat.explain.doctor import doctor, render_doctor
from bistat.declare.engine_version import compare_versions, engine_version_report, required_specifier
from bistat.store.enginelog import EngineModes, engine_modes, logged_modes
from bistat.engines import vllm_offline_worker as worker
from bistat.declare.experiment import DeclarationError, validate_experiment
from bistat.declare.prereg import register
from bistat.store.readers import read_jsonl
from bistat.report.finding import render_markdown
from bistat.run.runner import start_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_fake_kind_left_behind(monkeypatch):
    """helpers_runner registers the fake engine kind; later test files must not see it."""
    from bistat.engines import registry

    monkeypatch.setitem(vars(registry), "ENGINE_KINDS", dict(registry.ENGINE_KINDS))
    monkeypatch.setitem(vars(registry), "ADAPTERS", dict(registry.ADAPTERS))


NOW = dt.datetime(2026, 12, 2, 4, 0, tzinfo=dt.timezone.utc)
PYPI = "https://pypi.org/pypi"


def _index(status=200, body=None, seen=None):
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(str(request.url))
        if isinstance(body, Exception):
            raise body
        return httpx.Response(status, json=body if body is not None else
                              {"info": {"name": "vllm", "version": "0.33.0"},
                               "releases": {"0.25.0": [], "0.33.0": []}})
    return httpx.MockTransport(handle)


# -- the check --------------------------------------------------------------------------------

def test_the_check_reads_info_version_from_the_json_api():
    seen = []
    check = releases.check_newest_release("vllm", index=PYPI, transport=_index(seen=seen), now=NOW)
    assert seen == ["https://pypi.org/pypi/vllm/json"]
    assert check == releases.ReleaseCheck("vllm", "0.33.0", "2026-12-02T04:00:00Z", PYPI, None)
    assert releases.ReleaseCheck.from_dict(check.to_dict()) == check


@pytest.mark.parametrize("transport,error", [
    (_index(status=404, body={}), "the index answered HTTP 404"),
    (_index(body={"info": {}}), "the index's answer has no readable info.version (KeyError)"),
    (_index(body={"info": {"version": "not a version"}}),
     "the index's answer has no readable info.version (InvalidVersion)"),
    (_index(body=httpx.ConnectError("[Errno -3] Temporary failure in name resolution")),
     "the index could not be reached (ConnectError: [Errno -3] Temporary failure in name "
     "resolution)"),
])
def test_a_failed_check_is_recorded_as_unknown_with_the_reason(transport, error):
    check = releases.check_newest_release("vllm", index=PYPI, transport=transport, now=NOW)
    assert (check.newest, check.error) == (None, error)


def test_the_suite_never_reaches_the_network():
    """tests/conftest.py switches the index off; the check then makes no request at all."""
    check = releases.check_newest_release("vllm", transport=_index(body=AssertionError("asked")),
                                          now=NOW)
    assert (check.newest, check.index, check.error) == (
        None, "off", "not checked (BISTAT_PACKAGE_INDEX=off)")


# -- versions and requirements ----------------------------------------------------------------

@pytest.mark.parametrize("version,newest,how", [
    ("0.25.0", "0.33.0", "older"), ("0.33.0", "0.33.0", "newest"),
    ("0.34.0.dev12+g1234", "0.33.0", "newer"), ("0.33.1rc1", "0.33.0", "newer"),
    ("0.33", "0.33.0", "newest"), ("custom-build", "0.33.0", "incomparable")])
def test_compare_versions(version, newest, how):
    assert compare_versions(version, newest) == how


def _declaration(**engine):
    data = h.declaration()
    data["engine"] = {"kind": "vllm-offline", "model": "/tmp/model/m", **engine}
    return data


def test_required_version_is_validated_at_load_with_the_field_and_the_fix():
    assert str(required_specifier("0.33.0")) == "==0.33.0"
    exp = validate_experiment(_declaration(required_version=">=0.33,<0.34"), "experiments/x.toml")
    assert exp.resolved()["engine"]["required_version"] == ">=0.33,<0.34"
    with pytest.raises(DeclarationError) as err:
        validate_experiment(_declaration(required_version="newest"), "experiments/x.toml")
    assert str(err.value) == (
        "experiments/x.toml: engine.required_version: 'newest' is neither a version nor a "
        "version specifier (PEP 440); write e.g. \"0.33.0\" or \">=0.33,<0.34\"")


# -- the report (pure) ------------------------------------------------------------------------

ARMS = [{"name": "default", "role": "control"}, {"name": "batch-invariant", "role": "treatment"}]


def _env(version="0.25.0", commit="gdd10e03f9", modes=None):
    rows = []
    for a in ARMS:
        row = {"arm": a["name"], "engine": {"kind": "vllm-server", "version": version,
                                            "commit": commit}}
        if modes is not None:
            row["modes"] = modes[a["name"]]
        rows.append(row)
    return rows


def _check(newest, when="2026-12-02T03:00:00Z", error=None):
    return releases.ReleaseCheck("vllm", newest, when, PYPI, error).to_dict()


def test_no_recorded_check_says_the_gap_is_unknown():
    rep = engine_version_report("vllm-server", {"arms": ARMS}, {}, _env(), [])
    assert rep.comparison == ("vllm 0.25.0 (gdd10e03f9): no check of the newest vllm release "
                              "was recorded with this run or its registration, so how it "
                              "compares with the newest release is unknown.",)
    assert (rep.used, rep.deviations, rep.required) == (None, (), None)


def test_the_latest_check_that_found_a_release_is_used():
    sealed = {"engine_release": _check("0.32.0", "2026-11-20T00:00:00Z")}
    events = [{"event": "gpu_busy", "detail": "pid 1"},
              {"event": "release_check", "release_check": _check(
                  None, "2026-12-02T05:00:00Z", "the index could not be reached (ConnectError: x)")}]
    rep = engine_version_report("vllm-server", {"arms": ARMS}, sealed, _env(), events)
    assert [w for w, _ in rep.checks] == ["registration", "run"]
    assert rep.comparison == ("vllm 0.25.0 (gdd10e03f9) is older than the newest release known, "
                              "0.32.0 (https://pypi.org/pypi, checked 2026-11-20T00:00:00Z at "
                              "registration).",)
    events[1]["release_check"] = _check("0.33.0", "2026-12-02T05:00:00Z")
    rep = engine_version_report("vllm-server", {"arms": ARMS}, sealed, _env("0.33.0", "g4ba787ec9"),
                                events)
    assert rep.comparison == ("vllm 0.33.0 (g4ba787ec9) is the newest release known (0.33.0) "
                              "(https://pypi.org/pypi, checked 2026-12-02T05:00:00Z when the run "
                              "started).",)


def test_only_failed_checks_say_why_the_newest_release_is_unknown():
    sealed = {"engine_release": _check(None, error="not checked (BISTAT_PACKAGE_INDEX=off)")}
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, sealed, _env(), [])
    assert rep.comparison == ("vllm 0.25.0 (gdd10e03f9): the newest vllm release is unknown (not "
                              "checked (BISTAT_PACKAGE_INDEX=off); https://pypi.org/pypi, checked "
                              "2026-12-02T03:00:00Z at registration).",)


def test_a_run_on_a_version_the_registration_excludes_is_a_deviation():
    decl = {"arms": ARMS, "engine": {"required_version": "0.33.0"}}
    rep = engine_version_report("vllm-server", decl, {}, _env("0.25.0"), [])
    assert rep.deviations == tuple(
        f"arm {a}: the engine ran version 0.25.0, which the registration's required version "
        "(==0.33.0) excludes" for a in ("default", "batch-invariant"))
    assert engine_version_report("vllm-server", decl, {}, _env("0.33.0"), []).deviations == ()
    missing = engine_version_report("vllm-server", decl, {}, _env(None), [])
    assert missing.deviations[0] == ("arm default: the engine's version was not recorded; the "
                                     "registration requires ==0.33.0")


def test_embedded_engines_have_no_release_comparison_but_keep_the_requirement():
    rep = engine_version_report("embedded", {"arms": ARMS}, {}, _env("0.1.0"), [])
    assert (rep.package, rep.comparison) == (None, ())


# -- modes ------------------------------------------------------------------------------------

CONFIG_025 = ("(EngineCore pid=3065) INFO 12-01 16:47:58 [core.py:114] Initializing a V1 LLM "
              "engine (v0.25.0) with config: model='/tmp/model/qwen3-8b-config', "
              "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'debug_dump_path': "
              "None, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, "
              "'cudagraph_num_of_warmups': 1}, kernel_config=KernelConfig()")
LOG_033_BREAKABLE = "\n".join([
    "(MainProcess pid=7) INFO 12-02 04:10:00 [vllm.py:859] VLLM_BATCH_INVARIANT=1: auto-enabling "
    "VLLM_USE_BREAKABLE_CUDAGRAPH=1. Set VLLM_USE_BREAKABLE_CUDAGRAPH=0 to opt out.",
    CONFIG_025.replace("v0.25.0", "v0.33.0").replace("<CompilationMode.VLLM_COMPILE: 3>",
                                                     "<CompilationMode.NONE: 0>"),
    "(EngineCore pid=9) INFO 12-02 04:10:40 [breakable_cudagraph.py:294] Breakable CUDA graph "
    "enabled"])


def test_modes_from_the_configuration_line_vllm_logs():
    assert engine_modes(CONFIG_025) == EngineModes("VLLM_COMPILE", "FULL_AND_PIECEWISE", False,
                                                   "engine log")
    breakable = engine_modes(LOG_033_BREAKABLE)
    assert breakable == EngineModes("NONE", "FULL_AND_PIECEWISE", True, "engine log")
    assert breakable.describe() == ("no torch.compile (NONE)", "FULL_AND_PIECEWISE, breakable")
    assert engine_modes("INFO nothing about the config") is None


def test_modes_of_committed_0_25_runs_come_from_their_kept_logs():
    modes = logged_modes(ROOT / "data" / "h200" / "h200-cost-qwen3-8b-latency-b8")
    assert sorted(modes) == ["batch-invariant", "bi-tuned-gemm", "default"]
    assert {m.describe() for starts in modes.values() for m in starts} == {
        ("torch.compile (VLLM_COMPILE)", "FULL_AND_PIECEWISE")}


def test_recorded_modes_win_over_the_logs_and_the_last_start_counts():
    recorded = {"default": {"compilation_mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE",
                            "breakable_cudagraph": False, "source": "engine config"},
                "batch-invariant": {"compilation_mode": "NONE",
                                    "cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "breakable_cudagraph": True, "source": "engine config"}}
    logged = {"default": [engine_modes(CONFIG_025)], "batch-invariant": [None]}
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, {}, _env(modes=recorded), [],
                                logged)
    assert [a.modes.describe() for a in rep.arms] == [
        ("torch.compile (VLLM_COMPILE)", "PIECEWISE"),
        ("no torch.compile (NONE)", "FULL_AND_PIECEWISE, breakable")]
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, {}, _env(), [], logged)
    assert [a.modes and a.modes.source for a in rep.arms] == ["engine log", None]



def test_the_engine_logs_breakable_graphs_complete_a_record_that_could_not_see_them():
    """vLLM 0.34 keeps the breakable-graph switch in its config, not in the environment variable
    the offline worker read (0.33): a record saying False beside a log saying "auto-enabling
    VLLM_USE_BREAKABLE_CUDAGRAPH=1" reads as breakable, and says where that came from; the
    recorded compilation and CUDA-graph modes stay. A log that says nothing changes nothing."""
    recorded = {"default": {"compilation_mode": "VLLM_COMPILE", "cudagraph_mode": "FULL_AND_PIECEWISE",
                            "breakable_cudagraph": False, "source": "engine config"},
                "batch-invariant": {"compilation_mode": "NONE",
                                    "cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "breakable_cudagraph": False, "source": "engine config"}}
    logged = {"default": [engine_modes(CONFIG_025)],
              "batch-invariant": [engine_modes(LOG_033_BREAKABLE)]}
    rep = engine_version_report("vllm-offline", {"arms": ARMS}, {}, _env(modes=recorded), [],
                                logged)
    assert [a.modes.describe() for a in rep.arms] == [
        ("torch.compile (VLLM_COMPILE)", "FULL_AND_PIECEWISE"),
        ("no torch.compile (NONE)", "FULL_AND_PIECEWISE, breakable")]
    assert [a.modes.source for a in rep.arms] == [
        "engine config", "engine config; breakable CUDA graphs from the engine log"]

class _Enum:
    def __init__(self, name):
        self.name = name


def test_the_offline_worker_reads_the_modes_from_the_engine_config(monkeypatch):
    cc = types.SimpleNamespace(mode=_Enum("NONE"), cudagraph_mode=_Enum("FULL_AND_PIECEWISE"))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(compilation_config=cc)))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")  # vLLM 0.33 sets it in this process
    assert worker._modes(llm) == {"compilation_mode": "NONE", "cudagraph_mode": "FULL_AND_PIECEWISE",
                                  "breakable_cudagraph": True, "source": "engine config"}
    cc.use_breakable_cudagraph = False  # vLLM 0.34's config field wins over the variable
    assert worker._modes(llm)["breakable_cudagraph"] is False
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    cc.use_breakable_cudagraph = True
    assert worker._modes(llm)["breakable_cudagraph"] is True
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    old = types.SimpleNamespace(level=3, cudagraph_mode=None)  # an older config: a level number
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    llm.llm_engine.vllm_config.compilation_config = old
    assert worker._modes(llm)["compilation_mode"] == "3"
    assert worker._modes(types.SimpleNamespace()) == {}


# -- where the checks are recorded ------------------------------------------------------------

def _write(path: Path, data: dict) -> Path:
    return h.write_toml(path, data)


def test_registration_seals_the_check_for_vllm_engines_only(tmp_path):
    decl = _declaration()
    decl["name"] = "vllmreg"
    calls = []

    def check(package):
        calls.append(package)
        return releases.ReleaseCheck(package, "0.33.0", "2026-12-02T04:00:00Z", PYPI)

    reg, _ = register(_write(tmp_path / "vllmreg.toml", decl), registrations_dir=tmp_path / "p",
                      base_dir=tmp_path, now=NOW, release_check=check)
    assert calls == ["vllm"]
    assert reg.sealed["engine_release"] == {"package": "vllm", "newest": "0.33.0",
                                            "checked_utc": "2026-12-02T04:00:00Z", "index": PYPI,
                                            "error": None}
    fake = h.declaration()
    fake["name"] = "fakereg"
    reg2, _ = register(_write(tmp_path / "fakereg.toml", fake), registrations_dir=tmp_path / "p",
                       base_dir=tmp_path, now=NOW, release_check=check)
    assert "engine_release" not in reg2.sealed and calls == ["vllm"]


def test_a_vllm_run_records_the_check_made_as_it_starts(tmp_path, monkeypatch):
    asked = []

    def check(package):
        asked.append(package)
        return releases.ReleaseCheck(package, None, "2026-12-02T04:00:01Z", PYPI,
                                     "the index could not be reached (ConnectError: offline)")

    monkeypatch.setattr(releases, "check_newest_release", check)
    exp = h.experiment(engine={"kind": "vllm-offline", "model": "m"})
    script = fakes.FakeScript()
    outcome = start_run(exp, {"name": "x"}, tmp_path / "run", engine_factory=script.factory,
                        command=["bistat", "run"])
    assert outcome.status == "complete" and asked == ["vllm"]
    events, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    (ev,) = [e for e in events if e["event"] == "release_check"]
    assert (ev["arm"], ev["detail"]) == ("*", "vllm: newest release unknown (the index could not "
                                               "be reached (ConnectError: offline))")
    assert ev["release_check"]["error"] == "the index could not be reached (ConnectError: offline)"


# -- the finding and doctor -------------------------------------------------------------------

def test_the_finding_states_the_gap_and_the_modes(monkeypatch):
    run = ROOT / "data" / "h200" / "h200-cost-qwen3-8b-latency-b8"
    monkeypatch.chdir(ROOT)
    s = analyze_run(run.relative_to(ROOT), Path("preregistrations/h200-cost-qwen3-8b-latency-b8.json"))
    md = render_markdown(s)
    assert ("| compilation | torch.compile (VLLM_COMPILE) | torch.compile (VLLM_COMPILE) | "
            "torch.compile (VLLM_COMPILE) |") in md
    assert "| engine commit | gdd10e03f9 | gdd10e03f9 | gdd10e03f9 |" in md
    assert ("## Engine version\n\nvllm 0.25.0 (gdd10e03f9): no check of the newest vllm release was "
            "recorded with this run or its registration, so how it compares with the newest "
            "release is unknown.\n\nThe registration requires no engine version.\n") in md
    sealed = {"engine_release": _check("0.33.0")}
    decl = dict(s.declaration, engine={**s.declaration["engine"], "required_version": "0.33.0"})
    env = [{"arm": a.arm, "engine": {"version": a.version, "commit": a.commit}}
           for a in s.engine_version.arms]
    rep = engine_version_report("vllm-offline", decl, sealed, env, [])
    md = render_markdown(dataclasses.replace(s, engine_version=rep,
                                             deviations=s.deviations + rep.deviations))
    assert ("vllm 0.25.0 (gdd10e03f9) is older than the newest release known, 0.33.0 "
            "(https://pypi.org/pypi, checked 2026-12-02T03:00:00Z at registration).") in md
    assert ("| registration | 0.33.0 | 2026-12-02T03:00:00Z | https://pypi.org/pypi | — |") in md
    assert ("Required version (`engine.required_version`): `0.33.0`; arms ran versions it "
            "excludes (see Deviations).") in md
    assert ("- arm default: the engine ran version 0.25.0, which the registration's required "
            "version (==0.33.0) excludes") in md


def test_doctor_says_the_installed_vllm_and_its_gap(tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "_version.py").write_text("__version__ = version = '0.25.0'\n"
                                     "__commit_id__ = commit_id = 'gdd10e03f9'\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr("bistat.explain.doctor.package_versions",
                        lambda: {"python": "3.12.3", "vllm": "0.25.0"})
    rep = doctor(find_spec=lambda m: spec if m == "vllm" else object(), which=lambda c: None,
                 gpus=list, release_check=lambda p: releases.check_newest_release(
                     p, index=PYPI, transport=_index(), now=NOW))
    assert rep.vllm_release == {"version": "0.25.0", "commit": "gdd10e03f9", "newest": "0.33.0",
                                "comparison": "older", "checked_utc": "2026-12-02T04:00:00Z",
                                "index": PYPI, "error": None}
    assert ("vllm 0.25.0 (gdd10e03f9): older than the newest release, 0.33.0 "
            "(https://pypi.org/pypi, checked 2026-12-02T04:00:00Z)\n") in render_doctor(rep)
    off = doctor(find_spec=lambda m: spec if m == "vllm" else object(), which=lambda c: None,
                 gpus=list)
    assert ("vllm 0.25.0 (gdd10e03f9): newest release unknown (not checked "
            "(BISTAT_PACKAGE_INDEX=off))\n") in render_doctor(off)
    json.dumps(rep.to_dict())

