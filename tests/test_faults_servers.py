"""No server outlives its run: ``kill -9`` of the process that started the servers, for every
server engine kind that runs here -- ``command-server`` with ``bistat serve``, ``vllm-server``
against its stand-in (tests/helpers_serve.py, which also starts a child in its process group),
``sglang-server`` against its stand-in (tests/sglang_standin.py) -- leaves no process of any
server's group behind within a few seconds (each server's watchdog stops it). With the
watchdogs killed as well, the servers' PIDs recorded in the run directory let ``bistat run
--resume`` stop them, and the mark in their environment lets ``bistat doctor`` find and stop
them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import faults_support as s
from bistat.engines.lifetime import SERVER_MARK, group_pids

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> str:
    """A tiny random LLaMA with a byte-level tokenizer (what the stand-ins and ``bistat serve``
    load)."""
    from bistat.model.loader import save_model
    from bistat.model.testing import tiny_random_model

    folder = tmp_path_factory.mktemp("model") / "tiny"
    save_model(tiny_random_model(0, tokenizer="byte"), folder)
    return str(folder)


def _kill_group(pgid: int) -> None:
    """Clean up after a failed test: the servers this test started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _started(driver: subprocess.Popen, report: Path) -> dict:
    """Once the driver says "ready": the one process it reported started, checked as recorded
    (its own group, its identity, command line, watchdog and stop signal)."""
    line = driver.stdout.readline()
    assert line == "ready\n", line + driver.stdout.read()
    (started,) = s.read_jsonl(report)
    assert started["state"] == "started" and started["pid"] == started["pgid"]
    assert {"start_ticks", "boot_id", "argv", "watchdog_pid", "stop_signal"} <= set(started)
    return started


@pytest.mark.parametrize("kind", ["command-server", "vllm-server", "sglang-server"])
def test_kill_9_of_the_process_that_started_a_server_stops_the_server(byte_model, tmp_path,
                                                                      kind):
    spec = {**s.server_spec(kind, byte_model, tmp_path, TESTS, ROOT / "src"),
            "report": str(tmp_path / "processes.jsonl")}
    driver = subprocess.Popen([sys.executable, "-c", s.SERVER_DRIVER, json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=s.env(PYTHONPATH=str(ROOT / "src")))
    try:
        started = _started(driver, tmp_path / "processes.jsonl")
        pgid = started["pgid"]
        members = group_pids(pgid)
        if kind == "vllm-server":   # the stand-in's child shares the group
            assert len(members) == 2, members
        environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
        assert f"{SERVER_MARK}={driver.pid}:".encode() in b"\0".join(environ)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert s.gone_within([pgid], 15), f"{kind}: {group_pids(pgid)} still up after 15 s"
        assert s.gone_within([started["watchdog_pid"]], 5)   # the watchdog ends with it
    finally:
        driver.kill()
        for rec in s.read_jsonl(tmp_path / "processes.jsonl"):
            _kill_group(rec["pgid"])


def _declare_command_server(root: Path, model: str, name: str) -> None:
    text = s.declaration(name, model, kind="command-server",
                         engine_args=f"command = {json.dumps(s.SERVE)}, stop_grace_s = 5",
                         blas_args='gemm = "blas"', invariant_args='gemm = "invariant"',
                         passes=4, max_tokens=24, concurrency=1)
    s.write_declaration(root, name, text)
    rc, out = s.bistat("register", f"experiments/{name}.toml", cwd=root)
    assert rc == 0, out


def test_kill_9_of_bistat_run_leaves_no_server_and_resume_and_doctor_stop_leftovers(
        tiny_model, tmp_path):
    """``bistat run`` of a command-server study killed with SIGKILL mid-pass: its two servers
    (both arms up together), recorded in events.jsonl as they started, are gone within seconds
    and the resume completes. Then twice with the servers' watchdogs killed first, so the
    servers outlive the run, re-parented to PID 1: ``bistat doctor --leave-servers`` lists them,
    ``bistat run --resume`` stops them (and records it) before starting its own; in the second,
    ``bistat doctor`` stops them."""
    root = tmp_path
    _declare_command_server(root, tiny_model, "srv")
    run = s.run_until(root, "srv", "killed", 12)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=10)
    servers = s.recorded_servers(root / "runs" / "killed")
    assert [p["argv"][p["argv"].index("--gemm") + 1] for p in servers] == ["blas", "invariant"]
    try:
        assert s.gone_within([p["pgid"] for p in servers], 15)
        rc, out = s.bistat("run", "--resume", "runs/killed", "--no-progress", cwd=root)
        assert rc == 0, out
        assert "left running" not in out       # the watchdogs had stopped them
    finally:
        for p in servers:
            _kill_group(p["pgid"])

    for run_name in ("resumed", "doctored"):
        run = s.run_until(root, "srv", run_name, 12)
        run_dir = root / "runs" / run_name
        servers = s.recorded_servers(run_dir)
        try:
            for p in servers:
                os.kill(p["watchdog_pid"], signal.SIGKILL)
            run.send_signal(signal.SIGKILL)
            run.wait(timeout=10)
            time.sleep(1)
            assert all(group_pids(p["pgid"]) for p in servers)   # outlived the run
            done = subprocess.run([sys.executable, "-m", "bistat", "doctor", "--json",
                                   "--leave-servers"], capture_output=True, text=True,
                                  env=s.env(), timeout=120)
            listed = {d["pid"]: d for d in json.loads(done.stdout)["leftover_servers"]}
            assert {p["pid"] for p in servers} <= set(listed)
            assert all(listed[p["pid"]]["stopped"] is False
                       and listed[p["pid"]]["owner"].startswith(f"{run.pid}:") for p in servers)
            if run_name == "resumed":
                rc, out = s.bistat("run", "--resume", f"runs/{run_name}", "--no-progress",
                                   cwd=root)
                assert rc == 0, out
                for arm, p in zip(("blas", "invariant"), servers):
                    assert (f"stopped the {arm} server an earlier process of this run left "
                            f"running (pid {p['pid']}, process group {p['pgid']})") in out
                stopped = [r for r in s.read_jsonl(run_dir / "events.jsonl")
                           if r["event"] == "server" and "stopped by the resume" in r["detail"]]
                assert [r["process"]["pid"] for r in stopped] == [p["pid"] for p in servers]
            else:
                rc, out = s.bistat("doctor", cwd=root)
                assert rc == 0, out
                for p in servers:
                    assert f"  stopped: pid {p['pid']} (process group {p['pgid']}), started by " \
                           f"bistat process {run.pid}: " in out
            assert s.gone_within([p["pgid"] for p in servers], 15)
        finally:
            for p in servers:
                _kill_group(p["pgid"])


