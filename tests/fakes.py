"""A scriptable fake engine implementing :class:`bistat.engines.base.Engine`, special-cased nowhere.

The runner and the probe drive it exactly as they drive a real engine (after llm's
``MockModel``). Its outputs are pure functions of the request and — when asked — of the batch it
ran in, so tests know what to expect:

* deterministic outputs: token ids and logprobs derived from ``sha256(prompt)``;
* batch-dependent outputs (``divergence``): a request whose batch (the ``concurrency``-sized
  chunk of the submission order it falls in) hashes below ``divergence`` gets a changed token at
  a hash-chosen position and a logprob off by one ulp: passes with different batch compositions
  then disagree, the way a non-invariant GEMM makes them disagree. ``logprob_jitter`` changes only
  the logprob bits;
* failures: ``fail_prompts`` always fail (like HTTP 500 after every retry); ``transient_failures``
  makes the first N attempts of every request fail (retried up to ``workload.retries``);
  ``drop_prompts`` are never answered (a protocol violation the runner must catch);
* crashes: ``crash_on_call`` (the k-th ``run_pass`` call of that arm, counted across engine
  instances, so across restarts and resumes) raises :class:`EngineError` after
  ``crash_after`` results; ``interrupt_on_call`` raises :class:`KeyboardInterrupt` instead, and
  ``exit_on_call`` ends the whole process at once (``os._exit(137)``, like ``kill -9``);
* start-up: ``refuse`` (:class:`EngineRefused`) and ``start_error`` (:class:`EngineStartError`).

:class:`StepFakeEngine` (``step_factory``) schedules step by step instead, to model a kernel whose
outputs change only past a KV tile and only beside a prefill (FlashAttention 3 at head size 64).

A :class:`FakeScript` holds the behaviour per arm and the call log; ``script.factory`` is the
engine factory the runner takes. :func:`install` registers the kind ``"fake"`` so the CLI can run
declarations with ``engine.kind = "fake"``; the engine then reads its behaviour from the arm's
engine arguments (``args = { fake = { divergence = 0.5 } }``) and uses the installed script's
call counters.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from bistat.engines.base import (
    EngineError,
    EngineInfo,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)

VOCAB = 1000
EOS = 0


@dataclass(frozen=True)
class FakeArm:
    """Behaviour of one arm's fake engine (see the module docstring)."""

    divergence: float = 0.0
    logprob_jitter: bool = False
    fail_prompts: frozenset[str] = frozenset()
    transient_failures: int = 0
    drop_prompts: frozenset[str] = frozenset()
    crash_on_call: int | None = None
    crash_after: int = 0
    interrupt_on_call: int | None = None
    exit_on_call: int | None = None
    refuse: str | None = None
    start_error: str | None = None
    version: str = "fake-1.0"
    gpu_uuid: str | None = None

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "FakeArm":
        fake = dict(args.get("fake", {}))
        for key in ("fail_prompts", "drop_prompts"):
            if key in fake:
                fake[key] = frozenset(fake[key])
        return cls(**fake)


@dataclass
class FakeScript:
    """Per-arm behaviour plus the log of what the engines were asked (shared by all instances)."""

    arms: dict[str, FakeArm] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # run_pass calls per arm
    starts: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    passes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (arm, submission order)
    running: set[str] = field(default_factory=set)
    max_running_engines: int = 0

    def behaviour(self, arm: str, args: Mapping[str, Any]) -> FakeArm:
        return self.arms.get(arm) or FakeArm.from_args(args)

    def factory(self, experiment: Any, arm: Any) -> "FakeEngine":
        return FakeEngine(experiment, arm, script=self)


_INSTALLED: dict[str, FakeScript] = {}


def install(script: FakeScript | None = None) -> FakeScript:
    """Register engine kind ``"fake"`` (-> :class:`FakeEngine`) and make ``script`` its default."""
    from bistat.engines.registry import register_adapter

    script = script or FakeScript()
    _INSTALLED["default"] = script
    register_adapter("fake", f"{__name__}:FakeEngine", "the test suite's fake engine")
    return script


