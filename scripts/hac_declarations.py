"""Write experiments/NAME-hac.toml for every committed study with a cost rule whose counted passes
can be paired, and seal them: the cost interval that allows for serial correlation applied to the
existing cost studies as exploratory analyses (docs/COST-INTERVALS.md, "On the committed studies").

Each is the declaration its run was recorded under (experiments/NAME.toml) with its name and its
decision rule replaced, nothing else: a *sibling* registration in bistat.analysis.summary's sense.
The rule is the one that decides the study's cost -- the study's own where it has a cost rule,
else the default rule applied to it after its data (NAME-exploratory, Welch's interval) -- with
``[rule.cost] interval = "hac"`` (cosine kernel, bandwidth "llsw") in place of the interval it
declares. Registered after the run's data, it can be applied to the run only as an exploratory
analysis (the finding says so in its first line; the seal's time and the run's first record prove
the order), and the rule it varies keeps its own interval: a sealed rule is never changed.

    python scripts/hac_declarations.py             # writes the files, checks each is a sibling
    python scripts/hac_declarations.py --register  # and seals those not sealed yet

A file or a registration that exists already is left alone (a registration sealed from it must
not change). Sealing asks the package index for the engine's newest release once, for all of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bistat.declare.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]

#: Run (= the registration it was recorded under) -> the registration whose rule decides its
#: cost, which the HAC reading varies. Left out: h200-match-smollm2 (its arms' two counted passes
#: each share one pass index with the control: one pair, and its cost is untested) and the test
#: fixtures of tests/data/vllm-h200/ (fixtures, not studies).
STUDIES = {
    # vLLM 0.25.0: no cost rule of their own; the default rule applied after the data (Welch)
    "h200-cost-qwen3-8b-latency-b8": "h200-cost-qwen3-8b-latency-b8-exploratory",
    "h200-cost-qwen3-8b-throughput": "h200-cost-qwen3-8b-throughput-exploratory",
    "h200-match-qwen3-8b-synth": "h200-match-qwen3-8b-synth-exploratory",
    "h200-fa3-kv128-smollm2": "h200-fa3-kv128-smollm2-exploratory",
    "h200-match-smollm2-r2": "h200-match-smollm2-r2-exploratory",
    "h200-cost-qwen3-8b-throughput-r2": "h200-cost-qwen3-8b-throughput-r2-exploratory",
    "h200-cost-qwen3-8b-latency-b32": "h200-cost-qwen3-8b-latency-b32-exploratory",
    "h200-cost-qwen3-1_7b-latency-b8": "h200-cost-qwen3-1_7b-latency-b8-exploratory",
    "tp1-match": "tp1-match-exploratory",
    # vLLM 0.33.0 and 0.34.0: each study's own cost rule (Welch's or the paired interval)
    "h200-v033-match-smollm2": "h200-v033-match-smollm2",
    "h200-v033-i23-latency-qwen3-8b-b8": "h200-v033-i23-latency-qwen3-8b-b8",
    "h200-v033-i23-latency-qwen3-17b-b8": "h200-v033-i23-latency-qwen3-17b-b8",
    "h200-v034-i23-latency-qwen3-8b-b8-compiled": "h200-v034-i23-latency-qwen3-8b-b8-compiled",
    "h200-v034-i23-latency-qwen3-8b-b32-compiled": "h200-v034-i23-latency-qwen3-8b-b32-compiled",
    "h200-v034-i23-latency-qwen3-17b-b8-compiled": "h200-v034-i23-latency-qwen3-17b-b8-compiled",
    "h200-v034-i23-throughput-qwen3-8b-serial-compiled":
        "h200-v034-i23-throughput-qwen3-8b-serial-compiled",
    "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled":
        "h200-v034-i23-throughput-qwen3-8b-concurrent-compiled",
    "h200-v034-i23-throughput-qwen3-8b-paired": "h200-v034-i23-throughput-qwen3-8b-paired",
    "h200-v034-match-smollm2": "h200-v034-match-smollm2",
}

#: What replaces the interval in [rule.cost] (the parameters bistat new writes).
HAC_LINES = [
    '# The interval that allows for serial correlation of the pairs of passes (docs/COST-INTERVALS.md),',
    '# in place of the interval the rule above declares; nothing else changed.',
    'interval = "hac"',
    'hac_kernel = "cosine"            # equal-weighted cosine transforms, t with B degrees of freedom',
    'hac_bandwidth = "llsw"           # B = max(2, floor(0.4 n^(2/3))) cosine terms for n pairs',
]


def _rule_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """A declaration's lines before its decision rule and the rule's (with the comment that
    introduces it)."""
    cut = next(i for i, line in enumerate(lines) if line.strip() == "[rule]")
    while cut > 0 and (lines[cut - 1].startswith("#") or not lines[cut - 1].strip()):
        cut -= 1
    return lines[:cut], lines[cut:]


def _with_hac(rule: list[str]) -> list[str]:
    """The rule's lines with [rule.cost]'s interval replaced by :data:`HAC_LINES`."""
    start = next(i for i, line in enumerate(rule) if line.strip() == "[rule.cost]")
    end = next((i for i in range(start + 1, len(rule)) if rule[i].lstrip().startswith("[")),
               len(rule))
    table = [line for line in rule[start + 1:end]
             if not line.split("=")[0].strip() in ("interval", "hac_kernel", "hac_bandwidth")]
    while table and not table[-1].strip():
        table.pop()
    return rule[:start + 1] + table + HAC_LINES + [""] * (end < len(rule)) + rule[end:]


def hac_text(run: str, base: str) -> str:
    """experiments/RUN.toml with the name and the rule replaced (see the module docstring)."""
    body, _ = _rule_lines((ROOT / "experiments" / f"{run}.toml").read_text(
        encoding="utf-8").splitlines())
    _, rule = _rule_lines((ROOT / "experiments" / f"{base}.toml").read_text(
        encoding="utf-8").splitlines())
    top = next(i for i, line in enumerate(body) if line.startswith("name = "))
    body[top] = f'name = "{run}-hac"'
    header = [
        f"# {run}-hac: experiments/{run}.toml, the declaration its run was recorded under,",
        f"# with its name and its decision rule replaced by {base}'s rule with the",
        "# cost interval that allows for serial correlation ([rule.cost] interval = \"hac\"), nothing",
        "# else. Registered after the run's data, so the run is analysed under it only as an",
        "# EXPLORATORY analysis, never a test of the hypothesis; the rule it varies keeps its own",
        "# interval. Written by `python scripts/hac_declarations.py`.",
        "#",
    ]
    return "\n".join(header + body + [""] + _with_hac(rule)).rstrip("\n") + "\n"


def check(run: str, base: str) -> str | None:
    """Why experiments/RUN-hac.toml is not what this script writes (None: it is): a sibling of
    RUN's declaration whose rule is BASE's with the HAC interval."""
    mine = load_experiment(ROOT / "experiments" / f"{run}-hac.toml")
    theirs = load_experiment(ROOT / "experiments" / f"{run}.toml")
    rule = load_experiment(ROOT / "experiments" / f"{base}.toml").rule
    a, b = mine.resolved(), theirs.resolved()
    for data in (a, b):
        del data["name"], data["rule"]
    if a != b:
        return f"not a sibling of experiments/{run}.toml"
    want = rule.model_copy(update={"cost": rule.cost.model_copy(update={
        "interval": "hac", "hac_kernel": "cosine", "hac_bandwidth": "llsw"})})
    if mine.rule != want:
        return f"its rule is not {base}'s with interval = \"hac\""
    return None


def register_all() -> int:
    """Seal every experiments/RUN-hac.toml that has no registration yet, with one release check."""
    from bistat.declare.prereg import register
    from bistat.declare.releases import check_newest_release

    checks: dict[str, object] = {}

    def release_check(package: str):
        if package not in checks:
            checks[package] = check_newest_release(package)
        return checks[package]

    for run in STUDIES:
        if (ROOT / "preregistrations" / f"{run}-hac.json").exists():
            continue
        reg, _ = register(f"experiments/{run}-hac.toml", registrations_dir="preregistrations",
                          base_dir=ROOT, release_check=release_check)
        print(f"sealed {reg.path} at {reg.sealed_utc}")
    return 0


def main(argv: list[str]) -> int:
    for run, base in STUDIES.items():
        path = ROOT / "experiments" / f"{run}-hac.toml"
        if not path.exists():
            path.write_text(hac_text(run, base), encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
        why = check(run, base)
        if why is not None:
            print(f"{path}: {why}", file=sys.stderr)
            return 1
    if "--register" in argv:
        return register_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
