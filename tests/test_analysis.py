"""records -> RunSummary: match counting, exclusions, divergences, validity, status, CLI."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from bistat.store.writer import RunWriter
from bistat.store.compact import compact
from bistat.store.readers import load_table
from bistat.store.format import token_sha256

from bistat.core import stats
from bistat.analysis.summary import AnalysisError, analyze_run
from bistat.cli import cli
from bistat.report.finding import render_markdown

from helpers_analysis import GPU_B, declaration, fingerprint, make_run, register_tiny

BASE = [[10 * i + k for k in range(4)] for i in range(10)]


def diverge(ids: list[int], at: int) -> list[int]:
    return ids[:at] + [999] * (len(ids) - at)


def control_diverges(arm: str, p: int, i: int):
    """ctl: prompt 2 differs at index 1 in pass 1, prompt 5 at index 3 in pass 1; trt: stable."""
    if arm == "ctl" and p == 1 and i == 2:
        return diverge(BASE[i], 1)
    if arm == "ctl" and p == 1 and i == 5:
        return diverge(BASE[i], 3)
    return BASE[i]


@pytest.fixture
def tiny(tmp_path):
    reg = register_tiny(tmp_path, declaration())
    return tmp_path, reg


def test_all_passes_counts_and_divergences(tiny):
    tmp, reg = tiny
    run = make_run(tmp, reg, control_diverges,
                   throughput=lambda arm, p: 80.0 + p if arm == "trt" else 100.0 + 2 * p)
    s = analyze_run(run)
    ctl, trt = s.arm("ctl"), s.arm("trt")
    assert (ctl.n_prompts, ctl.n_matched, ctl.n_units) == (10, 8, 10)
    assert (trt.n_prompts, trt.n_matched) == (10, 10)
    assert [(d.prompt_id, d.pass_index, d.reference_pass, d.position) for d in ctl.divergences] \
        == [("q02", 1, 0, 1), ("q05", 1, 0, 3)]
    assert ctl.match_interval == stats.wilson_interval(8, 10, 0.95)
    assert ctl.pass_throughputs == (100.0, 102.0) and trt.pass_throughputs == (80.0, 81.0)
    (comp,) = s.comparisons
    assert (comp.mcnemar.b, comp.mcnemar.c) == (0, 2)
    assert comp.difference == stats.newcombe_difference(10, 10, 8, 10, 0.95)
    assert comp.ratio == stats.throughput_ratio((80.0, 81.0), (100.0, 102.0), 0.95)
    assert comp.verdict.label.value == "working"
    assert s.deviations == () and s.not_run == () and s.gaps == ()


def test_pairwise_counts_pairs_of_passes(tmp_path):
    reg = register_tiny(tmp_path, declaration(passes=3, multi_pass="pairwise"))

    def outputs(arm, p, i):   # ctl prompt 0: A, A, B -> 1 of 3 pairs; prompt 1: A, B, C -> 0
        if arm == "ctl" and i == 0 and p == 2:
            return diverge(BASE[0], 2)
        if arm == "ctl" and i == 1 and p > 0:
            return diverge(BASE[1], p)
        return BASE[i]

    s = analyze_run(make_run(tmp_path, reg, outputs, passes=3))
    ctl = s.arm("ctl")
    assert (ctl.unit, ctl.n_units, ctl.n_matched) == ("prompt pair", 30, 8 * 3 + 1)
    assert ctl.n_prompts_matched == 8
    assert s.comparisons[0].mcnemar.c == 2


def test_failed_and_missing_prompts_are_excluded_and_counted(tiny):
    tmp, reg = tiny

    def outputs(arm, p, i):
        if arm == "ctl" and p == 1 and i == 4:
            return {"token_ids": [], "error": "HTTP 500"}
        if arm == "ctl" and p == 0 and i == 7:
            return None                        # never recorded
        return BASE[i]

    s = analyze_run(make_run(tmp, reg, outputs))
    ctl = s.arm("ctl")
    assert (ctl.n_prompts_recorded, ctl.n_prompts, ctl.n_excluded_failed,
            ctl.n_excluded_missing, ctl.n_failed_requests) == (10, 8, 1, 1, 1)
    assert s.comparisons[0].n_paired == 8
    assert s.deviations == (
        "arm ctl: 1 failed request(s) in counted passes; 1 prompt(s) excluded from matching",
        "arm ctl: 1 prompt(s) missing from a counted pass; excluded from matching")


def test_every_request_failed_is_untested(tiny):
    tmp, reg = tiny
    s = analyze_run(make_run(tmp, reg, lambda arm, p, i: {"error": "down"} if arm == "trt"
                             else BASE[i]))
    assert s.status.testable is False
    assert s.status.reason == "arm trt: every prompt had a failed request"
    assert s.comparisons[0].verdict.label.value == "untested"


def test_an_arm_whose_requests_all_failed_leaves_the_other_comparisons_testable(tmp_path):
    # h200-cost-qwen3-8b-throughput: one treatment's engine died (out of memory) and every one
    # of its requests failed; the other treatment's comparison with the control stays testable.
    reg = register_tiny(tmp_path, declaration(extra_treatments=("trt2",)))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: {"error": "worker exited"}
                             if arm == "trt2" else BASE[i], arms=("ctl", "trt", "trt2"),
                             throughput=lambda arm, p: 80.0 if arm == "trt" else 100.0))
    assert (s.status.testable, s.status.reason) == (
        False, "arm trt2: every prompt had a failed request")
    verdicts = {c.treatment: c.verdict for c in s.comparisons}
    assert verdicts["trt2"].label.value == "untested"
    assert verdicts["trt"].label.value == "working"
    assert s.not_run == ("arm trt2: its 2 counted pass(es) ran, but the engine answered none of "
                         "their requests (every request failed)",)


def test_sibling_registrations_classify_the_same_comparisons_by_their_rules(tmp_path):
    """Two rules registered together for one run (the published rule and a stricter one): the
    summary carries the sibling's verdicts; a registration differing in more than name and rule
    is no sibling, and a non-registration JSON in the folder is skipped."""
    from bistat.analysis.summary import sibling_registrations

    text = declaration()
    reg = register_tiny(tmp_path, text)
    strict = text.replace('name = "tiny"', 'name = "tiny-strict"').replace("at_least = 0.5", "at_least = 0.99")
    register_tiny(tmp_path, strict, name="tiny-strict")
    register_tiny(tmp_path, declaration(n_prompts=12).replace('name = "tiny"', 'name = "other"'),
                  name="other")
    (tmp_path / "preregistrations" / "notes.json").write_text('{"not": "a registration"}')
    assert [r.name for r in sibling_registrations(reg)] == ["tiny-strict"]

    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: BASE[i],
                             throughput=lambda arm, p: 80.0 if arm == "trt" else 100.0))
    assert s.comparisons[0].verdict.label.value == "working"       # Wilson lower end 0.72 >= 0.5
    (sib,) = s.siblings
    assert (sib.name, sib.treatment, sib.control, sib.verdict.label.value) == (
        "tiny-strict", "trt", "ctl", "reported as observed")         # 0.72 < 0.99
    assert sib.registration.endswith("preregistrations/tiny-strict.json")


def test_an_arm_with_extra_passes_that_all_failed_gets_both_the_deviation_and_not_run(tmp_path):
    reg = register_tiny(tmp_path, declaration(passes=2))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: {"error": "worker exited"}
                             if arm == "trt" else BASE[i], passes=3))
    assert "arm trt: 3 counted passes recorded, 2 declared" in s.deviations
    assert "arm ctl: 3 counted passes recorded, 2 declared" in s.deviations
    assert s.not_run == ("arm trt: its 3 counted pass(es) ran, but the engine answered none of "
                         "their requests (every request failed)",)


def test_logprob_unit_compares_bits_and_text_unit_compares_text(tmp_path):
    reg = register_tiny(tmp_path, declaration(unit="token_ids+logprobs"))

    def outputs(arm, p, i):
        lps = [-0.5, -0.25, -1.0, -2.0]
        if arm == "ctl" and i == 3 and p == 1:
            lps = [-0.5, -0.25, -1.0000000000000002, -2.0]   # one ulp at index 2
        if arm == "ctl" and i == 6:
            lps = None                                      # no logprobs: excluded
        return {"token_ids": BASE[i], "logprobs": lps}

    s = analyze_run(make_run(tmp_path, reg, outputs))
    ctl = s.arm("ctl")
    assert (ctl.n_prompts, ctl.n_matched, ctl.n_excluded_no_logprobs) == (9, 8, 1)
    assert [(d.prompt_id, d.position) for d in ctl.divergences] == [("q03", 2)]

    (tmp_path / "t").mkdir()
    reg2 = register_tiny(tmp_path / "t", declaration("texty", unit="text"), name="texty")
    s2 = analyze_run(make_run(tmp_path / "t", reg2, lambda arm, p, i: {
        "token_ids": BASE[i], "text": "same" if not (arm == "trt" and i == 0 and p) else "diff"}))
    assert (s2.arm("trt").n_matched, s2.arm("ctl").n_matched) == (9, 10)


def test_incomplete_pass_is_not_counted_and_duplicates_keep_the_last(tiny):
    tmp, reg = tiny
    run = make_run(tmp, reg, control_diverges,
                   status=lambda arm, p: "interrupted" if (arm, p) == ("trt", 1) else "complete")
    with RunWriter.open_existing(run) as w:   # a resumed run re-records q02 of ctl pass 1
        w.append("responses", {"arm": "ctl", "seq": 2, "pass_index": 1, "kind": "counted",
                               "prompt_id": "q02", "prompt_index": 2, "token_ids": BASE[2],
                               "error": None, "token_sha256": token_sha256(BASE[2])})
    s = analyze_run(run)
    assert s.arm("trt").counted_passes == (0,)
    assert s.arm("ctl").n_matched == 9
    assert "trt counted pass 1 (schedule position 2) ended 'interrupted'; not counted" \
        in s.deviations
    assert "1 response(s) recorded twice for one prompt and pass (resumed run); the last " \
           "recorded counts" in s.deviations
    assert s.not_run == ("arm trt: 1 of 2 declared counted passes not recorded",)


@pytest.mark.parametrize("kwargs, check, observed", [
    ({"env_fp": lambda arm: fingerprint(GPU_B) if arm == "trt" else fingerprint()},
     "same GPU", "ctl: GPU-aaaa; trt: GPU-bbbb"),
    ({"env_fp": lambda arm: fingerprint(vllm="0.24.0") if arm == "trt" else fingerprint()},
     "same versions", "vllm: 0.24.0 / 0.25.0"),
    # embedded samples (means since the previous one): the one at t = 0 weighs nothing, so the
    # control's mean is (2 + 1) / 2
    ({"running": lambda arm, p: [1.0, 2.0, 1.0] if arm == "ctl" else [4.0, 4.0]},
     "mean running requests", 1.5),
])
def test_failed_validity_check_makes_the_verdict_untested(tmp_path, kwargs, check, observed):
    reg = register_tiny(tmp_path, declaration(min_mean_running=2.0))
    s = analyze_run(make_run(tmp_path, reg, control_diverges,
                             throughput=lambda arm, p: 50.0 + p if arm == "trt" else 100.0 + p,
                             **kwargs))
    failed = [v for v in s.validity if v.passed is False]
    assert [(v.name, v.observed) for v in failed] == [(check, observed)]
    verdict = s.comparisons[0].verdict
    assert verdict.label.value == "untested"
    assert verdict.untested_reasons[0].startswith(f"validity check {check} failed")


def test_preemptions_above_the_cap_fail(tmp_path):
    reg = register_tiny(tmp_path, declaration(max_preemptions=0))
    s = analyze_run(make_run(tmp_path, reg, control_diverges,
                             preemptions=lambda arm, p: 3.0 if arm == "trt" else 0.0))
    (pre,) = [v for v in s.validity if v.name == "preemptions"]
    assert (pre.passed, pre.observed, pre.limit) == (False, 6.0, 0)


def test_preemptions_the_answers_report_count_where_the_counter_missed_them(tmp_path):
    """An engine that says per answer how often it preempted the request (SGLang's
    num_retractions): a pass's preemptions are the larger of the counter's increase and the
    answers' sum, so a retraction the once-a-second counter missed still fails the check."""
    reg = register_tiny(tmp_path, declaration(max_preemptions=0))

    def outputs(arm, p, i):
        out = control_diverges(arm, p, i)
        out = {"token_ids": out} if isinstance(out, list) else dict(out)
        return {**out, "preemptions": 1 if (arm, i) == ("trt", 3) else 0}

    s = analyze_run(make_run(tmp_path, reg, outputs,
                             preemptions=lambda arm, p: 0.0))
    (pre,) = [v for v in s.validity if v.name == "preemptions"]
    assert (pre.passed, pre.observed, pre.limit) == (False, 2.0, 0)
    assert pre.detail == "most in one arm's counted passes: trt"
    # the counter's reading stands where it is the larger
    s = analyze_run(make_run(tmp_path, reg, outputs, run_name="run2",
                             preemptions=lambda arm, p: 3.0 if arm == "ctl" else 0.0))
    (pre,) = [v for v in s.validity if v.name == "preemptions"]
    assert (pre.passed, pre.observed) == (False, 6.0)