def _h(*parts: object) -> int:
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _next_after(x: float) -> float:
    """The float64 one ulp above ``x`` (a bitwise-different, numerically negligible value)."""
    (bits,) = struct.unpack("<q", struct.pack("<d", x))
    bits += 1 if x >= 0 else -1
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def expected_tokens(request: GenerationRequest) -> list[int]:
    """The fake's batch-independent output for a request (``max_tokens`` ids, or up to its EOS)."""
    key = request.prompt if isinstance(request.prompt, str) else ",".join(map(str, request.prompt))
    ids = [1 + _h(key, request.seed, i) % (VOCAB - 1) for i in range(request.max_tokens)]
    if not request.ignore_eos:
        stop = _h(key, "eos") % (2 * request.max_tokens)
        if stop < len(ids):
            ids = ids[:stop] + [EOS]
    return ids


class FakeEngine:
    """The fake engine; constructor ``(experiment, arm)`` like every adapter."""

    kind = "fake"

    def __init__(self, experiment: Any, arm: Any, *, script: FakeScript | None = None) -> None:
        self.experiment = experiment
        self.arm = arm
        self.script = script or _INSTALLED.get("default") or FakeScript()
        self.behaviour = self.script.behaviour(arm.name, experiment.arm_args(arm))
        self.retries = experiment.workload.retries
        self.started = False

    # protocol -------------------------------------------------------------------------------

    def start(self) -> EngineInfo:
        b = self.behaviour
        if b.refuse is not None:
            raise EngineRefused(b.refuse)
        if b.start_error is not None:
            raise EngineStartError(b.start_error)
        self.started = True
        self.script.starts.append(self.arm.name)
        self.script.running.add(self.arm.name)
        self.script.max_running_engines = max(self.script.max_running_engines, len(self.script.running))
        return EngineInfo(
            kind=self.kind,
            version=b.version,
            commit="0" * 40,
            args=dict(self.experiment.arm_args(self.arm)),
            env=dict(self.arm.env),
            log_findings=("fake: batch invariance " + ("off" if b.divergence else "on"),),
        )

    def fingerprint(self) -> dict[str, Any]:
        gpus = [] if self.behaviour.gpu_uuid is None else [
            {"name": "Fake GPU", "uuid": self.behaviour.gpu_uuid, "serial": None, "driver": "0"}
        ]
        return {
            "gpus": gpus,
            "cpu": {"model": "fake", "count": 1, "machine": "x86_64"},
            "os": {"system": "Linux", "release": "0", "platform": "linux"},
            "versions": {"python": "3", "numpy": "2", "torch": None, "triton": None, "vllm": None,
                         "bistat": "0.1.0", "fake": self.behaviour.version},
            "git": {"commit": None, "dirty": None},
            "host": "fake-host",
        }

    def stop(self) -> None:
        if self.started:
            self.started = False
            self.script.stops.append(self.arm.name)
            self.script.running.discard(self.arm.name)

    def run_pass(
        self,
        requests: Sequence[GenerationRequest],
        *,
        concurrency: int,
        on_result: Callable[[GenerationResult], None],
        on_metrics: Callable[[MetricsSample], None],
    ) -> None:
        if not self.started:
            raise EngineError("run_pass before start")
        b = self.behaviour
        name = self.arm.name
        call = self.script.calls.get(name, 0)
        self.script.calls[name] = call + 1
        self.script.passes.append((name, tuple(r.prompt_id for r in requests)))
        crash = b.crash_on_call == call
        interrupt = b.interrupt_on_call == call
        hard_exit = b.exit_on_call == call
        delivered = 0
        t = 0.0
        generated = 0
        for start in range(0, len(requests), concurrency):
            batch = list(requests[start:start + concurrency])
            batch_key = tuple(sorted(r.prompt_id for r in batch))
            waiting = len(requests) - start - len(batch)
            on_metrics(MetricsSample(t=t, num_requests_running=float(len(batch)), num_requests_waiting=float(waiting),
                                     num_preemptions_total=0.0, generation_tokens_total=float(generated),
                                     prompt_tokens_total=0.0, source="fake"))
            for request in batch:
                if (crash or interrupt or hard_exit) and delivered >= b.crash_after:
                    if hard_exit:
                        os._exit(137)
                    if interrupt:
                        raise KeyboardInterrupt
                    raise EngineError(f"fake engine for {name!r} died (scripted crash on call {call})")
                t += 0.001
                if request.prompt_id in b.drop_prompts:
                    continue
                result = self._result(request, batch_key, t)
                generated += len(result.token_ids)
                on_result(result)
                delivered += 1
            t += 0.01
        on_metrics(MetricsSample(t=t, num_requests_running=0.0, num_requests_waiting=0.0,
                                 num_preemptions_total=0.0, generation_tokens_total=float(generated),
                                 prompt_tokens_total=0.0, source="fake"))

    # outputs --------------------------------------------------------------------------------

    def _result(self, request: GenerationRequest, batch_key: tuple[str, ...], t: float) -> GenerationResult:
        b = self.behaviour
        attempts_needed = b.transient_failures + 1
        base = GenerationResult(prompt_id=request.prompt_id, token_ids=[], text="", logprobs=None,
                                top_logprobs=None, finish_reason=None, n_prompt_tokens=None,
                                t_submit=t - 0.001, t_first_token=None, t_done=t)
        if request.prompt_id in b.fail_prompts or attempts_needed > self.retries + 1:
            return replace(base, error="HTTP 500: Internal Server Error", attempts=self.retries + 1)
        ids = expected_tokens(request)
        logprobs = [-(1 + _h(request.prompt_id, i) % 1000) / 997.0 for i in range(len(ids))]
        batch_hash = _h(request.prompt_id, *batch_key) / 2.0**64
        if ids and b.divergence > 0 and batch_hash < b.divergence:
            pos = _h(request.prompt_id, "pos", *batch_key) % len(ids)
            ids = ids[:pos] + [(ids[pos] % (VOCAB - 1)) + 1 if ids[pos] != VOCAB - 1 else 1] + ids[pos + 1:]
            logprobs = logprobs[:pos] + [_next_after(logprobs[pos])] + logprobs[pos + 1:]
        elif ids and b.logprob_jitter and batch_hash < 0.5:
            logprobs = [_next_after(logprobs[0])] + logprobs[1:]
        n_prompt = len(request.prompt) if not isinstance(request.prompt, str) else len(request.prompt.split())
        return replace(
            base,
            token_ids=ids,
            text=" ".join(f"t{i}" for i in ids),
            logprobs=logprobs,
            top_logprobs=[[(tok, lp)] for tok, lp in zip(ids, logprobs)] if request.logprobs >= 1 else None,
            finish_reason="stop" if ids and ids[-1] == EOS else "length",
            n_prompt_tokens=n_prompt,
            t_first_token=t - 0.0005,
            attempts=attempts_needed,
        )


