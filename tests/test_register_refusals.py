"""``bistat register`` refuses what ``bistat run`` would, for every engine kind, with no traceback:
each refusal through the CLI names the file, the field and the fix, and writes nothing (no
registration, no run directory, no run ledger). What an adapter cannot check before its engine
runs is stated in the design report instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from bistat.cli import cli

BASE = """\
name = "{name}"
hypothesis = "The treatment's outputs match across passes."

[engine]
kind = "{kind}"
model = "{model}"
{engine_args}

[[arms]]
name = "control"
role = "control"
{control_args}

[[arms]]
name = "treatment"
role = "treatment"
{treatment_args}

[workload]
source = "{source}"
n_prompts = {n_prompts}
max_tokens = {max_tokens}
concurrency = 2
passes = 2

[rule]
[[rule.labels]]
label = "working"
all = [ {{ criterion = "match_lower_bound", at_least = 0.5 }} ]
"""

URL = 'args = { url = "http://127.0.0.1:8000" }'

#: the fields of a declaration each case changes; the rest are these
DEFAULTS = {"kind": "embedded", "model": "smollm2-135m", "engine_args": "",
            "control_args": 'args = { gemm = "blas" }',
            "treatment_args": 'args = { gemm = "invariant" }', "source": "builtin:chat",
            "n_prompts": 8, "max_tokens": 4}

F = "experiments/x.toml"

#: (case, the declaration's changed fields, the exact error lines after "Error: ")
REFUSALS = [
    ("openai without url",
     {"kind": "openai", "model": "m", "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.url: engine 'openai' needs the URL of each arm's server (arms "
      "'control', 'treatment' have none), e.g. url = \"http://127.0.0.1:8000\" in engine.args or "
      "in each arm's args"]),
    ("openai with an unknown key",
     {"kind": "openai", "model": "m", "engine_args": URL, "control_args": "",
      "treatment_args": 'args = { gemm = "invariant" }'},
     [f"{F}: arms[1].args.gemm: unknown argument 'gemm' for engine 'openai', which only connects "
      "to a server started elsewhere; expected some of ['url', 'retries', 'backoff_s', "
      "'max_retry_wait_s', 'request_timeout_s', 'metrics_interval_s', 'api_key_env']; a setting "
      "of the server itself (its GEMM, its attention backend) is made where the server is "
      "started, e.g. `bistat serve --gemm invariant`; to start a server per arm from a command, "
      "use kind = \"command-server\""]),
    ("openai with a misspelt key",
     {"kind": "openai", "model": "m", "engine_args": 'args = { url = "http://h:1", retires = 2 }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.retires: unknown argument 'retires' for engine 'openai', which only "
      "connects to a server started elsewhere; expected some of ['url', 'retries', 'backoff_s', "
      "'max_retry_wait_s', 'request_timeout_s', 'metrics_interval_s', 'api_key_env']; did you "
      "mean 'retries'?"]),
    ("openai, one arm without url",
     {"kind": "openai", "model": "m", "control_args": URL, "treatment_args": ""},
     [f"{F}: arms[1].args.url: engine 'openai' needs the URL of each arm's server (arm "
      "'treatment' has none), e.g. url = \"http://127.0.0.1:8000\" in engine.args or in each "
      "arm's args"]),
    ("openai, url without a scheme",
     {"kind": "openai", "model": "m", "engine_args": 'args = { url = "127.0.0.1:8000" }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.url: '127.0.0.1:8000' is not a server URL; write it as "
      "http://HOST:PORT or https://HOST:PORT, e.g. \"http://127.0.0.1:8000\""]),
    ("openai, port out of range",
     {"kind": "openai", "model": "m", "control_args": URL,
      "treatment_args": 'args = { url = "http://127.0.0.1:99999" }'},
     [f"{F}: arms[1].args.url: 'http://127.0.0.1:99999': port 99999 is not in 1..65535"]),
    ("openai, negative retries and a bad key variable",
     {"kind": "openai", "model": "m",
      "engine_args": 'args = { url = "http://h:1", retries = -1, api_key_env = "" }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.api_key_env: '' is not the name of an environment variable; write e.g. "
      "api_key_env = \"OPENAI_API_KEY\" (the key itself never sits in a declaration)",
      f"{F}: engine.args.retries: -1 is not an integer >= 0; write e.g. retries = 2"]),
    ("vllm-server with a port of its own",
     {"kind": "vllm-server", "model": "/m", "engine_args": "args = { port = 8000 }",
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.port: engine 'vllm-server' starts each arm's server itself on a free "
      "loopback port it chooses (and connects there); remove port, or attach to a server you "
      "started with kind = \"openai\" and its url"]),
    ("vllm-server attached to a malformed url",
     {"kind": "vllm-server", "model": "/m", "engine_args": 'args = { url = "localhost" }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.url: 'localhost' is not a server URL; write it as http://HOST:PORT or "
      "https://HOST:PORT, e.g. \"http://127.0.0.1:8000\""]),
    ("vllm-server, max_tokens over the declared max_model_len",
     {"kind": "vllm-server", "model": "/m", "engine_args": "args = { max_model_len = 2048 }",
      "control_args": "", "treatment_args": "", "max_tokens": 10_000_000},
     [f"{F}: workload.max_tokens: 10000000 new tokens plus a prompt of even 1 token exceed "
      "engine.args.max_model_len = 2048 (arms 'control', 'treatment'): vLLM refuses every such "
      "request; lower workload.max_tokens to at most 2047, or raise max_model_len"]),
    ("vllm-offline, token-id prompts over one arm's max_model_len",
     {"kind": "vllm-offline", "model": "/m", "control_args": "",
      "treatment_args": "args = { max_model_len = 64 }", "max_tokens": 40,
      "source": "builtin:token-ids?length=32"},
     [f"{F}: workload.max_tokens: 40 new tokens plus the longest prompt (ids-0000, 32 tokens) "
      "exceed arms[1].args.max_model_len = 64 (arm 'treatment'): vLLM refuses every such "
      "request; lower workload.max_tokens to at most 32, or raise max_model_len"]),
    ("sglang-server, a host and a context too short",
     {"kind": "sglang-server", "model": "/m",
      "engine_args": 'args = { host = "0.0.0.0", context_length = 100 }', "control_args": "",
      "treatment_args": "", "max_tokens": 100},
     [f"{F}: engine.args.host: engine 'sglang-server' starts each arm's server itself on a free "
      "loopback port it chooses (and connects there); remove host, or attach to a server you "
      "started with kind = \"openai\" and its url",
      f"{F}: workload.max_tokens: 100 new tokens plus a prompt of even 1 token exceed "
      "engine.args.context_length = 100 (arms 'control', 'treatment'): SGLang refuses every such "
      "request; lower workload.max_tokens to at most 99, or raise context_length"]),
    ("command-server without {port} and with a bad ready_path",
     {"kind": "command-server", "model": "m",
      "engine_args": 'args = { command = "serve --model {model}", ready_path = "health" }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.command: the command has no {{port}} placeholder: bistat starts each "
      "arm's server on a free loopback port it chooses and connects there; write --port {port} "
      "(or what the server's own option is) in the command",
      f"{F}: engine.args.ready_path: 'health' is not a path on the server; write e.g. "
      "ready_path = \"/v1/models\" (the default) or \"/health\""]),
    ("command-server with a negative timeout",
     {"kind": "command-server", "model": "m",
      "engine_args": 'args = { command = "serve --port {port}", health_timeout_s = -5 }',
      "control_args": "", "treatment_args": ""},
     [f"{F}: engine.args.health_timeout_s: -5 is not a number > 0; write e.g. "
      "health_timeout_s = 30.0"]),
    ("embedded, max_tokens over the default max_model_len",
     {"max_tokens": 10_000_000},
     [f"{F}: workload.max_tokens: 10000000 new tokens plus the longest prompt (chat-0001, 47 "
      "tokens) exceed the embedded engine's default max_model_len = 2048 (arms 'control', "
      "'treatment'): the embedded engine refuses every such request; lower workload.max_tokens "
      "to at most 2001, or raise max_model_len"]),
    ("embedded, an environment, a zero batch and a tensor parallel size the heads refuse",
     {"engine_args": "args = { max_batch_size = 0, tensor_parallel_size = 7 }",
      "treatment_args": 'args = { gemm = "invariant" }\nenv = { OMP_NUM_THREADS = "1" }'},
     [f"{F}: engine.args.max_batch_size: 0 is not a positive integer; write e.g. "
      "max_batch_size = 32",
      f"{F}: arms[1].env: the embedded engine runs inside the bistat process, so environment "
      "variables ['OMP_NUM_THREADS'] cannot apply to it; remove them or use a server engine kind",
      f"{F}: engine.args.tensor_parallel_size: 7 does not divide model 'smollm2-135m''s heads and "
      "MLP; set it to one of [1, 3], or remove it (default 1)"]),
    ("embedded, token ids outside the model's vocabulary",
     {"source": "builtin:token-ids?vocab=99999"},
     [f"{F}: workload.source: prompt ids-0000 has token id 85062, outside model "
      "'smollm2-135m''s vocabulary [0, 49152); set the source's vocab to at most 49152"]),
    ("more prompts than the built-in chat source holds",
     {"n_prompts": 100_000},
     [f"{F}: workload.n_prompts: builtin:chat: n_prompts = 100000 but the built-in chat source "
      "holds 1200 distinct prompts; lower workload.n_prompts or use a file:PATH.jsonl source"]),
    ("a prompt file with fewer prompts than declared",
     {"source": "file:prompts.jsonl"},
     [f"{F}: workload.n_prompts: prompts.jsonl: holds 2 prompts but workload.n_prompts = 8; add "
      "prompts or lower n_prompts"]),
    ("a prompt file with a malformed line",
     {"source": "file:bad.jsonl", "n_prompts": 2},
     [f"{F}: workload.source: bad.jsonl:2: not valid JSON (Expecting value at column 1)"]),
    ("an unknown parameter of the token-id source",
     {"source": "builtin:token-ids?lenght=8"},
     [f"{F}: workload.source: builtin:token-ids?lenght=8: unknown parameter 'lenght'; expected "
      "one of 'length', 'vocab', 'low'"]),
]


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    return tmp_path


def _declare(root: Path, **fields) -> str:
    (root / F).write_text(BASE.format(name="x", **{**DEFAULTS, **fields}))
    return F


def _written(root: Path) -> list[str]:
    """Everything in the project besides its inputs."""
    inputs = {"experiments", F, "prompts.jsonl", "bad.jsonl"}
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if str(p.relative_to(root)) not in inputs)


@pytest.mark.parametrize("case, fields, lines", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_register_refuses_naming_the_file_the_field_and_the_fix(project, case, fields, lines):
    path = _declare(project, **fields)
    result = CliRunner().invoke(cli, ["register", path])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.output == "Error: " + "\n".join(lines) + "\n"
    # nothing written: no registration, no run directory, no run ledger
    assert _written(project) == []
    # and a run has nothing to start from
    run = CliRunner().invoke(cli, ["run", "preregistrations/x.json", "--no-progress"])
    assert run.exit_code == 1
    assert _written(project) == []


@pytest.mark.parametrize("kind, fields, unchecked", [
    ("openai", {"engine_args": 'args = { url = "http://127.0.0.1:8000" }'},
     "engine 'openai': workload.max_tokens against the server's context length, and the model it "
     "serves: the server is started elsewhere and tells them only when it answers (at the run's "
     "start, /v1/models); a pass in which every request fails stops the run"),
    ("vllm-server", {},
     "engine 'vllm-server': workload.max_tokens against the model's context length, for arms "
     "'control', 'treatment': no max_model_len is declared, so vLLM takes the model's own when it "
     "starts; declare engine.args.max_model_len to have it checked at registration (a pass in "
     "which every request fails stops the run)"),
    ("sglang-server", {"treatment_args": "args = { context_length = 4096 }"},
     "engine 'sglang-server': workload.max_tokens against the model's context length, for arm "
     "'control': no context_length is declared, so SGLang takes the model's own when it starts; "
     "declare engine.args.context_length to have it checked at registration (a pass in which "
     "every request fails stops the run)"),
    ("command-server", {"engine_args": 'args = { command = "serve --port {port}" }'},
     "engine 'command-server': that the command starts a server serving the model, and "
     "workload.max_tokens against its context length: each arm's server tells them only when it "
     "answers (at the run's start, /v1/models); a pass in which every request fails stops the "
     "run"),
])
def test_what_an_adapter_cannot_check_is_stated_in_the_design_report(project, kind, fields,
                                                                      unchecked):
    path = _declare(project, **{"kind": kind, "model": "/m", "control_args": "",
                                "treatment_args": "", **fields})
    result = CliRunner().invoke(cli, ["register", path])
    assert result.exit_code == 0, result.output
    assert ("\nNot checked at registration (the engine tells only when it runs):\n"
            f"  - {unchecked}\n") in result.output


def test_an_embedded_model_not_fetched_yet_says_what_waits_for_it(project):
    (project / "model").mkdir()
    (project / "model" / "manifest.json").write_text("{}")   # a model folder, unreadable
    path = _declare(project, model=str(project / "model"))
    result = CliRunner().invoke(cli, ["design", path])
    assert result.exit_code == 0, result.output
    assert (f"  - engine 'embedded': model '{project / 'model'}' is not on this machine yet, so "
            "the prompts' lengths under its chat template (counted as 1 token against "
            "max_model_len) and tensor_parallel_size against its heads are checked when the run "
            f"loads it (`bistat model fetch {project / 'model'}` before registering checks them "
            "here)\n") in result.output
