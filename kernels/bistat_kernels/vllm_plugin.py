"""vLLM general plugin: route vLLM's batch-invariant GEMM through bistat's tuned kernel.

Entry point (pyproject): ``bistat_tuned_gemm = "bistat_kernels.vllm_plugin:register"`` in the group
``vllm.general_plugins``. vLLM calls :func:`register` in every process that loads plugins (engine
and workers, possibly several times). It does nothing unless ``BISTAT_TUNED_GEMM=1``.

Where it hooks in: with ``VLLM_BATCH_INVARIANT=1``, ``UnquantizedLinearMethod.apply``
(``linear.py``) and the lm_head's ``UnquantizedEmbeddingMethod.apply``
(``vocab_parallel_embedding.py``) call ``linear_batch_invariant(x, weight, bias)`` of vLLM's
batch-invariant module, which reaches the module global ``matmul_persistent(a, b, bias=None)``:

- vLLM 0.25.0, ``vllm/model_executor/layers/batch_invariant.py``: ``linear_batch_invariant`` →
  ``matmul_batch_invariant`` → ``matmul_persistent`` with one fixed configuration; on SM80 the
  ``aten::mm`` / ``addmm`` / ``matmul`` / ``linear`` overrides reach the same global;
- vLLM 0.33.0, ``vllm/model_executor/determinism/batch_invariant.py`` (moved by #53619):
  ``linear_batch_invariant`` → ``mm_batch_invariant`` → ``matmul_persistent``, whose launch
  configuration now comes from vLLM's own M-bucketed tables (``batch_invariant_configs.
  _get_matmul_config``); on Hopper and Blackwell ``aten::mm`` is no longer overridden (cuBLAS is
  kept from splitting K by its workspace settings), so only the linear layers and the lm_head
  take this path.

Replacing that one module attribute is the narrowest point: every caller looks it up at call time,
nothing else in vLLM changes, and the signature ``(a, b, bias=None) -> Tensor`` is kept. The hook
is found by feature, not by version string (:func:`find_hook`): the first of
:data:`TARGET_MODULES` that imports and passes :func:`hook_problems` (``matmul_persistent`` with
parameters ``(a, b, bias=None)``, reached from ``linear_batch_invariant`` through module-level
names). On a vLLM where none does, :func:`register` raises :class:`UnsupportedVLLMError`, naming
the vLLM version and what it looked for: an arm that asked for the tuned GEMM must not run vLLM's
own instead. ``kernels/bistat_kernels/vllm_hooks/VERSION.json`` records, per supported release, what the wheel
holds (``bistat_kernels.hook_manifest`` derives it with ``ast``), and the tests check
:func:`hook_problems` against each.

The replacement calls the tuned launcher through a ``torch.library`` operator
(``bistat::matmul_persistent``) so that torch.compile treats it as one opaque node: Dynamo never
traces the table lookup (whose branch on the symbolic batch size would otherwise be frozen into
the graph at trace time), and the bucket is chosen with the real M when the op runs — eagerly, or
while vLLM captures a CUDA graph for that batch size (0.33's breakable CUDA graphs, which vLLM
turns on instead of torch.compile in batch-invariant mode when its own table holds the model's
shapes, run it eagerly while capturing).

The operator is defined with ``torch.library.Library`` and a plain Python kernel per device,
not with ``torch.library.custom_op``: a step that is not a CUDA-graph replay (vLLM 0.25.0 captures
steps of up to 512 tokens) pays the dispatch on every GEMM call, and ``custom_op``'s
wrapper with a lookup per call added 14.8 us of host time per call over vLLM's direct call on the
H200 machine's host, this operator 3.8 us (``benchmarks/bench_plugin_dispatch.py``,
``kernels/results/plugin_dispatch_h200_host.txt``; 145 calls per Qwen3-8B decode step). The
launch configuration of each (M, N, K) is looked up once and kept, and the first call of each
weight shape compiles every bucket of its table entry (:func:`_precompile`; off with
``BISTAT_GEMM_PRECOMPILE=0``), so that no batch size first seen during a measured pass pays a
Triton compilation there.

Which table serves the GPU is resolved at the first call (:mod:`bistat_kernels.resolution`: the
user's or the shipped table of the GPU's name, else one measured on a GPU of the same compute
capability and multiprocessor count) and logged once; a shape that table has no entry for (every
shape, where no table resolves) is handed to vLLM's own ``matmul_persistent``, which serves it from
vLLM's own table where that has the shape and from its fixed configuration otherwise: such shapes
run as vLLM ships them. Each shape's source is logged once (``... served by ...``), and a finding's
environment quotes both lines (:mod:`bistat.analysis.activation`).
"""

