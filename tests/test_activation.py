"""bistat.analysis.activation: what an arm requested, what its engine log shows, what a probe confirmed."""

from __future__ import annotations

import json
import shutil
import gzip
from pathlib import Path

import pytest

from bistat.analysis.activation import arm_activation, log_markers
from bistat.analysis.summary import AnalysisError, analyze_run

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "data" / "h200" / "h200-match-smollm2"

ARMS = [{"name": "default", "role": "control", "env": {"VLLM_BATCH_INVARIANT": "0"}},
        {"name": "bi", "role": "treatment", "env": {"VLLM_BATCH_INVARIANT": "1"}},
        {"name": "bi-triton", "role": "treatment", "env": {"VLLM_BATCH_INVARIANT": "1"},
         "args": {"attention_backend": "TRITON_ATTN"}}]
BI_LINE = ("(EngineCore pid=1409)        new kernel: registered at "
           "/tmp/site/vllm/model_executor/layers/batch_invariant.py:905 (Triggered internally")


def test_markers_from_real_vllm_0_25_log_lines():
    fa3 = ["INFO 11-29 12:29:52 [cuda.py:476] Using FLASH_ATTN attention backend out of potential "
           "backends: ['FLASH_ATTN', 'TRITON_ATTN']",
           "INFO 11-29 12:29:52 [flash_attn.py:718] Using FlashAttention version 3"]
    assert log_markers(fa3) == {"bi_kernels": False, "tuned_gemm": False,
                                "attention": ("FLASH_ATTN (FA3)",)}
    assert log_markers([BI_LINE, "bistat_kernels: tuned GEMM installed as vllm.model_executor."
                        "layers.batch_invariant.matmul_persistent (pid 1813)",
                        "INFO [cuda.py:416] Using AttentionBackendEnum.TRITON_ATTN backend."]) == {
        "bi_kernels": True, "tuned_gemm": True, "attention": ("TRITON_ATTN",)}


def test_vllm_034s_compiled_batch_invariant_engine_is_seen_by_its_cublaslt_choice():
    """vLLM 0.34.0 compiled with the tuned GEMM (VLLM_USE_BREAKABLE_CUDAGRAPH=0) logs none of the
    other markers; enable_batch_invariant_mode's cuBLASLt choice makes torch warn (that engine's
    log, data/h200-v034); the default arm's log has no such line."""
    run = ROOT / "data" / "h200-v034" / "h200-v034-i23-latency-qwen3-8b-b8-compiled"
    logs = {arm: gzip.open(run / "engine-logs" / f"{arm}-1.log.gz", "rt").read().splitlines()
            for arm in ("default", "bi-tuned-gemm-compiled")}
    assert log_markers(logs["bi-tuned-gemm-compiled"])["bi_kernels"] is True
    assert log_markers(logs["default"])["bi_kernels"] is False
    line = ("[W1202 18:39:33.237104191 Context.cpp:629] Warning: torch.backends.cuda."
            "preferred_blas_library is an experimental feature. If you see any error or "
            "unexpected behavior when this flag is set please file an issue on GitHub.")
    assert any(logged.startswith(line) for logged in logs["bi-tuned-gemm-compiled"])
    assert log_markers([line])["bi_kernels"] is True

def test_status_without_logs_with_logs_and_with_a_probe():
    acts = {a.arm: a for a in arm_activation(ARMS, {"default": [], "bi": [], "bi-triton": [BI_LINE]})}
    assert acts["default"].status == "control: nothing requested" and acts["default"].requested == ()
    assert acts["bi"].status == "requested; NOT seen in the engine log"
    assert acts["bi-triton"].requested == ("VLLM_BATCH_INVARIANT=1", "attention_backend=TRITON_ATTN")
    assert acts["bi-triton"].status == ("requested; kernels registered in the engine log, not "
                                        "confirmed by a probe")
    no_logs = {a.arm: a for a in arm_activation(ARMS, {})}
    assert no_logs["bi"].status == "requested; no engine log to check"
    assert no_logs["bi"].bi_kernels_logged is None

    def report(control_differs):
        return {"schema": "bistat.probe/1", "outcome": "violated", "arms": [
            {"arm": "bi", "role": "probed", "differs": True},
            {"arm": "bi-triton", "role": "probed", "differs": False},
            {"arm": "default", "role": "negative_control", "differs": control_differs}]}
    probed = {a.arm: a for a in arm_activation(ARMS, {}, report(True))}
    assert (probed["bi"].probe, probed["bi-triton"].probe, probed["default"].probe) == \
        ("violated", "confirmed", None)
    assert probed["bi"].status == "the probe found it NOT batch-invariant"
    assert probed["bi-triton"].status.startswith("confirmed by the probe")
    weak = {a.arm: a for a in arm_activation(ARMS, {}, report(False))}
    assert weak["bi-triton"].probe == "no_power"
    assert weak["bi-triton"].status == "requested; no engine log to check; probe: no power"
    # a probe's "confirmed" does not stand against the study's own passes
    study = {"bi-triton": (0, 541)}
    assert arm_activation(ARMS, {}, report(True), study)[2].status.startswith("confirmed by the probe")
    study = {"bi-triton": (457, 541)}
    assert arm_activation(ARMS, {}, report(True), study)[2].status == (
        "the probe saw no difference, but 457 of 541 prompts diverged across the study's counted "
        "passes: the probe missed it")


