"""The study data recorded on an H100 (data/h100-sglang/: SGLang 0.5.23; data/h100-v034/: vLLM
0.34.0, Study 1(a)'s twin set beside SGLang's on one card type): sealed before the data,
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
S2 = DATA_SGLANG / "h100-sglang-match-qwen3-8b-synth"
S3 = DATA_SGLANG / "h100-sglang-latency-qwen3-8b-b8"
DATA_V034 = ROOT / "data" / "h100-v034"
V1A = DATA_V034 / "h100-v034-match-smollm2"
#: committed finding of findings/h100 -> (its run directory, the registration analysed against)
FINDINGS = {"h100-sglang-match-smollm2": (S1, "h100-sglang-match-smollm2"),
            "h100-sglang-match-qwen3-8b-synth": (S2, "h100-sglang-match-qwen3-8b-synth"),
            "h100-sglang-latency-qwen3-8b-b8": (S3, "h100-sglang-latency-qwen3-8b-b8"),
            "h100-v034-match-smollm2": (V1A, "h100-v034-match-smollm2")}
#: the H100 of the session of 2026-12-07 afternoon, where vLLM's Study 1(a) twin ran
GPU_V034 = "GPU-433db766-c1f6-b653-799b-b9e2ad229cef"
COMPARISON = ROOT / "findings" / "h100" / "compare-h100-sglang-match-smollm2-v034.md"
GPU = "GPU-05e403b9-5ded-b5fc-15d4-2ba65f6e28bb"
#: the H100 of the second session of 2026-12-07, where S3 and S2 ran one after the other
GPU_S2S3 = "GPU-4b7a13f1-f947-b1c2-7ed4-97141b1573ec"


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_h100_data_stays_within_its_budget_and_every_run_is_trimmed():
    # three runs, slim and trimmed: S1 and S2 (541 prompts x 5 passes x 4 and 3 arms) hold 6-7 MB each
    assert _bytes(DATA_SGLANG) < 16_000_000, f"data/h100-sglang holds {_bytes(DATA_SGLANG):,} bytes"
    # vLLM's twin (541 prompts x 5 passes x 5 arms): 5.2 MB
    assert _bytes(DATA_V034) < 7_000_000, f"data/h100-v034 holds {_bytes(DATA_V034):,} bytes"
    runs = sorted(p for d in (DATA_SGLANG, DATA_V034) for p in d.iterdir()
                  if p.is_dir() and p.name != "device")
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


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_the_run_postdates_its_registration(name):
    run, reg = FINDINGS[name]
    report = verify(REG / f"{reg}.json", [run])
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


@pytest.fixture(scope="module")
def s2():
    return analyze_run(S2, REG / "h100-sglang-match-qwen3-8b-synth.json")


@pytest.fixture(scope="module")
def s3():
    return analyze_run(S3, REG / "h100-sglang-latency-qwen3-8b-b8.json")


def _verdicts(summary):
    return {c.treatment: str(getattr(c.verdict.label, "value", c.verdict.label))
            for c in summary.comparisons}


def test_sglang_deterministic_mode_holds_at_head_size_128_on_fa3_and_triton(s2):
    """S2 on an H100: the 8-layer Qwen3-8B-shaped model (head size 128) at concurrency 64. The
    default arm diverges (143/541 identical in 4 counted passes); --enable-deterministic-inference
    on fa3 and on triton keeps all 541 identical, token ids and logprobs, working by the rule; the
    throughput cost within the 10 % margin (no measurable cost) on the paired interval."""
    assert {a.name: (a.n_prompts, a.n_matched, len(a.counted_passes)) for a in s2.arms} == {
        "default": (541, 143, 4), "deterministic-fa3": (541, 541, 4),
        "deterministic-triton": (541, 541, 4)}
    assert _verdicts(s2) == {"deterministic-fa3": "working", "deterministic-triton": "working"}
    costs = {c.treatment: c.verdict.cost for c in s2.comparisons}
    for arm, (low, high) in {"deterministic-fa3": (0.92, 1.00),
                             "deterministic-triton": (0.93, 0.99)}.items():
        cost = costs[arm]
        assert (cost.outcome.value, cost.metric, cost.n_pairs) == ("no measurable cost",
                                                                   "throughput", 4), arm
        assert (round(cost.interval.low, 2), round(cost.interval.high, 2)) == (low, high), arm
    assert [(v.name, v.passed) for v in s2.validity if v.passed is not True] == []
    assert {u for _, env in s2.environments for u in env.gpu_uuids} == {GPU_S2S3}


def test_sglang_deterministic_mode_costs_a_fifth_in_batch_8_latency(s3):
    """S3 on an H100: one batch of 8 requests (128 + 128 tokens) at the Qwen3-8B shape, 60 counted
    passes per arm. The deterministic arm's mean request latency is 1.21x the default's, its HAC
    interval (1.20-1.23) wholly beyond the 5 % margin: it costs. Eight prompts cannot decide
    invariance, so the labels stay as observed."""
    assert {a.name: (a.n_prompts, a.n_matched, len(a.counted_passes)) for a in s3.arms} == {
        "default": (8, 8, 60), "deterministic": (8, 8, 60)}
    assert _verdicts(s3) == {"deterministic": "reported as observed"}
    (comparison,) = s3.comparisons
    cost = comparison.verdict.cost
    assert (cost.outcome.value, cost.metric, cost.n_pairs, cost.interval.method) == (
        "costs", "latency", 60, "hac-cosine-log")
    assert (round(cost.ratio, 2), round(cost.interval.low, 2), round(cost.interval.high, 2)) == (
        1.21, 1.20, 1.23)
    assert [(v.name, v.passed) for v in s3.validity if v.passed is not True] == []
    assert {u for _, env in s3.environments for u in env.gpu_uuids} == {GPU_S2S3}


def test_the_s3_servers_got_the_same_kv_pool_and_graphs():
    """The H100 twin's memory settings did what its registration says: both servers logged the
    capped 32768-token pool and the same decode CUDA-graph batch sizes, whatever their start order."""
    import gzip
    pools, graphs = {}, {}
    for log in sorted((S3 / "engine-logs").glob("*.log.gz")):
        text = gzip.decompress(log.read_bytes()).decode("utf-8", "replace")
        pools[log.name] = [line.split("max_total_num_tokens=")[1].split(",")[0]
                           for line in text.splitlines() if "max_total_num_tokens=" in line]
        graphs[log.name] = [line.split("bs=")[1].split("]")[0] for line in text.splitlines()
                            if "Capture target decode CUDA graph end" in line]
    assert pools == {"default-1.log.gz": ["32768"], "deterministic-1.log.gz": ["32768"]}
    assert graphs["default-1.log.gz"] == graphs["deterministic-1.log.gz"] and graphs["default-1.log.gz"]


@pytest.fixture(scope="module")
def v1a():
    return analyze_run(V1A, REG / "h100-v034-match-smollm2.json")


def test_vllm_study_1a_on_the_h100_repeats_the_h200(v1a):
    """vLLM 0.34.0 on an H100, Study 1(a)'s twin: as on the H200, the default and
    VLLM_BATCH_INVARIANT=1 on FA3 keep 82/541 (doubtful at head size 64), bistat's FA3 pin,
    TRITON_ATTN and the whole plugin 541/541 (working); no cost decidable at 4 counted passes."""
    assert {a.name: (a.n_prompts, a.n_matched, len(a.counted_passes)) for a in v1a.arms} == {
        "default": (541, 82, 4), "batch-invariant": (541, 82, 4), "bi-fa3-pin": (541, 541, 4),
        "bi-triton-attn": (541, 541, 4), "bi-plugin": (541, 541, 4)}
    assert _verdicts(v1a) == {"batch-invariant": "doubtful", "bi-fa3-pin": "working",
                              "bi-triton-attn": "working", "bi-plugin": "working"}
    costs = {c.treatment: c.verdict.cost.outcome.value for c in v1a.comparisons}
    assert set(costs.values()) == {"undecidable"}
    assert {u for _, env in v1a.environments for u in env.gpu_uuids} == {GPU_V034}
    assert [(v.name, v.passed) for v in v1a.validity if v.passed is not True] == []
    # the tuned arm ran the H200's table by name, every SmolLM2 shape served by it
    plugin = dict(v1a.environments)["bi-plugin"].log_findings
    assert any("nvidia_h200.json, named by BISTAT_GEMM_TABLE" in x for x in plugin)
    served = [x for x in plugin if "served by" in x]
    assert len(served) == 5 and all("served by bistat table nvidia_h200.json" in x for x in served)


def test_the_engine_comparison_on_one_card_type_regenerates_and_reads_as_two_engines(
        s1, v1a, tmp_path):
    """bistat compare of SGLang's and vLLM's twins (scripts/regenerate_findings.sh): the committed
    comparison regenerates byte for byte, is titled as two engines, and says what it found:
    SGLang's deterministic FA3 arm holds where vLLM's batch-invariant FA3 arm does not, and both
    engines' Triton attention holds."""
    from bistat.analysis.version_compare import compare_versions
    from bistat.report.version_comparison import render_version_comparison

    vc = compare_versions(s1, v1a, {"default": "default", "deterministic-fa3": "batch-invariant",
                                    "deterministic-triton": "bi-triton-attn"})
    text = render_version_comparison(vc)
    assert text == COMPARISON.read_text()
    assert text.startswith("# Engine comparison: h100-sglang-match-smollm2 (SGLang 0.5.23) and "
                           "h100-v034-match-smollm2 (vLLM 0.34.0)\n")
    assert not vc.same_engine and vc.earlier_version is None and vc.upstream == ()
    rows = {c.later.arm: c for c in vc.arms}
    fa3, tri = rows["batch-invariant"], rows["bi-triton-attn"]
    assert (fa3.earlier.verdict, fa3.later.verdict, fa3.match_changed) == (
        "working", "doubtful", True)
    assert (tri.earlier.verdict, tri.later.verdict, tri.match_changed) == (
        "working", "working", False)
    # where the defaults diverge: vLLM's earlier in the output, and more prompts
    sg, vl = rows["default"].earlier.spread, rows["default"].later.spread
    assert (sg.n_prompts, sg.earliest, sg.median) == (112, 145, 213)
    assert (vl.n_prompts, vl.earliest, vl.median) == (459, 80, 91)
    assert fa3.explanation().startswith("differs between the engines")
    setups = {what: (a, b) for what, a, b in vc.setups}
    assert setups["arm deterministic-fa3 / batch-invariant: set beyond the control"] == (
        "`--enable-deterministic-inference`, `--attention-backend fa3`",
        "`VLLM_BATCH_INVARIANT=1`")
    assert setups["torch"] == ("2.14.1", "2.14.0")
    assert setups["counted passes"] == ("4 per arm", "4 per arm")
    assert any("different GPUs of one model (NVIDIA H100 80GB HBM3" in n for n in vc.notes)
