"""Continuous batching: which requests run in the next step, and with how many tokens each.

The policy is vLLM's (v1 scheduler, chunked prefill on), simplified:

1. every running request that is decoding gets one row;
2. then, first come first served, running requests still in their prompt, then waiting requests
   (admitted while fewer than ``max_batch_size`` run), get their next prompt chunk, as long as
   the step's token budget (``max_num_batched_tokens``) holds it.

Prompt chunk boundaries are fixed by the request alone: chunk ``j`` covers prompt positions
``[j * prefill_chunk, (j + 1) * prefill_chunk)``. A chunk is scheduled whole or not at all, so the
queries that attend together (and so the attention shapes) never depend on the other requests —
which the invariant GEMM mode needs. Requests leave the running set when they finish. Nothing is
ever preempted (the KV cache grows per request), so ``num_preemptions_total`` stays 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bistat.engines.embedded.kvcache import KVCache
from bistat.engines.embedded.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    """The state of one request inside the engine."""

    request: Any  # bistat.engines.base.GenerationRequest
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    rng: np.random.Generator | None
    cache: KVCache
    future: Any
    t_submit: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    t_first_token: float | None = None
    finish_reason: str | None = None

    @property
    def num_computed(self) -> int:
        return self.cache.length

    @property
    def in_prefill(self) -> bool:
        return self.cache.length < len(self.prompt_ids)

    def next_chunk(self, prefill_chunk: int) -> tuple[list[int], int, bool]:
        """(tokens, start position, wants logits) of this request's next rows."""
        start = self.cache.length
        if start < len(self.prompt_ids):
            end = min(len(self.prompt_ids), (start // prefill_chunk + 1) * prefill_chunk)
            return self.prompt_ids[start:end], start, end == len(self.prompt_ids)
        return [self.output_ids[-1]], start, True


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    tokens: list[int]
    start: int
    want_logits: bool


class Scheduler:
    """Waiting queue, running set, and the per-step plan."""

    def __init__(self, max_batch_size: int, max_num_batched_tokens: int, prefill_chunk: int) -> None:
        if max_num_batched_tokens < max_batch_size + prefill_chunk:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be at least "
                f"max_batch_size + prefill_chunk = {max_batch_size + prefill_chunk}, "
                "so a prompt chunk always fits next to a full batch of decode rows")
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.last_plan: list[Scheduled] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Scheduled]:
        """The next step's rows (and admit waiting requests into the running set)."""
        self.last_plan = self._schedule()
        return self.last_plan

    def _schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        plan: list[Scheduled] = []
        for seq in self.running:
            if not seq.in_prefill:
                tokens, start, want = seq.next_chunk(self.prefill_chunk)
                plan.append(Scheduled(seq, tokens, start, want))
                budget -= 1
        for seq in self.running:
            if seq.in_prefill:
                tokens, start, want = seq.next_chunk(self.prefill_chunk)
                if len(tokens) > budget:
                    return plan
                plan.append(Scheduled(seq, tokens, start, want))
                budget -= len(tokens)
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            tokens, start, want = seq.next_chunk(self.prefill_chunk)
            if len(tokens) > budget:
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append(Scheduled(seq, tokens, start, want))
            budget -= len(tokens)
        return plan

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
