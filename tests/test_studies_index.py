"""experiments/README.md, the index of the studies (scripts/studies_index.py): current, and a
faithful map: every registration listed once, as a study or as one of its readings; every reading
a sibling of its study (the same declaration but for the name and the decision rule); every
committed run beside the registration it was recorded under."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from bistat.analysis.siblings import declaration_without_name_and_rule
from bistat.declare.prereg import load_registration

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def index():
    spec = importlib.util.spec_from_file_location("studies_index",
                                                  ROOT / "scripts" / "studies_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def text(index):
    return index.render(ROOT)


def test_the_committed_index_is_current(text):
    committed = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    assert committed == text, "experiments/README.md is stale: run python scripts/studies_index.py"


@pytest.mark.parametrize("name, line", [
    ("h200-match-smollm2", "match-smollm2"),
    ("h200-match-smollm2-r2", "match-smollm2"),
    ("h200-v034-match-smollm2", "match-smollm2"),
    ("h200-sglang-match-smollm2", "match-smollm2"),
    ("h100-v034-i23-latency-qwen3-8b-b8-compiled", "i23-latency-qwen3-8b-b8-compiled"),
    ("h200-v033-i23-latency-qwen3-8b-b8-compiled", "i23-latency-qwen3-8b-b8-compiled"),
    ("tp1-match", "tp1-match"),
    ("quickstart-r2", "quickstart"),
])
def test_a_study_line_drops_the_gpu_release_engine_and_round_tags(index, name, line):
    assert index.study_line(name) == line


def test_every_registration_is_listed_once_and_every_reading_is_a_sibling(index):
    studies = index.studies(ROOT)
    listed = [s.name for s in studies] + [n for s in studies for n in s.readings.values()]
    registered = sorted(p.stem for p in (ROOT / "preregistrations").glob("*.json"))
    assert sorted(listed) == registered
    by_suffix = {}
    for s in studies:
        mine = declaration_without_name_and_rule(
            load_registration(ROOT / "preregistrations" / f"{s.name}.json"))
        for suffix, name in s.readings.items():
            assert name == f"{s.name}-{suffix}"
            other = load_registration(ROOT / "preregistrations" / f"{name}.json")
            assert declaration_without_name_and_rule(other) == mine, name
            by_suffix.setdefault(suffix, []).append(s.name)
    assert set(by_suffix) == {"exploratory", "hac", "improved", "goal"}
    assert by_suffix["goal"] == ["h200-cost-qwen3-8b-throughput", "h200-cost-qwen3-8b-throughput-r2"]


def test_each_study_line_holds_its_twins_releases_and_rounds_with_their_runs(text):
    section = text[text.index("\n## match-smollm2\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| [")]
    assert [re.match(r"\| \[([^\]]+)\]", r).group(1) for r in rows] == [
        "h100-sglang-match-smollm2", "h100-v034-match-smollm2", "h200-match-smollm2",
        "h200-match-smollm2-r2", "h200-sglang-match-smollm2", "h200-v033-match-smollm2",
        "h200-v034-match-smollm2"]
    assert "[data/h200-v034/h200-v034-match-smollm2](../data/h200-v034/h200-v034-match-smollm2) " \
           "(NVIDIA H200, vllm-server 0.34.0)" in rows[6]
    assert "[hac](../findings/h200/h200-v034-match-smollm2-hac.md)" in rows[6]
    assert "not run: " in rows[4] and "sglang-server 0.5.23" in rows[4]
    # vLLM's H100 twin ran beside SGLang's, compared on one card type
    assert ("[data/h100-v034/h100-v034-match-smollm2](../data/h100-v034/h100-v034-match-smollm2) "
            "(NVIDIA H100 80GB HBM3, vllm-server 0.34.0)") in rows[1]
    assert "[compare-h100-sglang-match-smollm2-v034](../findings/h100/" in section
    # the H100 twin beside its H200 study, with its run on the card it ran on
    assert ("[data/h100-sglang/h100-sglang-match-smollm2](../data/h100-sglang/"
            "h100-sglang-match-smollm2) (NVIDIA H100 80GB HBM3, sglang-server 0.5.23)") in rows[0]
    assert "[compare-h200-match-smollm2-r2-v033](../findings/h200/" in section
    twins = text[text.index("\n## i23-latency-qwen3-8b-b8-compiled\n"):]
    twins = twins[:twins.index("\n## ", 1)]
    assert "[h100-v034-i23-latency-qwen3-8b-b8-compiled](" in twins
    assert "[h200-v034-i23-latency-qwen3-8b-b8-compiled](" in twins


def test_every_committed_run_is_listed_beside_its_registration(text):
    headers = [p for folder in ("data", "tests/data", "examples")
               for p in (ROOT / folder).rglob("run.json")]
    assert len(headers) >= 20
    registered = {p.stem for p in (ROOT / "preregistrations").glob("*.json")}
    examples = text[text.index("\n## Runs of registrations outside preregistrations/\n"):]
    for header in headers:
        name = json.loads(header.read_text())["registration"]["name"]
        run = header.parent.relative_to(ROOT).as_posix()
        if name not in registered:          # a worked example's own registration
            assert f"[{run}](../{run})" in examples.split("\n## ")[1]
            continue
        row = next(line for line in text.splitlines() if line.startswith(f"| [{name}]("))
        assert f"[{run}](../{run})" in row
    assert "[examples/synthetic/run](../examples/synthetic/run)" in examples
