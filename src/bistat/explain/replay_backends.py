"""How ``bistat replay`` drives an engine: the embedded engine through its ``generate`` (every
request queued before the first step, so batch compositions, hence outputs, are deterministic and
a repro pack reproduces bit for bit), any other through the :class:`~bistat.engines.base.Engine`
protocol (``run_pass`` with every request in flight); and the error a replay cannot go on from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from bistat.engines.base import (Engine, EngineUnsupported, GenerationRequest, GenerationResult,
                                 MetricsSample)
from bistat.engines.registry import capabilities


class ReplayError(Exception):
    """A replay cannot be made: unknown prompt, missing registration, unreadable pack."""


class _Backend(Protocol):
    prefix_cache: bool | None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]: ...

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str: ...

    def stop(self) -> None: ...


class _EmbeddedBackend:
    """The embedded engine, not started: ``generate`` runs steps in this thread, deterministically."""

    prefix_cache = None  # no prefix cache at all

    def __init__(self, model_name: str, args: Mapping[str, Any]) -> None:
        from bistat.engines.embedded.engine import EmbeddedEngine
        from bistat.engines.embedded.adapter import ENGINE_ARGS
        from bistat.model import load_model

        unknown = sorted(set(args) - set(ENGINE_ARGS))
        if unknown:
            raise ReplayError(f"embedded engine: unknown argument(s) {unknown}; expected some of "
                              f"{list(ENGINE_ARGS)}")
        self.model = load_model(model_name)
        self.engine = EmbeddedEngine(self.model, **dict(args))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return self.engine.generate(list(requests))

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str:
        from bistat.engines.embedded import ops
        from bistat.engines.embedded.forward import Segment, forward_step
        from bistat.engines.embedded.kvcache import KVCache

        eng = self.engine
        prompt = eng.encode_prompt(request)
        d = eng.weights.dims
        out: list[float] = []
        for j in range(min(upto, len(tokens))):
            ids = list(prompt) + [int(t) for t in tokens[:j]]
            cache = KVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                            eng.max_model_len, initial=len(ids))
            logits = forward_step(eng.weights, [Segment(cache, ids, 0, True)],
                                  eng.gemm)  # [1, V]
            lse, _ = ops.log_softmax_rows(logits)  # [1]
            out.append(float(logits[0, int(tokens[j])] - lse[0]))
        return out

    def stop(self) -> None:
        return None


class _EngineBackend:
    """Any engine through the ``Engine`` protocol (all requests in flight at once)."""

    def __init__(self, engine: Engine, prefix_cache: bool | None) -> None:
        self.engine = engine
        self.prefix_cache = prefix_cache
        engine.start()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        got: dict[str, GenerationResult] = {}

        def on_result(r: GenerationResult) -> None:
            got[r.prompt_id] = r

        def on_metrics(_: MetricsSample) -> None:
            return None

        self.engine.run_pass(list(requests), concurrency=len(requests), on_result=on_result,
                             on_metrics=on_metrics)
        missing = [r.prompt_id for r in requests if r.prompt_id not in got]
        if missing:
            raise ReplayError(f"the engine returned no result for {missing[:3]}")
        return [got[r.prompt_id] for r in requests]

    def prefill_logprobs(self, request: GenerationRequest, tokens: Sequence[int],
                         upto: int) -> list[float] | str:
        fn = getattr(self.engine, "prompt_logprobs", None)
        if not callable(fn):  # adapters that wrap an HTTP client (vllm-server) expose it there
            fn = getattr(getattr(self.engine, "client", None), "prompt_logprobs", None)
        if not callable(fn):
            return (f"unsupported: engine kind {getattr(self.engine, 'kind', '?')!r} returns no "
                    "prompt logprobs through the Engine protocol (needs a prompt_logprobs method, "
                    "e.g. vLLM's prompt_logprobs request field)")
        try:
            return [float(x) for x in fn(request, list(tokens[:upto]))]
        except EngineUnsupported as exc:
            return f"unsupported: {exc}"

    def stop(self) -> None:
        self.engine.stop()


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.lower() in ("1", "true", "yes", "on"))


def _backend(declaration: Mapping[str, Any], arm: str,
             engine_factory: Callable[[Any, Any], Engine] | None) -> _Backend:
    from bistat.declare.experiment import validate_experiment

    exp = validate_experiment(dict(declaration), source="registration declaration")
    arm_obj = next(a for a in exp.arms if a.name == arm)
    args = exp.arm_args(arm_obj)
    if capabilities(exp.engine.kind).in_process_replay and engine_factory is None:
        if arm_obj.env:
            raise ReplayError(f"arms[{arm}].env: the embedded engine cannot apply environment "
                              "variables")
        return _EmbeddedBackend(str(exp.engine.model), args)
    if engine_factory is None:
        from bistat.engines.registry import create_engine

        engine_factory = create_engine
    pc = any(_truthy(v) for k, v in args.items()
             if k.replace("-", "_").lstrip("_") == "enable_prefix_caching")
    return _EngineBackend(engine_factory(exp, arm_obj), pc)
