"""What the sections of ``kernels/RESULTS.md`` share: the goals' targets, the models' layer
counts, the geometric mean and the provenance record. Needs only the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


# The earlier goals: the targets of bench files that carry no ``summary.goal_targets`` (recorded
# before bench files stated their targets); newer files state their own (bench.GOAL_OVERALL,
# bench.GOAL_DECODE).
GOAL_OVERALL = 1.15
GOAL_DECODE = 1.25
SPEEDUP_GOAL = 2.5  # tuned over vLLM's fixed default at decode sizes (geometric mean)
# Layers per model, for the per-decode-step sum (config.json num_hidden_layers).
LAYERS = {"qwen3-8b": 36, "qwen3-1.7b": 28, "smollm2-135m": 30}
DECODE_LAYERS = ("qkv", "o", "gate_up", "down")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


@dataclass(frozen=True)
class Provenance:
    """Where an artefact was measured; ``ident`` and ``rest`` hold only the fields it records."""

    gpu_name: str
    ident: tuple[str, ...]      # "UUID …", "serial …"
    rest: tuple[str, ...]       # "driver …", "torch …", "CUDA …", "triton …"
    date_utc: str
    command: str
    vllm: str | None = None
    vllm_commit: str | None = None


def provenance(prov: dict[str, Any]) -> Provenance:
    return Provenance(
        gpu_name=str(prov.get("gpu_name", "?")),
        ident=tuple(f"{label} {prov[key]}" for label, key in (("UUID", "gpu_uuid"),
                                                              ("serial", "gpu_serial"))
                    if key in prov),
        rest=tuple(f"{label} {prov[key]}" for label, key in (
            ("driver", "driver"), ("torch", "torch"), ("CUDA", "cuda"), ("triton", "triton"))
            if key in prov),
        date_utc=str(prov.get("date_utc", "?")), command=str(prov.get("command", "?")),
        vllm=prov.get("vllm"), vllm_commit=prov.get("vllm_commit"))
