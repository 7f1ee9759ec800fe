"""vLLM general plugin: make FlashAttention 3's kernel choice independent of the batch.

Entry point (pyproject): ``bistat_fa3_pin = "bistat_kernels.vllm_fa3:register"`` in the group
``vllm.general_plugins``. vLLM calls :func:`register` in every process that loads plugins (API
server, engine core, workers; possibly several times). It does nothing unless ``BISTAT_FA3_PIN=1``.
This file imports nothing outside the standard library at import time, so a script can load it by
path where bistat is not installed (``scripts/device/fa3_check.py``).

The mechanism (why vLLM's batch-invariant mode is not invariant on FA3 at head size 64)
---------------------------------------------------------------------------------------
vLLM's FLASH_ATTN backend hands FlashAttention 3 the step's longest query as ``max_seqlen_q``
(vLLM 0.33.0 ``vllm/v1/attention/backends/flash_attn.py:1283``, through the module global
``flash_attn_varlen_func`` at :113-116 and :1404-1428; 0.25.0 the same file, :843 and :952-976)
and, when it schedules ahead of time, computes FA3's scheduler metadata from the same value
(0.33.0 :634-668, 0.25.0 :485-511, both through the module global ``get_scheduler_metadata``). FA3
picks its kernel on the host from that scalar (vllm-project/flash-attention ``hopper/``, cited at
commit 617264c1): ``mha_fwd`` takes ``seqlen_q = max_seqlen_q`` for varlen batches
(``flash_api.cpp:827``) and (1) relaxes a causal call to non-causal when it is 1 (:868-872);
(2) runs one MMA warpgroup when ``seqlen_q * (q heads / KV heads) <= 64`` at head size 64 or 128
(``heuristics.h:10-14``; the template switch ``flash_fwd_launch_template.h:217-219``), which at
head size 64 is the 64 x **192** tile, against 192 x **128** for two warpgroups on a causal call
(``tile_size.h:23-30``); (3) loads paged KV by TMA when the page size is a multiple of the tile's
kBlockN and ``seqlen_q * (q heads / KV heads) > kBlockM`` (``flash_api.cpp:464-474``, :1058);
(4) splits KV by a heuristic of ``seqlen_q`` unless ``num_splits`` is given (:1059). Pack-GQA
needs no pin on this path: a varlen query always packs (``heuristics.h:18``, via
``flash_api.cpp:494``; 1:1 attention never does, :490), and ``get_scheduler_metadata`` repeats
the same decisions from its own ``max_seqlen_q`` (:619, :641-645, :667-669). A decode row's
softmax is summed over KV tiles of kBlockN keys, so up to 128 keys it is one tile in both
kernels, and past 128 keys it is reduced in other places when an unrelated prefill of
``64 // (q heads / KV heads) + 1`` tokens or more joins its step (SmolLM2-135M, 9/3 heads: 22).
Batch-invariant mode pins only (4) and turns the AOT scheduler off (0.33.0 :834-837 and
:867-868; 0.25.0 :450-452 and :482-483), so the flip stays: vLLM issue #51902 (H100, 14/2
heads: ``max_seqlen_q`` 9 gives ``VarlenDynamicPersistentTileScheduler<64,192,...>``, 10 gives
``<192,128,...>``); flash-attention PR #169 (open) would add a ``batch_invariant`` flag that pins
(1)-(4) inside FA3. vLLM 0.33.0's FA3 library (a later FlashAttention than 617264c1: its mainloop
template has one more flag) still holds both head-size-64 varlen pack-GQA kernels, 64 x 192 and
192 x 128 (their symbol names in ``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``), and the flip was
measured with it (shared/device-latest/README.md, "(d) Long needles": FA3 in batch-invariant
mode first differed at KV lengths 135, 311 and 636, at the first decode step past the prompt).

What this plugin does
---------------------
It wraps those two module globals of ``vllm.v1.attention.backends.flash_attn`` (the hook exists
in 0.25.0 and 0.33.0, found by feature detection; anything else is refused at start with the
version and what was looked for). Every FA3 call (``fa_version == 3``) gets

* ``max_seqlen_q = max(given, pinned)``, with ``pinned`` from :func:`pinned_max_seqlen_q`: the
  smallest value at which (1), (2) and (3) take the same branch as for every longer query, so
  every step of an engine runs the same template whatever the batch holds (a larger value is
  never passed on: FA3 reads ``max_seqlen_q`` as an upper bound and takes each query's own length
  from ``cu_seqlens_q``);
* ``num_splits = 1`` (what batch-invariant mode already passes; outside it, vLLM's split
  heuristic would otherwise depend on the batch);

and ``get_scheduler_metadata`` gets the same two values, so AOT metadata (vLLM's default outside
batch-invariant mode) always matches the call it is made for. A CUDA graph captured for decode
steps (vLLM captures with ``max_query_len = 1``) captures the pinned kernel, because capture runs
the same Python. Other attention backends, FA2 and FA4 calls pass through unchanged.

Cost: the pin changes nothing for steps that already run the two-warpgroup kernel (every step
with a prefill of 22+ tokens at SmolLM2's heads); decode-only steps run the 192 x 128 causal
kernel instead of the 64 x 192 one. Any value at or above ``pinned`` selects that same kernel,
and on vLLM's varlen path FA3's grid is the SM count (``VarlenDynamicPersistentTileScheduler``,
``tile_scheduler.hpp:424``) with tiles counted from each query's own length, so pinning to
``max_num_batched_tokens`` would cost the same kernels; the smallest value is kept so that every
quantity FA3 still derives from ``max_seqlen_q`` (``num_blocks_m``, ``flash_fwd_launch_template.h
:153``) stays as small as the template allows. What the decode-only steps lose is measured by
the GPU study (docs/STUDIES.md), not here.
"""

