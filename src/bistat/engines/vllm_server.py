"""Engine adapter: ``vllm serve`` started per arm (or attached by URL), driven over HTTP.

Start-up: the server runs in its own process group with the arm's environment on a free loopback
port, with ``--no-enable-prefix-caching`` unless the declaration turns prefix caching on, and
NVLink multicast forced off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``). bistat waits for ``GET /health`` up to a timeout, keeps the server's
log in a file and scans it for batch-invariance and attention-backend lines. A server that exits
before it is healthy is *refused* (``EngineRefused``) when what stopped it, its log's root-cause
error line or argparse's error line, says the setting is not supported (a warning never makes a
refusal), otherwise a start failure (``EngineStartError``) naming that root-cause line; both
make the arm *untested*.

A server that dies during a pass (its process exits: vLLM's API server shuts down when its
engine core dies, e.g. of ``torch.OutOfMemoryError``) or no longer answers ``/health`` after a pass
with failed requests is an engine failure: ``run_pass`` raises
:class:`~bistat.engines.base.EngineError` naming the exit code, the root-cause error line of the
log (:func:`last_error_line`) and the log's path, so the runner ends the pass *interrupted*. The
failed requests of a live, healthy server (an HTTP 4xx, or a 500 for one request) stay per-request
failures.

Shutdown: SIGINT to the whole process group, then SIGKILL after a grace period, then wait until
no process of the group is left (so GPU memory is released) — also on errors, on Ctrl-C and at
interpreter exit. The process lifecycle is :class:`~bistat.engines.server_process.LocalServerEngine`'s,
shared with the SGLang and command adapters.

vLLM itself is never imported here: its version and commit come from ``python -c`` run in the
arm's environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Mapping, Sequence

from bistat.engines.base import (
    EngineCapabilities,
    EngineInfo,
    EngineStartError,
    GenerationRequest,
)
from bistat.engines.declared import DeclaredContext
from bistat.engines.openai_http import OpenAIHTTPEngine, workload_conflicts
from bistat.engines.server_process import (  # noqa: F401 - re-exported: the vLLM adapters' names
    ERROR_LINE_MAX,
    ERROR_LINE_RE,
    FORCED_ENV,
    NOT_INHERITED_ENV,
    REFUSAL_RE,
    WRAPPER_ERROR_RE,
    LocalServerEngine,
    cli_args,
    gone_error,
    inherited_env,
    last_error_line,
    read_log,
)
from bistat.engines.server_process import free_port as _free_port  # noqa: F401
from bistat.engines.server_process import group_pids as _group_pids  # noqa: F401
from bistat.engines.vllm_args import arg_problems

#: Defaults a declaration may override.
DEFAULT_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

#: Server-log lines worth keeping as evidence (batch invariance, attention backend, JIT).
LOG_FINDING_RE = re.compile(
    r"batch[ _-]?invariant|VLLM_BATCH_INVARIANT|attention backend|attn[ _]backend|"
    r"Using \w+ backend|FLASH_ATTN|FLASHINFER|FlashAttention|TRITON_ATTN|JIT-compiled|"
    r"Breakable CUDA graph|preferred_blas_library",
    re.IGNORECASE)

#: vLLM's version and git commit, printed as JSON by the arm's Python. The commit lives in
#: ``vllm._version.__commit_id__`` (vcs-versioning; 'gdd10e03f9' for 0.25.0), older builds had
#: ``vllm.__commit__``.
VERSION_PROBE = ("import json, vllm\n"
                 "try:\n    from vllm._version import __commit_id__ as c\n"
                 "except ImportError:\n    c = getattr(vllm, '__commit__', None)\n"
                 "print(json.dumps({'version': vllm.__version__, 'commit': c}))")


class VLLMServerEngine(DeclaredContext, LocalServerEngine):
    """Start ``vllm serve MODEL`` for one arm (or attach to ``url``) and drive it over HTTP.

    Parameters
    ----------
    model : str
        Model path or Hugging Face id given to ``vllm serve`` (and the served model name).
    args : mapping
        Extra ``vllm serve`` arguments (``cli_args`` turns them into flags).
    env : mapping
        The arm's environment variables, on top of this process's environment.
    url : str or None
        Attach to this already-running server instead of starting one.
    command : sequence of str
        The server command before the model: ``("vllm", "serve")`` by default; tests point it at
        a script that starts ``bistat serve``.
    python : str
        Interpreter of the arm's environment, used for the version probe.
    enable_prefix_caching : bool
        Off unless the declaration turns it on (prefix caching can make logprobs order-dependent).
    tensor_parallel_size : int or None
        ``--tensor-parallel-size``.
    health_timeout_s : float
        Longest wait for ``/health`` (vLLM compiles at start: minutes).
    stop_grace_s : float
        Wait after SIGINT before SIGKILL.
    log_path : path or None
        Where the server's output goes (a temporary file by default); kept after ``stop``.
    http : dict
        Keyword arguments for ``OpenAIHTTPEngine`` (retries, backoff_s, request_timeout_s, ...).
    """

    kind = "vllm-server"
    capabilities = EngineCapabilities(local_gpu=True, default_memory_fraction=0.9, engine_log=True,
                                      prompt_logprobs=True, prefix_cache_reset=True)
    engine_name = "vLLM"
    install_hint = "install vLLM (pip install 'bistat[vllm]') or set the engine's command"
    log_finding_re = LOG_FINDING_RE
    log_prefix = "bistat-vllm-"

    def __init__(self, model: str, *, args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, url: str | None = None,
                 command: Sequence[str] = ("vllm", "serve"), python: str = sys.executable,
                 host: str = "127.0.0.1", port: int | None = None,
                 enable_prefix_caching: bool = False, tensor_parallel_size: int | None = None,
                 health_timeout_s: float = 900.0, stop_grace_s: float = 30.0,
                 log_path: str | os.PathLike | None = None,
                 http: Mapping[str, Any] | None = None) -> None:
        self._init_server(model, env=env, http=http, host=host, port=port,
                          health_timeout_s=health_timeout_s, stop_grace_s=stop_grace_s,
                          log_path=log_path)
        self.args = dict(args or {})
        self.url = url
        self.command = list(command)
        self.python = python
        self.enable_prefix_caching = enable_prefix_caching
        self.tensor_parallel_size = tensor_parallel_size
        self.client: OpenAIHTTPEngine | None = None
        self._served: EngineInfo | None = None  # what the started server answered at start

    #: declaration keys that configure bistat's handling rather than ``vllm serve``
    ADAPTER_KEYS = ("url", "command", "python", "health_timeout_s", "stop_grace_s", "log_path",
                    "enable_prefix_caching", "tensor_parallel_size")

    @classmethod
    def declaration_problems(cls, experiment: Any) -> list[tuple[str, str]]:
        """Argument names no supported vLLM's ``vllm serve`` accepts (:mod:`.vllm_args`), and
        the HTTP client's settings declared twice with different values
        (:func:`~bistat.engines.openai_http.workload_conflicts`)."""
        from bistat.engines.declared import (chosen_address_problems, declared_at,
                                             number_problems, url_problem)

        problems = (arg_problems(experiment, "server", cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                    + chosen_address_problems(experiment, cls.kind, unless="url")
                    + number_problems(experiment, cls.ADAPTER_KEYS + cls.HTTP_KEYS)
                    + workload_conflicts(experiment, "vllm-server"))
        for i, arm in enumerate(experiment.arms):
            args = {**dict(experiment.engine.args), **dict(arm.args)}
            if "url" in args and url_problem(args["url"]) is not None:
                problems.append((declared_at(experiment, i, "url"), url_problem(args["url"])))
        return list(dict.fromkeys(problems))

    @classmethod
    def from_experiment(cls, experiment: Any, arm: Any) -> "VLLMServerEngine":
        """Build from a declaration: ``engine.args`` overridden by ``arm.args``; the adapter's own
        keys (``ADAPTER_KEYS``, ``HTTP_KEYS``) are taken out, the rest become ``vllm serve``
        flags; ``arm.env`` is the server's environment. The HTTP client's ``retries`` and
        ``request_timeout_s`` are the workload's where the arguments do not set them."""
        args, own, http = cls.split_args(experiment, arm)
        return cls(experiment.engine.model, args=args, env=dict(arm.env), http=http, **own)

    # -- pieces ------------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """The server's environment: ours (less ``NOT_INHERITED_ENV``), the defaults, the arm's,
        then the forced settings."""
        return {**inherited_env(), **DEFAULT_ENV, **self.arm_env, **FORCED_ENV}

    def argv(self, port: int) -> list[str]:
        """The full server command line."""
        flags = ["--host", self.host, "--port", str(port)]
        flags.append("--enable-prefix-caching" if self.enable_prefix_caching
                     else "--no-enable-prefix-caching")
        if self.tensor_parallel_size is not None:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return self.command + [self.model] + flags + cli_args(self.args)

    def logged_modes(self) -> dict[str, Any]:
        """The compilation / CUDA-graph modes the server's log states (its engine core logs its
        configuration before it is healthy); empty when it states none."""
        from bistat.store.enginelog import engine_modes

        modes = engine_modes(self.log_text())
        return {} if modes is None else modes.to_dict()

    def probe_version(self) -> tuple[str, str | None, str | None]:
        """(version, commit, problem) of vLLM in the arm's environment, via ``python -c``."""
        try:
            out = subprocess.run([self.python, "-c", VERSION_PROBE], env=self.child_env(),
                                 capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return "unknown", None, f"version probe failed: {exc}"
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return "unknown", None, f"version probe failed: {tail}"
        data = json.loads(out.stdout.strip().splitlines()[-1])
        return str(data["version"]), data.get("commit"), None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EngineInfo:
        """Start (or attach to) the server and wait until it is healthy and serves the model."""
        if self.url is not None:
            self.client = OpenAIHTTPEngine(self.url, model=None, kind=self.kind,
                                           **self.http_kwargs)
            info = self.client.start()
            self.info = EngineInfo(kind=self.kind, version=info.version,
                                   args={"url": self.url, **self.args,
                                         "server_reported": info.args.get("server_reported")},
                                   env=self.arm_env)
            return self.info
        version, commit, problem = self.probe_version()
        argv, _ = self._start_server()
        served = self._served
        assert served is not None
        if version == "unknown" and served.version != "unknown":
            version = served.version
        findings = self.log_findings() + ((problem,) if problem else ())
        self.info = EngineInfo(
            kind=self.kind, version=version, commit=commit,
            args={"argv": argv, "model": self.model, **self.args,
                  "enable_prefix_caching": self.enable_prefix_caching,
                  "tensor_parallel_size": self.tensor_parallel_size,
                  "log_path": str(self.log_path),
                  "server_reported": served.args.get("server_reported")},
            env={**self.arm_env, **FORCED_ENV}, log_findings=findings,
            modes=self.logged_modes())
        return self.info

    def _connect(self, base: str) -> OpenAIHTTPEngine:
        client = OpenAIHTTPEngine(base, model=self.model, kind=self.kind, **self.http_kwargs)
        self._served = client.start()
        return client

    def prompt_logprobs(self, request: GenerationRequest, continuation: Sequence[int]) -> list[float]:
        """Prefill logprobs of ``continuation`` (vLLM's ``prompt_logprobs``), via the HTTP client."""
        if self.client is None:
            raise EngineStartError("vllm-server: prompt_logprobs() before start()")
        return self.client.prompt_logprobs(request, continuation)

    def reset_prefix_cache(self) -> bool:
        """Ask the server to drop its prefix cache (vLLM serves the endpoint only with
        ``VLLM_SERVER_DEV_MODE=1``); False when it has no such endpoint."""
        if self.client is None:
            raise EngineStartError("vllm-server: reset_prefix_cache() before start()")
        return self.client.reset_prefix_cache()

    def fingerprint(self) -> dict[str, Any]:
        info = self.info
        return {"kind": self.kind, "model": self.model,
                "version": info.version if info else None,
                "commit": info.commit if info else None,
                "url": self.client.base_url if self.client else self.url}
