"""``RunSummary`` + verdicts -> the markdown finding ``findings/NAME.md`` and its PNG plots.

This layer formats finished results and computes no statistic (criterion.rs' ``Report``, STYLE.md
§6). The output is a function of the summary and of the seal's evidence (``seal``, the one line
``Seal: ...`` that :mod:`bistat.report.seal` computes from git and the signature): no clock is
read, no absolute path is printed, numbers have fixed formats and plots are saved
deterministically (``bistat.report.plots``), so regenerating a finding from the same records in
the same repository gives byte-identical files.

This module renders the finding (:func:`render_markdown`, the sections in their order) and writes
it with its plots (:func:`write_finding`). The sections are its parts, each a module of its own:

- :mod:`bistat.report.finding_verdict` -- the head, the Summary, the verdicts with their cost, the
  other registered rules' verdicts, the registration's runs, the rule and its amendments.
- :mod:`bistat.report.finding_engine` -- the environment, the engine version, the activation and
  the probe.
- :mod:`bistat.report.finding_match` -- the match rates, the first divergences and the anatomy.
- :mod:`bistat.report.finding_throughput` -- throughput, with the cost interval's pairs and the
  passes' serial correlation.
- :mod:`bistat.report.finding_batching` -- batch latency and batching.
- :mod:`bistat.report.finding_validity` -- the validity checks, the failed requests and the tail.
- :mod:`bistat.report.finding_cells` -- the cells and lists all of them format alike.

A release comparison (``bistat compare``) is rendered by
:func:`bistat.report.version_comparison.render_version_comparison`, also named here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bistat.analysis.results import RunSummary
# the sections' constants, the markdown builder and the helpers the tests read, read through here
from bistat.analysis.timing import FRONT_END_BOUND_SHARE, MIN_SAMPLES_FOR_SHARE  # noqa: F401
from bistat.core.markdown import md_cell, md_table  # noqa: F401
from bistat.report.anatomy import plot_anatomy
from bistat.report.finding_batching import _batching, _latency
from bistat.report.finding_engine import (  # noqa: F401
    _activation, _engine_version_section, _environment, _gemm_table_rows, _probe_detail,
    _probe_needles)
from bistat.report.finding_match import (  # noqa: F401
    _anatomy, _divergence, _kv_tile_boundary, _match)
from bistat.report.finding_throughput import _throughput
from bistat.report.finding_validity import _failed_requests, _tail, _validity
from bistat.report.finding_verdict import (_amendments, _head, _registration_runs, _rule,
                                           _siblings, _summary, _verdict)
from bistat.report.plots import PLOTS, save_plots
from bistat.report.seal import SealEvidence
from bistat.report.version_comparison import render_version_comparison

#: Suffix of the divergence-anatomy plot (``NAME-anatomy.png``), drawn by ``bistat.report.anatomy``.
ANATOMY_PLOT = "anatomy"

__all__ = ["FindingExistsError", "FindingFiles", "finding_run", "render_markdown", "write_finding",
           "render_version_comparison"]


@dataclass(frozen=True)
class FindingFiles:
    """The files a finding consists of."""

    markdown: Path
    plots: tuple[Path, ...]


def render_markdown(summary: RunSummary, plot_files: dict[str, str] | None = None, *,
                    seal: SealEvidence | None = None) -> str:
    """The finding as markdown. ``plot_files`` maps plot suffix -> file name beside it;
    ``seal`` (:func:`bistat.report.seal.seal_evidence`) gives the ``Seal: ...`` line under the
    verdict, which ``bistat analyze`` always writes (without it the line is left out)."""
    suffixes = [suffix for suffix, _, _ in PLOTS] + [ANATOMY_PLOT]
    plots = plot_files or {suffix: f"{summary.name}-{suffix}.png" for suffix in suffixes}
    parts = (_head(summary, seal) + _summary(summary) + _verdict(summary) + _siblings(summary)
             + _registration_runs(summary) + _rule(summary)
             + _amendments(summary)
             + _environment(summary) + _engine_version_section(summary)
             + _activation(summary) + _match(summary, plots["match"])
             + _throughput(summary, plots["throughput"], plots.get("serial"))
             + _latency(summary)
             + _divergence(summary, plots["divergence"])
             + _anatomy(summary, plots.get(ANATOMY_PLOT))
             + _batching(summary, plots["running"]) + _validity(summary)
             + _failed_requests(summary) + _tail(summary))
    return "\n".join(parts).rstrip("\n") + "\n"


class FindingExistsError(ValueError):
    """The finding would replace another run's finding of the same name."""


_RUN_ROW = re.compile(r"^\| Run \| `(?P<run>.+)` \|\s*$", re.MULTILINE)


def finding_run(path: str | Path) -> str | None:
    """The run a finding file was written from (its head table's ``Run`` row); None when the
    file has none (not a finding written by ``bistat analyze``)."""
    try:
        m = _RUN_ROW.search(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return None if m is None else m["run"]


def write_finding(summary: RunSummary, out_dir: str | Path, *,
                  seal: SealEvidence | None = None, force: bool = False) -> FindingFiles:
    """Write ``out_dir/NAME.md`` and its plots ``out_dir/NAME-*.png``; return the paths.

    The plots are :data:`bistat.report.plots.PLOTS` and, with an anatomy, ``NAME-anatomy.png``
    (``bistat.report.anatomy.plot_anatomy``). ``seal``: as for :func:`render_markdown`.

    Raises
    ------
    FindingExistsError
        ``out_dir/NAME.md`` is the finding of another run (of the same registration), unless
        ``force``: a second run's analysis never silently replaces the first run's finding.
    """
    out = Path(out_dir)
    md = out / f"{summary.name}.md"
    other = finding_run(md) if md.exists() and not force else None
    if other is not None and other != summary.run_id:
        raise FindingExistsError(
            f"{md} is the finding of run {other}; this is run {summary.run_id}, and writing its "
            f"finding there would replace that run's. Write it elsewhere (--out DIR), or replace "
            f"it with --force (both runs stay listed under 'Runs of this registration')")
    out.mkdir(parents=True, exist_ok=True)
    paths = save_plots(summary, out, summary.name)
    if summary.anatomy is not None:
        paths[ANATOMY_PLOT] = plot_anatomy(summary.anatomy,
                                           out / f"{summary.name}-{ANATOMY_PLOT}.png")
    text = render_markdown(summary, {k: p.name for k, p in paths.items()}, seal=seal)
    md.write_bytes(text.encode("utf-8"))
    return FindingFiles(md, tuple(paths.values()))
