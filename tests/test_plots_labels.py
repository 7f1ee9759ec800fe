"""The finding's plots say what they show: the match plot's count labels stay inside the axes
(a "0/24" beside an interval starting at 0 printed over the arm's name), and the running-requests
plot draws the engine's per-step batches where it recorded them rather than holding the pass's
first sample (1 running at t = 0) for a second."""

from __future__ import annotations

from types import SimpleNamespace

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bistat.analysis.passes import MetricsSeries
from bistat.core import stats
from bistat.report.plots import match_forest, running_over_time


def _arm(name, role, k, n):
    return SimpleNamespace(name=name, role=role, n_matched=k, n_units=n, unit="prompt",
                           match_interval=stats.wilson_interval(k, n, 0.95))


def test_match_counts_stay_inside_the_axes():
    summary = SimpleNamespace(
        arms=[_arm("default", "control", 0, 24), _arm("invariant", "treatment", 24, 24)],
        declaration={"rule": {"labels": []}}, confidence_level=0.95, match_unit="token_ids",
        multi_pass="all")
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    match_forest(summary, fig)
    fig.canvas.draw()
    (ax,) = fig.axes
    box = ax.get_window_extent()
    texts = {t.get_text(): t for t in ax.texts}
    renderer = fig.canvas.get_renderer()
    for label in ("0/24", "24/24"):
        extent = texts[label].get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, label
    # 0/24 starts at the axis: its count goes right of the interval; 24/24 keeps the left side
    assert texts["0/24"].get_ha() == "left" and texts["24/24"].get_ha() == "right"
    assert ax.get_xlabel() == "match rate per prompt (95 % two-sided Wilson interval)"


def _pass(arm, seq):
    return SimpleNamespace(arm=arm, seq=seq, counted=True)


def test_running_plot_draws_the_engine_steps_not_the_first_sample_held():
    series = MetricsSeries("a", 0, t=(0.0, 1.0, 2.0), running=(1.0, 5.5, 8.0),
                           step_t=(0.2, 0.6, 1.4), step_batch=(1.0, 8.0, 8.0))
    summary = SimpleNamespace(passes=[_pass("a", 0)], metrics=[series],
                              declaration={"validity": {}}, arms=[SimpleNamespace(name="a")])
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    running_over_time(summary, fig)
    (ax,) = fig.axes
    (line,) = ax.get_lines()
    # where="pre": a step's batch is drawn over the time since the previous step ended
    assert line.get_drawstyle() == "steps-pre"
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(0.0, 1.0), (0.2, 1.0), (0.6, 8.0),
                                                             (1.4, 8.0)]
    assert ax.get_ylabel() == "requests per engine step"


def test_running_plot_holds_each_sample_without_step_records():
    series = MetricsSeries("a", 0, t=(0.0, 0.25), running=(2.0, 6.0))
    summary = SimpleNamespace(passes=[_pass("a", 0)], metrics=[series],
                              declaration={"validity": {}}, arms=[SimpleNamespace(name="a")])
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    running_over_time(summary, fig)
    (ax,) = fig.axes
    (line,) = ax.get_lines()
    assert line.get_drawstyle() == "steps-post"
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(0.0, 2.0), (0.25, 6.0)]
    assert ax.get_ylabel() == "running requests"


