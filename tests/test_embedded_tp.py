"""Emulated tensor parallelism in the embedded engine (``tensor_parallel_size``).

Megatron-style shards computed rank after rank in one process: per-rank GEMMs of the
column-parallel layers, per-rank partial sums of the row-parallel layers combined by
``ops.all_reduce`` in the collective's order (``bistat.engines.embedded.forward``, ``bistat.engines.embedded.ops``).
The questions: does ``T == 1`` stay the plain engine bit for bit, and does the ``"invariant"``
mode's batch invariance survive ``T = 2, 3``?

Never rerun these tests on failure: a flaky difference is exactly what they measure.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from helpers_embedded import (
    decode_logits,
    near_tie_model,
    prefilled,
    real_model_or_skip,
    reference_logits,
    tiny,
)

from bistat.engines.embedded import ops
from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.embedded.forward import Segment, forward_step, prepare_weights
from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.base import EngineRefused, GenerationRequest
from bistat.engines.embedded.adapter import ENGINE_ARGS, EmbeddedEngineAdapter

#: Heads 12, KV heads 6 (grouped-query, 2 per group), intermediate 192: T = 1, 2, 3, 6 divide all.
TP_CONFIG = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 12,
             "num_key_value_heads": 6, "head_dim": 8}
PROMPTS = [f"Prompt number {i}: tell me a story about {w}." for i, w in enumerate(
    ["the sea", "a fox", "Paris", "numbers", "a cat", "rain", "stars", "bread"] * 3)]


@pytest.fixture(scope="module")
def tp_model():
    return tiny(0, **TP_CONFIG)


@pytest.fixture(scope="module")
def near_tie_tp_model():
    return near_tie_model(0, **TP_CONFIG)


def _results(eng, n=12, max_tokens=10):
    reqs = [GenerationRequest(f"p{i}", PROMPTS[i] * (1 + i % 3), max_tokens, ignore_eos=True,
                              logprobs=3) for i in range(n)]
    return eng.generate(reqs)


def _same(a, b):
    return (a.token_ids == b.token_ids and a.top_logprobs == b.top_logprobs
            and np.array_equal(np.array(a.logprobs), np.array(b.logprobs)))


# ------------------------------------------------------------------------------ T == 1
@pytest.mark.parametrize("mode", ["blas", "invariant"])
def test_tp1_is_bitwise_the_engine_without_the_argument(mode):
    """``T == 1`` runs the unsharded forward pass: same tokens, logprobs and top-k bits.

    (Checked once against the engine before the argument existed, on the same inputs: bitwise
    equal in both modes; this test keeps the no-argument engine as that reference.)
    """
    m = near_tie_model(0)  # the default tiny shape, with near-ties that expose any change
    plain = EmbeddedEngine(m, mode, max_batch_size=8, prefill_chunk=16)
    tp1 = EmbeddedEngine(m, mode, max_batch_size=8, prefill_chunk=16, tensor_parallel_size=1)
    assert tp1.tensor_parallel_size == 1 and tp1.weights.tensor_parallel_size == 1
    assert all(not lw.ranks for lw in tp1.weights.layers)
    for a, b in zip(_results(plain), _results(tp1)):
        assert _same(a, b), a.prompt_id


# ------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("tp", [2, 3, 6])
def test_sharded_forward_matches_the_float64_reference(tp_model, tp):
    """The shards compute the same model: logits within float32 rounding of the reference."""
    ids = np.random.default_rng(0).integers(3, tp_model.config.vocab_size, size=30).tolist()
    ref = reference_logits(tp_model.config, tp_model.weights, ids)[-1]
    wt = prepare_weights(tp_model.config, tp_model.weights, 64, tp)
    assert wt.tensor_parallel_size == tp and all(len(lw.ranks) == tp for lw in wt.layers)
    assert all(lw.qkv is None and lw.gate_up is None for lw in wt.layers)  # dropped: no 2x memory
    assert wt.nbytes == prepare_weights(tp_model.config, tp_model.weights, 64).nbytes
    d = wt.dims
    for mode in ("blas", "invariant"):
        cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 64)
        got = forward_step(wt, [Segment(cache, ids, 0, True)], mode)[0]
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 + 2e-5 * np.abs(ref).max())


def test_tp2_and_tp1_differ_in_the_last_bits_in_invariant_mode(tp_model):
    """Invariant mode at T=2 is invariant, not equal to T=1: split sums.

    Observed (deterministically, every run): most logits differ in the last bits, by ~1e-5.
    The row-parallel layers sum K = H*d (o_proj) and K = I (down_proj) as two halves added
    once by the all-reduce instead of one long fma chain. (The column-parallel GEMMs are not the
    cause: each output column is its own chain over K, whatever N the rank's GEMM has; see
    the next test.) Batch invariance is a property of one configuration; TP=1 and TP=2 are two
    configurations, as on GPUs.
    """
    d = tp_model.config
    logits = {}
    for tp in (1, 2):
        wt = prepare_weights(tp_model.config, tp_model.weights, 64, tp)
        rows = []
        for s in range(4):
            ids = np.random.default_rng(s).integers(3, d.vocab_size, size=5 + 3 * s).tolist()
            cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 64)
            rows.append(forward_step(wt, [Segment(cache, ids, 0, True)], "invariant")[0])
        logits[tp] = np.stack(rows)  # [4, V]
    differ = logits[2] != logits[1]
    assert differ.mean() > 0.5, f"only {differ.sum()} of {differ.size} logits differ"
    np.testing.assert_allclose(logits[2], logits[1], rtol=0, atol=1e-4)


def test_invariant_column_parallel_gemms_give_the_unsharded_columns_bitwise(tp_model):
    """A column's fma chain does not depend on the GEMM's N: the ranks' Q/K/V and gate/up columns,
    put back in order, are bitwise the unsharded GEMM's, at T = 2, 3 and 6."""
    from bistat.engines.embedded.forward import _qkv_column_parallel

    whole = prepare_weights(tp_model.config, tp_model.weights, 64)
    hn = np.random.default_rng(0).standard_normal((7, whole.dims.hidden_size)).astype(np.float32)
    for tp in (2, 3, 6):
        sharded = prepare_weights(tp_model.config, tp_model.weights, 64, tp)
        for lw, ls in zip(whole.layers, sharded.layers):
            assert np.array_equal(_qkv_column_parallel(hn, ls.ranks, "invariant"),
                                  ops.gemm(hn, lw.qkv, "invariant")), tp
            i = whole.dims.intermediate_size // tp
            ref = ops.gemm(hn, lw.gate_up, "invariant")  # [7, 2I]: gate | up
            for r, rw in enumerate(ls.ranks):
                got = ops.gemm(hn, rw.gate_up, "invariant")  # [7, 2I/T]: its gate | its up
                half = whole.dims.intermediate_size
                assert np.array_equal(got[:, :i], ref[:, r * i:(r + 1) * i]), (tp, r)
                assert np.array_equal(got[:, i:], ref[:, half + r * i:half + (r + 1) * i]), (tp, r)


