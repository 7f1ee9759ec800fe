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
    :func:`gemm_invariant`: the rows are cut into tiles of a fixed number of rows (the last one
    padded with zeros) and BLAS is called once per tile with the *identical* shape
    ``[tile, K] @ [K, N]``. BLAS therefore always takes the same kernel, blocking and thread
    partition, and a GEMM never mixes rows. That makes a row independent of the *other* rows, not
    of *where it sits in its tile*: OpenBLAS 0.3.31's AVX2 (Haswell) SGEMM kernel gives rows 6-15 of
    a 16-row call other bits than rows 0-5 (measured on a 2-core AMD EPYC; its AVX-512 SkylakeX
    kernel does not). So the tile's layout is chosen per ``(K, N, tile)`` by a bitwise self-check
    on this machine's BLAS (:func:`tile_layout`): the rows as BLAS rows, or as BLAS columns
    (``w.T @ tile.T``), or, if neither is position-independent, one BLAS call per row.
    Each output row is then the same function of its input row whatever the other rows are and
    wherever the row sits (checked bitwise by ``tests/test_embedded_invariance.py``). The other
    reductions are per row or per request already:
    RMSNorm and the log-softmax reduce one row at a time (numpy's pairwise sum along the
    contiguous last axis, whose order depends only on the row length), and attention runs per request
    on that request's own KV cache, with shapes that depend on the request alone.

Emulated tensor parallelism (:mod:`bistat.embedded.forward`, ``tensor_parallel_size > 1``) adds
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
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

GEMM_MODES = ("blas", "invariant")
# Rows per BLAS call in "invariant" mode. Any fixed value is invariant; it trades small-batch
# against full-batch speed. Decode throughput invariant / blas, SmolLM2-135M, 48 greedy tokens,
# median of 2-3 interleaved repeats, 2-core AMD EPYC (OpenBLAS 0.3.31 SkylakeX kernels, 2 threads,
# OPENBLAS_CORETYPE unset), machine shared (load 0.3-2), `python benchmarks/bench_embedded.py --tile T`:
#   tile  8: batch 32 -> 0.58, batch 1 -> 0.41
#   tile 16: batch 32 -> 0.71-0.73, batch 1 -> 0.33-0.35   (default: the middle of both regimes)
#   tile 32: batch 32 -> 0.96, batch 1 -> 0.25
DEFAULT_TILE = 16


def gemm_blas(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` with numpy's BLAS as is: [M, K] @ [K, N] -> [M, N] (batch-variant)."""
    return x @ w  # [M, K] @ [K, N] -> [M, N]


#: How :func:`gemm_invariant` hands a row tile to BLAS, in the order :func:`tile_layout` tries them.
TILE_LAYOUTS = ("rows", "columns", "row-by-row")
_LAYOUT: dict[tuple[int, int, int], str] = {}      # (K, N, tile) -> the layout chosen here
_TRANSPOSED: dict[int, np.ndarray] = {}             # id(w) -> w.T contiguous, while w lives


def _transposed(w: np.ndarray) -> np.ndarray:
    """``w.T`` as a C-contiguous [N, K] copy, made once per weight and dropped with it."""
    key = id(w)
    wt = _TRANSPOSED.get(key)
    if wt is None:
        wt = _TRANSPOSED[key] = w.T.copy(order="C")  # [N, K], never a view of w
        weakref.finalize(w, _TRANSPOSED.pop, key, None)
    return wt


def _tile_product(xt: np.ndarray, w: np.ndarray, layout: str, out: np.ndarray) -> None:
    """``out[:] = xt @ w`` for one [tile, K] tile, laid out for BLAS as ``layout`` says."""
    if layout == "rows":
        np.matmul(xt, w, out=out)  # [tile, K] @ [K, N] -> [tile, N]
    elif layout == "columns":
        out[:] = (_transposed(w) @ np.ascontiguousarray(xt.T)).T  # ([N, K] @ [K, tile]).T
    else:
        for r in range(len(xt)):
            np.matmul(xt[r : r + 1], w, out=out[r : r + 1])  # [1, K] @ [K, N] -> [1, N]


def tile_layout(k: int, n: int, tile: int) -> str:
    """The first of :data:`TILE_LAYOUTS` whose rows are bitwise position-independent here.

    A bitwise self-check on this process's BLAS, once per ``(k, n, tile)``: random rows, each
    computed in every position of a tile (the tile rotated ``tile`` times) and alone in a
    zero tile, must give identical bits. ``"row-by-row"`` (one ``[1, K]`` call per row, the
    same call for every row) is the fallback and is not checked.
    """
    key = (k, n, tile)
    if key not in _LAYOUT:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((tile, k), dtype=np.float32)  # [tile, K]
        w = rng.standard_normal((k, n), dtype=np.float32)     # [K, N]
        chosen = TILE_LAYOUTS[-1]
        for layout in TILE_LAYOUTS[:-1]:
            ref = np.empty((tile, n), dtype=np.float32)
            _tile_product(x, w, layout, ref)
            ok = True
            out = np.empty_like(ref)
            for shift in range(1, tile):  # row i at position (i - shift) mod tile
                _tile_product(np.roll(x, -shift, axis=0), w, layout, out)
                if not np.array_equal(out, np.roll(ref, -shift, axis=0)):
                    ok = False
                    break
            if ok:
                alone = np.zeros_like(x)
                alone[0] = x[tile - 1]
                _tile_product(alone, w, layout, out)
                ok = np.array_equal(out[0], ref[tile - 1])
            if ok:
                chosen = layout
                break
        _LAYOUT[key] = chosen
    return _LAYOUT[key]


def gemm_invariant(x: np.ndarray, w: np.ndarray, tile: int = DEFAULT_TILE) -> np.ndarray:
    """Batch-invariant ``x @ w``: one BLAS call of one fixed shape per row tile.

    Parameters
    ----------
    x : ndarray, float32, shape [M, K]
    w : ndarray, float32, shape [K, N], C-contiguous
    tile : int
        Rows per BLAS call. Every call has exactly this many rows (the last tile is zero-padded),
        so BLAS takes the same kernel, blocking and threading for every call and every ``M``; the
        tile goes to BLAS as rows or as columns, whichever this machine's BLAS computes the same
        in every position (:func:`tile_layout`).

    Returns
    -------
    ndarray, float32, shape [M, N]
        Row ``i`` depends on ``x[i]`` and ``w`` only: not on ``M``, the other rows, or ``i``.
    """
    m, k = x.shape  # [M, K]
    n = w.shape[1]
    layout = tile_layout(k, n, tile)
    m_pad = -(-m // tile) * tile
    if m_pad != m or not x.flags.c_contiguous:
        xp = np.zeros((m_pad, k), dtype=np.float32)  # [M_pad, K]
        xp[:m] = x
    else:
        xp = x
    out = np.empty((m_pad, n), dtype=np.float32)  # [M_pad, N]
    for i in range(0, m_pad, tile):
        _tile_product(xp[i : i + tile], w, layout, out[i : i + tile])  # [tile, K] -> [tile, N]
    return out[:m]  # [M, N]


def gemm(x: np.ndarray, w: np.ndarray, mode: str, tile: int = DEFAULT_TILE) -> np.ndarray:
    """[M, K] @ [K, N] -> [M, N] in the given mode (``"blas"`` or ``"invariant"``)."""
    if mode == "invariant":
        return gemm_invariant(x, w, tile)
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