import importlib
import importlib.util
import logging
import os
import sys
import types
from collections import Counter
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Optional, Union

ENABLE_ENV = "BISTAT_TUNED_GEMM"
#: ``BISTAT_GEMM_PRECOMPILE=0`` turns off compiling a shape's every bucket at its first call.
PRECOMPILE_ENV = "BISTAT_GEMM_PRECOMPILE"
PRECOMPILE = os.environ.get(PRECOMPILE_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}
_PRECOMPILED: set = set()  # (dtype, N, K, strides, bias?, device) compiled at a first call
#: Where vLLM keeps its batch-invariant GEMM, newest layout first (0.33.0: determinism/; 0.25.0:
#: layers/). The first that imports and passes :func:`hook_problems` is hooked.
TARGET_MODULES = ("vllm.model_executor.determinism.batch_invariant",
                  "vllm.model_executor.layers.batch_invariant")
#: The function replaced, and its parameters (``bias`` defaulting to None).
HOOK = "matmul_persistent"
HOOK_PARAMS = ("a", "b", "bias")
#: What vLLM's linear layers and lm_head call; it must reach :data:`HOOK` through module-level
#: names (looked up at call time), or replacing the module attribute would change nothing.
ENTRY = "linear_batch_invariant"
#: The vLLM modules that call :data:`ENTRY` (checked in the manifests: they import it by name).
CALLERS = ("vllm.model_executor.layers.linear",
           "vllm.model_executor.layers.vocab_parallel_embedding")
#: How many module-level calls may lie between :data:`ENTRY` and :data:`HOOK`.
MAX_DEPTH = 3
OP_NAME = "bistat::matmul_persistent"

_log = logging.getLogger("bistat_kernels.vllm_plugin")

# Executions of the operator's real implementation per (N, K, BLOCK_M, BLOCK_N, BLOCK_K,
# SPLIT_K): eager calls and CUDA-graph captures (a graph replay runs no Python, so it is not
# counted). The vLLM check script reads this to prove the tuned kernel ran.
CALLS: dict[tuple[int, ...], int] = {}
#: the same for the calls handed to vLLM's own ``matmul_persistent``, per (N, K): shapes bistat's
#: table has no entry for (vLLM's own table or its fixed configuration serves them)
VLLM_CALLS: Counter = Counter()
_OP: Any = None
_LIB: Any = None  # the torch.library.Library defining the op; kept alive with the process
# (M, N, K, dtype, device) -> (the table it was looked up in, its launch configuration, or None
# where vLLM's own kernel serves the shape)
_CONFIGS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
#: vLLM's own ``matmul_persistent``, kept by :func:`install`: the shapes bistat's table lacks go
#: to it, so that they run as vLLM ships them (its own table where it has the shape)
_VLLM_OWN: Any = None