# ------------------------------------------------------------------------------ invariance
@pytest.mark.parametrize("tp", [2, 3])
def test_invariant_tp_logits_bitwise_equal_at_every_batch_size_and_position(tp_model, tp):
    wt = prepare_weights(tp_model.config, tp_model.weights, 160, tp)
    seqs = prefilled(wt, "invariant", 20, max_len=128)
    alone = [decode_logits(wt, "invariant", seqs, [j])[0] for j in range(20)]
    for b in range(1, 21):
        members = list(range(b))
        for shift in {0, b - 1}:
            order = members[shift:] + members[:shift]  # every member at a new position
            logits = decode_logits(wt, "invariant", seqs, order)
            bad = [j for pos, j in enumerate(order) if not np.array_equal(logits[pos], alone[j])]
            assert not bad, f"T={tp}, batch {b}, rotation {shift}: requests {bad} changed"
    # prefill rows in the same step; 150 rows: past the size (96 rows at D = 96) from which
    # blas mode's all-reduce would take the ring (invariant mode: rank order whatever the size)
    d = wt.dims
    for n_prefill in (1, 9, 150):
        newcomer = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, 160)
        segs = [Segment(newcomer, list(range(3, 3 + n_prefill)), 0, True)]
        segs += [Segment(c, [t], p, True) for c, t, p in seqs[:3]]
        logits = forward_step(wt, segs, "invariant")
        assert np.array_equal(logits[1], alone[0]), f"T={tp}: {n_prefill} prefill rows changed it"


