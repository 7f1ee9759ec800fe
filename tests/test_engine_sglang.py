"""The ``sglang-server`` adapter against a stand-in server process (tests/sglang_standin.py: NOT
SGLang, a process tree behaving as SGLang 0.5.23's server does where the adapter meets it,
generating with bistat's embedded engine): start, versions, what the server reports, token ids
and logprobs exactly, metrics (the retraction counter absent until a retraction, gauges refreshed
as SGLang refreshes them), the request schema, stop; the faults (never ready, a crash at start
after a warning, dies mid-pass, malformed JSON, a refused setting, a slow health check); the
argument names recorded from the wheel; one server started at a time; and a run end to end
through the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from external import SGLANG_SITE_VAR, named_folder
from fakes import failing_passes

from bistat.engines.base import (
    EngineError,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)
from bistat.engines.metrics import parse_sglang_metrics
from bistat.engines.server_process import FORCED_ENV, group_pids
from bistat.engines.sglang_server import (
    SERVER_INFO_KEYS,
    SGLangHTTPClient,
    SGLangServerEngine,
    answer_retractions,
    parse_generate_answer,
    sglang_cli_args,
)

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).with_name("sglang_standin.py")
COMMAND = (sys.executable, str(STANDIN))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """A tiny random LLaMA (2 layers, byte-level tokenizer with a chat template) on disk."""
    from bistat.model.loader import save_model
    from bistat.model.testing import tiny_random_model

    folder = tmp_path_factory.mktemp("model") / "tiny"
    save_model(tiny_random_model(0, tokenizer="byte"), folder)
    return str(folder)


def _fake_sglang_site(tmp_path: Path) -> str:
    """A site with SGLang's version file and the four distributions' metadata (no code)."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("raise ImportError('the probe must not import me')\n")
    (site / "sglang" / "_version.py").write_text("__version__ = '0.5.23'\n"
                                                 "__commit_id__ = commit_id = 'g1234abc'\n")
    for name, version in (("sglang", "0.5.23"), ("sglang_kernel", "0.4.10"),
                          ("flashinfer_python", "0.7.2")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
                                       f"Version: {version}\n")
    return str(site)


def _engine(model: str, tmp_path: Path, *, env=None, args=None, **kw) -> SGLangServerEngine:
    return SGLangServerEngine(model, command=COMMAND, args=args, env=env, health_timeout_s=90,
                              stop_grace_s=5, log_path=tmp_path / "server.log",
                              http={"retries": 0, "metrics_interval_s": 0.05, **kw})


def _pass(eng, requests, concurrency):
    results, samples = [], []
    eng.run_pass(requests, concurrency=concurrency, on_result=results.append,
                 on_metrics=samples.append)
    return {r.prompt_id: r for r in results}, samples


# -- pieces ---------------------------------------------------------------------------------------

def test_command_line_flags_and_environment():
    eng = SGLangServerEngine("/tmp/model/smollm2", args={
        "attention_backend": "fa3", "enable_deterministic_inference": True, "tp_size": 1,
        "enable_torch_compile": False, "cuda_graph_bs": [1, 8]},
        env={"NCCL_NVLS_ENABLE": "1", "SGLANG_X": "1"})
    assert eng.argv(1234) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/tmp/model/smollm2",
        "--host", "127.0.0.1", "--port", "1234", "--enable-metrics", "--disable-radix-cache",
        "--attention-backend", "fa3", "--enable-deterministic-inference", "--tp-size", "1",
        "--cuda-graph-bs", "1", "8"]
    assert "--disable-radix-cache" not in SGLangServerEngine("/m", enable_prefix_caching=True).argv(1)
    env = eng.child_env()
    assert {k: env[k] for k in FORCED_ENV} == FORCED_ENV and env["SGLANG_X"] == "1"
    assert sglang_cli_args({"json_model_override_args": {"a": 1}, "x": None}) == [
        "--json-model-override-args", '{"a": 1}']


def test_from_experiment_splits_adapter_keys_from_server_flags():
    exp = SimpleNamespace(
        engine=SimpleNamespace(model="/m", args={"mem_fraction_static": 0.4, "retries": 4,
                                                 "health_timeout_s": 30, "python": "/py"}),
        workload=SimpleNamespace(retries=2, request_timeout_s=600.0))
    arm = SimpleNamespace(name="det", env={"A": "1"},
                          args={"enable_deterministic_inference": True, "enable_prefix_caching": True})
    eng = SGLangServerEngine.from_experiment(exp, arm)
    assert eng.args == {"mem_fraction_static": 0.4, "enable_deterministic_inference": True}
    assert (eng.health_timeout_s, eng.python, eng.enable_prefix_caching) == (30, "/py", True)
    assert eng.command == ["/py", "-m", "sglang.launch_server"]
    assert eng.http_kwargs == {"metrics_interval_s": 0.25, "retries": 4, "request_timeout_s": 600.0}
    assert eng.arm_env == {"A": "1"}