def test_engine_refused_is_untested_and_not_run(tiny):
    tmp, reg = tiny
    run = make_run(tmp, reg, control_diverges, events=[
        {"arm": "trt", "event": "refused", "time_utc": "2026-02-01T13:00:00Z",
         "detail": "VLLM_BATCH_INVARIANT unsupported on this GPU"}])
    s = analyze_run(run)
    assert s.status.reason == "arm trt: engine refused: VLLM_BATCH_INVARIANT unsupported on " \
                              "this GPU"
    assert s.not_run == ("arm trt: engine refused (VLLM_BATCH_INVARIANT unsupported on this "
                         "GPU)",)
    assert s.comparisons[0].verdict.label.value == "untested"


def test_a_busy_gpu_allowed_at_start_is_a_deviation_not_a_failure(tiny):
    tmp, reg = tiny
    detail = "pid 4242 python3 (9120 MiB on GPU-aaaa)"
    s = analyze_run(make_run(tmp, reg, control_diverges, events=[
        {"arm": "*", "event": "gpu_busy", "time_utc": "2026-02-01T13:00:00Z", "detail": detail}]))
    assert s.deviations == (
        "other processes held the GPU when the run (or a resume) started, allowed with "
        f"--allow-busy-gpu: {detail}; they shared its memory and time with the arms' engines",)
    quiet = analyze_run(make_run(tmp, reg, control_diverges, run_name="quiet"))
    assert s.status.testable and quiet.deviations == ()
    assert s.comparisons[0].verdict == quiet.comparisons[0].verdict


