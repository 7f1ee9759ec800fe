"""Write experiments/README.md: every study with its readings, its twins, its other releases' and
rounds' runs, and where its data and findings are, generated from experiments/, preregistrations/,
the committed run folders and findings/.

    python scripts/studies_index.py            # writes experiments/README.md
    python scripts/studies_index.py --check    # exit 1 (and say so) where the file is not current

The files stay where they are: a registration's seal and its git evidence name its path, and the
lead adds registrations while others work. What the index reads:

* **Readings** are bistat's *siblings* (``bistat.analysis.siblings``): registrations sealed with
  the same declaration but for the name and the decision rule, under which one run is analysed
  again (``-improved``, ``-goal``: registered with the study; ``-exploratory``, ``-hac``: after its
  data, exploratory). Of a group of siblings the *study* is the one whose name the others extend.
* **A study line** gathers studies whose names differ only in the tags of this repository's naming
  (:func:`study_line`): the GPU (``h100-``, ``h200-``: an H100 twin beside its H200 study), the
  engine release (``v033-``, ``v034-``: vLLM 0.33.0, 0.34.0; none: the release the first studies
  ran on), the engine (``sglang-``) and the round (``-r2``: the study registered and run again).
* **Runs** are the committed run directories (``data/``, ``tests/data/``, ``examples/``) whose
  ``run.json`` names the registration; their GPU and engine release are the ones the run recorded.
  A registration without one says why from ``findings/not-run.toml`` where that file says.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bistat.analysis.siblings import declaration_without_name_and_rule
from bistat.declare.prereg import load_registration
from bistat.store.readers import read_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
INDEX = Path("experiments/README.md")
RUN_FOLDERS = ("data", "tests/data", "examples")

_GPU = re.compile(r"^h\d00-")
_RELEASE = re.compile(r"^v\d{3}-")
_ENGINE = re.compile(r"^sglang-")
_ROUND = re.compile(r"-r\d+$")


def study_line(name: str) -> str:
    """The name without the tags of GPU, engine release, engine and round, in that order:
    ``h100-v034-i23-latency-qwen3-8b-b8-compiled`` -> ``i23-latency-qwen3-8b-b8-compiled``,
    ``h200-match-smollm2-r2`` -> ``match-smollm2``."""
    for tag in (_GPU, _RELEASE, _ENGINE):
        name = tag.sub("", name)
    return _ROUND.sub("", name)


@dataclass(frozen=True)
class Run:
    """A committed run directory: where it is, and the GPU and engine release it recorded."""

    path: str
    gpu: str
    engine: str


@dataclass
class Study:
    """A registration that is no reading of another, with its readings by suffix."""

    name: str
    engine_kind: str
    required_version: str | None
    registered: str
    readings: dict[str, str] = field(default_factory=dict)   # suffix -> registration name


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def committed_runs(root: Path) -> dict[str, list[Run]]:
    """The run directories under the run folders, by the registration name their run.json names."""
    runs: dict[str, list[Run]] = defaultdict(list)
    for folder in RUN_FOLDERS:
        for header in sorted((root / folder).rglob("run.json")):
            reg = json.loads(header.read_text(encoding="utf-8")).get("registration") or {}
            name = reg.get("name") or Path(str(reg.get("path", ""))).stem
            if not name:
                continue
            env = read_table(header.parent, "environment", ["fingerprint", "engine"])
            first = env.iloc[0] if len(env) else None
            gpus = (first["fingerprint"] or {}).get("gpus") or [] if first is not None else []
            engine = (first["engine"] or {}) if first is not None else {}
            runs[name].append(Run(_relative(header.parent, root),
                                  gpus[0]["name"] if gpus else "CPU",
                                  f"{engine.get('kind', '?')} {engine.get('version') or ''}".strip()))
    return runs


def studies(root: Path) -> list[Study]:
    """Every registration that is no reading of another, with its readings (its siblings)."""
    groups: dict[str, list] = defaultdict(list)
    for path in sorted((root / "preregistrations").glob("*.json")):
        reg = load_registration(path)
        key = json.dumps(declaration_without_name_and_rule(reg), sort_keys=True, default=str)
        groups[key].append(reg)
    found = []
    for regs in groups.values():
        names = [Path(r.path).stem for r in regs]
        heads = [r for r, n in zip(regs, names)
                 if all(m == n or m.startswith(n + "-") for m in names)]
        if len(heads) != 1:   # siblings without a common stem: each listed as a study
            heads = regs
        for head in heads:
            exp = head.experiment()
            name = Path(head.path).stem
            readings = {} if len(heads) > 1 else {
                n[len(name) + 1:]: n for n in sorted(names) if n != name}
            found.append(Study(name, exp.engine.kind, exp.engine.required_version,
                               head.registered_utc[:10], readings))
    return found


def not_run_reasons(root: Path) -> dict[str, str]:
    path = root / "findings" / "not-run.toml"
    if not path.is_file():
        return {}
    return dict(tomllib.loads(path.read_text(encoding="utf-8")).get("not_run", {}))


def findings(root: Path) -> dict[str, str]:
    """Each finding under findings/ (a machine's own, findings/local, left out) by its name."""
    return {p.stem: _relative(p, root) for p in sorted((root / "findings").rglob("*.md"))
            if "local" not in p.relative_to(root / "findings").parts[:-1] and p.name != "README.md"}


def _link(text: str, target: str) -> str:
    return f"[{text}](../{target})"


def _registration(name: str) -> str:
    return f"[{name}]({name}.toml) ([sealed](../preregistrations/{name}.json))"


def render(root: Path) -> str:
    """The index's markdown."""
    runs, found, reasons = committed_runs(root), findings(root), not_run_reasons(root)
    order: dict[str, list[Study]] = defaultdict(list)
    for s in studies(root):
        order[study_line(s.name)].append(s)
    out = ["# Studies", "",
           "Generated by `python scripts/studies_index.py` from `experiments/`, `preregistrations/`, "
           "the committed run folders (`data/`, `tests/data/`, `examples/`) and `findings/`; "
           "`tests/test_studies_index.py` checks that it is current. The files stay where they "
           "are (a seal and its git evidence name the path).", "",
           "One section per study line: the studies whose names differ only in the GPU "
           "(`h100-`, `h200-`: an H100 twin beside its H200 study), the engine release (`v033-`, "
           "`v034-`: vLLM 0.33.0, 0.34.0; none: the release the first studies ran on), the "
           "engine (`sglang-`) and the round (`-r2`: registered and run again). One row per "
           "study; its *readings* are the registrations sealed with the same declaration but for "
           "the name and the decision rule, under which its run is analysed again (`improved`, "
           "`goal`: registered with it; `exploratory`, `hac`: after its data, exploratory). "
           "*Runs*: the committed run directories recorded under it, with the GPU and engine "
           "release each recorded.", ""]
    out += ["Study lines: " + " · ".join(f"[{line}](#{line}) ({len(order[line])})"
                                         for line in sorted(order)), ""]
    for line in sorted(order):
        out += [f"## {line}", "",
                "| study | engine | registered | readings | runs | finding |",
                "|---|---|---|---|---|---|"]
        for s in sorted(order[line], key=lambda s: s.name):
            engine = f"{s.engine_kind} {s.required_version or ''}".strip()
            readings = ", ".join(_link(suffix, found[n]) if n in found else f"{suffix} (no finding)"
                                 for suffix, n in s.readings.items()) or "—"
            recorded = "<br>".join(f"{_link(r.path, r.path)} ({r.gpu}, {r.engine})"
                                   for r in runs.get(s.name, []))
            if not recorded:
                recorded = f"not run: {reasons[s.name]}" if s.name in reasons else "not run"
            finding = _link(Path(found[s.name]).name, found[s.name]) if s.name in found else "—"
            out.append(f"| {_registration(s.name)} | {engine} | {s.registered} | {readings} | "
                       f"{recorded.replace('|', '/')} | {finding} |")
        out.append("")
        compared = [n for n in found if n.startswith("compare-")
                    and any(s.name in n for s in order[line])]
        if compared:
            out += ["Compared across releases or engines: "
                    + ", ".join(_link(n, found[n]) for n in compared) + ".", ""]
    registered = {p.stem for p in (root / "preregistrations").glob("*.json")}
    elsewhere = [r for name in sorted(runs) if name not in registered for r in runs[name]]
    if elsewhere:
        out += ["## Runs of registrations outside preregistrations/", "",
                "Worked examples, each with its own registration beside it: "
                + ", ".join(_link(r.path, r.path) for r in elsewhere) + ".", ""]
    unsealed = sorted(p.stem for p in (root / "experiments").glob("*.toml")
                      if p.stem not in registered)
    if unsealed:
        out += ["## Declarations not registered", "",
                "Declared and never sealed (a worked example or a template): "
                + ", ".join(f"[{n}]({n}.toml)" for n in unsealed) + ".", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="Exit 1 where experiments/README.md is not what this writes.")
    args = parser.parse_args(argv)
    text = render(ROOT)
    path = ROOT / INDEX
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != text:
            print(f"{INDEX} is not current: run python scripts/studies_index.py", file=sys.stderr)
            return 1
        print(f"{INDEX} is current")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
