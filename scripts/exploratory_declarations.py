"""Write experiments/NAME-exploratory.toml for every committed H200 run.

Each is the declaration its run was recorded under (experiments/NAME.toml) with its name and its
decision rule replaced by the default rule (bistat.declare.template.DEFAULT_RULE_TOML), nothing else: a
*sibling* registration in bistat.analysis.summary's sense. Registered after the run's data, it can be
applied to the run only as an exploratory analysis (the finding says so in its first line; the
seal's time and the run's first record prove the order).

    python scripts/exploratory_declarations.py          # writes the files, checks each is a sibling
    for f in experiments/*-exploratory.toml; do bistat register "$f"; done

A file that exists already is left alone (a registration sealed from it must not change).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bistat.declare.experiment import load_experiment
from bistat.declare.template import DEFAULT_RULE_TOML

ROOT = Path(__file__).resolve().parents[1]

#: The registrations the committed H200 runs were recorded under (data/h200/, data/h200-tp/,
#: tests/data/vllm-h200/).
RUNS = ("h200-match-smollm2", "h200-cost-qwen3-8b-latency-b8", "h200-cost-qwen3-8b-throughput",
        "h200-match-qwen3-8b-synth", "h200-fa3-kv128-smollm2", "h200-match-smollm2-r2",
        "h200-cost-qwen3-8b-throughput-r2", "h200-cost-qwen3-8b-latency-b32",
        "h200-cost-qwen3-1_7b-latency-b8", "tp1-match", "h200-fixture-smollm2",
        "h200-fixture-triton-attn")


def exploratory_text(name: str) -> str:
    """experiments/NAME.toml with the name and the rule replaced, and a header saying so."""
    lines = (ROOT / "experiments" / f"{name}.toml").read_text(encoding="utf-8").splitlines()
    cut = next(i for i, line in enumerate(lines) if line.strip() == "[rule]")
    while cut > 0 and (lines[cut - 1].startswith("#") or not lines[cut - 1].strip()):
        cut -= 1   # the comment that introduced the old rule goes with it
    body = lines[:cut]
    top = next(i for i, line in enumerate(body) if line.startswith("name = "))   # before [engine]
    body[top] = f'name = "{name}-exploratory"'
    header = [
        f"# {name}-exploratory: experiments/{name}.toml, the declaration its run was recorded",
        "# under, with its name and its decision rule replaced by the default rule",
        "# (bistat.declare.template.DEFAULT_RULE_TOML), nothing else. Registered after the run's data, so",
        "# the run is analysed under it only as an EXPLORATORY analysis, never a test of",
        "# the hypothesis. Written by `python scripts/exploratory_declarations.py`.",
        "#",
    ]
    return "\n".join(header + body) + "\n\n" + DEFAULT_RULE_TOML


def main() -> int:
    for name in RUNS:
        path = ROOT / "experiments" / f"{name}-exploratory.toml"
        if not path.exists():
            path.write_text(exploratory_text(name), encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
        mine = load_experiment(path).resolved()
        theirs = load_experiment(ROOT / "experiments" / f"{name}.toml").resolved()
        for data in (mine, theirs):
            del data["name"], data["rule"]
        if mine != theirs:
            print(f"{path}: not a sibling of experiments/{name}.toml", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
