"""A per-request KV cache that grows with the request (no pre-allocated max_model_len slab).

Each request owns two float32 arrays ``[L, KVH, capacity, d]`` (keys, already rotated, and values).
The capacity doubles when a chunk would overflow it, up to ``max_len``; the slice handed to
attention, ``[KVH, T, d]``, has the same contents and row layout whatever the capacity, so growing
never changes a result. Memory per cached token for SmolLM2-135M: 2 * 30 * 3 * 64 * 4 B = 46 KiB.
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 64


class KVCache:
    """Keys and values of one request, layer by layer."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 initial: int = _MIN_CAPACITY) -> None:
        self.max_len = max_len
        self.length = 0  # tokens whose K/V are stored in every layer
        cap = min(max(initial, _MIN_CAPACITY), max_len)
        self.k = np.zeros((n_layers, n_kv_heads, cap, head_dim), dtype=np.float32)  # [L, KVH, cap, d]
        self.v = np.zeros_like(self.k)  # [L, KVH, cap, d]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, new_length: int) -> None:
        """Make room for ``new_length`` tokens (doubling), before a chunk is written."""
        if new_length > self.max_len:
            raise ValueError(f"KV cache: {new_length} tokens exceed max_model_len={self.max_len}")
        if new_length <= self.capacity:
            return
        cap = min(max(2 * self.capacity, new_length), self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (cap,) + old.shape[3:], dtype=np.float32)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store a chunk's K/V ``[C, KVH, d]`` at ``start`` and return the views ``[KVH, start + C, d]``."""
        c = k.shape[0]
        end = start + c
        self.k[layer, :, start:end] = k.transpose(1, 0, 2)  # [C, KVH, d] -> [KVH, C, d]
        self.v[layer, :, start:end] = v.transpose(1, 0, 2)
        return self.k[layer, :, :end], self.v[layer, :, :end]  # [KVH, T, d] each
