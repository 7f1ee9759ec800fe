"""The number a finding shows is the number that decided.

Reads every committed finding (findings/*.md, findings/h200/*.md) as text and checks, for every
criterion row of every verdict, that the value shown is the one the classifier computes from the
inputs the same finding shows: the matched / compared counts of its Match table, the discordant
prompts of its between-arms table, the ratio and interval of its Throughput table, the probe
outcome of its Activation table; and that the verdict line, the Summary table and the cost
paragraph state one cost. Nothing is recomputed from the records here: a finding must agree with
itself, whatever the records say (the byte-for-byte tests tie it to the records).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bistat.core import stats
from bistat.core.classify import format_decided
from bistat.core.rule import Rule

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = sorted(p for p in [*(ROOT / "findings").glob("*.md"),
                              *(ROOT / "findings" / "h200").glob("*.md")]
                  if p.name != "README.md" and not p.name.startswith("compare-"))


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def _table_after(lines: list[str], start: int) -> list[list[str]]:
    """The rows (header excluded) of the first markdown table at or after ``start``."""
    i = start
    while not lines[i].startswith("| "):
        i += 1
    rows = []
    i += 2
    while i < len(lines) and lines[i].startswith("| "):
        rows.append(_cells(lines[i]))
        i += 1
    return rows


def _section(lines: list[str], heading: str) -> int:
    return lines.index(heading)


class Finding:
    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text(encoding="utf-8")
        self.lines = self.text.splitlines()
        rule_at = _section(self.lines, "## Decision rule (as registered)")
        start = self.lines.index("```json", rule_at) + 1
        end = self.lines.index("```", start)
        self.rule = Rule.model_validate(json.loads("\n".join(self.lines[start:end])))
        match = _table_after(self.lines, _section(self.lines, "## Match"))
        self.units = {}
        self.wilson = {}
        for row in match:
            arm = row[0].rsplit(" (", 1)[0]
            m = re.match(r"(\d+) / (\d+) ", row[8])
            self.units[arm] = (int(m[1]), int(m[2]))
            self.wilson[arm] = row[10]
        between = self.lines.index("Between arms (paired by prompt; McNemar on prompts identical "
                                   "in all passes; Newcombe "
                                   f"{self.rule.confidence_level * 100:g} % interval for "
                                   "treatment − control match rate):")
        self.discordant = {row[0]: row[2] for row in _table_after(self.lines, between)}
        ratio_at = next(i for i, x in enumerate(self.lines)
                        if x.startswith("Ratio of per-pass output tokens/s"))
        self.ratios = {row[0]: (row[1], row[2]) for row in _table_after(self.lines, ratio_at)}
        self.probe = {}
        if "## Activation" in self.lines:
            act = _table_after(self.lines, _section(self.lines, "## Activation"))
            for row in act:
                self.probe[row[0]] = row[-2]

    def verdicts(self):
        """(treatment, control, label, criteria rows, the section's lines) per comparison."""
        heads = [i for i, x in enumerate(self.lines)
                 if re.match(r"^### .+ \(treatment\) vs .+ \(control\): \*\*", x)]
        for n, i in enumerate(heads):
            m = re.match(r"^### (.+) \(treatment\) vs (.+) \(control\): \*\*(.+)\*\*$",
                         self.lines[i])
            stop = heads[n + 1] if n + 1 < len(heads) else len(self.lines)
            yield m[1], m[2], m[3], _table_after(self.lines, i), self.lines[i:stop]


def _shown(observed: str) -> str:
    return observed.split(" (")[0]


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_decided_value_is_computed_from_the_inputs_the_finding_shows(path):
    f = Finding(path)
    rule = f.rule
    cl = rule.confidence_level
    checked = 0
    for treatment, control, label, rows, section in f.verdicts():
        for lab, description, observed, threshold, met in rows:
            if met.startswith("not evaluable"):
                continue
            bound = float(re.sub(r"^[<>=]+ ", "", threshold)) if re.match(
                r"^[<>=]+ [-\d.]+$", threshold) else None
            role = "control" if (description.startswith("control")) else "treatment"
            arm = control if role == "control" else treatment
            if "Wilson" in description and "overlap" not in description:
                m = re.search(r"\((\d+) of (\d+) matched; (?:one|two)-sided interval", observed)
                assert (int(m[1]), int(m[2])) == f.units[arm], (description, observed)
                k, n = f.units[arm]
                upper = "upper" in description
                if "one-sided" in description:
                    iv = stats.wilson_interval(k, n, cl, "less" if upper else "greater")
                else:
                    iv = stats.wilson_interval(k, n, cl)
                value = iv.high if upper else iv.low
                assert _shown(observed) == format_decided(value, [bound]), (description, observed)
                checked += 1
            elif "overlap" in description:
                assert f"treatment {f.wilson[treatment]}" in observed
                assert f"control {f.wilson[control]}" in observed
                checked += 1
            elif description == "throughput ratio (treatment ÷ control), point estimate":
                point, _ = f.ratios[f"{treatment} ÷ {control}"]
                assert float(_shown(observed)) == pytest.approx(float(point), abs=5e-5)
                assert _shown(observed) == point or len(_shown(observed)) > len(point)
                checked += 1
            elif description.startswith("throughput ratio") and "interval" in description \
                    and "equivalent" not in description:
                _, iv = f.ratios[f"{treatment} ÷ {control}"]
                ends = [x.strip() for x in iv.strip("[]").split(",")]
                end = ends[0] if "lower end" in description else ends[1]
                assert float(_shown(observed)) == pytest.approx(float(end), abs=5e-5)
                checked += 1
            elif description.startswith("treatment beats control"):
                m = re.search(r"McNemar: (\d+) control only / (\d+) treatment only", observed)
                if m:
                    assert f"{m[1]} / {m[2]}" == f.discordant[f"{treatment} vs {control}"]
                    p = stats.mcnemar_test(int(m[1]), int(m[2])).pvalue
                    shown = _shown(observed) if not observed.startswith(("yes", "no")) else \
                        re.search(r"McNemar p (\S+)", observed)[1]
                    alpha = float(re.search(r"< ([\d.]+)", threshold)[1])
                    assert shown == format_decided(p, [alpha], significant=True)
                    checked += 1
            elif description.startswith("the probe confirmed"):
                assert observed.split(" ")[0].replace("_", " ") in (
                    f.probe[treatment], f.probe[treatment].split(" ")[0])
                checked += 1
        # one cost, stated alike in the verdict line, the Summary and the cost paragraph
        cost = next((x for x in section if x.startswith("Cost (`[rule.cost]`")), None)
        if cost is not None:
            statement = cost.split(" — ", 1)[1].rstrip(".")
            assert f"**{label}** — {statement} ({treatment} vs {control})" in f.lines[2]
            summary = _table_after(f.lines, _section(f.lines, "## Summary"))
            (row,) = [r for r in summary if r[0] == treatment and r[1] == control]
            if row[7] != "—":
                shown = re.search(r"ratio ([\d.]+)", statement)[1]
                assert float(shown) == pytest.approx(float(row[7]), abs=0.5 * 10 ** -(
                    len(shown.split(".")[1])) + 1e-12)
    assert checked > 0 or "untested" in f.lines[2]


def test_every_committed_finding_is_read():
    assert len(FINDINGS) >= 30
    names = {p.stem for p in FINDINGS}
    assert {"quickstart", "synthetic-example", "tp1-match", "tp1-match-exploratory"} <= names
