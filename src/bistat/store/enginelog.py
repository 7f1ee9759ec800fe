"""Kernel compilations during inference, each engine start's compilation / CUDA-graph mode, and
whether its torch.compile came from vLLM's compile cache, read from the engine logs a run kept.

Field lesson: warm-up is not steady state. An M-bucketed Triton kernel compiles again for each new
configuration, and a compilation inside a counted pass makes that pass slow for a reason that is
not the arm's steady-state cost. vLLM 0.25.0 watches for it and warns in its log
(``jit_monitor.py``: ``Triton kernel JIT compilation during inference: NAME. This causes a latency
spike; ...``). bistat keeps every engine start's log (``engine-logs/ARM-N.log.gz``); this module
finds those warnings and places each in the passes of its arm that were running in that second,
so that a finding can say which pass (warm-up or counted) paid for a compilation.

vLLM stamps its log lines with the host's clock to the second and without a year
(``12-01 16:56:08``): the year is the run's (``run.json`` ``created_utc``, the next one when the
month is earlier than the run's), the clock is taken as UTC (the GPU machines bistat's runs came
from keep UTC), and a second can overlap two passes of the same arm, which are then both named.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import math
import re
from dataclasses import dataclass
from pathlib import Path

from bistat.store.format import ENGINE_LOGS_DIR, parse_time

__all__ = ["JIT_WARNING", "CompileCache", "CudaGraphSizes", "EngineModes", "JitCompile",
           "compile_cache", "cudagraph_sizes", "engine_modes", "jit_compiles", "kept_logs",
           "logged_modes", "kept_log_lines"]

#: vLLM's warning (``vllm/.../jit_monitor.py``), with its log stamp ``MM-DD HH:MM:SS``
JIT_WARNING = re.compile(
    r"(?P<month>\d\d)-(?P<day>\d\d) (?P<time>\d\d:\d\d:\d\d)(?:[.,]\d+)? \[jit_monitor\.py:\d+\] "
    r"Triton kernel JIT compilation during inference: (?P<kernel>[\w.]+?)\.?(?:\s|$)")


@dataclass(frozen=True)
class JitCompile:
    """One warning: which arm's engine compiled which kernel, when, and during which passes."""

    arm: str
    start: int                             # the arm's engine start (``ARM-N.log.gz``)
    time_utc: str                          # the log's second, ``YYYY-MM-DDTHH:MM:SSZ``
    kernel: str
    passes: tuple[tuple[int, str], ...]    # (pass_index, kind) of the arm's passes in that second

    @property
    def in_counted_pass(self) -> bool:
        return any(kind == "counted" for _, kind in self.passes)


def jit_compiles(logs: str | Path | dict[str, dict[int, str]], created_utc: str | None,
                 passes: list[dict]) -> tuple[JitCompile, ...]:
    """The JIT-compilation warnings in a run's engine logs, in time order.

    Parameters
    ----------
    logs : path or dict
        The recorded run (its ``engine-logs/`` folder; none: no warnings), or what
        :func:`kept_logs` read from it.
    created_utc : str or None
        ``run.json``'s ``created_utc``, for the year the log stamps leave out (None: none found).
    passes : list of dict
        The run's passes (``passes.jsonl`` rows: ``arm``, ``pass_index``, ``kind``,
        ``started_utc``, ``wall_s``).
    """
    if created_utc is None:
        return ()
    found_logs = logs if isinstance(logs, dict) else kept_logs(logs)
    if not found_logs:
        return ()
    created = parse_time(created_utc)
    spans: dict[str, list[tuple[_dt.datetime, _dt.datetime, int, str]]] = {}
    for p in passes:
        started, wall = p.get("started_utc"), p.get("wall_s")
        if isinstance(started, str) and isinstance(wall, (int, float)) and math.isfinite(wall):
            t0 = parse_time(started)
            spans.setdefault(str(p["arm"]), []).append(
                (t0, t0 + _dt.timedelta(seconds=float(wall)), int(p["pass_index"]),
                 str(p["kind"])))
    found: list[JitCompile] = []
    for arm, starts in sorted(found_logs.items()):
        for start, text in sorted(starts.items()):
            for line in text.splitlines():
                m = JIT_WARNING.search(line)
                if m is None:
                    continue
                month = int(m["month"])
                year = created.year + (1 if month < created.month else 0)
                second = _dt.datetime.fromisoformat(
                    f"{year:04d}-{month:02d}-{m['day']}T{m['time']}+00:00")
                during = tuple((i, kind) for t0, t1, i, kind in spans.get(arm, ())
                               if t0 < second + _dt.timedelta(seconds=1) and t1 >= second)
                found.append(JitCompile(arm, start, second.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                        m["kernel"], during))
    return tuple(sorted(found, key=lambda j: (j.time_utc, j.arm, j.kernel)))