def test_blas_tp3_logits_depend_on_the_batch(tp_model):
    """Negative control for the test above: the same check in blas mode finds differences."""
    wt = prepare_weights(tp_model.config, tp_model.weights, 128, 3)
    seqs = prefilled(wt, "blas", 20, max_len=128)
    alone = decode_logits(wt, "blas", seqs, [0])[0]
    changed = [b for b in range(2, 21)
               if not np.array_equal(decode_logits(wt, "blas", seqs, list(range(b)))[0], alone)]
    assert changed, "blas mode at T=3 gave bitwise equal logits at every batch size 2..20"


def _generate(eng, target, neighbours, position):
    reqs = [GenerationRequest(f"n{i}", p, 16, ignore_eos=True, logprobs=3)
            for i, p in enumerate(neighbours)]
    reqs.insert(position, GenerationRequest("target", target, 16, ignore_eos=True, logprobs=3))
    return {r.prompt_id: r for r in eng.generate(reqs)}["target"]


@pytest.mark.parametrize("tp", [2, 3])
def test_invariant_tp_engine_tokens_and_logprobs_independent_of_neighbours(near_tie_tp_model, tp):
    """Near-tie model (blas flips greedy choices with the batch): invariant TP stays bitwise."""
    eng = EmbeddedEngine(near_tie_tp_model, "invariant", max_batch_size=24, prefill_chunk=16,
                         tensor_parallel_size=tp)
    alone = _generate(eng, PROMPTS[0], [], 0)
    for b, pos in [(2, 1), (5, 4), (9, 3), (17, 8), (24, 23)]:
        got = _generate(eng, PROMPTS[0], PROMPTS[1:b], pos)
        assert _same(got, alone), f"T={tp}, batch {b}, position {pos}"
    # negative control: the same model and T in blas mode changes its greedy tokens
    blas = EmbeddedEngine(near_tie_tp_model, "blas", max_batch_size=24, prefill_chunk=16,
                          tensor_parallel_size=tp)
    alone = _generate(blas, PROMPTS[0], [], 0)
    assert _generate(blas, PROMPTS[0], PROMPTS[1:9], 3).token_ids != alone.token_ids


def test_invariant_tp_prefill_gives_the_decode_bits(tp_model):
    """``prompt_logprobs`` (a prefill of each prefix) carries the shards too: same bits."""
    exp = SimpleNamespace(engine=SimpleNamespace(kind="embedded", model="tiny",
                                                 args={"tensor_parallel_size": 3}))
    arm = SimpleNamespace(name="inv", args={"gemm": "invariant"}, env={})
    eng = EmbeddedEngineAdapter(exp, arm, loader=lambda name: tp_model)
    info = eng.start()
    try:
        assert info.args["tensor_parallel_size"] == 3
        assert info.log_findings[1].startswith("embedded tensor parallelism: 3 ranks emulated")
        req = GenerationRequest("p", "prompt for prefill", 6, ignore_eos=True)
        got = []
        eng.run_pass([req], concurrency=1, on_result=got.append, on_metrics=lambda s: None)
        assert eng.prompt_logprobs(req, got[0].token_ids) == got[0].logprobs
    finally:
        eng.stop()


@pytest.mark.model
def test_invariant_tp3_real_model_bitwise_independent_of_neighbours():
    """SmolLM2-135M (9 heads, 3 KV heads, intermediate 1536) at T=3: alone == among 3 others.

    T=2 is no option for it (9 heads), as with vLLM; the refusal says which values are.
    """
    model = real_model_or_skip()
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\), num_key_value_heads "
                                         r"\(3\) and intermediate_size \(1536\); valid "
                                         r"values: \[1, 3\]$"):
        EmbeddedEngine(model, "invariant", tensor_parallel_size=2)
    eng = EmbeddedEngine(model, "invariant", max_batch_size=4, tensor_parallel_size=3)
    others = ["Write a short poem about the sea.", "Explain how photosynthesis works.",
              "Tell me a joke about cats."]
    reqs = [GenerationRequest(str(i), p, 12, ignore_eos=True, chat=True)
            for i, p in enumerate(["What is the capital of France?"] + others)]
    alone = eng.generate(reqs[:1])[0]
    together = eng.generate(reqs)[0]
    assert together.token_ids == alone.token_ids
    assert np.array_equal(np.array(together.logprobs), np.array(alone.logprobs))