def test_generate_answers_that_do_not_carry_ids_and_logprobs_exactly_are_malformed():
    good = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "prompt_tokens": 3, "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-0.125, 5, None], [-2.5, 6, "b"]]}}
    assert parse_generate_answer(good) == ([5, 6], "ab", [-0.125, -2.5], None, "length", 3)
    assert answer_retractions(good) is None
    assert answer_retractions({"meta_info": {"num_retractions": 0}}) == 0
    # what the adapter hands the runner: the answer's fields by name, retractions as preemptions
    client = SGLangHTTPClient("http://127.0.0.1:1", model="m")
    req = GenerationRequest(prompt_id="p", prompt=[1, 2, 3], max_tokens=2)
    counted = json.loads(json.dumps(good))
    counted["meta_info"]["num_retractions"] = 2
    answer = client.parse_answer(counted, req)
    assert (answer.token_ids, answer.finish_reason, answer.n_prompt_tokens, answer.preemptions) == (
        [5, 6], "length", 3, 2)
    assert client.parse_answer(good, req).preemptions is None
    assert set(answer._fields) <= {f.name for f in dataclasses.fields(GenerationResult)}
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="num_retractions is .*, not a count"):
            answer_retractions({"meta_info": {"num_retractions": bad}})
    swapped = json.loads(json.dumps(good))
    swapped["meta_info"]["output_token_logprobs"][1][1] = 7
    with pytest.raises(ValueError, match="disagree with the 2 output_ids"):
        parse_generate_answer(swapped)
    short = json.loads(json.dumps(good))
    short["meta_info"]["output_top_logprobs"] = [[[-0.125, 5, None]]]
    with pytest.raises(ValueError, match="1 output_top_logprobs rows for 2 tokens"):
        parse_generate_answer(short)
    aborted = {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "input too long", "status_code": 400}}}
    with pytest.raises(ValueError, match="the server aborted the request: input too long"):
        parse_generate_answer(aborted)


def test_sglang_metric_names_feed_the_batching_fields():
    labels = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    text = (f'sglang:num_running_reqs{{{labels}}} 57.0\n'
            f'sglang:num_running_reqs{{{labels},priority="3"}} 9.0\n'
            f'sglang:num_queue_reqs{{{labels}}} 4.0\n'
            f'sglang:num_retracted_requests_total{{{labels}}} 2.0\n'
            f'sglang:generation_tokens_total{{{labels},is_streaming="false"}} 1200.0\n'
            f'sglang:prompt_tokens_total{{{labels},is_streaming="false"}} 900.0\n'
            f'sglang:prompt_tokens_total{{model_name="other"}} 5.0\n')
    s = parse_sglang_metrics(text, t=1.5, model_name="m")
    assert (s.t, s.num_requests_running, s.num_requests_waiting, s.num_preemptions_total,
            s.generation_tokens_total, s.prompt_tokens_total) == (1.5, 57.0, 4.0, 2.0, 1200.0, 900.0)


def test_no_retraction_yet_reads_zero_retractions_and_the_first_one_is_counted():
    """SGLang's retraction counter is labelled: absent (its family too, in its multiprocess
    registry) until the first retraction. While the scheduler's gauges are there it reads 0, so
    a pass whose first retraction starts the series at 3 shows 3 retractions, not 3 - 3 = 0."""
    from bistat.run.batching import batching_summary

    labels = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    gauges = f'sglang:num_running_reqs{{{labels}}} 8.0\nsglang:num_queue_reqs{{{labels}}} 0.0\n'
    before = parse_sglang_metrics(gauges, t=0.0, model_name="m")
    after = parse_sglang_metrics(gauges + f'sglang:num_retracted_requests_total{{{labels}}} 3.0\n',
                                 t=1.0, model_name="m")
    assert (before.num_preemptions_total, after.num_preemptions_total) == (0.0, 3.0)
    assert batching_summary([before, after], wall_s=2.0)["preemptions"] == 3.0
    # no scheduler gauge in the answer (another model's, or none yet): nothing is known
    other = parse_sglang_metrics(gauges, t=0.0, model_name="other")
    assert math.isnan(other.num_requests_running) and math.isnan(other.num_preemptions_total)


# -- against the stand-in -------------------------------------------------------------------------

