"""The embedded engine's operators: row invariance (bitwise) and accuracy (allclose)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from bistat.engines.embedded import ops
from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.embedded.sampling import SamplingParams, select_token, top_logprobs

# SmolLM2-135M's GEMM shapes (K = in_features, N = out_features): qkv, o, gate_up, down.
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
# Its shards under emulated tensor parallelism (tests/test_embedded_tp.py): T = 3 per rank, qkv,
# o (K = H*d / T), gate_up, down (K = I / T); T = 2 would not divide its 9 heads, but its shapes
# are the kernel's too (a partial last panel: none of these N is one).
SMOLLM2_TP3_SHAPES = [(576, 320), (192, 576), (576, 1024), (512, 576)]
LM_HEAD = (576, 49152)
BATCHES = range(1, 41)


def _rows(k: int, m: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


def _weight(k: int, n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)


def _assert_rows_independent_of_batch_and_position(w: np.ndarray, x: np.ndarray) -> None:
    """Row ``i`` of ``gemm_invariant(x[rows], w)`` is bitwise row ``i`` computed alone, for every
    ``M`` in 1..40 (rows in order and permuted) and, at ``M = 40``, every row at every position."""
    alone = np.stack([ops.gemm_invariant(x[i:i + 1], w)[0] for i in range(len(x))])  # [40, N]
    for m in BATCHES:
        out = ops.gemm_invariant(x[:m], w)
        bad = [i for i in range(m) if not np.array_equal(out[i], alone[i])]
        assert not bad, f"M={m}: rows {bad} differ from the same rows computed alone"
        perm = np.random.default_rng(m).permutation(m)
        out = ops.gemm_invariant(x[perm], w)
        assert np.array_equal(out, alone[perm]), f"M={m}: a permuted batch changed some row"
    for shift in range(1, len(x)):  # row i at position (i - shift) mod 40
        out = ops.gemm_invariant(np.roll(x, -shift, axis=0), w)
        assert np.array_equal(out, np.roll(alone, -shift, axis=0)), f"rotation {shift}"
    exact = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(alone, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("k,n", SMOLLM2_SHAPES + SMOLLM2_TP3_SHAPES)
def test_gemm_invariant_rows_are_bitwise_independent_of_batch_and_position(k, n):
    _assert_rows_independent_of_batch_and_position(_weight(k, n, k + n), _rows(k))


def test_gemm_invariant_lm_head_shape():
    _assert_rows_independent_of_batch_and_position(_weight(*LM_HEAD, 1), _rows(LM_HEAD[0], seed=1))


def test_blas_gemm_is_batch_variant_on_this_machine():
    """Negative control: through numpy's BLAS a row's float32 result depends on M (OpenBLAS kernels)."""
    k, n = 576, 3072
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    x = _rows(k)
    alone = ops.gemm_blas(x[:1], w)[0]
    differing = [m for m in BATCHES if not np.array_equal(ops.gemm_blas(x[:m], w)[0], alone)]
    assert differing, "numpy's BLAS gave bitwise equal rows at every M in 1..40"


@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "rope", "log_softmax"])
def test_rowwise_ops_are_bitwise_independent_of_batch(name):
    rng = np.random.default_rng(3)
    d = 576
    g = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    cos, sin = ops.rope_tables(64, 1e5, 64)
    pos = rng.integers(0, 64, size=40)

    def f(x, idx):
        if name == "rmsnorm":
            return ops.rmsnorm(x, g, 1e-5)
        if name == "swiglu":
            return ops.swiglu(x)
        if name == "rope":
            return ops.apply_rope(x.reshape(len(x), 9, 64), cos[pos[idx]], sin[pos[idx]])
        return np.stack(ops.log_softmax_rows(x), axis=-1)

    x = (3 * rng.standard_normal((40, d))).astype(np.float32)
    alone = [f(x[i:i + 1], np.array([i]))[0] for i in range(40)]
    for m in BATCHES:
        out = f(x[:m], np.arange(m))
        assert all(np.array_equal(out[i], alone[i]) for i in range(m)), f"{name}: M={m}"


def test_rmsnorm_matches_float64():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    g = rng.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(ops.rmsnorm(x, g, 1e-5), ref, rtol=1e-5, atol=1e-6)


def test_rope_is_hf_rotate_half():
    cos, sin = ops.rope_tables(8, 10000.0, 16)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ang = 5 * inv
    x = np.arange(8, dtype=np.float32)[None, None, :] + 1  # [1, 1, 8]
    out = ops.apply_rope(x, cos[[5]], sin[[5]])[0, 0]
    x1, x2 = x[0, 0, :4].astype(np.float64), x[0, 0, 4:].astype(np.float64)
    ref = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)])
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_attention_matches_float64_causal_gqa():
    rng = np.random.default_rng(5)
    c, h, kvh, d, start = 4, 6, 2, 16, 3
    q = rng.standard_normal((c, h, d)).astype(np.float32)
    k = rng.standard_normal((kvh, start + c, d)).astype(np.float32)
    v = rng.standard_normal((kvh, start + c, d)).astype(np.float32)
    out = ops.attention(q, k, v, start).reshape(c, h, d)
    for i in range(c):
        for head in range(h):
            kk, vv = k[head // (h // kvh), : start + i + 1].astype(np.float64), v[head // 3, : start + i + 1]
            s = kk @ q[i, head].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, head], (p / p.sum()) @ vv, rtol=1e-5, atol=1e-5)


def test_kvcache_grows_without_changing_contents_and_refuses_past_max_len():
    cache = KVCache(2, 3, 4, max_len=200, initial=1)
    assert cache.capacity == 64
    k = np.arange(70 * 12, dtype=np.float32).reshape(70, 3, 4)
    cache.reserve(70)
    kc, _ = cache.write(1, 0, k, -k)
    assert cache.capacity == 128 and kc.shape == (3, 70, 4)
    cache.reserve(150)
    assert cache.capacity == 200  # doubled, capped at max_len
    assert np.array_equal(cache.k[1, :, :70], k.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="201 tokens exceed max_model_len=200"):
        cache.reserve(201)


def test_greedy_takes_lowest_id_on_ties_and_top_logprobs_are_sorted():
    logits = np.array([0.0, 2.0, 1.0, 2.0, -1.0], dtype=np.float32)
    assert select_token(logits, SamplingParams(), None) == 1
    lse = ops.log_softmax_rows(logits[None])[0][0]
    tl = top_logprobs(logits, lse, 3)
    assert [t for t, _ in tl] == [1, 3, 2]
    assert tl[0][1] == pytest.approx(2.0 - np.log(np.exp(logits.astype(np.float64)).sum()), abs=1e-6)
    assert top_logprobs(logits, lse, 1) == [(1, pytest.approx(tl[0][1]))]


def test_seeded_sampling_follows_the_distribution_and_top_k_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    n = 4000
    rng = np.random.default_rng(7)
    draws = np.array([select_token(logits, SamplingParams(temperature=1.0), rng) for _ in range(n)])
    for tok, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        lo, hi = stats.binom.interval(0.9999, n, p)
        assert lo <= (draws == tok).sum() <= hi, (tok, (draws == tok).sum())
    rng = np.random.default_rng(8)
    top2 = {select_token(logits, SamplingParams(1.0, 1.0, 2), rng) for _ in range(300)}
    assert top2 == {0, 1}
    rng = np.random.default_rng(9)
    nucleus = {select_token(logits, SamplingParams(1.0, 0.7, -1), rng) for _ in range(300)}
    assert nucleus == {0, 1}  # 0.5 < 0.7 <= 0.8
    a = [select_token(logits, SamplingParams(0.8), np.random.default_rng(11)) for _ in range(5)]
    assert len(set(a)) == 1  # same seed, same first draw


# ------------------------------------------------------------------ the invariant GEMM's kernel
def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """IEEE 754 fusedMultiplyAdd in binary32, round to nearest even: ``a * b + c`` rounded once.

    Exact: the sum is a ``Fraction``; ``float(Fraction)`` is correctly rounded to binary64, whose
    nearest binary32 is the answer or one of its neighbours, so the three are compared exactly
    (no double rounding). An exact zero takes IEEE's sign rule: -0 only if ``a * b`` and ``c``
    are both -0 (or 0 of negative sign); otherwise +0.
    """
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:
        product_negative = (np.signbit(a) != np.signbit(b))
        return np.float32(-0.0) if product_negative and np.signbit(c) else np.float32(0.0)
    f = np.float32(float(exact))
    candidates = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]

    def key(v: np.float32):
        odd = int(np.array(v).view(np.uint32)) & 1
        return abs(Fraction(float(v)) - exact), odd  # nearest, then the even significand

    return min(candidates, key=key)


def _fma_chain_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The documented result: ``out[i, j] = fma(x[i, K-1], w[K-1, j], ... fma(x[i, 0], w[0, j], +0))``."""
    m, k = x.shape
    out = np.empty((m, w.shape[1]), dtype=np.float32)
    for i in range(m):
        for j in range(w.shape[1]):
            acc = np.float32(0.0)
            for p in range(k):
                acc = _fma32(x[i, p], w[p, j], acc)
            out[i, j] = acc
    return out


