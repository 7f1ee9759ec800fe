"""GEMM shapes of the models bistat tunes for (N = out_features, K = in_features).

From ``shared/MODELS.md`` ("Shapes that matter for the batch-invariant GEMM"): the fused
projections as vLLM runs them (qkv = q, k, v stacked; gate_up = gate and up stacked) and lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmShape:
    """One linear layer: ``y[M, N] = x[M, K] @ W[N, K].T``."""

    model: str
    layer: str
    n: int
    k: int


MODEL_SHAPES: dict[str, tuple[GemmShape, ...]] = {
    "qwen3-1.7b": (
        GemmShape("qwen3-1.7b", "qkv", 4096, 2048),
        GemmShape("qwen3-1.7b", "o", 2048, 2048),
        GemmShape("qwen3-1.7b", "gate_up", 12288, 2048),
        GemmShape("qwen3-1.7b", "down", 2048, 6144),
        GemmShape("qwen3-1.7b", "lm_head", 151936, 2048),
    ),
    "qwen3-8b": (
        GemmShape("qwen3-8b", "qkv", 6144, 4096),
        GemmShape("qwen3-8b", "o", 4096, 4096),
        GemmShape("qwen3-8b", "gate_up", 24576, 4096),
        GemmShape("qwen3-8b", "down", 4096, 12288),
        GemmShape("qwen3-8b", "lm_head", 151936, 4096),
    ),
    "smollm2-135m": (
        GemmShape("smollm2-135m", "qkv", 960, 576),
        GemmShape("smollm2-135m", "o", 576, 576),
        GemmShape("smollm2-135m", "gate_up", 3072, 576),
        GemmShape("smollm2-135m", "down", 576, 1536),
        GemmShape("smollm2-135m", "lm_head", 49152, 576),
    ),
}


def shapes_for(models: tuple[str, ...] | list[str]) -> list[GemmShape]:
    """The shapes of ``models`` in the given order; unknown names raise with the allowed list."""
    out: list[GemmShape] = []
    for model in models:
        if model not in MODEL_SHAPES:
            raise ValueError(f"unknown model {model!r}; expected one of "
                             f"{', '.join(sorted(MODEL_SHAPES))}")
        out.extend(MODEL_SHAPES[model])
    return out
