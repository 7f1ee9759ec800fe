"""Passes clustered by engine start (bistat.core.stats.block_effect_test,
bistat.analysis.summary.engine_starts and the finding's *Engine starts* note).

One engine at a time, every block of passes restarts its arm's engine, and the passes of one start
share that start's speed. The per-pass intervals (Welch's, the paired one) treat the passes as
independent: simulated below, they cover less than their level when starts differ, while the
interval on the starts' means holds it. The statistic is checked against scipy's one-way ANOVA and
a hand computation of the nested F.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sps

from bistat.analysis.summary import analyze_run, engine_starts, summary_to_dict
from bistat.core import stats
from bistat.core.schedule import counted_order

ROOT = Path(__file__).resolve().parents[1]
SERIAL = ROOT / "data" / "h200-v034" / "h200-v034-i23-throughput-qwen3-8b-serial-compiled"
CONCURRENT = ROOT / "data" / "h200-v034" / "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled"


def _nested_f(groups):
    """The nested F by hand: cell means against group means, on logs."""
    logs = [[np.log(np.asarray(b, float)) for b in g if len(b)] for g in groups]
    y = np.concatenate([b for g in logs for b in g])
    rss_full = sum(float(((b - b.mean()) ** 2).sum()) for g in logs for b in g)
    rss_red = sum(float(((np.concatenate(g) - np.concatenate(g).mean()) ** 2).sum())
                  for g in logs)
    cells, nonempty = sum(len(g) for g in logs), sum(1 for g in logs if g)
    df1, df2 = cells - nonempty, y.size - cells
    f = ((rss_red - rss_full) / df1) / (rss_full / df2)
    return f, float(sps.f.sf(f, df1, df2)), df1, df2


def test_one_group_is_one_way_anova():
    blocks = [[100.0, 101.0, 99.0], [110.0, 111.0], [95.0, 97.0, 96.0, 94.0]]
    r = stats.block_effect_test([blocks])
    ref = sps.f_oneway(*[np.log(b) for b in blocks])
    assert r.f_stat == pytest.approx(float(ref.statistic), rel=1e-10)
    assert r.p_value == pytest.approx(float(ref.pvalue), rel=1e-8)
    assert (r.df_blocks, r.df_resid, r.n_values, r.n_blocks, r.n_groups) == (2, 6, 9, 3, 1)


def test_two_groups_against_the_nested_f_by_hand():
    """Two arms at different speeds: the arms' own means do not count as a block effect."""
    groups = [[[100.0, 102.0], [104.0, 103.0], [99.0]],
              [[200.0, 203.0], [190.0], [], [201.0, 199.0, 198.0]]]
    r = stats.block_effect_test(groups)
    f, p, df1, df2 = _nested_f(groups)
    assert (r.df_blocks, r.df_resid) == (df1, df2) == (4, 5)
    assert r.f_stat == pytest.approx(f, rel=1e-10) and r.p_value == pytest.approx(p, rel=1e-8)
    assert (r.n_blocks, r.n_groups, r.method) == (6, 2, "nested-f-log")
    # a constant factor on one arm (its own speed) changes nothing
    scaled = [groups[0], [[3.0 * v for v in b] for b in groups[1]]]
    assert stats.block_effect_test(scaled).f_stat == pytest.approx(r.f_stat, rel=1e-9)