# --------------------------------------------------------------------------------------------
# a continuous-batching fake, step by step: FlashAttention 3's KV tile at head size 64, modelled
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepArm:
    """Behaviour of one arm of :class:`StepFakeEngine`.

    ``diverge``: ``"never"`` (batch-invariant); ``"tile"`` (a decode token whose attention reads
    more than ``tile`` keys changes its logprob by one ulp when another request's prompt is
    prefilled in the same step: FA3 at head size 64, whose kernel, 64 x 192 or 192 x 128, follows
    the step's longest query, vLLM #51902); ``"batched"`` (every token computed beside another
    request changes: a batch-dependent GEMM, the negative control).
    """

    diverge: str = "never"
    tile: int = 128


class StepFakeEngine:
    """A fake engine that schedules like vLLM, one engine step at a time: at most
    ``concurrency`` requests in flight (the next admitted when one finishes); a new request's
    prompt is prefilled in the step it is admitted (its first token comes from it), and every
    running request decodes one token per step. It reports each step's batch size
    (``step_batch_size``) as the embedded engine does, a prompt's tokens as ``len(text) // 4``
    (:data:`bistat.analysis.probe_report.CHARS_PER_TOKEN`) or its token ids, and ``calls`` keeps every pass's
    (submission order, concurrency)."""

    kind = "fake-steps"

    def __init__(self, behaviour: StepArm) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[tuple[str, ...], int]] = []
        self.perturbed: list[tuple[str, int, int]] = []   # (prompt id, token index, KV length)
        self.prefill_steps: list[list[int]] = []           # per pass: the steps that prefilled

    def start(self) -> EngineInfo:
        return EngineInfo(kind=self.kind, version="1", log_findings=())

    def fingerprint(self) -> dict[str, Any]:
        return {}

    def stop(self) -> None:
        pass

    @staticmethod
    def n_prompt(request: GenerationRequest) -> int:
        return max(1, len(request.prompt) // 4) if isinstance(request.prompt, str) else len(request.prompt)

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        self.calls.append((tuple(r.prompt_id for r in requests), concurrency))
        pending = list(requests)[::-1]
        running: list[dict[str, Any]] = []
        step = 0
        self.prefill_steps.append([])
        while pending or running:
            while pending and len(running) < concurrency:
                r = pending.pop()
                running.append({"req": r, "ids": expected_tokens(r), "lps": [], "t0": step * 1e-3,
                                "prefilled": False})
            prefilling = {id(s) for s in running if not s["prefilled"]}
            if prefilling:
                self.prefill_steps[-1].append(step)
            for s in running:
                r, i = s["req"], len(s["lps"])
                kv = self.n_prompt(r) + i
                lp = -(1 + _h(r.prompt_id, r.prompt, i) % 1000) / 997.0
                others_prefill = bool(prefilling - {id(s)})
                b = self.behaviour
                if (b.diverge == "tile" and id(s) not in prefilling and others_prefill and kv > b.tile) \
                        or (b.diverge == "batched" and len(running) > 1):
                    lp = _next_after(lp)
                    self.perturbed.append((r.prompt_id, i, kv))
                s["lps"].append(lp)
                s["prefilled"] = True
            step += 1
            t = step * 1e-3
            on_metrics(MetricsSample(t=t, num_requests_running=math.nan, num_requests_waiting=math.nan,
                                     num_preemptions_total=math.nan, generation_tokens_total=math.nan,
                                     prompt_tokens_total=math.nan, source="fake-step",
                                     step_batch_size=float(len(running))))
            for s in [s for s in running if len(s["lps"]) == len(s["ids"])]:
                running.remove(s)
                r = s["req"]
                on_result(GenerationResult(
                    prompt_id=r.prompt_id, token_ids=list(s["ids"]), text="", logprobs=list(s["lps"]),
                    top_logprobs=None, finish_reason="length", n_prompt_tokens=self.n_prompt(r),
                    t_submit=s["t0"], t_first_token=s["t0"] + 1e-3, t_done=t))


def step_factory(arms: Mapping[str, StepArm], engines: dict[str, StepFakeEngine] | None = None
                 ) -> Callable[[Any, Any], StepFakeEngine]:
    """An engine factory for the probe: each arm's :class:`StepArm` (default ``never``); the
    engines it made are kept in ``engines`` by arm name."""
    def factory(experiment: Any, arm: Any) -> StepFakeEngine:
        engine = StepFakeEngine(arms.get(arm.name, StepArm()))
        if engines is not None:
            engines[arm.name] = engine
        return engine
    return factory


# --------------------------------------------------------------------------------------------
# a stand-in ``vllm`` package for the vllm-offline adapter's worker (no GPU here)
# --------------------------------------------------------------------------------------------

#: Source of a stand-in ``vllm/__init__.py``: the slice of vLLM 0.25.0 that
#: ``bistat.engines.vllm_offline_worker`` uses, with its real signatures and behaviour. Knobs
#: (environment of the worker): ``FAKE_REFUSE``, ``FAKE_BROKEN`` (start-up failures),
#: ``FAKE_PREEMPT_AT_STEP=N``, ``FAKE_HANG_AT_STEP=N`` (step N never returns),
#: ``FAKE_CRASH_AFTER=N`` (the process dies, logging vLLM's
#: ``torch.OutOfMemoryError`` and ``EngineDeadError`` lines, when its N-th request finishes;
#: with ``FAKE_CRASH_FLAG=PATH`` only while PATH exists, which the crash deletes: a crash once).
FAKE_VLLM = textwrap.dedent('''
    # The slice of vLLM 0.25.0 the worker uses, with the real signatures and behaviour
    # (paths are in the wheel vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl).
    import multiprocessing, os, time, types
    print("vLLM banner on stdout")
    __version__ = "0.25.0"
    __commit__ = "deadbeef"

    # vllm/sampling_params.py:199-301: a msgspec Struct; an unknown keyword is a TypeError;
    # output_kind defaults to CUMULATIVE; top_k -1 is accepted as "off" (:560-564); greedy
    # sets top_k = 0 (:490-493).
    _FIELDS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None,
               "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
               "detokenize": True, "output_kind": 0}

    class RequestOutputKind:  # vllm/sampling_params.py (an IntEnum)
        CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2

    sampling_params = types.SimpleNamespace(RequestOutputKind=RequestOutputKind)

    class SamplingParams:
        def __init__(self, **kw):
            for k in kw:
                if k not in _FIELDS:
                    raise TypeError(f"Unexpected keyword argument {k!r}")
            self.__dict__.update(_FIELDS, **kw)
            if self.top_k < -1:
                raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
            if self.max_tokens is not None and self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
            if self.temperature < 1e-5:
                self.top_p, self.top_k = 1.0, 0

    class _Logprob:  # vllm/logprobs.py:13-24
        def __init__(self, logprob):
            self.logprob, self.rank, self.decoded_token = logprob, None, None

    class _Metric:  # vllm/v1/metrics/reader.py:11-67 (counters are named without _total)
        def __init__(self, name, **kw):
            self.name, self.labels = name, {"model_name": "smol", "engine": "0"}
            self.__dict__.update(kw)

    class _Engine:  # vllm/v1/engine/llm_engine.py (V1 LLMEngine)
        def __init__(self, max_num_seqs, log_stats):
            self.reqs, self.max_num_seqs, self.finished = {}, max_num_seqs, 0
            self.log_stats, self.steps, self.stale = log_stats, 0, False
            self.running = self.waiting = self.preemptions = self.gen = self.prompt = 0

        def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                        tokenization_kwargs=None, trace_headers=None, priority=0, prompt_text=None):
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a string, got {type(request_id)}")
            if not isinstance(params, SamplingParams):
                raise TypeError("params must be SamplingParams")
            ids = prompt.get("prompt_token_ids") or [ord(c) for c in prompt["prompt"]]
            if max(ids) >= 1000:  # vllm/v1/engine/input_processor.py:483-484
                raise ValueError(f"Token id {max(ids)} is out of vocabulary")
            self.reqs[request_id] = (ids, params, [])
            return request_id

        def has_unfinished_requests(self):
            return bool(self.reqs)

        def step(self):
            if not self.reqs:  # the real one waits on the engine core's output queue for ever
                time.sleep(3600)
            if self.stale:
                # The engine core's stats-only output of the step after a pass's last request
                # finished (vllm/v1/core/sched/scheduler.py:1839-1849): read by the next pass's
                # first step(); no request outputs, so the gauges are not recorded
                # (vllm/v1/engine/llm_engine.py:320-332).
                self.stale = False
                return []
            self.steps += 1
            if self.steps == int(os.environ.get("FAKE_HANG_AT_STEP", "0")):
                time.sleep(3600)  # a hung engine: the worker falls silent
            running = list(self.reqs.items())[: self.max_num_seqs]
            print(f"step batch={len(running)}")
            if self.steps == int(os.environ.get("FAKE_PREEMPT_AT_STEP", "0")):
                self.preemptions += 1
            outs = []
            for rid, (ids, params, out) in running:
                if not out:
                    self.prompt += len(ids)
                out.append((sum(ids) + len(out)) % 50 + 10)
                self.gen += 1
                done = len(out) >= params.max_tokens
                lps = [{t: _Logprob(-0.25 * (k + 1)), t + 1: _Logprob(-2.0 - k)} for k, t in enumerate(out)]
                comp = types.SimpleNamespace(index=0, token_ids=out, text="", logprobs=lps,
                                             cumulative_logprob=None,
                                             finish_reason="length" if done else None)
                if done or params.output_kind != RequestOutputKind.FINAL_ONLY:
                    outs.append(types.SimpleNamespace(request_id=rid, prompt_token_ids=ids,
                                                      outputs=[comp], finished=done))
                if done:
                    del self.reqs[rid]
                    self.finished += 1
                    if self.finished == int(os.environ.get("FAKE_CRASH_AFTER", "0")):
                        flag = os.environ.get("FAKE_CRASH_FLAG")  # crash once: while it exists
                        if flag is None or os.path.exists(flag):
                            if flag is not None:
                                os.unlink(flag)
                            import sys
                            print("(EngineCore_DP0 pid=1) ERROR torch.OutOfMemoryError: CUDA out of "
                                  "memory. Tried to allocate 544.00 MiB. 231.94 MiB is free.",
                                  file=sys.stderr)
                            print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
                                  "encountered an issue. See stack trace (above) for the root "
                                  "cause.", file=sys.stderr, flush=True)
                            os._exit(3)
            self.running = min(len(self.reqs), self.max_num_seqs)
            self.waiting = len(self.reqs) - self.running
            self.stale = not self.reqs
            return outs

        def get_metrics(self):  # llm_engine.py:378-380
            assert self.log_stats, "Stat logging disabled"
            return [_Metric("vllm:num_requests_running", value=float(self.running)),
                    _Metric("vllm:num_requests_waiting", value=float(self.waiting)),
                    _Metric("vllm:num_preemptions", value=self.preemptions),
                    _Metric("vllm:generation_tokens", value=self.gen),
                    _Metric("vllm:prompt_tokens", value=self.prompt),
                    _Metric("vllm:request_prompt_tokens", count=1, sum=2.0, buckets={})]

    class LLM:  # vllm/entrypoints/llm.py:176-330
        def __init__(self, model, *, skip_tokenizer_init=False, seed=0, **kw):
            if kw.get("enable_prefix_caching") is not False:
                raise AssertionError("prefix caching must be off by default")
            kw.setdefault("disable_log_stats", True)  # llm.py:235-236
            if os.environ.get("FAKE_REFUSE"):
                raise ValueError("VLLM_BATCH_INVARIANT is not supported on this GPU")
            if os.environ.get("FAKE_BROKEN"):
                raise RuntimeError("CUDA out of memory")
            # The engine core is a forked process (VLLM_WORKER_MULTIPROC_METHOD=fork).
            self._core = multiprocessing.get_context("fork").Process(
                target=time.sleep, args=(600,), daemon=True)
            self._core.start()
            self.skip_tokenizer_init = skip_tokenizer_init
            self.llm_engine = _Engine(kw.get("max_num_seqs", 256), not kw["disable_log_stats"])

        def get_metrics(self):
            return self.llm_engine.get_metrics()

        def get_tokenizer(self):  # vllm/renderers/base.py:159
            if self.skip_tokenizer_init:
                raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
            raise ValueError("the stand-in has no tokenizer")
''')


def fake_vllm_site(root: os.PathLike[str] | str) -> str:
    """Write the stand-in ``vllm`` package under ``root/site`` and return that directory (for
    the arm's ``PYTHONPATH``)."""
    from pathlib import Path

    pkg = Path(root) / "site" / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    return str(Path(root) / "site")


def failing_passes(engine: Any, requests: Sequence[GenerationRequest], *, concurrency: int,
                   times: int = 1) -> tuple[list[Exception], list[GenerationResult], int | None]:
    """Start ``engine``, run ``times`` passes of ``requests`` that must each raise
    ``EngineError`` (an engine that dies), stop it. Returns the errors, the results delivered and
    the engine process's pid (None without one)."""
    import pytest

    from bistat.engines.base import EngineError

    errors: list[Exception] = []
    results: list[GenerationResult] = []
    try:
        engine.start()
        pid = engine.proc.pid if getattr(engine, "proc", None) is not None else None
        for _ in range(times):
            with pytest.raises(EngineError) as exc:
                engine.run_pass(requests, concurrency=concurrency, on_result=results.append,
                                on_metrics=lambda s: None)
            errors.append(exc.value)
    finally:
        engine.stop()
    return errors, results, pid
