"""Intervals and tests for batch-invariance experiments (pure: no I/O, no clock, no printing).

Every function takes counts or arrays and returns a frozen result object. The intervals
themselves come from scipy and statsmodels; the arguments are validated once, at this boundary,
the literature's names (``confidence_level``, ``alternative``) translated into statsmodels'
``alpha``, and the method recorded beside every number returned.

This module is the statistics core's one name for its parts, each a module of its own:
:mod:`bistat.core.proportions` (match rates), :mod:`bistat.core.throughput` (per-pass values),
:mod:`bistat.core.stat_results` (the result objects) and :mod:`bistat.core.validation` (the
checks at the boundary). The modules of the core import those parts directly.

Contents
--------
- :func:`match_fraction`, :func:`wilson_interval` -- one arm's match rate (Wilson score interval).
- :func:`newcombe_difference` -- difference of two arms' match rates (Newcombe's hybrid score).
- :func:`intervals_overlap` -- whether two intervals share a point.
- :func:`mcnemar_test` -- paired, prompt-level comparison of two arms.
- :func:`throughput_ratio` -- treatment / control per-pass throughput, Welch interval on logs.
- :func:`paired_ratio` -- the same ratio from passes paired across the arms (paired t on logs).
- :func:`ratio_of_geometric_means` -- the point estimate alone (one pass per arm suffices).
- :func:`tost_ratio` -- TOST equivalence of the throughput ratio within declared margins.
- :func:`pooled_cv` -- pooled pass-to-pass coefficient of variation.
- :func:`block_effect_test` -- whether passes of one engine start are more alike than passes of
  different starts (nested F test on log throughput).
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
