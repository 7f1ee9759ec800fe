"""Child process of ``VLLMOfflineEngine``: ``vllm.LLM`` driven by JSON lines on stdin/stdout.

Run as ``python -m bistat.engines.vllm_offline_worker`` in the arm's environment. vLLM is
imported here, in this child only. Protocol (one JSON object per line):

parent -> worker                                   worker -> parent
``{"op": "init", "model", "engine_args"}``         ``{"op": "ready", "version", "commit", "modes"}`` or
                                                   ``{"op": "error", "refused", "message"}``
``{"op": "pass", "requests", "concurrency",        ``{"op": "result", ...}`` per request,
"metrics_interval_s", "final_only"}``              ``{"op": "metrics", ...}`` about once per
                                                   interval (after every engine step when the
                                                   interval is 0), then ``{"op": "pass_done"}``
``{"op": "exit"}``                                 (the worker exits)

The protocol owns the real stdout: before vLLM is imported, file descriptor 1 is pointed at
stderr, so anything vLLM prints goes to the log, never into the protocol stream. vLLM 0.25.0 forks
its engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING`` and ``VLLM_WORKER_MULTIPROC_METHOD=fork``
are the defaults, vllm/envs.py:880-881, 1293-1294); a forked child would inherit the protocol pipe
and hold it open after this worker dies, so the parent would see no end of stream until its idle
timeout. Every forked child therefore points its copy of the protocol descriptor at /dev/null.

Engine metrics come from ``LLM.get_metrics()`` (vllm/entrypoints/llm.py:847-857), which needs stat
logging on: ``vllm.LLM`` turns it off unless ``disable_log_stats`` is given (llm.py:235-236) and
``LLMEngine.get_metrics`` then fails an assertion (vllm/v1/engine/llm_engine.py:378-380).
``VLLMOfflineEngine`` passes ``disable_log_stats=False`` unless the declaration says otherwise.

The gauges lag at the start of a pass. ``LLMEngine.step()`` records them only for an engine-core
output that carries request outputs (vllm/v1/engine/llm_engine.py:320-332), and after the last
request of a pass finishes the engine core sends one more output that carries only scheduler stats
(the step that clears the finished requests: vllm/v1/core/sched/scheduler.py:1839-1849,
vllm/v1/engine/core.py:479-490), which nobody reads until the next pass. The next pass's first
``step()`` returns that stale output, so the gauges still say 0 running and 0 waiting while every
request of the pass is in flight. A pass shorter than the sampling interval then had one sample, a
stale 0 (``bistat probe``: "running requests from 1 metrics sample(s) around the needle: max 0",
seen on the H200). The worker therefore drops an engine-stats sample that reports nothing running
or waiting while its own in-flight count is positive (the engine has not reported on this pass
yet) and samples again after the next step; and with ``metrics_interval_s = 0`` it samples after
every step (the probe's short passes; ``get_metrics`` every step is too costly for throughput
passes).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any, TextIO

REFUSAL_WORDS = ("not supported", "unsupported", "NotImplementedError", "not compatible")


def _protocol_stream() -> TextIO:
    proto_fd = os.dup(1)  # not inheritable across exec (PEP 446); forks are handled below
    os.dup2(2, 1)  # fd 1 (print, C libraries) now goes to the log
    sys.stdout = os.fdopen(1, "w", buffering=1)
    os.register_at_fork(after_in_child=lambda: _release_in_child(proto_fd))
    return os.fdopen(proto_fd, "w", buffering=1)


def _release_in_child(fd: int) -> None:
    """In a forked child (vLLM's engine core): drop this copy of the protocol pipe, so the parent
    sees end of stream as soon as the worker itself exits; the descriptor number stays valid."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _vllm_commit(vllm_module) -> str | None:
    """vLLM's git commit: ``vllm._version.__commit_id__`` (vcs-versioning builds, e.g.
    'gdd10e03f9' for 0.25.0), else the older ``vllm.__commit__``."""
    try:
        from vllm._version import __commit_id__
    except ImportError:
        return getattr(vllm_module, "__commit__", None)
    return __commit_id__


def _modes(llm: Any) -> dict[str, Any]:
    """The compilation and CUDA-graph modes vLLM configured, read from ``llm.llm_engine.
    vllm_config.compilation_config`` (``mode``; ``level`` in older releases) by feature; whether
    breakable CUDA graphs are on from ``compilation_config.use_breakable_cudagraph`` (vLLM 0.34),
    else from ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, which vLLM 0.33 sets in this process when
    batch-invariant mode turns them on. Empty when the engine exposes no configuration."""
    cc = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None),
                 "compilation_config", None)
    if cc is None:
        return {}
    mode = getattr(cc, "mode", None)
    if mode is None:
        mode = getattr(cc, "level", None)
    graphs = getattr(cc, "cudagraph_mode", None)
    breakable = getattr(cc, "use_breakable_cudagraph", None)  # vLLM 0.34 keeps the switch here
    if not isinstance(breakable, bool):  # 0.33 sets the variable in this process instead
        breakable = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "").strip().lower() in ("1", "true")
    return {"compilation_mode": None if mode is None else str(getattr(mode, "name", mode)),
            "cudagraph_mode": None if graphs is None else str(getattr(graphs, "name", graphs)),
            "breakable_cudagraph": breakable, "source": "engine config"}


