"""Batch (in)variance of the embedded engine: ``invariant`` is bitwise batch-independent, ``blas`` is not.

Never rerun these tests on failure: a flaky difference is exactly what they measure.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers_embedded import (
    decode_logits,
    near_tie_model,
    prefilled,
    real_model_or_skip,
    tiny,
)

from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.embedded.forward import Segment, forward_step, prepare_weights
from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.base import GenerationRequest

PROMPTS = [f"Prompt number {i}: tell me a story about {w}." for i, w in
           enumerate(["the sea", "a fox", "Paris", "numbers", "a cat", "rain", "stars", "bread"] * 5)]


def test_invariant_logits_bitwise_equal_at_every_batch_size_and_position():
    m = tiny(0, hidden_size=128, intermediate_size=384, head_dim=32)
    wt = prepare_weights(m.config, m.weights, 256)
    seqs = prefilled(wt, "invariant", 40)
    alone = [decode_logits(wt, "invariant", seqs, [j])[0] for j in range(40)]
    for b in range(1, 41):
        members = list(range(b))
        for shift in {0, b // 2, b - 1}:
            order = members[shift:] + members[:shift]  # every member at a new position
            logits = decode_logits(wt, "invariant", seqs, order)
            bad = [j for pos, j in enumerate(order) if not np.array_equal(logits[pos], alone[j])]
            assert not bad, f"batch {b}, rotation {shift}: requests {bad} changed"


def test_invariant_logits_unchanged_by_prefill_rows_in_the_same_step():
    m = tiny(1)
    wt = prepare_weights(m.config, m.weights, 256)
    seqs = prefilled(wt, "invariant", 6)
    alone = decode_logits(wt, "invariant", seqs, [0])[0]
    d = wt.dims
    for n_prefill in (1, 9, 50):
        newcomer = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 256)
        segs = [Segment(newcomer, list(range(3, 3 + n_prefill)), 0, True)]
        segs += [Segment(c, [t], p, True) for c, t, p in seqs]
        logits = forward_step(wt, segs, "invariant")
        assert np.array_equal(logits[1], alone), f"{n_prefill} prefill rows changed a decode row"


def test_blas_logits_depend_on_the_batch():
    """Negative control for the test above: the same check with numpy's BLAS finds differences."""
    m = tiny(0, hidden_size=128, intermediate_size=384, head_dim=32)
    wt = prepare_weights(m.config, m.weights, 256)
    seqs = prefilled(wt, "blas", 40)
    alone = decode_logits(wt, "blas", seqs, [0])[0]
    changed = [b for b in range(2, 41)
               if not np.array_equal(decode_logits(wt, "blas", seqs, list(range(b)))[0], alone)]
    assert changed, "blas mode gave bitwise equal logits at every batch size 2..40"


def _generate(eng, target, neighbours, position, **kw):
    reqs = [GenerationRequest(f"n{i}", p, 24, ignore_eos=True, **kw) for i, p in enumerate(neighbours)]
    reqs.insert(position, GenerationRequest("target", target, 24, ignore_eos=True, **kw))
    return {r.prompt_id: r for r in eng.generate(reqs)}["target"]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)],
                         ids=["greedy", "seeded"])
def test_invariant_engine_tokens_and_logprobs_independent_of_neighbours(sampling):
    """Near-tie model (blas flips its greedy choices, see below): invariant mode stays bitwise equal."""
    m = near_tie_model(0)
    eng = EmbeddedEngine(m, "invariant", max_batch_size=40, prefill_chunk=16)
    target = PROMPTS[0]
    alone = _generate(eng, target, [], 0, **sampling)
    for b, pos in [(2, 1), (3, 0), (5, 4), (8, 3), (16, 15), (17, 8), (33, 32), (40, 20)]:
        got = _generate(eng, target, PROMPTS[1:b], pos, **sampling)
        assert got.token_ids == alone.token_ids, f"batch {b}, position {pos}: tokens changed"
        assert np.array_equal(np.array(got.logprobs), np.array(alone.logprobs)), f"batch {b}, position {pos}"
        assert got.top_logprobs == alone.top_logprobs


