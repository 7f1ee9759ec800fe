"""The determinism tax on vLLM's newest release, as shipped and with bistat's plugin: the README's
table beside the results at a glance.

A *tax study* is a registration that sets, beside its control, vLLM's batch-invariant mode exactly
as vLLM ships it (``VLLM_BATCH_INVARIANT=1`` and nothing of bistat's: no tuned GEMM, no FA3 pin,
vLLM's own attention backend and compile / CUDA-graph choice) and the mode with bistat's plugin as
bistat recommends it (the tuned GEMM with torch.compile kept, ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``).
:func:`tax_rows` finds them among the registrations by those arms (not by name), keeps those on
the newest vLLM release the registrations checked, and reads each one's cost from its finding's
Summary and each arm's compile / CUDA-graph mode from its Environment table; a tax study without
a finding is a row that says so. :func:`render_tax` writes the table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bistat.core.markdown import md_row
from bistat.report.index_answers import (_ratio_cell, findings_per_run, model_words,
                                         workload_words)
from bistat.report.index_findings import IndexedFinding, SummaryRow
from bistat.report.index_releases import NewestRelease

if TYPE_CHECKING:
    from bistat.declare.experiment import Experiment
    from bistat.declare.registration import Registration

__all__ = ["TaxRow", "tax_arms", "tax_rows", "render_tax"]


@dataclass(frozen=True)
class TaxRow:
    """One tax study: the mode as shipped and with bistat's plugin, each against the default."""

    registration: str
    registration_path: Path
    gpu: str                      # from its finding; "—" when it has none
    model: str
    workload: str
    under_load: bool
    metric: str                   # the cost rule's metric: throughput or latency
    shipped: str                  # the arm names
    plugin: str
    shipped_row: SummaryRow | None
    plugin_row: SummaryRow | None
    shipped_mode: str | None
    plugin_mode: str | None
    finding: IndexedFinding | None
    load: tuple[int, int, int]    # concurrency, prompts, tokens: the order of the rows


def tax_arms(exp: Experiment) -> tuple[str, str] | None:
    """The (as shipped, with bistat's plugin) arms of a tax study, or None if ``exp`` is not one."""
    if not exp.engine.kind.startswith("vllm") or exp.rule.cost is None:
        return None
    if not any(a.role == "control" for a in exp.arms):
        return None
    shipped = plugin = None
    for a in exp.arms:
        env = a.env
        if a.role != "treatment" or env.get("VLLM_BATCH_INVARIANT") != "1":
            continue
        if (env.get("BISTAT_TUNED_GEMM", "0") == "0" and env.get("BISTAT_FA3_PIN", "0") == "0"
                and "VLLM_USE_BREAKABLE_CUDAGRAPH" not in env
                and "attention_backend" not in a.args and shipped is None):
            shipped = a.name
        elif (env.get("BISTAT_TUNED_GEMM") == "1" and env.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "0"
              and "attention_backend" not in a.args and plugin is None):
            plugin = a.name
    return (shipped, plugin) if shipped and plugin else None


def tax_rows(findings: Sequence[IndexedFinding], registrations: Mapping[str, Registration],
             newest: Mapping[str, NewestRelease]) -> list[TaxRow]:
    """Every tax study on the newest vLLM release the registrations checked, with its finding's
    numbers where it has one (of several findings of one run, the newest registration's, as the
    answers choose), in the order of their loads."""
    release = newest.get("vllm")
    if release is None:
        return []
    # one row per run: a run analysed under several registrations (a -hac sibling) shows once,
    # under the newest of them, as in the answers; a registration with any finding has run
    chosen = {f.name: f for f, _ in findings_per_run(findings, registrations).values()}
    analysed = {f.name for f in findings}
    rows = []
    for name, reg in sorted(registrations.items()):
        exp = reg.experiment()
        arms = tax_arms(exp)
        if arms is None or exp.engine.required_version != release.version:
            continue
        finding = chosen.get(name)
        if finding is None and name in analysed:
            continue
        shipped, plugin = arms
        summary_rows = {} if finding is None else {r.treatment: r for r in finding.summary.rows}
        modes = {} if finding is None else dict(finding.modes)
        model, _ = model_words(exp.engine.model, exp.engine.args)
        w = exp.workload
        rows.append(TaxRow(name, reg.path, finding.summary.gpu if finding else "—", model,
                           workload_words(exp), w.n_prompts > w.concurrency,
                           exp.rule.cost.metric, shipped, plugin, summary_rows.get(shipped),
                           summary_rows.get(plugin), modes.get(shipped), modes.get(plugin),
                           finding, (w.concurrency, w.n_prompts, w.max_tokens)))
    rows.sort(key=lambda r: (r.under_load, r.load, r.model, r.finding is None, r.gpu,
                             r.registration))
    return rows


def _cost(row: SummaryRow | None) -> str:
    return "—" if row is None else f"{row.cost}: {_ratio_cell(row)}"


def render_tax(rows: Sequence[TaxRow], readme_dir: Path, release: NewestRelease | None
               ) -> list[str]:
    """The tax table as markdown lines (none when there is no tax study)."""
    if not rows or release is None:
        return []
    lines = [f"**The determinism tax on vLLM {release.version}, as shipped and with bistat.** "
             "Each row is one study's three arms side by side on one GPU: the default engine, "
             "`VLLM_BATCH_INVARIANT=1` exactly as vLLM ships it (its own GEMM table, attention "
             "backend and compile / CUDA-graph choice), and the mode with bistat's plugin (the "
             "tuned GEMM, torch.compile kept with `VLLM_USE_BREAKABLE_CUDAGRAPH=0`); each cost is "
             "against the default (throughput below 1 or latency above 1 is slower), and each "
             "arm's compile / CUDA-graph mode is what its engine logged.", "",
             "| study | GPU | model | workload | as shipped: cost | its mode | with bistat's "
             "plugin: cost | its mode |", "|---|---|---|---|---|---|---|---|"]
    ran = [r for r in rows if r.finding is not None]
    for r in ran:
        rel = Path(os.path.relpath(r.finding.path, readme_dir)).as_posix()
        lines.append(md_row((f"[{r.registration}]({rel})", r.gpu, r.model, r.workload,
                             _cost(r.shipped_row), r.shipped_mode or "—", _cost(r.plugin_row),
                             r.plugin_mode or "—")))
    if not ran:
        lines.append(md_row(("none run yet", "—", "—", "—", "—", "—", "—", "—")))
    waiting = [r for r in rows if r.finding is None]
    if waiting:
        names = ", ".join(
            f"[{r.registration}]({Path(os.path.relpath(r.registration_path, readme_dir)).as_posix()})"
            f" ({r.model}, {r.workload}, {r.metric})" for r in waiting)
        lines += ["", f"Registered before any data, not run yet: {names}."]
    return lines
