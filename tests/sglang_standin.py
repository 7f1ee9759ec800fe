"""A stand-in for SGLang's server, NOT SGLang: a process tree that behaves as SGLang 0.5.23's
``python -m sglang.launch_server`` does where the ``sglang-server`` adapter meets it, so the
adapter is tested end to end without a GPU. Nothing here is SGLang's code; the citations name the
SGLang 0.5.23 source each behaviour copies.

Run as ``python tests/sglang_standin.py --model-path FOLDER --host H --port P [flags]`` (the
command line ``python -m sglang.launch_server`` gets). The generations are real: bistat's embedded
numpy engine on the model folder, with ``--enable-deterministic-inference`` mapped to its
batch-invariant GEMM (``gemm="invariant"``), so the deterministic mode here is really invariant
and the default one really is not (numpy's BLAS).

Processes (sglang/srt/entrypoints/engine.py): the main process serves HTTP and tokenizes; it
spawns a *scheduler* (the engine) and a *detokenizer* (output text), in its process group, each
killed when the main process dies (``PR_SET_PDEATHSIG``). Requests go main -> scheduler ->
detokenizer -> main. SIGTERM to the group kills the scheduler and the detokenizer at once (their
default action); the main process only marks itself exiting (``/health`` answers 503), and its
subprocess watchdog, finding a child dead within a second, SIGQUITs the main process, which kills
the tree, itself by SIGKILL. A scheduler that fails logs "Scheduler hit an exception:" with its
traceback and SIGQUITs the main process the same way.

Start-up: the server's arguments are resolved as SGLang resolves them, with its log lines
(sglang/srt/arg_groups/overrides.py, attention_hook.py; the log format is ``[%(asctime)s]
%(message)s``, no level): a deterministic arm without a backend falls back to fa3; a backend the
deterministic mode does not support is a ``ValueError``; a deterministic backend without radix
cache support (flashinfer) logs "Currently radix cache is not compatible with flashinfer attention
backend for deterministic inference. It will be supported in the future." and disables the radix
cache. A flag SGLang 0.5.23 does not know is refused by argparse (exit 2). Once the scheduler has
loaded the model, HTTP is served; ``/health`` and ``/health_generate`` answer 503 until the
warm-up is done: ``STANDIN_WARMUP_S`` seconds (CUDA graphs, JIT), then the warm-up request SGLang
sends itself (``POST /generate``, "The capital city of France is", 8 tokens at temperature 0:
http_server.py ``_execute_server_warmup``; its tokens are counted in the token counters).

Routes (sglang/srt/entrypoints/http_server.py):

- ``GET /health_generate`` and ``GET /health`` (which generates too unless
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false): 503 while starting or exiting; else a
  one-token generation (``input_ids=[0]``, not counted in the token counters) is sent to the
  scheduler and the answer, checked once a second, is 200 as soon as any output has come back
  since the probe began, 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20);
- ``POST /generate``: the body is checked against the schema first (sglang/api/v1/api_types.py
  via entrypoints/api_contract.py): ``sampling_params`` refuses a key it does not define (400,
  ``{"error": "unknown field `x`, expected one of `max_new_tokens`, ..."}``) and a value of the
  wrong JSON type: an integer field (``max_new_tokens``, ``top_k``, ``min_new_tokens``, ``n``,
  ``stream_interval``, ``sampling_seed``, ``beam_width``) given ``1.0`` or ``true`` is "invalid
  type: floating point `1.0`, expected i64"; then ``text`` or ``input_ids`` is generated
  (``sampling_seed`` is read only under ``--enable-deterministic-inference``), answered with
  ``output_ids`` and ``meta_info``: ``output_token_logprobs`` as ``[logprob, token_id, null]``,
  ``output_top_logprobs`` rows (a position whose row is empty is ``null``, as
  tokenizer_manager.py ``detokenize_top_logprobs_tokens`` makes it), ``num_retractions``;
- ``GET /server_info`` (and ``/get_server_info``): the resolved arguments, flat, with
  ``version``; ``GET /model_info`` (and ``/get_model_info``); ``GET /v1/models``;
  ``POST /tokenize`` (``messages`` through the chat template);
- ``POST /flush_cache``: 400 ("Flush cache failed.") while requests run or wait, else 200;
- ``GET /metrics`` (``--enable-metrics``): prometheus_client's multiprocess registry, as SGLang
  keeps it (a fresh ``PROMETHEUS_MULTIPROC_DIR``). The scheduler's gauges
  ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` are refreshed at every prefill
  step, every ``--decode-log-interval`` decode steps (40) and when the scheduler falls idle
  (scheduler_components/metrics_reporter.py), not at each scrape; the token counters
  ``sglang:prompt_tokens_total`` and ``sglang:generation_tokens_total`` grow when a request
  finishes; ``sglang:num_retracted_requests_total`` is a labelled counter, absent (its whole
  family) until the first retraction.

Faults and probes, by environment variable: ``STANDIN_DIE_AFTER=N``: the scheduler fails after N
client requests finish (the N-th is not answered; with ``STANDIN_DIE_FLAG=PATH`` only while that
file exists, which it removes: a resumed run then completes); ``STANDIN_START_CRASH=1``: the
scheduler fails building the model (``ModuleNotFoundError: No module named 'cutlass.cute'``, as
SGLang 0.5.23 did without nvidia-cutlass-dsl-libs-core); ``STANDIN_NEVER_READY=1``: the warm-up
never ends (503 for ever); ``STANDIN_WARMUP_S=S``: the warm-up waits S seconds first;
``STANDIN_MALFORMED=1``: ``/generate`` answers a body that is not JSON; ``STANDIN_REFUSE=1``:
SGLang's refusal of the attention backend for deterministic inference, exit 1;
``STANDIN_RETRACT_EVERY=N``: every N-th decode step with two requests or more decoding, the
newest is retracted (back to the waiting queue for one step: counted as SGLang counts it);
``STANDIN_NULL_TOP_EVERY=N``: every N-th output position's top-logprob row is empty (``null``);
``STANDIN_HEALTH_SLOW_S=S``: once a client request has finished, the scheduler holds each
health-check request S seconds;
``STANDIN_STEP_S=S``: every engine step lasts S seconds longer; ``STANDIN_PIDFILE=PATH``: the
main process's pid; ``STANDIN_TIMES=PATH``: a JSON line ``{"pid", "start", "ready"}`` (epoch
seconds: process start, warm-up done) appended once the server is ready.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any

#: The attention backends SGLang 0.5.23's deterministic mode accepts
#: (sglang/srt/arg_groups/choices.py, DETERMINISTIC_ATTENTION_BACKEND_CHOICES), and those of them
#: that keep the radix cache (RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND).
DETERMINISTIC_BACKENDS = ["ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton"]
RADIX_DETERMINISTIC_BACKENDS = ["ascend", "fa3", "fa4", "triton"]
VERSION = "0.5.23"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
WARMUP_TEXT = "The capital city of France is"

#: ``SamplingParams``'s fields in schema order (sglang/api/v1/api_types.py), by JSON type.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
INT_FIELDS = frozenset({"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval",
                        "sampling_seed", "beam_width"})
FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "frequency_penalty",
                          "presence_penalty", "repetition_penalty"})
BOOL_FIELDS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                         "no_stop_trim"})
STRING_FIELDS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})


def log(message: str) -> None:
    """One log line in SGLang's format (``[%(asctime)s] %(message)s``: no level)."""
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), as SGLang's
    children ask (sglang/srt/utils/common.py, ``kill_itself_when_parent_died``)."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            parents.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


