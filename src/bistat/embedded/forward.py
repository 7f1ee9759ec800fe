"""The LLaMA forward pass over one engine step: prefill chunks and decode rows in one batch.

Following gpt-fast's split (``prefill`` / ``decode_one_token``, pytorch-labs/gpt-fast
``generate.py``) but with vLLM's chunked prefill: one step is a list of :class:`Segment` s, one
per request — a decode row (one token) or a prefill chunk (several prompt tokens). All rows of all
segments go through each linear layer in ONE GEMM ([rows, K] @ [K, N]); attention runs per segment
on that request's own KV cache. Shapes on every line, as in jaymody/picoGPT ``gpt2.py``.

In the ``"invariant"`` GEMM mode a row's bits depend neither on the other requests of the step
(row-invariant GEMM tiles) nor on whether its token arrived in a prefill chunk or a decode step
(attention computed row by row over exactly the keys the row may see,
:func:`bistat.embedded.ops.attention`): prefill and decode logprobs agree bitwise, which
``bistat probe --mode prefill-decode`` confirms with ``"blas"`` as its negative control.

Weights are prepared once (:func:`prepare_weights`): Q/K/V and gate/up fused by concatenation,
every linear weight transposed to a contiguous ``[in, out]`` array, float32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from bistat.embedded import ops
from bistat.embedded.kvcache import KVCache
from bistat.model.config import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray  # [D]
    qkv: np.ndarray  # [D, (H + 2*KVH) * d]
    o: np.ndarray  # [H*d, D]
    post_norm: np.ndarray  # [D]
    gate_up: np.ndarray  # [D, 2I]
    down: np.ndarray  # [I, D]


@dataclass(frozen=True)
class Weights:
    dims: ModelConfig
    embed: np.ndarray  # [V, D]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [D, V]
    rope_cos: np.ndarray  # [P, d]
    rope_sin: np.ndarray  # [P, d]

    @property
    def nbytes(self) -> int:
        arrays = [self.embed, self.final_norm, self.lm_head, self.rope_cos, self.rope_sin]
        for lw in self.layers:
            arrays += [lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down]
        return sum(a.nbytes for a in arrays)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _t(*parts: np.ndarray) -> np.ndarray:
    """Concatenate [out_i, in] weights along out and transpose: -> contiguous [in, sum out_i]."""
    return np.ascontiguousarray(np.concatenate(parts, axis=0).T, dtype=np.float32)


def prepare_weights(config: ModelConfig | Mapping[str, Any], weights: Mapping[str, np.ndarray], max_positions: int) -> Weights:
    """Fuse and transpose Hugging Face LLaMA weights ([out, in], HF names) for the engine.

    Raises ``KeyError`` naming the missing tensor when the dict lacks one.
    """
    dims = config if isinstance(config, ModelConfig) else ModelConfig.from_hf_dict(dict(config))

    def w(name: str) -> np.ndarray:
        if name not in weights:
            raise KeyError(f"model weights: missing tensor {name!r} (HF LLaMA naming expected)")
        return weights[name]

    layers = []
    for i in range(dims.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            input_norm=_f32(w(p + "input_layernorm.weight")),
            qkv=_t(w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                   w(p + "self_attn.v_proj.weight")),
            o=_t(w(p + "self_attn.o_proj.weight")),
            post_norm=_f32(w(p + "post_attention_layernorm.weight")),
            gate_up=_t(w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")),
            down=_t(w(p + "mlp.down_proj.weight")),
        ))
    embed = _f32(w("model.embed_tokens.weight"))  # [V, D]
    if dims.tie_word_embeddings or "lm_head.weight" not in weights:
        lm_head = _t(embed)  # [D, V]
    else:
        lm_head = _t(w("lm_head.weight"))
    cos, sin = ops.rope_tables(dims.head_dim, dims.rope_theta, max_positions)
    return Weights(dims, embed, tuple(layers), _f32(w("model.norm.weight")), lm_head, cos, sin)


@dataclass
class Segment:
    """One request's rows in a step: tokens at positions ``start .. start + len(tokens) - 1``."""

    cache: KVCache
    tokens: Sequence[int]
    start: int
    want_logits: bool  # True: the last row's logits are needed (decode, or the last prompt chunk)


def forward_step(wt: Weights, segments: Sequence[Segment], mode: str,
                 tile: int = ops.DEFAULT_TILE) -> np.ndarray:
    """Run one step; write every segment's K/V into its cache; return the wanted logits.

    Returns
    -------
    ndarray float32 [S_out, V]: the last row's logits of each segment with ``want_logits``,
    in segment order.
    """
    dims = wt.dims
    h, kvh, d = dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim
    eps = dims.rms_norm_eps
    ids = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in segments])  # [N]
    pos = np.concatenate([np.arange(s.start, s.start + len(s.tokens)) for s in segments])  # [N]
    bounds = np.cumsum([0] + [len(s.tokens) for s in segments])  # [S + 1]
    for s in segments:
        s.cache.reserve(s.start + len(s.tokens))
    cos, sin = wt.rope_cos[pos], wt.rope_sin[pos]  # [N, d], [N, d]
    x = wt.embed[ids]  # [N, D]
    nq, nk = h * d, kvh * d
    for li, lw in enumerate(wt.layers):
        hn = ops.rmsnorm(x, lw.input_norm, eps)  # [N, D]
        qkv = ops.gemm(hn, lw.qkv, mode, tile)  # [N, D] @ [D, (H+2KVH)d] -> [N, (H+2KVH)d]
        q = ops.apply_rope(qkv[:, :nq].reshape(-1, h, d), cos, sin)  # [N, H, d]
        k = ops.apply_rope(qkv[:, nq:nq + nk].reshape(-1, kvh, d), cos, sin)  # [N, KVH, d]
        v = qkv[:, nq + nk:].reshape(-1, kvh, d)  # [N, KVH, d]
        attn = np.empty((len(ids), nq), dtype=np.float32)  # [N, H*d]
        for si, s in enumerate(segments):
            a, b = bounds[si], bounds[si + 1]
            kc, vc = s.cache.write(li, s.start, k[a:b], v[a:b])  # [KVH, T, d] each
            attn[a:b] = ops.attention(q[a:b], kc, vc, s.start,  # [C, H*d]
                                      row_by_row=mode == "invariant")
        x = x + ops.gemm(attn, lw.o, mode, tile)  # [N, H*d] @ [H*d, D] -> [N, D]
        hn = ops.rmsnorm(x, lw.post_norm, eps)  # [N, D]
        gu = ops.gemm(hn, lw.gate_up, mode, tile)  # [N, D] @ [D, 2I] -> [N, 2I]
        x = x + ops.gemm(ops.swiglu(gu), lw.down, mode, tile)  # [N, I] @ [I, D] -> [N, D]
    for s in segments:
        s.cache.length = s.start + len(s.tokens)
    rows = [bounds[si + 1] - 1 for si, s in enumerate(segments) if s.want_logits]
    if not rows:
        return np.empty((0, dims.vocab_size), dtype=np.float32)
    hl = ops.rmsnorm(x[rows], wt.final_norm, eps)  # [S_out, D]
    return ops.gemm(hl, wt.lm_head, mode, tile)  # [S_out, D] @ [D, V] -> [S_out, V]