# ------------------------------------------------------------------------------ all_reduce
def _parts(t, m, d=576, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((m, d), dtype=np.float32) for _ in range(t)]


def _ring(parts):
    """Reduce-scatter by hand: chunk c starts at rank (c + 1) % T and ends with rank c."""
    t = len(parts)
    chunks = [np.array_split(p, t, axis=1) for p in parts]
    out = []
    for c in range(t):
        acc = chunks[(c + 1) % t][c].copy()
        for j in range(2, t + 1):
            acc = acc + chunks[(c + j) % t][c]
        out.append(acc)
    return np.concatenate(out, axis=1)


RING_ROWS = math.ceil(ops.ALLREDUCE_RING_MIN_BYTES / (576 * 4))  # 16 rows of SmolLM2's D = 576


def test_all_reduce_threshold_switches_tree_and_ring_by_rows():
    assert RING_ROWS == 16
    for m, want in [(1, "tree"), (RING_ROWS - 1, "tree"), (RING_ROWS, "ring"), (544, "ring")]:
        assert ops.allreduce_algorithm(m * 576 * 4, "blas") == want, m
        assert ops.allreduce_algorithm(m * 576 * 4, "invariant") == "rank-order", m
    with pytest.raises(ValueError, match="all_reduce: mode \\('fast'\\)"):
        ops.all_reduce(_parts(2, 1), "fast")
    # T = 4, where tree, ring and rank order all associate differently: which one ran
    for m, order in [(RING_ROWS - 1, "tree"), (RING_ROWS, "ring")]:
        p = _parts(4, m, seed=m)
        want = (p[0] + p[1]) + (p[2] + p[3]) if order == "tree" else _ring(p)
        assert np.array_equal(ops.all_reduce(p, "blas"), want), (m, order)


def test_all_reduce_at_tp2_is_commutative_hence_batch_invariant():
    """T = 2: tree, ring and rank order all compute p0 + p1 (IEEE addition commutes)."""
    for m in (1, 3, RING_ROWS - 1, RING_ROWS, 100):
        p = _parts(2, m, seed=m)
        want = p[0] + p[1]
        assert np.array_equal(ops.all_reduce(p, "blas"), want), m
        assert np.array_equal(ops.all_reduce(p, "invariant"), want), m
        assert np.array_equal(ops.all_reduce(p[::-1], "blas"), want), m
    # so a row's bits do not depend on how many rows the message has, in blas mode too
    p = _parts(2, 100, seed=7)
    whole = ops.all_reduce(p, "blas")  # ring
    rows = np.concatenate([ops.all_reduce([q[i:i + 1] for q in p], "blas") for i in range(100)])
    assert np.array_equal(whole, rows)


def test_all_reduce_at_tp3_ring_and_tree_differ_in_the_last_bits():
    p = _parts(3, 64, seed=3)
    whole = ops.all_reduce(p, "blas")  # 64 rows: ring
    assert np.array_equal(whole, _ring(p))
    rows = np.concatenate([ops.all_reduce([q[i:i + 1] for q in p], "blas") for i in range(64)])
    assert np.array_equal(rows, (p[0] + p[1]) + p[2])  # 1 row each: tree
    differ = whole != rows
    assert differ.any(), "ring and tree orders gave the same bits on 64 x 576 random floats"
    np.testing.assert_allclose(whole, rows, rtol=1e-6, atol=1e-6)  # rounding only
    # the last chunk's ring order, (p0 + p1) + p2, is the tree's: only chunks 0 and 1 differ
    assert not differ[:, 384:].any() and differ[:, :384].any()


@pytest.mark.parametrize("t", [3, 4, 5])
def test_all_reduce_invariant_is_rank_order_left_to_right_whatever_the_rows(t):
    p = _parts(t, 40, seed=t)
    want = p[0] + p[1]
    for q in p[2:]:
        want = want + q
    whole = ops.all_reduce(p, "invariant")
    assert np.array_equal(whole, want)
    for m in (1, 7, RING_ROWS, 40):  # a row's bits never depend on the message's row count
        assert np.array_equal(ops.all_reduce([q[:m] for q in p], "invariant"), want[:m]), m
    assert np.array_equal(ops.all_reduce(p[:1], "invariant"), p[0])


