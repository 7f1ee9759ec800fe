"""Benchmark of the embedded numpy engine: batched greedy decode, blas vs invariant (the tax).

Goal: invariant / blas decode throughput >= 0.8 at batch 1 and >= 0.95 at batch 32.

Prints, for each GEMM mode and batch size, the decode throughput (output tokens per second over
the decode steps, the prefill step excluded) and the end-to-end throughput (all output tokens over
the wall time, prefill included), the median over interleaved repeats (blas, invariant, blas, ...),
the ratio invariant / blas (the determinism tax), and the peak resident memory of the process.

Validates before timing (Triton tutorial style): with the real model, greedy chat "What is the
capital of France?" must answer "The capital of France is Paris." in both modes.

    python benchmarks/bench_embedded.py                     # SmolLM2-135M if cached, else random weights
    python benchmarks/bench_embedded.py --batch 1 --batch 32 --max-tokens 64 --repeats 3

Run it on a quiet machine: the figures are wall-clock and share the 2 cores with whatever else
runs (the load average is printed before and after). OPENBLAS_CORETYPE is reported, not changed.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import numpy as np

from bistat.engines.embedded import ops
from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.base import GenerationRequest

PROMPTS = ["Write a short poem about the sea.", "Explain how photosynthesis works.",
           "What is the largest planet in the solar system?", "Tell me a joke about cats.",
           "Describe the city of Paris.", "How do I bake bread?", "What is machine learning?",
           "Give me three tips for studying."]


def _load(name: str):
    if name == "random":
        from bistat.model.testing import tiny_random_model

        return tiny_random_model(0, tokenizer="byte", hidden_size=576, intermediate_size=1536,
                                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                 head_dim=64, vocab_size=49152, rope_theta=100000.0,
                                 max_position_embeddings=8192), False
    from bistat.model import load_model
    from bistat.model.errors import ModelError

    try:
        return load_model(name), True
    except ModelError as exc:
        print(f"# {name} not cached ({exc}); using random weights of the SmolLM2-135M shape")
        return _load("random")


def _blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    return "; ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
                     f"threads={i.get('num_threads')}" for i in threadpool_info() if i.get("user_api") == "blas")


def run_once(eng: EmbeddedEngine, batch: int, max_tokens: int, chat: bool) -> tuple[float, float, int]:
    """(decode tokens/s, end-to-end tokens/s, output tokens) of one batch of greedy requests."""
    reqs = [GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos=True, chat=chat)
            for i in range(batch)]
    n0 = len(eng.step_log)
    t0 = time.perf_counter()
    results = eng.generate(reqs)
    wall = time.perf_counter() - t0
    steps = eng.step_log[n0:]
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    total = sum(len(r.token_ids) for r in results)
    # tokens produced by the steps after the first (the first step prefills every prompt)
    decode_tokens = total - batch
    decode_s = steps[-1][0] - steps[0][0]
    return decode_tokens / decode_s if decode_s > 0 else float("nan"), total / wall, total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="registered name, folder, or 'random'")
    ap.add_argument("--batch", type=int, action="append", help="batch sizes (default 32 and 1)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    batches = args.batch or [32, 1]

    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"numpy {np.__version__}, BLAS: {_blas_info()}")
    print(f"# OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')}")
    print(f"# invariant GEMM: bistat _rowgemm (one fma chain per element, no BLAS), "
          f"{ops.GEMM_ISAS[-1]}, {ops.gemm_threads()} threads")
    print(f"# load average before: {os.getloadavg()}")
    model, real = _load(args.model)
    blas = EmbeddedEngine(model, "blas", max_batch_size=max(batches), max_model_len=512)
    engines = {"blas": blas,
               "invariant": EmbeddedEngine(model, "invariant", max_batch_size=max(batches),
                                           max_model_len=512, prepared=blas.weights)}
    weights_mib = engines["blas"].weights.nbytes / 2**20
    del model  # the engines keep only their prepared weights
    if real:
        for mode, eng in engines.items():
            r = eng.generate([GenerationRequest("v", "What is the capital of France?", 32, chat=True)])[0]
            assert r.text == "The capital of France is Paris.", (mode, r.text)
        print("# validated: greedy chat answers 'The capital of France is Paris.' in both modes")
    for eng in engines.values():  # warm-up (first touches of every weight page)
        run_once(eng, 2, 4, real)

    print("mode,batch,max_tokens,decode_tok_s_median,e2e_tok_s_median,decode_tok_s_all")
    medians: dict[tuple[str, int], float] = {}
    for batch in batches:
        samples: dict[str, list[tuple[float, float]]] = {"blas": [], "invariant": []}
        for _ in range(args.repeats):
            for mode in ("blas", "invariant"):
                dec, e2e, _ = run_once(engines[mode], batch, args.max_tokens, real)
                samples[mode].append((dec, e2e))
        for mode, s in samples.items():
            dec = statistics.median(x for x, _ in s)
            e2e = statistics.median(y for _, y in s)
            medians[(mode, batch)] = dec
            print(f"{mode},{batch},{args.max_tokens},{dec:.1f},{e2e:.1f},"
                  + " ".join(f"{x:.1f}" for x, _ in s))
    for batch in batches:
        ratio = medians[("invariant", batch)] / medians[("blas", batch)]
        tax = (f"determinism tax {100 * (1 - ratio):.1f} %" if ratio < 1 else
               "no determinism tax: the invariant mode is not slower")
        print(f"# batch {batch}: invariant / blas decode throughput = {ratio:.3f} ({tax})")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    packed_mib = ops.packed_bytes() / 2**20
    print(f"# prepared weights: {weights_mib:.0f} MiB (shared by both engines), packed for the "
          f"invariant GEMM: {packed_mib:.0f} MiB; peak RSS of this process, model loaded and every "
          f"run done: {peak:.0f} MiB")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
