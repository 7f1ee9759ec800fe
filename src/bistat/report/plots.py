"""The finding's PNG plots, drawn from a finished :class:`bistat.analysis.results.RunSummary`.

Every plot uses matplotlib's object API on a bare :class:`matplotlib.figure.Figure` (rendered by
Agg), under matplotlib's default style whatever the user's ``matplotlibrc`` says, with a fixed
size and dpi, and is saved with ``metadata={"Software": None}`` so that regenerating a finding
from the same data gives byte-identical files (the pytest-mpl convention, STYLE.md §6). No
statistic is computed here: intervals and ratios come from the summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import matplotlib as mpl
import matplotlib.style
from matplotlib.figure import Figure

if TYPE_CHECKING:  # pragma: no cover
    from bistat.analysis.results import RunSummary

__all__ = ["PLOTS", "save_plots", "match_forest", "throughput_passes", "passes_in_order",
           "divergence_positions", "running_over_time"]

FIGSIZE = (7.0, 3.6)
DPI = 100
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _color(summary: "RunSummary", arm: str) -> str:
    names = [a.name for a in summary.arms]
    return _COLORS[names.index(arm) % len(_COLORS)] if arm in names else "#7f7f7f"


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})


def _criteria(summary: "RunSummary", name: str) -> list[dict]:
    out = []
    for spec in summary.declaration.get("rule", {}).get("labels", []):
        for c in spec.get("all", spec.get("criteria", [])):
            if c.get("criterion") == name:
                out.append({**c, "label": spec.get("label")})
    return out


def match_forest(summary: "RunSummary", fig: Figure) -> None:
    """Match rate with its Wilson interval per arm (forest plot), rule thresholds dashed."""
    ax = fig.subplots()
    arms = [a for a in summary.arms if a.match_interval is not None]
    lows = [a.match_interval.low for a in arms] or [0.0]
    x_min, x_max = max(0.0, min(lows) - 0.06), 1.02
    for i, a in enumerate(arms):
        iv = a.match_interval
        rate = a.n_matched / a.n_units
        ax.errorbar([rate], [i], xerr=[[rate - iv.low], [iv.high - rate]], fmt="o", capsize=4,
                    color=_color(summary, a.name))
        # the count beside the interval, on the side with room inside the axes: left of an
        # interval that starts at the axis ("0/24" from 0) it would print over the arm's label
        room = 0.12 * (x_max - x_min)
        if iv.low - x_min >= room:
            where, offset, ha = iv.low, -6, "right"
        elif x_max - iv.high >= room:
            where, offset, ha = iv.high, 6, "left"
        else:
            where, offset, ha = rate, 0, "center"
        ax.annotate(f"{a.n_matched}/{a.n_units}", (where, i),
                    xytext=(offset, 0 if ha != "center" else 8), textcoords="offset points",
                    va="center", ha=ha, fontsize=8)
    for c in _criteria(summary, "match_lower_bound"):
        ax.axvline(c["at_least"], color="0.4", linestyle="--", linewidth=1)
        ax.annotate(f"{c['label']}: {c['arm']} lower end >= {c['at_least']:g}",
                    (c["at_least"], len(arms) - 0.5), xytext=(-4, 0), textcoords="offset points",
                    ha="right", fontsize=7, color="0.3")
    ax.set_yticks(range(len(arms)), [f"{a.name} ({a.role})" for a in arms])
    ax.set_ylim(-0.6, len(arms) - 0.3)
    ax.set_xlim(x_min, x_max)
    ax.set_xlabel(f"match rate per {arms[0].unit if arms else 'prompt'} "
                  f"({summary.confidence_level * 100:g} % two-sided Wilson interval)")
    ax.set_title(f"Match ({summary.match_unit}, {summary.multi_pass} passes)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()


def throughput_passes(summary: "RunSummary", fig: Figure) -> None:
    """Per-pass output tokens/s by schedule position, and the ratio with its interval."""
    ax, ax2 = fig.subplots(1, 2, width_ratios=(2.2, 1))
    for a in summary.arms:
        ps = [p for p in summary.passes if p.arm == a.name and p.counted
              and p.output_tokens_per_s is not None]
        ax.plot([p.seq for p in ps], [p.output_tokens_per_s for p in ps], "o",
                color=_color(summary, a.name), label=f"{a.name} ({a.role})")
        warm = [p for p in summary.passes if p.arm == a.name and p.kind == "warmup"
                and p.output_tokens_per_s is not None]
        if warm:
            ax.plot([p.seq for p in warm], [p.output_tokens_per_s for p in warm], "o",
                    mfc="none", color=_color(summary, a.name))
    ax.set_xlabel("schedule position (open: warm-up, not counted)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Per-pass throughput")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    labels = []
    for i, c in enumerate(summary.comparisons):
        if c.ratio is not None:
            iv = c.ratio.interval
            ax2.errorbar([i], [c.ratio.ratio], yerr=[[c.ratio.ratio - iv.low],
                                                    [iv.high - c.ratio.ratio]],
                         fmt="o", capsize=4, color=_color(summary, c.treatment))
        elif c.ratio_point is not None:
            ax2.plot([i], [c.ratio_point], "o", color=_color(summary, c.treatment))
        labels.append(c.treatment)
    ax2.axhline(1.0, color="0.2", linewidth=1)
    bounds = sorted({float(c[k]) for n in ("throughput_ratio", "throughput_slower",
                                          "throughput_not_slower")
                     for c in _criteria(summary, n)
                     for k in ("below", "at_least", "bound", "margin_low", "margin_high",
                               "lower_at_least") if c.get(k) is not None})
    for b in bounds:
        ax2.axhline(b, color="0.5", linestyle="--", linewidth=0.8)
    ax2.set_xticks(range(len(labels)), labels)
    ax2.set_xlim(-0.6, max(len(labels), 1) - 0.4)
    ax2.set_ylabel("treatment ÷ control")
    ax2.set_title(f"Ratio ({summary.confidence_level * 100:g} % CI)", fontsize=10)
    ax2.grid(axis="y", alpha=0.3)
    fig.tight_layout()


_METRIC_LABELS = {"throughput": "output tokens/s", "latency": "mean request latency (s)"}


def _r(c) -> str:
    """A series' lag-1 autocorrelation for a legend (``r₁ 0.47``; ``r₁ —`` without one)."""
    return "r₁ —" if c is None or c.lag1 is None else f"r₁ {c.lag1:.2f}"


