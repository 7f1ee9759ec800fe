"""The statistics core's result objects: frozen dataclasses with named fields, each recording the
method and the confidence level beside its numbers (STYLE 1.2). The functions that return them are
in :mod:`bistat.core.proportions` and :mod:`bistat.core.throughput`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """A confidence interval with its level, method and sidedness.

    Attributes
    ----------
    low, high : float
        The bounds. A one-sided interval has the parameter's natural limit as its open end
        (for a proportion ``high == 1.0`` when ``alternative == "greater"``; for a ratio
        ``high == inf``).
    confidence_level : float
        Nominal coverage, e.g. 0.95.
    method : str
        How it was computed, e.g. ``"wilson"``, ``"newcombe-hybrid-score"``, ``"welch-log"``.
    alternative : str
        ``"two-sided"``, ``"greater"`` (lower bound) or ``"less"`` (upper bound).
    """

    low: float
    high: float
    confidence_level: float
    method: str
    alternative: str = "two-sided"

    def contains(self, x: float) -> bool:
        """Return whether ``low <= x <= high`` (the interval is closed)."""
        return bool(self.low <= x <= self.high)

    @property
    def width(self) -> float:
        """``high - low``."""
        return self.high - self.low


@dataclass(frozen=True)
class McNemarResult:
    """Result of :func:`mcnemar_test`.

    Attributes
    ----------
    statistic : float
        Exact test: ``min(b, c)`` (the binomial count). Asymptotic test: the chi-square
        statistic with continuity correction, ``(|b - c| - 1)**2 / (b + c)``.
    pvalue : float
        Two-sided p-value.
    b, c : int
        The discordant counts (arm 1 matched and arm 2 did not; the reverse).
    method : str
        ``"exact-binomial"`` or ``"chi2-continuity-corrected"``.
    """

    statistic: float
    pvalue: float
    b: int
    c: int
    method: str


@dataclass(frozen=True)
class RatioResult:
    """Result of :func:`throughput_ratio` or :func:`paired_ratio` (treatment / control).

    Attributes
    ----------
    ratio : float
        ``exp(mean(log treatment) - mean(log control))``: the ratio of geometric means.
    interval : Interval
        The Welch interval for ``log_diff``, exponentiated.
    df : float
        Welch-Satterthwaite degrees of freedom (``"welch-log"``), or pairs - 1
        (``"paired-log"``).
    log_diff : float
        ``mean(log treatment) - mean(log control)``.
    se : float
        Standard error of ``log_diff`` on the log scale: ``sqrt(s_t**2 / n_t + s_c**2 / n_c)``
        (Welch), or the pair differences' standard deviation over ``sqrt(pairs)`` (paired).
    n_treatment, n_control : int
        Passes per arm (paired: both the number of pairs).
    method : str
        ``"welch-log"`` or ``"paired-log"``.
    """

    ratio: float
    interval: Interval
    df: float
    log_diff: float
    se: float
    n_treatment: int
    n_control: int
    method: str = "welch-log"


@dataclass(frozen=True)
class TostResult:
    """Result of :func:`tost_ratio`.

    Attributes
    ----------
    pvalue : float
        The TOST p-value, the larger of the two one-sided Welch tests' p-values.
    equivalent : bool
        ``pvalue < alpha``: equivalence within ``(low, high)`` is shown.
    low, high : float
        The equivalence margins on the ratio scale.
    alpha : float
        The level of each one-sided test.
    ratio : float
        The point estimate ``exp(log_diff)``.
    statistic_low, statistic_high : float
        Welch t statistics of the tests ``H0: ratio <= low`` and ``H0: ratio >= high``.
    pvalue_low, pvalue_high : float
        Their p-values.
    df : float
        Welch-Satterthwaite degrees of freedom.
    method : str
        ``"tost-welch-log"``.
    """

    pvalue: float
    equivalent: bool
    low: float
    high: float
    alpha: float
    ratio: float
    statistic_low: float
    statistic_high: float
    pvalue_low: float
    pvalue_high: float
    df: float
    method: str = "tost-welch-log"


@dataclass(frozen=True)
class CVResult:
    """Result of :func:`pooled_cv`.

    Attributes
    ----------
    cv : float
        Coefficient of variation of a lognormal with log-scale sd ``sd_log``:
        ``sqrt(exp(sd_log**2) - 1)``.
    sd_log : float
        Pooled within-group standard deviation of log throughput.
    df : int
        Degrees of freedom of the pooled variance, ``sum(n_i - 1)``.
    n_groups : int
        Number of groups that contributed (groups with one value contribute nothing).
    """

    cv: float
    sd_log: float
    df: int
    n_groups: int


@dataclass(frozen=True)
class BlockEffect:
    """Result of :func:`block_effect_test`.

    Attributes
    ----------
    f_stat, p_value : float
        The F statistic of the blocks within each group and its upper-tail p-value.
    df_blocks, df_resid : int
        Its degrees of freedom: blocks beyond one per group, and values beyond one per block.
    n_values, n_blocks, n_groups : int
        The values, the blocks holding at least one, and the groups holding at least one.
    """

    f_stat: float
    p_value: float
    df_blocks: int
    df_resid: int
    n_values: int
    n_blocks: int
    n_groups: int
    method: str = "nested-f-log"
