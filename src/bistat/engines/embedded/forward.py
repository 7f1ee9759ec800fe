"""The LLaMA forward pass over one engine step: prefill chunks and decode rows in one batch.

Following gpt-fast's split (``prefill`` / ``decode_one_token``, pytorch-labs/gpt-fast
``generate.py``) but with vLLM's chunked prefill: one step is a list of :class:`Segment` s, one
per request — a decode row (one token) or a prefill chunk (several prompt tokens). All rows of all
segments go through each linear layer in ONE GEMM ([rows, K] @ [K, N]); attention runs per segment
on that request's own KV cache. Shapes on every line, as in jaymody/picoGPT ``gpt2.py``.

In the ``"invariant"`` GEMM mode a row's bits depend neither on the other requests of the step
(one fixed fma chain per GEMM output element, :func:`bistat.engines.embedded.ops.gemm_invariant`) nor
on whether its token arrived in a prefill chunk or a decode step (attention computed row by row
over exactly the keys the row may see,
:func:`bistat.engines.embedded.ops.attention`): prefill and decode logprobs agree bitwise, which
``bistat probe --mode prefill-decode`` confirms with ``"blas"`` as its negative control.

Weights are prepared once (:func:`prepare_weights`): Q/K/V and gate/up fused by concatenation,
every linear weight transposed to a contiguous ``[in, out]`` array, float32 throughout.

Emulated tensor parallelism (``tensor_parallel_size = T > 1``, :func:`shard_weights`): Megatron-LM
style sharding (Shoeybi et al., 2019, arXiv:1909.08053), as vLLM's ``QKVParallelLinear`` /
``MergedColumnParallelLinear`` / ``RowParallelLinear`` do it, computed rank after rank in this
process with no communication:

* column-parallel, fused Q/K/V and gate/up: rank ``r`` holds the columns of its ``H/T`` query
  heads, ``KVH/T`` key and value heads, and its ``I/T`` slice of gate and of up, and runs its own
  ``[N, D] @ [D, N_out/T]`` GEMM; the Q/K/V columns are put back in head order and attention runs
  as at ``T == 1`` (it is per head, so per rank nothing changes); SwiGLU runs per rank on the
  rank's gate/up slice (elementwise, so the bits are those of the reassembled columns);
* row-parallel, o_proj (``K = H*d`` split by the rank's heads) and down_proj (``K = I`` in ``T``
  contiguous parts): rank ``r`` computes the partial sum ``x[:, K_r] @ w[K_r, :]`` and the ``T``
  partials are summed by :func:`bistat.engines.embedded.ops.all_reduce` in the collective's order;
* embedding and lm_head stay whole: vLLM's vocab-parallel embedding sums one non-zero shard per
  row and its vocab-parallel lm_head all-gathers the logits, so neither adds across ranks and
  neither can change a bit; RMSNorm, RoPE and attention are replicated or per head.

At ``T == 1`` :func:`forward_step` runs exactly the unsharded code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from bistat.engines.embedded import ops
from bistat.engines.embedded.kvcache import KVCache
from bistat.model.config import ModelConfig


@dataclass(frozen=True)
class RankWeights:
    """One emulated tensor-parallel rank's shard of one layer (:func:`shard_weights`)."""

    qkv: np.ndarray  # [D, (H + 2*KVH) * d / T]: its q heads | its k heads | its v heads
    o: np.ndarray  # [H*d / T, D]: the rows of its q heads (a view of LayerWeights.o)
    gate_up: np.ndarray  # [D, 2I / T]: its gate slice | its up slice
    down: np.ndarray  # [I / T, D]: the rows of its intermediate slice (a view of LayerWeights.down)


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray  # [D]
    qkv: np.ndarray | None  # [D, (H + 2*KVH) * d]; None when sharded (T > 1: see ranks)
    o: np.ndarray  # [H*d, D]
    post_norm: np.ndarray  # [D]
    gate_up: np.ndarray | None  # [D, 2I]; None when sharded (T > 1: see ranks)
    down: np.ndarray  # [I, D]
    ranks: tuple[RankWeights, ...] = ()  # T > 1: one shard per emulated rank; () when T == 1


