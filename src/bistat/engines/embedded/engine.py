"""``EmbeddedEngine``: the numpy LLaMA engine with continuous batching, in process.

A loop thread runs engine steps as vLLM does: each step admits waiting requests into the running
batch (up to ``max_batch_size``) and prefills them in chunks, decodes one token for every running
request — all rows of the step in ONE GEMM per linear layer — and lets finished requests leave.
``submit`` returns a ``concurrent.futures.Future`` resolved with a
:class:`bistat.engines.base.GenerationResult`; a request that cannot run (prompt too long, bad
token id, ...) resolves with ``error`` set instead of raising. ``step_log`` records
``(monotonic time, batch size)`` for every step: the batching evidence.

``gemm="blas"`` is batch-variant (numpy's BLAS picks kernels by batch size);
``gemm="invariant"`` makes a request's tokens and logprobs bitwise independent of its neighbours
and of its position in the batch. Why, step by step:

* every GEMM output element is one fma chain over ``k = 0 .. K-1``
  (:func:`bistat.engines.embedded.ops.gemm_invariant`, bistat's own kernel: BLAS is not used), so a row's
  sums never depend on the other rows, their number, or the row's position;
* RMSNorm, SwiGLU, RoPE and the log-softmax work row by row;
* attention runs per request over its own KV cache, with shapes fixed by that request alone —
  prompt chunk boundaries are multiples of ``prefill_chunk`` from the request's start
  (:mod:`bistat.engines.embedded.scheduler`), never cut by what else shares the step;
* sampling uses the request's own row and its own seeded generator.

The tests (``tests/test_embedded_invariance.py``) check it bitwise at batch sizes 1..40 and
rotated positions, with prefill rows mixed into the step.

``tensor_parallel_size=T`` emulates Megatron-style tensor parallelism over ``T`` ranks inside
this process (:mod:`bistat.engines.embedded.forward`): per-rank GEMMs of the column-parallel layers,
per-rank partial sums of the row-parallel layers combined by
:func:`bistat.engines.embedded.ops.all_reduce` in the collective's summation order (fixed in
``"invariant"`` mode, ring or tree by message size in ``"blas"`` mode). Nothing is communicated;
what changes is the arithmetic: GEMM shapes and one more sum. ``tests/test_embedded_tp.py``
checks that batch invariance survives it.

Times in results are ``time.monotonic()`` seconds; the engine adapter rebases them on the pass start.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Sequence as Seq

import numpy as np

from bistat.engines.embedded import ops
from bistat.engines.embedded.forward import (
    Segment,
    Weights,
    check_tensor_parallel_size,
    forward_step,
    gemm_weights,
    model_dims,
    prepare_weights,
    shard_weights,
)
from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.embedded.sampling import SamplingParams, select_token, top_logprobs
from bistat.engines.embedded.scheduler import Scheduler, Sequence
from bistat.engines.base import GenerationRequest, GenerationResult


class EmbeddedEngine:
    """Continuous-batching numpy inference engine over a loaded LLaMA-family model.

    Parameters
    ----------
    model : object with ``config`` (HF LLaMA config names), ``weights`` (dict of HF-named float32
        ``[out, in]`` arrays) and ``tokenizer`` (``encode``, ``decode``, ``apply_chat_template``),
        e.g. :func:`bistat.model.load_model`'s ``Model``. Only the prepared (fused, transposed)
        weights are kept, so dropping the model afterwards frees its arrays.
    gemm : ``"blas"`` or ``"invariant"``
    max_batch_size : most requests in the running batch
    max_model_len : most tokens (prompt + output) of one request
    prefill_chunk : prompt tokens per prefill chunk (chunk boundaries are fixed per request)
    max_num_batched_tokens : rows per step (decode rows + prefill chunks); default
        ``max_batch_size + 2 * prefill_chunk``
    prepared : the ``weights`` of another engine over the same model (shared, read only), to
        skip preparing them again (e.g. one engine per GEMM mode); unsharded ones are sharded
        for this engine's ``tensor_parallel_size`` (the shards are new arrays)
    tensor_parallel_size : emulated tensor-parallel ranks ``T`` (default 1: no sharding, the
        plain forward pass). An ``int >= 1`` dividing the model's num_attention_heads,
        num_key_value_heads and intermediate_size, else
        :class:`bistat.engines.embedded.forward.TensorParallelSizeError` (a ``ValueError``) listing the
        valid values. The sharded weights take as much memory as unsharded ones
        (:func:`bistat.engines.embedded.forward.shard_weights`).

    In ``"invariant"`` mode every GEMM weight is packed for the kernel when the engine is made
    (:func:`bistat.engines.embedded.ops.packed_weight`: a copy, as many bytes again as the GEMM weights,
    kept while the weights live and shared by engines over the same prepared weights).
    """

    def __init__(self, model: Any, gemm: str = "blas", max_batch_size: int = 32,
                 max_model_len: int = 2048, *,
                 prefill_chunk: int = 256, max_num_batched_tokens: int | None = None,
                 prepared: Weights | None = None, tensor_parallel_size: int = 1) -> None:
        if gemm not in ops.GEMM_MODES:
            raise ValueError(f"gemm ({gemm!r}) must be one of 'blas' or 'invariant'")
        for name, value in (("max_batch_size", max_batch_size), ("max_model_len", max_model_len),
                            ("prefill_chunk", prefill_chunk)):
            if int(value) < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        self.tensor_parallel_size = check_tensor_parallel_size(tensor_parallel_size,
                                                               model_dims(model.config))
        self.gemm = gemm
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = int(max_model_len)
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.model_name = getattr(model, "name", None)
        tp = self.tensor_parallel_size
        if (prepared is not None and prepared.rope_cos.shape[0] >= self.max_model_len
                and prepared.tensor_parallel_size in (1, tp)):
            self.weights: Weights = shard_weights(prepared, tp)  # prepared itself when T matches
        else:
            self.weights = prepare_weights(model.config, model.weights, self.max_model_len, tp)
        if gemm == "invariant":  # pack every GEMM weight now, not in the first steps
            for w in gemm_weights(self.weights):
                ops.packed_weight(w)
        eos = getattr(model.config, "eos_token_id", None)
        if isinstance(model.config, dict):
            eos = model.config.get("eos_token_id")
        self.eos_token_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else eos))
        if max_num_batched_tokens is None:
            max_num_batched_tokens = self.max_batch_size + 2 * prefill_chunk
        self.scheduler = Scheduler(self.max_batch_size, int(max_num_batched_tokens), int(prefill_chunk))
        self.step_log: list[tuple[float, int]] = []
        self._incoming: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._generation_tokens_total = 0
        self._prompt_tokens_total = 0

    # ----------------------------------------------------------------------------- public API
    def start(self) -> None:
        """Start the loop thread (requests submitted before are taken in its first step)."""
        if self._thread is not None:
            raise RuntimeError("EmbeddedEngine.start(): already started")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="bistat-embedded-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; unfinished requests resolve with an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all("engine stopped before the request finished")

    def submit(self, request: GenerationRequest) -> "Future[GenerationResult]":
        """Queue a request; the future resolves with its result (``error`` set if it cannot run).

        Cancelling the future (``fut.cancel()``) withdraws the request: it leaves the batch
        before the next step and no more tokens are generated for it."""
        fut: Future[GenerationResult] = Future()
        t_submit = time.monotonic()
        try:
            seq = self._make_sequence(request, fut, t_submit)
        except ValueError as exc:
            fut.set_result(self._error_result(request, str(exc), t_submit))
            return fut
        with self._cv:
            self._incoming.append(seq)
            self._cv.notify_all()
        return fut

    def generate(self, requests: Seq[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion in the calling thread (engine not started).

        All requests are queued before the first step, so the batch compositions are
        deterministic: the first ``max_batch_size`` start together, the rest join as others leave.
        """
        if self._thread is not None:
            raise RuntimeError("EmbeddedEngine.generate(): the loop thread is running; use submit()")
        futures = [self.submit(r) for r in requests]
        while not all(f.done() for f in futures):
            if not self._step():
                raise RuntimeError("EmbeddedEngine.generate(): no progress with requests pending")
        return [f.result() for f in futures]

    def metrics(self) -> dict[str, float]:
        """vLLM-named counters: running / waiting requests, preemptions, token totals."""
        return {
            "num_requests_running": float(len(self.scheduler.running)),
            "num_requests_waiting": float(len(self.scheduler.waiting) + len(self._incoming)),
            "num_preemptions_total": 0.0,
            "generation_tokens_total": float(self._generation_tokens_total),
            "prompt_tokens_total": float(self._prompt_tokens_total),
            "num_steps_total": float(len(self.step_log)),
        }

    def encode_prompt(self, request: GenerationRequest) -> list[int]:
        """The prompt token ids of a request (chat template applied when ``chat`` is set)."""
        if request.chat:
            if not isinstance(request.prompt, str):
                raise ValueError(f"request {request.prompt_id}: chat=True needs a text prompt (the user message)")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}])
            return list(self.tokenizer.encode(text))
        if isinstance(request.prompt, str):
            return list(self.tokenizer.encode(request.prompt))
        return [int(t) for t in request.prompt]

    # ----------------------------------------------------------------------------- internals
    def _make_sequence(self, req: GenerationRequest, fut: Future, t_submit: float) -> Sequence:
        ids = self.encode_prompt(req)
        vocab = self.weights.dims.vocab_size
        if not ids:
            raise ValueError(f"request {req.prompt_id}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req.prompt_id}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.prompt_id}: max_tokens ({req.max_tokens}) must be at least 1")
        if len(ids) + req.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.prompt_id}: prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) "
                f"exceeds max_model_len={self.max_model_len}; lower max_tokens or raise max_model_len")
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            raise ValueError(f"request {req.prompt_id}: temperature must be >= 0 and top_p in (0, 1]")
        params = SamplingParams(float(req.temperature), float(req.top_p), int(req.top_k))
        rng = None if params.temperature <= 0 else np.random.default_rng(req.seed)
        d = self.weights.dims
        cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, self.max_model_len,
                        initial=len(ids) + min(req.max_tokens, 64))
        return Sequence(req, ids, int(req.max_tokens), params, rng, cache, fut, t_submit)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._incoming or self.scheduler.running
                           or self.scheduler.waiting):
                    self._cv.wait()
                if self._stopping:
                    return
            self._step()

    def _step(self) -> bool:
        with self._cv:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        if not plan:
            return False
        segments = [Segment(p.seq.cache, p.tokens, p.start, p.want_logits) for p in plan]
        try:
            logits = forward_step(self.weights, segments, self.gemm)  # [S_out, V]
            lse, _ = ops.log_softmax_rows(logits)  # [S_out]
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the loop
            for p in plan:
                self.scheduler.finish(p.seq)
                self._resolve(p.seq, error=f"engine step failed: {type(exc).__name__}: {exc}")
            return True
        now = time.monotonic()
        self.step_log.append((now, len(plan)))
        j = 0
        for p in plan:
            seq = p.seq
            if p.start < len(seq.prompt_ids):
                self._prompt_tokens_total += len(p.tokens)
            if not p.want_logits:
                continue
            row, row_lse = logits[j], lse[j]  # [V], scalar
            j += 1
            tok = select_token(row, seq.params, seq.rng)
            seq.output_ids.append(tok)
            seq.logprobs.append(float(row[tok] - row_lse))
            if seq.request.logprobs >= 1:
                seq.top_logprobs.append(top_logprobs(row, row_lse, int(seq.request.logprobs)))
            if seq.t_first_token is None:
                seq.t_first_token = now
            self._generation_tokens_total += 1
            if tok in self.eos_token_ids and not seq.request.ignore_eos:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self._resolve(seq)
        return True

    def _drop_cancelled(self) -> None:
        """Forget the requests whose future was cancelled (``Future.cancel()``: the client went
        away): they leave the batch before the next step, so no more tokens are computed for them."""
        gone = [s for s in self.scheduler.running if s.future.cancelled()]
        for seq in gone:
            self.scheduler.finish(seq)
        if any(s.future.cancelled() for s in self.scheduler.waiting):
            kept = [s for s in self.scheduler.waiting if not s.future.cancelled()]
            self.scheduler.waiting.clear()
            self.scheduler.waiting.extend(kept)

    def _resolve(self, seq: Sequence, error: str | None = None) -> None:
        ids = list(seq.output_ids)
        text_ids = ids[:-1] if seq.finish_reason == "stop" else ids
        text = ""
        if error is None:
            try:
                text = self.tokenizer.decode(text_ids)
            except Exception as exc:  # noqa: BLE001 - reported on the request
                error = f"detokenization failed: {type(exc).__name__}: {exc}"
        result = GenerationResult(
            prompt_id=seq.request.prompt_id, token_ids=ids, text=text,
            logprobs=list(seq.logprobs),
            top_logprobs=list(seq.top_logprobs) if seq.request.logprobs >= 1 else None,
            finish_reason=seq.finish_reason if error is None else None,
            n_prompt_tokens=len(seq.prompt_ids), t_submit=seq.t_submit,
            t_first_token=seq.t_first_token, t_done=time.monotonic(), error=error)
        if not seq.future.done():
            seq.future.set_result(result)

    def _error_result(self, req: GenerationRequest, error: str, t_submit: float) -> GenerationResult:
        return GenerationResult(prompt_id=req.prompt_id, token_ids=[], text="", logprobs=None,
                                top_logprobs=None, finish_reason=None, n_prompt_tokens=None,
                                t_submit=t_submit, t_first_token=None, t_done=time.monotonic(),
                                error=error)

    def _fail_all(self, error: str) -> None:
        with self._cv:
            pending = list(self._incoming)
            self._incoming.clear()
        pending += list(self.scheduler.waiting) + list(self.scheduler.running)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for seq in pending:
            self._resolve(seq, error=error)