# -- the /generate body's schema --------------------------------------------------------------


class ContractError(ValueError):
    """The body breaks the ``/generate`` schema: SGLang answers 400 with this text."""


def _shown(v: Any) -> str:
    """A JSON value as serde's ``Unexpected`` names it in its messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _need(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_shown(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _strings(v: Any, alone: str) -> None:
    """A string, or a list of strings (``alone`` names what a lone value should have been)."""
    if isinstance(v, list):
        for e in v:
            _need(isinstance(e, str), e, "a string")
    else:
        _need(isinstance(v, str), v, alone)


def check_sampling_params(sp: Any) -> None:
    """Raise :class:`ContractError` where ``sp`` breaks ``SamplingParams``'s schema."""
    _need(isinstance(sp, dict), sp, "struct SamplingParams")
    for key, v in sp.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if v is None or key == "custom_params":
            continue
        if key in INT_FIELDS:
            _need(_is_int(v), v, "i64")
        elif key in FLOAT_FIELDS:
            _need(_is_number(v), v, "f64")
        elif key in BOOL_FIELDS:
            _need(isinstance(v, bool), v, "a boolean")
        elif key in STRING_FIELDS:
            _need(isinstance(v, str), v, "a string")
        elif key in ("stop", "stop_regex"):
            _strings(v, "a value or an array of values for StringOrList")
        elif key in ("stop_token_ids", "choice"):
            _need(isinstance(v, list), v, "a sequence")
            for e in v:
                _need(_is_int(e) if key == "stop_token_ids" else isinstance(e, str), e,
                      "i64" if key == "stop_token_ids" else "a string")
        elif key == "logit_bias":
            _need(isinstance(v, dict), v, "a map")
            for e in v.values():
                _need(_is_number(e), e, "f64")
        elif key == "watermark":
            _need(isinstance(v, dict), v, "struct WatermarkRequestConfig")