def test_kill_9_of_bistat_run_stops_the_sglang_stand_in_servers(byte_model, tmp_path):
    """The same kill of a run of the ``sglang-server`` kind against its stand-in: no server
    left once the run is gone."""
    from test_engine_sglang import DECLARATION

    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "sgl.toml").write_text(DECLARATION.format(
        name="sgl", model=byte_model, command=json.dumps([sys.executable,
                                                          str(TESTS / "sglang_standin.py")]),
        treatment_env=""))
    assert s.bistat("register", "experiments/sgl.toml", cwd=tmp_path)[0] == 0
    run = s.run_until(tmp_path, "sgl", "sgl", 10, STANDIN_STEP_S="0.02")
    servers = s.recorded_servers(tmp_path / "runs" / "sgl")
    try:
        assert servers and all(group_pids(p["pgid"]) for p in servers)   # one arm's, or both
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        assert s.gone_within([p["pgid"] for p in servers], 15)
    finally:
        for p in servers:
            _kill_group(p["pgid"])


#: Runs as a process of its own: start a ``vllm-offline`` worker against the stand-in vLLM
#: (tests/fakes.py) whose first engine step hangs, start a pass, print "ready", wait to be killed.
OFFLINE_DRIVER = """
import json, sys, threading, time
from bistat.engines.base import GenerationRequest
from bistat.engines.vllm_offline import VLLMOfflineEngine
spec = json.loads(sys.argv[1])
engine = VLLMOfflineEngine("smol", args={"max_num_seqs": 4}, log_path=spec["log"],
                           env={"PYTHONPATH": spec["site"], "FAKE_HANG_AT_STEP": "1"},
                           start_timeout_s=60, pass_idle_timeout_s=600, stop_grace_s=5)
with open(spec["report"], "a") as out:
    engine.report_processes(lambda p: (out.write(json.dumps(dict(p)) + "\\n"), out.flush()))
    engine.start()
    threading.Thread(target=engine.run_pass, daemon=True, kwargs=dict(
        requests=[GenerationRequest(prompt_id="p", prompt=[1, 2], max_tokens=4)], concurrency=1,
        on_result=lambda r: None, on_metrics=lambda m: None)).start()
    time.sleep(1)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_kill_9_mid_pass_of_the_process_that_started_a_vllm_offline_worker_stops_it(tmp_path):
    """The offline engine's worker holds the GPU as a server does. Killed with SIGKILL while its
    worker is inside a pass (an engine step that does not return), the driving process leaves
    the worker computing, re-parented and with its stdin still open to no one: the worker's
    watchdog, recorded with it, stops its group within seconds."""
    from fakes import fake_vllm_site

    spec = {"site": fake_vllm_site(tmp_path), "log": str(tmp_path / "worker.log"),
            "report": str(tmp_path / "processes.jsonl")}
    driver = subprocess.Popen([sys.executable, "-c", OFFLINE_DRIVER, json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=s.env(PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                    str(TESTS)])))
    try:
        started = _started(driver, tmp_path / "processes.jsonl")
        pgid = started["pgid"]
        assert started["argv"][1:] == ["-m", "bistat.engines.vllm_offline_worker"]
        environ = Path(f"/proc/{pgid}/environ").read_bytes()
        assert f"{SERVER_MARK}={driver.pid}:".encode() in environ
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert s.gone_within([pgid], 15), f"{group_pids(pgid)} still up after 15 s"
        assert s.gone_within([started["watchdog_pid"]], 5)
    finally:
        driver.kill()
        for rec in s.read_jsonl(tmp_path / "processes.jsonl"):
            _kill_group(rec["pgid"])