def test_start_reports_versions_backend_and_deterministic_flag_then_stops_cleanly(
        model_folder, tmp_path):
    pidfile = tmp_path / "pid"
    env = {"PYTHONPATH": os.pathsep.join([_fake_sglang_site(tmp_path), str(ROOT / "src")]),
           "STANDIN_PIDFILE": str(pidfile)}
    eng = _engine(model_folder, tmp_path, env=env,
                  args={"enable_deterministic_inference": True, "attention_backend": "triton"})
    try:
        info = eng.start()
        assert (info.kind, info.version, info.commit) == ("sglang-server", "0.5.23", "g1234abc")
        assert info.args["versions"] == {"sglang": "0.5.23", "sglang-kernel": "0.4.10",
                                         "flashinfer-python": "0.7.2",
                                         "torch": _installed("torch")}
        reported = info.args["server_reported"]
        assert (reported["attention_backend"], reported["enable_deterministic_inference"],
                reported["sampling_backend"], reported["disable_radix_cache"]) == (
            "triton", True, "pytorch", True)
        assert reported == {**dict.fromkeys(SERVER_INFO_KEYS), **reported}  # all 14 reported
        assert None not in [reported[k] for k in SERVER_INFO_KEYS
                            if not k.endswith("_attention_backend")]
        # as SGLang logs them: the sampler's switch, then the resolved server_args
        sampling, server_args = info.log_findings[-2:]
        assert sampling.endswith("] Sampling backend is set to pytorch for deterministic "
                                 "inference.")
        assert "] server_args={'model_path': " in server_args
        assert info.env["NCCL_NVLS_ENABLE"] == "0"
        # torch.compile and the CUDA graphs, from the server_args line SGLang logs at start
        assert info.modes == {"compilation_mode": "no torch.compile (SGLang)",
                              "cudagraph_mode": "decode full (≤ 8 requests), prefill breakable "
                                                "(≤ 8192 tokens)",
                              "breakable_cudagraph": None, "source": "engine log"}
        fp = eng.fingerprint()
        assert "gpus" not in fp  # the runner adds the machine's (GPU UUIDs, driver)
        assert fp["server"] == reported and fp["versions"] == info.args["versions"]
        assert eng.reset_prefix_cache() is True
        pid = int(pidfile.read_text())
        # SGLang's process tree: the HTTP process, its scheduler and detokenizer (spawned, and
        # the multiprocessing resource tracker that spawning starts), one process group
        tree = group_pids(pid)
        names = sorted(_cmdline(p) for p in tree if p != pid)
        assert pid in tree and sum("spawn_main" in n for n in names) == 2, names
    finally:
        eng.stop()
    assert group_pids(pid) == []
    log = (tmp_path / "server.log").read_text()
    assert "--enable-metrics" in log
    # SIGTERM killed the scheduler and the detokenizer; the watchdog then killed the tree
    assert re.search(r"Subprocess (scheduler|detokenizer) \(pid=\d+\) crashed with exit code "
                     r"-15\.", log)
    assert "SIGQUIT received" in log


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _installed(name):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_token_ids_logprobs_and_batching_come_back_exactly(model_folder, tmp_path):
    """Token-id, text and chat prompts through /generate: the ids and logprobs are the embedded
    engine's, bit for bit (the deterministic arm's batch-invariant GEMM makes them independent
    of the batch, so a lone run is the reference); the chat prompt went through /tokenize."""
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model

    eng = _engine(model_folder, tmp_path, args={"enable_deterministic_inference": True},
                  metrics_interval_s=0.01)
    reqs = [GenerationRequest(prompt_id=f"ids{i}", prompt=[40 + i, 50, 60], max_tokens=96,
                              logprobs=2, ignore_eos=True) for i in range(6)]
    reqs += [GenerationRequest(prompt_id="text", prompt="hello world", max_tokens=6, logprobs=2),
             GenerationRequest(prompt_id="chat", prompt="hello world", max_tokens=6, logprobs=2,
                               chat=True)]
    try:
        eng.start()
        before = _scrape(eng)
        got, samples = _pass(eng, reqs, concurrency=8)
        again, _ = _pass(eng, reqs, concurrency=1)
    finally:
        eng.stop()
    ref_engine = EmbeddedEngine(load_model(model_folder), gemm="invariant", max_batch_size=1)
    refs = {r.prompt_id: r for r in ref_engine.generate(reqs)}
    # SGLang's warm-up request (8 tokens at most) is in its token counters before any pass; its
    # health checks (one token each, at least one before the server was ready) are not
    (warmup,) = ref_engine.generate([GenerationRequest(
        prompt_id="warmup", prompt="The capital city of France is", max_tokens=8)])
    assert before.generation_tokens_total == len(warmup.token_ids)
    assert before.num_preemptions_total == 0.0   # no retraction: the counter is absent
    for pid, ref in refs.items():
        r = got[pid]
        assert r.error is None, r.error
        assert (r.token_ids, r.logprobs, r.n_prompt_tokens) == (
            ref.token_ids, ref.logprobs, ref.n_prompt_tokens), pid
        assert r.top_logprobs == [sorted(row, key=lambda p: -p[1]) for row in ref.top_logprobs]
        assert (again[pid].token_ids, again[pid].logprobs) == (r.token_ids, r.logprobs)
    assert got["chat"].n_prompt_tokens > got["text"].n_prompt_tokens  # the template was applied
    assert samples and max(s.num_requests_running for s in samples) >= 1
    assert samples[-1].generation_tokens_total == (before.generation_tokens_total
                                                   + sum(len(r.token_ids) for r in got.values()))
    assert {s.num_preemptions_total for s in samples} == {0.0}