def contract_error(body: Any) -> str | None:
    """The schema violation of a ``/generate`` body, or None. The fields the stand-in reads are
    checked (a key ``GenerateRequest`` does not define is ignored there, as SGLang ignores it)."""
    try:
        _need(isinstance(body, dict), body, "struct GenerateRequest")
        for key, v in body.items():
            if v is None:
                continue
            if key in ("text", "rid"):
                _strings(v, "a value or an array of values for StringOrList")
            elif key == "input_ids":
                _need(isinstance(v, list), v,
                      "a value or an array of values for TokenIdsOrList")
                for e in v:
                    if isinstance(e, list):
                        for t in e:
                            _need(_is_int(t), t, "i64")
                    else:
                        _need(_is_int(e), e, "i64")
            elif key == "stream":
                _need(isinstance(v, bool), v, "a boolean")
            elif key == "return_logprob":
                _need(isinstance(v, bool) or isinstance(v, list), v,
                      "a value or an array of values for BoolOrList")
            elif key in ("top_logprobs_num", "logprob_start_len"):
                _need(_is_int(v) or isinstance(v, list), v,
                      "a value or an array of values for Int64OrList")
            elif key == "sampling_params":
                for sp in (v if isinstance(v, list) else [v]):
                    check_sampling_params(sp)
    except ContractError as exc:
        return str(exc)
    return None


# -- the scheduler process --------------------------------------------------------------------


def _metric_labels(served: str) -> dict[str, str]:
    return {"model_name": served, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
            "moe_ep_rank": "0"}


