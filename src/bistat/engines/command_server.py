"""Engine adapter: any OpenAI-compatible server, started per arm from a command template.

For servers bistat has no adapter of their own for (TensorRT-LLM's ``trtllm-serve``, llama.cpp's
``llama-server``, a user's own build, ``bistat serve``): each arm's server is started from
``command`` (a string, split like a shell would, or a list), with ``{port}``, ``{host}`` and
``{model}`` filled in and any further ``{name}`` from the arm's (or the engine's) ``args``, in its
own process group with the arm's environment on a free loopback port
(:class:`~bistat.engines.server_process.LocalServerEngine`). It is ready when ``GET ready_path``
answers 200 (default ``/v1/models``, which every OpenAI-compatible server has); then it is driven
exactly as the ``openai`` kind drives a server started elsewhere
(:class:`~bistat.engines.openai_http.OpenAIHTTPEngine`: ``/v1/completions`` and
``/v1/chat/completions``, token ids from vLLM's ``return_token_ids`` fields or ``token_id:N``
tokens, ``/metrics`` with vLLM's names where the server has them). Stopped with SIGTERM to its
group, SIGKILL after ``stop_grace_s``; its log is kept.

A declaration::

    [engine]
    kind = "command-server"
    model = "smollm2-135m"          # {model}, and the model name the server must serve
    args = { command = "bistat serve --port {port} --model {model} --gemm {gemm}" }

    [[arms]]
    name = "blas"
    args = { gemm = "blas" }
"""

from __future__ import annotations

import os
import shlex
import signal
import string
from typing import Any, Mapping, Sequence

from bistat.engines.base import EngineCapabilities, EngineInfo, EngineStartError, GenerationRequest
from bistat.engines.openai_http import OpenAIHTTPEngine, workload_conflicts
from bistat.engines.server_process import (
    FORCED_ENV,
    LocalServerEngine,
    inherited_env,
)

__all__ = ["CommandServerEngine", "template_fields"]

#: the placeholders bistat fills in itself
BUILTIN_FIELDS = ("port", "host", "model")


