"""``bistat serve``'s ASGI app over a fake engine: routes, wire format, errors, metrics, batching."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bistat.engines.serve.server import BackgroundServer
from helpers_serve import EOS, ByteTokenizer, expected_logprob, expected_token, fake_app

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def served():
    app, engine = fake_app(max_batch_size=8, step_s=0.002)
    with BackgroundServer(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            yield client, engine
    assert engine.started == 1 and engine.stopped == 1


def _expected_ids(prompt_ids, n, seed=None, temperature=0.0):
    return [expected_token(prompt_ids, i, seed, temperature) for i in range(n)]


def test_completion_token_id_prompt_with_logprobs(served):
    client, _ = served
    r = client.post("/v1/completions", json={
        "model": "fake-model", "prompt": [10, 11, 12], "max_tokens": 4, "temperature": 0,
        "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200
    body = r.json()
    ids = _expected_ids([10, 11, 12], 4)
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert choice["token_ids"] == ids
    assert choice["prompt_token_ids"] == [10, 11, 12]
    assert choice["text"] == TOK.decode(ids)
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["token_logprobs"] == [expected_logprob(t, i) for i, t in enumerate(ids)]
    assert lp["top_logprobs"][0] == {f"token_id:{ids[0]}": expected_logprob(ids[0], 0),
                                     f"token_id:{ids[0] + 1}": expected_logprob(ids[0], 0) - 1}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_completion_text_prompt_tokens_are_strings_without_token_id_flag(served):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 0})
    choice = r.json()["choices"][0]
    ids = _expected_ids(TOK.encode("abc"), 3)
    assert "token_ids" not in choice
    assert choice["logprobs"]["tokens"] == [TOK.decode([t]) for t in ids]
    # logprobs=0: only the chosen token in each top_logprobs entry (vLLM's behaviour)
    assert [len(d) for d in choice["logprobs"]["top_logprobs"]] == [1, 1, 1]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]


def test_completion_batch_prompt_gives_one_choice_each(served):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2,
                                             "return_token_ids": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["token_ids"] for c in choices] == [_expected_ids([5, 6], 2), _expected_ids([7, 8, 9], 2)]
    assert choices[0]["logprobs"] is None


def test_seed_changes_sampled_output_only_when_temperature_positive(served):
    client, _ = served
    def ids(**kw):
        body = {"prompt": [20, 21], "max_tokens": 6, "return_token_ids": True, **kw}
        return client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert ids(temperature=0, seed=1) == ids(temperature=0, seed=2)
    assert ids(temperature=0.7, seed=1) == _expected_ids([20, 21], 6, 1, 0.7)
    assert ids(temperature=0.7, seed=1) != ids(temperature=0.7, seed=2)


def test_stop_string_cuts_text_and_tokens(served):
    client, _ = served
    full = client.post("/v1/completions", json={"prompt": [30, 31], "max_tokens": 12,
                                                "return_token_ids": True}).json()["choices"][0]
    stop = full["text"][5:7]
    first = full["text"].find(stop)
    cut = client.post("/v1/completions", json={"prompt": [30, 31], "max_tokens": 12, "stop": stop,
                                               "return_token_ids": True}).json()["choices"][0]
    assert cut["text"] == full["text"][:first]
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == full["token_ids"][:first + len(stop)]


def test_eos_ends_generation_unless_ignored():
    app, _ = fake_app(eos_after=2)
    with BackgroundServer(app) as srv:
        stop = httpx.post(srv.url + "/v1/completions", json={
            "prompt": [40], "max_tokens": 5, "return_token_ids": True}).json()["choices"][0]
        cont = httpx.post(srv.url + "/v1/completions", json={
            "prompt": [40], "max_tokens": 5, "ignore_eos": True,
            "return_token_ids": True}).json()["choices"][0]
    assert stop["token_ids"] == _expected_ids([40], 2) + [EOS]
    assert stop["finish_reason"] == "stop"
    assert cont["token_ids"] == _expected_ids([40], 5)
    assert cont["finish_reason"] == "length"


def test_chat_completion_applies_template_and_returns_chat_logprobs(served):
    client, _ = served
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 1, "return_token_ids": True})
    body = r.json()
    prompt_ids = TOK.encode(TOK.apply_chat_template(messages))
    ids = _expected_ids(prompt_ids, 3)
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": TOK.decode(ids)}
    assert choice["token_ids"] == ids
    assert [c["token"] for c in choice["logprobs"]["content"]] == [TOK.decode([t]) for t in ids]
    assert [len(c["top_logprobs"]) for c in choice["logprobs"]["content"]] == [1, 1, 1]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_multi_message_chat_is_templated_by_the_server(served):
    client, _ = served
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2,
                                                  "return_token_ids": True})
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert r.json()["choices"][0]["token_ids"] == _expected_ids(
        TOK.encode(TOK.apply_chat_template(flat)), 2)


def test_models_health_version(served):
    client, _ = served
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == 512
    assert client.get("/version").json()["gemm"] == "fake"


def _error(r):
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize("payload, status, param, message", [
    (b"{", 400, None, "the request body is not valid JSON: Expecting property name enclosed in "
                      "double quotes: line 1 column 2 (char 1)"),
    (b"[1, 2]", 400, None, "the request body must be a JSON object"),
    ({"max_tokens": 3}, 400, "prompt", "prompt: Field required"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature",
     "temperature: Input should be greater than or equal to 0"),
    ({"prompt": "x", "top_k": -5}, 400, "top_k",
     "top_k: top_k must be -1 (off) or a positive integer"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs: Input should be less than or equal to 20"),
    ({"prompt": "x", "stream": True}, 400, "stream",
     "stream: streaming is not supported by bistat serve; send stream=false"),
    ({"prompt": "x", "n": 2}, 400, "n",
     "n: only n=1 is supported; send the prompt several times instead"),
    ({"prompt": [1, "a"]}, 400, "prompt",
     "prompt: must be a string, a list of token ids, a list of strings or a list of token-id lists"),
    ({"prompt": []}, 400, "prompt", "prompt must not be empty"),
    ({"prompt": ""}, 400, "prompt", "prompt must not be empty"),
    ({"prompt": [1, 999]}, 400, "prompt", "token id 999 is out of range [0, 259)"),
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens",
     "max_tokens=600 plus the prompt's 1 tokens exceeds the maximum context length 512"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model",
     "The model `gpt-4` does not exist; this server serves `fake-model`."),
])
def test_malformed_completion_requests_get_openai_errors(served, payload, status, param, message):
    client, _ = served
    if isinstance(payload, bytes):
        r = client.post("/v1/completions", content=payload,
                        headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json=payload)
    code, err = _error(r)
    assert code == status
    assert err == {"message": message, "type": "NotFoundError" if status == 404 else
                   "invalid_request_error", "param": param, "code": status}


def test_malformed_chat_requests_and_unknown_routes(served):
    client, _ = served
    assert _error(client.post("/v1/chat/completions", json={"messages": []})) == (400, {
        "message": "messages: List should have at least 1 item after validation, not 0",
        "type": "invalid_request_error", "param": "messages", "code": 400})
    assert _error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})) == (400, {
        "message": "top_logprobs needs logprobs=true", "type": "invalid_request_error",
        "param": None, "code": 400})
    assert _error(client.get("/v1/nothing")) == (404, {
        "message": "GET /v1/nothing: Not Found", "type": "NotFoundError", "param": None,
        "code": 404})
    assert _error(client.get("/v1/completions"))[0] == 405
    assert client.get("/health").status_code == 200  # still alive after all of that


def test_engine_failure_is_a_500_for_that_request_only():
    app, _ = fake_app(fail_prompt="boom")
    with BackgroundServer(app) as srv:
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "boom", "max_tokens": 2})
        good = httpx.post(srv.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert _error(bad) == (500, {"message": "the engine failed: injected engine failure",
                                 "type": "InternalServerError", "param": None, "code": 500})
    assert good.status_code == 200


def _metric_values(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:"):
                out[s.name] = (s.value, s.labels)
    return out


def test_concurrent_requests_share_engine_steps_and_metrics_count_tokens():
    app, engine = fake_app(max_batch_size=8, step_s=0.01)
    n, max_tokens = 8, 10
    with BackgroundServer(app) as srv:
        before = _metric_values(httpx.get(srv.url + "/metrics").text)
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futs = [pool.submit(httpx.post, srv.url + "/v1/completions",
                                json={"prompt": [50 + i], "max_tokens": max_tokens},
                                timeout=30) for i in range(n)]
            assert all(f.result().status_code == 200 for f in futs)
        after = _metric_values(httpx.get(srv.url + "/metrics").text)
    assert before["vllm:generation_tokens_total"] == (0.0, {"model_name": "fake-model"})
    assert after["vllm:generation_tokens_total"][0] == n * max_tokens
    assert after["vllm:prompt_tokens_total"][0] == n
    assert after["vllm:num_requests_running"][0] == 0.0
    assert after["vllm:num_preemptions_total"][0] == 0.0
    # batching: some engine step ran several HTTP requests together
    assert max(size for _, size in engine.step_log) >= 4


def test_serve_command_help_and_loopback_default():
    from click.testing import CliRunner

    from bistat.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output.startswith("Usage: cli serve [OPTIONS]\n")
    cmd = cli.commands["serve"]
    defaults = {p.name: p.default for p in cmd.params}
    assert defaults["host"] == "127.0.0.1"
    assert (defaults["model_name"], defaults["gemm"], defaults["max_batch_size"],
            defaults["port"]) == ("smollm2-135m", "blas", 32, 8000)
    gemm = next(p for p in cmd.params if p.name == "gemm")
    assert list(gemm.type.choices) == ["blas", "invariant"]
