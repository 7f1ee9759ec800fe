"""The embedded engine's operators: row invariance (bitwise) and accuracy (allclose)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from bistat.embedded import ops
from bistat.embedded.kvcache import KVCache
from bistat.embedded.sampling import SamplingParams, select_token, top_logprobs

# SmolLM2-135M's GEMM shapes (K = in_features, N = out_features): qkv, o, gate_up, down.
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
BATCHES = range(1, 41)


def _rows(k: int, m: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


@pytest.mark.parametrize("k,n", SMOLLM2_SHAPES)
def test_gemm_invariant_rows_are_bitwise_independent_of_batch_and_position(k, n):
    rng = np.random.default_rng(k + n)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    x = _rows(k)
    alone = np.stack([ops.gemm_invariant(x[i:i + 1], w)[0] for i in range(len(x))])  # [40, N]
    for m in BATCHES:
        out = ops.gemm_invariant(x[:m], w)
        bad = [i for i in range(m) if not np.array_equal(out[i], alone[i])]
        assert not bad, f"M={m}: rows {bad} differ from the same rows computed alone"
        perm = np.random.default_rng(m).permutation(m)
        out = ops.gemm_invariant(x[perm], w)
        assert np.array_equal(out, alone[perm]), f"M={m}: a permuted batch changed some row"
    np.testing.assert_allclose(alone, x @ w, rtol=1e-5, atol=1e-5)


def test_gemm_invariant_lm_head_shape():
    k, n = 576, 49152
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    x = _rows(k, 33)
    alone = ops.gemm_invariant(x[:1], w)[0]
    for m in (2, 7, 16, 17, 33):
        assert np.array_equal(ops.gemm_invariant(x[:m], w)[0], alone), f"M={m}"


def test_blas_gemm_is_batch_variant_on_this_machine():
    """Negative control: without tiles, a row's float32 result depends on M (OpenBLAS kernels)."""
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


def _position_dependent(broken: set[str]):
    """A ``_tile_product`` whose rows 6.. come out with other bits in the ``broken`` layouts, as
    OpenBLAS 0.3.31's AVX2 SGEMM kernel gives them in a 16-row call; in the other layouts every
    row is computed alone (float64 without BLAS, rounded), so nothing depends on this machine's BLAS."""

    def product(xt, w, layout, out):
        out[:] = np.einsum("ik,kj->ij", xt.astype(np.float64), w.astype(np.float64),
                           optimize=False).astype(np.float32)  # no BLAS: row by row
        if layout in broken:
            out[6:] = np.nextafter(out[6:], np.float32(np.inf))

    return product


@pytest.mark.parametrize("broken, chosen", [(set(), "rows"), ({"rows"}, "columns"),
                                            ({"rows", "columns"}, "row-by-row")])
def test_the_tile_layout_is_the_first_whose_rows_do_not_depend_on_their_position(
        monkeypatch, broken, chosen):
    monkeypatch.setattr(ops, "_LAYOUT", {})
    monkeypatch.setattr(ops, "_tile_product", _position_dependent(broken))
    assert ops.tile_layout(24, 20, 16) == chosen
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 24), dtype=np.float32)
    w = rng.standard_normal((24, 20), dtype=np.float32)
    alone = np.stack([ops.gemm_invariant(x[i:i + 1], w)[0] for i in range(len(x))])
    # under the broken layouts a row's bits would follow its position; the chosen one keeps them
    assert np.array_equal(ops.gemm_invariant(x, w), alone)
    assert np.array_equal(ops.gemm_invariant(x[::-1].copy(), w), alone[::-1])


def test_every_layout_computes_the_same_product_to_float32_rounding():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 72), dtype=np.float32)
    w = rng.standard_normal((72, 40), dtype=np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    for layout in ops.TILE_LAYOUTS:
        out = np.empty((16, 40), dtype=np.float32)
        ops._tile_product(x, w, layout, out)
        np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-4)


def test_the_columns_layout_keeps_a_weight_transposed_only_while_the_weight_lives():
    import gc

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    wt = ops._transposed(w)
    assert ops._transposed(w) is wt and np.array_equal(wt, w.T) and wt.flags.c_contiguous
    key = id(w)
    del w
    gc.collect()
    assert key not in ops._TRANSPOSED
