"""Benchmark: bistat's HTTP client ceiling with vLLM-shaped chat answers of 256 tokens with logprobs.

Question it answers: in the H200 run ``h200-match-smollm2`` (vLLM 0.25.0 ``vllm serve``,
SmolLM2-135M, 541 chat requests per pass, concurrency 64, max_tokens 256, top_logprobs 5,
``return_token_ids``) a pass reached about 30 requests/s (6.4k output tokens/s). Could bistat's
own asyncio client (``OpenAIHTTPEngine``: httpx, ``json.loads``, ``parse_completion_choice``, and
the runner's ``on_result`` that writes and fsyncs one ``responses.jsonl`` line per answer) be
the limit?

A local server (uvicorn + starlette, in its own process) answers ``/v1/chat/completions`` at
once with a canned body shaped like vLLM 0.25.0's non-streaming chat answer (``logprobs.content``
entries with ``token`` = ``token_id:N``, ``bytes`` and ``top_logprobs``; ``token_ids`` and
``prompt_token_ids`` from ``return_token_ids``), serialized once, so the server costs almost
nothing per request. The client is bistat's ``OpenAIHTTPEngine`` at concurrency 64, with
``/metrics`` sampled every 0.25 s as ``vllm-server`` does.

For each top_logprobs value it prints:

* ``parse``: client CPU per answer outside HTTP (``json.loads`` + ``parse_completion_choice``), and
  with the runner's record path (``_response_record`` + JSON line + fsync to a temporary run);
* ``http``: requests/s and output tokens/s end to end through HTTP, bare (results kept in a list)
  and with the runner's record path as ``on_result``; the client's CPU seconds per request; and
  the ratio of requests/s to the GPU run's 30 requests/s (a ratio well above 1 means the client
  was not the limit there).

Absolute numbers depend on the machine: on a shared 2-core box the server process and the client
compete for the same cores, so the end-to-end rate is a lower bound of the client's ceiling; the
client CPU per request (``ms/request``) is the figure to compare across machines.

    python benchmarks/bench_http_logprobs.py [--requests 1000] [--concurrency 64]
        [--tokens 256] [--top 5 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bistat.engines.base import GenerationRequest, GenerationResult
from bistat.engines.openai_http import OpenAIHTTPEngine, parse_completion_choice
from bistat.engines.vllm_server import _free_port
from bistat.store.writer import RunWriter
from bistat.run.runner import _response_record
from bistat.core.schedule import PlannedPass
from bench_http_runner import wait_up  # noqa: E402 (a sibling script in benchmarks/)

#: requests/s of a counted pass of the H200 run h200-match-smollm2 (541 requests in ~18 s)
GPU_RUN_REQUESTS_PER_S = 30.0
MODEL = "smollm2"
PROMPT_IDS = list(range(1, 42))  # 41 prompt tokens, the run's typical chat prompt


def _token_bytes(rng: random.Random) -> list[int]:
    return [rng.randrange(97, 123) for _ in range(rng.randrange(2, 7))]


def vllm_chat_answer(n_tokens: int, top: int, seed: int = 0) -> dict:
    """A body shaped like vLLM 0.25.0's non-streaming ``/v1/chat/completions`` answer with
    ``logprobs=true``, ``top_logprobs=top``, ``return_token_ids`` and
    ``return_tokens_as_token_ids`` (full-precision float logprobs, as vLLM writes them)."""
    rng = random.Random(seed)
    ids = [rng.randrange(2, 49152) for _ in range(n_tokens)]
    content = []
    for tid in ids:
        chosen = -rng.random() * 3.0
        # top entries: token and bytes both from the "token_id:N" placeholder (vLLM 0.25.0
        # chat_completion/serving.py _get_top_logprobs); the chosen token's bytes are its text's
        alts = [{"token": f"token_id:{tid}", "logprob": chosen,
                 "bytes": list(f"token_id:{tid}".encode())}]
        lp = chosen
        for _ in range(top - 1):
            lp -= rng.random() * 2.0
            alt = rng.randrange(2, 49152)
            alts.append({"token": f"token_id:{alt}", "logprob": lp,
                         "bytes": list(f"token_id:{alt}".encode())})
        content.append({"token": f"token_id:{tid}", "logprob": chosen, "bytes": _token_bytes(rng),
                        "top_logprobs": alts})
    text = " ".join("w" * rng.randrange(2, 7) for _ in range(n_tokens))
    return {
        "id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion",
        "created": 1764419734, "model": MODEL,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "tool_calls": [], "reasoning": None, "reasoning_content": None},
                     "logprobs": {"content": content}, "finish_reason": "length",
                     "stop_reason": None, "token_ids": ids}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": len(PROMPT_IDS), "total_tokens": len(PROMPT_IDS) + n_tokens,
                  "completion_tokens": n_tokens, "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS, "kv_transfer_params": None,
    }


def instant_server(port: int, n_tokens: int, top: int) -> None:
    """Serve the canned answer (serialized once) until killed."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    # compact separators, as starlette's JSONResponse (which vLLM's FastAPI app uses) writes
    body = json.dumps(vllm_chat_answer(n_tokens, top), separators=(",", ":")).encode()
    metrics_text = "".join(
        f'vllm:{name}{{engine="0",model_name="{MODEL}"}} {value}\n'
        for name, value in [("num_requests_running", 0.0), ("num_requests_waiting", 0.0),
                            ("num_preemptions_total", 0.0), ("generation_tokens_total", 0.0),
                            ("prompt_tokens_total", 0.0)])

    async def chat(request):
        await request.body()
        return Response(body, media_type="application/json")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(request):
        return Response(metrics_text, media_type="text/plain")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models), Route("/metrics", metrics)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                http="h11", loop="asyncio", backlog=4096)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _recorder(run_dir: Path):
    """The runner's on_result path: ``_response_record`` -> one fsync'ed JSON line."""
    writer = RunWriter.create(run_dir, {"run_id": run_dir.name, "schema": "bistat.run/1"})
    planned = PlannedPass(seq=0, arm="bench", pass_index=0, kind="counted", block=0)
    results: list[GenerationResult] = []

    def on_result(result: GenerationResult) -> None:
        writer.append("responses", _response_record(planned, 0, result))
        results.append(result)

    return writer, results, on_result


