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

Above that listing, given the registrations, the index opens with the answers (:func:`answers`):
one table per engine release and GPU, one row per model, head size, attention backend, setting and
workload, under the newest confirmatory rule registered for each run. The numbers are the
findings' Summary rows; the setting, the workload and the model's weights come from the run's
sealed registration, and the model's name and head size from :data:`MODELS`. The README's results
at a glance (:func:`glance`, :func:`readme_with_glance`) are a selection of those rows, written between
two markers, so the README's numbers are the findings' own.

This module renders and writes the index (:func:`render_index`, :func:`write_index`, with the
options it records: :func:`index_options`) and names the reading of a rule under another cost
interval (:func:`interval_readings`). Its parts, each a module of its own:

- :mod:`bistat.report.index_findings` -- what it reads from each finding (:func:`read_finding`,
  :func:`read_findings`).
- :mod:`bistat.report.index_registrations` -- the registrations, those without a finding, and the
  newest release their checks recorded.
- :mod:`bistat.report.index_answers` -- the answers (:func:`answers`, :data:`MODELS`).
- :mod:`bistat.report.index_releases` -- engine releases: their order, how far from the newest.
- :mod:`bistat.report.index_glance` -- the README's results at a glance.

Every public name of the parts is read as ``bistat.report.index.NAME`` too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bistat.core.markdown import md_row
from bistat.report.index_answers import (  # noqa: F401 - read through here too
    MODE_SWITCHES, MODELS, Answer, ModelName, answers, arm_setting, model_words, render_answers,
    workload_words)
from bistat.report.index_findings import (  # noqa: F401 - read through here too
    LOCAL_FINDINGS, FindingSummary, IndexedFinding, SummaryRow, read_finding, read_findings)
from bistat.report.index_glance import (  # noqa: F401 - read through here too
    GLANCE_ROWS, README_BEGIN, README_END, glance, readme_with_glance, render_glance)
from bistat.report.index_registrations import (  # noqa: F401 - read through here too
    UnrunRegistration, load_registrations, newest_releases, read_reasons, unrun_registrations)
from bistat.report.index_releases import (  # noqa: F401 - read through here too
    NewestRelease, release_words, releases_sentence)
from bistat.report.version_comparison import RELEASE_COMPARISON_TITLE  # noqa: F401 - as before
from bistat.report.index_tax import TaxRow, tax_rows  # noqa: F401 - read through here too

if TYPE_CHECKING:
    from bistat.declare.registration import Registration


@dataclass(frozen=True)
class IntervalReading:
    """A finding whose rule is another finding's rule of the same run with its cost interval
    replaced (``scripts/hac_declarations.py``: ``interval = "hac"``, applied after the data): the
    rule it varies (``base``, that finding's name) and the two intervals."""

    base: str
    base_interval: str
    interval: str


#: How the index names a cost interval.
INTERVAL_WORDS = {"welch": "Welch", "paired": "paired", "hac": "HAC"}


def _without_interval(rule: Any) -> Any:
    """The rule with its cost interval and the interval's parameters at their defaults."""
    cost = rule.cost.model_copy(update={"interval": "welch", "hac_kernel": None,
                                        "hac_bandwidth": None})
    return rule.model_copy(update={"cost": cost})


def interval_readings(findings: Sequence[IndexedFinding],
                      registrations: Mapping[str, Registration]
                      ) -> dict[str, IntervalReading]:
    """Finding name -> the rule it varies, for each exploratory finding whose rule decides the
    cost on the HAC interval and is otherwise the rule of another finding of the same run, one
    with another interval (the HAC reading of a study's cost: ``NAME-hac``). Findings whose
    registration is not in ``registrations`` are left out."""
    rules: dict[str, tuple[str, Any]] = {}
    for f in findings:
        reg = registrations.get(f.name)
        if f.summary is not None and reg is not None:
            rule = reg.experiment().rule
            if rule.cost is not None:
                rules[f.name] = (f.summary.run, rule)
    out: dict[str, IntervalReading] = {}
    for f in findings:
        if f.name not in rules or f.summary.analysis != "exploratory":
            continue
        run, rule = rules[f.name]
        if rule.cost.interval != "hac":
            continue
        bases = sorted(
            name for name, (other_run, other) in rules.items()
            if other_run == run and other.cost.interval != "hac"
            and _without_interval(other) == _without_interval(rule))
        if bases:
            base = bases[0]
            out[f.name] = IntervalReading(base, rules[base][1].cost.interval, rule.cost.interval)
    return out


def _outcome(cost: str) -> str:
    """A Summary row's cost cell without its metric: ``undecidable (throughput)`` ->
    ``undecidable``."""
    return cost.rsplit(" (", 1)[0]