def enabled(environ: Optional[Union["os._Environ[str]", dict]] = None) -> bool:
    """Whether ``BISTAT_TUNED_GEMM`` asks for the plugin (``1``, ``true``, ``yes`` or ``on``)."""
    env = os.environ if environ is None else environ
    return env.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _launch_for(M: int, N: int, K: int, a: Any, b: Any, bias: Any, facts: Any) -> Any:
    """The launch configuration of one call shape, or None for vLLM's own kernel (a shape
    without an entry in bistat's table, once install() has kept vLLM's function); the table is
    resolved at the first call (logged once), and each shape's source is logged once."""
    from bistat_kernels import matmul_persistent as mp
    from bistat_kernels import tables

    table = tables.resolve_device_table(facts)
    dtype = mp.dtype_name(a.dtype)
    entry = table.lookup(dtype, N, K) if table is not None else None
    if entry is None and _VLLM_OWN is not None:
        tables.note_shape(dtype, N, K, tables.shape_source(dtype, N, K, vllm_kernel=True))
        return None
    if entry is not None:
        tables.note_shape(dtype, N, K, tables.shape_source(dtype, N, K))
        if PRECOMPILE:
            _precompile(a, b, bias, table, dtype, N, K)
    return tables.lookup_config(M, N, K, dtype, facts)