class Scheduler:
    """The engine, its gauges and its retraction counter, in the scheduler process."""

    def __init__(self, cfg: dict[str, Any], to_detokenizer: Any) -> None:
        from prometheus_client import Counter, Gauge

        from bistat.engines.embedded.engine import EmbeddedEngine
        from bistat.model import load_model

        self.cfg = cfg
        self.to_detokenizer = to_detokenizer
        self.send_lock = threading.Lock()
        self.labels = _metric_labels(cfg["served"])
        names = list(self.labels)
        self.running_gauge = Gauge("sglang:num_running_reqs", "The number of running requests.",
                                   names, multiprocess_mode="mostrecent")
        self.queue_gauge = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting "
                                 "queue.", names, multiprocess_mode="mostrecent")
        self.retracted_gauge = Gauge("sglang:num_retracted_reqs", "The number of retracted "
                                     "requests.", names)
        self.retracted_total = Counter("sglang:num_retracted_requests_total",
                                       "Total number of retracted requests.", names)
        self.decode_steps = 0
        self.retracted_since_report = 0
        self.reported_running: int | None = None
        self.retractions: dict[str, int] = {}
        self.held_out: list[Any] = []
        self.answered = 0
        self.fatal: BaseException | None = None
        step_s = float(os.environ.get("STANDIN_STEP_S", "0"))
        retract_every = int(os.environ.get("STANDIN_RETRACT_EVERY", "0"))
        scheduler = self

        class Engine(EmbeddedEngine):
            def _step(self) -> bool:
                if step_s:
                    time.sleep(step_s)  # a GPU's pace: running requests show in the metrics
                with self._cv:
                    while self._incoming:
                        self.scheduler.add(self._incoming.popleft())
                decoding = [s for s in self.scheduler.running if not s.in_prefill]
                if (retract_every and len(decoding) >= 2
                        and (scheduler.decode_steps + 1) % retract_every == 0):
                    scheduler.retract(self, decoding[-1])
                progressed = super()._step()
                self.scheduler.waiting.extendleft(reversed(scheduler.held_out))
                scheduler.held_out.clear()
                if progressed:
                    scheduler.after_step(self)
                return progressed

        model = load_model(cfg["model_path"])
        self.engine = Engine(model, gemm="invariant" if cfg["deterministic"] else "blas",
                             max_batch_size=cfg["max_running_requests"],
                             max_model_len=cfg["context_length"])
        self.eos = self.engine.eos_token_ids

    def retract(self, engine: Any, seq: Any) -> None:
        """Send a decoding request back to the waiting queue for one step (SGLang retracts when
        the KV cache runs short: scheduler.py, ``retract_decode``), counted as SGLang counts it."""
        engine.scheduler.running.remove(seq)
        self.held_out.append(seq)
        rid = seq.request.prompt_id
        self.retractions[rid] = self.retractions.get(rid, 0) + 1
        self.retracted_since_report += 1
        self.retracted_total.labels(**self.labels).inc(1)

    def after_step(self, engine: Any) -> None:
        """Refresh the gauges where SGLang does: a prefill step, every ``decode_log_interval``-th
        decode step, and an idle scheduler whose running gauge is stale."""
        plan = engine.scheduler.last_plan
        prefill = any(p.start < len(p.seq.prompt_ids) for p in plan)
        if not prefill and plan:
            self.decode_steps += 1
        idle = not engine.scheduler.running and not engine.scheduler.waiting
        if (prefill or (plan and self.decode_steps % self.cfg["decode_log_interval"] == 0)
                or (idle and self.reported_running != 0)):
            running = len(engine.scheduler.running)
            self.running_gauge.labels(**self.labels).set(running)
            self.queue_gauge.labels(**self.labels).set(len(engine.scheduler.waiting)
                                                       + len(engine._incoming))
            self.retracted_gauge.labels(**self.labels).set(self.retracted_since_report)
            self.retracted_since_report = 0
            self.reported_running = running

    def idle(self) -> bool:
        engine = self.engine
        return not (engine.scheduler.running or engine.scheduler.waiting or engine._incoming
                    or self.held_out)

    def submit(self, msg: dict[str, Any]) -> None:
        from bistat.engines.base import GenerationRequest

        req = GenerationRequest(
            prompt_id=msg["rid"], prompt=msg["input_ids"], max_tokens=msg["max_new_tokens"],
            temperature=msg["temperature"], top_p=msg["top_p"],
            top_k=msg["top_k"] if msg["top_k"] < 1 << 30 else -1,
            seed=msg["sampling_seed"] if self.cfg["deterministic"] else None,
            logprobs=max(1, msg["top_logprobs_num"]), ignore_eos=msg["ignore_eos"])
        fut = self.engine.submit(req)
        fut.add_done_callback(lambda f: self.finished(msg, f.result()))

    def finished(self, msg: dict[str, Any], result: Any) -> None:
        """Hand a finished request to the detokenizer (or fail, for ``STANDIN_DIE_AFTER``)."""
        if self.fatal is not None:
            return
        if msg["counted"]:
            self.answered += 1
            die_after = int(os.environ.get("STANDIN_DIE_AFTER", "0"))
            flag = os.environ.get("STANDIN_DIE_FLAG")
            if die_after and self.answered >= die_after and (flag is None or os.path.exists(flag)):
                if flag is not None:
                    os.remove(flag)
                self.fatal = RuntimeError("scheduler died (STANDIN_DIE_AFTER)")
                return
        every = int(os.environ.get("STANDIN_NULL_TOP_EVERY", "0"))
        top = [[] if every and (i + 1) % every == 0 else list(row)
               for i, row in enumerate(result.top_logprobs or [])]
        out = {"rid": msg["rid"], "error": result.error, "output_ids": list(result.token_ids),
               "logprobs": list(result.logprobs or []), "top": top,
               "finish_reason": result.finish_reason, "prompt_tokens": result.n_prompt_tokens,
               "num_retractions": self.retractions.pop(msg["rid"], 0),
               "matched": result.token_ids[-1] if result.finish_reason == "stop" else None}
        with self.send_lock:
            self.to_detokenizer.send(out)

    def hold_health_check(self, msg: dict[str, Any]) -> None:
        time.sleep(float(os.environ.get("STANDIN_HEALTH_SLOW_S", "0")))
        self.submit(msg)

    def event_loop(self, requests: Any, to_main: Any) -> None:
        self.engine.start()
        while True:
            if self.fatal is not None:
                raise self.fatal
            if not requests.poll(0.05):
                continue
            msg = requests.recv()
            if msg["kind"] == "flush":
                if self.idle():
                    log("Cache flushed successfully!")
                    to_main.send({"kind": "flush", "success": True})
                else:
                    log(f"Cache not flushed because there are pending requests. #queue-req: "
                        f"{len(self.engine.scheduler.waiting) + len(self.engine._incoming)}, "
                        f"#running-req: {len(self.engine.scheduler.running)}")
                    to_main.send({"kind": "flush", "success": False})
            elif (msg["rid"].startswith(HEALTH_CHECK_RID_PREFIX) and self.answered
                  and os.environ.get("STANDIN_HEALTH_SLOW_S")):
                threading.Thread(target=self.hold_health_check, args=(msg,), daemon=True).start()
            else:
                self.submit(msg)


