"""The lines a pass writes into the run directory (``docs/CONTRACTS.md``): each response as it
arrives (:func:`_response_record`; a request the engine never answered, :func:`_missing_record`),
each engine metrics sample (:func:`_metrics_record`) and the pass's ``start`` and ``end`` lines of
``schedule.jsonl`` (:func:`_schedule_record`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bistat.core.schedule import PlannedPass
from bistat.engines.base import GenerationRequest, GenerationResult, MetricsSample
from bistat.store.format import logprob_sha256, token_sha256, utc_now


def _finite_or_none(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _response_record(
    planned: PlannedPass, prompt_index: int, result: GenerationResult
) -> dict[str, Any]:
    ok = result.error is None
    logprobs = result.logprobs
    return {
        "arm": planned.arm,
        "seq": planned.seq,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "prompt_id": result.prompt_id,
        "prompt_index": prompt_index,
        "token_ids": [int(t) for t in result.token_ids],
        "text": result.text,
        # JSON has no -inf/NaN: such a logprob is written as null; the hash keeps its bits.
        "logprobs": None if logprobs is None else [_finite_or_none(float(x)) for x in logprobs],
        "top_logprobs": None
        if result.top_logprobs is None
        else [[[int(t), _finite_or_none(float(lp))] for t, lp in pos] for pos in result.top_logprobs],
        "finish_reason": result.finish_reason,
        "n_prompt_tokens": result.n_prompt_tokens,
        "t_submit": result.t_submit,
        "t_first_token": result.t_first_token,
        "t_done": result.t_done,
        "error": result.error,
        "attempts": result.attempts,
        "rate_limited": result.rate_limited,
        "retry_wait_s": result.retry_wait_s,
        "preemptions": result.preemptions,
        "token_sha256": token_sha256(result.token_ids) if ok else None,
        "logprob_sha256": logprob_sha256(logprobs) if ok else None,
    }


def _missing_record(planned: PlannedPass, prompt_index: int, request: GenerationRequest) -> dict[str, Any]:
    """A request the engine never answered (a protocol violation): recorded as failed."""
    return {
        "arm": planned.arm,
        "seq": planned.seq,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "prompt_id": request.prompt_id,
        "prompt_index": prompt_index,
        "token_ids": [],
        "text": "",
        "logprobs": None,
        "top_logprobs": None,
        "finish_reason": None,
        "n_prompt_tokens": None,
        "t_submit": None,
        "t_first_token": None,
        "t_done": None,
        "error": "engine returned no result",
        "attempts": 0,
        "rate_limited": 0,
        "retry_wait_s": 0.0,
        "preemptions": None,
        "token_sha256": None,
        "logprob_sha256": None,
    }


def _metrics_record(planned: PlannedPass, sample: MetricsSample) -> dict[str, Any]:
    record: dict[str, Any] = {"arm": planned.arm, "seq": planned.seq}
    for key, value in dataclasses.asdict(sample).items():
        record[key] = _finite_or_none(value) if isinstance(value, float) else value
    return record


def _schedule_record(planned: PlannedPass, event: str, **extra: Any) -> dict[str, Any]:
    return {
        "event": event,
        "seq": planned.seq,
        "arm": planned.arm,
        "pass_index": planned.pass_index,
        "kind": planned.kind,
        "block": planned.block,
        "time_utc": utc_now(),
        **extra,
    }