def passes_in_order(summary: "RunSummary", fig: Figure) -> None:
    """Each arm's per-pass metric against pass order (the series whose serial correlation the
    finding states), and each comparison's pair differences in pass order."""
    ax, ax2 = fig.subplots(1, 2, width_ratios=(1.5, 1))
    sp = summary.serial
    metric = "throughput" if sp is None else sp.metric
    for a in () if sp is None else sp.arms:
        ax.plot(a.passes, a.values, "o-", markersize=3, linewidth=1,
                color=_color(summary, a.arm), label=f"{a.arm} ({_r(a.correlation)})")
    drawn = False
    for p in () if sp is None else sp.pairs:
        if p.log_differences:
            ax2.plot(p.passes, p.log_differences, "o-", markersize=3, linewidth=1,
                     color=_color(summary, p.treatment),
                     label=f"{p.treatment} ({_r(p.differences)})")
            drawn = True
    if sp is not None and sp.arms:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no counted pass with a value", ha="center", va="center",
                transform=ax.transAxes)
    if drawn:
        ax2.axhline(0.0, color="0.2", linewidth=1)
        ax2.legend(fontsize=7, loc="best")
    else:
        ax2.text(0.5, 0.5, "no pairs of passes", ha="center", va="center",
                 transform=ax2.transAxes)
    ax.set_xlabel("pass index (pass order)")
    ax.set_ylabel(_METRIC_LABELS[metric])
    ax.set_title("Passes in pass order")
    ax.grid(alpha=0.3)
    ax2.set_xlabel("pass index (pass order)")
    ax2.set_ylabel("log(treatment ÷ control)")
    ax2.set_title("Pair differences", fontsize=10)
    ax2.grid(alpha=0.3)
    fig.tight_layout()