# --------------------------------------------------------------------------------------------
# Compilation and CUDA-graph modes (which execution mode each engine start ran in)

#: vLLM's engine core logs its whole configuration once per start ("Initializing a V1 LLM engine
#: (vX) with config: ... compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, ...,
#: 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, ...}"; 0.25.0 and 0.33.0 alike).
_CONFIG_MODE = re.compile(r"compilation_config=\{.*?'mode': <CompilationMode\.(?P<mode>\w+): \d+>")
_CONFIG_GRAPHS = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(?P<graphs>\w+)")
#: vLLM 0.33's breakable CUDA graphs (no torch.compile): switched on by batch-invariant mode for
#: models in its tuned table ("VLLM_BATCH_INVARIANT=1: auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1"),
#: by architecture, or by hand; the engine core then logs "Breakable CUDA graph enabled".
_BREAKABLE = re.compile(r"Breakable CUDA graph enabled|auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1",
                        re.IGNORECASE)


@dataclass(frozen=True)
class EngineModes:
    """The execution mode of one engine start, as vLLM configured it.

    Attributes
    ----------
    compilation_mode : str or None
        vLLM's ``CompilationMode`` name: ``VLLM_COMPILE`` (torch.compile), ``NONE`` (no
        torch.compile: eager, or 0.33's breakable CUDA graphs), ...; None: not found.
    cudagraph_mode : str or None
        vLLM's ``CUDAGraphMode`` name (``FULL_AND_PIECEWISE``, ``PIECEWISE``, ``NONE``, ...).
    breakable_cudagraph : bool or None
        vLLM 0.33's breakable CUDA graphs were on; None where the source cannot tell.
    source : str
        ``engine config`` (read from the live ``vllm_config`` by the offline worker) or
        ``engine log`` (the configuration line vLLM logs at start).
    """

    compilation_mode: str | None
    cudagraph_mode: str | None
    breakable_cudagraph: bool | None
    source: str

    def to_dict(self) -> dict[str, object]:
        return {"compilation_mode": self.compilation_mode, "cudagraph_mode": self.cudagraph_mode,
                "breakable_cudagraph": self.breakable_cudagraph, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "EngineModes":
        return cls(data.get("compilation_mode"), data.get("cudagraph_mode"),
                   data.get("breakable_cudagraph"), str(data.get("source") or "engine config"))

    def describe(self) -> tuple[str, str]:
        """(compilation, CUDA graphs) in words, for a finding's environment table."""
        compiled = {"VLLM_COMPILE": "torch.compile (VLLM_COMPILE)",
                    "NONE": "no torch.compile (NONE)"}.get(self.compilation_mode or "",
                                                          self.compilation_mode or "unknown")
        graphs = self.cudagraph_mode or "unknown"
        if self.breakable_cudagraph:
            graphs += ", breakable"
        return compiled, graphs


def _config_lines(log_text: str):
    """The lines of one engine start's log that carry vLLM's configuration (each start logs it
    once; :func:`engine_modes` and :func:`cudagraph_sizes` read them)."""
    return (line for line in log_text.splitlines() if "compilation_config=" in line)


#: SGLang's server logs its whole argument set once per start as a Python literal
#: ("[time] server_args={'model_path': ..., 'enable_torch_compile': False, 'cuda_graph_config':
#: {'decode': {'backend': 'full', 'max_bs': 128, ...}, 'prefill': {'backend': 'breakable', ...}},
#: 'disable_cuda_graph': False, ...}"; 0.5.23).
_SGLANG_ARGS = re.compile(r"\bserver_args=(?P<args>\{.*\})\s*$")


def _sglang_modes(log_text: str) -> EngineModes | None:
    """SGLang's modes from its logged ``server_args``: torch.compile on or off (and up to which
    batch), and its decode and prefill CUDA graphs (backend and largest size); None without it."""
    import ast

    for line in log_text.splitlines():
        m = _SGLANG_ARGS.search(line)
        if m is None:
            continue
        try:
            args = ast.literal_eval(m["args"])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if not isinstance(args, dict):
            continue
        compiled = (f"torch.compile (SGLang, batch ≤ {args.get('torch_compile_max_bs')})"
                    if args.get("enable_torch_compile") else "no torch.compile (SGLang)")
        config = args.get("cuda_graph_config")
        if args.get("disable_cuda_graph"):
            graphs = "none (disable_cuda_graph)"
        elif isinstance(config, dict):
            units = {"decode": "requests", "prefill": "tokens"}
            parts = [f"{phase} {c.get('backend')} (≤ {c.get('max_bs')} {units[phase]})"
                     for phase in ("decode", "prefill")
                     if isinstance(c := config.get(phase), dict) and c.get("backend") != "disabled"]
            graphs = ", ".join(parts) or "none"
        elif args.get("cuda_graph_max_bs") is not None:
            graphs = f"decode (≤ {args['cuda_graph_max_bs']} requests)"
        else:
            graphs = None
        return EngineModes(compiled, graphs, None, "engine log")
    return None


def engine_modes(log_text: str) -> EngineModes | None:
    """The modes one engine start's log states (vLLM's configuration line, or SGLang's
    ``server_args``); None when it holds neither.

    >>> engine_modes("INFO [core.py:114] Initializing a V1 LLM engine (v0.25.0) with config: "
    ...     "model='m', compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, "
    ...     "'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}").describe()
    ('torch.compile (VLLM_COMPILE)', 'FULL_AND_PIECEWISE')
    >>> engine_modes("[2026-12-07 08:16:49] server_args={'enable_torch_compile': False, "
    ...     "'torch_compile_max_bs': 32, 'cuda_graph_config': {'decode': {'backend': 'full', "
    ...     "'max_bs': 128}, 'prefill': {'backend': 'breakable', 'max_bs': 8192}}, "
    ...     "'disable_cuda_graph': False}").describe()
    ('no torch.compile (SGLang)', 'decode full (≤ 128 requests), prefill breakable (≤ 8192 tokens)')
    """
    if "server_args=" in log_text and "compilation_config=" not in log_text:
        return _sglang_modes(log_text)
    mode = graphs = None
    for line in _config_lines(log_text):
        m = _CONFIG_MODE.search(line)
        g = _CONFIG_GRAPHS.search(line)
        if m or g:
            mode = m["mode"] if m else mode
            graphs = g["graphs"] if g else graphs
    if mode is None and graphs is None:
        return None
    return EngineModes(mode, graphs, bool(_BREAKABLE.search(log_text)), "engine log")


#: The configuration line's CUDA-graph sizes: tokens per step up to which a step can replay a
#: graph (vLLM 0.25 to 0.34), and (0.34) the requests up to which a decode step replays a full one.
_CAPTURE_MAX = re.compile(r"'max_cudagraph_capture_size': (?P<n>\d+)")
_DECODE_MAX = re.compile(r"'max_decode_cudagraph_capture_requests': (?P<n>\d+)")


@dataclass(frozen=True)
class CudaGraphSizes:
    """The CUDA-graph sizes of one engine start, as its logged configuration states them.

    Attributes
    ----------
    cudagraph_mode : str or None
        ``CUDAGraphMode`` name (``NONE``: no step replays a graph).
    max_capture_size : int or None
        ``max_cudagraph_capture_size``: a step of more tokens runs without a CUDA graph, every
        kernel launched from the host (eager).
    max_decode_requests : int or None
        ``max_decode_cudagraph_capture_requests`` (vLLM 0.34): the largest decode batch captured
        as a full graph; None where the configuration has no such field.
    """

    cudagraph_mode: str | None
    max_capture_size: int | None
    max_decode_requests: int | None = None


def cudagraph_sizes(log_text: str) -> CudaGraphSizes | None:
    """The CUDA-graph sizes one engine start's log states (its last configuration line); None
    when it holds no configuration line naming them.

    >>> cudagraph_sizes("Initializing a V1 LLM engine (v0.34.0) with config: model='m', "
    ...     "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': "
    ...     "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'max_decode_cudagraph_capture_requests': "
    ...     "256, 'max_cudagraph_capture_size': 512}")
    CudaGraphSizes(cudagraph_mode='FULL_AND_PIECEWISE', max_capture_size=512, max_decode_requests=256)
    """
    found = None
    for line in _config_lines(log_text):
        size, graphs = _CAPTURE_MAX.search(line), _CONFIG_GRAPHS.search(line)
        if size is None and graphs is None:
            continue
        decode = _DECODE_MAX.search(line)
        found = CudaGraphSizes(graphs["graphs"] if graphs else None,
                               int(size["n"]) if size else None,
                               int(decode["n"]) if decode else None)
    return found


#: vLLM's torch.compile at an engine start (vLLM 0.25 to 0.34, ``compilation/backends.py`` and
#: ``decorators.py``): the compiled graphs loaded from its compile cache (``~/.cache/vllm``), or
#: compiled, with the seconds each compilation took.
_CACHE_LOAD = re.compile(r"Directly load (?:AOT compilation from path|the compiled graph)")
_COMPILED = re.compile(r"Compiling a graph for .*? takes (?P<s>\d+(?:\.\d+)?) s")
#: the cache entries a start names (the directory of its compiled graphs, its AOT compilation):
#: two starts naming one entry compiled, or would compile, the same code
_CACHE_KEY = re.compile(r"torch_compile_cache/(?:torch_aot_compile/)?(?P<key>[0-9a-f]{8,})")


@dataclass(frozen=True)
class CompileCache:
    """Whether one engine start's torch.compile came from vLLM's compile cache.

    Attributes
    ----------
    loaded : int
        Graphs (or AOT compilations) loaded from the cache: the start found the compiled code of
        an earlier engine of the same model and configuration on that machine.
    compiled : int
        Graphs compiled at this start.
    compile_s : float
        The seconds those compilations took, as vLLM logged them.
    keys : tuple of str
        The cache entries the start named (hashes under ``torch_compile_cache/``), in order of
        first mention: where another start of the run compiled one of them, a start that loaded
        it found what that start left, not an earlier machine's cache.
    """

    loaded: int
    compiled: int
    compile_s: float
    keys: tuple[str, ...] = ()

    @property
    def warm(self) -> bool:
        """The start loaded compiled code and compiled none (a warm cache)."""
        return self.loaded > 0 and self.compiled == 0


def compile_cache(log_text: str) -> CompileCache | None:
    """What one engine start's log says of its torch.compile: loaded from vLLM's compile cache or
    compiled; None when it says neither (no torch.compile: an eager or uncompiled engine, or an
    engine that is not vLLM).

    >>> compile_cache("[backbone] Directly load the compiled graph(s) for compile range (1, 8192) "
    ...               "from the cache, took 1.425 s").warm
    True
    >>> compile_cache("Using cache directory: /root/.cache/vllm/torch_compile_cache/96cde78d40/"
    ...               "rank_0_0/backbone ... Compiling a graph for compile range (1, 8192) "
    ...               "takes 65.48 s")
    CompileCache(loaded=0, compiled=1, compile_s=65.48, keys=('96cde78d40',))
    """
    loaded = len(_CACHE_LOAD.findall(log_text))
    times = [float(m["s"]) for m in _COMPILED.finditer(log_text)]
    if not loaded and not times:
        return None
    keys = tuple(dict.fromkeys(m["key"] for m in _CACHE_KEY.finditer(log_text)))
    return CompileCache(loaded, len(times), round(sum(times), 3), keys)


def kept_logs(run_dir: str | Path) -> dict[str, dict[int, str]]:
    """Arm -> start number -> the text of ``engine-logs/ARM-N.log.gz`` (every start's kept log),
    read once for :func:`jit_compiles`, :func:`logged_modes`, :func:`kept_log_lines` and
    :func:`cudagraph_sizes`."""
    logs = Path(run_dir) / ENGINE_LOGS_DIR
    found: dict[str, dict[int, str]] = {}
    if not logs.is_dir():
        return {}
    for path in sorted(logs.glob("*.log.gz")):
        arm, _, start = path.name[: -len(".log.gz")].rpartition("-")
        if not arm or not start.isdigit():
            continue
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as fh:
            found.setdefault(arm, {})[int(start)] = fh.read()
    return found


def logged_modes(logs: str | Path | dict[str, dict[int, str]],
                 ) -> dict[str, list[EngineModes | None]]:
    """Arm -> the modes of each engine start (``engine-logs/ARM-N.log.gz``, N in order) for runs
    whose environment records predate recording them; ``logs``: a run directory, or what
    :func:`kept_logs` read from one."""
    found = logs if isinstance(logs, dict) else kept_logs(logs)
    return {arm: [engine_modes(starts[i]) for i in sorted(starts)]
            for arm, starts in found.items()}


def kept_log_lines(logs: str | Path | dict[str, dict[int, str]]) -> dict[str, tuple[str, ...]]:
    """Arm -> every line of its kept engine logs, starts in order: what the activation markers read
    besides the lines the run recorded at each start (``log_findings``, filtered when recorded by
    the pattern of that day: a later marker, such as vLLM 0.34's only one in a compiled
    batch-invariant engine, is still in the kept log); ``logs`` as for :func:`logged_modes`."""
    found = logs if isinstance(logs, dict) else kept_logs(logs)
    return {arm: tuple(line for i in sorted(starts) for line in starts[i].splitlines())
            for arm, starts in found.items()}
