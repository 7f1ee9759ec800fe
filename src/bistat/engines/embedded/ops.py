"""The numpy operators of the LLaMA forward pass, float32 throughout, picoGPT-style.

Pure functions over arrays, with the shapes on every line (after jaymody/picoGPT ``gpt2.py``).
The conventions follow Hugging Face ``transformers`` ``models/llama/modeling_llama.py``:
RMSNorm (Zhang & Sennrich, 2019), rotary embeddings with the ``rotate_half`` layout (Su et al.,
2021), grouped-query attention (Ainslie et al., 2023) and the SwiGLU MLP (Shazeer, 2020).

Two GEMM modes (:func:`gemm`):

``"blas"``
    ``x @ w`` as numpy gives it. OpenBLAS picks its kernel from the shape: ``M == 1`` goes to
    GEMV, small ``M`` to its small-matrix kernels, larger ``M`` to the packed GEMM, and the thread
    partition depends on ``M`` too. Those paths sum the ``K`` products in different orders, so a
    row's float32 result depends on how many other rows share the call, i.e. on the batch.

``"invariant"``
    :func:`gemm_invariant`: bistat's own kernel (``bistat.engines.embedded._rowgemm``, C), in which every
    output element is one chain of ``K`` fused multiply-adds in the order ``k = 0 .. K-1``,
    started from ``+0.0``, each rounded once to float32 [6]_::

        out[i, j] = fma(x[i, K-1], w[K-1, j], ... fma(x[i, 0], w[0, j], +0.0))

    No partial sums, no second accumulator, no K-blocking, no alpha/beta scaling: nothing but
    that chain ever touches the value. So ``out[i, j]`` is a function of ``x[i, :]`` and
    ``w[:, j]`` alone, and cannot depend on ``M``, on the other rows or on the row's position:
    whichever kernel computes it (blocks of 1-8 rows, 1-8 panels of 16 columns), in whichever
    SIMD lane (AVX-512, AVX2, or the portable C ``fmaf`` path, the best this CPU runs), on
    whichever thread, performs the same ``K`` operations on the same operands in the same order,
    and vector FMA instructions are lane-wise IEEE fma with one rounding. BLAS is not used at
    all, so OpenBLAS's kernel choice (``OPENBLAS_CORETYPE``, its GEMV and small-matrix paths, its
    thread partition) has nothing to act on. The weights are packed once per weight
    (:func:`packed_weight`: 16-column panels, a copy) so that a kernel streams each panel from
    memory, and the panels are shared out between threads (:func:`gemm_threads`) in chunks that a
    thread computes whole. (Why not BLAS on fixed shapes: inside one OpenBLAS call the batch rows
    are its ``n`` dimension, cut into micro-tiles of several widths, and the kernels sum
    differently: the AVX2 SGEMM kernel used under ``OPENBLAS_CORETYPE=Haswell`` keeps one chain
    per element in its 16x6 tile but splits even and odd ``k`` into two accumulators added at
    the end in its 8x4 and 8x6 tiles (``KERNEL_k2m8n4`` / ``SAVE_m8n4``,
    OpenMathLib/OpenBLAS ``kernel/x86_64/sgemm_kernel_8x4_haswell_2.c@72461f1c8c11``), so a row's
    bits follow the tile its position falls in, and other core types have other kernels.)
    ``tests/test_embedded_ops.py`` checks the bits at every ``M`` in 1..40
    and every position on SmolLM2's shapes, on every instruction set and thread count, and the
    chain itself against an exactly rounded reference.
    The other reductions are per row or per request already:
    RMSNorm and the log-softmax reduce one row at a time (numpy's pairwise sum along the
    contiguous last axis, whose order depends only on the row length), and attention runs per request
    on that request's own KV cache, with shapes that depend on the request alone.

Emulated tensor parallelism (:mod:`bistat.engines.embedded.forward`, ``tensor_parallel_size > 1``) adds
one reduction across "ranks": :func:`all_reduce` sums the row-parallel layers' partial results in
the order a collective would, fixed in ``"invariant"`` mode and chosen by message size (ring or
tree, as NCCL does) in ``"blas"`` mode.

References
----------
.. [1] B. Zhang and R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
.. [2] J. Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021,
       arXiv:2104.09864.
.. [3] J. Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from
       Multi-Head Checkpoints", EMNLP 2023.
.. [4] N. Shazeer, "GLU Variants Improve Transformer", 2020, arXiv:2002.05202.
.. [5] H. He and Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025
       (batch invariance: fixed reduction order regardless of batch size).
.. [6] IEEE Std 754-2019, 5.4.1 fusedMultiplyAdd; ISO C11 7.12.13.1 ``fmaf`` ("rounded as one
       ternary operation"); Intel SDM vol. 2, VFMADD231PS (packed, one rounding per element).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence

import numpy as np

GEMM_MODES = ("blas", "invariant")
#: The ``_rowgemm`` extension this module is written against (its ``VERSION``).
ROWGEMM_VERSION = 1
_REBUILD = ("rebuild bistat's C part with `pip install -e .` (or `bash scripts/setup.sh`; "
            "needs a C compiler)")
try:
    from bistat.engines.embedded import _rowgemm
except ImportError as exc:  # installed without its C part, or built for another Python
    _rowgemm = None
    _ROWGEMM_MISSING = f"bistat.engines.embedded._rowgemm cannot be imported ({exc}); {_REBUILD}"
else:
    _ROWGEMM_MISSING = (None if getattr(_rowgemm, "VERSION", None) == ROWGEMM_VERSION else
                        f"bistat.engines.embedded._rowgemm is version {getattr(_rowgemm, 'VERSION', None)}, "
                        f"this bistat needs {ROWGEMM_VERSION}; {_REBUILD}")


def _kernel():
    """The ``_rowgemm`` extension, or a ``RuntimeError`` that says how to build it."""
    if _ROWGEMM_MISSING is not None:
        raise RuntimeError(f"the invariant GEMM: {_ROWGEMM_MISSING}")
    return _rowgemm


def gemm_blas(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` with numpy's BLAS as is: [M, K] @ [K, N] -> [M, N] (batch-variant)."""
    return x @ w  # [M, K] @ [K, N] -> [M, N]


