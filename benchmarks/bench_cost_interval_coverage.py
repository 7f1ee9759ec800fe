#!/usr/bin/env python3
"""Benchmark: coverage of cost intervals when passes are serially correlated.

Prints the full table behind docs/COST-INTERVALS.md: for each interval, the share of simulated
runs whose nominal 95 % interval contains the true ratio, at 8, 16, 32 and 64 pairs of passes and
each arm's own noise independent or AR(1) with rho 0.3, 0.5, 0.7; then each interval's mean width
against the width it would need. Not a timed test::

    python benchmarks/bench_cost_interval_coverage.py                  # 10,000 runs per case
    python benchmarks/bench_cost_interval_coverage.py --reps 2000      # quicker

The data model is tests/helpers_serial.py's: log throughput of each arm
= a drift shared by both arms (Gaussian random walk, step SD 0.01) + the arm's own noise (AR(1),
innovation SD 0.02), true ratio 0.95, pass i of each arm paired. Every run's intervals:

- ``hac`` -- bistat's ``[rule.cost] interval = "hac"`` (``bistat.core.serial.hac_ratio``: the
  equal-weighted cosine interval, B = max(2, floor(0.4 n^(2/3))) terms, t_B critical values);
- ``hac, B rounded`` -- the same with 0.4 n^(2/3) rounded to nearest (Lazarus et al.'s rule as
  written), to show why bistat rounds down;
- ``paired`` -- ``bistat.core.stats.paired_ratio`` (paired t on the log differences);
- ``welch`` -- ``bistat.core.stats.throughput_ratio`` (Welch on each arm's logs);
- ``NW, t`` -- Newey-West (statsmodels' HAC covariance of the mean, Bartlett kernel,
  floor(4 (n/100)^(2/9)) lags: Newey and West 1994) with the paired t's critical value: the
  textbook HAC interval on the real run;
- ``NW, fixed-b`` -- Newey-West with bandwidth M = ceil(1.3 sqrt(n)) (M - 1 lags; Lazarus et al.
  2018) and Kiefer and Vogelsang's (2005) fixed-b critical value at b = M / n, taken from their
  limiting distribution simulated here (iid normal series of 1,000 steps; 50,000 draws per b);
- ``AR(1)-corrected`` -- the paired standard error times sqrt((1 + r) / (1 - r)), r the
  bias-corrected lag-1 autocorrelation of the differences (``lag1_bias_corrected``, clipped to
  [-0.9, 0.95]), t with n - 1 degrees of freedom;
- ``block bootstrap`` -- moving-block bootstrap (Kuensch 1989) of the mean difference, blocks of
  round(n^(1/3)) passes (at least 2), 999 resamples, percentile interval.

bistat's intervals are computed run by run by bistat's own functions; the others over all runs at
once. Before counting, the script checks that bistat's HAC interval with every cosine term is the
paired t interval, and that the vectorized Newey-West standard error is statsmodels' HAC one.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import statsmodels.api as sm
from scipy import fft
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers_serial import correlated_arms  # noqa: E402

from bistat.core.serial import HacSpec, cosine_terms, hac_ratio, lag1_bias_corrected  # noqa: E402
from bistat.core.stats import paired_ratio, throughput_ratio  # noqa: E402

RATIO = 0.95
PAIRS = (8, 16, 32, 64)
RHOS = (0.0, 0.3, 0.5, 0.7)
NOISE_SD, DRIFT_SD = 0.02, 0.01
SEED = 20261204
METHODS = ("hac", "hac, B rounded", "paired", "welch", "NW, t", "NW, fixed-b", "AR(1)-corrected",
           "block bootstrap")


def fixed_b_critical_value(b: float, rng: np.random.Generator, draws: int = 50_000,
                           steps: int = 1000) -> float:
    """The 97.5 % quantile of |t| under Kiefer and Vogelsang's (2005) fixed-b limit for the
    Bartlett kernel at bandwidth ratio ``b``: Newey-West t statistics of iid normal series of
    ``steps`` values with bandwidth ``b * steps`` (their simulation's construction)."""
    m = b * steps
    weights = np.clip(1.0 - np.arange(1, steps) / m, 0.0, None)
    out = []
    for start in range(0, draws, 2000):
        u = rng.standard_normal((min(2000, draws - start), steps))
        mean = u.mean(axis=1)
        v = u - mean[:, None]
        spec = fft.rfft(v, n=2 * steps, axis=1)
        gamma = fft.irfft(spec * np.conj(spec), axis=1)[:, :steps] / steps
        omega = gamma[:, 0] + 2.0 * gamma[:, 1:] @ weights
        out.append(np.abs(math.sqrt(steps) * mean / np.sqrt(omega)))
    return float(np.quantile(np.concatenate(out), 0.95))


def newey_west_se(d: np.ndarray, lags: int) -> float:
    """statsmodels' HAC standard error of the mean (Bartlett weights 1 - j / (lags + 1))."""
    fit = sm.OLS(d, np.ones(d.size)).fit(cov_type="HAC", cov_kwds={"maxlags": lags})
    return float(fit.bse[0])


def newey_west_se_rows(d: np.ndarray, lags: int) -> np.ndarray:
    """:func:`newey_west_se` of every row of ``d`` at once (the formula :func:`validate` checks
    against statsmodels)."""
    n = d.shape[1]
    u = d - d.mean(axis=1, keepdims=True)
    omega = np.sum(u * u, axis=1) / n
    for j in range(1, lags + 1):
        omega += 2 * (1 - j / (lags + 1)) * np.sum(u[:, j:] * u[:, :-j], axis=1) / n
    return np.sqrt(omega / n)


def block_bootstrap_rows(d: np.ndarray, rng: np.random.Generator,
                         resamples: int = 999) -> tuple[np.ndarray, np.ndarray]:
    """Moving-block bootstrap percentile interval of each row's mean, blocks of round(n^(1/3))
    values (at least 2)."""
    reps, n = d.shape
    block = max(2, round(n ** (1 / 3)))
    blocks = math.ceil(n / block)
    low, high = np.empty(reps), np.empty(reps)
    for start in range(0, reps, 100):
        rows = np.arange(start, min(start + 100, reps))
        starts = rng.integers(0, n - block + 1, size=(rows.size, resamples, blocks))
        idx = (starts[..., None] + np.arange(block)).reshape(rows.size, resamples, -1)[..., :n]
        means = np.take_along_axis(d[rows][:, None, :].repeat(resamples, axis=1), idx,
                                   axis=2).mean(axis=2)
        low[rows], high[rows] = np.quantile(means, [0.025, 0.975], axis=1)
    return low, high


def validate(rng: np.random.Generator) -> None:
    t, c = correlated_arms(rng, 4, 16, 0.5)
    full = hac_ratio(t[0], c[0], hac=HacSpec(bandwidth=15))
    paired = paired_ratio(t[0], c[0])
    assert math.isclose(full.interval.low, paired.interval.low, rel_tol=1e-12)
    assert math.isclose(full.interval.high, paired.interval.high, rel_tol=1e-12)
    d = np.log(t) - np.log(c)
    rows = newey_west_se_rows(d, 3)
    assert all(math.isclose(newey_west_se(d[i], 3), rows[i], rel_tol=1e-12) for i in range(4))


def oracle_half_width(pairs: int, rho: float) -> float:
    """1.96 times the true standard error of the mean log difference (AR(1) pairs)."""
    var = 2 * NOISE_SD**2 / (1 - rho**2)
    i = np.arange(pairs)
    return 1.96 * math.sqrt(var * np.sum(rho ** np.abs(i[:, None] - i[None, :]))) / pairs


def run_case(pairs: int, rho: float, reps: int, rng: np.random.Generator,
             fixed_b: dict[int, float]) -> dict[str, tuple[float, float]]:
    """(coverage, mean width over the width needed) of every interval at one grid point."""
    t, c = correlated_arms(rng, reps, pairs, rho, RATIO, NOISE_SD, DRIFT_SD)
    truth = math.log(RATIO)
    rounded = HacSpec(bandwidth=max(1, round(0.4 * pairs ** (2 / 3))))
    bounds: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    bistat = {"hac": lambda i: hac_ratio(t[i], c[i]),
              "hac, B rounded": lambda i: hac_ratio(t[i], c[i], hac=rounded),
              "paired": lambda i: paired_ratio(t[i], c[i]),
              "welch": lambda i: throughput_ratio(t[i], c[i])}
    for name, interval in bistat.items():   # bistat's own functions, run by run
        ivs = [interval(i).interval for i in range(reps)]
        bounds[name] = (np.log([iv.low for iv in ivs]), np.log([iv.high for iv in ivs]))
    d = np.log(t) - np.log(c)
    mean = d.mean(axis=1)
    t_paired = sps.t.ppf(0.975, pairs - 1)
    half = t_paired * newey_west_se_rows(d, math.floor(4 * (pairs / 100) ** (2 / 9)))
    bounds["NW, t"] = (mean - half, mean + half)
    half = fixed_b[pairs] * newey_west_se_rows(d, math.ceil(1.3 * math.sqrt(pairs)) - 1)
    bounds["NW, fixed-b"] = (mean - half, mean + half)
    u = d - mean[:, None]
    r1 = np.sum(u[:, 1:] * u[:, :-1], axis=1) / np.sum(u * u, axis=1)
    r = np.clip([lag1_bias_corrected(x, pairs) for x in r1], -0.9, 0.95)
    half = t_paired * d.std(axis=1, ddof=1) / math.sqrt(pairs) * np.sqrt((1 + r) / (1 - r))
    bounds["AR(1)-corrected"] = (mean - half, mean + half)
    bounds["block bootstrap"] = block_bootstrap_rows(d, rng)
    oracle = 2 * oracle_half_width(pairs, rho)
    return {k: (float(np.mean((low <= truth) & (truth <= high))),
                float(np.mean(high - low)) / oracle) for k, (low, high) in bounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10_000, help="runs per case")
    args = parser.parse_args()
    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    validate(rng)
    fixed_b = {n: fixed_b_critical_value(math.ceil(1.3 * math.sqrt(n)) / n, rng) for n in PAIRS}
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}, statsmodels {sm.__version__}")
    print(f"# model: log throughput = shared random walk (step SD {DRIFT_SD}) + own AR(1) noise "
          f"(innovation SD {NOISE_SD}); true ratio {RATIO}; {args.reps} runs per case, seed {SEED}")
    se = math.sqrt(0.95 * 0.05 / args.reps)
    print(f"# validated: hac with every cosine term = paired t; the Newey-West SE = statsmodels' "
          f"HAC SE. Monte Carlo SE of a coverage near 0.95: {se:.4f}")
    print("# NW, fixed-b critical values (simulated Kiefer-Vogelsang limit): " + ", ".join(
        f"{n} pairs b = {math.ceil(1.3 * math.sqrt(n))}/{n}: {q:.3f}" for n, q in fixed_b.items()))
    print("# hac cosine terms B: " + ", ".join(f"{n} pairs {cosine_terms(n)}" for n in PAIRS)
          + "; rounded: " + ", ".join(f"{n} pairs {max(1, round(0.4 * n ** (2 / 3)))}"
                                      for n in PAIRS))
    results = {(n, rho): run_case(n, rho, args.reps, rng, fixed_b) for n in PAIRS for rho in RHOS}
    heads = ["independent"] + [f"AR(1) rho {r}" for r in RHOS[1:]]
    for title, col in (("coverage of the nominal 95 % interval", 0),
                       ("mean width / the width needed (2 x 1.96 x the true SE)", 1)):
        print()
        print(f"{title}:")
        print()
        print("| interval | pairs | " + " | ".join(heads) + " |")
        print("|---|---|" + "---|" * len(heads))
        for name in METHODS:
            for n in PAIRS:
                cells = [f"{results[(n, rho)][name][col]:.3f}" for rho in RHOS]
                print(f"| {name} | {n} | " + " | ".join(cells) + " |")
    within = [(n, rho) for n in PAIRS for rho in RHOS
              if abs(results[(n, rho)]["hac"][0] - 0.95) <= 0.015]
    print()
    print("# hac within +-1.5 points of 0.95 at: " + ", ".join(f"{n} pairs rho {r}"
                                                              for n, r in within))
    print(f"# wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