from __future__ import annotations

import inspect
import logging
import os
from types import ModuleType
from typing import Any, Callable, Mapping, MutableMapping, Optional

ENABLE_ENV = "BISTAT_FA3_PIN"
TARGET_MODULE = "vllm.v1.attention.backends.flash_attn"
FORWARD = "flash_attn_varlen_func"
SCHEDULER = "get_scheduler_metadata"
#: The parameters each wrapped function must take (looked for by name in its signature).
FORWARD_PARAMS = ("q", "k", "max_seqlen_q", "num_splits", "fa_version", "block_table")
SCHEDULER_PARAMS = ("max_seqlen_q", "num_heads_q", "num_heads_kv", "page_size", "num_splits")
#: The vLLM releases whose FLASH_ATTN backend this hook was read in.
READ_IN = ("0.25.0", "0.33.0")

#: heuristics.h:10-14: one MMA warpgroup while ``seqlen_q * (q heads / KV heads) <= 64``.
ONE_WARPGROUP_ROWS = 64
#: tile_size.h: the largest kBlockM of any 2-byte SM90 forward tile (192), the bound of the
#: paged-KV TMA test ``seqlen_q * (q heads / KV heads) > kBlockM`` (flash_api.cpp:473).
LARGEST_BLOCK_M = 192
#: tile_size.h: every SM90 kBlockN is a multiple of 16 and at least 64, so a page of fewer than 64
#: keys is never a multiple of one and paged KV then never goes by TMA (flash_api.cpp:473).
SMALLEST_BLOCK_N = 64

_log = logging.getLogger("bistat_kernels.vllm_fa3")

