"""VLLMServerEngine against ``bistat serve`` standing in for ``vllm serve`` (same protocol and
metric names): start, version probe, log findings, refusal, never-healthy, clean stop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bistat.engines.base import EngineRefused, EngineStartError, GenerationRequest
from bistat.engines.vllm_server import FORCED_ENV, VLLMServerEngine, _group_pids, cli_args

HELPER = Path(__file__).with_name("helpers_serve.py")
COMMAND = (sys.executable, str(HELPER), "serve")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is as good as gone
        return fh.read().split(") ")[1][0] != "Z"


def _fake_vllm_package(tmp_path: Path) -> str:
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.25.0"\n__commit__ = "abc123"\n')
    return str(tmp_path / "site")


def test_cli_args_and_argv():
    assert cli_args({"max_num_seqs": 256, "enforce_eager": True, "trust_remote_code": False,
                     "compilation_config": {"level": 0}, "seed": None}) == [
        "--max-num-seqs", "256", "--enforce-eager", "--no-trust-remote-code",
        "--compilation-config", '{"level": 0}']
    eng = VLLMServerEngine("/m", args={"max_num_seqs": 8}, tensor_parallel_size=2)
    assert eng.argv(1234) == ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "1234",
                              "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
                              "--max-num-seqs", "8"]
    assert VLLMServerEngine("/m", enable_prefix_caching=True).argv(1)[7] == "--enable-prefix-caching"
    env = VLLMServerEngine("/m", env={"NCCL_NVLS_ENABLE": "1", "VLLM_BATCH_INVARIANT": "1"}).child_env()
    assert {k: env[k] for k in FORCED_ENV} == FORCED_ENV  # multicast stays off whatever the arm says
    assert env["VLLM_BATCH_INVARIANT"] == "1"


def test_start_run_and_stop_leave_no_process(tmp_path):
    pidfile = tmp_path / "pid"
    eng = VLLMServerEngine(
        "smol", command=COMMAND, health_timeout_s=60, log_path=tmp_path / "server.log",
        env={"VLLM_BATCH_INVARIANT": "1", "FAKE_VLLM_PIDFILE": str(pidfile), "FAKE_VLLM_CHILD": "1",
             "PYTHONPATH": _fake_vllm_package(tmp_path) + os.pathsep + str(HELPER.parent)},
        http={"retries": 0, "metrics_interval_s": 0.05})
    try:
        info = eng.start()
        assert (info.kind, info.version, info.commit) == ("vllm-server", "0.25.0", "abc123")
        assert info.env["VLLM_BATCH_INVARIANT"] == "1"
        assert info.env["NCCL_NVLS_ENABLE"] == "0"
        assert info.log_findings == (
            "INFO env VLLM_BATCH_INVARIANT=1",
            "INFO Batch invariant mode enabled: overriding matmul kernels",
            "INFO Using FLASH_ATTN attention backend.")
        assert "'--no-enable-prefix-caching'" in (tmp_path / "server.log").read_text()
        results, samples = [], []
        reqs = [GenerationRequest(prompt_id=str(i), prompt=[50, i], max_tokens=20) for i in range(6)]
        eng.run_pass(reqs, concurrency=6, on_result=results.append, on_metrics=samples.append)
        assert sorted(r.prompt_id for r in results) == [str(i) for i in range(6)]
        assert all(r.error is None and len(r.token_ids) == 20 for r in results)
        assert samples and samples[-1].generation_tokens_total == 120
        pid = int(pidfile.read_text())
        child = int(Path(str(pidfile) + ".child").read_text())
        assert _group_pids(pid) and _pid_alive(child)
    finally:
        eng.stop()
    assert not _pid_alive(pid) and not _pid_alive(child)
    assert _group_pids(pid) == []
    assert eng.fingerprint()["version"] == "0.25.0"


def test_refused_setting_is_classified_as_refused(tmp_path):
    eng = VLLMServerEngine("smol", command=COMMAND, env={"FAKE_VLLM_REFUSE": "1"},
                           log_path=tmp_path / "log", health_timeout_s=60)
    with pytest.raises(EngineRefused) as exc:
        eng.start()
    assert str(exc.value) == (
        "the server refused the setting (exit code 1): ERROR ValueError: VLLM_BATCH_INVARIANT is "
        f"not supported on this platform (log: {tmp_path / 'log'})")


def test_server_that_never_becomes_healthy_is_a_start_failure_and_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    eng = VLLMServerEngine("smol", command=COMMAND, health_timeout_s=1.5, stop_grace_s=1,
                           env={"FAKE_VLLM_HANG": "1", "FAKE_VLLM_PIDFILE": str(pidfile)},
                           log_path=tmp_path / "log")
    with pytest.raises(EngineStartError) as exc:
        eng.start()
    assert str(exc.value).startswith("the server at http://127.0.0.1:")
    assert str(exc.value).endswith(f"did not become healthy within 1.5 s (log: {tmp_path / 'log'}); "
                                   "raise health_timeout_s or read the log")
    assert not _pid_alive(int(pidfile.read_text()))


def test_missing_command_is_a_start_failure_with_the_fix(tmp_path):
    eng = VLLMServerEngine("smol", command=(str(tmp_path / "no-vllm"), "serve"),
                           log_path=tmp_path / "log")
    with pytest.raises(EngineStartError) as exc:
        eng.start()
    assert str(exc.value).startswith(f"cannot run '{tmp_path / 'no-vllm'}': [Errno 2]")
    assert str(exc.value).endswith("install vLLM (pip install 'bistat[vllm]') or set the engine's command")


def test_attach_to_url(tmp_path):
    from bistat.server import BackgroundServer
    from helpers_serve import fake_app

    app, _ = fake_app()
    with BackgroundServer(app) as srv:
        eng = VLLMServerEngine("ignored", url=srv.url)
        info = eng.start()
        results = []
        eng.run_pass([GenerationRequest(prompt_id="a", prompt=[1, 2], max_tokens=3)],
                     concurrency=1, on_result=results.append, on_metrics=lambda s: None)
        eng.stop()
    assert (info.kind, info.version) == ("vllm-server", "0.1.0")
    assert results[0].error is None and len(results[0].token_ids) == 3


def test_from_experiment_splits_adapter_keys_from_server_flags():
    from types import SimpleNamespace

    from bistat.engines.openai_http import OpenAIHTTPEngine
    from bistat.engines.vllm_offline import VLLMOfflineEngine

    exp = SimpleNamespace(engine=SimpleNamespace(model="/m", args={
        "max_num_seqs": 64, "retries": 5, "health_timeout_s": 30, "tensor_parallel_size": 2}))
    arm = SimpleNamespace(name="bi", env={"VLLM_BATCH_INVARIANT": "1"}, args={"max_num_seqs": 32})
    eng = VLLMServerEngine.from_experiment(exp, arm)
    assert (eng.args, eng.http_kwargs, eng.health_timeout_s) == ({"max_num_seqs": 32}, {"retries": 5, "metrics_interval_s": 0.25}, 30)
    assert eng.argv(9)[-4:] == ["--tensor-parallel-size", "2", "--max-num-seqs", "32"]
    assert eng.arm_env == {"VLLM_BATCH_INVARIANT": "1"}
    off = VLLMOfflineEngine.from_experiment(exp, arm)
    assert off.engine_args == {"enable_prefix_caching": False, "disable_log_stats": False,
                               "max_num_seqs": 32, "retries": 5, "health_timeout_s": 30,
                               "tensor_parallel_size": 2}
    http = OpenAIHTTPEngine.from_experiment(
        SimpleNamespace(engine=SimpleNamespace(model="m", args={"url": "http://h:1", "retries": 1})),
        SimpleNamespace(name="a", env={}, args={}))
    assert (http.base_url, http.model, http.retries) == ("http://h:1", "m", 1)
    with pytest.raises(ValueError) as exc:
        OpenAIHTTPEngine.from_experiment(SimpleNamespace(engine=SimpleNamespace(model="m", args={})),
                                         SimpleNamespace(name="a", env={}, args={"gemm": "blas"}))
    assert str(exc.value) == ("arms[a].args / engine.args: unknown key(s) ['gemm'] for engine "
                              "'openai'; expected some of ['api_key_env', 'backoff_s', "
                              "'metrics_interval_s', 'request_timeout_s', 'retries', 'url']")


def test_version_probe_reads_the_commit_of_vcs_versioning_builds(tmp_path):
    """vLLM 0.25.0 keeps its commit in vllm/_version.py (__commit_id__ = 'gdd10e03f9'), not in
    vllm.__commit__; the probe reads it there first."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.25.0"\n')
    (pkg / "_version.py").write_text('__version__ = "0.25.0"\n__commit_id__ = "gdd10e03f9"\n')
    eng = VLLMServerEngine("/m", python=sys.executable, env={"PYTHONPATH": str(tmp_path / "site")})
    assert eng.probe_version() == ("0.25.0", "gdd10e03f9", None)
    (pkg / "_version.py").unlink()
    (pkg / "__init__.py").write_text('__version__ = "0.24.0"\n__commit__ = "abc123"\n')
    assert eng.probe_version() == ("0.24.0", "abc123", None)