def test_data_recorded_before_registration_fails_validity(tiny):
    tmp, reg = tiny
    s = analyze_run(make_run(tmp, reg, control_diverges, created_utc="2026-02-01T11:00:00Z"))
    (check,) = [v for v in s.validity if v.name == "registration precedes data"]
    assert check.passed is False
    assert s.comparisons[0].verdict.label.value == "untested"


def test_parquet_and_jsonl_give_the_same_finding(tiny):
    tmp, reg = tiny
    run = make_run(tmp, reg, control_diverges)
    before = render_markdown(analyze_run(run))
    compact(run)
    assert load_table(run, "responses").source == "parquet"
    assert render_markdown(analyze_run(run)) == before


def test_run_recorded_under_another_registration_is_refused(tiny):
    tmp, reg = tiny
    run = make_run(tmp, reg, control_diverges)
    (tmp / "o").mkdir()
    other = register_tiny(tmp / "o", declaration(n_prompts=11), name="tiny")
    with pytest.raises(AnalysisError) as err:
        analyze_run(run, other.path)
    assert str(err.value) == (
        f"{run / 'run.json'}: registration.sha256 {reg.sha256} is not the seal of {other.path} "
        f"({other.sha256}); the run was recorded under another registration")


def test_cli_analyze_and_compact(tiny, monkeypatch):
    tmp, reg = tiny
    make_run(tmp, reg, control_diverges,
             throughput=lambda arm, p: 50.0 + p if arm == "trt" else 100.0 + p)
    monkeypatch.chdir(tmp)
    runner = CliRunner()
    res = runner.invoke(cli, ["analyze", "run", "--out", "out"], catch_exceptions=False)
    assert res.exit_code == 0
    lines = res.output.splitlines()
    # then the one-screen CI summary (bistat.report.gating.ci_summary), the verdicts said once
    assert lines[0] == "wrote out/tiny.md and 6 plots"
    assert lines[1].startswith("bistat: tiny run run (registration ")
    assert lines[2:6] == ["  arm ctl (control): matched 8/10, two-sided 95 % Wilson [0.4902, 0.9433]; "
                          "2 divergence(s)",
                          "  arm trt (treatment): matched 10/10, two-sided 95 % Wilson "
                          "[0.7225, 1.0000]; 0 divergence(s)",
                          "VERDICT trt vs ctl: WORKING",
                          "  Batch invariance is working by the registered rule."]
    assert res.output.count("VERDICT ") == 1 and res.output.count("is working by") == 1
    # long lines are wrapped, not cut: the criterion's whole text is there
    assert "..." not in res.output and all(len(line) <= 100 for line in lines)
    crit = next(i for i, line in enumerate(lines) if line.startswith("  [met] working:"))
    assert lines[crit + 1].startswith("    ")
    assert lines[-1] == "exit 0: no --fail-on given: every verdict exits 0"
    assert sorted(p.name for p in (tmp / "out").iterdir()) == [
        "tiny-anatomy.png", "tiny-divergence.png", "tiny-match.png", "tiny-running.png",
        "tiny-serial.png", "tiny-throughput.png", "tiny.md"]
    res = runner.invoke(cli, ["analyze", "run", "--out", "out", "--json"], catch_exceptions=False)
    data = json.loads(res.stdout)  # the CI summary goes to stderr with --json
    assert res.stderr.splitlines()[-1] == "exit 0: no --fail-on given: every verdict exits 0"
    assert data["anatomy"]["arms"][0]["label_counts"]["undetermined"] == 2
    assert [(a["name"], a["n_matched"], a["n_units"]) for a in data["arms"]] == [
        ("ctl", 8, 10), ("trt", 10, 10)]
    assert data["comparisons"][0]["verdict"]["label"] == "working"
    res = runner.invoke(cli, ["compact", "run"], catch_exceptions=False)
    assert res.output.splitlines()[:2] == ["wrote run/schedule.parquet", "wrote run/responses.parquet"]
    # without --out: this machine's findings/local/, which the index never lists, so a run of
    # one's own never rewrites the project's findings
    res = runner.invoke(cli, ["analyze", "run"], catch_exceptions=False)
    assert res.output.splitlines()[0] == "wrote findings/local/tiny.md and 6 plots"
    assert sorted(p.relative_to(tmp).as_posix() for p in (tmp / "findings").rglob("*.md")) == [
        "findings/local/tiny.md"]
    res = runner.invoke(cli, ["index", "findings"], catch_exceptions=False)
    assert "tiny" not in (tmp / "findings" / "README.md").read_text()
    (tmp / "empty").mkdir()
    res = runner.invoke(cli, ["analyze", "empty"])
    assert (res.exit_code, res.output) == (
        1, "Error: empty/run.json: not found; is empty a bistat run directory?\n")