def _scrape(eng) -> MetricsSample:
    import httpx

    text = httpx.get(eng.client.base_url + "/metrics", timeout=10).text
    return parse_sglang_metrics(text, t=0.0, model_name=eng.client.model)


def test_bodies_pass_sglangs_schema_null_rows_read_empty_and_gauges_lag(model_folder, tmp_path):
    """SGLang's ``/generate`` refuses unknown sampling keys and non-integer integer fields (400);
    the adapter's bodies pass whatever number types a request carries. A ``null`` top-logprob
    row reads as no alternatives. ``/flush_cache`` is refused while a request runs. The running
    gauge is refreshed at prefill and when idle only (``--decode-log-interval`` 1000 here): after
    the short request leaves, it still reads both requests until the long one ends."""
    import threading

    import httpx

    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model

    eng = _engine(model_folder, tmp_path, args={"enable_deterministic_inference": True,
                                                "decode_log_interval": 1000},
                  env={"STANDIN_NULL_TOP_EVERY": "3", "STANDIN_STEP_S": "0.04"},
                  metrics_interval_s=0.02)
    reqs = [GenerationRequest(prompt_id="long", prompt=[40, 50, 60], max_tokens=50.0, top_k=50.0,
                              logprobs=2, ignore_eos=1),
            GenerationRequest(prompt_id="short", prompt=[41, 50, 60], max_tokens=10, logprobs=2,
                              ignore_eos=True)]
    try:
        eng.start()
        url = eng.client.base_url + "/generate"
        refused = [httpx.post(url, json={"input_ids": [5], "sampling_params": sp}, timeout=30)
                   for sp in ({"max_new_tokens": 2, "seed": 1}, {"max_new_tokens": 2.0},
                              {"max_new_tokens": 2, "top_k": True})]
        flushed_while_running: list[bool] = []
        done = threading.Event()

        def flush_while_running() -> None:
            while not done.is_set() and not flushed_while_running:
                if _scrape(eng).num_requests_running >= 1:
                    flushed_while_running.append(eng.reset_prefix_cache())
                time.sleep(0.05)

        watcher = threading.Thread(target=flush_while_running)
        watcher.start()
        try:
            got, samples = _pass(eng, reqs, concurrency=2)
        finally:
            done.set()
            watcher.join()
        flushed_after = eng.reset_prefix_cache()
    finally:
        eng.stop()
    assert [(r.status_code, r.json()["error"].split(", expected")[0]) for r in refused] == [
        (400, "unknown field `seed`"), (400, "invalid type: floating point `2.0`"),
        (400, "invalid type: boolean `true`")]
    assert refused[0].json()["error"].endswith("`sampling_seed`, `custom_params`, `beam_width`, "
                                               "`watermark`, `choice`")
    assert (flushed_while_running, flushed_after) == ([False], True)
    ref_engine = EmbeddedEngine(load_model(model_folder), gemm="invariant", max_batch_size=1)
    for ref in ref_engine.generate([GenerationRequest(prompt_id=r.prompt_id, prompt=r.prompt,
                                                      max_tokens=int(r.max_tokens), top_k=50,
                                                      logprobs=2, ignore_eos=True)
                                    for r in reqs]):
        r = got[ref.prompt_id]
        assert r.error is None, r.error
        assert (r.token_ids, r.logprobs) == (ref.token_ids, ref.logprobs)
        assert r.top_logprobs == [[] if i % 3 == 2 else sorted(row, key=lambda p: -p[1])
                                  for i, row in enumerate(ref.top_logprobs)]
    long, short = got["long"], got["short"]
    between = [x.num_requests_running for x in samples
               if short.t_done + 0.1 < x.t < long.t_done - 0.1]
    assert len(between) >= 3 and set(between) == {2.0}, between
    assert samples[-1].num_requests_running == 0.0


