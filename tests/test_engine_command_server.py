"""The ``command-server`` kind: each arm's OpenAI-compatible server started from a command template,
here ``bistat serve`` itself (real outputs of the embedded engine on a tiny model), end to end
through the CLI; the template's checks at registration."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bistat.engines.base import EngineStartError, GenerationRequest
from bistat.engines.command_server import CommandServerEngine, template_fields
from bistat.engines.server_process import group_pids

SERVE = [sys.executable, "-m", "bistat", "serve", "--port", "{port}", "--model", "{model}",
         "--gemm", "{gemm}", "--max-batch-size", "8"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    from bistat.model.loader import save_model
    from bistat.model.testing import tiny_random_model

    folder = tmp_path_factory.mktemp("model") / "tiny"
    save_model(tiny_random_model(0, tokenizer="byte"), folder)
    return str(folder)


def _exp(engine_args, *arm_args):
    return SimpleNamespace(engine=SimpleNamespace(model="m", args=engine_args),
                           arms=[SimpleNamespace(name=f"a{i}", args=a, env={})
                                 for i, a in enumerate(arm_args)],
                           workload=SimpleNamespace(retries=2, request_timeout_s=60.0,
                                                    model_fields_set=set()))


def test_the_template_is_checked_at_registration():
    ok = _exp({"command": "srv --port {port} --model {model} --gemm {gemm}"},
              {"gemm": "blas"}, {"gemm": "invariant", "retries": 1})
    assert CommandServerEngine.declaration_problems(ok) == []
    assert CommandServerEngine.declaration_problems(_exp({}, {})) == [
        ("engine.args.command", "engine 'command-server' needs the server's command template, "
                                "e.g. command = \"bistat serve --port {port} --model {model}\"")]
    bad = _exp({"command": "srv --port {port} --gemm {gemm}"}, {"gemm": "blas"}, {"gmm": "x"})
    assert CommandServerEngine.declaration_problems(bad) == [
        ("engine.args.command", "placeholder {gemm} has no value for arm 'a1'; set args.gemm in "
                                "the arm or in engine.args"),
        ("arms[1].args.gmm", "'gmm' is not a placeholder of the command template (nor one of "
                             "bistat's own keys ['command', 'ready_path', 'health_timeout_s', "
                             "'stop_grace_s', 'log_path', 'retries', 'backoff_s', "
                             "'max_retry_wait_s', 'request_timeout_s', 'metrics_interval_s', "
                             "'api_key_env']); write {gmm} in the command or remove it")]
    with pytest.raises(ValueError, match=re.escape("placeholder {0} in 'x{0}' is not a plain name")):
        template_fields("srv x{0}")


def test_argv_fills_the_template_and_a_missing_program_is_a_start_failure(tmp_path):
    eng = CommandServerEngine("smol", command=["srv", "--port={port}", "{model}", "--b", "{b}"],
                              values={"b": 2}, log_path=tmp_path / "log")
    assert eng.argv(99) == ["srv", "--port=99", "smol", "--b", "2"]
    missing = CommandServerEngine("smol", command=f"{tmp_path}/nope --port {{port}}",
                                  log_path=tmp_path / "log")
    with pytest.raises(EngineStartError, match="cannot run '.*nope': .*check engine.args.command"):
        missing.start()


def test_bistat_serve_started_per_arm_gives_the_embedded_engines_outputs(model_folder, tmp_path):
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model

    reqs = [GenerationRequest(prompt_id=str(i), prompt=[20 + i, 21, 22], max_tokens=6, logprobs=2)
            for i in range(4)]
    eng = CommandServerEngine(model_folder, command=SERVE, values={"gemm": "invariant"},
                              health_timeout_s=120, stop_grace_s=5, log_path=tmp_path / "log",
                              http={"retries": 0, "metrics_interval_s": 0.05})
    results, samples = [], []
    try:
        info = eng.start()
        pid = eng.proc.pid
        eng.run_pass(reqs, concurrency=4, on_result=results.append, on_metrics=samples.append)
    finally:
        eng.stop()
    assert group_pids(pid) == []
    argv = info.args["argv"]
    assert info.kind == "command-server" and argv[-4:] == ["--gemm", "invariant",
                                                           "--max-batch-size", "8"]
    assert argv[3:5] == ["serve", "--port"] and argv[5].isdigit() and argv[7] == model_folder
    ref = {r.prompt_id: r for r in EmbeddedEngine(load_model(model_folder), gemm="invariant",
                                                  max_batch_size=1).generate(reqs)}
    got = {r.prompt_id: r for r in results}
    assert {k: (r.token_ids, r.logprobs) for k, r in got.items()} == {
        k: (r.token_ids, r.logprobs) for k, r in ref.items()}
    assert samples and samples[-1].generation_tokens_total == sum(len(r.token_ids) for r in results)


DECLARATION = """\
name = "cmd"
hypothesis = "bistat serve, started per arm from a command template: the invariant GEMM matches itself across passes."