def _find_neighbour_dependent_prompt(model, prompts, max_tokens, chat=False):
    """Search, in order, for a prompt whose greedy output alone differs from that in a full batch.

    All prompts run together once (``len(prompts)`` rows per decode step). Each prompt is then
    replayed alone (one row per step) along its batched output, stopping at the first position
    where the lone greedy choice differs: up to there both runs saw the same tokens, so that is
    exactly where a lone run diverges. The find is then confirmed by a real lone run.
    Returns ``(index, position, together_result, alone_result)`` or None.
    """
    eng = EmbeddedEngine(model, "blas", max_batch_size=len(prompts))
    reqs = [GenerationRequest(str(i), p, max_tokens, ignore_eos=True, chat=chat) for i, p in enumerate(prompts)]
    together = eng.generate(reqs)
    wt, d = eng.weights, eng.weights.dims
    for i, req in enumerate(reqs):
        ids = eng.encode_prompt(req)
        cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, eng.max_model_len)
        logits = forward_step(wt, [Segment(cache, ids, 0, True)], "blas")[0]
        for j, tok in enumerate(together[i].token_ids):
            if int(np.argmax(logits)) != tok:
                alone = eng.generate([dataclasses.replace(req, max_tokens=j + 1)])[0]
                return i, j, together[i], alone
            logits = forward_step(wt, [Segment(cache, [tok], len(ids) + j, True)], "blas")[0]
    return None


def _assert_found(found, what):
    assert found is not None, f"no {what} prompt changed its greedy output between alone and in a batch"
    i, j, together, alone = found
    assert alone.token_ids[:j] == together.token_ids[:j]
    assert alone.token_ids[j] != together.token_ids[j], (i, j)


def test_blas_finds_a_prompt_whose_greedy_output_changes_with_its_neighbours():
    _assert_found(_find_neighbour_dependent_prompt(near_tie_model(0), PROMPTS[:8], 24), "near-tie model")


@pytest.mark.model
def test_blas_real_model_logprobs_change_with_neighbours():
    """SmolLM2-135M in blas mode: a request's logprobs alone differ (bitwise) from those in a batch.

    A greedy *token* flip needs a top-2 logit gap below the perturbation: on this machine's
    OpenBLAS (SkylakeX kernels; M=1 GEMV vs M>=2 GEMM) the perturbation is ~1e-5 while the smallest
    gap seen in 8 chat prompts x 128 tokens was 2e-3, so greedy flips are too rare to find within a
    test's budget with the real model; the near-tie test above finds them.
    """
    model = real_model_or_skip()
    eng = EmbeddedEngine(model, "blas", max_batch_size=4)
    prompts = ["What is the capital of France?", "Write a short poem about the sea.",
               "Tell me a joke about cats.", "How do I bake bread?"]
    reqs = [GenerationRequest(str(i), p, 8, ignore_eos=True, chat=True) for i, p in enumerate(prompts)]
    together = eng.generate(reqs)[0]
    alone = eng.generate(reqs[:1])[0]
    assert together.logprobs != alone.logprobs
    np.testing.assert_allclose(together.logprobs, alone.logprobs, atol=1e-3)


@pytest.mark.model
def test_invariant_real_model_bitwise_independent_of_neighbours():
    model = real_model_or_skip()
    eng = EmbeddedEngine(model, "invariant", max_batch_size=9)
    target = "What is the capital of France?"
    others = ["Write a short poem about the sea.", "Explain how photosynthesis works.",
              "Tell me a joke about cats.", "How do I bake bread?", "What is machine learning?",
              "Describe the city of Paris.", "Why is the sky blue?", "List five fruits."]
    alone = _generate(eng, target, [], 0, chat=True)
    for b, pos in [(2, 1), (9, 4)]:
        got = _generate(eng, target, others[:b - 1], pos, chat=True)
        assert got.token_ids == alone.token_ids, f"batch {b}, position {pos}"
        assert np.array_equal(np.array(got.logprobs), np.array(alone.logprobs)), f"batch {b}, position {pos}"