def test_retractions_are_counted_from_the_first(model_folder, tmp_path):
    """The stand-in retracts (``STANDIN_RETRACT_EVERY``): the counter SGLang creates at its first
    retraction is read from 0, so the pass's retractions are all counted; the deterministic
    arm's tokens and logprobs do not change."""
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model
    from bistat.run.batching import batching_summary

    eng = _engine(model_folder, tmp_path, args={"enable_deterministic_inference": True},
                  env={"STANDIN_RETRACT_EVERY": "5", "STANDIN_STEP_S": "0.02"},
                  metrics_interval_s=0.02)
    reqs = [GenerationRequest(prompt_id=str(i), prompt=[60 + i, 7], max_tokens=30,
                              ignore_eos=True) for i in range(4)]
    try:
        eng.start()
        before = _scrape(eng)
        got, samples = _pass(eng, reqs, concurrency=4)
        after = _scrape(eng)
    finally:
        eng.stop()
    assert before.num_preemptions_total == 0.0
    assert after.num_preemptions_total >= 2
    assert batching_summary(samples, wall_s=samples[-1].t)["preemptions"] == (
        after.num_preemptions_total)
    # each answer says how often its request was retracted: together, every retraction
    per_request = {pid: r.preemptions for pid, r in got.items()}
    assert all(isinstance(n, int) for n in per_request.values()), per_request
    assert sum(per_request.values()) == after.num_preemptions_total
    assert max(per_request.values()) >= 1
    ref_engine = EmbeddedEngine(load_model(model_folder), gemm="invariant", max_batch_size=1)
    for ref in ref_engine.generate(reqs):
        assert (got[ref.prompt_id].token_ids, got[ref.prompt_id].logprobs) == (
            ref.token_ids, ref.logprobs)


def test_a_health_check_that_takes_sglangs_time_is_waited_for(model_folder, tmp_path):
    """SGLang's health check generates a token and may take up to its 20 s timeout before it
    answers: a scheduler that takes 11 s to answer it (here once it has served a request) is
    healthy. The probe after a pass with a failed request (a prompt over the context length:
    HTTP 400) waits for it, and the pass keeps its failed request as that request's failure."""
    eng = _engine(model_folder, tmp_path, env={"STANDIN_HEALTH_SLOW_S": "11"})
    reqs = [GenerationRequest(prompt_id="ok", prompt=[5, 6], max_tokens=3),
            GenerationRequest(prompt_id="long", prompt=[5] * 600, max_tokens=3)]
    try:
        eng.start()
        got, _ = _pass(eng, reqs, concurrency=2)
    finally:
        eng.stop()
    assert got["ok"].error is None and len(got["ok"].token_ids) == 3
    assert got["long"].error.startswith("after 1 attempt(s): HTTP 400")
    assert "exceeds max_model_len=512" in got["long"].error
    assert (eng.ready_probe_timeout_s, eng.health_probe_timeout_s) == (30.0, 30.0)


def test_a_server_that_never_becomes_ready_is_a_start_failure_and_is_stopped(model_folder,
                                                                             tmp_path):
    pidfile = tmp_path / "pid"
    eng = _engine(model_folder, tmp_path, env={"STANDIN_NEVER_READY": "1",
                                               "STANDIN_PIDFILE": str(pidfile)})
    eng.health_timeout_s = 3
    with pytest.raises(EngineStartError) as exc:
        eng.start()
    assert str(exc.value).endswith(f"did not become healthy within 3 s (log: {tmp_path / 'server.log'}); "
                                   "raise health_timeout_s or read the log")
    assert group_pids(int(pidfile.read_text())) == []


def test_a_backend_the_deterministic_mode_does_not_support_is_refused_naming_it(model_folder,
                                                                                  tmp_path):
    eng = _engine(model_folder, tmp_path, args={"enable_deterministic_inference": True,
                                                "attention_backend": "torch_native"})
    with pytest.raises(EngineRefused) as exc:
        eng.start()
    assert str(exc.value).startswith(
        "the server refused the setting (exit code 1): ValueError: Currently only ['ascend', "
        "'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton'] attention backends are supported for "
        "deterministic inference, but you explicitly specified 'torch_native'.")


def test_a_crash_after_the_radix_cache_warning_is_a_start_failure_not_a_refusal(model_folder,
                                                                                tmp_path):
    """The flashinfer deterministic arm logs SGLang's radix-cache warning ("... is not
    compatible with flashinfer attention backend ..."), which reads like a refusal; the server
    then dies building the model. What stopped it is the missing module: a start failure."""
    eng = _engine(model_folder, tmp_path, env={"STANDIN_START_CRASH": "1"},
                  args={"enable_deterministic_inference": True, "attention_backend": "flashinfer"})
    with pytest.raises(EngineStartError) as exc:
        eng.start()
    assert not isinstance(exc.value, EngineRefused)
    assert str(exc.value) == ("the server exited with code -9 before it was healthy: "
                              "ModuleNotFoundError: No module named 'cutlass.cute' "
                              f"(log: {tmp_path / 'server.log'})")
    log = (tmp_path / "server.log").read_text()
    assert re.search(r"^\[[\d: -]+\] Currently radix cache is not compatible with flashinfer "
                     r"attention backend for deterministic inference\. It will be supported in "
                     r"the future\.$", log, re.MULTILINE)