def test_cli_fail_on_returns_the_verdict_code(tiny, monkeypatch):
    tmp, reg = tiny
    make_run(tmp, reg, control_diverges)   # equal throughput: not "working"
    monkeypatch.chdir(tmp)
    res = CliRunner().invoke(cli, ["analyze", "run", "--out", "out", "--fail-on",
                                   "reported as observed"])
    assert res.exit_code == 11
    assert "VERDICT trt vs ctl: REPORTED AS OBSERVED" in res.output


@pytest.mark.parametrize("label,code", [("working", 0), ("doubtful", 10),
                                        ("reported as observed", 11)])
def test_cli_fail_on_any_gives_each_verdicts_code(tmp_path, monkeypatch, label, code):
    """`bistat analyze --fail-on any`: the exit code of every verdict label (untested below)."""
    text = declaration()
    if label != "working":  # the "working" criteria are not met: the fallback label is given
        text = text.replace("[rule]\n", f'[rule]\notherwise = "{label}"\n')
    reg = register_tiny(tmp_path, text)
    make_run(tmp_path, reg, control_diverges,
             throughput=lambda arm, p: 50.0 + p if label == "working" and arm == "trt" else 100.0 + p)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["analyze", "run", "--out", "out", "--fail-on", "any"])
    assert res.exit_code == code
    assert f"VERDICT trt vs ctl: {label.upper()}" in res.output.splitlines()