# ------------------------------------------------------------------------------ refusals
VALID = "[1, 2, 3, 6]"


def _message(value):
    return (f"tensor_parallel_size ({value!r}) must be an integer >= 1 that divides the model's "
            "num_attention_heads (12), num_key_value_heads (6) and intermediate_size (192); "
            f"valid values: {VALID}")


REFUSED = [0, -1, 2.0, True, 4, "2"]


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_engine_refuses_a_size_the_model_cannot_be_sharded_by(tp_model, value):
    with pytest.raises(ValueError) as info:
        EmbeddedEngine(tp_model, tensor_parallel_size=value)
    assert str(info.value) == _message(value)


def test_default_tiny_model_lists_its_own_valid_sizes():
    with pytest.raises(ValueError) as info:
        EmbeddedEngine(tiny(0), tensor_parallel_size=3)
    assert str(info.value) == (
        "tensor_parallel_size (3) must be an integer >= 1 that divides the model's "
        "num_attention_heads (4), num_key_value_heads (2) and intermediate_size (128); "
        "valid values: [1, 2]")


@pytest.mark.parametrize("value", REFUSED, ids=repr)
@pytest.mark.parametrize("where", ["engine", "arm"])
def test_adapter_refuses_naming_the_declaration_field_and_the_fix(tp_model, value, where):
    engine_args = {"tensor_parallel_size": value} if where == "engine" else {}
    arm_args = {"gemm": "invariant", **({"tensor_parallel_size": value} if where == "arm" else {})}
    exp = SimpleNamespace(engine=SimpleNamespace(kind="embedded", model="tiny", args=engine_args))
    arm = SimpleNamespace(name="inv", args=arm_args, env={})
    eng = EmbeddedEngineAdapter(exp, arm, loader=lambda name: tp_model)
    with pytest.raises(EngineRefused) as info:
        eng.start()
    field = ("engine.args.tensor_parallel_size" if where == "engine"
             else "arms[inv].args.tensor_parallel_size")
    assert str(info.value) == (f"{field}: {_message(value)}. Fix: set {field} to one of "
                               f"{VALID}, or remove it (default 1, no tensor parallelism)")
    assert eng.engine is None


def test_adapter_reports_the_default_size(tp_model):
    assert "tensor_parallel_size" in ENGINE_ARGS
    exp = SimpleNamespace(engine=SimpleNamespace(kind="embedded", model="tiny", args={}))
    eng = EmbeddedEngineAdapter(exp, SimpleNamespace(name="a", args={}, env={}),
                                loader=lambda name: tp_model)
    info = eng.start()
    try:
        assert info.args["tensor_parallel_size"] == 1
        assert not any("tensor parallelism" in f for f in info.log_findings)
    finally:
        eng.stop()


# ------------------------------------------------------------------------------ end to end
def test_tp3_matching_study_end_to_end(tmp_path, near_tie_tp_model):
    """Register, run (real runner, real adapter, TP=3) and analyse a two-arm study on CPU."""
    from helpers_explain import BLAS_ARMS, record_run

    from bistat.analysis.summary import analyze_run
    from bistat.model.loader import save_model
    from bistat.store.readers import read_jsonl

    model_dir = tmp_path / "model"
    save_model(near_tie_tp_model, model_dir)
    run_dir = record_run(tmp_path, "tp3-match", BLAS_ARMS, model_dir=model_dir, n_prompts=6,
                         passes=2, engine_args="max_batch_size = 8, prefill_chunk = 8, "
                                               "max_model_len = 256, tensor_parallel_size = 3")
    env, _ = read_jsonl(run_dir / "environment.jsonl")
    assert {(e["arm"], e["engine"]["args"]["tensor_parallel_size"]) for e in env} == {
        ("blas", 3), ("invariant", 3)}
    summary = analyze_run(run_dir, tmp_path / "preregistrations" / "tp3-match.json")
    arms = {a.name: a for a in summary.arms}
    assert (arms["invariant"].n_prompts, arms["invariant"].n_prompts_matched) == (6, 6)
    assert arms["invariant"].n_matched == arms["invariant"].n_units
    assert arms["blas"].n_prompts == 6  # whatever it matched: batch-variant, not asserted
