"""The engine protocol: what every inference engine bistat drives must provide.

One small ``typing.Protocol`` (after simonw/llm's ``Model.execute``) and one record type. Engines
are adapters; the runner never special-cases one. See docs/CONTRACTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


class EngineError(Exception):
    """Base class of engine failures that make a run *untested* rather than crash it."""


class EngineRefused(EngineError):
    """The engine refused the requested setting (e.g. a mode it does not support)."""


class EngineStartError(EngineError):
    """The engine failed to start or never became healthy."""


class EngineUnsupported(EngineRefused):
    """The engine (or server) does not offer an optional capability, e.g. prompt logprobs."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_id: str
    prompt: str | list[int]  # text (raw, or a user message when chat=True) or token ids
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (vLLM convention)
    seed: int | None = None
    logprobs: int = 1  # alternatives per position; the chosen token's logprob is always returned
    ignore_eos: bool = False
    chat: bool = False  # prompt is a user message: the engine applies its chat template


@dataclass(frozen=True)
class GenerationResult:
    prompt_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    n_prompt_tokens: int | None
    t_submit: float
    t_first_token: float | None
    t_done: float
    error: str | None = None
    attempts: int = 1


@dataclass(frozen=True)
class MetricsSample:
    """One engine metrics sample (about once a second), or one engine step.

    A *step sample* sets ``step_batch_size`` (the requests computed together in that engine
    step: exact batching evidence, which the embedded engine records) and leaves the counters
    NaN (written as null), so per-second batching summaries ignore it; ``t`` is then the time
    the step finished, on the pass clock.
    """

    t: float
    num_requests_running: float
    num_requests_waiting: float
    num_preemptions_total: float
    generation_tokens_total: float
    prompt_tokens_total: float
    source: str
    step_batch_size: float | None = None


@dataclass(frozen=True)
class EngineInfo:
    kind: str
    version: str
    commit: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log_findings: tuple[str, ...] = ()
    #: the execution mode vLLM configured (``bistat.enginelog.EngineModes.to_dict``); empty when
    #: the engine has none to tell
    modes: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    kind: str

    def start(self) -> EngineInfo: ...

    def run_pass(
        self,
        requests: Sequence[GenerationRequest],
        *,
        concurrency: int,
        on_result: Callable[[GenerationResult], None],
        on_metrics: Callable[[MetricsSample], None],
    ) -> None: ...

    def fingerprint(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...
