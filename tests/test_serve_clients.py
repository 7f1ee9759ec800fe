"""``bistat serve`` against real OpenAI-compatible clients from PyPI: the ``openai`` SDK (with
``extra_body``) and ``chain-determinism-harness``, a determinism-testing client that replays a
chat at temperature 0 and compares the replays (both in the ``dev`` extra; the tests skip without
them).

The fields vLLM's and SGLang's servers accept beyond the OpenAI API are honoured where the model
reads them (a chat-template switch its template renders), accepted where they cannot change the
output (and logged), refused where they would: the logprobs of a request carrying the switches a
determinism client sends are bitwise those of the same request without them, and those of the
engine run in-process on the prompt the template renders.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from bistat.engines.base import GenerationRequest
from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.serve.server import BackgroundServer, create_app
from bistat.model.testing import tiny_random_model
from bistat.model.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

MAX_LEN = 512
SYSTEM = "You answer in one word."
USER = "Name a colour."
#: The switches a determinism-testing client sends with its chat payload: a chat-template switch,
#: a reasoning effort, and the reasoning outputs of vLLM and SGLang, none of which this model reads.
SWITCHES = {"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False,
            "separate_reasoning": False, "top_k": -1, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "skip_special_tokens": True}
#: A template that reads ``enable_thinking`` (as Qwen3's does): the switch changes the prompt.
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined "
                     "and not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(0, tokenizer="byte", max_position_embeddings=MAX_LEN)


def _serve(model, tokenizer=None):
    engine = EmbeddedEngine(model, gemm="invariant", max_batch_size=4, max_model_len=MAX_LEN)
    app = create_app(engine, tokenizer or model.tokenizer, model_name="tiny",
                     max_model_len=MAX_LEN, vocab_size=int(model.config.vocab_size))
    return BackgroundServer(app)


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, **extra):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": USER}],
        max_tokens=12, temperature=0, seed=0, logprobs=True, top_logprobs=3, **extra)
    c = r.choices[0]
    return ([t.token for t in c.logprobs.content], [t.logprob for t in c.logprobs.content],
            [[(a.token, a.logprob) for a in t.top_logprobs] for t in c.logprobs.content],
            r.usage.prompt_tokens)


def test_the_openai_sdk_with_a_determinism_client_s_switches_gets_bitwise_the_same_logprobs(
        model, caplog):
    """With the switches (``extra_body``) and ``reasoning_effort``: HTTP 200, and the tokens,
    logprobs and top logprobs are bitwise those without them, and those of the engine in-process
    on the rendered prompt; each switch accepted without effect is logged once."""
    caplog.set_level(logging.WARNING, logger="bistat.engines.serve.server")
    with _serve(model) as srv:
        client = _client(srv)
        plain = _chat(client)
        switched = [_chat(client, reasoning_effort="low", extra_body=SWITCHES) for _ in range(3)]
    assert all(s == plain for s in switched)      # floats compared with ==: bitwise
    prompt = model.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": USER}])
    engine = EmbeddedEngine(model, gemm="invariant", max_batch_size=1, max_model_len=MAX_LEN)
    (ref,) = engine.generate([GenerationRequest(prompt_id="r", prompt=prompt, max_tokens=12,
                                                temperature=0.0, seed=0, logprobs=3)])
    assert plain[1] == [float(x) for x in ref.logprobs]
    assert plain[3] == ref.n_prompt_tokens
    accepted = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("accepted request field")]
    assert len(accepted) == 7, accepted      # 6 fields (top_k is honoured) and reasoning_effort
    assert ("accepted request field chat_template_kwargs.enable_thinking = False without effect: "
            "this model's chat template does not read 'enable_thinking', so the prompt is the same "
            "without it") in accepted
    assert ("accepted request field reasoning_effort = 'low' without effect: this model's chat "
            "template does not read 'reasoning_effort', so the prompt is the same without it"
            ) in accepted
    assert ("accepted request field include_reasoning = False without effect: it does not change "
            "the tokens generated") in accepted


def test_a_template_switch_the_template_reads_is_honoured(model):
    """A template that reads ``enable_thinking``: the switch reaches it (the prompt gains its
    empty think block), as vLLM passes ``chat_template_kwargs`` to the template."""
    base = model.tokenizer
    thinking = Tokenizer(base.backend, THINKING_TEMPLATE, bos_token_id=base.bos_token_id,
                         eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    with _serve(model, thinking) as srv:
        client = _client(srv)
        on = _chat(client)
        off = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on[3] == len(thinking.encode(thinking.apply_chat_template(messages)))
    assert off[3] == len(thinking.encode(thinking.apply_chat_template(messages,
                                                                      enable_thinking=False)))
    assert off[3] == on[3] + len(thinking.encode("<think></think>"))


@pytest.mark.parametrize("extra, message", [
    ({"presence_penalty": 0.5}, "presence_penalty = 0.5 penalises tokens already present, which "
                                "bistat serve does not implement; send 0 or leave it out"),
    ({"logit_bias": {"5": 10}}, "logit_bias = {'5': 10} adds biases to the logits, which bistat "
                                "serve does not implement; send {} or leave it out"),
    ({"tool_choice": "required"}, "tool_choice: 'required' needs a tool call, which bistat serve "
                                  "does not make; send \"none\" or \"auto\" or leave it out"),
    ({"temprature": 0}, "unknown field 'temprature': neither bistat serve nor vLLM's or SGLang's "
                        "OpenAI servers know it, and ignoring it would change what is measured; "
                        "did you mean 'temperature'? the fields bistat serve implements: "),
])
def test_a_field_that_would_change_the_output_is_refused_naming_it(model, extra, message):
    with _serve(model) as srv:
        with pytest.raises(openai.BadRequestError) as exc:
            _chat(_client(srv), extra_body=extra)
    err = exc.value.body
    assert err["message"].startswith(message), err["message"]
    assert err["param"] == next(iter(extra))


def test_chain_determinism_harness_replays_agree(model):
    """``chain-determinism-harness`` replays one question four times at once (batched together)
    at temperature 0 with its 22 tool schemas and ``tool_choice = "auto"``: the template renders
    no tools, so the model answers in text, as one that chose no tool. Every replay succeeds
    (before, each was a 400 the harness records as an error) and all four agree."""
    cdh = pytest.importorskip("chain_determinism_harness")
    with _serve(model) as srv:
        client = cdh.make_client(base_url=srv.url + "/v1", api_key="unused")

        async def replays():
            return await asyncio.gather(*(cdh.run_one_replay(
                client, "tiny", SYSTEM, USER, cdh.TOOL_SCHEMAS_OPENAI, temperature=0.0,
                max_tokens=12, stub_tool_response=cdh.stub_tool_response) for _ in range(4)))

        runs = asyncio.run(replays())
    assert [r["error_category"] for r in runs] == [None] * 4, runs
    assert runs[0]["rationale"] and all(r["rationale"] == runs[0]["rationale"] for r in runs)
    assert all(r["tool_call_sequence"] == [] for r in runs)
