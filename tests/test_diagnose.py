"""``bistat diagnose``: causes ranked with evidence, on real embedded-engine runs and handwritten records."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from helpers_analysis import declaration, register_tiny
from helpers_explain import blas_run, invariant_run, validate

from bistat.cli import cmd_diagnose
from bistat.explain.diagnose import diagnose_run, render_diagnosis
from bistat.store.writer import RunWriter
from bistat.store.format import token_sha256


@pytest.fixture(scope="module")
def blas(tmp_path_factory):
    return blas_run(tmp_path_factory)


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    return invariant_run(tmp_path_factory)


@pytest.fixture()
def cli():
    group = click.Group("bistat")
    cmd_diagnose.register(group)
    return group


# --- acceptance: embedded engine, blas vs invariant ------------------------------------------------

def test_blas_run_names_batch_shape_dependence_first_with_its_evidence(blas):
    d = diagnose_run(blas)
    assert not d.nothing_to_diagnose and d.n_divergences >= 1
    top = d.causes[0]
    assert (top.key, top.strength) == ("batch_shape", "strong")
    ev = "\n".join(top.evidence)
    assert "batch sizes from per-step batch sizes (step_batch_size)" in ev
    assert f"{d.n_divergences} of {d.n_divergences} diverging pass pair(s) saw a different" in ev
    assert "arm invariant: 0 of 64 pass pairs diverged although" in ev
    assert "engine arguments of blas vs invariant: gemm: blas / invariant" in ev
    keys = [c.key for c in d.causes]
    assert keys[1] == "near_tie" and d.causes[1].strength == "moderate"
    strengths = {c.key: c.strength for c in d.causes}
    assert strengths["environment"] == "none"
    assert strengths["refused"] == "none"
    assert strengths["prefix_cache"] == "none"
    assert strengths["tokenization"] == "none"
    assert strengths["setting_ineffective"] == "none"  # the invariant (treatment) arm never diverged
    validate(d.to_dict(), "diagnosis.schema.json")


def test_cli_prints_the_ranked_causes(blas, cli):
    result = CliRunner().invoke(cli, ["diagnose", str(blas)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == render_diagnosis(diagnose_run(blas))
    lines = result.output.splitlines()
    assert lines[0] == "run blasrun"
    assert lines[1].endswith("most likely cause: batch-shape dependence (strong).")
    assert lines[2].startswith("1. batch-shape dependence [strong]: every divergence came with")


def test_cli_json_validates(blas, cli):
    result = CliRunner().invoke(cli, ["diagnose", str(blas), "--json"], catch_exceptions=False)
    data = json.loads(result.output)
    validate(data, "diagnosis.schema.json")
    assert data["causes"][0]["key"] == "batch_shape" and data["causes"][0]["rank"] == 1


def test_invariant_run_has_nothing_to_diagnose(invariant, cli):
    result = CliRunner().invoke(cli, ["diagnose", str(invariant)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == (
        "run invrun\n"
        "Nothing to diagnose: no counted pass differs from its arm's reference pass (128 pass "
        "pair(s) of 64 prompt(s) compared by token_ids).\n")
    d = diagnose_run(invariant)
    assert d.nothing_to_diagnose and d.causes == ()
    validate(d.to_dict(), "diagnosis.schema.json")


def test_cli_error_for_a_directory_that_is_not_a_run(tmp_path, cli):
    result = CliRunner().invoke(cli, ["diagnose", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'run.json'}: not found; is {tmp_path} a bistat "
                             "run directory?\n")


# --- handwritten records: each cause on its own ---------------------------------------------------

FP = {"gpus": [], "cpu": {"model": "x"}, "versions": {"numpy": "2.0"}, "git": {"commit": "c"},
      "host": "h"}


def _write_run(root, *, env=None, events=None, responses, metrics=(), arms=("ctl", "trt"),
               engine_kind="fake", engine_args=None):
    root.mkdir(parents=True, exist_ok=True)
    # a sealed registration: a run's declaration is read only from one whose seal verifies
    reg = register_tiny(root, declaration().replace('name = "ctl"', f'name = "{arms[0]}"')
                        .replace('name = "trt"', f'name = "{arms[1]}"')).path
    run = root / "run"
    with RunWriter.create(run, {"run_id": "hand", "registration": {"path": str(reg)},
                                "engine_kind": engine_kind}) as w:
        for arm in arms:
            for p in (0, 1):
                for ev in ("start", "end"):
                    w.append("schedule", {"event": ev, "seq": p, "arm": arm, "pass_index": p,
                                          "kind": "counted", "block": p, "time_utc": "t",
                                          **({"status": "complete", "n_failed": 0}
                                             if ev == "end" else {})})
        for rec in env if env is not None else [
                {"arm": a, "block": 0, "fingerprint": FP,
                 "engine": {"kind": engine_kind, "version": "1", "args": engine_args or {}},
                 "log_findings": []} for a in arms]:
            w.append("environment", rec)
        for e in events if events is not None else [
                {"arm": a, "event": "started", "time_utc": "t", "detail": None} for a in arms]:
            w.append("events", e)
        for r in responses:
            w.append("responses", r)
        for m in metrics:
            w.append("metrics", m)
    return run


def _r(arm, p, pid, ids, n_prompt=3, top=None, t=(0.0, 1.0)):
    return {"arm": arm, "seq": p, "pass_index": p, "kind": "counted", "prompt_id": pid,
            "prompt_index": 0, "token_ids": ids, "text": "", "logprobs": [-0.1] * len(ids),
            "top_logprobs": top, "finish_reason": "length", "n_prompt_tokens": n_prompt,
            "t_submit": t[0], "t_first_token": None, "t_done": t[1], "error": None,
            "attempts": 1, "token_sha256": token_sha256(ids), "logprob_sha256": None}


def _diverging(arm="ctl", **kw):
    return [_r(arm, 0, "p0", [1, 2], **kw), _r(arm, 1, "p0", [1, 3], **kw),
            _r(arm, 0, "p1", [1, 2]), _r(arm, 1, "p1", [1, 2])]


def test_environment_change_within_an_arm_ranks_first(tmp_path):
    fp2 = {**FP, "versions": {"numpy": "2.1"}}
    env = [{"arm": "ctl", "block": 0, "fingerprint": FP, "engine": {"kind": "fake"}},
           {"arm": "ctl", "block": 1, "fingerprint": fp2, "engine": {"kind": "fake"}},
           {"arm": "trt", "block": 0, "fingerprint": FP, "engine": {"kind": "fake"}}]
    d = diagnose_run(_write_run(tmp_path, env=env, responses=_diverging()))
    top = d.causes[0]
    assert (top.key, top.strength) == ("environment", "strong")
    assert top.evidence == ("arm ctl: engine start (block 1) differs from block 0: "
                            "versions.numpy: 2.0 / 2.1",)
    validate(d.to_dict(), "diagnosis.schema.json")


def test_engine_restarts_differ_only_in_pids_times_and_ports_are_no_environment_change(tmp_path):
    line = ("(EngineCore pid={pid}) INFO 11-29 12:{m}:22 [core.py:114] Initializing a V1 LLM engine "
            "(v0.25.0) with config: model='/tmp/model/smollm2', log at /tmp/bistat-vllm-{tmp}.log")
    api = "(APIServer pid={pid}) INFO 11-29 12:{m}:41 [api_utils.py:273] non-default args: {{'port': {port}}}"

    def env(block, pid, m, tmp, port, extra=()):
        return {"arm": "ctl", "block": block, "fingerprint": FP, "engine": {"kind": "fake"},
                "log_findings": [line.format(pid=pid, m=m, tmp=tmp),
                                 api.format(pid=pid + 1, m=m, port=port), *extra]}

    restart = [env(0, 1409, 31, "rnk4t695", 41155), env(1, 2910, 39, "416dy3gm", 37621),
               {"arm": "trt", "block": 0, "fingerprint": FP, "engine": {"kind": "fake"}}]
    d = diagnose_run(_write_run(tmp_path / "a", env=restart, responses=_diverging()))
    assert {c.key: c.strength for c in d.causes}["environment"] == "none"
    # a line that really changed is named, shortened, not every line of both starts
    changed = [restart[0], env(1, 2910, 39, "416dy3gm", 37621,
                               ["(EngineCore pid=2911) INFO 11-29 12:39:58 [flash_attn.py:718] "
                                "Using FlashAttention version 2"]), restart[2]]
    d = diagnose_run(_write_run(tmp_path / "b", env=changed, responses=_diverging()))
    env_cause = next(c for c in d.causes if c.key == "environment")
    assert env_cause.strength == "strong"
    assert env_cause.evidence == (
        "arm ctl: engine start (block 1) differs from block 0: log_findings: 1 line(s) differ "
        "(only in one: (EngineCore) INFO [flash_attn.py:718] Using FlashAttention version 2)",)


def test_divergences_past_one_kv_tile_point_at_the_attention_kernel(tmp_path):
    # 20 prompts of 100 tokens, each diverging at output index 29..48: KV lengths 129..148
    responses = []
    for i in range(20):
        ids = list(range(60))
        other = ids[:29 + i] + [999] + ids[30 + i:]
        responses += [_r("ctl", 0, f"p{i}", ids, n_prompt=100), _r("ctl", 1, f"p{i}", other, n_prompt=100)]
    d = diagnose_run(_write_run(tmp_path / "a", responses=responses))
    tile = next(c for c in d.causes if c.key == "attention_kv_tile")
    assert (tile.strength, tile.summary) == (
        "strong", "20 of 20 first divergence(s) start one key past a power-of-two KV length, "
                  "never before it")
    assert tile.evidence[0] == ("arm ctl: 20 first divergence(s) at KV lengths (prompt tokens + "
                                "index) 129-148, median 138; outputs began at 100-100 keys; none "
                                "at 128 or fewer, 1 exactly at 129")
    validate(d.to_dict(), "diagnosis.schema.json")
    # one key later everywhere: no tile boundary
    shifted = [{**r, "n_prompt_tokens": 101} for r in responses]
    d = diagnose_run(_write_run(tmp_path / "b", responses=shifted))
    assert next(c for c in d.causes if c.key == "attention_kv_tile").strength == "none"


def test_a_kv_tile_break_names_the_backend_the_head_size_and_the_measured_remedies(tmp_path):
    """The engine log's attention backend and the model's head size (bistat's model
    table, src/bistat/data/attention_remedies.toml), then what bistat measured against it."""
    responses = []
    for i in range(20):
        ids = list(range(60))
        responses += [_r("ctl", 0, f"p{i}", ids, n_prompt=100),
                      _r("ctl", 1, f"p{i}", ids[:29 + i] + [999] + ids[30 + i:], n_prompt=100)]
    fa3 = ["(EngineCore pid=1) INFO 12-01 13:59:04 [flash_attn.py:718] Using FlashAttention version 3"]
    env = [{"arm": a, "block": 0, "fingerprint": FP, "log_findings": fa3,
            "engine": {"kind": "vllm-server", "version": "0.25.0",
                       "args": {"model": "/tmp/model/smollm2"}}} for a in ("ctl", "trt")]
    d = diagnose_run(_write_run(tmp_path, env=env, responses=responses, engine_kind="vllm-server"))
    tile = next(c for c in d.causes if c.key == "attention_kv_tile")
    assert tile.summary == ("20 of 20 first divergence(s) start one key past a power-of-two KV "
                            "length, never before it (FLASH_ATTN (FA3), head size 64)")
    assert tile.evidence[2].startswith("arm ctl: attention backend FLASH_ATTN (FA3) (engine log), "
                                       "head size 64 (SmolLM2-135M-Instruct: 9 query heads, 3 KV "
                                       "heads; config.json of `bistat model export smollm2-135m`")
    assert [e.split(": ")[1] + ": " + e.split(": ")[2].split(" — ")[0] for e in tile.evidence[3:]] == [
        '`attention_backend = "TRITON_ATTN"` (engine argument) with `VLLM_BATCH_INVARIANT=1`: working',
        "prompt and output kept within one 128-key tile: working",
        "`BISTAT_FA3_PIN=1` with `VLLM_BATCH_INVARIANT=1` (bistat's FlashAttention-3 pin, "
        "kernels/bistat_kernels/vllm_fa3.py): working"]
    assert "(`findings/h200/h200-match-smollm2-r2.md`, arm bi-triton-attn; " in tile.evidence[3]
    validate(d.to_dict(), "diagnosis.schema.json")


def test_a_refused_setting_is_diagnosed_even_without_divergences(tmp_path):
    events = [{"arm": "ctl", "event": "started", "time_utc": "t", "detail": None},
              {"arm": "trt", "event": "refused", "time_utc": "t", "detail": "no such mode"}]
    d = diagnose_run(_write_run(tmp_path, events=events,
                                responses=[_r("ctl", p, "p0", [1]) for p in (0, 1)]))
    assert not d.nothing_to_diagnose
    assert (d.causes[0].key, d.causes[0].strength) == ("refused", "strong")
    assert d.causes[0].evidence == ("arm trt: refused (no such mode)",)


def test_unstable_tokenization_of_a_diverging_prompt(tmp_path):
    resp = [_r("ctl", 0, "p0", [1, 2], n_prompt=3), _r("ctl", 1, "p0", [1, 3], n_prompt=4)]
    d = diagnose_run(_write_run(tmp_path, responses=resp))
    tok = next(c for c in d.causes if c.key == "tokenization")
    assert tok.strength == "strong"
    assert tok.evidence == ("1 prompt(s) were tokenized to different lengths in different passes, "
                            "e.g. arm ctl prompt p0: [3, 4] tokens",)


def test_a_diverging_treatment_arm_means_the_setting_did_not_take_effect(tmp_path):
    resp = _diverging("trt") + [_r("ctl", p, pid, [1, 2]) for p in (0, 1) for pid in ("p0", "p1")]
    d = diagnose_run(_write_run(tmp_path, responses=resp))
    c = next(c for c in d.causes if c.key == "setting_ineffective")
    assert c.strength == "strong"
    assert c.evidence[:2] == ("treatment arm trt: 1 of 2 prompt(s) diverged between its passes",
                              "as often as or more than the control arm ctl (0 of 2)")


def test_prefix_caching_on_is_a_moderate_suspect(tmp_path):
    d = diagnose_run(_write_run(tmp_path, responses=_diverging(), engine_kind="vllm-server",
                                engine_args={"enable_prefix_caching": True}))
    c = next(c for c in d.causes if c.key == "prefix_cache")
    assert c.strength == "moderate"
    assert c.evidence[0] == "arm ctl: enable_prefix_caching on"


def test_divergence_under_identical_step_batch_sizes_argues_against_batch_shape(tmp_path):
    metrics = [{"arm": "ctl", "seq": p, "t": t, "num_requests_running": 4.0,
                "num_requests_waiting": 0.0, "num_preemptions_total": 0.0,
                "generation_tokens_total": 0.0, "prompt_tokens_total": 0.0,
                "source": "embedded-step", "step_batch_size": 4.0}
               for p in (0, 1) for t in (0.2, 0.4, 0.6)]
    d = diagnose_run(_write_run(tmp_path, responses=_diverging(), metrics=metrics))
    c = next(c for c in d.causes if c.key == "batch_shape")
    assert c.strength == "none"
    assert c.summary == "divergences also occur under identical batch sizes"
    assert ("1 diverging pair(s) saw identical per-step batch sizes (e.g. prompt p0 in arm ctl): "
            "batch shape cannot explain those (run-to-run nondeterminism?)") in c.evidence


def test_no_batch_metrics_is_not_assessable(tmp_path):
    d = diagnose_run(_write_run(tmp_path, responses=_diverging()))
    c = next(c for c in d.causes if c.key == "batch_shape")
    assert c.strength == "not assessable"
    near = next(c for c in d.causes if c.key == "near_tie")
    assert near.strength == "not assessable"  # no top-k logprobs recorded


def test_a_probe_report_that_is_not_one_is_refused(tmp_path):
    run = _write_run(tmp_path, responses=_diverging())
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"schema": "bistat.other/1"}))
    with pytest.raises(Exception, match=r"p\.json: field 'schema' is 'bistat\.other/1' "
                                        r"\(expected 'bistat\.probe/1'\)"):
        diagnose_run(run, probe_reports=[bad])


def test_a_violated_probe_report_is_weighed(tmp_path):
    run = _write_run(tmp_path, responses=_diverging())
    (run / "probe-trt.json").write_text(json.dumps({"schema": "bistat.probe/1",
                                                    "outcome": "violated", "reason": "r"}))
    c = next(c for c in diagnose_run(run).causes if c.key == "setting_ineffective")
    assert c.strength == "strong"
    assert f"probe report {run / 'probe-trt.json'}: outcome 'violated' (r)" in c.evidence


def test_per_second_running_counts_serve_when_no_step_sizes_were_recorded(tmp_path):
    """vLLM-like records: only ~1 s samples of num_requests_running (no step_batch_size)."""
    metrics = [{"arm": arm, "seq": p, "t": t, "num_requests_running": running,
                "num_requests_waiting": 0.0, "num_preemptions_total": 0.0,
                "generation_tokens_total": 0.0, "prompt_tokens_total": 0.0,
                "source": "prometheus"}
               for arm in ("ctl", "trt") for p, running in ((0, 4.0), (1, 9.0))
               for t in (0.0, 1.0, 2.0)]
    resp = _diverging("ctl") + [_r("trt", p, pid, [1, 2]) for p in (0, 1) for pid in ("p0", "p1")]
    d = diagnose_run(_write_run(tmp_path, responses=resp, metrics=metrics))
    c = d.causes[0]
    assert (c.key, c.strength) == ("batch_shape", "strong")
    assert c.evidence[:2] == (
        "batch sizes from per-second running-request counts (num_requests_running), over each "
        "response's lifetime",
        "1 of 1 diverging pass pair(s) saw a different batch-size profile than the reference "
        "pass (mean |Δ batch size| 5)")
    assert "arm trt: 0 of 2 pass pairs diverged although 2 saw different batch sizes" in c.evidence


def test_near_tie_share_counts_jitter_as_jitter_not_as_near_tie_flips():
    """0 near-tie flips and 15 logprob jitters: the summary says 100 % rounding noise, all of it
    jitter, never "100 % near-ties" above evidence of 0 near-tie flips."""
    from types import SimpleNamespace

    from bistat.analysis.anatomy import JITTER, NEAR_TIE
    from bistat.explain.diagnose import _near_tie

    def div(label):
        return SimpleNamespace(label=label, margin=None, margin_is_bound=False, arm="ctl",
                               prompt_id="p", position=0)

    anatomy = SimpleNamespace(n_divergences=15, divergences=[div(JITTER)] * 15, epsilon=0.01,
                              top_k=5)
    cause = _near_tie(anatomy)
    assert cause.evidence[0].startswith("0 near-tie flip(s), 0 large drift(s), 15 logprob jitter")
    assert cause.summary == ("100 % of divergences are rounding noise: 15 logprob jitter "
                             "(rounding noise in the logprobs, no token flipped)")
    assert "near-ties" not in cause.summary
    mixed = _near_tie(SimpleNamespace(n_divergences=4, divergences=[div(NEAR_TIE)] * 2
                                      + [div(JITTER)] * 2, epsilon=0.01, top_k=5))
    assert mixed.summary == ("100 % of divergences are rounding noise: 2 near-tie flip(s) that "
                             "rounding noise tipped and 2 logprob jitter (rounding noise in the "
                             "logprobs, no token flipped)")