#: FA3 forward calls that went through the pin, per (q heads, KV heads, head size, page size or
#: None when not paged, pinned max_seqlen_q): eager calls and CUDA-graph captures (a replay runs
#: no Python). The device check reads it to prove the pin ran.
CALLS: dict[tuple[Any, ...], int] = {}
#: Of those, the calls whose ``max_seqlen_q`` the pin raised (a step that would have run the
#: other kernel), per the same key.
RAISED: dict[tuple[Any, ...], int] = {}


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``BISTAT_FA3_PIN`` asks for the plugin (``1``, ``true``, ``yes`` or ``on``)."""
    env = os.environ if environ is None else environ
    return env.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def pinned_max_seqlen_q(num_heads_q: int, num_heads_kv: int, page_size: Optional[int]) -> int:
    """The smallest ``max_seqlen_q`` at which FA3's host-side choices are those of every longer one.

    Parameters
    ----------
    num_heads_q, num_heads_kv : int
        Query and KV heads of the call (FA3's ``h`` and ``h_k``).
    page_size : int or None
        Keys per KV-cache page (paged KV), or None when the call is not paged.

    Returns
    -------
    int
        At least 2 (a query length of 1 relaxes causal attention, ``flash_api.cpp:868-872``);
        above ``64 / (q heads / KV heads)`` (two MMA warpgroups, ``heuristics.h:10-14``); and, when
        pages of 64 keys or more could be a multiple of a tile's kBlockN, above ``192 / (q heads /
        KV heads)`` (paged KV by TMA, ``flash_api.cpp:464-474``).

    Examples
    --------
    >>> pinned_max_seqlen_q(9, 3, 16)      # SmolLM2-135M: 3 query heads per KV head, pages of 16
    22
    >>> pinned_max_seqlen_q(14, 2, 16), pinned_max_seqlen_q(14, 2, 128)   # vLLM issue #51902
    (10, 28)
    >>> pinned_max_seqlen_q(32, 32, 16), pinned_max_seqlen_q(128, 1, None)
    (65, 2)
    """
    if num_heads_q < 1 or num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"query heads ({num_heads_q}) must be a positive multiple of KV heads "
                         f"({num_heads_kv})")
    per_kv = num_heads_q // num_heads_kv
    floor = ONE_WARPGROUP_ROWS // per_kv + 1
    if page_size is not None and page_size >= SMALLEST_BLOCK_N:
        floor = max(floor, LARGEST_BLOCK_M // per_kv + 1)
    return max(2, floor)


def pin_forward_arguments(arguments: Mapping[str, Any], default_fa_version: int = 2
                          ) -> tuple[dict[str, Any], Optional[tuple[Any, ...]]]:
    """The keyword arguments of one ``flash_attn_varlen_func`` call with the pin applied.

    Only FA3 calls change (``fa_version``, else ``default_fa_version``): ``max_seqlen_q`` becomes
    at least :func:`pinned_max_seqlen_q` of the call's heads and page size (read from ``q``
    ``[total_q, q heads, head size]`` and ``k``: ``[pages, page size, KV heads, head size]`` when
    ``block_table`` is given, else ``[total_k, KV heads, head size]``), and ``num_splits`` 1.

    Returns
    -------
    (dict, tuple or None)
        The arguments to pass on, and the call's key ``(q heads, KV heads, head size, page size,
        pinned)`` (None when the call is not FA3 and passes through unchanged).
    """
    out = dict(arguments)
    if out.get("fa_version", default_fa_version) != 3:
        return out, None
    q, k = out["q"], out["k"]
    heads_q, head_size = int(q.shape[-2]), int(q.shape[-1])
    heads_kv = int(k.shape[-2])
    page = int(k.shape[1]) if out.get("block_table") is not None else None
    pinned = pinned_max_seqlen_q(heads_q, heads_kv, page)
    out["max_seqlen_q"] = max(int(out["max_seqlen_q"]), pinned)
    out["num_splits"] = 1
    return out, (heads_q, heads_kv, head_size, page, pinned)


def pin_scheduler_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one ``get_scheduler_metadata`` call (FA3 only) with the pin:
    the same ``max_seqlen_q`` and ``num_splits`` the forward call it is made for will get."""
    out = dict(arguments)
    page = out.get("page_size")
    pinned = pinned_max_seqlen_q(int(out["num_heads_q"]), int(out["num_heads_kv"]),
                                 None if page is None else int(page))
    out["max_seqlen_q"] = max(int(out["max_seqlen_q"]), pinned)
    out["num_splits"] = 1
    return out