def _send(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _sampling_params(vllm: Any, req: dict[str, Any], final_only: bool = True) -> Any:
    """``final_only``: ``RequestOutputKind.FINAL_ONLY`` (vllm/sampling_params.py; what
    ``LLM.generate`` asks for), so ``step()`` returns only finished requests instead of every
    running request's whole output so far (``CUMULATIVE``, the default)."""
    kw: dict[str, Any] = {}
    if final_only:
        kw["output_kind"] = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
    return vllm.SamplingParams(
        n=1, max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
        top_k=req["top_k"], seed=req["seed"], logprobs=max(1, req["logprobs"]),
        ignore_eos=req["ignore_eos"], **kw)


def _prompt(llm: Any, req: dict[str, Any]) -> Any:
    prompt = req["prompt"]
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    if req["chat"]:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return {"prompt": prompt}


def _result(out: Any, t0: float, t_submit: float, t_first: float | None) -> dict[str, Any]:
    comp = out.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    logprobs = top = None
    if comp.logprobs is not None:
        logprobs, top = [], []
        for tok, position in zip(ids, comp.logprobs):
            logprobs.append(float(position[tok].logprob))
            ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)
            top.append([[int(t), float(lp.logprob)] for t, lp in ranked])
    return {"op": "result", "prompt_id": out.request_id, "token_ids": ids, "text": comp.text,
            "logprobs": logprobs, "top_logprobs": top, "finish_reason": comp.finish_reason,
            "n_prompt_tokens": len(out.prompt_token_ids or []), "t_submit": t_submit,
            "t_first_token": t_first, "t_done": time.monotonic() - t0, "error": None}


def _metrics(llm: Any, t: float, in_flight: int, counters: dict[str, float]) -> dict[str, Any]:
    """The engine's own stats when ``LLM.get_metrics`` gives them, else the in-flight count.

    ``get_metrics`` returns vLLM's Prometheus registry as ``Gauge``/``Counter`` objects named
    without ``_total`` (vllm/v1/metrics/reader.py:86-115; names in vllm/v1/metrics/loggers.py:
    457-470, 625-672). Without engine stats the waiting count and the preemptions are unknown,
    so they are NaN (not 0: a preemption check must not pass for want of data).
    """
    sample = {"op": "metrics", "t": t, "num_requests_running": float(in_flight),
              "num_requests_waiting": math.nan, "num_preemptions_total": math.nan,
              "generation_tokens_total": counters["generation"],
              "prompt_tokens_total": counters["prompt"], "source": "inflight"}
    get = getattr(llm, "get_metrics", None)
    if get is None:
        return sample
    names = {"vllm:num_requests_running": "num_requests_running",
             "vllm:num_requests_waiting": "num_requests_waiting",
             "vllm:num_preemptions": "num_preemptions_total",
             "vllm:generation_tokens": "generation_tokens_total",
             "vllm:prompt_tokens": "prompt_tokens_total"}
    try:
        metrics = get()
    except (AttributeError, RuntimeError, AssertionError):
        return sample
    found = {}
    for m in metrics:
        key = names.get(getattr(m, "name", "").removesuffix("_total"))
        if key is not None and hasattr(m, "value"):
            found[key] = found.get(key, 0.0) + float(m.value)
    if "num_requests_running" in found:
        sample.update(found, source="engine-stats")
    return sample


def _stale(sample: dict[str, Any], in_flight: int) -> bool:
    """An engine-stats sample from before the engine reported on this pass: nothing running or
    waiting by vLLM's gauges while the worker has requests in flight (see the module docstring)."""
    return (sample["source"] == "engine-stats" and in_flight > 0
            and sample["num_requests_running"] == 0.0
            and not sample["num_requests_waiting"] > 0.0)