def render_index(findings: list[IndexedFinding], base: Path,
                 unrun: list[UnrunRegistration] | None = None,
                 reasons_source: str | None = None,
                 comparisons: list[tuple[Path, str]] | None = None,
                 answers_lines: Sequence[str] = (),
                 readings: Mapping[str, IntervalReading] | None = None,
                 options: Mapping[str, str | None] | None = None) -> str:
    """The index as markdown: the answers (``answers_lines``, :func:`render_answers`), then one
    table per engine version and GPU (findings with a Summary), rows grouped by run, a reading
    of a rule under another cost interval (``readings``, :func:`interval_readings`) named as
    such, its cost verdict marked where it differs from the rule's; then findings without a
    Summary; then the registrations without a finding when ``unrun`` is given. ``options``: the
    line recording what it was written from (:data:`OPTIONS_LINE`; paths from ``base``)."""
    readings = readings or {}
    by_name = {f.name: f for f in findings}
    lines = ["# Findings", "",
             "Generated by `bistat index` from the findings in this folder; each finding is "
             "regenerated from its recorded data by `bistat analyze`.", ""]
    if options is not None:
        lines += ["<!-- bistat index options: " + json.dumps(dict(options), sort_keys=True)
                  + " -->", ""]
    lines += list(answers_lines)
    if answers_lines:
        lines += ["## Every run under every rule", ""]
    lines += ["One table per engine version and GPU. Each row is one arm against its control under "
             "one registered rule: is it batch-invariant (the verdict, prompts matched / compared "
             "across the counted passes, the Wilson interval) and what does it cost (the cost "
             "rule's statement; its ratio and interval, or the throughput ratio and its interval "
             "where the rule has no cost rule). *Confirmatory*: the rule was sealed before the "
             "run's data, a test of the hypothesis. *Exploratory*: sealed after them (the default "
             "rule applied to runs recorded before it existed), a description that tests nothing. "
             "*HAC reading of R*: R's rule with the cost interval that allows for serial "
             "correlation of the passes (`interval = \"hac\"`, docs/COST-INTERVALS.md), sealed "
             "after the data; where its cost verdict differs from R's, the row says so in bold. "
             "The rows of one run are adjacent; a run whose registration was run more than once "
             "says so (each finding lists every run of its registration).", ""]
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
            runs = ("" if not f.registration_runs or f.registration_runs < 2 else
                    f" (one of {f.registration_runs} runs of its registration)")
            reading = readings.get(f.name)
            kind = sm.analysis
            if reading is not None and reading.base in by_name:
                base_rel = by_name[reading.base].path.relative_to(base).as_posix()
                kind += (f"; {INTERVAL_WORDS.get(reading.interval, reading.interval)} reading of "
                         f"[{reading.base}]({base_rel})")
            for r in sm.rows:
                key = (sm.run, r.treatment, r.control, sm.analysis != "confirmatory", f.name)
                cost = r.cost
                if reading is not None and reading.base in by_name:
                    was = next((b.cost for b in by_name[reading.base].summary.rows
                                if (b.treatment, b.control) == (r.treatment, r.control)), None)
                    if was is not None and _outcome(was) != _outcome(cost):
                        other = INTERVAL_WORDS.get(reading.base_interval, reading.base_interval)
                        cost = (f"{cost}: **changes** (was {_outcome(was)} with the {other} "
                                "interval)")
                entries.append((key, sm, dataclasses.replace(r, cost=cost),
                                f"[{f.name}]({rel}) ({kind})", runs))
        previous = None
        for key, sm, r, rule, runs in sorted(entries, key=lambda e: e[0]):
            run = f"`{sm.run}`{runs}" if sm.run != previous else ""
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
        lines += ["## One study on two releases or two engines", "",
                  "Written by `bistat compare` from the two runs' data: per arm, both runs' "
                  "match counts, verdicts, cost and first divergences, what changed by fixed "
                  "rules, and the upstream changes between two releases (or, for two engines, "
                  "the two setups side by side).", ""]
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


#: The line of the index that records the options it was written with (paths from the findings
#: folder), so that ``bistat index`` without options writes it whole again (:func:`index_options`).
OPTIONS_LINE = re.compile(r"^<!-- bistat index options: (?P<json>\{.*\}) -->$", re.M)
#: Sections only the registrations give the index (lost by an index written without them).
REGISTRATION_SECTIONS = ("## Answers", "## Registered, no finding yet")


