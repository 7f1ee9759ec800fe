"""What the findings index reads from a finding: its name, verdicts, hypothesis and Summary.

A finding's ``## Summary`` section (:mod:`bistat.report.finding_verdict` writes it) and its
``### TREATMENT (treatment) vs CONTROL (control): **LABEL**`` headings are read back
(:func:`read_finding`), so the index cannot drift from the findings. :func:`read_findings` reads
every finding below a folder but the machine's own (:data:`LOCAL_FINDINGS`), and lists release
comparisons (:data:`~bistat.report.version_comparison.COMPARISON_TITLES`) apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bistat.report.version_comparison import COMPARISON_TITLES

_VERDICT = re.compile(r"^### (?P<treatment>.+?) \(treatment\) vs (?P<control>.+?) \(control\): "
                      r"\*\*(?P<label>[^*]+)\*\*\s*$")
_TITLE = re.compile(r"^# Finding: (?P<name>.+?)(?: — exploratory analysis.*)?\s*$")
_HYPOTHESIS = re.compile(r"^> (?P<text>.+)$")
_SUMMARY_LINE = re.compile(r"^Engine: (?P<engine>.+?) · GPU: (?P<gpu>.+?) · model: `(?P<model>.*)` · "
                           r"run: `(?P<run>.*)` · rule: `(?P<rule>.*)` \((?P<analysis>confirmatory|"
                           r"exploratory)\)\s*$")
_RUN_CREATED = re.compile(r"^\| Run created \(UTC\) \| (?P<utc>[^|]+?) \|\s*$")
_RUNS = re.compile(r"^\| Runs of its registration \| (?P<n>\d+)\b")


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
    run_created: str | None = None    # the header's "Run created (UTC)"
    #: the header's "Runs of its registration" (None in findings written before it existed)
    registration_runs: int | None = None
    #: per arm, the compilation and CUDA-graph mode its Environment table gives
    #: (``torch.compile (VLLM_COMPILE), FULL_AND_PIECEWISE``); empty where it records none
    modes: tuple[tuple[str, str], ...] = ()
    #: per arm, what the behavioural probe found (its Activation table's "probe" column:
    #: ``confirmed``, ``violated``, ``no power``, ``not run`` ...); empty where it has none
    probes: tuple[tuple[str, str], ...] = ()


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
    run_created = None
    n_runs = None
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        if (m := _TITLE.match(line)) and name == path.stem:
            name = m["name"]
        elif run_created is None and (m := _RUN_CREATED.match(line)):
            run_created = m["utc"]
        elif n_runs is None and (m := _RUNS.match(line)):
            n_runs = int(m["n"])
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
    tables = _section_tables(text)
    return IndexedFinding(path, name, tuple(verdicts), hypothesis, summary, run_created, n_runs,
                          _env_modes(tables.get("Environment", [])),
                          _probes(tables.get("Activation", [])))


def _section_tables(text: str) -> dict[str, list[list[list[str]]]]:
    """Each ``## `` section's markdown tables, in order: each a list of rows of cells, its header
    first (separator rows left out)."""
    out: dict[str, list[list[list[str]]]] = {}
    section, table = None, None
    for line in text.splitlines():
        if line.startswith("## "):
            section, table = line[3:].strip(), None
        elif section is not None and line.startswith("|"):
            if table is None:
                table = []
                out.setdefault(section, []).append(table)
            if not line.startswith("|---"):
                table.append(_cells(line))
        else:
            table = None
    return out


def _env_modes(tables: list[list[list[str]]]) -> tuple[tuple[str, str], ...]:
    """Per arm, the compilation and CUDA-graph cells of the Environment section's table (its
    header names the arms after an empty first cell)."""
    modes: dict[str, list[str]] = {}
    for table in tables:
        if table and table[0] and table[0][0] == "":
            for row in table[1:]:
                if row[0] in ("compilation", "CUDA graphs"):
                    for arm, cell in zip(table[0][1:], row[1:]):
                        if cell and cell not in ("not recorded", "—"):
                            modes.setdefault(arm, []).append(cell)
            break
    return tuple((arm, ", ".join(cells)) for arm, cells in modes.items())


def _probes(tables: list[list[list[str]]]) -> tuple[tuple[str, str], ...]:
    """Per arm, the "probe" column of the Activation section's first table that has one."""
    for table in tables:
        if table and table[0][:2] == ["arm", "role"] and "probe" in table[0]:
            col = table[0].index("probe")
            return tuple((row[0], row[col]) for row in table[1:] if len(row) > col)
    return ()


#: The folder below the findings where a machine's own runs write theirs (``bash scripts/main.sh``
#: writes ``findings/local/quickstart-r2.md``; git ignores it): not the project's findings, so
#: never indexed, and a checkout's index and README stay what its committed findings say.
LOCAL_FINDINGS = "local"


def read_findings(findings_dir: str | Path
                  ) -> tuple[list[IndexedFinding], list[tuple[Path, str]]]:
    """Every ``*.md`` below ``findings_dir`` but its README and :data:`LOCAL_FINDINGS`: the
    findings, and the comparisons of releases or engines (path, title) apart."""
    comparisons, findings = [], []
    for p in sorted(Path(findings_dir).rglob("*.md")):
        if p.name == "README.md" or p.relative_to(findings_dir).parts[0] == LOCAL_FINDINGS:
            continue
        first = p.read_text(encoding="utf-8").split("\n", 1)[0]
        title = next((x for x in COMPARISON_TITLES if first.startswith(x)), None)
        if title is not None:
            comparisons.append((p, first.removeprefix("# ")))
        else:
            findings.append(read_finding(p))
    return findings, comparisons
