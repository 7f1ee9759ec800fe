"""Intervals and tests for batch-invariance experiments (pure: no I/O, no clock, no printing).

Every function takes counts or arrays and returns a frozen result object. The intervals
themselves come from scipy and statsmodels; the arguments are validated once, at this boundary,
the literature's names (``confidence_level``, ``alternative``) translated into statsmodels'
``alpha``, and the method recorded beside every number returned.

This module names the statistics core's parts, each a module of its own with its contents listed
in its docstring; the modules of the core import the parts directly:

- :mod:`bistat.core.proportions` -- match rates: one arm's (:func:`wilson_interval`), two arms'
  difference (:func:`newcombe_difference`), the paired comparison (:func:`mcnemar_test`).
- :mod:`bistat.core.throughput` -- per-pass values: the ratio's Welch and paired intervals
  (:func:`throughput_ratio`, :func:`paired_ratio`), TOST, the pooled CV, the block effect.
- :mod:`bistat.core.stat_results` -- the result objects (:class:`Interval`,
  :class:`RatioResult`, ...).
- :mod:`bistat.core.validation` -- the checks at the boundary.
"""
from __future__ import annotations

from bistat.core.proportions import (  # noqa: F401 - MCNEMAR_EXACT_BELOW read through here too
    MCNEMAR_EXACT_BELOW, intervals_overlap, match_fraction, mcnemar_test, newcombe_difference,
    wilson_interval)
from bistat.core.stat_results import (BlockEffect, CVResult, Interval, McNemarResult, RatioResult,
                                      TostResult)
from bistat.core.throughput import (block_effect_test, geometric_mean, paired_ratio, pooled_cv,
                                    ratio_of_geometric_means, throughput_ratio, tost_ratio)
from bistat.core.validation import (  # noqa: F401 - the shared checks, read through here too
    ALTERNATIVES, _confidence_level, _int_at_least, _positive_sample)

__all__ = [
    "ALTERNATIVES",
    "BlockEffect",
    "CVResult",
    "Interval",
    "McNemarResult",
    "RatioResult",
    "TostResult",
    "block_effect_test",
    "geometric_mean",
    "intervals_overlap",
    "match_fraction",
    "mcnemar_test",
    "newcombe_difference",
    "pooled_cv",
    "ratio_of_geometric_means",
    "paired_ratio",
    "throughput_ratio",
    "tost_ratio",
    "wilson_interval",
]