def tuned_matmul_op() -> Any:
    """The operator ``torch.ops.bistat.matmul_persistent.default(a, b, bias)``, defined once."""
    global _OP, _LIB
    if _OP is not None:
        return _OP
    import torch

    from bistat_kernels import matmul_persistent as mp
    from bistat_kernels import tables

    def _matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        M, K = a.shape
        N = b.shape[1]
        _, facts = mp._device_facts(a.device)
        table = tables.resolve_device_table(facts)
        where = (M, N, K, a.dtype, facts)
        known = _CONFIGS.get(where)
        if known is not None and known[0] is table:  # a table set since is looked up afresh
            cfg = known[1]
        else:
            cfg = _launch_for(M, N, K, a, b, bias, facts)
            _CONFIGS[where] = (table, cfg)
        if cfg is None:
            VLLM_CALLS[(N, K)] += 1
            return _VLLM_OWN(a, b, bias)
        key = (N, K, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
        CALLS[key] = CALLS.get(key, 0) + 1
        return mp.matmul_persistent(a, b, bias, config=cfg)

    lib = torch.library.Library("bistat", "DEF")
    lib.define("matmul_persistent(Tensor a, Tensor b, Tensor? bias) -> Tensor")
    for dispatch_key in ("CPU", "CUDA"):
        lib.impl("matmul_persistent", _matmul, dispatch_key)

    @torch.library.register_fake(OP_NAME, lib=lib)
    def _(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return a.new_empty((a.shape[0], b.shape[1]))  # [M, N]

    _LIB, _OP = lib, torch.ops.bistat.matmul_persistent.default
    return _OP


def _precompile(a: Any, b: Any, bias: Any, table: Any, dtype: str, n: int, k: int) -> None:
    """At the first call of a weight shape (vLLM's profiling and warm-up runs, before any
    measured request), compile every bucket of its table entry, so that no later batch size pays
    a Triton compilation in the middle of a pass."""
    import time

    from bistat_kernels import matmul_persistent as mp

    entry = table.lookup(dtype, n, k)
    seen = (dtype, n, k, a.stride(), b.stride(), bias is not None, a.device.index)
    if entry is None or seen in _PRECOMPILED:
        return
    start = time.perf_counter()
    launched = mp.precompile_buckets(a, b, bias, entry)
    if launched:
        _PRECOMPILED.add(seen)
        _log.warning("bistat_kernels: precompiled %d bucket configurations of %s N=%d K=%d in "
                     "%.1f s", launched, dtype, n, k, time.perf_counter() - start)


class UnsupportedVLLMError(RuntimeError):
    """``BISTAT_TUNED_GEMM=1`` on a vLLM whose batch-invariant GEMM the plugin cannot hook."""


def hook_problems(view: Mapping[str, Any]) -> list[str]:
    """What keeps the plugin from hooking a batch-invariant module; empty: it can.

    Parameters
    ----------
    view : mapping
        ``{"functions": {name: {"params": [...], "defaults": {param: text}, "names": [...]}}}``:
        the module's top-level functions, their parameters, the source text of their defaults
        and the module-level names their bodies use. :func:`module_view` builds it from a
        live module, ``bistat_kernels.hook_manifest`` from a wheel's source (``ast``).

    Examples
    --------
    >>> f = {"params": ["a", "b", "bias"], "defaults": {"bias": "None"}, "names": []}
    >>> hook_problems({"functions": {"matmul_persistent": f,
    ...     "linear_batch_invariant": {"params": ["input", "weight", "bias"],
    ...                                "defaults": {"bias": "None"}, "names": ["mm"]},
    ...     "mm": {"params": ["a", "b"], "defaults": {}, "names": ["matmul_persistent"]}}})
    []
    >>> hook_problems({"functions": {}})[0]
    'no function matmul_persistent'
    """
    functions = view.get("functions") or {}
    problems = []
    hook = functions.get(HOOK)
    if hook is None:
        return [f"no function {HOOK}"] + ([] if ENTRY in functions else [f"no function {ENTRY}"])
    params = list(hook.get("params") or [])
    defaults = hook.get("defaults") or {}
    if tuple(params[:len(HOOK_PARAMS)]) != HOOK_PARAMS or defaults.get("bias") != "None":
        problems.append(f"{HOOK} has parameters ({', '.join(params)}), not (a, b, bias=None)")
    extra = [p for p in params[len(HOOK_PARAMS):] if p not in defaults]
    if extra:
        problems.append(f"{HOOK} requires more parameters: {', '.join(extra)}")
    if ENTRY not in functions:
        return problems + [f"no function {ENTRY}"]
    if _call_path(functions, ENTRY, HOOK) is None:
        problems.append(f"{ENTRY} does not reach {HOOK} through module-level names within "
                        f"{MAX_DEPTH} calls")
    return problems


def _call_path(functions: Mapping[str, Any], start: str, goal: str) -> Optional[list[str]]:
    """The shortest chain of module-level functions from ``start`` to ``goal`` (breadth first)."""
    frontier = [[start]]
    for _ in range(MAX_DEPTH):
        nxt = []
        for path in frontier:
            for name in (functions.get(path[-1]) or {}).get("names") or []:
                if name == goal:
                    return path + [goal]
                if name in functions and name not in path:
                    nxt.append(path + [name])
        frontier = nxt
    return None


def call_path(view: Mapping[str, Any]) -> Optional[list[str]]:
    """``[ENTRY, ..., HOOK]`` in ``view`` (see :func:`hook_problems`); None when there is none."""
    return _call_path(view.get("functions") or {}, ENTRY, HOOK)


def _code_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions (matmul_persistent's grid) and lambdas
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def module_view(module: ModuleType) -> dict:
    """:func:`hook_problems`' view of a live module: its own top-level functions, their
    parameters and defaults (``inspect.signature``) and the module-level names their code uses."""
    import inspect

    top = set(vars(module))
    functions = {}
    for name, fn in sorted(vars(module).items()):
        if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        fn = inspect.unwrap(fn)
        sig = inspect.signature(fn)
        functions[name] = {
            "params": list(sig.parameters),
            "defaults": {p.name: repr(p.default) for p in sig.parameters.values()
                         if p.default is not inspect.Parameter.empty},
            "names": sorted(_code_names(fn.__code__) & top),
        }
    return {"module": module.__name__, "functions": functions}


def vllm_version() -> str:
    """vLLM's version from its package metadata ("unknown" when it has none)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get("vllm"), "__version__", "unknown"))


def _vllm_present() -> bool:
    if "vllm" in sys.modules:  # imported (or blocked with None, as tests do)
        return sys.modules["vllm"] is not None
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def find_hook() -> tuple[Optional[ModuleType], list[str]]:
    """The first of :data:`TARGET_MODULES` that imports and passes :func:`hook_problems`, and
    one line per module tried that did not (why not)."""
    tried = []
    for name in TARGET_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            tried.append(f"{name}: cannot be imported ({exc})")
            continue
        problems = hook_problems(module_view(module))
        if not problems:
            return module, tried
        tried.append(f"{name}: {'; '.join(problems)}")
    return None, tried


def unsupported_message(version: str, tried: list[str]) -> str:
    """The refusal: the vLLM version, what the plugin looked for and what it found instead."""
    return (f"bistat_kernels: the tuned GEMM ({ENABLE_ENV}=1) is not supported on vLLM {version}: "
            f"it looks for {HOOK}(a, b, bias=None), reached from {ENTRY} through module-level "
            f"names, in {' or '.join(TARGET_MODULES)}; " + "; ".join(tried)
            + f". Unset {ENABLE_ENV}, or use a vLLM that bistat_kernels/vllm_hooks/ has a "
            "manifest for (bistat_kernels.hook_manifest derives one from a wheel)")


#: calls handed back to vLLM's own matmul_persistent, by (out_dtype, extra keyword names)
PASSED_THROUGH: Counter = Counter()


def _note_passed_through(out_dtype: Any, more: Mapping[str, Any]) -> None:
    key = (str(out_dtype), tuple(sorted(more)))
    if key not in PASSED_THROUGH:
        _log.warning("bistat_kernels: matmul_persistent(out_dtype=%s%s) runs on vLLM's own kernel "
                     "(the tuned GEMM writes its inputs' dtype)", out_dtype,
                     "".join(f", {k}=..." for k in sorted(more)))
    PASSED_THROUGH[key] += 1


def install(module: ModuleType) -> bool:
    """Replace ``module.matmul_persistent`` by the tuned op; idempotent. True if it installed."""
    global _VLLM_OWN
    if getattr(module, "_bistat_tuned_gemm", False):
        return False
    original = module.matmul_persistent
    op = tuned_matmul_op()
    _VLLM_OWN = original

    def matmul_persistent(a: Any, b: Any, bias: Any = None, out_dtype: Any = None,
                          **more: Any) -> Any:
        # vLLM 0.34 added ``out_dtype`` (``mm_dtype_batch_invariant``: aten::mm.dtype, bf16/fp16
        # in, fp32 out; overridden on SM80 and ROCm only). The tuned op writes the inputs' dtype:
        # any other output dtype, or a parameter a later vLLM adds, stays on vLLM's own kernel.
        if more or (out_dtype is not None and out_dtype != a.dtype):
            _note_passed_through(out_dtype, more)
            extra = dict(more, **({} if out_dtype is None else {"out_dtype": out_dtype}))
            return original(a, b, bias, **extra)
        return op(a, b, bias)

    matmul_persistent.__wrapped__ = original  # type: ignore[attr-defined]
    matmul_persistent.__doc__ = "bistat tuned batch-invariant GEMM (bistat_kernels.vllm_plugin)"
    module.matmul_persistent = matmul_persistent
    module._bistat_tuned_gemm = True
    _log.warning("bistat_kernels: tuned GEMM installed as %s.matmul_persistent (pid %d)",
                 module.__name__, os.getpid())
    return True


def installed() -> bool:
    """Whether vLLM's batch-invariant module (if imported) currently routes through us."""
    return any(getattr(sys.modules.get(name), "_bistat_tuned_gemm", False)
               for name in TARGET_MODULES)


def hooked_module() -> Optional[ModuleType]:
    """The imported batch-invariant module the plugin routes through (None: not installed)."""
    return next((sys.modules[name] for name in TARGET_MODULES
                 if getattr(sys.modules.get(name), "_bistat_tuned_gemm", False)), None)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``BISTAT_TUNED_GEMM=1``.

    Raises
    ------
    UnsupportedVLLMError
        vLLM is installed but none of :data:`TARGET_MODULES` has the hook (:func:`find_hook`);
        vLLM's plugin loader lets it through, so the engine does not start.
    """
    if not enabled() or installed():  # plugins load again in every process: idempotent
        return
    if not _vllm_present():
        _log.warning("bistat_kernels: %s=1 but vLLM is not installed; the tuned GEMM is not "
                     "installed", ENABLE_ENV)
        return
    module, tried = find_hook()
    if module is None:
        raise UnsupportedVLLMError(unsupported_message(vllm_version(), tried))
    install(module)
