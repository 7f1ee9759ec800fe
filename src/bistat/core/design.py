"""Design analysis: what a declared experiment can and cannot conclude (pure, no I/O).

This module names the design analysis's parts, each a module of its own with its methods stated
in its docstring; the modules of the package import the parts directly:

- :mod:`bistat.core.design_match` -- the **match rate** (Wilson lower bound against a threshold:
  :func:`min_prompts_for_threshold`, :func:`max_mismatches_tolerated`,
  :func:`prob_lower_bound_at_least`) and the **activation criteria**
  (:func:`prob_upper_bound_at_most` for ``control_diverges``, :func:`power_mcnemar` and :func:`power_newcombe` for
  ``treatment_beats_control``), all exact sums over the binomial (or multinomial) support.
- :mod:`bistat.core.design_ratio` -- the **throughput ratio** under the lognormal planning model
  (:func:`log_sd_from_cv`): its interval's expected width (:func:`expected_ratio_halfwidth`,
  :func:`expected_ratio_interval_factor`), the power functions ``power_*`` (Monte Carlo of the
  Welch procedure's sufficient statistics with a fixed seed, :data:`POWER_SEED`), the cost
  rule's outcomes (:func:`cost_outcome_probabilities`, :func:`passes_to_decide`) and the search
  for the passes that reach a power (:func:`min_passes_for_power`).
- :mod:`bistat.core.design_rho` -- the **serial correlation** to plan at, read from an earlier
  run's per-pass values in pass order (:func:`estimate_serial_correlation`).
- :mod:`bistat.core.design_coverage` -- what that correlation does to each cost interval's
  coverage (:func:`interval_coverage`), and when the earlier run contradicts the declared
  interval (:func:`check_interval_assumptions`, ``docs/COST-INTERVALS.md``).
"""
from __future__ import annotations

# Every public name of the parts is read as ``design.NAME`` by the package and its tests, those
# beside ``__all__`` too (the serial-correlation planning, the searches, the support's tail), and
# ``_cosine_draws`` by the tests' Monte Carlo check.
from bistat.core.design_coverage import (  # noqa: F401
    COVERAGE_TOLERANCE, AssumptionCheck, check_interval_assumptions, interval_coverage,
    pairs_to_hold)
from bistat.core.design_match import (  # noqa: F401
    SUPPORT_TAIL, max_matches_below_upper, max_mismatches_tolerated, min_prompts_for_threshold,
    power_mcnemar, power_newcombe, prob_lower_bound_at_least, prob_upper_bound_at_most)
from bistat.core.design_ratio import (  # noqa: F401
    COST_OUTCOMES, POWER_DRAWS, POWER_SEED, _cosine_draws, bisect_power,
    cost_outcome_probabilities, expected_ratio_halfwidth, expected_ratio_interval_factor,
    log_sd_from_cv, min_passes_for_power, passes_to_decide, power_ratio_interval_above,
    power_ratio_interval_below, power_ratio_point_at_least, power_ratio_point_below, power_tost,
    welch_df_equal_variances)
from bistat.core.design_rho import (  # noqa: F401
    MIN_PAIRS_TO_CHECK, RHO_MAX, SerialEstimate, estimate_serial_correlation, planning_rho)

__all__ = [
    "COST_OUTCOMES",
    "POWER_DRAWS",
    "POWER_SEED",
    "cost_outcome_probabilities",
    "passes_to_decide",
    "power_mcnemar",
    "power_newcombe",
    "prob_upper_bound_at_most",
    "expected_ratio_halfwidth",
    "expected_ratio_interval_factor",
    "log_sd_from_cv",
    "max_mismatches_tolerated",
    "min_passes_for_power",
    "min_prompts_for_threshold",
    "power_ratio_interval_above",
    "power_ratio_interval_below",
    "power_ratio_point_at_least",
    "power_ratio_point_below",
    "power_tost",
    "prob_lower_bound_at_least",
    "welch_df_equal_variances",
]
