"""The ``embedded`` engine kind: bistat's in-process numpy engine behind the ``Engine`` protocol.

``start()`` loads the declared model (``engine.model``: a registered name such as
``smollm2-135m`` from the cache, or a model folder) and starts an
:class:`bistat.engines.embedded.engine.EmbeddedEngine` with the merged arguments (``engine.args``
overridden by the arm's ``args``): ``gemm`` (``"blas"`` | ``"invariant"``), ``max_batch_size``,
``max_model_len``, ``prefill_chunk``, ``max_num_batched_tokens``,
``tensor_parallel_size`` (emulated tensor parallelism in one process, default 1; reported in the
engine's arguments always, so findings show it; a value the model cannot be sharded by is refused
naming the declaration field and the valid values).

``run_pass`` keeps at most ``concurrency`` requests in flight, calls ``on_result`` in the calling
thread as requests finish (times rebased on the pass start), and ``on_metrics`` about once a second
with ``source="embedded"``. In those samples ``num_requests_running`` is the *step-log* figure: the
mean batch size of the engine steps completed since the previous sample (the instantaneous count
when no step completed), so the batching evidence comes from what the engine actually computed.
Before each of those samples, every engine step completed since the previous one is reported as
a *step sample* (``source="embedded-step"``, ``step_batch_size`` = the requests in that step, ``t``
= when it finished, counters NaN so per-second summaries skip it): the exact per-step batch sizes
``bistat diagnose`` and the probe's vacuity guard read. ``pass_step_log`` keeps every step of the
last pass as ``(t since pass start, batch size)``.

``prompt_logprobs(request, continuation)`` prefills the prompt plus each prefix of
``continuation`` in one forward step, without the KV cache of a decode, and returns the logprob
of each continuation token: the prefill side of the prefill-vs-decode check.
"""

from __future__ import annotations

import math
import os
import queue
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable, Sequence

from bistat import __version__
from bistat.engines.base import (
    EngineCapabilities,
    EngineInfo,
    EngineRefused,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    MetricsSample,
)

ENGINE_ARGS = ("gemm", "max_batch_size", "max_model_len", "prefill_chunk",
               "max_num_batched_tokens", "tensor_parallel_size")
_DEFAULTS = {"gemm": "blas", "max_batch_size": 32, "max_model_len": 2048, "tensor_parallel_size": 1}
METRICS_INTERVAL_S = 1.0
#: ``source`` of the per-step metrics samples (``step_batch_size`` set, counters NaN).
STEP_SOURCE = "embedded-step"


#: the engine arguments that must be positive integers
_POSITIVE_INTS = ("max_batch_size", "max_model_len", "prefill_chunk", "max_num_batched_tokens",
                  "tensor_parallel_size")


def _local_model(name: str) -> Any:
    """``(config, tokenizer)`` of the model when it is on this machine, else None."""
    from bistat.model.loader import local_config_and_tokenizer

    return local_config_and_tokenizer(name)


def _default_loader(name: str) -> Any:
    from bistat.model import load_model  # imported lazily: the model package reads the cache

    return load_model(name)


def _blas_findings() -> tuple[str, ...]:
    """Which BLAS numpy uses and the kernel it chose (threadpoolctl, when installed)."""
    lines = [f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')!s} "
             f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '')!s}"]
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return tuple(lines)
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            lines.append(f"blas: {info.get('internal_api')} {info.get('version')} "
                         f"architecture={info.get('architecture')} threads={info.get('num_threads')}")
    return tuple(lines)