def divergence_positions(summary: "RunSummary", fig: Figure) -> None:
    """Histogram of first-divergence token positions per arm."""
    ax = fig.subplots()
    positions = {a.name: [d.position for d in a.divergences] for a in summary.arms}
    top = max((max(v) for v in positions.values() if v), default=0)
    bins = [x - 0.5 for x in range(0, top + 2)]
    drawn = False
    for a in summary.arms:
        if positions[a.name]:
            ax.hist(positions[a.name], bins=bins, alpha=0.6, color=_color(summary, a.name),
                    label=f"{a.name} ({len(positions[a.name])})")
            drawn = True
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no divergence in any arm", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("first-divergence token index (vs the arm's first counted pass)")
    ax.set_ylabel("passes")
    ax.set_title("Where outputs first diverge")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()


def running_over_time(summary: "RunSummary", fig: Figure) -> None:
    """Running requests over time within each counted pass (engine metrics): the batch of every
    engine step where the engine recorded them (each drawn over the step it ended), else each
    sample held until the next."""
    ax = fig.subplots()
    counted = {(p.arm, p.seq) for p in summary.passes if p.counted}
    seen: set[str] = set()
    stepped = False
    for s in summary.metrics:
        if (s.arm, s.seq) not in counted:
            continue
        label = s.arm if s.arm not in seen else None
        seen.add(s.arm)
        if s.step_t:   # a step's batch stands for the time since the previous step ended
            stepped = True
            ax.step((0.0, *s.step_t), (s.step_batch[0], *s.step_batch), where="pre",
                    color=_color(summary, s.arm), alpha=0.7, linewidth=1, label=label)
        else:
            ax.step(s.t, s.running, where="post", color=_color(summary, s.arm), alpha=0.7,
                    linewidth=1, label=label)
    floor = summary.declaration.get("validity", {}).get("min_mean_running")
    if floor is not None:
        ax.axhline(floor, color="0.4", linestyle="--", linewidth=1,
                   label=f"declared floor (mean) {floor:g}")
    if seen or floor is not None:
        ax.legend(fontsize=8)
    if not seen:
        ax.text(0.5, 0.5, "no engine metrics recorded", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("seconds since pass start")
    ax.set_ylabel("requests per engine step" if stepped else "running requests")
    ax.set_ylim(bottom=0)
    ax.set_title("Batching: running requests in counted passes")
    ax.grid(alpha=0.3)
    fig.tight_layout()


#: (file suffix, title, drawing function) of every plot, in the finding's order.
PLOTS: tuple[tuple[str, str, Callable[["RunSummary", Figure], None]], ...] = (
    ("match", "Match intervals per arm", match_forest),
    ("throughput", "Per-pass throughput and the ratio interval", throughput_passes),
    ("serial", "Passes in pass order and the pair differences", passes_in_order),
    ("divergence", "First-divergence positions", divergence_positions),
    ("running", "Running requests over time", running_over_time),
)


def save_plots(summary: "RunSummary", out_dir: Path, stem: str) -> dict[str, Path]:
    """Draw every plot of :data:`PLOTS` into ``out_dir/<stem>-<suffix>.png``; return the paths."""
    out: dict[str, Path] = {}
    with mpl.style.context("default"), mpl.rc_context({"svg.hashsalt": "bistat",
                                                       "path.simplify": True}):
        for suffix, _title, draw in PLOTS:
            fig = Figure(figsize=FIGSIZE, dpi=DPI)
            draw(summary, fig)
            path = Path(out_dir) / f"{stem}-{suffix}.png"
            _save(fig, path)
            out[suffix] = path
    return out
