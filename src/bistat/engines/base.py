"""The engine protocol: what every inference engine bistat drives must provide.

One small ``typing.Protocol`` (after simonw/llm's ``Model.execute``) and one record type. Engines
are adapters; the runner never special-cases one. See docs/CONTRACTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence, runtime_checkable


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
    rate_limited: int = 0      # attempts answered 429 (HTTP engines)
    retry_wait_s: float = 0.0  # seconds waited between attempts (inside t_submit..t_done)
    # times the engine preempted the request and ran it again (SGLang's retractions, from its
    # answer's meta_info.num_retractions); None where the engine does not say per request
    preemptions: int | None = None


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
    #: the execution mode vLLM configured (``bistat.store.enginelog.EngineModes.to_dict``); empty when
    #: the engine has none to tell
    modes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine kind can do, declared once on its adapter class (``capabilities``).

    Code above the engines asks these fields (through
    :func:`bistat.engines.registry.capabilities`) instead of comparing kind names.
    """

    #: it starts its engines on this machine's GPU: the run checks that the GPU is free first
    local_gpu: bool = False
    #: the GPU memory fraction an arm's engine takes when it declares no ``gpu_memory_utilization``
    #: (0: it holds no GPU memory, e.g. the embedded engine on the CPU, an attached server)
    default_memory_fraction: float = 0.0
    #: the engine argument that sets that fraction (vLLM's ``gpu_memory_utilization``, SGLang's
    #: ``mem_fraction_static``)
    memory_fraction_arg: str = "gpu_memory_utilization"
    #: the arms' engines may start at the same time. vLLM sizes its KV cache by profiling the GPU
    #: memory free at start-up, so two vLLM engines starting together on one GPU each count the
    #: other's allocations and fail ("No available memory for the cache blocks"); SGLang sizes its
    #: static memory from the memory free at its start, and servers started beside others were
    #: refused ("Loaded weights leave no GPU memory for the KV cache") on an H100 at settings
    #: that started alone.
    parallel_start: bool = False
    #: requests pass through an HTTP front end in the engine's process (vllm-offline has none)
    front_end: bool = True
    #: it can score a given continuation (:class:`PromptLogprobs`)
    prompt_logprobs: bool = False
    #: it can empty its prefix cache on request (:class:`PrefixCacheReset`)
    prefix_cache_reset: bool = False
    #: its arms may name a GEMM mode (``gemm``: the embedded engine's ``blas`` or ``invariant``)
    gemm_modes: bool = False
    #: it keeps the engine's log lines at every start (``environment.jsonl`` ``log_findings``), so
    #: a rule can evaluate ``engine_log`` on it
    engine_log: bool = False
    #: it recomputes every prompt from scratch (no prefix cache to share across requests)
    recomputes_prompts: bool = False
    #: its forward pass runs in bistat's process, so ``bistat replay`` steps it token by token
    in_process_replay: bool = False
    #: it drives any OpenAI-compatible server, which bistat knows only by what the server
    #: declares (``GET /version``, ``/v1/models``: ``server_reported`` in its start's
    #: ``engine.args``): the finding names that server, not the client
    declared_server: bool = False


#: the capabilities of a kind whose adapter declares none
NO_CAPABILITIES = EngineCapabilities()


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


# Optional abilities: an engine offers one by having the method (checked with ``isinstance``).


@runtime_checkable
class PromptLogprobs(Protocol):
    """Scores ``continuation`` after the request's prompt in one prefill: its logprobs."""

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]
                        ) -> list[float]: ...


@runtime_checkable
class PrefixCacheReset(Protocol):
    """Empties the engine's prefix cache; False when the server refused."""

    def reset_prefix_cache(self) -> bool: ...


@runtime_checkable
class PrefixCaching(Protocol):
    """Runs with a prefix cache that can be on or off (``enable_prefix_caching``)."""

    enable_prefix_caching: bool


@runtime_checkable
class EveryStepMetrics(Protocol):
    """Can sample its metrics after every engine step while the context is open."""

    def every_step_metrics(self) -> ContextManager[None]: ...


@runtime_checkable
class ServerProcesses(Protocol):
    """Starts processes of its own (a server per arm) and reports each one as it starts and
    once it is stopped, so that the runner records them in the run directory and a resume finds
    one that a killed run left up (:mod:`bistat.engines.lifetime`)."""

    def report_processes(self, report: Callable[[Mapping[str, Any]], None]) -> None: ...