class EmbeddedEngineAdapter:
    """``Engine`` protocol adapter of the embedded numpy engine (one per arm)."""

    kind = "embedded"
    capabilities = EngineCapabilities(parallel_start=True, prompt_logprobs=True,
                                      gemm_modes=True, recomputes_prompts=True,
                                      in_process_replay=True)

    def __init__(self, experiment: Any, arm: Any, *, loader: Callable[[str], Any] | None = None) -> None:
        self.model_name = str(experiment.engine.model)
        self.args = {**dict(experiment.engine.args), **dict(arm.args)}
        self._arm_arg_names = frozenset(dict(arm.args))
        self.env = dict(getattr(arm, "env", {}) or {})
        self.arm_name = getattr(arm, "name", "?")
        self._loader = loader or _default_loader
        self.engine: Any = None
        self.pass_step_log: list[tuple[float, int]] = []

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """What registration can check before any run: ``(field, message with the fix)`` for
        every unknown argument (in the table it was written in), a GEMM mode that is not one of
        ``ops.GEMM_MODES`` and a model that is neither a registered name nor a model folder (a
        registered model not yet fetched is fine: it is fetched before the run)."""
        from bistat.engines.embedded.ops import GEMM_MODES
        from bistat.model.loader import model_problem

        problems: list[tuple[str, str]] = []
        tables = [("engine.args", dict(experiment.engine.args))]
        tables += [(f"arms[{i}].args", dict(arm.args)) for i, arm in enumerate(experiment.arms)]
        for table, args in tables:
            for key in sorted(set(args) - set(ENGINE_ARGS)):
                problems.append((f"{table}.{key}", f"unknown embedded-engine argument {key!r}; "
                                 f"expected one of {list(ENGINE_ARGS)}"))
            if "gemm" in args and args["gemm"] not in GEMM_MODES:
                modes = " or ".join(repr(m) for m in GEMM_MODES)
                problems.append((f"{table}.gemm", f"unknown GEMM mode {args['gemm']!r}; expected "
                                 f"{modes}"))
        for table, args in tables:
            for key in _POSITIVE_INTS:
                value = args.get(key)
                if key in args and (isinstance(value, bool) or not isinstance(value, int)
                                    or value < 1):
                    problems.append((f"{table}.{key}", f"{value!r} is not a positive integer; "
                                     f"write e.g. {key} = {_DEFAULTS.get(key, 256)}"))
        for i, arm in enumerate(experiment.arms):
            if arm.env:
                problems.append((f"arms[{i}].env", f"the embedded engine runs inside the bistat "
                                 f"process, so environment variables {sorted(arm.env)} cannot "
                                 "apply to it; remove them or use a server engine kind"))
        problem = model_problem(str(experiment.engine.model))
        if problem is not None:
            problems.append(("engine.model", problem))
            return problems
        local = _local_model(str(experiment.engine.model))
        if local is not None:
            from bistat.engines.embedded.forward import model_dims, valid_tensor_parallel_sizes

            valid = valid_tensor_parallel_sizes(model_dims(local[0]))
            for table, args in tables:
                tp = args.get("tensor_parallel_size")
                if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and tp not in valid:
                    problems.append((f"{table}.tensor_parallel_size", f"{tp} does not divide "
                                     f"model {experiment.engine.model!r}'s heads and MLP; set it "
                                     f"to one of {valid}, or remove it (default 1)"))
        return problems

    @classmethod
    def prompt_problems(cls, experiment: Any, prompts: Sequence[Any]) -> list[tuple[str, str]]:
        """What the engine would refuse of every request of a pass: the longest prompt (with the
        model's chat template, when the model is on this machine; else counted as 1 token) and
        ``workload.max_tokens`` over an arm's ``max_model_len`` (default 2048), and a token id
        outside the model's vocabulary."""
        from bistat.engines.declared import context_problems

        local = _local_model(str(experiment.engine.model))
        lengths = None
        problems: list[tuple[str, str]] = []
        if local is not None and prompts:
            config, tokenizer = local
            longest, pid = 0, None
            for p in prompts:
                if isinstance(p.prompt, str):
                    text = (tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}])
                            if p.chat else p.prompt)
                    n = len(tokenizer.encode(text))
                else:
                    n = len(p.prompt)
                    bad = [x for x in p.prompt if not 0 <= int(x) < config.vocab_size]
                    if bad and not problems:
                        problems.append(("workload.source", f"prompt {p.prompt_id} has token id "
                                         f"{bad[0]}, outside model {experiment.engine.model!r}'s "
                                         f"vocabulary [0, {config.vocab_size}); set the source's "
                                         f"vocab to at most {config.vocab_size}"))
                if n > longest:
                    longest, pid = n, p.prompt_id
            lengths = (longest, pid, True)
        return problems + context_problems(experiment, "max_model_len", "the embedded engine",
                                           prompts, lengths=lengths,
                                           default=_DEFAULTS["max_model_len"])

    @classmethod
    def declaration_limits(cls, experiment: Any) -> list[str]:
        """What registration cannot check: with the model not on this machine yet, the prompts'
        lengths under its chat template and the tensor parallel size against its heads."""
        name = str(experiment.engine.model)
        if _local_model(name) is not None:
            return []
        return [f"engine 'embedded': model {name!r} is not on this machine yet, so the prompts' "
                "lengths under its chat template (counted as 1 token against max_model_len) and "
                "tensor_parallel_size against its heads are checked when the run loads it "
                f"(`bistat model fetch {name}` before registering checks them here)"]

    def _table(self, key: str) -> str:
        """The declaration table an argument came from: the arm's ``args`` override
        ``engine.args``."""
        return f"arms[{self.arm_name}].args" if key in self._arm_arg_names else "engine.args"

    def start(self) -> EngineInfo:
        unknown = sorted(set(self.args) - set(ENGINE_ARGS))
        if unknown:
            # name the table each unknown key came from: the arm's args override engine.args
            tables: dict[str, list[str]] = {}
            for key in unknown:
                tables.setdefault(self._table(key), []).append(key)
            where = " and ".join(f"{table}: {keys}" for table, keys in sorted(tables.items(),
                                                                             reverse=True))
            raise EngineRefused(
                f"{where}: unknown embedded-engine argument(s); expected some of "
                f"{list(ENGINE_ARGS)}; remove them or use an engine kind that takes them")
        if self.env:
            raise EngineRefused(
                f"arms[{self.arm_name}].env: the embedded engine runs inside the bistat process, so "
                f"environment variables {sorted(self.env)} cannot apply to it; remove them or use a "
                "server engine kind")
        args = {**_DEFAULTS, **self.args}
        from bistat.engines.embedded.engine import EmbeddedEngine
        from bistat.engines.embedded.forward import TensorParallelSizeError

        try:
            model = self._loader(self.model_name)
        except Exception as exc:  # noqa: BLE001 - every load failure makes the arm untested
            raise EngineStartError(f"embedded engine: cannot load model {self.model_name!r}: {exc}") from exc
        try:
            self.engine = EmbeddedEngine(model, **args)
        except TensorParallelSizeError as exc:
            field = f"{self._table('tensor_parallel_size')}.tensor_parallel_size"
            raise EngineRefused(
                f"{field}: {exc}. Fix: set {field} to one of {list(exc.valid)}, or remove it "
                "(default 1, no tensor parallelism)") from exc
        except (TypeError, ValueError, KeyError) as exc:
            raise EngineRefused(f"embedded engine: arguments {args} refused: {exc}") from exc
        self.engine.start()
        findings = (f"embedded gemm mode: {args['gemm']}",)
        tp = self.engine.tensor_parallel_size
        if tp > 1:
            order = "rank order" if args["gemm"] == "invariant" else "tree or ring by message size"
            findings += ((f"embedded tensor parallelism: {tp} ranks emulated in one process "
                          f"(per-rank GEMMs, all-reduce in {order}; no communication)"),)
        if args["gemm"] == "invariant":
            from bistat.engines.embedded import ops

            findings += ((f"embedded invariant gemm: one fma chain per element (bistat _rowgemm, "
                          f"{ops.GEMM_ISAS[-1]}, {ops.gemm_threads()} threads; BLAS not used "
                          "for the GEMMs)"),)
        findings += _blas_findings()
        return EngineInfo(kind=self.kind, version=__version__, commit=None,
                          args={**args, "model": self.model_name,
                                "model_sha256": getattr(model, "sha256", None)},
                          env={}, log_findings=findings)

    def run_pass(self, requests: Sequence[GenerationRequest], *, concurrency: int,
                 on_result: Callable[[GenerationResult], None],
                 on_metrics: Callable[[MetricsSample], None]) -> None:
        if self.engine is None:
            raise EngineStartError("embedded engine: run_pass() before start()")
        if concurrency < 1:
            raise ValueError(f"concurrency ({concurrency}) must be at least 1")
        eng = self.engine
        t0 = time.monotonic()
        step0 = len(eng.step_log)
        last_step = step0
        done: queue.Queue[tuple[GenerationRequest, Future]] = queue.Queue()
        pending = list(requests)[::-1]
        in_flight = 0

        def submit_next() -> None:
            nonlocal in_flight
            req = pending.pop()
            fut = eng.submit(req)
            fut.add_done_callback(lambda f, r=req: done.put((r, f)))
            in_flight += 1

        def sample(t: float) -> None:
            nonlocal last_step
            m = eng.metrics()
            steps = eng.step_log[last_step:]
            last_step += len(steps)
            for ts, size in steps:  # one step sample per engine step: exact batching evidence
                on_metrics(MetricsSample(t=ts - t0, num_requests_running=math.nan,
                                         num_requests_waiting=math.nan,
                                         num_preemptions_total=math.nan,
                                         generation_tokens_total=math.nan,
                                         prompt_tokens_total=math.nan, source=STEP_SOURCE,
                                         step_batch_size=float(size)))
            running = (sum(b for _, b in steps) / len(steps)) if steps else m["num_requests_running"]
            on_metrics(MetricsSample(t=t, num_requests_running=float(running),
                                     num_requests_waiting=m["num_requests_waiting"],
                                     num_preemptions_total=m["num_preemptions_total"],
                                     generation_tokens_total=m["generation_tokens_total"],
                                     prompt_tokens_total=m["prompt_tokens_total"], source="embedded"))

        while pending and in_flight < concurrency:
            submit_next()
        next_sample = t0 + METRICS_INTERVAL_S
        sample(0.0)
        while in_flight:
            try:
                req, fut = done.get(timeout=max(0.0, next_sample - time.monotonic()))
            except queue.Empty:
                pass
            else:
                in_flight -= 1
                on_result(self._rebased(req, fut, t0))
                if pending:
                    submit_next()
            now = time.monotonic()
            if now >= next_sample:
                sample(now - t0)
                next_sample = now + METRICS_INTERVAL_S
        sample(time.monotonic() - t0)
        self.pass_step_log = [(t - t0, b) for t, b in eng.step_log[step0:]]

    @staticmethod
    def _rebased(req: GenerationRequest, fut: Future, t0: float) -> GenerationResult:
        try:
            res: GenerationResult = fut.result()
        except Exception as exc:  # noqa: BLE001 - a request's failure is a result, never a raise
            now = time.monotonic() - t0
            return GenerationResult(prompt_id=req.prompt_id, token_ids=[], text="", logprobs=None,
                                    top_logprobs=None, finish_reason=None, n_prompt_tokens=None,
                                    t_submit=now, t_first_token=None, t_done=now,
                                    error=f"{type(exc).__name__}: {exc}")
        return replace(res, t_submit=res.t_submit - t0, t_done=res.t_done - t0,
                       t_first_token=None if res.t_first_token is None else res.t_first_token - t0)

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        """Logprob of each token of ``continuation`` when prompt + the tokens before it are prefilled.

        One fresh KV cache and one forward step per position (a prefill of the whole prefix,
        never a decode step), in the arm's GEMM mode; float32 logits, log-softmax as the
        engine's sampler computes it. A decode that is consistent with prefill gives the same
        bits at every position.
        """
        if self.engine is None:
            raise EngineStartError("embedded engine: prompt_logprobs() before start()")
        from bistat.engines.embedded import ops
        from bistat.engines.embedded.forward import Segment, forward_step
        from bistat.engines.embedded.kvcache import KVCache

        eng = self.engine
        prompt = list(eng.encode_prompt(request))
        d = eng.weights.dims
        out: list[float] = []
        for j, token in enumerate(int(t) for t in continuation):
            ids = prompt + [int(t) for t in continuation[:j]]
            cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                            eng.max_model_len, initial=len(ids))
            logits = forward_step(eng.weights, [Segment(cache, ids, 0, True)],
                                  eng.gemm)  # [1, V]
            lse, _ = ops.log_softmax_rows(logits)  # [1]
            out.append(float(logits[0, token] - lse[0]))
        return out

    def fingerprint(self) -> dict[str, Any]:
        return {}

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