def run_scheduler(cfg: dict[str, Any], requests: Any, to_detokenizer: Any, to_main: Any) -> None:
    """The scheduler process (sglang/srt/managers/scheduler.py, ``run_scheduler_process``)."""
    die_with_parent()
    try:
        if os.environ.get("STANDIN_START_CRASH"):
            raise ModuleNotFoundError("No module named 'cutlass.cute'", name="cutlass.cute")
        scheduler = Scheduler(cfg, to_detokenizer)
        to_main.send({"kind": "init", "status": "ready"})
        scheduler.event_loop(requests, to_main)
    except Exception:
        log(f"Scheduler hit an exception: {traceback.format_exc()}")
        os.kill(os.getppid(), signal.SIGQUIT)


def run_detokenizer(model_path: str, from_scheduler: Any, to_main: Any) -> None:
    """The detokenizer process: output ids to text, the stop token trimmed from the text only."""
    die_with_parent()
    from bistat.model import load_tokenizer

    tok = load_tokenizer(model_path)
    while True:
        try:
            out = from_scheduler.recv()
        except EOFError:  # the scheduler is gone: wait to be killed with the tree
            signal.pause()
            continue
        ids = out["output_ids"]
        out["text"] = "" if out["error"] else tok.decode(ids[:-1] if out["matched"] is not None
                                                         else ids)
        to_main.send(out)


# -- the main process -------------------------------------------------------------------------


