"""The findings index: one table per engine version and GPU answering the user's question.

For each finding's comparisons: the model, the backend, the arm against its control -> is it
batch-invariant (the verdict, prompts matched / compared, the Wilson interval) and what does it
cost (the cost rule's statement, ratio and interval), with the registered rule named in each row
and whether its analysis is *confirmatory* (the rule sealed before the data) or *exploratory*
(sealed after: it describes the data and tests nothing). The rows of one run are adjacent, so a
study's confirmatory verdicts and its exploratory one stand side by side.

The index is generated from the findings themselves -- each finding's ``## Summary`` section
(``bistat.report.finding``), and its ``### TREATMENT (treatment) vs CONTROL (control): **LABEL**``
headings -- so it cannot drift from them, and regenerating it from the same findings gives the
same bytes. A finding written before the Summary section existed is listed by its headings in a
last table. Given the registrations folder it also lists every sealed registration that has no
finding yet, with the reason stated for it in a TOML file (``[not_run]`` table: ``NAME = "why"``),
so that what was not run is said plainly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from bistat.core.markdown import md_row

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_VERDICT = re.compile(r"^### (?P<treatment>.+?) \(treatment\) vs (?P<control>.+?) \(control\): "
                      r"\*\*(?P<label>[^*]+)\*\*\s*$")
_TITLE = re.compile(r"^# Finding: (?P<name>.+?)(?: — exploratory analysis.*)?\s*$")
_HYPOTHESIS = re.compile(r"^> (?P<text>.+)$")
_SUMMARY_LINE = re.compile(r"^Engine: (?P<engine>.+?) · GPU: (?P<gpu>.+?) · model: `(?P<model>.*)` · "
                           r"run: `(?P<run>.*)` · rule: `(?P<rule>.*)` \((?P<analysis>confirmatory|"
                           r"exploratory)\)\s*$")


@dataclass(frozen=True)
class SummaryRow:
    """One comparison as a finding's Summary table states it."""

    treatment: str
    control: str
    backend: str
    verdict: str          # as shown, e.g. "*working*"
    matched: str          # "541 / 541"
    interval: str         # the treatment's Wilson interval
    cost: str
    ratio: str
    cost_interval: str


@dataclass(frozen=True)
class FindingSummary:
    """A finding's Summary section: where it ran, under which rule, and its rows."""

    engine: str
    gpu: str
    model: str
    run: str
    rule: str
    analysis: str         # "confirmatory" | "exploratory"
    rows: tuple[SummaryRow, ...]


