"""Shared helpers of the runner, probe and CLI-run tests: declarations on the fake engine."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import fakes
from bistat.declare.experiment import Experiment, validate_experiment

BASE_TOML = """
name = "fakerun"
hypothesis = "The fake engine's invariant arm matches across passes; the control arm diverges."

[engine]
kind = "fake"
model = "fake-model"

[[arms]]
name = "blas"
role = "control"

[[arms]]
name = "invariant"
role = "treatment"

[workload]
source = "builtin:chat"
n_prompts = 12
max_tokens = 6
concurrency = 4
passes = 4
warmup_passes = 1
order = "abba"
seed = 0
retries = 2

[validity]
min_mean_running = 1.0

[rule]
confidence_level = 0.95
otherwise = "reported as observed"

[[rule.labels]]
label = "working"
all = [ { criterion = "match_lower_bound", arm = "treatment", at_least = 0.99 } ]
"""


def declaration(**sections: Any) -> dict[str, Any]:
    """The base declaration with top-level sections (dicts) merged in, e.g. ``workload={...}``."""
    fakes.install(fakes._INSTALLED.get("default"))
    data = tomllib.loads(BASE_TOML)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = copy.deepcopy(value)
    return data


def experiment(**sections: Any) -> Experiment:
    return validate_experiment(declaration(**sections), source="test.toml")


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    """Write a declaration dict as TOML (the subset the declarations use)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(type(v))

    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    for k, v in data.items():
        if isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict)):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {value(v)}")
    for k, v in tables:
        if isinstance(v, dict):
            sub = [(kk, vv) for kk, vv in v.items() if isinstance(vv, list) and vv and isinstance(vv[0], dict)]
            lines.append(f"[{k}]")
            lines += [f"{kk} = {value(vv)}" for kk, vv in v.items() if (kk, vv) not in sub]
            for kk, items in sub:
                for item in items:
                    lines.append(f"[[{k}.{kk}]]")
                    lines += [f"{a} = {value(b)}" for a, b in item.items()]
        else:
            for item in v:
                lines.append(f"[[{k}]]")
                lines += [f"{a} = {value(b)}" for a, b in item.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
