"""The README's results at a glance: a selection of the index's answers, between two markers.

:func:`glance` chooses the rows (settings that switch batch invariance on, tested, each engine's
newest release first), :func:`render_glance` writes them, and :func:`readme_with_glance` puts
them between :data:`README_BEGIN` and :data:`README_END`, so the README's numbers are the
findings' own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from packaging.version import Version

from bistat.core.markdown import md_row
from bistat.report.index_answers import Answer, _ratio_cell, _setting_cell, probe_words
from bistat.report.index_tax import TaxRow, render_tax
from bistat.report.index_releases import (NewestRelease, _engine_release, _table_order,
                                          releases_sentence)


#: The README's results at a glance: at most this many rows (room for each engine's newest release,
#: its settings both under changing batches and in one batch).
GLANCE_ROWS = 12
README_BEGIN = ("<!-- results at a glance: written by `bistat index --readme`, from the findings; "
                "do not edit by hand -->")
README_END = "<!-- end of the results at a glance -->"


def glance(rows: Sequence[Answer], limit: int = GLANCE_ROWS) -> tuple[list[Answer], int]:
    """The README's rows, and how many were left out for room.

    Only settings that switch batch invariance on count, and only tested ones: a row whose verdict
    is *untested* (a run that could not test the hypothesis: an engine that refused the setting,
    too few passes, a toy run stopped early) never enters. For each engine, head size, attention
    backend, setting and kind of workload (under changing batches, where invariance and the
    throughput cost are decided; or one batch, where the latency cost is), the row from the newest
    release that has it (in that release: more prompts compared, then a decided cost over an undecidable one, then the newer run). Each engine's newest release comes first; then older releases, newest first,
    preferring a head size and attention backend the table does not show yet, then fewer
    settings.
    """
    best: dict[tuple, Answer] = {}
    for a in rows:
        if not a.mode_on or "untested" in a.row.verdict:   # an untested run answers nothing
            continue
        k = (_engine_release(a.engine)[0], a.head_size, a.backend, _switches(a.setting),
             a.under_load)
        if k not in best or _glance_rank(best[k]) < _glance_rank(a):
            best[k] = a
    newest_of: dict[str, Version] = {}
    for a in best.values():
        name, version = _engine_release(a.engine)
        newest_of[name] = max(newest_of.get(name, Version("0")), version or Version("0"))
    left, chosen, shown = list(best.values()), [], set()

    def priority(a: Answer) -> tuple:
        name, version = _engine_release(a.engine)
        version = version or Version("0")
        return (version != newest_of[name], [-x for x in version.release],
                (a.head_size, a.backend) in shown, len(a.setting), a.head_size or 0, a.backend,
                a.setting, a.engine)

    while left and len(chosen) < limit:
        a = min(left, key=priority)
        left.remove(a)
        chosen.append(a)
        shown.add((a.head_size, a.backend))
    chosen.sort(key=lambda a: (_table_order(a.engine, a.gpu), a.head_size or 0, a.backend,
                               len(a.setting), a.setting))
    return chosen, len(left)


def _switches(setting: tuple[str, ...]) -> tuple[str, ...]:
    """A setting as what a user switches: naming a GEMM table (``BISTAT_GEMM_TABLE``) picks which
    measurements the tuned GEMM uses, not whether it is on, and a card without a table of its own
    resolves a shipped one by architecture (kernels/README.md), so it makes no row of its own."""
    return tuple(s for s in setting if not s.strip("`").startswith("BISTAT_GEMM_TABLE="))


def _glance_rank(a: Answer) -> tuple:
    """Newer release, then more prompts compared, then a decided cost over an undecidable one
    (more passes, or a quieter card, decided it), then the newer run."""
    _, version = _engine_release(a.engine)
    return (version or Version("0"), a.compared, not a.row.cost.startswith("undecidable"),
            a.finding.run_created or "")


def render_glance(rows: Sequence[Answer], left_out: int, readme_dir: Path, index_path: Path,
                  newest: Mapping[str, NewestRelease], tax: Sequence[TaxRow] = ()) -> list[str]:
    """The README's results at a glance (between :data:`README_BEGIN` and :data:`README_END`),
    and below them the determinism tax on vLLM's newest release (:func:`render_tax`)."""
    index = Path(os.path.relpath(index_path, readme_dir)).as_posix()
    lines = [README_BEGIN, ""]
    lines += [releases_sentence([a.engine for a in rows], newest), ""]
    lines += ["| engine | GPU | model | head size, attention | workload | setting | invariant? "
              "| cost: ratio [95 % interval] |", "|---|---|---|---|---|---|---|---|"]
    for a in rows:
        rel = Path(os.path.relpath(a.finding.path, readme_dir)).as_posix()
        if a.row.ratio == "—":
            cost = a.row.cost
        elif a.row.cost.startswith("—"):
            cost = f"no cost rule; throughput {_ratio_cell(a.row)}"
        else:
            cost = f"{a.row.cost}: {_ratio_cell(a.row)}"
        lines.append(md_row((a.engine, a.gpu, a.model, f"{a.head_size or '—'}, {a.backend}",
                             a.workload, _setting_cell(a),
                             f"[{a.row.verdict}, {a.row.matched}]({rel}){probe_words(a)}",
                             cost)))
    more = (f" {left_out} more combination{'s' if left_out != 1 else ''} of head size, backend, "
            "setting and workload, and every other run, are" if left_out else " Every other run is")
    lines += ["", f"One row per head size, attention backend, setting that switches batch "
                  f"invariance on and kind of workload (changing batches, or one batch), from the "
                  f"newest release that measured it (each verdict links "
                  f"its finding; ratio: treatment ÷ control, throughput below 1 or latency above "
                  f"1 is slower).{more} in [{index}]({index}).", ""]
    tax_lines = render_tax(tax, readme_dir, newest.get("vllm"))
    lines += tax_lines + ([""] if tax_lines else []) + [README_END]
    return lines


def readme_with_glance(readme: str | Path, rows: Sequence[Answer], index_path: Path,
                       newest: Mapping[str, NewestRelease], tax: Sequence[TaxRow] = ()) -> str:
    """``readme``'s text with its results at a glance (the lines from :data:`README_BEGIN` to
    :data:`README_END`) made current: :func:`glance` of ``rows``, linked from the README's
    folder."""
    readme = Path(readme)
    lines = readme.read_text(encoding="utf-8").split("\n")
    if lines.count(README_BEGIN) != 1 or lines.count(README_END) != 1 or \
            lines.index(README_BEGIN) > lines.index(README_END):
        raise ValueError(f"{readme}: needs one line {README_BEGIN!r} and, below it, one line "
                         f"{README_END!r}, where the results at a glance go; add them")
    chosen, left_out = glance(rows)
    block = render_glance(chosen, left_out, readme.resolve().parent, Path(index_path).resolve(),
                          newest, tax)
    return "\n".join(lines[:lines.index(README_BEGIN)] + block
                     + lines[lines.index(README_END) + 1:])