def _tokens(command: str | Sequence[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def template_fields(command: str | Sequence[str]) -> list[str]:
    """The ``{name}`` placeholders of a command template, in order of first use.

    >>> template_fields("serve --port {port} --gemm {gemm} --model {model}")
    ['port', 'gemm', 'model']

    Raises
    ------
    ValueError
        A placeholder that is not a plain name (``{0}``, ``{a.b}``, ``{x!r}``) or a lone brace.
    """
    names: dict[str, None] = {}
    for token in _tokens(command):
        for _, name, spec, conversion in string.Formatter().parse(token):
            if name is None:
                continue
            if not name.isidentifier() or spec or conversion:
                raise ValueError(f"placeholder {{{name}}} in {token!r} is not a plain name; "
                                 "write {port}, {model} or {name_of_an_arg}")
            names.setdefault(name)
    return list(names)


class CommandServerEngine(LocalServerEngine):
    """Start one arm's server from a command template and drive it over the OpenAI API.

    Parameters
    ----------
    model : str
        The model name the server serves (checked at ``/v1/models``) and ``{model}``.
    command : str or sequence of str
        The command template (module docstring).
    values : mapping
        The further ``{name}`` values (the arm's ``args`` over the engine's).
    env : mapping
        The arm's environment variables, on top of this process's environment.
    ready_path : str
        Answers 200 once the server serves requests.
    health_timeout_s, stop_grace_s, log_path
        As for the other server adapters.
    http : dict
        Keyword arguments for :class:`OpenAIHTTPEngine` (retries, request_timeout_s, api_key, ...).
    """

    kind = "command-server"
    capabilities = EngineCapabilities(local_gpu=True, engine_log=True, prompt_logprobs=True,
                                      prefix_cache_reset=True, declared_server=True)
    engine_name = "command-started"
    install_hint = "check engine.args.command (the program must be on PATH or a full path)"
    stop_signal = signal.SIGTERM
    log_prefix = "bistat-command-"

    #: declaration keys that configure bistat's handling rather than fill the template
    ADAPTER_KEYS = ("command", "ready_path", "health_timeout_s", "stop_grace_s", "log_path")
    HTTP_KEYS = LocalServerEngine.HTTP_KEYS + ("api_key_env",)

    def __init__(self, model: str, *, command: str | Sequence[str],
                 values: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 ready_path: str = "/v1/models", host: str = "127.0.0.1", port: int | None = None,
                 health_timeout_s: float = 600.0, stop_grace_s: float = 30.0,
                 log_path: str | os.PathLike | None = None,
                 http: Mapping[str, Any] | None = None) -> None:
        self._init_server(model, env=env, http=http, host=host, port=port,
                          health_timeout_s=health_timeout_s, stop_grace_s=stop_grace_s,
                          log_path=log_path)
        self.command = command if isinstance(command, str) else list(command)
        self.values = {str(k): v for k, v in (values or {}).items()}
        self.ready_path = ready_path
        self.client: OpenAIHTTPEngine | None = None
        self._served: EngineInfo | None = None

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """For each arm: a command template, every placeholder of it filled, and every further
        argument used by it (an argument no placeholder takes would be silently ignored)."""
        problems: list[tuple[str, str]] = []
        engine_args = dict(experiment.engine.args)
        for i, arm in enumerate(experiment.arms):
            args = {**engine_args, **dict(arm.args)}
            where = f"arms[{i}].args" if "command" in arm.args else "engine.args"
            if "command" not in args:
                problems.append(("engine.args.command", "engine 'command-server' needs the "
                                 "server's command template, e.g. command = \"bistat serve "
                                 "--port {port} --model {model}\""))
                break
            try:
                fields = template_fields(args["command"])
            except ValueError as exc:
                problems.append((f"{where}.command", str(exc)))
                continue
            if "port" not in fields:
                problems.append((f"{where}.command", "the command has no {port} placeholder: "
                                 "bistat starts each arm's server on a free loopback port it "
                                 "chooses and connects there; write --port {port} (or what the "
                                 "server's own option is) in the command"))
            ready = args.get("ready_path", "/v1/models")
            if not (isinstance(ready, str) and ready.startswith("/")):
                field = (f"arms[{i}].args.ready_path" if "ready_path" in arm.args
                         else "engine.args.ready_path")
                problems.append((field, f"{ready!r} is not a path on the server; write e.g. "
                                 "ready_path = \"/v1/models\" (the default) or \"/health\""))
            values = set(args) - set(cls.ADAPTER_KEYS) - set(cls.HTTP_KEYS)
            for name in fields:
                if name not in BUILTIN_FIELDS and name not in values:
                    problems.append((f"{where}.command", f"placeholder {{{name}}} has no value "
                                     f"for arm {arm.name!r}; set args.{name} in the arm or in "
                                     "engine.args"))
            for name in sorted(values - set(fields)):
                field = f"arms[{i}].args.{name}" if name in arm.args else f"engine.args.{name}"
                problems.append((field, f"{name!r} is not a placeholder of the command template "
                                 f"(nor one of bistat's own keys "
                                 f"{list(cls.ADAPTER_KEYS + cls.HTTP_KEYS)}); write "
                                 f"{{{name}}} in the command or remove it"))
        from bistat.engines.declared import number_problems

        return (list(dict.fromkeys(problems))
                + number_problems(experiment, cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                + workload_conflicts(experiment, cls.kind))

    @classmethod
    def declaration_limits(cls, experiment: Any) -> list[str]:
        """What registration cannot check for servers started from a command."""
        return [f"engine {cls.kind!r}: that the command starts a server serving the model, and "
                "workload.max_tokens against its context length: each arm's server tells them "
                "only when it answers (at the run's start, /v1/models); a pass in which every "
                "request fails stops the run"]

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "CommandServerEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``; the adapter's own
        keys are taken out, the rest fill the template; ``api_key_env`` names the environment
        variable holding the server's key (a key never sits in a declaration)."""
        args, own, http = cls.split_args(experiment, arm)
        key_env = http.pop("api_key_env", None)
        if key_env:
            http["api_key"] = os.environ.get(key_env)
        if "command" not in own:
            raise ValueError("engine.args.command: engine 'command-server' needs the server's "
                             "command template")
        return cls(experiment.engine.model, values=args, env=dict(arm.env), http=http, **own)

    # -- pieces ----------------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """Ours (less ``NOT_INHERITED_ENV``), the arm's, then NVLink multicast off."""
        return {**inherited_env(), **self.arm_env, **FORCED_ENV}

    def argv(self, port: int) -> list[str]:
        """The command template with its placeholders filled."""
        values = {**{k: str(v) for k, v in self.values.items()}, "port": str(port),
                  "host": self.host, "model": self.model}
        try:
            return [token.format(**values) for token in _tokens(self.command)]
        except KeyError as exc:
            raise EngineStartError(f"engine.args.command: placeholder {{{exc.args[0]}}} has no "
                                   "value; set it in the arm's args") from exc

    def _connect(self, base: str) -> OpenAIHTTPEngine:
        client = OpenAIHTTPEngine(base, model=self.model, kind=self.kind, **self.http_kwargs)
        self._served = client.start()
        return client

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> EngineInfo:
        """Start the server, wait on ``ready_path``, check that it serves the model."""
        argv, _ = self._start_server()
        assert self._served is not None
        self.info = EngineInfo(
            kind=self.kind, version=self._served.version,
            args={"argv": argv, "model": self.model, "command": self.command,
                  "ready_path": self.ready_path, **self.values, "log_path": str(self.log_path),
                  "server_reported": self._served.args.get("server_reported")},
            env={**self.arm_env, **FORCED_ENV})
        return self.info

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        """Prefill logprobs of ``continuation`` where the server has vLLM's ``prompt_logprobs``."""
        if self.client is None:
            raise EngineStartError("command-server: prompt_logprobs() before start()")
        return self.client.prompt_logprobs(request, continuation)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``POST /reset_prefix_cache`` where the server has it; False otherwise."""
        if self.client is None:
            raise EngineStartError("command-server: reset_prefix_cache() before start()")
        return self.client.reset_prefix_cache()

    def fingerprint(self) -> dict[str, Any]:
        """The engine's own details; the runner adds the machine's."""
        return {"kind": self.kind, "model": self.model,
                "version": self.info.version if self.info else None,
                "argv": list(self.info.args["argv"]) if self.info else None,
                "url": self.client.base_url if self.client else None}
