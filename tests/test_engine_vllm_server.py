"""VLLMServerEngine against ``bistat serve`` standing in for ``vllm serve`` (same protocol and
metric names): start, version probe, log findings, refusal, never-healthy, clean stop."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
from fakes import failing_passes

from bistat.engines.base import (
    EngineError,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
)
from bistat.engines.vllm_server import (
    FORCED_ENV,
    VLLMServerEngine,
    _group_pids,
    cli_args,
    last_error_line,
)

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
    from helpers_serve import fake_app

    from bistat.engines.serve.server import BackgroundServer

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
        SimpleNamespace(engine=SimpleNamespace(model="m", args={"url": "http://h:1", "retries": 1}),
                        workload=SimpleNamespace(retries=2)),
        SimpleNamespace(name="a", env={}, args={}))
    assert (http.base_url, http.model, http.retries) == ("http://h:1", "m", 1)
    with pytest.raises(ValueError) as exc:
        OpenAIHTTPEngine.from_experiment(SimpleNamespace(engine=SimpleNamespace(model="m", args={}),
                                                         workload=SimpleNamespace(retries=2)),
                                         SimpleNamespace(name="a", env={}, args={"gemm": "blas"}))
    assert str(exc.value) == ("arms[a].args / engine.args: unknown key(s) ['gemm'] for engine "
                              "'openai'; expected some of ['api_key_env', 'backoff_s', "
                              "'max_retry_wait_s', 'metrics_interval_s', 'request_timeout_s', "
                              "'retries', 'url']")


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


# -- vllm serve --api-server-count 2 ------------------------------------------------------------
# With more than one API server, vLLM 0.25.0 sets PROMETHEUS_MULTIPROC_DIR (vllm/entrypoints/cli/
# serve.py:268-269, vllm/v1/metrics/prometheus.py:17-36) and every server's /metrics reads all
# servers' files through prometheus_client's MultiProcessCollector (vllm/entrypoints/serve/
# instrumentator/metrics.py:56-82). The gauges are "mostrecent" (vllm/v1/metrics/loggers.py:
# 456-470): no pid label, the latest value wins; the counters are summed over the servers. A gauge
# no server has set yet is left out (an idle engine before its first request).

MP_LABELS = 'engine="0",model_name="/tmp/model/smollm2"'
#: /metrics of `vllm serve --api-server-count 2` (vLLM's five metrics, verbatim shape).
MP_BUSY = f"""# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{MP_LABELS}}} 3.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{MP_LABELS}}} 1200.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{MP_LABELS}}} 1000.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{MP_LABELS}}} 57.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{MP_LABELS}}} 0.0
"""
MP_IDLE = f"""# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{MP_LABELS}}} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{MP_LABELS}}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{MP_LABELS}}} 0.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
"""

API_SERVER = '''
import sys
from prometheus_client import Counter, Gauge
L, V = ["model_name", "engine"], ("/tmp/model/smollm2", "0")
g = {n: Gauge(n, "doc", multiprocess_mode="mostrecent", labelnames=L).labels(*V)
     for n in ("vllm:num_requests_running", "vllm:num_requests_waiting")}
c = {n: Counter(n, "doc", labelnames=L).labels(*V)
     for n in ("vllm:num_preemptions", "vllm:generation_tokens", "vllm:prompt_tokens")}
if len(sys.argv) > 1:
    run, wait, pre, gen, prompt = map(float, sys.argv[1:])
    g["vllm:num_requests_running"].set(run); g["vllm:num_requests_waiting"].set(wait)
    c["vllm:num_preemptions"].inc(pre); c["vllm:generation_tokens"].inc(gen)
    c["vllm:prompt_tokens"].inc(prompt)
'''
COLLECT = ("from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
           "r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)\n"
           "print(generate_latest(r).decode(), end='')")


def test_metrics_of_two_api_servers_parse_as_one_engine():
    from bistat.engines.metrics import parse_vllm_metrics

    busy = parse_vllm_metrics(MP_BUSY, t=1.0, model_name="/tmp/model/smollm2")
    assert (busy.num_requests_running, busy.num_requests_waiting, busy.num_preemptions_total,
            busy.generation_tokens_total, busy.prompt_tokens_total) == (57.0, 0.0, 3.0, 1200.0, 1000.0)
    idle = parse_vllm_metrics(MP_IDLE, t=0.0, model_name="/tmp/model/smollm2")
    assert math.isnan(idle.num_requests_running) and math.isnan(idle.num_requests_waiting)
    assert (idle.num_preemptions_total, idle.generation_tokens_total) == (0.0, 0.0)


def test_multiprocess_exposition_is_what_prometheus_client_writes(tmp_path):
    """Two stand-in API-server processes declare vLLM's metrics as 0.25.0 does and record one
    step each; the collected /metrics text is MP_IDLE before and MP_BUSY after (the later
    server's gauges win, the counters add up), up to line order and HELP texts."""
    import subprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def py(*argv):
        return subprocess.run([sys.executable, "-c", *argv], env=env, check=True,
                              capture_output=True, text=True).stdout

    py(API_SERVER)
    py(API_SERVER)
    idle = py(COLLECT)
    py(API_SERVER, "40", "3", "1", "700", "900")
    py(API_SERVER, "57", "0", "2", "500", "100")
    busy = py(COLLECT)
    norm = lambda text: sorted(line for line in text.splitlines() if not line.startswith("# HELP"))
    assert norm(idle) == norm(MP_IDLE) and norm(busy) == norm(MP_BUSY)


def test_inherited_prometheus_multiproc_dir_is_not_passed_on(monkeypatch):
    from bistat.engines.vllm_offline import VLLMOfflineEngine

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/stale")
    assert "PROMETHEUS_MULTIPROC_DIR" not in VLLMServerEngine("/m").child_env()
    assert "PROMETHEUS_MULTIPROC_DIR" not in VLLMOfflineEngine("/m").child_env()
    arm = {"PROMETHEUS_MULTIPROC_DIR": "/tmp/mine"}
    assert VLLMServerEngine("/m", env=arm).child_env()["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/mine"


def test_api_server_count_flags():
    """`api_server_count = 2` and `disable_uvicorn_access_log = true` become the 0.25.0 flags
    --api-server-count (vllm/entrypoints/openai/cli_args.py:359-365) and
    --disable-uvicorn-access-log (cli_args.py:248, a BooleanOptionalAction via
    vllm/engine/arg_utils.py:345-347)."""
    eng = VLLMServerEngine("/m", args={"api_server_count": 2, "disable_uvicorn_access_log": True})
    assert eng.argv(9)[-3:] == ["--api-server-count", "2", "--disable-uvicorn-access-log"]


# -- a server that dies mid-pass ---------------------------------------------------------------

#: ``vllm serve`` stand-in whose engine dies like vLLM 0.25.0's on the H200: after DIE_AFTER
#: finished requests it logs the engine core's torch.OutOfMemoryError, then the API server's
#: EngineDeadError, and the process exits 1.
DYING_SERVER = """
import os, sys
from helpers_serve import ByteTokenizer, FakeEngine, VOCAB
from bistat.engines.serve.server import create_app, serve

class Dying(FakeEngine):
    def submit(self, req):
        fut = super().submit(req)
        def done(_):
            self.n = getattr(self, "n", 0) + 1
            if self.n == int(os.environ["DIE_AFTER"]):
                print("(EngineCore_DP0 pid=9) ERROR torch.OutOfMemoryError: CUDA out of memory. "
                      "Tried to allocate 544.00 MiB", flush=True)
                print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                      "issue. See stack trace (above) for the root cause.", flush=True)
                os._exit(1)
        fut.add_done_callback(done)
        return fut

tok = ByteTokenizer()
port = int(sys.argv[sys.argv.index("--port") + 1])
serve(create_app(Dying(tok, max_batch_size=2, step_s=0.01), tok, model_name="smol",
                 max_model_len=512, vocab_size=VOCAB), port=port)
"""

OOM_LINE = ("(EngineCore_DP0 pid=9) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 544.00 MiB")


def test_server_dying_mid_pass_is_an_engine_error_not_failed_requests(tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(DYING_SERVER)
    eng = VLLMServerEngine("smol", command=(sys.executable, str(script)), health_timeout_s=60,
                           log_path=tmp_path / "log", stop_grace_s=5,
                           env={"DIE_AFTER": "3", "PYTHONPATH": str(HELPER.parent)},
                           http={"retries": 1, "backoff_s": 0.05, "metrics_interval_s": 0.05})
    reqs = [GenerationRequest(prompt_id=str(i), prompt=[50, i], max_tokens=8) for i in range(8)]
    (exc, again), results, _ = failing_passes(eng, reqs, concurrency=2, times=2)
    assert str(exc) == (f"the vLLM server exited during the pass with code 1: {OOM_LINE} "
                        f"(log: {tmp_path / 'log'})")
    assert str(again).startswith("the vLLM server had exited before the pass with code 1: ")
    assert 1 <= len(results) <= 2 and all(r.error is None for r in results)  # never a failure


def test_a_per_request_500_on_a_live_server_is_a_failed_result(tmp_path):
    from helpers_serve import fake_app

    from bistat.engines.serve.server import BackgroundServer

    app, _ = fake_app(fail_prompt="boom")
    results = []
    with BackgroundServer(app) as srv:
        eng = VLLMServerEngine("ignored", url=srv.url, http={"retries": 1, "backoff_s": 0.01})
        eng.start()
        eng.run_pass([GenerationRequest(prompt_id="bad", prompt="boom", max_tokens=3),
                      GenerationRequest(prompt_id="ok", prompt=[1, 2], max_tokens=3)],
                     concurrency=2, on_result=results.append, on_metrics=lambda s: None)
        eng.stop()
    by_id = {r.prompt_id: r for r in results}
    assert by_id["ok"].error is None and len(by_id["ok"].token_ids) == 3
    assert by_id["bad"].error.startswith("after 2 attempt(s): HTTP 500: ")
    assert "injected engine failure" in by_id["bad"].error


def test_failed_requests_and_a_server_that_stops_answering_health_are_an_engine_error(tmp_path):
    """An attached server whose engine died but whose process lives (vLLM with
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) answers 500 everywhere, /health too."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from bistat.engines.openai_http import OpenAIHTTPEngine
    from bistat.engines.serve.server import BackgroundServer

    dead = Starlette(routes=[Route(path, lambda request: Response(status_code=500),
                                   methods=["GET", "POST"])
                             for path in ("/health", "/v1/completions", "/metrics")])
    with BackgroundServer(dead) as srv:
        eng = VLLMServerEngine("m", url=srv.url)
        # attached as start() would, which itself needs a working /v1/models
        eng.client = OpenAIHTTPEngine(srv.url, model="m", retries=0, metrics_interval_s=0)
        with pytest.raises(EngineError) as exc:
            eng.run_pass([GenerationRequest(prompt_id="a", prompt=[1], max_tokens=2)],
                         concurrency=1, on_result=lambda r: None, on_metrics=lambda s: None)
    assert str(exc.value) == (f"1 request(s) failed and the server at {srv.url} answers /health "
                              "with HTTP 500 (log: None)")


def test_last_error_line_prefers_the_root_cause():
    log = "\n".join(["INFO Using FLASH_ATTN attention backend.",
                     "Traceback (most recent call last):",
                     '  File "core.py", line 9, in step',
                     "    raise RuntimeError(msg)",
                     OOM_LINE,
                     "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."])
    assert last_error_line(log) == OOM_LINE
    assert last_error_line("x\nvllm.v1.engine.exceptions.EngineDeadError: gone") == (
        "vllm.v1.engine.exceptions.EngineDeadError: gone")
    assert last_error_line("INFO ok\nWARNING KV cache 90% full") is None
    assert last_error_line("KeyError: " + "k" * 500).endswith("k...")