def test_a_flag_sglang_does_not_know_is_refused_by_its_argument_parser(model_folder, tmp_path):
    eng = _engine(model_folder, tmp_path, args={"enable_determinstic_inference": True})
    with pytest.raises(EngineRefused) as exc:
        eng.start()
    assert str(exc.value) == ("the server refused the setting (exit code 2): launch_server.py: "
                              "error: unrecognized arguments: --enable-determinstic-inference "
                              f"(log: {tmp_path / 'server.log'})")


def test_a_server_dying_mid_pass_is_an_engine_error_not_failed_requests(model_folder, tmp_path):
    """The scheduler fails: it SIGQUITs the main process, which kills the tree (itself by
    SIGKILL); the error names the scheduler's exception."""
    eng = _engine(model_folder, tmp_path, env={"STANDIN_DIE_AFTER": "3"})
    reqs = [GenerationRequest(prompt_id=str(i), prompt=[30 + i, 31], max_tokens=4) for i in range(8)]
    (exc, again), results, _ = failing_passes(eng, reqs, concurrency=2, times=2)
    assert str(exc) == ("the SGLang server exited during the pass with code -9: "
                        "RuntimeError: scheduler died (STANDIN_DIE_AFTER) "
                        f"(log: {tmp_path / 'server.log'})")
    assert str(again).startswith("the SGLang server had exited before the pass with code -9: ")
    assert 1 <= len(results) <= 2 and all(r.error is None for r in results)  # never a failure


def test_malformed_json_fails_the_requests_of_a_live_server(model_folder, tmp_path):
    """As for vLLM: a body that is not JSON is retried, then the request is recorded as failed;
    the server still answers /health, so the pass is not an engine failure."""
    eng = _engine(model_folder, tmp_path, env={"STANDIN_MALFORMED": "1"}, retries=1,
                  backoff_s=0.01)
    try:
        eng.start()
        got, _ = _pass(eng, [GenerationRequest(prompt_id="a", prompt=[5, 6], max_tokens=3)], 1)
    finally:
        eng.stop()
    assert got["a"].error.startswith("after 2 attempt(s): malformed answer (JSONDecodeError")
    assert got["a"].token_ids == [] and got["a"].attempts == 2


# -- registration ---------------------------------------------------------------------------------

def _sglang_declaration(required="0.5.23", **arm_args):
    from bistat.declare.experiment import validate_experiment
    from helpers_runner import declaration

    data = declaration()
    data["engine"] = {"kind": "sglang-server", "model": "/tmp/model/smollm2",
                      "required_version": required, "args": {"mem_fraction_static": 0.4}}
    data["arms"][1]["args"] = dict(arm_args)
    return validate_experiment(data, source="x.toml")


def test_argument_names_are_checked_against_the_wheel_with_the_closest_suggested(tmp_path):
    from bistat.declare.prereg import registration_problems

    ok = _sglang_declaration(enable_deterministic_inference=True, attention_backend="fa3",
                             health_timeout_s=600, enable_prefix_caching=False)
    assert registration_problems(ok, "experiments/x.toml", tmp_path) == []
    bad = _sglang_declaration(enable_determinstic_inference=True)
    (problem,) = registration_problems(bad, "experiments/x.toml", tmp_path)
    assert problem.startswith("experiments/x.toml: arms[1].args.enable_determinstic_inference: "
                              "unknown sglang.launch_server argument "
                              "'enable_determinstic_inference' in SGLang 0.5.23")
    assert problem.endswith("did you mean 'enable_deterministic_inference'?")


def test_the_recorded_names_are_the_wheels_own():
    """scripts/sglang_arg_names.py on SGLang 0.5.23's wheel found 559 flags (equal, name for name,
    to the option strings of the wheel's own parser, ServerArgs.add_cli_args, when checked)."""
    from bistat.engines.sglang_args import known_names

    names = known_names()["0.5.23"]
    assert len(names) == 559
    assert {"attention_backend", "enable_deterministic_inference", "mem_fraction_static",
            "disable_radix_cache", "enable_metrics", "tp_size", "tensor_parallel_size",
            "sampling_backend", "decode_log_interval", "config"} <= names
    assert "gpu_memory_utilization" not in names  # vLLM's name, not SGLang's


