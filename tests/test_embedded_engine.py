"""EmbeddedEngine: continuous batching, the loop thread, stopping, errors, sampling options."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.base import GenerationRequest
from helpers_embedded import tiny


@pytest.fixture(scope="module")
def model():
    return tiny(0)


def _req(pid, prompt="Hello there", n=8, **kw):
    return GenerationRequest(pid, prompt, n, ignore_eos=True, **kw)


def test_continuous_batching_requests_join_and_leave(model):
    eng = EmbeddedEngine(model, "blas", max_batch_size=4)
    lengths = [3, 9, 5, 12, 4, 7, 6, 10, 2, 8]
    results = eng.generate([_req(str(i), f"prompt {i}", n) for i, n in enumerate(lengths)])
    assert [len(r.token_ids) for r in results] == lengths
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    sizes = [b for _, b in eng.step_log]
    assert max(sizes) == 4 and sizes[0] == 4
    # 64 tokens over at most 4 requests a step: fewer steps than tokens, and a full batch most of the time
    assert sum(lengths) / 4 <= len(sizes) < sum(lengths)
    assert sizes[-1] < 4  # the tail drains
    m = eng.metrics()
    assert m["generation_tokens_total"] == sum(lengths)
    assert m["prompt_tokens_total"] == sum(r.n_prompt_tokens for r in results)
    assert (m["num_requests_running"], m["num_requests_waiting"], m["num_preemptions_total"]) == (0, 0, 0)


def test_loop_thread_serves_concurrent_submitters(model):
    eng = EmbeddedEngine(model, "invariant", max_batch_size=8)
    reference = EmbeddedEngine(model, "invariant").generate([_req("ref", "prompt 3", 6)])[0]
    eng.start()
    try:
        futures: list = []
        lock = threading.Lock()

        def client(k):
            for i in range(4):
                f = eng.submit(_req(f"{k}-{i}", f"prompt {i}", 6))
                with lock:
                    futures.append(f)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [f.result(timeout=60) for f in futures]
    finally:
        eng.stop()
    assert len(results) == 20 and all(r.error is None and len(r.token_ids) == 6 for r in results)
    for r in results:
        assert r.t_submit <= r.t_first_token <= r.t_done
        if r.prompt_id.endswith("-3"):
            assert r.token_ids == reference.token_ids and r.logprobs == reference.logprobs
    assert max(b for _, b in eng.step_log) > 1  # concurrent requests were batched


def test_stop_resolves_unfinished_requests_with_an_error(model):
    eng = EmbeddedEngine(model, "blas")
    futures = [eng.submit(_req(str(i), n=50)) for i in range(3)]  # queued, loop never started
    eng.stop()
    for f in futures:
        r = f.result(timeout=5)
        assert r.error == "engine stopped before the request finished" and r.finish_reason is None


@pytest.mark.parametrize("req,message", [
    (GenerationRequest("long", list(range(3, 60)), 10), "request long: prompt (57 tokens) + max_tokens (10) "
     "exceeds max_model_len=64; lower max_tokens or raise max_model_len"),
    (GenerationRequest("tok", [3, 999999], 4), "request tok: token id 999999 outside the vocabulary [0, "),
    (GenerationRequest("zero", "hi", 0), "request zero: max_tokens (0) must be at least 1"),
    (GenerationRequest("chat", [5, 6], 4, chat=True), "request chat: chat=True needs a text prompt"),
    (GenerationRequest("empty", [], 4), "request empty: the prompt is empty"),
])
def test_invalid_requests_resolve_with_an_error(model, req, message):
    eng = EmbeddedEngine(model, "blas", max_model_len=64)
    r = eng.submit(req).result(timeout=5)
    assert r.error is not None and r.error.startswith(message), r.error
    assert r.token_ids == [] and r.prompt_id == req.prompt_id


def test_constructor_rejects_unknown_gemm_mode(model):
    with pytest.raises(ValueError, match=r"gemm \('fast'\) must be one of 'blas' or 'invariant'"):
        EmbeddedEngine(model, "fast")


def test_eos_stops_unless_ignored(model):
    w = dict(model.weights)
    emb = w["model.embed_tokens.weight"].copy()
    emb[model.config.eos_token_id] *= 50  # the tied head now always prefers EOS
    m = dataclasses.replace(model, weights={**w, "model.embed_tokens.weight": emb})
    eng = EmbeddedEngine(m, "blas")
    stop, cont = eng.generate([GenerationRequest("a", "Hi", 5), GenerationRequest("b", "Hi", 5, ignore_eos=True)])
    assert stop.finish_reason == "stop" and stop.token_ids == [2] and stop.text == ""
    assert cont.finish_reason == "length" and len(cont.token_ids) == 5


def test_chat_template_and_top_logprobs(model):
    eng = EmbeddedEngine(model, "blas")
    r = eng.generate([GenerationRequest("c", "What is the capital of France?", 4, chat=True, logprobs=3)])[0]
    tok = model.tokenizer
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    assert r.n_prompt_tokens == len(expected)
    assert len(r.top_logprobs) == len(r.token_ids) == len(r.logprobs)
    for chosen, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs):
        assert len(top) == 3 and top[0] == (chosen, lp)  # greedy: the chosen token is the best
        assert [x for _, x in top] == sorted((x for _, x in top), reverse=True)
    assert r.text == tok.decode(r.token_ids)
    no_top = eng.generate([GenerationRequest("n", "Hi", 3, logprobs=0, ignore_eos=True)])[0]
    assert no_top.top_logprobs is None and len(no_top.logprobs) == 3


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    w = dict(model.weights)
    w["model.norm.weight"] = w["model.norm.weight"] * np.float32(0.02)  # flatter logits: sampling varies
    eng = EmbeddedEngine(dataclasses.replace(model, weights=w), "blas")
    kw = dict(temperature=1.5, top_p=0.98, n=20)
    a, b, c = eng.generate([_req("a", seed=1, **kw), _req("b", seed=1, **kw), _req("c", seed=2, **kw)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = eng.generate([_req("g", n=20)])[0]
    assert a.token_ids != greedy.token_ids
    assert all(lp <= 0 for lp in a.logprobs) and not np.allclose(a.logprobs, 0)


def test_engines_can_share_prepared_weights(model):
    blas = EmbeddedEngine(model, "blas")
    inv = EmbeddedEngine(model, "invariant", prepared=blas.weights)
    assert inv.weights is blas.weights
    a = blas.generate([_req("a", n=5)])[0]
    b = inv.generate([_req("b", n=5)])[0]
    assert a.token_ids == b.token_ids  # peaked tiny model: same greedy tokens in both modes


def test_scheduler_chunks_prompts_at_fixed_boundaries_within_the_token_budget(model):
    eng = EmbeddedEngine(model, "blas", max_batch_size=2, prefill_chunk=8, max_num_batched_tokens=12)
    prompts = [list(range(3, 23)), list(range(3, 8))]  # 20 and 5 tokens
    futures = [eng.submit(GenerationRequest(str(i), p, 2, ignore_eos=True)) for i, p in enumerate(prompts)]
    plans = []
    while not all(f.done() for f in futures):
        eng._step()
        plans.append([(s.seq.request.prompt_id, s.start, len(s.tokens))
                      for s in eng.scheduler.last_plan])
    # request 0: chunks [0, 8), [8, 16), [16, 20); request 1 joins when its 5 tokens fit the budget
    assert plans[0] == [("0", 0, 8)]
    assert plans[1] == [("0", 8, 8)]
    assert plans[2] == [("0", 16, 4), ("1", 0, 5)]
    assert plans[3] == [("0", 20, 1), ("1", 5, 1)]


def test_scheduler_rejects_a_budget_too_small_for_a_chunk(model):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=10 must be at least max_batch_size \+ "
                                         r"prefill_chunk = 40"):
        EmbeddedEngine(model, "blas", max_batch_size=32, prefill_chunk=8, max_num_batched_tokens=10)
