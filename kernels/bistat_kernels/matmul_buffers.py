"""The persistent GEMM's split-K tile counters and float32 workspace, kept per (device, stream).

The launcher (:func:`bistat_kernels.matmul_persistent.matmul_persistent`) passes a counter buffer
to every launch (one kernel signature) and a workspace to launches whose splits run in parallel.
"""

from __future__ import annotations

import torch


# ---- split-K tile counters and workspace ---------------------------------------------------------
#
# Parallel split-K counts each tile's arrived partials in an int32 counter that the last program
# of the tile sets back to zero, so a buffer is zero between launches; the float32 partials live
# in a workspace that the same launch has finished reading when it ends. Launches on one stream
# run in order and may share both; launches on two streams may run at once and must not, so they
# are kept per (device, stream). A buffer that has to grow is replaced, and the old one is kept
# alive: a CUDA graph captured with it still points at it. (Two graphs captured on one stream
# must therefore not be replayed at the same time on two streams, as with any captured
# workspace.) Workspaces above WORKSPACE_KEPT_MAX elements are allocated per call instead.

_LOCKS: dict[tuple, torch.Tensor] = {}  # (device index, stream handle) -> int32 counters, zeros
_RETIRED_LOCKS: list[torch.Tensor] = []


def _lock_buffer(device: torch.device, stream: int, tiles: int) -> torch.Tensor:
    locks = _LOCKS.get((device.index, stream))
    if locks is None or locks.numel() < tiles:  # (tiles = 0: any buffer, for the signature)
        if locks is not None:
            _RETIRED_LOCKS.append(locks)
        size = max(tiles, 1024 if locks is None else 2 * locks.numel())
        locks = torch.zeros(size, device=device, dtype=torch.int32)
        _LOCKS[(device.index, stream)] = locks
    return locks


WORKSPACE_KEPT_MAX = 1 << 24  # float32 elements (64 MiB) kept per (device, stream) at most
_WORKSPACES: dict[tuple, torch.Tensor] = {}  # (device index, stream handle) -> float32, flat
_RETIRED_WORKSPACES: list[torch.Tensor] = []


def _workspace(device: torch.device, stream: int, split_k: int, M: int, N: int) -> torch.Tensor:
    """This stream's float32 workspace, flat, with room for [split_k, M, N] at its start (the
    kernel indexes it from its address; above WORKSPACE_KEPT_MAX a fresh one for this call)."""
    need = split_k * M * N
    if need > WORKSPACE_KEPT_MAX:
        return torch.empty(need, device=device, dtype=torch.float32)
    ws = _WORKSPACES.get((device.index, stream))
    if ws is None or ws.numel() < need:
        if ws is not None:
            _RETIRED_WORKSPACES.append(ws)
        size = min(WORKSPACE_KEPT_MAX, max(need, 1 << 20 if ws is None else 2 * ws.numel()))
        ws = torch.empty(size, device=device, dtype=torch.float32)
        _WORKSPACES[(device.index, stream)] = ws
    return ws


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
