"""Benchmark: what ``bistat serve`` adds to the embedded engine's throughput at batch 32.

Side by side in one process, same engine object, same requests (greedy, ignore_eos, token-id
prompts): (a) submitted straight to ``EmbeddedEngine.submit``; (b) sent through the HTTP server
(``bistat.engines.serve.server`` on loopback) by ``OpenAIHTTPEngine`` at concurrency 32. Reports output tokens/s
of each and the overhead; the goal is < 5 %.

    python benchmarks/bench_serve_overhead.py [--model smollm2-135m] [--gemm blas]
        [--requests 64] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import platform
import statistics
import sys
import time

from bistat.engines.base import GenerationRequest
from bistat.engines.openai_http import OpenAIHTTPEngine
from bistat.engines.serve.server import BackgroundServer, create_app


def _requests(n: int, max_tokens: int, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_id=f"{tag}{i}", prompt=[1] + [100 + (i * 7 + k) % 500 for k in range(16)],
                              max_tokens=max_tokens, ignore_eos=True) for i in range(n)]


def direct(engine, reqs) -> float:
    t0 = time.perf_counter()
    futures = [engine.submit(r) for r in reqs]
    results = [f.result() for f in concurrent.futures.as_completed(futures)]
    wall = time.perf_counter() - t0
    assert all(r.error is None for r in results)
    return sum(len(r.token_ids) for r in results) / wall


def over_http(client: OpenAIHTTPEngine, reqs, concurrency: int) -> float:
    results: list = []
    t0 = time.perf_counter()
    client.run_pass(reqs, concurrency=concurrency, on_result=results.append, on_metrics=lambda s: None)
    wall = time.perf_counter() - t0
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return sum(len(r.token_ids) for r in results) / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--gemm", default="blas", choices=["blas", "invariant"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model

    model = load_model(args.model)
    engine = EmbeddedEngine(model, gemm=args.gemm, max_batch_size=args.batch, max_model_len=2048)
    engine.start()
    app = create_app(engine, model.tokenizer, model_name=args.model, max_model_len=2048,
                     vocab_size=int(model.config.vocab_size), manage_engine=False)
    try:
        with BackgroundServer(app) as srv:
            client = OpenAIHTTPEngine(srv.url, metrics_interval_s=1.0)
            client.start()
            # validate before timing: the same greedy request gives the same tokens both ways
            (a,) = [engine.submit(r).result() for r in _requests(1, 8, "v")]
            got: list = []
            client.run_pass(_requests(1, 8, "v"), concurrency=1, on_result=got.append,
                            on_metrics=lambda s: None)
            assert got[0].token_ids == a.token_ids, (got[0].token_ids, a.token_ids)
            direct(engine, _requests(args.batch, 8, "w"))  # warm-up
            d_rates, h_rates = [], []
            for rep in range(args.repeats):  # interleaved: a, b, a, b, ...
                d_rates.append(direct(engine, _requests(args.requests, args.max_tokens, f"d{rep}-")))
                h_rates.append(over_http(client, _requests(args.requests, args.max_tokens, f"h{rep}-"),
                                         args.batch))
    finally:
        engine.stop()
    d, h = statistics.median(d_rates), statistics.median(h_rates)
    overhead = 1 - h / d
    print(f"machine: {platform.machine()}, python {platform.python_version()}, model {args.model}, "
          f"gemm {args.gemm}, batch {args.batch}, {args.requests} requests x {args.max_tokens} tokens")
    print("direct  tokens/s per repeat: " + ", ".join(f"{x:.1f}" for x in d_rates))
    print("http    tokens/s per repeat: " + ", ".join(f"{x:.1f}" for x in h_rates))
    print(f"median direct {d:.1f} tokens/s, via bistat serve {h:.1f} tokens/s, overhead {100 * overhead:.1f} %")
    print(f"goal < 5 % overhead: {'met' if overhead < 0.05 else 'NOT met'}")
    return 0 if overhead < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