def test_the_recorder_reads_fields_cli_names_aliases_and_added_flags(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_arg_names",
                                                  ROOT / "scripts" / "sglang_arg_names.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    srt = tmp_path / "sglang" / "srt"
    (srt / "arg_groups" / "fields").mkdir(parents=True)
    (srt / "arg_groups" / "fields" / "exec_.py").write_text(
        "import argparse\nclass K:\n"
        "    attention_backend: A[Optional[str], Arg(help='x', choices=C)] = None\n"
        "    tp_size: A[int, Arg(help='x', aliases=['--tensor-parallel-size'])] = 1\n"
        "    fp8_backend: A[str, Arg(cli_name='--fp8-gemm-backend')] = 'auto'\n"
        "    hidden: A[bool, Arg(no_cli=True)] = False\n"
        "    tf32: A[Optional[bool], Arg(action=argparse.BooleanOptionalAction)] = None\n"
        "    enable_x: A[bool, 'help'] = False\n"
        "    plain: int = 0\n")
    (srt / "server_args.py").write_text("def f(parser):\n    parser.add_argument(\n"
                                        "        '--sampling-backend', type=str)\n")
    assert mod.names(tmp_path) == ["attention_backend", "enable_x", "fp8_gemm_backend",
                                   "no_tf32", "sampling_backend", "tensor_parallel_size", "tf32",
                                   "tp_size"]


# -- SGLang's own parser, where SGLANG_SITE names a site with SGLang (and a torch) -----------------

def test_every_sglang_declaration_parses_with_sglangs_own_parser():
    site = str(named_folder(SGLANG_SITE_VAR, "pip install --no-deps --target SITE sglang==0.5.23 "
                                             "orjson pybase64 msgspec aiohttp ... and a torch; "
                                             "scripts/device/check_sglang_args.py says which"))
    probe = subprocess.run([sys.executable, "-c", "import sglang.srt.server_args"],
                           env={**os.environ, "PYTHONPATH": site}, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, f"{SGLANG_SITE_VAR}={site}: {probe.stderr}"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device" / "check_sglang_args.py"),
                           "--names"], env={**os.environ, "PYTHONPATH": site},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("SGLang 0.5.23 from ")
    assert "recorded names: 559, the parser's: 559, equal" in lines
    assert lines[-1] == "every arm passed"
    assert sum(line.startswith("OK   ") for line in lines) >= 10


# -- end to end through the CLI -------------------------------------------------------------------

DECLARATION = """\
name = "{name}"
hypothesis = "Stand-in SGLang server (NOT SGLang): the deterministic arm, on the embedded engine's batch-invariant GEMM, matches itself across passes."

[engine]
kind = "sglang-server"
model = "{model}"
required_version = "0.5.23"
args = {{ command = {command}, health_timeout_s = 120, stop_grace_s = 5, metrics_interval_s = 0.05 }}

[[arms]]
name = "default"
role = "control"

[[arms]]
name = "deterministic"
role = "treatment"
args = {{ enable_deterministic_inference = true, attention_backend = "triton" }}
env = {{ {treatment_env} }}

[workload]
source = "builtin:chat"
n_prompts = 8
max_tokens = 16
concurrency = 4
passes = 2
warmup_passes = 0
order = "abba"
seed = 0
top_logprobs = 2

[validity]
min_mean_running = 1.0

[rule]
confidence_level = 0.95
otherwise = "reported as observed"

[[rule.labels]]
label = "working"
all = [ {{ criterion = "match_lower_bound", arm = "treatment", at_least = 0.5 }} ]
"""


def _bistat(*args, cwd, env=None):
    done = subprocess.run([sys.executable, "-m", "bistat", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "BISTAT_PACKAGE_INDEX": "off",
                                                       "STANDIN_STEP_S": "0.01", **(env or {})})
    return done.returncode, done.stdout + done.stderr


def test_sglang_servers_start_one_at_a_time():
    """Each SGLang server sizes its memory from the GPU memory free at its start, so servers
    starting together on one GPU were refused: the kind starts its engines one at a time."""
    from bistat.engines.registry import capabilities

    assert capabilities("sglang-server").parallel_start is False


def test_the_design_analysis_prices_sglang_starts_per_engine(tmp_path):
    """An earlier run whose two engines started in 40 s prices each SGLang engine's start at 20 s:
    a start of both is 2 x 20 s, not the 40 s of a kind whose engines start together."""
    from test_design_duration import _declaration, _write_run

    from bistat.declare.design_report import analyse_design
    from bistat.declare.experiment import validate_experiment

    run = _write_run(tmp_path / "old", [(("blas", "invariant"), (30.0, 40.0),
                                         [("blas", 10.0), ("invariant", 12.0)] * 3)],
                     together=True)
    data = _declaration(run)
    data["engine"].update(kind="sglang-server", model="/tmp/model/smollm2",
                          engines_concurrent=True, args={"mem_fraction_static": 0.4})
    data["arms"][1]["args"] = {"enable_deterministic_inference": True}
    d = analyse_design(validate_experiment(data)).duration
    assert (d.engines_per_start, d.first_start_s) == (2, pytest.approx(20.0))
    assert d.start_basis == ("sglang-server engines start one at a time (each sizes its KV cache "
                             "from the GPU memory free when it starts): the earlier run's start "
                             "of 2 engines, 40 s, is 20.0 s per engine")


def test_run_analyze_and_finding_against_the_stand_in(model_folder, tmp_path):
    """Both arms' servers up together (``engines_concurrent``), started one after the other: each
    server's start comes after the previous one was ready (the stand-in records both times)."""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "sgl.toml").write_text(DECLARATION.format(
        name="sgl", model=model_folder, command=json.dumps(list(COMMAND)), treatment_env=""
    ).replace('required_version = "0.5.23"\n',
              'required_version = "0.5.23"\nengines_concurrent = true\n'))
    rc, out = _bistat("register", "experiments/sgl.toml", cwd=tmp_path)
    assert rc == 0, out
    times = tmp_path / "server-times.jsonl"
    rc, out = _bistat("run", "preregistrations/sgl.json", "--run-dir", "runs/sgl", "--no-progress",
                      cwd=tmp_path, env={"STANDIN_TIMES": str(times)})
    assert rc in (0, 10, 11, 12), out
    starts = sorted((json.loads(line) for line in times.read_text().splitlines()),
                    key=lambda r: r["start"])
    assert len(starts) == 2 and starts[0]["start"] < starts[0]["ready"] < starts[1]["start"]
    run = tmp_path / "runs" / "sgl"
    assert json.loads((run / "run.json").read_text())["engines_concurrent"] is True
    env = [json.loads(line) for line in (run / "environment.jsonl").read_text().splitlines()]
    assert {e["arm"]: e["engine"]["args"]["server_reported"]["enable_deterministic_inference"]
            for e in env} == {"default": False, "deterministic": True}
    assert all(e["engine"]["kind"] == "sglang-server" and e["fingerprint"]["source"] == "runner"
               and e["fingerprint"]["engine_reported"]["server"]["attention_backend"] in ("fa3", "triton")
               for e in env)
    rc, out = _bistat("analyze", "runs/sgl", "--out", "findings", cwd=tmp_path)
    assert rc == 0, out
    finding = (tmp_path / "findings" / "sgl.md").read_text()
    # the engine named by SGLang's version, the backend column by what each server reported
    assert "Engine: SGLang 0.5.23 · GPU: no GPU" in finding
    row = next(line for line in finding.splitlines() if line.startswith("| deterministic | default"))
    assert row.startswith("| deterministic | default | sglang-server, triton, deterministic | "
                          "*working* | 8 / 8 | "), row
    activation = finding.split("## Activation")[1].split("## Match")[0]
    assert "| arm | role | requested (vs control) | attention backend (server) | probe | status |" \
        in activation
    assert "| default | control | — | fa3 | not run | control: nothing requested |" in activation
    # same versions compares SGLang's version as each arm's environment reported it
    assert "| sglang | 0.5.23 | 0.5.23 |" in finding
    assert ("| same versions | identical | identical python, numpy, torch, triton, vllm, sglang, "
            "bistat, git commit, driver, bistat code, the servers' declared versions | passed |"
            in finding)
    assert "validity FAILED" not in out