def test_cli_fail_on_untested_and_a_bad_label(tiny, monkeypatch):
    tmp, reg = tiny
    make_run(tmp, reg, control_diverges, running=lambda arm, p: [0.5, 0.5])  # validity fails
    monkeypatch.chdir(tmp)
    res = CliRunner().invoke(cli, ["analyze", "run", "--out", "out", "--fail-on", "untested"])
    assert res.exit_code == 12
    assert res.output.splitlines()[-1] == "exit 12: verdict 1 is 'untested', named by --fail-on"
    assert "  validity FAILED: mean running requests: observed 0.5, limit 1.0" in res.output
    res = CliRunner().invoke(cli, ["analyze", "run", "--out", "out", "--fail-on", "working"])
    assert res.exit_code == 2
    assert ("Error: --fail-on: 'working' has exit code 0 and cannot fail a command; name one of "
            "'doubtful', 'reported as observed', 'untested' or 'any'") in res.output


def test_anatomy_of_the_summary_equals_bistat_anatomy_and_feeds_large_drifts(tmp_path_factory):
    """analysis reads only the mismatching prompts' rows, yet gets bistat.analysis.anatomy's answer."""
    from helpers_explain import blas_run

    from bistat.analysis.anatomy import LARGE_DRIFT, NEAR_TIE, divergence_anatomy
    from bistat.core.classify import classify
    from bistat.core.rule import Rule

    run_dir = blas_run(tmp_path_factory)
    summary = analyze_run(run_dir)
    full = divergence_anatomy(run_dir)
    assert summary.anatomy.divergences == full.divergences
    assert summary.anatomy.large_drifts() == full.large_drifts() == {"blas": 0, "invariant": 0}
    blas = summary.anatomy.arm("blas")
    assert blas.n_divergences > 0 and blas.count(NEAR_TIE) == blas.n_divergences
    assert blas.n_divergences == len(summary.arm("blas").divergences)
    assert summary.anatomy.top_k == 5  # workload.top_logprobs reached every request


