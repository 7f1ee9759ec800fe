"""The study data recorded on an H100 (data/h100-sglang/: SGLang 0.5.23): sealed before the data,
analysed from the slim-compacted and trimmed records, the committed findings regenerating byte for
byte, and what they found, asserted from the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bistat.analysis.summary import analyze_run
from bistat.declare.prereg import verify
from bistat.store.format import TRIM_RULE
from bistat.store.readers import trim_info
from finding_seal import assert_regenerates

ROOT = Path(__file__).resolve().parents[1]
REG = ROOT / "preregistrations"
DATA_SGLANG = ROOT / "data" / "h100-sglang"
S1 = DATA_SGLANG / "h100-sglang-match-smollm2"
#: committed finding of findings/h100 -> (its run directory, the registration analysed against)
FINDINGS = {"h100-sglang-match-smollm2": (S1, "h100-sglang-match-smollm2")}
GPU = "GPU-05e403b9-5ded-b5fc-15d4-2ba65f6e28bb"


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_h100_data_stays_within_its_budget_and_every_run_is_trimmed():
    assert _bytes(DATA_SGLANG) < 8_000_000, f"data/h100-sglang holds {_bytes(DATA_SGLANG):,} bytes"
    runs = sorted(p for p in DATA_SGLANG.iterdir() if p.is_dir() and p.name != "device")
    assert runs == sorted({run for run, _ in FINDINGS.values()})
    for run in runs:
        info = trim_info(run)
        assert info is not None and info["rule"] == TRIM_RULE, run.name
        registered = json.loads((REG / f"{run.name}.json").read_text())["sealed"]["declaration"]
        assert info["unit"] == registered["match"]["unit"], run.name


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_committed_h100_findings_regenerate_byte_for_byte(name, tmp_path, monkeypatch):
    """As generated: bistat analyze data/h100-sglang/RUN --registration preregistrations/NAME.json
    --out findings/h100 (from the repository root)."""
    run, reg = FINDINGS[name]
    monkeypatch.chdir(ROOT)
    run, reg = run.relative_to(ROOT), Path("preregistrations") / f"{reg}.json"
    assert_regenerates(analyze_run(run, reg), run, reg, ROOT / "findings" / "h100" / f"{name}.md",
                       tmp_path)


def test_the_run_postdates_its_registration():
    report = verify(REG / "h100-sglang-match-smollm2.json", [S1])
    assert report.ok, report.problems


@pytest.fixture(scope="module")
def s1():
    return analyze_run(S1, REG / "h100-sglang-match-smollm2.json")


def test_sglang_deterministic_mode_holds_at_head_size_64_on_every_hopper_backend(s1):
    """SGLang 0.5.23 on an H100: the default arm diverges (429/541 identical in 4 counted
    passes); --enable-deterministic-inference on fa3, triton and flashinfer keeps all 541
    prompts' token ids and logprobs identical, working by the registered rule."""
    assert {a.name: (a.n_prompts, a.n_matched, len(a.counted_passes)) for a in s1.arms} == {
        "default": (541, 429, 4), "deterministic-fa3": (541, 541, 4),
        "deterministic-triton": (541, 541, 4), "deterministic-flashinfer": (541, 541, 4)}
    verdicts = {c.treatment: str(getattr(c.verdict.label, "value", c.verdict.label))
                for c in s1.comparisons}
    assert verdicts == {"deterministic-fa3": "working", "deterministic-triton": "working",
                        "deterministic-flashinfer": "working"}
    assert {u for _, env in s1.environments for u in env.gpu_uuids} == {GPU}


def test_every_validity_check_passed_and_no_server_retracted_a_request(s1):
    """SGLang's retraction counter is absent until its first retraction: read as 0 where the
    scheduler's gauges were reported, the preemptions check is evaluable, and passed at 0."""
    assert [(v.name, v.passed) for v in s1.validity if v.passed is not True] == []
    pre = {v.name: v.observed for v in s1.validity}["preemptions"]
    assert float(pre) == 0.0
    lines = (S1 / "metrics.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) > 1000
    assert {s["num_preemptions_total"] for s in samples} == {0.0}


def test_each_server_ran_what_its_arm_asked(s1):
    """From the servers' own /server_info: the backend and the deterministic flag of each arm;
    SGLang's pytorch sampler in the deterministic arms, flashinfer's in the default."""
    reported = {}
    for line in (S1 / "environment.jsonl").read_text().splitlines():
        rec = json.loads(line)
        info = rec["engine"]["args"]["server_reported"]
        reported[rec["arm"]] = (info["attention_backend"], info["enable_deterministic_inference"],
                                info["sampling_backend"], info["disable_radix_cache"])
    assert reported == {
        "default": ("fa3", False, "flashinfer", True),
        "deterministic-fa3": ("fa3", True, "pytorch", True),
        "deterministic-triton": ("triton", True, "pytorch", True),
        "deterministic-flashinfer": ("flashinfer", True, "pytorch", True)}
