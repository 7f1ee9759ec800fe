"""Engine kind -> adapter class, imported lazily.

Adding an engine is one new module with a class implementing :class:`bistat.engines.base.Engine`
whose constructor takes ``(experiment, arm)`` and whose ``capabilities`` say what it can do, plus
one line in :data:`ADAPTERS` and :data:`ENGINE_KINDS` (or a call to :func:`register_adapter`).
The kinds a declaration accepts are :data:`ENGINE_KINDS`'s. Adapters are imported only when used:
``bistat --help`` never imports vLLM, and a kind whose optional dependencies are missing fails
with an error naming the extra to install.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from bistat.engines.base import NO_CAPABILITIES, Engine, EngineCapabilities, EngineStartError

__all__ = ["ADAPTERS", "ENGINE_KINDS", "adapter_class", "capabilities", "create_engine",
           "declaration_limits", "declaration_problems", "prompt_problems", "register_adapter"]

#: kind -> "module:Class" (imported on first use)
ADAPTERS: dict[str, str] = {
    "embedded": "bistat.engines.embedded.adapter:EmbeddedEngineAdapter",
    "openai": "bistat.engines.openai_http:OpenAIHTTPEngine",
    "vllm-server": "bistat.engines.vllm_server:VLLMServerEngine",
    "vllm-offline": "bistat.engines.vllm_offline:VLLMOfflineEngine",
    "sglang-server": "bistat.engines.sglang_server:SGLangServerEngine",
    "command-server": "bistat.engines.command_server:CommandServerEngine",
}

#: kind -> what it is, in words; the engine kinds a declaration accepts (``engine.kind``)
ENGINE_KINDS: dict[str, str] = {
    "embedded": "bistat's in-process numpy engine",
    "vllm-server": "vLLM started as `vllm serve` per arm, driven over HTTP",
    "vllm-offline": "vllm.LLM in a child process per arm",
    "openai": "any OpenAI-compatible server, started elsewhere",
    "sglang-server": "SGLang started as `python -m sglang.launch_server` per arm, driven over its native API",
    "command-server": "any OpenAI-compatible server started per arm from a command template",
}

_EXTRAS = {"vllm-server": "bistat[vllm]", "vllm-offline": "bistat[vllm]",
           "sglang-server": "bistat[sglang]"}


def register_adapter(kind: str, target: str, description: str | None = None) -> None:
    """Map ``kind`` to the adapter class ``"module:Class"`` and make it a valid ``engine.kind``."""
    module, sep, cls = target.partition(":")
    if not sep or not module or not cls:
        raise ValueError(f"adapter target {target!r} must read 'module:Class'")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", kind):
        raise ValueError(f"engine kind {kind!r} must match [a-z0-9][a-z0-9_-]*")
    ENGINE_KINDS[kind] = description or f"adapter {target}"
    ADAPTERS[kind] = target


def capabilities(kind: str) -> EngineCapabilities:
    """What engines of ``kind`` can do: their adapter's ``capabilities`` (none declared: none).

    A kind that is not registered here (a run recorded with an adapter this installation lacks),
    or whose adapter cannot be imported, has :data:`~bistat.engines.base.NO_CAPABILITIES`.
    """
    try:
        cls = adapter_class(kind)
    except (ValueError, EngineStartError):
        return NO_CAPABILITIES
    return getattr(cls, "capabilities", NO_CAPABILITIES)


def declaration_problems(experiment: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for what the adapter of ``experiment.engine.kind`` can tell is wrong
    with the declaration before any run (its ``declaration_problems`` classmethod: argument names
    against its schema, argument values, the model); none when the adapter checks nothing or
    cannot be imported here (the run then reports it)."""
    try:
        cls = adapter_class(experiment.engine.kind)
    except (ValueError, EngineStartError):
        return []
    check = getattr(cls, "declaration_problems", None)
    return list(check(experiment)) if callable(check) else []


def prompt_problems(experiment: Any, prompts: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for what the adapter of ``experiment.engine.kind`` would refuse of the
    requests built from ``prompts`` (the workload's prompts; empty when they could not be read):
    a prompt and ``max_tokens`` over a context length the declaration or the model fixes (its
    ``prompt_problems`` classmethod); none when the adapter checks nothing."""
    try:
        cls = adapter_class(experiment.engine.kind)
    except (ValueError, EngineStartError):
        return []
    check = getattr(cls, "prompt_problems", None)
    return list(check(experiment, list(prompts))) if callable(check) else []


def declaration_limits(experiment: Any) -> list[str]:
    """What the adapter of ``experiment.engine.kind`` cannot check before its engine runs, in
    words (its ``declaration_limits`` classmethod), for the design report; a kind whose adapter
    cannot be imported here says that."""
    try:
        cls = adapter_class(experiment.engine.kind)
    except (ValueError, EngineStartError) as exc:
        return [f"engine {experiment.engine.kind!r}: its adapter cannot be imported here ({exc}), "
                "so none of its arguments could be checked"]
    limits = getattr(cls, "declaration_limits", None)
    return list(limits(experiment)) if callable(limits) else []


def adapter_class(kind: str) -> type:
    """The adapter class of an engine kind (imported now).

    Raises
    ------
    ValueError
        unknown kind.
    EngineStartError
        the adapter's module cannot be imported (a missing optional dependency), naming the extra.
    """
    try:
        target = ADAPTERS[kind]
    except KeyError:
        expected = ", ".join(repr(k) for k in ADAPTERS)
        raise ValueError(f"engine.kind: unknown engine {kind!r}; expected one of {expected}") from None
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(kind)
        hint = f"; install it with: pip install '{extra}'" if extra else ""
        raise EngineStartError(f"engine {kind!r}: cannot import {module_name} ({exc}){hint}") from exc
    try:
        return getattr(module, cls_name)
    except AttributeError as exc:
        raise EngineStartError(f"engine {kind!r}: {module_name} has no class {cls_name}") from exc


def create_engine(experiment: Any, arm: Any) -> Engine:
    """A new (not yet started) engine for one arm of an experiment.

    ``experiment`` and ``arm`` are a :class:`bistat.declare.experiment.Experiment` and one of its
    arms; the engines read them (``engine.args``, ``arm_args``) without importing the declaration
    module, which sits above them.

    The adapter is built with ``cls.from_experiment(experiment, arm)`` when the class defines
    that constructor (adapters whose ``__init__`` takes engine-level parameters), otherwise with
    ``cls(experiment, arm)``.
    """
    cls = adapter_class(experiment.engine.kind)
    build = getattr(cls, "from_experiment", None)
    engine: Any = build(experiment, arm) if callable(build) else cls(experiment, arm)
    return engine