def _with_top_k(run_dir, tops):
    """Rewrite responses.jsonl with top-k lists {(arm, pass, prompt index): [[pos, [[tok, lp]...]]]}."""
    path = run_dir / "responses.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        got = tops.get((r["arm"], r["pass_index"], r["prompt_index"]))
        if got is not None:
            r["top_logprobs"] = [[[t, -1.0]] for t in r["token_ids"]]
            for pos, top in got:
                r["top_logprobs"][pos] = top
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("cap,label", [(0, "reported as observed"), (1, "working")])
def test_large_drifts_at_most_is_evaluated_from_the_anatomy(tmp_path, cap, label):
    text = declaration().replace(
        '{ criterion = "throughput_ratio", statistic = "point", below = 0.95 } ]',
        f'{{ criterion = "large_drifts_at_most", arm = "control", count = {cap} }} ]')
    assert "large_drifts_at_most" in text
    reg = register_tiny(tmp_path, text)
    run_dir = make_run(tmp_path, reg, control_diverges)
    # ctl prompt 2 flips at index 1 by a wide margin (2.9 nats), prompt 5 at index 3 by 0.05
    _with_top_k(run_dir, {
        ("ctl", 0, 2): [(1, [[21, -0.1], [999, -3.0]])],
        ("ctl", 1, 2): [(1, [[999, -0.1], [21, -3.0]])],
        ("ctl", 0, 5): [(3, [[53, -0.70], [999, -0.75]])],
        ("ctl", 1, 5): [(3, [[999, -0.70], [53, -0.72]])]})
    summary = analyze_run(run_dir)
    ctl = summary.anatomy.arm("ctl")
    assert (ctl.count("large drift"), ctl.count("near-tie flip")) == (1, 1)
    assert ctl.margins == pytest.approx((0.05, 2.9))
    (comparison,) = summary.comparisons
    assert comparison.verdict.label.value == label
    (crit,) = [c for c in comparison.verdict.labels[0].criteria if "large-drift" in c.description]
    assert (crit.met, crit.observed_text) == (cap >= 1, "1")
    text = render_markdown(summary)
    assert "| ctl | 2 | 1 (50 %) | 1 (50 %) | 0 (0 %) | 0 (0 %) | 0.05 [0.05, 2.9] | 1 [1, 3] |" in text