class Main:
    """The main process's state: the children, the pipes, the requests in flight."""

    def __init__(self, args: argparse.Namespace, resolved: dict[str, Any], served: str) -> None:
        from bistat.model import load_tokenizer

        self.args = args
        self.resolved = resolved
        self.served = served
        self.tok = load_tokenizer(args.model_path)
        self.status = "Starting"
        self.exiting = False
        self.last_receive = 0.0
        self.pending: dict[str, tuple[Any, Any]] = {}   # rid -> (event loop, future)
        self.send_lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.children: list[Any] = []
        self.prometheus_dir = ""

    # the process tree
    def spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # SGLang's start method
        requests_r, self.requests = ctx.Pipe(duplex=False)
        detok_r, detok_w = ctx.Pipe(duplex=False)
        self.results, results_w = ctx.Pipe(duplex=False)
        self.control, control_w = ctx.Pipe(duplex=False)
        cfg = {"model_path": self.args.model_path, "served": self.served,
               "deterministic": self.resolved["enable_deterministic_inference"],
               "max_running_requests": self.resolved["max_running_requests"],
               "context_length": self.args.context_length or 512,
               "decode_log_interval": self.args.decode_log_interval}
        self.children = [
            ctx.Process(target=run_scheduler, name="scheduler",
                        args=(cfg, requests_r, detok_w, control_w)),
            ctx.Process(target=run_detokenizer, name="detokenizer",
                        args=(self.args.model_path, detok_r, results_w))]
        for proc in self.children:
            proc.start()
        for end in (requests_r, detok_r, detok_w, results_w, control_w):
            end.close()

    def wait_for_scheduler(self) -> None:
        """Until the scheduler has loaded the model (engine.py, ``_wait_for_scheduler_ready``)."""
        while not self.control.poll(5.0):
            if not self.children[0].is_alive():
                raise RuntimeError("Rank 0 scheduler is dead. Please check if there are relevant "
                                   "logs.")
        self.control.recv()

    def kill_tree(self) -> None:
        """Every descendant, then this process, by SIGKILL (utils/common.py,
        ``kill_process_tree``)."""
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.prometheus_dir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_sigquit_starting(self, signum: int, frame: Any) -> None:
        log("Received sigquit from a child process. It usually means the child failed.")
        self.kill_tree()

    def on_sigquit(self, signum: int, frame: Any) -> None:
        log(f"SIGQUIT received. {signum=}. It usually means one child failed.")
        self.kill_tree()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        log(f"SIGTERM received. {signum=}. Draining requests and shutting down...")
        self.exiting = True

    def watchdog(self) -> None:
        """A child that ended with a non-zero code: SIGQUIT to this process (utils/watchdog.py)."""
        while True:
            time.sleep(1.0)
            for proc in self.children:
                if proc.exitcode not in (None, 0):
                    log(f"Subprocess {proc.name} (pid={proc.pid}) crashed with exit code "
                        f"{proc.exitcode}. Triggering SIGQUIT for cleanup...")
                    os.kill(os.getpid(), signal.SIGQUIT)
                    return

    def drain_on_sigterm(self) -> None:
        """After SIGTERM, once no request is in flight, stop the children and exit
        (tokenizer_manager.py, ``sigterm_watchdog``, which looks every 5 s)."""
        while not self.exiting:
            time.sleep(5.0)
        while self.pending:
            log(f"Gracefully exiting... Remaining number of requests {len(self.pending)}.")
            time.sleep(5.0)
        for proc in self.children:
            proc.terminate()
            proc.join()
        shutil.rmtree(self.prometheus_dir, ignore_errors=True)
        os._exit(0)

    # the pipes
    def read_results(self) -> None:
        while True:
            try:
                out = self.results.recv()
            except EOFError:
                return
            self.last_receive = time.time()
            loop, fut = self.pending.pop(out["rid"], (None, None))
            if loop is not None:
                loop.call_soon_threadsafe(lambda f=fut, o=out: f.done() or f.set_result(o))

    async def run(self, rid: str, input_ids: list[int], sp: dict[str, Any], top_n: int,
                  log_metrics: bool) -> dict[str, Any]:
        import asyncio

        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending[rid] = (loop, fut)
        def given(key: str, default: Any) -> Any:  # SamplingParams's defaults
            return default if sp.get(key) is None else sp[key]

        msg = {"kind": "generate", "rid": rid, "input_ids": input_ids,
               "max_new_tokens": given("max_new_tokens", 128),
               "temperature": float(given("temperature", 1.0)),
               "top_p": float(given("top_p", 1.0)), "top_k": given("top_k", 1 << 30),
               "sampling_seed": sp.get("sampling_seed"), "top_logprobs_num": top_n,
               "ignore_eos": bool(sp.get("ignore_eos")),
               "counted": log_metrics and rid != "warmup"}
        with self.send_lock:
            self.requests.send(msg)
        try:
            out = await fut
        finally:
            self.pending.pop(rid, None)
        if log_metrics and out["error"] is None:
            stream = {**_metric_labels(self.served), "is_streaming": "false"}
            self.prompt_tokens.labels(**stream).inc(out["prompt_tokens"])
            self.generation_tokens.labels(**stream).inc(len(out["output_ids"]))
        return out

    def flush(self) -> bool:
        with self.flush_lock:
            with self.send_lock:
                self.requests.send({"kind": "flush"})
            return bool(self.control.recv()["success"])

    def warm_up(self) -> None:
        """What SGLang's warm-up thread does: wait for ``/model_info``, send one request, and the
        server is up (http_server.py, ``_execute_server_warmup``)."""
        import httpx

        time.sleep(float(os.environ.get("STANDIN_WARMUP_S", "0")))
        if os.environ.get("STANDIN_NEVER_READY"):
            return
        url = f"http://{self.args.host}:{self.args.port}"
        for _ in range(120):
            time.sleep(1.0)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/model_info", timeout=5).status_code == 200:
                    break
        body = {"sampling_params": {"temperature": 0, "max_new_tokens": 8},
                "text": WARMUP_TEXT, "rid": "warmup"}
        resp = httpx.post(url + "/generate", json=body, timeout=600)
        if resp.status_code != 200:
            log(f"Initialization failed. warmup error: {resp.text}")
            self.kill_tree()
        self.status = "Up"
        log("The server is fired up and ready to roll!")
        if os.environ.get("STANDIN_TIMES"):
            with open(os.environ["STANDIN_TIMES"], "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "start": self.started,
                                     "ready": time.time()}) + "\n")