def _failed(prompt_id: str, t_submit: float, t0: float, error: str) -> dict[str, Any]:
    return {"op": "result", "prompt_id": prompt_id, "token_ids": [], "text": "",
            "logprobs": None, "top_logprobs": None, "finish_reason": None,
            "n_prompt_tokens": None, "t_submit": t_submit, "t_first_token": None,
            "t_done": time.monotonic() - t0, "error": error}


def run_pass(vllm: Any, llm: Any, msg: dict[str, Any], out: TextIO) -> None:
    """Keep at most ``concurrency`` requests in ``llm.llm_engine`` and step it until all finish.

    ``LLMEngine.add_request(request_id, prompt, params)`` (vllm/v1/engine/llm_engine.py:218-294)
    takes the token-id prompt as a ``{"prompt_token_ids": [...]}`` dict (a ``TokensPrompt``;
    vllm/renderers/inputs/preprocess.py:145-156) and stamps the arrival time itself
    (vllm/v1/engine/input_processor.py:288-289). ``step()`` blocks on the engine core's output
    queue (vllm/v1/engine/core_client.py:849-853): with nothing unfinished it would wait for
    ever, so it is called only while a request is in flight and the engine says it has
    unfinished work (``has_unfinished_requests``, llm_engine.py:191-195).
    """
    engine = llm.llm_engine
    pending = list(msg["requests"])[::-1]
    concurrency = int(msg["concurrency"])
    interval = max(0.0, float(msg.get("metrics_interval_s", 1.0)))  # 0: after every step
    final_only = bool(msg.get("final_only", True))
    t0 = time.monotonic()
    in_flight: dict[str, dict[str, Any]] = {}
    counters = {"generation": 0.0, "prompt": 0.0}
    next_sample = 0.0
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            req = pending.pop()
            t_submit = time.monotonic() - t0
            try:
                engine.add_request(req["prompt_id"], _prompt(llm, req),
                                   _sampling_params(vllm, req, final_only))
            except (ValueError, TypeError) as exc:  # vLLM rejects this one request
                _send(out, _failed(req["prompt_id"], t_submit, t0, f"{type(exc).__name__}: {exc}"))
                continue
            in_flight[req["prompt_id"]] = {"t_submit": t_submit, "t_first": None}
        if not in_flight:
            continue
        if not engine.has_unfinished_requests():  # never answered: fail them, do not block
            for prompt_id, state in in_flight.items():
                _send(out, _failed(prompt_id, state["t_submit"], t0,
                                   "vLLM dropped the request without a final output"))
            in_flight.clear()
            continue
        # FINAL_ONLY: a step returns the requests that finished in it. CUMULATIVE (streaming,
        # SamplingParams' default, vllm/sampling_params.py:301): every running request's whole
        # output so far, read for the first token's time; only finished outputs are recorded.
        for o in engine.step():
            state = in_flight.get(o.request_id)
            if state is None:
                continue
            if (not final_only and state["t_first"] is None and o.outputs
                    and len(o.outputs[0].token_ids) > 0):
                state["t_first"] = time.monotonic() - t0
            if o.finished:
                del in_flight[o.request_id]
                rec = _result(o, t0, state["t_submit"], state["t_first"])
                counters["generation"] += len(rec["token_ids"])
                counters["prompt"] += rec["n_prompt_tokens"]
                _send(out, rec)
        now = time.monotonic() - t0
        if now >= next_sample:  # after the step: the engine's gauges describe this step
            sample = _metrics(llm, now, len(in_flight), counters)
            if not _stale(sample, len(in_flight)):  # a stale one: sample after the next step
                _send(out, sample)
                next_sample = now + interval
    _send(out, _metrics(llm, time.monotonic() - t0, 0, counters))
    _send(out, {"op": "pass_done"})


def main() -> int:
    out = _protocol_stream()
    llm = vllm = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "init":
            try:
                import vllm  # noqa: F811 — only ever imported in this child

                llm = vllm.LLM(model=msg["model"], **msg["engine_args"])
            except Exception as exc:  # reported to the parent, which classifies it
                text = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                _send(out, {"op": "error", "message": text,
                            "refused": any(w.lower() in text.lower() for w in REFUSAL_WORDS)})
                return 1
            _send(out, {"op": "ready", "version": str(vllm.__version__),
                        "commit": _vllm_commit(vllm), "modes": _modes(llm)})
        elif op == "pass":
            run_pass(vllm, llm, msg, out)
        elif op == "exit":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
