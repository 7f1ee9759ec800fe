"""vLLM general plugin: route vLLM's batch-invariant GEMM through bistat's tuned kernel.

Entry point (pyproject): ``bistat_tuned_gemm = "bistat_kernels.vllm_plugin:register"`` in the group
``vllm.general_plugins``. vLLM calls :func:`register` in every process that loads plugins (engine
and workers, possibly several times). It does nothing unless ``BISTAT_TUNED_GEMM=1``.

Where it hooks in (vLLM 0.25.0, ``vllm/model_executor/layers/batch_invariant.py``): with
``VLLM_BATCH_INVARIANT=1``, ``UnquantizedLinearMethod.apply`` (``linear.py``) and the lm_head's
``UnquantizedEmbeddingMethod.apply`` (``vocab_parallel_embedding.py``) call
``linear_batch_invariant(x, weight, bias)``, which calls ``matmul_batch_invariant(x, weight.t())``,
which calls the module global ``matmul_persistent(a, b)``; on SM80 the ``aten::mm`` / ``addmm`` /
``matmul`` / ``linear`` overrides reach the same global through ``mm_batch_invariant`` and
``addmm_batch_invariant``. Replacing that one module attribute is the narrowest point: every
caller looks it up at call time, nothing else in vLLM changes, and the signature
``(a, b, bias=None) -> Tensor`` is kept.

The replacement calls the tuned launcher through a ``torch.library`` operator
(``bistat::matmul_persistent``) so that torch.compile treats it as one opaque node: Dynamo never
traces the table lookup (whose branch on the symbolic batch size would otherwise be frozen into
the graph at trace time), and the bucket is chosen with the real M when the op runs — eagerly, or
while vLLM captures a CUDA graph for that batch size.

The operator is defined with ``torch.library.Library`` and a plain Python kernel per device,
not with ``torch.library.custom_op``: a step that is not a CUDA-graph replay (vLLM 0.25.0 captures
steps of up to 512 tokens) pays the dispatch on every GEMM call, and ``custom_op``'s
wrapper with a lookup per call added 14.8 us of host time per call over vLLM's direct call on the
H200 machine's host, this operator 3.8 us (``benchmarks/bench_plugin_dispatch.py``,
``kernels/results/plugin_dispatch_h200_host.txt``; 145 calls per Qwen3-8B decode step). The launch configuration of each (M, N, K, dtype) is looked up
once and kept.
"""

import logging
import os
from types import ModuleType
from typing import Any, Optional, Union

ENABLE_ENV = "BISTAT_TUNED_GEMM"
TARGET_MODULE = "vllm.model_executor.layers.batch_invariant"
OP_NAME = "bistat::matmul_persistent"

_log = logging.getLogger("bistat_kernels.vllm_plugin")

# Executions of the operator's real implementation per (N, K, BLOCK_M, BLOCK_N, BLOCK_K,
# SPLIT_K): eager calls and CUDA-graph captures (a graph replay runs no Python, so it is not
# counted). The vLLM check script reads this to prove the tuned kernel ran.
CALLS: dict[tuple[int, ...], int] = {}
_OP: Any = None
_LIB: Any = None  # the torch.library.Library defining the op; kept alive with the process
# (M, N, K, dtype, device name) -> (the table it was looked up in, its launch configuration)
_CONFIGS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def enabled(environ: Optional[Union["os._Environ[str]", dict]] = None) -> bool:
    """Whether ``BISTAT_TUNED_GEMM`` asks for the plugin (``1``, ``true``, ``yes`` or ``on``)."""
    env = os.environ if environ is None else environ
    return env.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


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
        _, device_name = mp._device_facts(a.device)
        table = tables.resolve_device_table(device_name)
        where = (M, N, K, a.dtype, device_name)
        known = _CONFIGS.get(where)
        if known is not None and known[0] is table:  # a table set since is looked up afresh
            cfg = known[1]
        else:
            cfg = tables.lookup_config(M, N, K, mp.dtype_name(a.dtype), device_name)
            _CONFIGS[where] = (table, cfg)
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


def install(module: ModuleType) -> bool:
    """Replace ``module.matmul_persistent`` by the tuned op; idempotent. True if it installed."""
    if getattr(module, "_bistat_tuned_gemm", False):
        return False
    original = module.matmul_persistent
    op = tuned_matmul_op()

    def matmul_persistent(a: Any, b: Any, bias: Any = None) -> Any:
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
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return bool(module is not None and getattr(module, "_bistat_tuned_gemm", False))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``BISTAT_TUNED_GEMM=1``."""
    if not enabled():
        return
    import importlib

    try:
        module = importlib.import_module(TARGET_MODULE)
    except ImportError as exc:
        _log.warning("bistat_kernels: %s=1 but %s cannot be imported (%s); the tuned GEMM is "
                     "not installed", ENABLE_ENV, TARGET_MODULE, exc)
        return
    if not hasattr(module, "matmul_persistent"):
        _log.warning("bistat_kernels: %s has no matmul_persistent (vLLM version without it?); "
                     "the tuned GEMM is not installed", TARGET_MODULE)
        return
    install(module)