def _sibling(tmp_path, monkeypatch, old: str, new: str):
    """A registration of the synthetic example's declaration renamed, with ``old`` replaced by
    ``new``, sealed (like the example's own) before the example run was recorded."""
    import datetime as dt
    import shutil
    from pathlib import Path

    from bistat.declare.prereg import register

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(root / "examples", tmp_path / "examples")
    text = (root / "examples" / "synthetic" / "synthetic-example.toml").read_text()
    assert old in text
    text = text.replace('name = "synthetic-example"', 'name = "synthetic-example-sibling"', 1)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "synthetic-example-sibling.toml").write_text(text.replace(old, new, 1))
    reg, _ = register("experiments/synthetic-example-sibling.toml",
                      now=dt.datetime(2026, 1, 5, 9, 30, tzinfo=dt.timezone.utc))
    return tmp_path / "examples" / "synthetic" / "run", reg


def test_a_sibling_registration_differing_only_in_rule_analyses_the_run(tmp_path, monkeypatch):
    run, reg = _sibling(tmp_path, monkeypatch, "at_least = 0.95", "at_least = 0.9")
    summary = analyze_run(run, registration=reg)
    assert any("a sibling of the registration the run was recorded under" in d
               for d in summary.deviations)


def test_a_registration_differing_in_the_workload_is_refused(tmp_path, monkeypatch):
    run, reg = _sibling(tmp_path, monkeypatch, "max_tokens = 12", "max_tokens = 13")
    with pytest.raises(AnalysisError, match="the run was recorded under another registration"):
        analyze_run(run, registration=reg)