def _awkward(shape, seed: int) -> np.ndarray:
    """float32 values over 40 binades, with zeros of both signs: long carries and cancellations."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, size=shape))
    v[rng.random(shape) < 0.1] = 0.0
    v[rng.random(shape) < 0.05] = -0.0
    return v.astype(np.float32)


@pytest.mark.parametrize("isa", ops.GEMM_ISAS)
def test_gemm_invariant_is_exactly_one_fma_chain_per_element_in_k_order(isa):
    """Every element equals the exactly rounded fma chain: on every instruction set, with a
    partial last panel (N = 21), rows 1..9 (every row-block kernel), and K = 0."""
    x, w = _awkward((9, 37), 1), _awkward((37, 21), 2)
    ref = _fma_chain_reference(x, w)
    for m in range(1, 10):
        got = ops.gemm_invariant(x[:m], w, isa=isa)
        assert np.array_equal(got.view(np.uint32), ref[:m].view(np.uint32)), f"M={m}"  # -0 too
    # negative control: the correctly rounded dot product (another order, in effect) differs
    rounded = (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float32)
    assert not np.array_equal(rounded, ref)
    empty = ops.gemm_invariant(np.zeros((3, 0), np.float32), np.zeros((0, 5), np.float32), isa=isa)
    assert np.array_equal(empty.view(np.uint32), np.zeros((3, 5), np.uint32))  # +0.0: the empty chain


@pytest.mark.parametrize("k,n", SMOLLM2_SHAPES + [LM_HEAD, (64, 200), (7, 5)])
def test_every_instruction_set_and_thread_count_gives_the_same_bits(k, n):
    """AVX-512, AVX2 and the portable fmaf path (whichever this CPU runs), on 1, 2, 3 and 5
    threads: the same chain per element, so the same bits, at M = 1, 2, 3, 8, 9, 40."""
    x, w = _rows(k, seed=3), _weight(k, n, 4)
    ref = ops.gemm_invariant(x, w, isa="generic", threads=1)
    for isa in ops.GEMM_ISAS:
        for threads in (1, 2, 3, 5):
            for m in (1, 2, 3, 8, 9, 40):
                got = ops.gemm_invariant(x[:m], w, isa=isa, threads=threads)
                assert np.array_equal(got, ref[:m]), (isa, threads, m)


def test_gemm_invariant_from_several_python_threads_at_once():
    """Callers in parallel (one holds the thread pool, the others compute on their own thread):
    every result is the bits of the call made alone."""
    import concurrent.futures

    w = _weight(576, 3072, 5)
    xs = [_rows(576, m, seed=m) for m in (1, 7, 32, 33)]
    alone = [ops.gemm_invariant(x, w) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda x: ops.gemm_invariant(x, w), xs))
            assert all(np.array_equal(g, a) for g, a in zip(got, alone))


def test_gemm_invariant_in_a_forked_child():
    """The thread pool is made again in a forked child (its workers do not survive a fork)."""
    import multiprocessing

    w = _weight(576, 960, 6)
    x = _rows(576, 17, seed=6)
    want = ops.gemm_invariant(x, w, threads=2)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(ops.gemm_invariant, (x, w), {"threads": 2}).get(timeout=60)
    assert np.array_equal(got, want)


def test_gemm_invariant_refuses_mismatched_shapes_and_unknown_instruction_sets():
    with pytest.raises(ValueError, match=r"x is \[2, 3\] but w is \[4, 5\]"):
        ops.gemm_invariant(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="isa 'sse9' is not one this CPU runs"):
        ops.gemm_invariant(np.zeros((2, 3), np.float32), np.zeros((3, 5), np.float32), isa="sse9")


def test_a_weight_is_packed_once_and_dropped_with_it():
    import gc

    w = np.arange(12, dtype=np.float32).reshape(3, 4)  # [K=3, N=4]: one panel, 12 zero columns
    wp = ops.packed_weight(w)
    assert ops.packed_weight(w) is wp and wp.shape == (3 * 16,)
    assert np.array_equal(wp.reshape(3, 16)[:, :4], w) and not wp.reshape(3, 16)[:, 4:].any()
    key = id(w)
    del w
    gc.collect()
    assert key not in ops._PACKED


def test_an_unbuilt_or_stale_kernel_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(ops, "_ROWGEMM_MISSING", "bistat.engines.embedded._rowgemm is version 0, this "
                        "bistat needs 1; rebuild bistat's C part with `pip install -e .`")
    with pytest.raises(RuntimeError, match=r"the invariant GEMM: .*version 0.*pip install -e \."):
        ops.gemm_invariant(np.zeros((1, 3), np.float32), np.zeros((3, 2), np.float32))
