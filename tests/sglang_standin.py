"""A stand-in for SGLang's server, NOT SGLang: a process that speaks the part of SGLang 0.5.23's HTTP
protocol the ``sglang-server`` adapter uses, so the adapter is tested end to end without a GPU.

Run as ``python tests/sglang_standin.py --model-path FOLDER --host H --port P [flags]`` (the
command line ``python -m sglang.launch_server`` gets). The generations are real: bistat's embedded
numpy engine on the model folder (``bistat.engines.embedded``, as ``bistat serve`` does), with
``--enable-deterministic-inference`` mapped to its batch-invariant GEMM (``gemm="invariant"``), so
the deterministic mode here is really invariant and the default one really is not (numpy's BLAS).

Routes, with SGLang's shapes (sglang/srt/entrypoints/http_server.py; sglang/api/v1/api_types.py):
``GET /health``, ``GET /health_generate``, ``GET /model_info`` and ``/get_model_info``,
``GET /server_info`` and ``/get_server_info`` (the resolved arguments: ``attention_backend``,
``enable_deterministic_inference``, ``sampling_backend``, ``disable_radix_cache``, ``version``),
``POST /generate`` (``text`` or ``input_ids``, ``sampling_params``, ``return_logprob``,
``top_logprobs_num``: ``output_ids`` and ``meta_info.output_token_logprobs`` as
``[logprob, token_id, null]`` triples), ``POST /tokenize`` (``messages`` through the model's chat
template), ``POST /flush_cache``, ``GET /v1/models`` and ``GET /metrics`` (SGLang's metric names).

Faults, by environment variable: ``STANDIN_DIE_AFTER=N`` logs an error and exits 1 after N answered
``/generate`` requests (with ``STANDIN_DIE_FLAG=PATH`` only while that file exists, which it
removes as it dies: a resumed run then completes); ``STANDIN_NEVER_READY=1`` keeps ``/health_generate`` at 503 (as SGLang while
starting); ``STANDIN_MALFORMED=1`` answers ``/generate`` with a body that is not JSON;
``STANDIN_REFUSE=1`` prints SGLang's refusal of a backend for deterministic inference and exits 1;
``STANDIN_PIDFILE=PATH`` writes its pid. ``STANDIN_STEP_S=S`` makes every engine step last S seconds
longer, so that the metrics see requests running together.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

#: The attention backends SGLang 0.5.23's deterministic mode accepts
#: (sglang/srt/arg_groups/choices.py, DETERMINISTIC_ATTENTION_BACKEND_CHOICES).
DETERMINISTIC_BACKENDS = ["ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton"]
VERSION = "0.5.23"


def create_app(model_path: str, args: argparse.Namespace) -> Any:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from bistat.engines.base import GenerationRequest
    from bistat.engines.embedded.engine import EmbeddedEngine
    from bistat.model import load_model

    model = load_model(model_path)
    tok = model.tokenizer
    deterministic = bool(args.enable_deterministic_inference)
    step_s = float(os.environ.get("STANDIN_STEP_S", "0"))

    class Engine(EmbeddedEngine):
        def _step(self) -> bool:  # a GPU's pace: running requests show in the metrics
            if step_s:
                time.sleep(step_s)
            return super()._step()

    engine = Engine(model, gemm="invariant" if deterministic else "blas",
                            max_batch_size=args.max_running_requests or 8, max_model_len=512)
    served = args.served_model_name or model_path
    state = {"answered": 0, "retracted": 0}
    die_after = int(os.environ.get("STANDIN_DIE_AFTER", "0"))
    labels = {"model_name": served, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
              "moe_ep_rank": "0"}

    class Collector:
        def collect(self):
            m = engine.metrics()
            for name, value, kind in (
                    ("sglang:num_running_reqs", m["num_requests_running"], "gauge"),
                    ("sglang:num_queue_reqs", m["num_requests_waiting"], "gauge"),
                    ("sglang:num_retracted_requests", float(state["retracted"]), "counter"),
                    ("sglang:prompt_tokens", m["prompt_tokens_total"], "counter"),
                    ("sglang:generation_tokens", m["generation_tokens_total"], "counter")):
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                    name, "stand-in", labels=list(labels))
                family.add_metric(list(labels.values()), value)
                yield family

    registry = CollectorRegistry()
    registry.register(Collector())

    async def ok(request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(request: Request) -> Response:
        return Response(status_code=503 if os.environ.get("STANDIN_NEVER_READY") else 200)

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": model_path, "served_model_name": served,
                             "tokenizer_path": model_path, "is_generation": True})

    async def server_info(request: Request) -> Response:
        backend = args.attention_backend or "fa3"
        return JSONResponse({
            "version": VERSION, "model_path": model_path, "attention_backend": backend,
            "decode_attention_backend": None, "prefill_attention_backend": None,
            "enable_deterministic_inference": deterministic,
            "sampling_backend": "pytorch" if deterministic else "flashinfer",
            "disable_radix_cache": bool(args.disable_radix_cache), "tp_size": 1,
            "dtype": "auto", "random_seed": 0, "enable_metrics": bool(args.enable_metrics)})

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        if body.get("messages") is not None:
            ids = tok.encode(tok.apply_chat_template(body["messages"]))
        else:
            ids = tok.encode(body["prompt"])
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 512})

    async def generate(request: Request) -> Response:
        body = await request.json()
        if os.environ.get("STANDIN_MALFORMED"):
            return Response(b'{"text": "x", "output_ids": [1, 2', media_type="application/json")
        sp = body.get("sampling_params") or {}
        prompt = body["input_ids"] if body.get("input_ids") is not None else body["text"]
        req = GenerationRequest(prompt_id="x", prompt=prompt, max_tokens=int(sp["max_new_tokens"]),
                                temperature=float(sp["temperature"]), top_p=float(sp["top_p"]),
                                top_k=int(sp["top_k"]), seed=sp.get("sampling_seed"),
                                logprobs=int(body.get("top_logprobs_num") or 1),
                                ignore_eos=bool(sp.get("ignore_eos")))
        result = await asyncio.wrap_future(engine.submit(req))
        if result.error is not None:
            return JSONResponse({"error": {"message": result.error}}, status_code=400)
        state["answered"] += 1
        flag = os.environ.get("STANDIN_DIE_FLAG")
        if die_after and state["answered"] >= die_after and (flag is None or os.path.exists(flag)):
            if flag is not None:
                os.remove(flag)
            print("[stand-in] ERROR RuntimeError: scheduler died (STANDIN_DIE_AFTER)", flush=True)
            os._exit(1)
        eos = tok.eos_token_id
        stopped = result.finish_reason == "stop"
        finish = {"type": "stop", "matched": eos} if stopped else {
            "type": "length", "length": len(result.token_ids)}
        entries = [[lp, t, None] for lp, t in zip(result.logprobs or [], result.token_ids)]
        top = [[[lp, t, None] for t, lp in row] for row in result.top_logprobs or []]
        meta = {"id": "standin", "finish_reason": finish, "prompt_tokens": result.n_prompt_tokens,
                "completion_tokens": len(result.token_ids), "cached_tokens": 0,
                "output_token_logprobs": entries, "input_token_logprobs": [],
                "output_top_logprobs": top}
        return JSONResponse({"text": result.text, "output_ids": list(result.token_ids),
                             "meta_info": meta})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": served, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        if not args.enable_metrics:
            return Response(status_code=404)
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def lifespan(app: Starlette):
        engine.start()
        yield
        engine.stop()

    return Starlette(lifespan=lifespan, routes=[
        Route("/health", ok), Route("/health_generate", health_generate),
        Route("/model_info", model_info), Route("/get_model_info", model_info),
        Route("/server_info", server_info), Route("/get_server_info", server_info),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/flush_cache", ok, methods=["GET", "POST"]),
        Route("/v1/models", models), Route("/metrics", metrics)])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-standin")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--attention-backend")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--max-running-requests", type=int)
    args, rest = parser.parse_known_args(argv)
    print(f"[stand-in] not SGLang; args: {argv}", flush=True)
    if os.environ.get("STANDIN_PIDFILE"):
        with open(os.environ["STANDIN_PIDFILE"], "w") as fh:
            fh.write(str(os.getpid()))
    backend = args.attention_backend
    if os.environ.get("STANDIN_REFUSE") or (args.enable_deterministic_inference and backend
                                            and backend not in DETERMINISTIC_BACKENDS):
        print(f"ValueError: Currently only {DETERMINISTIC_BACKENDS} attention backends are "
              f"supported for deterministic inference, but you explicitly specified "
              f"'{backend}'.", flush=True)
        return 1
    if args.enable_deterministic_inference:
        print(f"[stand-in] deterministic inference on, attention backend {backend or 'fa3'}",
              flush=True)
    from bistat.engines.serve.server import serve

    serve(create_app(args.model_path, args), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