def test_what_the_control_sets_and_a_treatment_leaves_unset_is_a_difference():
    """h200-fa3-kv128-smollm2's design: the control pins TRITON_ATTN and the batch-invariant mode;
    a treatment that leaves the backend to vLLM differs from it by what it does not set."""
    arms = [{"name": "triton", "role": "control",
             "env": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "0"},
             "args": {"attention_backend": "TRITON_ATTN", "log_path": "/tmp/x.log"}},
            {"name": "bi", "role": "treatment", "env": {"VLLM_BATCH_INVARIANT": "1"}},
            {"name": "twin", "role": "treatment",
             "env": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "0"},
             "args": {"attention_backend": "TRITON_ATTN"}}]
    acts = {a.arm: a for a in arm_activation(arms, {"bi": [BI_LINE]})}
    assert acts["bi"].requested == ("BISTAT_TUNED_GEMM unset (control: 0)",
                                    "attention_backend unset (control: TRITON_ATTN)")
    assert acts["bi"].status == ("requested; kernels registered in the engine log, not confirmed "
                                 "by a probe")
    assert acts["twin"].requested == () and acts["twin"].status == "same settings as the control"
    assert acts["triton"].status == "control: nothing requested"


def test_the_first_h200_attempt_shows_fa3_on_the_diverging_arms():
    s = analyze_run(SMOL, ROOT / "preregistrations" / "h200-match-smollm2.json")
    acts = {a.arm: a for a in s.activation}
    assert {a: (x.bi_kernels_logged, x.tuned_gemm_logged, x.attention) for a, x in acts.items()} == {
        "default": (False, False, ("FLASH_ATTN (FA3)",)),
        "batch-invariant": (True, False, ("FLASH_ATTN (FA3)",)),
        "bi-tuned-gemm": (True, True, ("FLASH_ATTN (FA3)",)),
        "bi-triton-attn": (True, False, ("TRITON_ATTN",))}


def _probe_json(*arms, seed=0):
    """A bistat.probe/1 report over ``arms`` ((name, role, differs), ...), as `bistat probe
    --output` writes it."""
    from bistat.analysis.probe_report import ArmProbe, ProbeSettings, ProbeTrial, decide_report

    trial = {False: ProbeTrial(0, 40, 3, True, True, None, shared_step=True),
             True: ProbeTrial(0, 40, 3, False, False, 0, shared_step=True)}
    return decide_report([ArmProbe(name, role, True, (trial[differs],), 6) for name, role, differs in arms],
                   ProbeSettings(seed=seed), "p").to_json()


