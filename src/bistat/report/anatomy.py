"""The finding's "Divergence anatomy" section and plot, from an :class:`~bistat.analysis.anatomy.Anatomy`.

:mod:`bistat.analysis.anatomy` labels each first divergence and counts them per arm (with the
quantiles of their margins and positions); this module only formats those numbers as markdown and
draws them. :mod:`bistat.report.finding` wires both into the finding.
"""

from __future__ import annotations

import math
from pathlib import Path

from bistat.analysis.anatomy import JITTER, LARGE_DRIFT, NEAR_TIE, UNDETERMINED, Anatomy, ArmAnatomy
from bistat.core.markdown import md_table

__all__ = ["plot_anatomy", "render_anatomy_section"]


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _share(a: ArmAnatomy, label: str) -> str:
    s = a.share(label)
    return "—" if s is None else f"{a.count(label)} ({100 * s:.0f} %)"


def render_anatomy_section(anatomy: Anatomy, plot_file: str | None = None,
                           max_listed: int = 200) -> str:
    """The finding's "Divergence anatomy" section as markdown (deterministic text)."""
    out = ["## Divergence anatomy", "",
           f"At each first divergence (against the arm's first counted pass) the two candidate "
           f"tokens' logprobs are compared in both passes: a margin within ε = {anatomy.epsilon:g} "
           f"nats is a *near-tie flip* (what a different reduction order's rounding causes), one "
           f"beyond it a *large drift* (worth a bug report). Top-k recorded per position: "
           f"{anatomy.top_k if anatomy.top_k is not None else 'none'}.", ""]
    rows = []
    for a in anatomy.arms:
        mq, pq, rq = a.margin_quantiles, a.position_quantiles, a.relative_position_quantiles
        rows.append((a.arm, str(a.n_divergences), _share(a, NEAR_TIE), _share(a, LARGE_DRIFT),
                     _share(a, JITTER), _share(a, UNDETERMINED),
                     "—" if mq is None else f"{_g(mq['median'])} [{_g(mq['min'])}, {_g(mq['max'])}]",
                     "—" if pq is None else f"{pq['median']:.0f} [{pq['min']:.0f}, {pq['max']:.0f}]",
                     "—" if rq is None else f"{100 * rq['median']:.0f} %"))
    out += [md_table(("arm", "divergences", "near-tie flips", "large drifts", "logprob jitter",
                      "undetermined", "margin (nats): median [min, max]",
                      "first index: median [min, max]", "median depth into output"), rows), ""]
    if anatomy.divergences and len(anatomy.divergences) <= max_listed:
        detail = []
        for d in anatomy.divergences:
            detail.append((d.arm, d.prompt_id, f"{d.reference.pass_index} / {d.other.pass_index}",
                           str(d.position), _tok(d.reference.token_id), _tok(d.other.token_id),
                           ("≥ " if d.margin_is_bound else "") + _g(d.margin), d.label))
        out += ["<details><summary>Every divergence</summary>", "",
                md_table(("arm", "prompt", "passes (ref / other)", "index", "ref token",
                          "other token", "margin (nats)", "label"), detail), "", "</details>", ""]
    elif anatomy.divergences:
        out += [f"{len(anatomy.divergences)} divergences: too many to list; "
                "`bistat diagnose --json` prints them.", ""]
    else:
        out += ["No counted pass differs from its arm's reference pass: nothing to dissect.", ""]
    if plot_file:
        out += [f"![Margins and positions at first divergence]({plot_file})", ""]
    return "\n".join(out)


def _tok(t: int | None) -> str:
    return "(ended)" if t is None else str(t)


def plot_anatomy(anatomy: Anatomy, path: str | Path) -> Path:
    """Draw margins (log scale, ε dashed) and first-divergence indices per arm; save a PNG.

    Deterministic bytes (Agg, default style, ``metadata={"Software": None}``), like
    :mod:`bistat.report.plots`.
    """
    import matplotlib as mpl
    import matplotlib.style
    from matplotlib.figure import Figure

    path = Path(path)
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    markers = {NEAR_TIE: "o", LARGE_DRIFT: "X", JITTER: "s", UNDETERMINED: "^"}
    with mpl.rc_context(), matplotlib.style.context("default"):
        fig = Figure(figsize=(7.0, 3.6))
        ax_m, ax_p = fig.subplots(1, 2)
        floor = 1e-9
        for i, a in enumerate(anatomy.arms):
            c = colors[i % len(colors)]
            divs = [d for d in anatomy.divergences if d.arm == a.arm]
            for label, mk in markers.items():
                ys = [max(d.margin, floor) for d in divs
                      if d.label == label and d.margin is not None and math.isfinite(d.margin)]
                if ys:
                    ax_m.scatter([i] * len(ys), ys, marker=mk, color=c, alpha=0.7,
                                 label=f"{a.arm}: {label}")
            if a.positions:
                ax_p.hist(a.positions, bins=min(30, max(5, len(set(a.positions)))), color=c,
                          alpha=0.6, label=a.arm)
        ax_m.axhline(max(anatomy.epsilon, floor), color="0.3", linestyle="--", linewidth=1)
        ax_m.set_yscale("log")
        ax_m.set_xticks(range(len(anatomy.arms)), [a.arm for a in anatomy.arms])
        ax_m.set_ylabel("margin at first divergence (nats)")
        ax_m.set_title(f"ε = {anatomy.epsilon:g} (dashed)", fontsize=9)
        if ax_m.get_legend_handles_labels()[0]:
            ax_m.legend(fontsize=7)
        ax_p.set_xlabel("first differing token index")
        ax_p.set_ylabel("divergences")
        if ax_p.get_legend_handles_labels()[0]:
            ax_p.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100, metadata={"Software": None})
    return path