@dataclass(frozen=True)
class Weights:
    dims: ModelConfig
    embed: np.ndarray  # [V, D]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [D, V]
    rope_cos: np.ndarray  # [P, d]
    rope_sin: np.ndarray  # [P, d]
    tensor_parallel_size: int = 1  # T: emulated ranks the layers are sharded into

    @property
    def nbytes(self) -> int:
        """Bytes held (the ranks' o/down shards are views of the whole arrays: counted once)."""
        arrays = [self.embed, self.final_norm, self.lm_head, self.rope_cos, self.rope_sin]
        for lw in self.layers:
            arrays += [a for a in (lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down)
                       if a is not None]
            arrays += [a for r in lw.ranks for a in (r.qkv, r.gate_up)]
        return sum(a.nbytes for a in arrays)


class TensorParallelSizeError(ValueError):
    """A ``tensor_parallel_size`` the model cannot be sharded by; ``valid`` lists those it can."""

    def __init__(self, message: str, valid: Sequence[int]) -> None:
        super().__init__(message)
        self.valid = tuple(valid)


def valid_tensor_parallel_sizes(dims: ModelConfig) -> list[int]:
    """The ``T`` that divide num_attention_heads, num_key_value_heads and intermediate_size."""
    g = math.gcd(dims.num_attention_heads, dims.num_key_value_heads, dims.intermediate_size)
    return [t for t in range(1, g + 1) if g % t == 0]


def check_tensor_parallel_size(value: object, dims: ModelConfig) -> int:
    """``value`` as the number of emulated ranks, or :class:`TensorParallelSizeError`.

    It must be an ``int`` (``bool`` is not one here) ``>= 1`` dividing the model's
    num_attention_heads, num_key_value_heads and intermediate_size (every rank gets whole query
    heads, whole KV heads and an equal slice of the MLP, as vLLM requires of the heads).
    """
    valid = valid_tensor_parallel_sizes(dims)
    if isinstance(value, bool) or not isinstance(value, int) or value not in valid:
        raise TensorParallelSizeError(
            f"tensor_parallel_size ({value!r}) must be an integer >= 1 that divides the model's "
            f"num_attention_heads ({dims.num_attention_heads}), num_key_value_heads "
            f"({dims.num_key_value_heads}) and intermediate_size ({dims.intermediate_size}); "
            f"valid values: {valid}", valid)
    return int(value)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _t(*parts: np.ndarray) -> np.ndarray:
    """Concatenate [out_i, in] weights along out and transpose: -> contiguous [in, sum out_i]."""
    return np.ascontiguousarray(np.concatenate(parts, axis=0).T, dtype=np.float32)