def _parameters(fn: Callable[..., Any]) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _as_keywords(signature: inspect.Signature, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of a call by name (vLLM passes keywords; other callers may not)."""
    if not args:
        return kwargs
    bound = signature.bind(*args, **kwargs)
    return dict(bound.arguments)


def _default(signature: inspect.Signature, name: str, fallback: int) -> int:
    p = signature.parameters.get(name)
    return fallback if p is None or p.default is inspect.Parameter.empty else int(p.default)


def problems(module: ModuleType) -> list[str]:
    """What the hook needs and ``module`` lacks (empty: the plugin can install)."""
    found = []
    for name, params in ((FORWARD, FORWARD_PARAMS), (SCHEDULER, SCHEDULER_PARAMS)):
        fn = getattr(module, name, None)
        if not callable(fn):
            found.append(f"no function {name} (vLLM imports it only where FlashAttention is "
                         "available: a CUDA build of vLLM)")
            continue
        sig = _parameters(fn)
        missing = [p for p in params if sig is None or p not in sig.parameters]
        if missing:
            found.append(f"{name} takes no parameter(s) {', '.join(missing)}")
    return found


def _note(key: tuple[Any, ...]) -> None:
    if key not in CALLS:
        heads_q, heads_kv, head_size, page, pinned = key
        _log.warning(
            "bistat_kernels: FlashAttention-3 pin: max_seqlen_q >= %d and num_splits = 1 for %d "
            "query heads / %d KV heads, head size %d, %s (pid %d)", pinned, heads_q, heads_kv,
            head_size, "not paged" if page is None else f"page size {page}", os.getpid())
    CALLS[key] = CALLS.get(key, 0) + 1


def install(module: ModuleType) -> bool:
    """Wrap ``module``'s FA3 entry points; idempotent. True if it installed, False if it already was.

    Raises
    ------
    RuntimeError
        ``module`` lacks what the hook needs (:func:`problems`).
    """
    if getattr(module, "_bistat_fa3_pin", False):
        return False
    found = problems(module)
    if found:
        raise RuntimeError(f"{module.__name__}: " + "; ".join(found))
    forward, scheduler = getattr(module, FORWARD), getattr(module, SCHEDULER)
    fsig, ssig = _parameters(forward), _parameters(scheduler)
    assert fsig is not None and ssig is not None  # problems() found both signatures
    fa_default = _default(fsig, "fa_version", 2)

    def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> Any:
        given = _as_keywords(fsig, args, kwargs)
        arguments, key = pin_forward_arguments(given, fa_default)
        if key is not None:
            _note(key)
            if arguments["max_seqlen_q"] != given["max_seqlen_q"]:
                RAISED[key] = RAISED.get(key, 0) + 1
        return forward(**arguments)

    def get_scheduler_metadata(*args: Any, **kwargs: Any) -> Any:
        return scheduler(**pin_scheduler_arguments(_as_keywords(ssig, args, kwargs)))

    for wrapper, original in ((flash_attn_varlen_func, forward),
                              (get_scheduler_metadata, scheduler)):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = f"{original.__name__} with bistat's FlashAttention-3 pin (bistat_kernels.vllm_fa3)"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.get_scheduler_metadata = get_scheduler_metadata
    module._bistat_fa3_pin = True
    _log.warning("bistat_kernels: FlashAttention-3 pin installed in %s (%s=1; pid %d)",
                 module.__name__, ENABLE_ENV, os.getpid())
    return True


def uninstall(module: ModuleType) -> bool:
    """Restore the originals :func:`install` wrapped; True if it had installed."""
    if not getattr(module, "_bistat_fa3_pin", False):
        return False
    for name in (FORWARD, SCHEDULER):
        setattr(module, name, getattr(module, name).__wrapped__)
    module._bistat_fa3_pin = False
    return True


def installed(modules: Optional[MutableMapping[str, Any]] = None) -> bool:
    """Whether vLLM's FLASH_ATTN backend module (if imported) currently runs through the pin."""
    import sys

    module = (sys.modules if modules is None else modules).get(TARGET_MODULE)
    return bool(module is not None and getattr(module, "_bistat_fa3_pin", False))


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001 - only for the message: vLLM may be half-importable
        return f"unknown ({type(exc).__name__}: {exc})"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``BISTAT_FA3_PIN=1``.

    Raises
    ------
    RuntimeError
        The variable is set but this vLLM has no hook the pin knows (the engine then fails to
        start, so that an arm that asked for the pin never runs without it).
    """
    if not enabled():
        return
    import importlib

    version = _vllm_version()
    where = (f"bistat_kernels.vllm_fa3: {ENABLE_ENV}=1 but vLLM {version}")
    fix = (f"the FlashAttention-3 pin cannot be installed; unset {ENABLE_ENV}, or run a vLLM whose "
           f"FLASH_ATTN backend it was read in ({', '.join(READ_IN)})")
    try:
        module = importlib.import_module(TARGET_MODULE)
    except ImportError as exc:
        raise RuntimeError(f"{where} has no module {TARGET_MODULE} ({exc}): {fix}") from exc
    found = problems(module)
    if found:
        raise RuntimeError(f"{where}: {TARGET_MODULE} has {'; '.join(found)} (looked for "
                           f"{FORWARD}({', '.join(FORWARD_PARAMS)}) and {SCHEDULER}("
                           f"{', '.join(SCHEDULER_PARAMS)})): {fix}")
    install(module)