def create_app(main: Main) -> Any:
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, generate_latest, multiprocess
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    args = main.args
    names = [*_metric_labels(main.served), "is_streaming"]
    main.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens "
                                 "processed.", names)
    main.generation_tokens = Counter("sglang:generation_tokens_total", "Number of generation "
                                     "tokens processed.", names)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    timeout = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))

    async def health_generate(request: Request) -> Response:
        if main.exiting or main.status == "Starting":
            return Response(status_code=503)
        generation = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        if request.url.path == "/health" and generation.lower() in ("0", "false", "no"):
            return Response(status_code=200)
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        task = asyncio.create_task(main.run(rid, [0], {"max_new_tokens": 1, "temperature": 0.0},
                                            0, log_metrics=False))
        tic = time.time()
        while time.time() < tic + timeout:
            await asyncio.sleep(1)
            if main.last_receive > tic:
                task.cancel()
                main.status = "Up"
                return Response(status_code=200)
        task.cancel()
        log(f"Health check failed. Server couldn't get a response from detokenizer for last "
            f"{timeout} seconds.")
        main.status = "UnHealthy"
        return Response(status_code=503)

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": args.model_path, "served_model_name": main.served,
                             "tokenizer_path": args.model_path, "is_generation": True,
                             "weight_version": "default", "has_image_understanding": False})

    async def server_info(request: Request) -> Response:
        return JSONResponse({**main.resolved, "launch_command": " ".join(sys.argv),
                             "internal_states": [{"last_gen_throughput": 0.0}],
                             "version": VERSION, "frontend": "python"})

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        if body.get("messages") is not None:
            ids = main.tok.encode(main.tok.apply_chat_template(body["messages"]))
        else:
            ids = main.tok.encode(body["prompt"])
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": args.context_length or 512})

    async def generate(request: Request) -> Response:
        body = await request.json()
        problem = contract_error(body)
        if problem is not None:
            return JSONResponse({"error": problem}, status_code=400)
        if os.environ.get("STANDIN_MALFORMED"):
            return Response(b'{"text": "x", "output_ids": [1, 2', media_type="application/json")
        sp = body.get("sampling_params") or {}
        prompt = body.get("input_ids")
        if prompt is None:
            prompt = main.tok.encode(body["text"])
        if isinstance(sp, list) or (prompt and isinstance(prompt[0], list)):
            return JSONResponse({"error": {"message": "the stand-in serves one prompt per "
                                           "request"}}, status_code=400)
        top_n = int(body.get("top_logprobs_num") or 0)
        out = await main.run(body.get("rid") or uuid.uuid4().hex, list(prompt), sp, top_n,
                             log_metrics=True)
        if out["error"] is not None:
            return JSONResponse({"error": {"message": out["error"]}}, status_code=400)
        ids = out["output_ids"]
        finish = ({"type": "stop", "matched": out["matched"]}
                  if out["finish_reason"] == "stop" else {"type": "length", "length": len(ids)})
        meta: dict[str, Any] = {
            "id": body.get("rid") or "standin", "finish_reason": finish,
            "prompt_tokens": out["prompt_tokens"], "weight_version": "default",
            "num_retractions": out["num_retractions"], "reasoning_tokens": 0,
            "completion_tokens": len(ids), "cached_tokens": 0}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out["logprobs"], ids)]
            if top_n:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row[:top_n]] or None
                                               for row in out["top"]]
        return JSONResponse({"text": out["text"], "output_ids": ids, "meta_info": meta})

    async def flush_cache(request: Request) -> Response:
        if await asyncio.to_thread(main.flush):
            return Response("Cache flushed.\nPlease check backend logs for more details. (When "
                            "there are running or waiting requests, the operation will not be "
                            "performed.)\n")
        return Response("Flush cache failed.\n", status_code=400)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": main.served, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        if not args.enable_metrics:
            return Response(status_code=404)
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/health", health_generate), Route("/health_generate", health_generate),
        Route("/model_info", model_info), Route("/get_model_info", model_info),
        Route("/server_info", server_info), Route("/get_server_info", server_info),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/v1/models", models), Route("/metrics", metrics)])


