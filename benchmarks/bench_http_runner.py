"""Benchmark: requests/s the HTTP runner (OpenAIHTTPEngine) sustains against an instant server.

The server runs in a separate process (uvicorn, answers every completion at once with a fixed
body), so the figure measures the client side: bistat's goal is >= 200 requests/s without the
runner being the bottleneck.

    python benchmarks/bench_http_runner.py [--requests 2000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time

import httpx

from bistat.engines.base import GenerationRequest
from bistat.engines.openai_http import OpenAIHTTPEngine
from bistat.engines.vllm_server import _free_port


def wait_up(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the server at ``url`` answers ``GET /v1/models`` (raise after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

ANSWER = {"choices": [{"index": 0, "text": "abcd", "finish_reason": "length",
                       "token_ids": [1, 2, 3, 4], "prompt_token_ids": [5, 6],
                       "logprobs": {"tokens": ["token_id:1", "token_id:2", "token_id:3", "token_id:4"],
                                    "token_logprobs": [-0.1, -0.2, -0.3, -0.4],
                                    "text_offset": [0, 1, 2, 3],
                                    "top_logprobs": [{"token_id:1": -0.1}, {"token_id:2": -0.2},
                                                     {"token_id:3": -0.3}, {"token_id:4": -0.4}]}}],
          "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}


def instant_server(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def completions(request):
        await request.body()
        return JSONResponse(ANSWER)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "instant", "object": "model"}]})

    async def metrics(request):
        return Response('vllm:num_requests_running{model_name="instant"} 0.0\n')

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/metrics", metrics)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                http="h11", loop="asyncio", backlog=4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        instant_server(args.serve)
        return 0
    port = _free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        eng = OpenAIHTTPEngine(url, metrics_interval_s=1.0)
        eng.start()
        reqs = [GenerationRequest(prompt_id=str(i), prompt=[5, 6], max_tokens=4)
                for i in range(args.requests)]
        # validate before timing: one small pass must come back complete and error-free
        check: list = []
        eng.run_pass(reqs[:50], concurrency=args.concurrency, on_result=check.append,
                     on_metrics=lambda s: None)
        assert len(check) == 50 and all(r.error is None and r.token_ids == [1, 2, 3, 4] for r in check)
        results: list = []
        samples: list = []
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        eng.run_pass(reqs, concurrency=args.concurrency, on_result=results.append,
                     on_metrics=samples.append)
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        client_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    finally:
        proc.terminate()
        proc.wait()
    failed = sum(r.error is not None for r in results)
    rate = len(results) / wall
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"requests: {len(results)}  failed: {failed}  concurrency: {args.concurrency}")
    print(f"wall: {wall:.2f} s  requests/s: {rate:.0f}  metrics samples: {len(samples)}")
    print(f"client CPU: {client_cpu:.2f} s = {1000 * client_cpu / len(results):.2f} ms/request -> "
          f"{len(results) / client_cpu:.0f} requests/s per free core "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"goal >= 200 requests/s: {'met' if rate >= 200 and failed == 0 else 'NOT met'}")
    return 0 if rate >= 200 and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