def test_a_run_stopped_before_its_registered_passes_is_untested_but_keeps_its_numbers(tmp_path):
    # 2026-12-03: a serial workload-(i) run stopped after 11 of 24 counted passes per arm was
    # labelled as if it had run in full; with multi_pass = "all" fewer passes are a lenient test
    reg = register_tiny(tmp_path, declaration(passes=3))
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: BASE[i], passes=2,
                             throughput=lambda arm, p: 90.0 + p if arm == "trt" else 100.0 + p))
    (comp,) = s.comparisons
    assert str(getattr(comp.verdict.label, "value", comp.verdict.label)) == "untested"
    assert comp.verdict.basis.startswith(
        "untested: arm ctl: stopped early, 2 of 3 registered counted passes recorded (a pilot: "
        "the registered test did not run in full); arm trt: stopped early, 2 of 3")
    # what it recorded is still measured: every prompt matched, the ratio from its passes
    assert (s.arm("trt").n_matched, s.arm("trt").n_units) == (10, 10)
    assert comp.ratio is not None and comp.ratio.ratio == pytest.approx(
        math.sqrt(90.0 * 91.0) / math.sqrt(100.0 * 101.0))
    assert s.not_run == tuple(f"arm {a}: 1 of 3 declared counted passes not recorded"
                              for a in ("ctl", "trt"))
    # the same records under a registration of 2 passes: not untested
    (tmp_path / "two").mkdir()
    reg2 = register_tiny(tmp_path / "two", declaration(passes=2))
    s2 = analyze_run(make_run(tmp_path / "two", reg2, lambda arm, p, i: BASE[i], passes=2))
    assert str(getattr(s2.comparisons[0].verdict.label, "value",
                       s2.comparisons[0].verdict.label)) != "untested"


def test_a_paired_cost_rule_pairs_the_recorded_passes_and_the_finding_shows_its_interval(tmp_path):
    """``[rule.cost] interval = "paired"``: the run's passes slow down over the run in both arms
    alike and the treatment is 4 % slower within each pair. The cost is decided on the paired
    interval (pass i with pass i), which the finding shows beside Welch's; Welch's own interval,
    widened by the drift, would not have decided it."""
    text = declaration(passes=8) + "[rule.cost]\nmargin = 0.05\ninterval = \"paired\"\n"
    reg = register_tiny(tmp_path, text)
    slow = (100.0, 97.0, 93.0, 90.0, 88.0, 86.0, 85.0, 84.0)
    jitter = (0.998, 1.002, 1.001, 0.999, 1.0, 1.0015, 0.9985, 1.0)
    s = analyze_run(make_run(tmp_path, reg, lambda arm, p, i: BASE[i], passes=8,
                             throughput=lambda arm, p: slow[p] * (0.96 * jitter[p]
                                                                  if arm == "trt" else 1.0)))
    (comp,) = s.comparisons
    cost = comp.verdict.cost
    want = stats.paired_ratio([slow[p] * 0.96 * jitter[p] for p in range(8)], list(slow))
    assert (cost.interval.low, cost.interval.high) == pytest.approx(
        (want.interval.low, want.interval.high), rel=1e-12)
    assert cost.interval.method == "paired-log" and cost.n_pairs == 8
    assert cost.outcome.value == "no measurable cost"
    assert comp.ratio.method == "welch-log" and comp.ratio.interval.low < 0.95   # Welch: no
    md = render_markdown(s)
    assert "(`[rule.cost]`: throughput ratio (treatment ÷ control, output tokens/s per pass), " \
           "95 % paired interval against [0.95, 1.05]): **no measurable cost**" in md
    assert (f"| trt ÷ ctl | {want.ratio:.4f} | [{want.interval.low:.4f}, "
            f"{want.interval.high:.4f}] | 8 |") in md
    assert "The cost rule pairs the passes" in md
