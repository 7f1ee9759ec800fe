"""Whether an experiment's arms' engines stay up together on one GPU.

Each arm's engine takes its declared GPU memory fraction (``gpu_memory_utilization``, else its
kind's ``capabilities.default_memory_fraction``) plus a headroom that no engine's budget covers.
``bistat run`` decides with :func:`resolve_engines_concurrent`; ``bistat register``'s design report
says the same before any data.
"""

from __future__ import annotations

from bistat.declare.experiment import Experiment
from bistat.engines.registry import capabilities

__all__ = ["ENGINE_HEADROOM_FRACTION", "resolve_engines_concurrent"]

#: GPU memory fraction each engine holding GPU memory is assumed to take beyond its declared
#: ``gpu_memory_utilization`` when :func:`resolve_engines_concurrent` decides ``"auto"``: CUDA
#: context, CUDA graphs and the compile workspace are not inside vLLM's budget. Measured on the
#: H200 (139.8 GiB) with vLLM 0.25.0, study ``h200-cost-qwen3-8b-throughput`` (three
#: vllm-offline engines at 0.32 = 44.74 GiB each): the processes held 45.75, 46.06 and
#: 47.74 GiB, 1.0-3.0 GiB over, and the third engine hit ``torch.OutOfMemoryError`` ("Tried to
#: allocate 544.00 MiB ... 231.94 MiB is free") in its first pass, although 3 x 0.32 = 0.96
#: <= 1. 0.03 of a 140 GiB GPU is 4.2 GiB, above the 3.0 GiB measured.
ENGINE_HEADROOM_FRACTION = 0.03


def resolve_engines_concurrent(experiment: Experiment) -> tuple[bool, str]:
    """Whether all arms' engines stay up together, and why.

    The declaration's ``engine.engines_concurrent`` (``true`` / ``false`` / ``"auto"``, default
    ``"auto"``) decides. ``"auto"`` keeps them together when the arms' declared GPU memory
    fractions (``gpu_memory_utilization`` in each arm's engine arguments, SGLang's
    ``mem_fraction_static``: the kind's ``capabilities.memory_fraction_arg``; default
    the kind's ``default_memory_fraction``, 0 for engines holding no GPU memory)
    plus :data:`ENGINE_HEADROOM_FRACTION` per engine that holds GPU memory add up to at most
    1.0: a vLLM engine holds more than its fraction (see the constant). Three vLLM engines at
    0.30 fit on one GPU (0.90 + 3 x 0.03 = 0.99), three at 0.32 do not (1.05); two at vLLM's
    default 0.9 never do. The embedded engine holds no GPU memory: its arms always run together.

    Returns
    -------
    (bool, str)
        Together or not, and the reason in words (recorded as ``run.json``'s
        ``engines_concurrent_reason``), e.g. ``"auto: arms' GPU memory fractions sum to 0.96,
        + 3 x 0.03 headroom = 1.05 > 1; one engine at a time"``.
    """
    declared = getattr(experiment.engine, "engines_concurrent", "auto")
    if isinstance(declared, bool):
        return declared, f"declared engines_concurrent = {str(declared).lower()}"
    caps = capabilities(experiment.engine.kind)
    fractions = []
    for arm in experiment.arms:
        value = experiment.arm_args(arm).get(caps.memory_fraction_arg,
                                             caps.default_memory_fraction)
        fractions.append(float(value))
    total = sum(fractions)
    holders = sum(1 for f in fractions if f > 0.0)
    if holders == 0:
        return True, f"auto: arms' GPU memory fractions sum to {total:g} <= 1"
    need = total + holders * ENGINE_HEADROOM_FRACTION
    # rounded: 4 x 0.22 + 4 x 0.03 is 1.0000000000000002 in binary floating point
    what = (f"auto: arms' GPU memory fractions sum to {total:g}, + {holders} × "
            f"{ENGINE_HEADROOM_FRACTION:g} headroom = {round(need, 6):g}")
    if round(need, 9) <= 1.0:
        return True, f"{what} <= 1"
    return False, f"{what} > 1; one engine at a time"