# -- start-up ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags the stand-in reads; any other flag SGLang 0.5.23 accepts is taken and ignored,
    and one it does not know is argparse's "unrecognized arguments" (exit 2)."""
    from bistat.engines.sglang_args import known_names

    parser = argparse.ArgumentParser(prog="launch_server.py")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--attention-backend")
    parser.add_argument("--prefill-attention-backend")
    parser.add_argument("--decode-attention-backend")
    parser.add_argument("--sampling-backend")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--chunked-prefill-size", type=int)
    parser.add_argument("--page-size", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--decode-log-interval", type=int, default=40)
    args, rest = parser.parse_known_args(argv)
    known = known_names()[VERSION]
    unknown = [a for a in rest if a.startswith("--")
               and a[2:].split("=")[0].replace("-", "_") not in known]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The resolved server arguments, logging what SGLang logs as it resolves them; a backend
    the deterministic mode does not support raises its ``ValueError``."""
    deterministic = bool(args.enable_deterministic_inference)
    backend = args.attention_backend
    disable_radix = bool(args.disable_radix_cache)
    sampling = args.sampling_backend or "flashinfer"
    if deterministic:
        log("Sampling backend is set to pytorch for deterministic inference.")
        sampling = "pytorch"
        if backend is None:
            backend = "fa3"
            log(f"Attention backend not specified. Falling back to '{backend}' for deterministic "
                f"inference. You can explicitly set --attention-backend to one of "
                f"{DETERMINISTIC_BACKENDS}.")
        elif backend not in DETERMINISTIC_BACKENDS or os.environ.get("STANDIN_REFUSE"):
            raise ValueError(f"Currently only {DETERMINISTIC_BACKENDS} attention backends are "
                             f"supported for deterministic inference, but you explicitly "
                             f"specified '{backend}'.")
        if backend not in RADIX_DETERMINISTIC_BACKENDS:
            disable_radix = True
            log(f"Currently radix cache is not compatible with {backend} attention backend for "
                f"deterministic inference. It will be supported in the future.")
    elif backend is None:
        backend = "fa3"
        log(f"Attention backend not specified. Use {backend} backend by default.")
    return {
        "model_path": args.model_path, "attention_backend": backend,
        "decode_attention_backend": args.decode_attention_backend,
        "prefill_attention_backend": args.prefill_attention_backend,
        "enable_deterministic_inference": deterministic, "sampling_backend": sampling,
        "disable_radix_cache": disable_radix, "tp_size": args.tp_size, "dtype": args.dtype,
        "mem_fraction_static": args.mem_fraction_static or 0.835,
        "max_running_requests": args.max_running_requests or 8,
        "chunked_prefill_size": args.chunked_prefill_size or 8192,
        "page_size": args.page_size or 1, "kv_cache_dtype": args.kv_cache_dtype,
        "random_seed": args.random_seed if args.random_seed is not None else 42,
        "enable_metrics": bool(args.enable_metrics),
        "decode_log_interval": args.decode_log_interval}


def main(argv: list[str]) -> int:
    started = time.time()
    args = parse_args(argv)
    log(f"argv={argv} (tests/sglang_standin.py: a stand-in, NOT SGLang)")
    if os.environ.get("STANDIN_PIDFILE"):
        with open(os.environ["STANDIN_PIDFILE"], "w") as fh:
            fh.write(str(os.getpid()))
    resolved = resolve(args)
    # SGLang logs its whole resolved argument set once, as a Python literal (server_args.py):
    # the CUDA graphs' part as 0.5.23 resolves it for a small model (decode graphs up to the
    # running requests, breakable prefill graphs up to the chunk), no torch.compile
    log("server_args=" + repr({
        **resolved, "enable_torch_compile": False, "torch_compile_max_bs": 32,
        "disable_cuda_graph": False,
        "cuda_graph_config": {
            "decode": {"backend": "full", "max_bs": resolved["max_running_requests"]},
            "prefill": {"backend": "breakable", "max_bs": resolved["chunked_prefill_size"]}}}))
    # a fresh multiprocess metrics folder (inside a set one), before prometheus_client is
    # imported here or in a child (sglang/srt/utils/common.py, set_prometheus_multiproc_dir)
    prometheus_dir = tempfile.mkdtemp(dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prometheus_dir
    server = Main(args, resolved, args.served_model_name or args.model_path)
    server.started = started
    server.prometheus_dir = prometheus_dir
    signal.signal(signal.SIGQUIT, server.on_sigquit_starting)
    server.spawn()
    server.wait_for_scheduler()
    signal.signal(signal.SIGQUIT, server.on_sigquit)
    signal.signal(signal.SIGTERM, server.on_sigterm)
    for target in (server.watchdog, server.read_results, server.drain_on_sigterm,
                   server.warm_up):
        threading.Thread(target=target, daemon=True).start()
    import asyncio

    import uvicorn

    from bistat.engines.serve.server import bind

    sock = bind(args.host, args.port)
    http = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    http.capture_signals = contextlib.nullcontext  # SIGTERM is the handler's above, not uvicorn's
    asyncio.run(http.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