def test_a_probe_report_in_the_run_directory_is_read(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    (run / "probe.json").write_text(json.dumps(_probe_json(("batch-invariant", "probed", False),
                                                           ("default", "negative_control", True))))
    acts = {a.arm: a for a in analyze_run(run, reg).activation}
    assert acts["batch-invariant"].probe == "confirmed"
    (run / "probe.json").write_text("{}")
    with pytest.raises(AnalysisError, match=r"probe\.json: field 'schema' is None, expected "
                                            r"'bistat\.probe/1'"):
        analyze_run(run, reg)


def test_probe_reports_of_one_probe_on_different_arms_are_merged(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    # the treatment probed in a later call without a control: alone, no power ...
    (run / "probe-bi.json").write_text(json.dumps(_probe_json(("batch-invariant", "probed", False))))
    assert {a.arm: a.probe for a in analyze_run(run, reg).activation}["batch-invariant"] == "no_power"
    # ... beside the report whose negative control differed, confirmed
    (run / "probe.json").write_text(json.dumps(_probe_json(("default", "negative_control", True))))
    acts = {a.arm: a for a in analyze_run(run, reg).activation}
    assert acts["batch-invariant"].probe == "confirmed"
    (run / "probe.json").write_text(json.dumps(_probe_json(("default", "negative_control", True),
                                                           seed=7)))
    with pytest.raises(AnalysisError, match=r"probe-bi\.json: a different probe from probe\.json"):
        analyze_run(run, reg)


def test_handling_keys_are_not_requested_settings():
    arms = [{"name": "c", "role": "control", "args": {"log_path": "/tmp/c.log"}},
            {"name": "t", "role": "treatment", "args": {"log_path": "/tmp/t.log",
                                                          "attention_backend": "TRITON_ATTN"}}]
    assert arm_activation(arms, {})[1].requested == ("attention_backend=TRITON_ATTN",)


def test_a_probe_that_saw_nothing_where_the_study_diverged_is_called_out(tmp_path):
    """h200-match-smollm2-r2: the FA3 batch-invariant arms' needle stayed identical among fillers
    while 457 of 541 prompts diverged in the study; and its two parts had no negative control."""
    from bistat.report.finding import render_markdown

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    (run / "probe.json").write_text(json.dumps(_probe_json(("batch-invariant", "probed", False))))
    (run / "probe-default.json").write_text(json.dumps(_probe_json(("default", "probed", False))))
    md = render_markdown(analyze_run(run, reg))
    assert ("judged together, but no part ran a negative control (`--control`), so an arm's needle "
            "staying identical confirms nothing") in md
    # the synthetic run's default arm kept 70 of 79 prompts; batch-invariant all 80
    assert ("**The probe and the study disagree** on default (needle 6 tokens; 9 of 79 prompts "
            "diverged across the counted passes): the probe saw no difference there") in md
    assert "disagree** on batch-invariant" not in md and "batch-invariant (needle" not in md
    hint = ("To aim the probe at what the study saw, `bistat probe --needle-from` with this run's "
            "directory takes as its needle the prompt that diverged first here.")
    assert hint in md
    # a probe whose needle a run chose already was aimed: the disagreement stays, the hint goes
    source = {"run": "runs/study", "run_id": "study", "prompt_id": "p", "prompt_index": 0,
              "arm": "default", "pass_index": 2, "reference_pass": 1, "position": 5,
              "kind": "token", "n_prompts_diverged": 9}
    (run / "probe-default.json").write_text(json.dumps(
        {**_probe_json(("default", "probed", False)), "needle_source": source}))
    md = render_markdown(analyze_run(run, reg))
    assert "**The probe and the study disagree** on default" in md and hint not in md
    (run / "probe-default.json").write_text(json.dumps(_probe_json(("default", "negative_control",
                                                                    True))))
    md = render_markdown(analyze_run(run, reg))
    assert "so one part's negative control gives the others their power" in md
    assert "disagree" not in md


def test_the_probes_filler_evidence_is_in_the_finding(tmp_path):
    from bistat.analysis.probe_report import ArmProbe, ProbeSettings, ProbeTrial, decide_report
    from bistat.report.finding import render_markdown

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    same = ProbeTrial(0, 40, 3, True, True, None, shared_step=True)
    arms = [ArmProbe("batch-invariant", "probed", True, (same,), 6, n_fillers_compared=38),
            ArmProbe("default", "negative_control", True, (same,), 6, n_fillers_compared=38,
                     fillers_differing=("p1", "p2"), filler_first_divergence=4)]
    (run / "probe.json").write_text(json.dumps(decide_report(arms, ProbeSettings(), "p").to_json()))
    s = analyze_run(run, reg)
    assert {a.arm: a.probe for a in s.activation}["batch-invariant"] == "confirmed"
    md = render_markdown(s)
    assert ("The fillers too: each that ran in two or more trials (among other neighbours, at "
            "another place) compared bitwise with its first trial — batch-invariant: fillers in two "
            "or more trials: 38, all identical; default: fillers in two or more trials: 38, "
            "DIFFERENT in 2 (first at token 4).") in md


def test_the_finding_says_which_run_chose_the_probes_needle(tmp_path):
    from bistat.analysis.probe_report import NeedleSource, report_from_json
    from bistat.report.finding import render_markdown

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "synthetic" / "run", run)
    reg = ROOT / "examples" / "synthetic" / "synthetic-example.json"
    data = _probe_json(("batch-invariant", "probed", False), ("default", "negative_control", True))
    (run / "probe.json").write_text(json.dumps(data))
    assert "Probe (needle `p`, 3 trial(s) among 32-128 fillers" in render_markdown(analyze_run(run, reg))
    src = NeedleSource(run="runs/study", run_id="study", prompt_id="p", prompt_index=0,
                       arm="default", pass_index=2, reference_pass=0, position=5, kind="token",
                       n_prompts_diverged=9)
    data = {**data, "needle_source": {k: getattr(src, k) for k in src.__dataclass_fields__}}
    assert report_from_json(data).needle_source == src
    (run / "probe.json").write_text(json.dumps(data))
    md = render_markdown(analyze_run(run, reg))
    assert ("Probe (needle `p`, chosen from run `study` where it first diverged earliest (token 5, "
            "arm default, pass 2), 3 trial(s) among 32-128 fillers") in md


def test_the_tuned_gemms_table_and_each_shapes_source_come_from_its_log_lines():
    """What bistat_kernels logs once per process (the table and how it was chosen) and once per
    shape (which table served it), as a vLLM worker prints them, reaches the finding's
    environment; an arm whose log has no such line shows a dash."""
    import types

    from bistat.report.finding import _gemm_table_rows

    table = ("nvidia_h200.json, by architecture (no table for NVIDIA H100 80GB HBM3; NVIDIA "
             "H200's was measured with the same compute capability 9.0 and 132 multiprocessors); "
             "shapes without an entry: vLLM 0.34.0's hopper table (13 shapes), else vLLM's fixed "
             "configuration")
    lines = [f"(Worker pid=7) bistat_kernels: batch-invariant GEMM table for NVIDIA H100 80GB "
             f"HBM3 (compute capability 9.0, 132 multiprocessors): {table}",
             "(Worker pid=7) bistat_kernels: batch-invariant GEMM bfloat16 N=4096 K=2048 served "
             "by bistat table nvidia_h200.json",
             "(Worker pid=7) bistat_kernels: batch-invariant GEMM bfloat16 N=6144 K=4096 served "
             "by bistat table nvidia_h200.json",
             "(Worker pid=7) bistat_kernels: batch-invariant GEMM bfloat16 N=960 K=576 served by "
             "vLLM's fixed configuration, on vLLM's own kernel",
             "(Worker pid=7) bistat_kernels: batch-invariant GEMM bfloat16 N=4096 K=2048 served "
             "by bistat table nvidia_h200.json"]  # a second engine start: the same shape
    acts = arm_activation(ARMS, {"default": [], "bi": lines})
    assert (acts[1].gemm_table, acts[1].gemm_shapes) == (
        (table,), (("bistat table nvidia_h200.json", 2), ("vLLM's fixed configuration", 1)))
    assert (acts[0].gemm_table, acts[2].gemm_table) == ((), ())
    summary = types.SimpleNamespace(activation=acts)
    assert _gemm_table_rows(summary, ["default", "bi", "bi-triton"]) == [
        ("tuned GEMM table (engine log)", "—", table, "—"),
        ("tuned GEMM shapes by table (engine log)", "—",
         "bistat table nvidia_h200.json: 2, vLLM's fixed configuration: 1", "—")]
    assert _gemm_table_rows(types.SimpleNamespace(activation=acts[:1]), ["default"]) == []
    from bistat.analysis.activation import logged_gemm_tables

    assert logged_gemm_tables([
        "bistat_kernels: batch-invariant GEMM bfloat16 N=4096 K=2048 served by vLLM 0.34.0's "
        "hopper table, on vLLM's own kernel",
        "bistat_kernels: batch-invariant GEMM bfloat16 N=2048 K=2048 served by vLLM (version "
        "unknown)'s hopper table, on vLLM's own kernel"]) == (
        (), (("vLLM 0.34.0's hopper table", 1), ("vLLM (version unknown)'s hopper table", 1)))
