"""Shared helpers for the embedded engine's tests: tiny random LLaMAs (one with built-in near-ties), and an
independent float64 reference forward pass (no batching, no KV cache).

The reference is written from the Hugging Face LLaMA definition (``modeling_llama.py``) directly,
sharing no code with :mod:`bistat.engines.embedded`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from bistat.model.testing import tiny_random_model


def tiny(seed: int = 0, **config: Any):
    """``tiny_random_model`` with the in-memory byte-level tokenizer (independent of the cache)."""
    return tiny_random_model(seed, tokenizer="byte", **config)


def near_tie_model(seed: int = 0, rel: float = 3e-6, **config: Any):
    """A tiny random model whose greedy choices are near-ties by construction.

    Untied output projection in which row ``2j + 1`` equals row ``2j`` up to a relative
    perturbation of ``rel`` (about 25 float32 ulps): the two logits of each pair differ by about as
    much as float32 rounding changes them, so which of the pair wins depends on the order of the
    GEMM's sums. Real models have such near-ties by chance (a large vocabulary, thirty layers);
    a two-layer random model needs them built in.
    """
    m = tiny_random_model(seed, tokenizer="byte", tie_word_embeddings=False, **config)
    w = dict(m.weights)
    head = w["lm_head.weight"].copy()  # [V, D]
    n = head.shape[0] // 2 * 2
    rng = np.random.default_rng(seed + 1)
    noise = (1 + rel * rng.standard_normal(head[0:n:2].shape)).astype(np.float32)
    head[1:n:2] = head[0:n:2] * noise
    w["lm_head.weight"] = head
    return dataclasses.replace(m, weights=w, name=f"near-tie-{seed}")


def real_model_or_skip():
    """SmolLM2-135M from the cache, or skip with the reason."""
    try:
        from bistat.model import load_model
    except ImportError as exc:
        pytest.skip(f"bistat.model.load_model unavailable: {exc}")
    try:
        from bistat.model.errors import ModelError
    except ImportError:
        ModelError = Exception  # noqa: N806
    try:
        return load_model("smollm2-135m")
    except ModelError as exc:
        pytest.skip(f"smollm2-135m not cached (run `bistat model fetch smollm2-135m`): {exc}")


def reference_logits(config: Any, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Float64 logits [T, V] of a whole sequence, causal, no cache: HF LLaMA written out plainly."""
    c = config
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    t = len(ids)
    hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def norm(x, g):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + c.rms_norm_eps) * g

    inv = 1.0 / c.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [T, heads, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
        out = np.empty((t, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def prefilled(wt: Any, mode: str, n: int, seed: int = 0, max_len: int = 256) -> list:
    """``n`` KV caches of different lengths, each prefilled alone, and each one's next token:
    ``(cache, token, position)`` per sequence, for :func:`decode_logits`."""
    from bistat.engines.embedded.forward import Segment, forward_step
    from bistat.engines.embedded.kvcache import KVCache

    rng = np.random.default_rng(seed)
    d = wt.dims
    out = []
    for i in range(n):
        ids = rng.integers(3, d.vocab_size, size=5 + (7 * i) % 23).tolist()
        cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, max_len)
        logits = forward_step(wt, [Segment(cache, ids, 0, True)], mode)
        out.append((cache, int(np.argmax(logits[0])), len(ids)))
    return out


def decode_logits(wt: Any, mode: str, seqs: list, order: list[int]) -> np.ndarray:
    """One decode step of the :func:`prefilled` sequences ``order`` (in that order): their logits."""
    from bistat.engines.embedded.forward import Segment, forward_step

    return forward_step(wt, [Segment(seqs[j][0], [seqs[j][1]], seqs[j][2], True) for j in order],
                        mode)