@pytest.mark.parametrize("groups, message", [
    ([[[1.0, 2.0]], [[3.0, 4.0]]], "a group with two or more blocks"),
    ([[[1.0], [2.0]], [[3.0]]], "a block with two or more values"),
    ([[[1.0, 2.0], [0.0, 1.0]]], "groups[0][1]"),
])
def test_what_cannot_be_tested_is_refused(groups, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        stats.block_effect_test(groups)


def _abba_starts(passes: int, arms=("ctl", "trt"), each_its_own: bool = False) -> dict:
    """(arm, pass index) -> the engine start it runs in, for the counted passes of ABBA
    (``counted_order``, as make_run records them too) one engine at a time: a start per run of
    one arm's passes, or, ``each_its_own``, a start per pass. In time order."""
    starts, b, seen = {}, -1, {a: 0 for a in arms}
    order = counted_order(list(arms), passes=passes, order="abba", seed=0)
    for i, arm in enumerate(order):
        b += each_its_own or i == 0 or arm != order[i - 1]
        starts[(arm, seen[arm])] = b
        seen[arm] += 1
    return starts


def test_the_f_test_holds_its_level_without_start_effects():
    rng = np.random.default_rng(11)
    starts = _abba_starts(16)
    hits = 0
    for _ in range(2000):
        cells: dict[str, dict[int, list[float]]] = {"ctl": {}, "trt": {}}
        for (arm, _), b in starts.items():
            cells[arm].setdefault(b, []).append(math.exp(rng.normal(0.0, 0.03)))
        hits += stats.block_effect_test([list(c.values()) for c in cells.values()]).p_value < 0.05
    assert 0.035 <= hits / 2000 <= 0.065          # 5 % within about 3 binomial SDs


@pytest.mark.parametrize("sd_start, want_pass_below", [(0.0, None), (0.03, 0.92)])
def test_per_start_interval_covers_where_the_per_pass_one_does_not(sd_start, want_pass_below):
    """2,000 seeded serial ABBA runs of 16 passes per arm, true ratio 1, pass SD 0.03 on logs,
    each start's speed drawn with SD ``sd_start``: with no start effect both intervals hold 95 %;
    with a start SD equal to the pass SD the per-pass Welch interval covers about 89 % (what
    engine_starts' docstring quotes), the starts' one about 95 %. Through engine_starts itself."""
    rng = np.random.default_rng(5)
    starts, arms = _abba_starts(16), ("ctl", "trt")
    covered = {"pass": 0, "start": 0}
    runs = 2000
    for _ in range(runs):
        speed = rng.normal(0.0, sd_start, size=max(starts.values()) + 1)
        passes = [SimpleNamespace(arm=arm, counted=True, block=b, output_tokens_per_s=1000.0
                                  * math.exp(speed[b] + rng.normal(0.0, 0.03)))
                  for (arm, _), b in starts.items()]
        tp = {arm: [q.output_tokens_per_s for q in passes if q.arm == arm] for arm in arms}
        # the comparison carries its per-pass ratio, as the analysis's does
        compared = SimpleNamespace(treatment="trt", control="ctl",
                                   ratio=stats.throughput_ratio(tp["trt"], tp["ctl"], 0.95))
        summary = SimpleNamespace(passes=passes, confidence_level=0.95, comparisons=[compared],
                                  arms=[SimpleNamespace(name=arm) for arm in arms])
        (_, _, per_pass, per_start), = engine_starts(summary).ratios
        covered["pass"] += per_pass.interval.low <= 1.0 <= per_pass.interval.high
        covered["start"] += per_start.interval.low <= 1.0 <= per_start.interval.high
    assert 0.935 <= covered["start"] / runs <= 0.965
    if want_pass_below is None:
        assert 0.935 <= covered["pass"] / runs <= 0.965
    else:
        assert 0.87 <= covered["pass"] / runs <= want_pass_below


def test_the_committed_serial_run():
    """The workload-(i) run of 2026-12-03 with one engine at a time (stopped after 11 counted
    passes per arm, two per start but the first): recomputed from passes.jsonl by hand."""
    summary = analyze_run(SERIAL)
    starts = engine_starts(summary)
    assert starts.arms == (("default", 11, 6), ("bi-tuned-gemm-compiled", 11, 6))
    recs = [json.loads(x) for x in (SERIAL / "passes.jsonl").read_text().splitlines()]
    cells: dict[str, dict[int, list[float]]] = {}
    for r in recs:
        if r["kind"] == "counted" and r["status"] == "complete":
            cells.setdefault(r["arm"], {}).setdefault(r["block"], []).append(
                r["output_tokens_per_s"])
    f, p, df1, df2 = _nested_f([list(blocks.values()) for blocks in cells.values()])
    assert (starts.effect.df_blocks, starts.effect.df_resid) == (df1, df2) == (10, 10)
    assert starts.effect.f_stat == pytest.approx(f) and starts.effect.p_value == pytest.approx(p)
    assert round(starts.effect.f_stat, 2) == 2.46 and not starts.starts_differ
    (t, c, per_pass, per_start), = starts.ratios
    assert (t, c) == ("bi-tuned-gemm-compiled", "default")
    ratio = summary.comparisons[0].ratio                 # the finding's per-pass table
    assert (per_pass.ratio, per_pass.interval) == (ratio.ratio, ratio.interval)
    gm = {arm: [math.exp(np.mean(np.log(v))) for v in cells[arm].values()] for arm in cells}
    logs_t, logs_c = np.log(gm[t]), np.log(gm[c])
    se = math.sqrt(logs_t.var(ddof=1) / 6 + logs_c.var(ddof=1) / 6)
    dof = se ** 4 / ((logs_t.var(ddof=1) / 6) ** 2 / 5 + (logs_c.var(ddof=1) / 6) ** 2 / 5)
    half = float(sps.t.ppf(0.975, dof)) * se
    d = logs_t.mean() - logs_c.mean()
    assert per_start.ratio == pytest.approx(math.exp(d))
    assert (per_start.interval.low, per_start.interval.high) == pytest.approx(
        (math.exp(d - half), math.exp(d + half)))
    assert (round(per_start.interval.low, 4), round(per_start.interval.high, 4)) == (0.8831, 1.1037)
    data = summary_to_dict(summary)["engine_starts"]
    assert data["arms"][0] == {"arm": "default", "n_passes": 11, "n_starts": 6}
    assert data["effect"]["df_blocks"] == 10 and data["starts_differ"] is False
    assert data["ratios"][0]["per_start"]["n_treatment"] == 6


def test_engines_up_together_have_one_start():
    assert engine_starts(analyze_run(CONCURRENT)) is None
    assert summary_to_dict(analyze_run(CONCURRENT))["engine_starts"] is None


def test_the_finding_says_when_starts_differ_and_gives_the_ratio_per_start(tmp_path):
    from helpers_analysis import declaration, make_run, register_tiny

    from bistat.report.finding import render_markdown

    blocks = _abba_starts(6)
    assert [blocks[("ctl", p)] for p in range(6)] == [0, 2, 2, 4, 4, 6]
    speed = [1.00, 1.10, 0.90, 1.15, 0.95, 1.05, 1.00]        # each start's own, +-15 %

    def tp(arm: str, p: int) -> float:
        return (100.0 if arm == "ctl" else 95.0) * speed[blocks[(arm, p)]] * (1 + 0.002 * (p % 2))

    reg = register_tiny(tmp_path, declaration(passes=6))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], passes=6, throughput=tp,
                             block=lambda arm, p: blocks[(arm, p)]))
    starts = engine_starts(s)
    assert starts.arms == (("ctl", 6, 4), ("trt", 6, 3))
    assert starts.effect.df_blocks == (4 - 1) + (3 - 1) and starts.effect.df_resid == 12 - 7
    assert starts.starts_differ and starts.effect.p_value < 1e-6
    (_, _, per_pass, per_start), = starts.ratios
    ctl_means = [100.0 * speed[0], 100.0 * math.sqrt(speed[2] ** 2 * 1.002),
                 100.0 * math.sqrt(speed[4] ** 2 * 1.002), 100.0 * speed[6] * 1.002]
    trt_means = [95.0 * math.sqrt(speed[b] ** 2 * 1.002) for b in (1, 3, 5)]
    want = stats.throughput_ratio(trt_means, ctl_means, 0.95)
    assert per_start.ratio == pytest.approx(want.ratio)
    assert (per_start.interval.low, per_start.interval.high) == pytest.approx(
        (want.interval.low, want.interval.high))
    assert per_start.interval.high - per_start.interval.low > \
        per_pass.interval.high - per_pass.interval.low                # fewer, truer units
    text = render_markdown(s)
    assert "**Engine starts.**" in text and "| ctl | 6 | 4 |" in text and "| trt | 6 | 3 |" in text
    assert f"F(5, 5) = {starts.effect.f_stat:.2f}" in text
    assert "the starts, not the passes, are the independent units here" in text
    assert (f"| trt ÷ ctl | {per_pass.ratio:.4f} [{per_pass.interval.low:.4f}, "
            f"{per_pass.interval.high:.4f}] | {per_start.ratio:.4f} [{per_start.interval.low:.4f}, "
            f"{per_start.interval.high:.4f}] | 3 / 4 |") in text


def test_a_start_per_pass_has_no_f_test_and_one_start_has_no_note(tmp_path):
    from helpers_analysis import declaration, make_run, register_tiny

    from bistat.report.finding import render_markdown

    reg = register_tiny(tmp_path, declaration(passes=3))
    blocks = _abba_starts(3, each_its_own=True)
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], passes=3,
                             throughput=lambda arm, p: 100.0 + 3 * p + (arm == "trt"),
                             block=lambda arm, p: blocks[(arm, p)], run_name="own"))
    starts = engine_starts(s)
    assert starts.arms == (("ctl", 3, 3), ("trt", 3, 3)) and starts.effect is None
    assert starts.ratios[0][3].n_treatment == 3                      # each pass its own start
    assert "No start held two counted passes of one arm" in render_markdown(s)
    one = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: [i], passes=3,
                               block=lambda arm, p: 0, run_name="one"))
    assert engine_starts(one) is None and "Engine starts" not in render_markdown(one)