@dataclass(frozen=True)
class IndexedFinding:
    path: Path
    name: str
    verdicts: tuple[tuple[str, str, str], ...]  # (treatment, control, label)
    hypothesis: str
    summary: FindingSummary | None = None


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` is a literal bar)."""
    inner = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def read_finding(path: Path) -> IndexedFinding:
    """Read a finding's name, verdict headings, the first line of its hypothesis and its
    Summary section (when it has one)."""
    name, hypothesis = path.stem, ""
    verdicts: list[tuple[str, str, str]] = []
    in_hypothesis = in_summary = False
    head: dict[str, str] | None = None
    rows: list[SummaryRow] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if (m := _TITLE.match(line)) and name == path.stem:
            name = m["name"]
        elif line.strip() == "## Hypothesis":
            in_hypothesis = True
        elif in_hypothesis and (m := _HYPOTHESIS.match(line)):
            hypothesis, in_hypothesis = m["text"], False
        elif line.strip() == "## Summary":
            in_summary = True
        elif in_summary and line.startswith("## "):
            in_summary = False
        elif in_summary and (m := _SUMMARY_LINE.match(line)):
            head = m.groupdict()
        elif in_summary and line.startswith("| ") and not line.startswith("| treatment |"):
            cells = _cells(line)
            if len(cells) == 9:
                rows.append(SummaryRow(*cells))
        elif m := _VERDICT.match(line):
            verdicts.append((m["treatment"], m["control"], m["label"]))
    if not verdicts:
        raise ValueError(f"{path}: no verdict heading found; is it a finding written by "
                         "`bistat analyze`?")
    summary = None if head is None else FindingSummary(rows=tuple(rows), **head)
    return IndexedFinding(path, name, tuple(verdicts), hypothesis, summary)


@dataclass(frozen=True)
class UnrunRegistration:
    """A sealed registration without a finding, and why (None: no reason stated)."""

    name: str
    path: Path
    registered_utc: str | None
    reason: str | None


def read_reasons(path: str | Path) -> dict[str, str]:
    """The ``[not_run]`` table of a reasons file: registration name -> why it has no finding."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: not a readable TOML file ({exc})") from None
    table = data.get("not_run")
    if not isinstance(table, dict) or set(data) != {"not_run"}:
        raise ValueError(f"{path}: expected one table [not_run] of NAME = \"reason\" lines, got "
                         f"{', '.join(sorted(data)) or 'nothing'}")
    for name, why in table.items():
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"{path}: field not_run.{name} must be a non-empty string (why "
                             "registration NAME has no finding)")
    return {str(k): v.strip() for k, v in table.items()}


def unrun_registrations(findings: list[IndexedFinding], registrations_dir: str | Path,
                        reasons: dict[str, str], reasons_source: str = "the reasons file"
                        ) -> list[UnrunRegistration]:
    """Registrations in ``registrations_dir`` with no finding named after them; ``reasons`` must
    name only such registrations."""
    from bistat.declare.prereg import RegistrationError, load_registration

    have = {f.name for f in findings}
    out, names = [], set()
    for path in sorted(Path(registrations_dir).glob("*.json")):
        try:
            reg = load_registration(path)
        except RegistrationError as exc:
            raise ValueError(str(exc)) from None
        name = reg.experiment().name
        names.add(name)
        if name in have:
            if name in reasons:
                raise ValueError(f"{reasons_source}: not_run.{name} is stated, but {name} has a "
                                 "finding; remove the line")
            continue
        out.append(UnrunRegistration(name, path, reg.registered_utc, reasons.get(name)))
    unknown = sorted(set(reasons) - names)
    if unknown:
        raise ValueError(f"{reasons_source}: not_run.{unknown[0]} names no registration in "
                         f"{registrations_dir}; fix the name or remove the line")
    return out


#: the first line of a release comparison (``bistat compare``), which the index lists apart
RELEASE_COMPARISON_TITLE = "# Release comparison: "


def render_index(findings: list[IndexedFinding], base: Path,
                 unrun: list[UnrunRegistration] | None = None,
                 reasons_source: str | None = None,
                 comparisons: list[tuple[Path, str]] | None = None) -> str:
    """The index as markdown: one table per engine version and GPU (findings with a Summary),
    rows grouped by run; then findings without a Summary; then the registrations without a
    finding when ``unrun`` is given."""
    lines = ["# Findings", "",
             "Generated by `bistat index` from the findings in this folder; each finding is "
             "regenerated from its recorded data by `bistat analyze`.", "",
             "One table per engine version and GPU. Each row is one arm against its control under "
             "one registered rule: is it batch-invariant (the verdict, prompts matched / compared "
             "across the counted passes, the Wilson interval) and what does it cost (the cost "
             "rule's statement; its ratio and interval, or the throughput ratio and its interval "
             "where the rule has no cost rule). *Confirmatory*: the rule was sealed before the "
             "run's data, a test of the hypothesis. *Exploratory*: sealed after them (the default "
             "rule applied to runs recorded before it existed), a description that tests nothing. "
             "The rows of one run are adjacent.", ""]
    summarised = [f for f in findings if f.summary is not None]
    groups: dict[tuple[str, str], list[IndexedFinding]] = {}
    for f in summarised:
        groups.setdefault((f.summary.engine, f.summary.gpu), []).append(f)
    for (engine, gpu) in sorted(groups):
        lines += [f"## {engine} on {gpu}", "",
                  "| run | model | arm vs control | backend | invariant? | matched / compared | "
                  "interval | cost | ratio | interval | rule |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        entries = []
        for f in groups[(engine, gpu)]:
            sm = f.summary
            rel = f.path.relative_to(base).as_posix()
            for r in sm.rows:
                key = (sm.run, r.treatment, r.control, sm.analysis != "confirmatory", f.name)
                entries.append((key, sm, r, f"[{f.name}]({rel}) ({sm.analysis})"))
        previous = None
        for key, sm, r, rule in sorted(entries, key=lambda e: e[0]):
            run = f"`{sm.run}`" if sm.run != previous else ""
            previous = sm.run
            lines.append(md_row((
                run, f"`{sm.model}`", f"{r.treatment} vs {r.control}", r.backend, r.verdict,
                r.matched, r.interval, r.cost, r.ratio, r.cost_interval, rule)))
        lines.append("")
    rest = [f for f in findings if f.summary is None]
    if rest:
        lines += ["## Findings without a summary", "",
                  "Written before findings carried a Summary section; their verdicts as headed.",
                  "", "| finding | treatment vs control | verdict |", "|---|---|---|"]
        for f in sorted(rest, key=lambda f: f.path.as_posix()):
            rel = f.path.relative_to(base).as_posix()
            for i, (treatment, control, label) in enumerate(f.verdicts):
                cell = f"[{f.name}]({rel})" if i == 0 else ""
                lines.append(f"| {cell} | {treatment} vs {control} | *{label}* |")
        lines.append("")
    if comparisons:
        lines += ["## One study on two releases", "",
                  "Written by `bistat compare` from the two runs' data: per arm, both releases' "
                  "match counts, verdicts and cost, what changed by fixed rules, and the upstream "
                  "changes between the releases.", ""]
        lines += [f"- [{title}]({path.relative_to(base).as_posix()})"
                  for path, title in sorted(comparisons)]
        lines.append("")
    if unrun is not None:
        source = f" (`{reasons_source}`)" if reasons_source else ""
        lines += ["## Registered, no finding yet", "",
                  f"Sealed before any data and not run (or not analysed) so far; the reason as "
                  f"stated by the people running the studies{source}.", ""]
        if not unrun:
            lines.append("None: every registration has its finding.")
        else:
            lines += ["| registration | registered (UTC) | why no finding |", "|---|---|---|"]
            for u in unrun:
                rel = Path(os.path.relpath(u.path, base)).as_posix()
                lines.append(f"| [{u.name}]({rel}) | {u.registered_utc or '—'} | "
                             f"{u.reason or '*no reason stated*'} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def write_index(findings_dir: str | Path, registrations_dir: str | Path | None = None,
                reasons_path: str | Path | None = None) -> Path:
    """Write ``findings_dir/README.md`` listing every ``*.md`` finding below it, and, given
    ``registrations_dir``, the registrations that have none (why: ``reasons_path``)."""
    base = Path(findings_dir)
    paths = [p for p in sorted(base.rglob("*.md")) if p.name != "README.md"]
    comparisons, findings = [], []
    for p in paths:
        first = p.read_text(encoding="utf-8").split("\n", 1)[0]
        if first.startswith(RELEASE_COMPARISON_TITLE):
            comparisons.append((p, first.removeprefix(RELEASE_COMPARISON_TITLE)))
        else:
            findings.append(read_finding(p))
    unrun = source = None
    if reasons_path is not None and registrations_dir is None:
        raise ValueError("a reasons file needs the registrations folder (--registrations)")
    if registrations_dir is not None:
        source = None if reasons_path is None else Path(reasons_path).as_posix()
        reasons = {} if reasons_path is None else read_reasons(reasons_path)
        unrun = unrun_registrations(findings, registrations_dir, reasons,
                                    source or "the reasons file")
    out = base / "README.md"
    out.write_text(render_index(findings, base, unrun, source, comparisons), encoding="utf-8")
    return out
