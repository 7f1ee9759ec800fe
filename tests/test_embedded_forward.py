"""Accuracy of the embedded forward pass against independent references.

Tolerances: the engine computes in float32. Against the float64 reference written in
``helpers_embedded.reference_logits`` the logits agree within ``atol = 2e-4 + 2e-5 * max|logit|``
for the tiny models, and within ``1e-3`` absolute for SmolLM2-135M (30 layers, |logit| up to ~38;
measured: 5.8e-5). Against transformers' ``LlamaForCausalLM`` in float32: ``1e-4 * max|logit|``
for the tiny model and ``1e-3`` for SmolLM2-135M (measured: 9.8e-5; transformers itself is 8.9e-5
from the float64 reference). Float32 rounding differs between implementations (summation order
of each GEMM), so bitwise agreement with either reference is not expected.
"""

from __future__ import annotations

import numpy as np
import pytest

from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.embedded.forward import Segment, forward_step, prepare_weights
from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.base import GenerationRequest
from helpers_embedded import real_model_or_skip, reference_logits, tiny


def _engine_logits(model, ids, mode, chunk):
    """Logits [T, V] of every position: prefill in chunks of ``chunk`` tokens, each chunk's rows
    one at a time through decode-shaped steps after the first chunk."""
    wt = prepare_weights(model.config, model.weights, 512)
    d = wt.dims
    cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 512)
    rows = [forward_step(wt, [Segment(cache, ids[:1], 0, True)], mode)[0]]
    pos = 1
    while pos < len(ids):
        n = min(chunk, len(ids) - pos)
        for j in range(n):  # one position per step: every row's logits are returned
            rows.append(forward_step(wt, [Segment(cache, ids[pos + j:pos + j + 1], pos + j, True)], mode)[0])
        pos += n
    return np.stack(rows)


@pytest.mark.parametrize("mode", ["blas", "invariant"])
def test_logits_match_float64_reference(mode):
    m = tiny(3, hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=3)
    ids = np.random.default_rng(0).integers(3, m.config.vocab_size, size=40).tolist()
    got = _engine_logits(m, ids, mode, 40)
    ref = reference_logits(m.config, m.weights, ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 + 2e-5 * np.abs(ref).max())


def test_prefill_chunks_and_whole_prompt_agree():
    m = tiny(4)
    ids = np.random.default_rng(1).integers(3, m.config.vocab_size, size=70).tolist()
    ref = reference_logits(m.config, m.weights, ids)[-1]
    for chunk in (8, 16, 64, 256):
        eng = EmbeddedEngine(m, "invariant", prefill_chunk=chunk)
        res = eng.generate([GenerationRequest("x", ids, 1, logprobs=5)])[0]
        lse = np.log(np.exp(ref - ref.max()).sum()) + ref.max()
        assert res.token_ids == [int(np.argmax(ref))], chunk
        assert res.logprobs[0] == pytest.approx(ref.max() - lse, abs=1e-4), chunk
        assert [t for t, _ in res.top_logprobs[0]] == np.argsort(-ref, kind="stable")[:5].tolist()


def _transformers_or_skip():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install torch==2.13.0)")
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    return torch, transformers


def _hf_model(torch, transformers, model):
    cfg = transformers.LlamaConfig(**model.config.to_hf_dict())
    hf = transformers.LlamaForCausalLM(cfg).eval().to(torch.float32)
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in model.weights.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def test_logits_match_transformers_llama():
    torch, transformers = _transformers_or_skip()
    m = tiny(5, hidden_size=128, intermediate_size=256, head_dim=32)
    ids = np.random.default_rng(2).integers(3, m.config.vocab_size, size=24).tolist()
    hf = _hf_model(torch, transformers, m)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = _engine_logits(m, ids, "blas", 24)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()))


@pytest.mark.model
def test_real_model_greedy_chat_answers_paris():
    model = real_model_or_skip()
    for mode in ("blas", "invariant"):
        eng = EmbeddedEngine(model, mode, max_batch_size=4)
        res = eng.generate([GenerationRequest("france", "What is the capital of France?", 32, chat=True)])[0]
        assert res.error is None
        assert res.text == "The capital of France is Paris.", mode
        assert res.finish_reason == "stop"


@pytest.mark.model
def test_real_model_logits_match_float64_reference():
    model = real_model_or_skip()
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))[:24]
    got = _engine_logits(model, ids, "blas", 24)
    ref = reference_logits(model.config, model.weights, ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.model
def test_real_model_logits_match_transformers_llama():
    torch, transformers = _transformers_or_skip()
    model = real_model_or_skip()
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}]))
    hf = _hf_model(torch, transformers, model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = _engine_logits(model, ids, "invariant", len(ids))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