def test_a_server_dying_mid_run_interrupts_the_pass_and_resume_completes(model_folder, tmp_path):
    flag = tmp_path / "die-once"
    flag.write_text("")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "sgl.toml").write_text(DECLARATION.format(
        name="sgl", model=model_folder, command=json.dumps(list(COMMAND)),
        treatment_env=f'STANDIN_DIE_AFTER = "11", STANDIN_DIE_FLAG = "{flag}"'))
    assert _bistat("register", "experiments/sgl.toml", cwd=tmp_path)[0] == 0
    rc, out = _bistat("run", "preregistrations/sgl.json", "--run-dir", "runs/sgl", "--no-progress",
                      cwd=tmp_path)
    run = tmp_path / "runs" / "sgl"
    schedule = [json.loads(x) for x in (run / "schedule.jsonl").read_text().splitlines()]
    ends = [r for r in schedule if r["event"] == "end"]
    assert [(r["arm"], r["status"]) for r in ends if r["status"] != "complete"] == [
        ("deterministic", "interrupted")], out
    assert not flag.exists()
    assert "the SGLang server exited during the pass with code -9: RuntimeError: scheduler " \
           "died (STANDIN_DIE_AFTER)" in out
    kept = [json.loads(x) for x in (run / "responses.jsonl").read_text().splitlines()]
    assert not any(r["error"] for r in kept)  # nothing recorded as a failure; nothing lost
    rc, out = _bistat("run", "--resume", "runs/sgl", "--no-progress", cwd=tmp_path)
    schedule = [json.loads(x) for x in (run / "schedule.jsonl").read_text().splitlines()]
    done = Counter((r["arm"], r["status"]) for r in schedule if r["event"] == "end")
    assert done == {("default", "complete"): 2, ("deterministic", "complete"): 2,
                    ("deterministic", "interrupted"): 1}, out
    assert math.isfinite(len(kept))