def model_dims(config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """``config`` as a :class:`ModelConfig` (HF LLaMA config names when a mapping)."""
    return config if isinstance(config, ModelConfig) else ModelConfig.from_hf_dict(dict(config))


def prepare_weights(config: ModelConfig | Mapping[str, Any], weights: Mapping[str, np.ndarray],
                    max_positions: int, tensor_parallel_size: int = 1) -> Weights:
    """Fuse and transpose Hugging Face LLaMA weights ([out, in], HF names) for the engine.

    ``tensor_parallel_size > 1`` shards the layers for emulated tensor parallelism
    (:func:`shard_weights`). Raises ``KeyError`` naming the missing tensor when the dict lacks
    one, :class:`TensorParallelSizeError` for a ``tensor_parallel_size`` the model cannot take.
    """
    dims = model_dims(config)
    tp = check_tensor_parallel_size(tensor_parallel_size, dims)

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
    wt = Weights(dims, embed, tuple(layers), _f32(w("model.norm.weight")), lm_head, cos, sin)
    return wt if tp == 1 else shard_weights(wt, tp)


def shard_weights(wt: Weights, tensor_parallel_size: int) -> Weights:
    """Unsharded weights split for ``T = tensor_parallel_size`` emulated ranks (Megatron-LM layout).

    Each layer gets ``T`` :class:`RankWeights`: contiguous copies of the rank's fused Q/K/V and
    gate/up columns, and row-block *views* of o_proj and down_proj (a block of rows of a
    C-contiguous ``[K, D]`` array is itself contiguous). The unsharded Q/K/V and gate/up arrays
    are dropped from the result (``None``), so the sharded layers hold as many bytes as the
    unsharded ones; the result shares every other array with ``wt``. While this runs, the
    Q/K/V and gate/up weights exist twice (SmolLM2-135M: 279 MB more for the moment, its layers
    hold 425 MB in all).

    ``T == 1`` or weights already sharded ``T`` ways come back as they are; weights sharded
    another way cannot be resharded (prepare them again).
    """
    dims = wt.dims
    t = check_tensor_parallel_size(tensor_parallel_size, dims)
    if t == wt.tensor_parallel_size:
        return wt
    if wt.tensor_parallel_size != 1:
        raise ValueError(f"shard_weights: weights sharded {wt.tensor_parallel_size} ways cannot be "
                         f"resharded {t} ways; prepare them from the model again")
    d, i_size = dims.head_dim, dims.intermediate_size
    nq, nk = dims.num_attention_heads * d, dims.num_key_value_heads * d  # q / k columns
    qr, kr, ir = nq // t, nk // t, i_size // t  # per rank: q columns, k (= v) columns, I slice
    layers = []
    for lw in wt.layers:
        assert lw.qkv is not None and lw.gate_up is not None
        ranks = []
        for r in range(t):
            qkv_r = np.concatenate([lw.qkv[:, r * qr:(r + 1) * qr],  # its q heads [D, qr]
                                    lw.qkv[:, nq + r * kr:nq + (r + 1) * kr],  # its k heads
                                    lw.qkv[:, nq + nk + r * kr:nq + nk + (r + 1) * kr]],  # v
                                   axis=1)  # -> contiguous [D, qr + 2kr]
            gate_up_r = np.concatenate([lw.gate_up[:, r * ir:(r + 1) * ir],  # gate [D, I/T]
                                        lw.gate_up[:, i_size + r * ir:i_size + (r + 1) * ir]],
                                       axis=1)  # -> contiguous [D, 2I/T]
            ranks.append(RankWeights(qkv=_f32(qkv_r), o=lw.o[r * qr:(r + 1) * qr],  # [qr, D]
                                     gate_up=_f32(gate_up_r),
                                     down=lw.down[r * ir:(r + 1) * ir]))  # [I/T, D]
        layers.append(replace(lw, qkv=None, gate_up=None, ranks=tuple(ranks)))
    return replace(wt, layers=tuple(layers), tensor_parallel_size=t)


def gemm_weights(wt: Weights) -> list[np.ndarray]:
    """Every weight :func:`forward_step` multiplies by (``ops.gemm``'s ``w``), lm_head last."""
    out: list[np.ndarray] = []
    for lw in wt.layers:
        if lw.ranks:
            out += [a for r in lw.ranks for a in (r.qkv, r.o, r.gate_up, r.down)]
        else:
            assert lw.qkv is not None and lw.gate_up is not None
            out += [lw.qkv, lw.o, lw.gate_up, lw.down]
    return out + [wt.lm_head]


@dataclass
class Segment:
    """One request's rows in a step: tokens at positions ``start .. start + len(tokens) - 1``."""

    cache: KVCache
    tokens: Sequence[int]
    start: int
    want_logits: bool  # True: the last row's logits are needed (decode, or the last prompt chunk)


def forward_step(wt: Weights, segments: Sequence[Segment], mode: str) -> np.ndarray:
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
        if lw.ranks:
            qkv = _qkv_column_parallel(hn, lw.ranks, mode)  # [N, (H+2KVH)d]
        else:
            qkv = ops.gemm(hn, lw.qkv, mode)  # [N, D] @ [D, (H+2KVH)d] -> [N, (H+2KVH)d]
        q = ops.apply_rope(qkv[:, :nq].reshape(-1, h, d), cos, sin)  # [N, H, d]
        k = ops.apply_rope(qkv[:, nq:nq + nk].reshape(-1, kvh, d), cos, sin)  # [N, KVH, d]
        v = qkv[:, nq + nk:].reshape(-1, kvh, d)  # [N, KVH, d]
        attn = np.empty((len(ids), nq), dtype=np.float32)  # [N, H*d]
        for si, s in enumerate(segments):
            a, b = bounds[si], bounds[si + 1]
            kc, vc = s.cache.write(li, s.start, k[a:b], v[a:b])  # [KVH, T, d] each
            attn[a:b] = ops.attention(q[a:b], kc, vc, s.start,  # [C, H*d]
                                      row_by_row=mode == "invariant")
        if lw.ranks:
            x = x + _o_row_parallel(attn, lw.ranks, mode)  # [N, D]
            hn = ops.rmsnorm(x, lw.post_norm, eps)  # [N, D]
            x = x + _mlp_tensor_parallel(hn, lw.ranks, mode)  # [N, D]
            continue
        x = x + ops.gemm(attn, lw.o, mode)  # [N, H*d] @ [H*d, D] -> [N, D]
        hn = ops.rmsnorm(x, lw.post_norm, eps)  # [N, D]
        gu = ops.gemm(hn, lw.gate_up, mode)  # [N, D] @ [D, 2I] -> [N, 2I]
        x = x + ops.gemm(ops.swiglu(gu), lw.down, mode)  # [N, I] @ [I, D] -> [N, D]
    for s in segments:
        s.cache.length = s.start + len(s.tokens)
    rows = [bounds[si + 1] - 1 for si, s in enumerate(segments) if s.want_logits]
    if not rows:
        return np.empty((0, dims.vocab_size), dtype=np.float32)
    hl = ops.rmsnorm(x[rows], wt.final_norm, eps)  # [S_out, D]
    return ops.gemm(hl, wt.lm_head, mode)  # [S_out, D] @ [D, V] -> [S_out, V]


# ------------------------------------------------------------------ emulated tensor parallelism
def _qkv_column_parallel(hn: np.ndarray, ranks: Sequence[RankWeights], mode: str) -> np.ndarray:
    """Column-parallel fused Q/K/V: one GEMM per rank, columns put back in head order.

    [N, D] -> [N, (H + 2*KVH) * d]: all q heads | all k heads | all v heads, as at ``T == 1``.
    """
    outs = [ops.gemm(hn, rw.qkv, mode) for rw in ranks]  # T x [N, D] @ [D, qr + 2kr]
    qr = ranks[0].o.shape[0]  # q columns per rank, H*d / T
    kr = (outs[0].shape[1] - qr) // 2  # k (= v) columns per rank, KVH*d / T
    return np.concatenate([o[:, :qr] for o in outs] + [o[:, qr:qr + kr] for o in outs]
                          + [o[:, qr + kr:] for o in outs], axis=1)  # [N, (H + 2KVH)d]


def _o_row_parallel(attn: np.ndarray, ranks: Sequence[RankWeights], mode: str) -> np.ndarray:
    """Row-parallel o_proj: rank ``r``'s heads' columns @ its rows of o, then the all-reduce."""
    qr = ranks[0].o.shape[0]  # H*d / T
    parts = [ops.gemm(np.ascontiguousarray(attn[:, r * qr:(r + 1) * qr]), rw.o, mode)
             for r, rw in enumerate(ranks)]  # T x [N, H*d/T] @ [H*d/T, D] -> [N, D]
    return ops.all_reduce(parts, mode)  # [N, D]


def _mlp_tensor_parallel(hn: np.ndarray, ranks: Sequence[RankWeights], mode: str) -> np.ndarray:
    """Column-parallel gate/up and SwiGLU per rank, row-parallel down, then the all-reduce."""
    parts = []
    for rw in ranks:
        gu = ops.gemm(hn, rw.gate_up, mode)  # [N, D] @ [D, 2I/T] -> [N, 2I/T]
        parts.append(ops.gemm(ops.swiglu(gu), rw.down, mode))  # [N, I/T] @ [I/T, D]
    return ops.all_reduce(parts, mode)  # T x [N, D] -> [N, D]