[engine]
kind = "command-server"
model = "{model}"
args = {{ command = {command}, health_timeout_s = 120, stop_grace_s = 5, metrics_interval_s = 0.05 }}

[[arms]]
name = "blas"
role = "control"
args = {{ gemm = "blas" }}

[[arms]]
name = "invariant"
role = "treatment"
args = {{ gemm = "invariant" }}

[workload]
source = "builtin:token-ids?length=6&vocab=250&low=3"
n_prompts = 8
max_tokens = 8
concurrency = 4
passes = 2
warmup_passes = 0
order = "abba"
seed = 0

[validity]
min_mean_running = 0.0

[rule]
confidence_level = 0.95
otherwise = "reported as observed"

[[rule.labels]]
label = "working"
all = [ {{ criterion = "match_lower_bound", arm = "treatment", at_least = 0.5 }} ]
"""


def test_register_run_analyze_with_bistat_serve_as_the_server(model_folder, tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "cmd.toml").write_text(DECLARATION.format(
        model=model_folder, command=json.dumps(SERVE)))
    env = {**os.environ, "BISTAT_PACKAGE_INDEX": "off"}

    def bistat(*args):
        done = subprocess.run([sys.executable, "-m", "bistat", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        return done.returncode, done.stdout + done.stderr

    assert bistat("register", "experiments/cmd.toml")[0] == 0
    rc, out = bistat("run", "preregistrations/cmd.json", "--run-dir", "runs/cmd", "--no-progress")
    assert rc == 0, out
    environment = [json.loads(x) for x in
                   (tmp_path / "runs" / "cmd" / "environment.jsonl").read_text().splitlines()]
    assert {e["arm"]: e["engine"]["args"]["gemm"] for e in environment} == {
        "blas": "blas", "invariant": "invariant"}
    assert all(e["engine"]["kind"] == "command-server" for e in environment)
    assert sorted(p.name for p in (tmp_path / "runs" / "cmd" / "engine-logs").iterdir()) == [
        "blas-1.log.gz", "invariant-1.log.gz"]
    rc, out = bistat("analyze", "runs/cmd", "--out", "findings")
    assert rc == 0, out
    finding = (tmp_path / "findings" / "cmd.md").read_text()
    row = next(line for line in finding.splitlines() if line.startswith("| invariant | blas"))
    assert row.startswith("| invariant | blas | command-server | *working* | 8 / 8 | "), row


def test_a_failed_start_cites_the_run_s_copy_of_the_log_and_leaves_no_temporary_log(
        model_folder, tmp_path):
    """A server that exits before it is healthy, with no ``log_path`` declared: the run says
    untested and cites the log the run directory keeps (``engine-logs/ARM-1.log.gz``), not the
    adapter's temporary ``bistat-command-XXXX.log``, which is removed once kept."""
    failing = [sys.executable, "-c", "import sys; print('no GPU for this server'); sys.exit(3)",
               "--port", "{port}", "--gemm", "{gemm}"]
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "cmd.toml").write_text(DECLARATION.format(
        model=model_folder, command=json.dumps(failing)))
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "BISTAT_PACKAGE_INDEX": "off", "TMPDIR": str(temp)}
    done = [subprocess.run([sys.executable, "-m", "bistat", *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
            for args in (("register", "experiments/cmd.toml"),
                         ("run", "preregistrations/cmd.json", "--run-dir", "runs/cmd",
                          "--no-progress"))]
    assert done[0].returncode == 0, done[0].stdout + done[0].stderr
    out = done[1].stdout + done[1].stderr
    assert done[1].returncode == 1, out
    assert ("run untested: engine for arm 'blas' failed to start: the server exited with code 3 "
            "before it was healthy: no GPU for this server (log: runs/cmd/engine-logs/"
            "blas-1.log.gz)") in out
    assert "bistat-command-" not in out
    assert list(temp.glob("bistat-command-*")) == []
    events = [json.loads(x) for x in
              (tmp_path / "runs" / "cmd" / "events.jsonl").read_text().splitlines()]
    failed = next(e for e in events if e["event"] == "start_failed")
    assert failed["detail"].endswith("(log: runs/cmd/engine-logs/blas-1.log.gz)")