#: Instruction sets the invariant kernel runs on this CPU, the one it uses last (each gives the
#: same bits: the same fma chain per element).
GEMM_ISAS: tuple[str, ...] = tuple(_rowgemm.isas()) if _ROWGEMM_MISSING is None else ()
_PACKED: dict[int, np.ndarray] = {}  # id(w) -> w packed in 16-column panels, while w lives


@functools.cache
def gemm_threads() -> int:
    """Threads :func:`gemm_invariant` shares a GEMM between: the CPUs this process may run on
    (read once).

    Any number gives the same bits (a thread computes whole columns); it only sets the speed.
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def packed_weight(w: np.ndarray) -> np.ndarray:
    """``w`` [K, N] packed for :func:`gemm_invariant`, made once per weight and dropped with it.

    Panels of 16 columns, each ``K`` consecutive rows of 16 floats (the last panel zero-padded):
    a copy of the values, float32, ``K * 16 * ceil(N / 16)`` of them. The weight must not be
    modified afterwards (the packed copy would not follow).
    """
    key = id(w)
    wp = _PACKED.get(key)
    if wp is None:
        k, n = w.shape
        kernel = _kernel()
        wp = np.empty(kernel.packed_size(k, n), dtype=np.float32)  # [ceil(N/16) * K * 16]
        kernel.pack(np.ascontiguousarray(w, dtype=np.float32), wp)
        _PACKED[key] = wp
        weakref.finalize(w, _PACKED.pop, key, None)
    return wp


def packed_bytes() -> int:
    """Bytes held by the packed weights of :func:`packed_weight` in this process."""
    return sum(wp.nbytes for wp in _PACKED.values())


def gemm_invariant(x: np.ndarray, w: np.ndarray, *, isa: str | None = None,
                   threads: int | None = None) -> np.ndarray:
    """Batch-invariant ``x @ w``: one fma chain over ``k = 0 .. K-1`` per output element.

    Parameters
    ----------
    x : ndarray, float32, shape [M, K]
    w : ndarray, float32, shape [K, N] (packed once, :func:`packed_weight`)
    isa : ``"avx512"``, ``"avx2"`` or ``"generic"`` (default: the last of :data:`GEMM_ISAS`);
        every one gives the same bits.
    threads : threads to share the columns between (default :func:`gemm_threads`); any number
        gives the same bits.

    Returns
    -------
    ndarray, float32, shape [M, N]
        ``out[i, j] = fma(x[i, K-1], w[K-1, j], ... fma(x[i, 0], w[0, j], +0.0))``, each fma
        rounded once to float32: a function of ``x[i]`` and ``w`` alone, not of ``M``, the other
        rows, or ``i``.
    """
    m, k = x.shape  # [M, K]
    if w.shape[0] != k:
        raise ValueError(f"gemm_invariant: x is [{m}, {k}] but w is {list(w.shape)}")
    n = w.shape[1]
    out = np.empty((m, n), dtype=np.float32)  # [M, N]
    _kernel().gemm(np.ascontiguousarray(x, dtype=np.float32), packed_weight(w), n, out,
                   gemm_threads() if threads is None else threads, isa)
    return out


def gemm(x: np.ndarray, w: np.ndarray, mode: str) -> np.ndarray:
    """[M, K] @ [K, N] -> [M, N] in the given mode (``"blas"`` or ``"invariant"``)."""
    if mode == "invariant":
        return gemm_invariant(x, w)
    return gemm_blas(x, w)


#: Message size, in bytes, from which the ``"blas"`` mode's emulated all-reduce sums in ring
#: order (below it: tree order), as NCCL picks its algorithm by message size. The message is one
#: step's ``[M, D]`` float32 partial sum, ``4 * M * D`` bytes, so the number of rows ``M`` in the
#: step decides: at SmolLM2-135M's ``D = 576`` the threshold is ``M = 16`` rows (36,864 bytes),
#: so decode steps of fewer than 16 requests use the tree and larger batches or prefill chunks
#: the ring, and a default engine (32 requests, 256-token prefill chunks) meets both. (Tiny test
#: models with ``D = 64`` switch at ``M = 144``.) NCCL's own switch points are tuned per system;
#: this one is chosen so that both orders occur at the engine's usual batch sizes.
ALLREDUCE_RING_MIN_BYTES = 16 * 576 * 4
ALLREDUCE_ALGORITHMS = ("rank-order", "tree", "ring")


def allreduce_algorithm(message_bytes: int, mode: str) -> str:
    """The summation order :func:`all_reduce` uses for one message of ``message_bytes`` bytes.

    ``"rank-order"`` in ``"invariant"`` mode whatever the size; in ``"blas"`` mode ``"tree"``
    below :data:`ALLREDUCE_RING_MIN_BYTES` and ``"ring"`` at or above it.
    """
    if mode not in GEMM_MODES:
        raise ValueError(f"all_reduce: mode ({mode!r}) must be one of 'blas' or 'invariant'")
    if mode == "invariant":
        return "rank-order"
    return "ring" if message_bytes >= ALLREDUCE_RING_MIN_BYTES else "tree"


def all_reduce(parts: Sequence[np.ndarray], mode: str) -> np.ndarray:
    """Sum the emulated ranks' partial results in the order the collective would: [M, D] each.

    Emulates the reduction order of a tensor-parallel all-reduce, one float32 addition per pair;
    no data moves anywhere (the ranks are slices of one process's arrays). The order:

    ``"invariant"``: ``((p0 + p1) + p2) + ...``, the ranks in rank order, left to right, for every
    message. vLLM's batch-invariant mode fixes the collective in the same spirit: it disables
    vLLM's custom all-reduce and pins NCCL to one channel, the tree algorithm and the Simple
    protocol (``vllm/model_executor/layers/batch_invariant.py``, ``vllm/config/parallel.py``,
    vLLM 0.25.0), so the order no longer depends on the message size.

    ``"blas"`` (batch-variant, like NCCL's default choice of algorithm by message size,
    :func:`allreduce_algorithm`): below :data:`ALLREDUCE_RING_MIN_BYTES` a tree, ranks summed
    pairwise level by level (``(p0 + p1) + (p2 + p3)``; an odd last one joins the next level);
    at or above it a ring reduce-scatter: the message is cut into ``T`` chunks along ``D``
    (``numpy.array_split`` sizes) and chunk ``c`` is accumulated starting at rank ``(c + 1) % T``,
    around the ring, ending with rank ``c`` (the all-gather that follows only copies).

    With ``T == 2`` every order adds the same two numbers once, and IEEE addition is
    commutative, so the all-reduce is bitwise batch-invariant at TP=2 in both modes: batch
    dependence at TP=2 can only come from the GEMMs. At ``T >= 3`` the ring and the tree
    associate differently (for ``T == 3`` the tree is ``(p0 + p1) + p2``, the ring's chunk 0 is
    ``(p1 + p2) + p0``), so ``"blas"`` rows change in the last bits when a step's row count
    crosses the threshold.

    Parameters
    ----------
    parts : sequence of ``T >= 1`` float32 arrays of one shape, [M, D] (any leading shape)
    mode : ``"blas"`` or ``"invariant"``

    Returns
    -------
    ndarray float32 [M, D], a new array (``parts[0]`` itself when ``T == 1``: nothing to add).
    """
    if not parts:
        raise ValueError("all_reduce: no parts")
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"all_reduce: parts of different shapes {[p.shape for p in parts]}")
    algorithm = allreduce_algorithm(parts[0].nbytes, mode)
    t = len(parts)
    if t == 1:
        return parts[0]
    if algorithm == "rank-order":
        out = parts[0] + parts[1]  # [M, D]
        for p in parts[2:]:
            out += p  # ((p0 + p1) + p2) + ...
        return out
    if algorithm == "tree":
        level = list(parts)
        while len(level) > 1:
            nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]  # [M, D] each
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        return level[0]
    edges = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(shape[-1]), t)])  # [T + 1]
    out = np.empty_like(parts[0])  # [M, D]
    for c in range(t):
        a, b = edges[c], edges[c + 1]
        acc = parts[(c + 1) % t][..., a:b] + parts[(c + 2) % t][..., a:b]  # [M, D_c]
        for j in range(3, t + 1):  # ... ending with rank c (j == t)
            acc += parts[(c + j) % t][..., a:b]
        out[..., a:b] = acc
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm [1]_ as in HF ``LlamaRMSNorm``: [M, D] -> [M, D], one reduction per row."""
    var = np.mean(x * x, axis=-1, keepdims=True)  # [M, D] -> [M, 1]
    return (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))) * w  # [M, D]


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables of HF's default rotary embedding: -> ([P, head_dim], [P, head_dim]) float32.

    ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` and the angles are computed in float32, as
    ``LlamaRotaryEmbedding`` does for a float32 model; the halves are repeated (``cat(f, f)``).
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)  # [d/2]
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)  # [d/2]
    pos = np.arange(max_positions, dtype=np.float32)  # [P]
    freqs = pos[:, None] * inv_freq[None, :]  # [P, d/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [P, d]
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding [2]_, HF ``rotate_half`` layout: [M, H, d] with cos/sin [M, d] -> [M, H, d]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [M, H, d]
    return x * cos[:, None, :] + rotated * sin[:, None, :]  # [M, H, d]


def attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int,
    row_by_row: bool = False,
) -> np.ndarray:
    """Causal grouped-query attention [3]_ of one request's query chunk over its own KV cache.

    Parameters
    ----------
    q : [C, H, d] float32, the queries at positions ``start_pos .. start_pos + C - 1`` (rotated)
    k_cache, v_cache : [KVH, T, d] float32 with ``T = start_pos + C`` (keys already rotated)
    start_pos : int, position of the first query

    Returns
    -------
    [C, H * d] float32

    row_by_row : bool
        Compute each query row as a one-token decode step at its position would: over exactly
        the keys it may see, with the same array shapes. Then a prompt's prefill gives each
        position the bits a decode step gives it (prefill-decode consistency); the invariant GEMM
        mode uses it. Otherwise one vectorised pass over the chunk, whose masked columns and
        row count change how BLAS and the sums group their terms.

    Notes
    -----
    All shapes depend on this request alone (its chunk and cache length), so the result does not
    depend on the other requests of the step in either GEMM mode.
    """
    c, h, d = q.shape
    if row_by_row and c > 1:
        return np.concatenate([  # [C, H*d]
            attention(q[i:i + 1], k_cache[:, :start_pos + i + 1], v_cache[:, :start_pos + i + 1],
                      start_pos + i) for i in range(c)])
    kvh, t, _ = k_cache.shape
    g = h // kvh
    qg = q.transpose(1, 0, 2).reshape(kvh, g * c, d)  # [C, H, d] -> [KVH, G*C, d]
    scores = qg @ k_cache.transpose(0, 2, 1)  # [KVH, G*C, d] @ [KVH, d, T] -> [KVH, G*C, T]
    scores *= np.float32(1.0 / np.sqrt(d))
    if c > 1:
        q_pos = start_pos + np.arange(c)  # [C]
        masked = np.arange(t)[None, :] > q_pos[:, None]  # [C, T]
        scores.reshape(kvh, g, c, t)[:, :, masked] = -np.inf  # [KVH, G, C, T]
    scores -= scores.max(axis=-1, keepdims=True)  # [KVH, G*C, T]
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)  # softmax over T
    out = scores @ v_cache  # [KVH, G*C, T] @ [KVH, T, d] -> [KVH, G*C, d]
    return out.reshape(h, c, d).transpose(1, 0, 2).reshape(c, h * d)  # -> [C, H*d]


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU [4]_: [M, 2I] (gate | up) -> silu(gate) * up, [M, I]."""
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :i], gate_up[:, i:]  # [M, I], [M, I]
    return gate / (np.float32(1.0) + np.exp(-gate)) * up  # [M, I]


def log_softmax_rows(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row log-sum-exp in float32: [M, V] -> (lse [M], max [M]).

    ``logprob(token) = logits[token] - lse``. Computed in float32 (as vLLM computes logprobs from
    float32 logits): max-shifted exponentials, numpy's pairwise sum along the row, then log. The
    absolute error of a logprob is about ``V * eps32 * |lse|`` at worst, far below the 1e-4 the
    tests allow against a float64 reference.
    """
    m = logits.max(axis=-1)  # [M, V] -> [M]
    s = np.exp(logits - m[:, None]).sum(axis=-1)  # [M]
    return m + np.log(s), m  # [M], [M]