@dataclass(frozen=True)
class IndexOptions:
    """What an index is written from besides its findings: the registrations folder, the file of
    reasons why a registration has no finding, the README whose results at a glance it writes."""

    registrations_dir: str | None = None
    reasons_path: str | None = None
    readme: str | None = None

    def flags(self) -> str:
        """The options on a ``bistat index`` command line (``""`` without any)."""
        pairs = (("--registrations", self.registrations_dir), ("--reasons", self.reasons_path),
                 ("--readme", self.readme))
        return " ".join(f"{flag} {value}" for flag, value in pairs if value is not None)


def _named(path: str | Path, findings_dir: Path) -> str:
    """``path`` as the index names it: from the folder above the findings, however it was given,
    so that the index's bytes do not depend on the directory it was written from."""
    # abspath, not resolve: a registrations folder that is a link keeps its own name
    return Path(os.path.relpath(os.path.abspath(path),
                                os.path.dirname(os.path.abspath(findings_dir)))).as_posix()


def _from_folder(path: str | Path | None, folder: Path) -> str | None:
    return None if path is None else Path(os.path.relpath(os.path.abspath(path),
                                                          os.path.abspath(folder))).as_posix()


def index_options(findings_dir: str | Path) -> IndexOptions | None:
    """The options ``findings_dir/README.md`` was written with (paths as from the current
    directory), or None when there is no index or it records none.

    Raises
    ------
    ValueError
        The index has the answers or the registrations without a finding (written with
        ``--registrations``) but no options line: written by an older bistat, it cannot be
        written whole again without them being given.
    """
    base = Path(findings_dir)
    path = base / "README.md"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    m = OPTIONS_LINE.search(text)
    if m is None:
        lost = [s for s in REGISTRATION_SECTIONS if f"\n{s}\n" in f"\n{text}"]
        if lost:
            raise ValueError(f"{path}: written with --registrations (it has "
                             f"{' and '.join(repr(s[3:]) for s in lost)}) but records no options; "
                             "without them `bistat index` would delete those sections: give "
                             "them, e.g. bistat index " + f"{base.as_posix()} --registrations "
                             "preregistrations --reasons findings/not-run.toml --readme README.md")
        return None
    try:
        recorded = json.loads(m["json"])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: its options line is not valid JSON ({exc}); give the options "
                         "on the command line") from exc
    here = {k: None if recorded.get(k) is None else
            Path(os.path.relpath(base / recorded[k])).as_posix()
            for k in ("registrations_dir", "reasons_path", "readme")}
    for key, value in here.items():
        if value is not None and not Path(value).exists():
            raise ValueError(f"{path}: written with {key.split('_')[0]} {value}, which is not "
                             "there; give the options on the command line")
    return IndexOptions(**here)


def write_index(findings_dir: str | Path, registrations_dir: str | Path | None = None,
                reasons_path: str | Path | None = None, readme: str | Path | None = None
                ) -> Path:
    """Write ``findings_dir/README.md`` listing every ``*.md`` finding below it, and, given
    ``registrations_dir``, the answers above that listing and the registrations that have no
    finding (why: ``reasons_path``); given ``readme`` too, its results at a glance
    (:func:`readme_with_glance`). The index records these options (:func:`index_options`)."""
    base = Path(findings_dir)
    findings, comparisons = read_findings(base)
    unrun = source = None
    rows: list[Answer] = []
    newest: dict[str, NewestRelease] = {}
    answers_lines: list[str] = []
    readings: dict[str, IntervalReading] = {}
    if reasons_path is not None and registrations_dir is None:
        raise ValueError("a reasons file needs the registrations folder (--registrations)")
    if readme is not None and registrations_dir is None:
        raise ValueError("the README's results at a glance need the registrations folder "
                         "(--registrations)")
    if registrations_dir is not None:
        registrations = load_registrations(registrations_dir)
        source = None if reasons_path is None else _named(reasons_path, base)
        reasons = {} if reasons_path is None else read_reasons(reasons_path)
        unrun = unrun_registrations(findings, registrations_dir, reasons,   # errors: as given
                                    "the reasons file" if reasons_path is None
                                    else Path(reasons_path).as_posix(), registrations)
        rows, newest = answers(findings, registrations), newest_releases(registrations)
        answers_lines = render_answers(rows, base, newest, _named(registrations_dir, base))
        readings = interval_readings(findings, registrations)
    out = base / "README.md"
    options = {"registrations_dir": _from_folder(registrations_dir, base),
               "reasons_path": _from_folder(reasons_path, base),
               "readme": _from_folder(readme, base)}
    out.write_text(render_index(findings, base, unrun, source, comparisons, answers_lines,
                                readings, options), encoding="utf-8")
    if readme is not None:
        text = readme_with_glance(readme, rows, out, newest,
                                  tax_rows(findings, registrations, newest))
        Path(readme).write_text(text, encoding="utf-8")
    return out