def bench_parse(n_tokens: int, top: int, reps: int, tmp: Path) -> tuple[float, float, int]:
    """(ms per answer: json.loads + parse, ms per answer: + record path, body bytes)."""
    raw = json.dumps(vllm_chat_answer(n_tokens, top), separators=(",", ":")).encode()
    t0 = time.perf_counter()
    for _ in range(reps):
        parsed = parse_completion_choice(json.loads(raw), chat=True)
    t_parse = (time.perf_counter() - t0) / reps
    ids, text, lps, tops, finish, n_prompt = parsed
    assert len(ids) == n_tokens and all(len(p) == top for p in tops)
    result = GenerationResult(prompt_id="p", token_ids=ids, text=text, logprobs=lps,
                              top_logprobs=tops, finish_reason=finish, n_prompt_tokens=n_prompt,
                              t_submit=0.0, t_first_token=None, t_done=0.0, error=None, attempts=1)
    writer, _, on_result = _recorder(tmp / f"parse-top{top}")
    t0 = time.perf_counter()
    for _ in range(reps):
        on_result(result)
    t_record = (time.perf_counter() - t0) / reps
    writer.close()
    return 1000 * t_parse, 1000 * (t_parse + t_record), len(raw)


def bench_http(n_requests: int, concurrency: int, n_tokens: int, top: int,
               tmp: Path) -> list[tuple[str, float, float, int, int, float]]:
    """[(mode, wall s, client CPU s, requests, failed, median /metrics sample interval s)] for
    mode bare and record (sampling asks every 0.25 s after the previous answer, so an interval
    above 0.25 s is the /metrics round trip, here all client-side delay)."""
    port = _free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port),
                             "--tokens", str(n_tokens), "--top", str(top)])
    out = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        eng = OpenAIHTTPEngine(url, model=MODEL, metrics_interval_s=0.25)
        eng.start()
        reqs = [GenerationRequest(prompt_id=f"chat-{i:04d}", prompt="Tell me about seismic events.",
                                  max_tokens=n_tokens, chat=True, logprobs=top)
                for i in range(n_requests)]
        body = eng.request_body(reqs[0])
        assert body["top_logprobs"] == top and body["return_token_ids"] is True
        check: list[GenerationResult] = []  # validate (and warm up) before timing
        eng.run_pass(reqs[:concurrency], concurrency=concurrency, on_result=check.append,
                     on_metrics=lambda s: None)
        assert len(check) == concurrency and all(
            r.error is None and len(r.token_ids) == n_tokens and len(r.top_logprobs[0]) == top
            for r in check), [r.error for r in check if r.error][:3]
        for mode in ("bare", "record"):
            if mode == "bare":
                writer, results = None, []
                on_result = results.append
            else:
                writer, results, on_result = _recorder(tmp / f"http-top{top}")
            samples: list = []
            c0, t0 = _cpu(), time.perf_counter()
            eng.run_pass(reqs, concurrency=concurrency, on_result=on_result,
                         on_metrics=samples.append)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
            if writer is not None:
                writer.close()
            gaps = sorted(b.t - a.t for a, b in itertools.pairwise(samples))
            out.append((mode, wall, cpu, len(results), sum(r.error is not None for r in results),
                        gaps[len(gaps) // 2] if gaps else float("nan")))
    finally:
        proc.terminate()
        proc.wait()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, nargs="+", default=[5, 2])
    parser.add_argument("--parse-reps", type=int, default=200)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        instant_server(args.serve, args.tokens, args.top[0])
        return 0
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores (shared with other users: "
          f"load average {os.getloadavg()[0]:.1f}), python {platform.python_version()}, "
          f"httpx {httpx.__version__}")
    print(f"# {args.requests} chat requests x {args.tokens} tokens, concurrency "
          f"{args.concurrency}; server and client share this machine's cores")
    rc = 0
    with tempfile.TemporaryDirectory(prefix="bench-http-logprobs-") as tmpdir:
        tmp = Path(tmpdir)
        print("top_logprobs,body_kB,parse_ms,parse_record_ms,mode,wall_s,requests_per_s,"
              "tokens_per_s,client_cpu_ms_per_request,client_cpu_bound_requests_per_s,"
              "ratio_to_gpu_run,metrics_interval_s,failed")
        for top in args.top:
            parse_ms, record_ms, nbytes = bench_parse(args.tokens, top, args.parse_reps, tmp)
            for mode, wall, cpu, n, failed, m_int in bench_http(args.requests, args.concurrency,
                                                         args.tokens, top, tmp):
                rate = n / wall
                rc |= int(failed > 0 or n != args.requests)
                print(f"{top},{nbytes / 1000:.1f},{parse_ms:.2f},{record_ms:.2f},{mode},"
                      f"{wall:.2f},{rate:.1f},{rate * args.tokens:.0f},{1000 * cpu / n:.2f},"
                      f"{n / cpu:.1f},{rate / GPU_RUN_REQUESTS_PER_S:.2f},{m_int:.2f},{failed}",
                      flush=True)
    print(f"# ratio_to_gpu_run = requests/s here / {GPU_RUN_REQUESTS_PER_S:.0f} requests/s of "
          f"the H200 run's counted passes; client_cpu_bound = requests per client CPU second; "
          f"metrics_interval_s = median time between /metrics samples (asked 0.25 s apart)")
    print(f"# load average at end: {os.getloadavg()[0]:.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
