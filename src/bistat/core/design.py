"""Design analysis: what a declared experiment can and cannot conclude (pure, no I/O).

This module names the design analysis's parts, each a module of its own:
:mod:`bistat.core.design_match` (the match-rate and activation criteria),
:mod:`bistat.core.design_ratio` (the throughput ratio: its interval's width, power, the cost
rule's outcomes), :mod:`bistat.core.design_rho` (the serial correlation to plan at, from an
earlier run) and :mod:`bistat.core.design_coverage` (what it does to each cost interval). The
modules of the package import those parts directly.

Two halves, matching the two kinds of criteria in a decision rule:

- **Match rate** (Wilson lower bound against a threshold): :func:`min_prompts_for_threshold`,
  :func:`max_mismatches_tolerated`, :func:`prob_lower_bound_at_least`. These are exact: they
  call :func:`bistat.core.proportions.wilson_interval` itself and the binomial distribution.
- **Throughput ratio** (Welch interval on log per-pass throughput, see
  :func:`bistat.core.stats.throughput_ratio`): :func:`expected_ratio_halfwidth`,
  :func:`expected_ratio_interval_factor` and the power functions ``power_*``.

Planning model for throughput: per-pass throughput of each arm is lognormal with the same
coefficient of variation ``cv`` in both arms, i.e. normal on the log scale with standard
deviation ``sigma = sqrt(log(1 + cv**2))`` (:func:`log_sd_from_cv`), the same convention as
:func:`bistat.core.stats.pooled_cv`. Both arms have ``passes_per_arm`` counted passes.

Activation criteria (:func:`prob_upper_bound_at_most` for ``control_diverges``,
:func:`power_mcnemar` and :func:`power_newcombe` for ``treatment_beats_control``) are computed
exactly by summing over the binomial (or multinomial) support, under the planning model that
prompts match independently, with the declared rate per arm, and the two arms independently.
The cost rule's outcomes (:func:`cost_outcome_probabilities`, :func:`passes_to_decide`) use the
Welch draws below, or, for a paired interval, the paired t's: the same mean log difference
and one ``chi2(n - 1)`` variance, ``n - 1`` degrees of freedom.

Serial correlation (the last section): passes on one engine carry over from one to the next.
:func:`estimate_serial_correlation` reads it from an earlier run's per-pass values in pass order;
a paired or HAC cost interval is planned under AR(1) pairs with that lag-1 autocorrelation
(``rho``) from the exact normal distribution of the mean and the cosine transforms the interval
uses (:func:`_cosine_draws`); :func:`interval_coverage` gives each interval's coverage there and
:func:`check_interval_assumptions` says when the earlier run contradicts the declared interval
(``docs/COST-INTERVALS.md``).

Power of the point-estimate criteria is exact (normal distribution). Power of the interval
criteria and of TOST is computed by Monte Carlo from the exact sampling distribution of the
Welch procedure's sufficient statistics -- the difference of log means
``D ~ N(log r, 2 sigma**2 / n)`` and the two sample variances ``s_i**2 ~ sigma**2 chi2(n-1) /
(n-1)``, all independent -- because the Welch interval uses an *estimated*
(Welch-Satterthwaite) degrees of freedom; a noncentral t with the nominal ``2 (n - 1)`` degrees
of freedom is badly optimistic at two or three passes per arm. The draws use a fixed seed
(:data:`POWER_SEED`) and :data:`POWER_DRAWS` replicates, so results are deterministic; the
Monte Carlo standard error is at most ``0.5 / sqrt(POWER_DRAWS)`` = 0.0011.
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
