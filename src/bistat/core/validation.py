"""Validation at the boundary of the statistics core: each argument checked once, where a public
function of :mod:`bistat.core.proportions`, :mod:`bistat.core.throughput`, :mod:`bistat.core.serial`
or the design analysis receives it, with a message that names the value, what is allowed and the
fix (pure: no I/O). The functions below them trust what these return.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np


#: The accepted values of ``alternative`` (scipy's names). ``"greater"`` gives a lower
#: confidence bound (interval ``[low, upper limit]``), ``"less"`` an upper bound.
ALTERNATIVES = ("two-sided", "greater", "less")


def _count(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer count, got the boolean {value!r}")
    try:
        out = operator.index(value)  # accepts int and numpy integers, rejects 3.0 and "3"
    except TypeError:
        raise ValueError(f"{name} must be an integer count, got {value!r}") from None
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def _int_at_least(value: object, name: str, minimum: int) -> int:
    """``value`` as an int of at least ``minimum`` (numpy integers too; never a bool or a float)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got the boolean {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _counts(k: object, n: object, k_name: str = "k", n_name: str = "n") -> tuple[int, int]:
    k_i = _count(k, k_name)
    n_i = _count(n, n_name)
    if n_i == 0:
        raise ValueError(f"{n_name} must be >= 1 (no prompts means no match rate), got 0")
    if k_i > n_i:
        raise ValueError(f"{k_name} must be <= {n_name}, got {k_name}={k_i} > {n_name}={n_i}")
    return k_i, n_i


def _confidence_level(confidence_level: float) -> float:
    cl = float(confidence_level)
    if not 0.0 < cl < 1.0:
        raise ValueError(
            f"confidence_level must be strictly between 0 and 1 (e.g. 0.95), got {confidence_level!r}"
        )
    return cl


def _alternative(alternative: str) -> str:
    if alternative not in ALTERNATIVES:
        allowed = ", ".join(repr(a) for a in ALTERNATIVES)
        raise ValueError(f"alternative must be one of {allowed}; got {alternative!r}")
    return alternative


def _positive_sample(values: Sequence[float], name: str, min_size: int = 2) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a one-dimensional sequence of per-pass throughputs")
    if arr.size < min_size:
        raise ValueError(
            f"{name} needs at least {min_size} counted passes to estimate pass-to-pass variation, "
            f"got {arr.size}; declare workload.passes >= {min_size}"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        bad = [float(v) for v in arr[~(np.isfinite(arr) & (arr > 0))]]
        raise ValueError(f"{name} must hold finite throughputs > 0, got {bad}")
    return arr


def _positive(value: float, name: str) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _probability(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
    return v
