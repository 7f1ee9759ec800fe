"""End to end on the real embedded engine (a tiny random-weight model): runner, records, probe."""

from __future__ import annotations

from collections import Counter

import helpers_runner as h
from bistat.engines.embedded.adapter import EmbeddedEngineAdapter
from bistat.model.testing import tiny_random_model
from bistat.analysis.probe_report import ProbeSettings
from bistat.analysis.probe_report import run_probe
from bistat.store.readers import read_jsonl
from bistat.run.runner import start_run

REG = {"path": "p.json", "sha256": "0" * 64, "registered_utc": "2026-01-01T00:00:00Z", "name": "fakerun"}


def _factory(experiment, arm):
    return EmbeddedEngineAdapter(experiment, arm, loader=lambda name: tiny_random_model(0, tokenizer="byte"))


def _exp(**workload):
    return h.experiment(
        engine={"kind": "embedded", "model": "tiny", "args": {"max_batch_size": 8, "max_model_len": 256}},
        arms=[{"name": "blas", "role": "control", "args": {"gemm": "blas"}},
              {"name": "invariant", "role": "treatment", "args": {"gemm": "invariant"}}],
        workload={"source": "builtin:token-ids?length=6&vocab=400", "n_prompts": 8, "max_tokens": 4,
                  "concurrency": 4, "passes": 2, "warmup_passes": 1, "ignore_eos": True, **workload},
    )


def test_embedded_engine_end_to_end(tmp_path):
    outcome = start_run(_exp(), REG, tmp_path / "run", engine_factory=_factory)
    assert (outcome.status, outcome.passes_run, outcome.failed_requests) == ("complete", 6, 0)
    responses, _ = read_jsonl(tmp_path / "run" / "responses.jsonl")
    assert len(responses) == 6 * 8
    assert {len(r["token_ids"]) for r in responses} == {4}
    assert all(r["logprobs"] is not None and r["logprob_sha256"] is not None for r in responses)
    # workload.top_logprobs (default 5) alternatives at every position
    assert all(len(r["top_logprobs"]) == 4 and {len(p) for p in r["top_logprobs"]} == {5}
               for r in responses)
    # the invariant GEMM gives every prompt the same tokens in every pass, whatever the batch
    by_prompt = Counter()
    for r in responses:
        if r["arm"] == "invariant" and r["kind"] == "counted":
            by_prompt[(r["prompt_id"], r["token_sha256"], r["logprob_sha256"])] += 1
    assert set(by_prompt.values()) == {2} and len(by_prompt) == 8
    passes, _ = read_jsonl(tmp_path / "run" / "passes.jsonl")
    assert all(p["batching"]["max_running"] >= 1 for p in passes)
    # one metrics line per engine step with its exact batch size, beside the ~1 s samples
    metrics, _ = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [m for m in metrics if m["source"] == "embedded-step"]
    assert steps and all(1 <= m["step_batch_size"] <= 4 and m["num_requests_running"] is None
                         for m in steps)
    assert all(m["step_batch_size"] is None for m in metrics if m["source"] == "embedded")
    # the per-second figures ignore the step lines (their running count is null)
    assert all(p["batching"]["max_running"] <= 4 and p["batching"]["mean_running"] > 0
               for p in passes)
    env, _ = read_jsonl(tmp_path / "run" / "environment.jsonl")
    assert [(e["arm"], e["engine"]["args"]["gemm"], e["fingerprint"]["gpus"]) for e in env] == [
        ("blas", "blas", []), ("invariant", "invariant", [])]


def test_probe_on_the_embedded_engine_invariant_arm_is_bitwise_identical():
    report = run_probe(_exp(), settings=ProbeSettings(trials=2, min_fillers=8, max_fillers=12, max_tokens=3,
                                                         design="single"),
                       engine_factory=_factory)
    invariant = report.arms[0]
    assert invariant.arm == "invariant" and invariant.error is None
    assert invariant.alone_repeat_identical is True
    assert all(t.identical for t in invariant.trials)
    # the needle shared engine steps with its fillers, by the per-step batch sizes
    assert all(t.shared_step is True and t.evidence.startswith("per-step batch sizes while the "
                                                               "needle ran: ")
               for t in invariant.trials)
    # the invariant arm is identical and shared steps, so the outcome rests on the negative
    # control alone: whether the blas arm's bits change with the batch depends on the BLAS
    # kernels (OPENBLAS_CORETYPE), and the probe must say which it saw
    control = next(a for a in report.arms if a.role == "negative_control")
    assert control.arm == "blas" and control.error is None
    assert report.outcome == ("confirmed" if control.differs else "no_power")
    assert report.reason.startswith("bitwise identical alone and in every batch" if control.differs
                                    else "the negative control showed no difference either")


def test_a_probe_with_one_request_per_step_is_vacuous():
    exp = _exp()
    exp = exp.model_copy(update={"engine": exp.engine.model_copy(update={
        "args": {"max_batch_size": 1, "max_model_len": 256}})})
    report = run_probe(exp, settings=ProbeSettings(trials=1, min_fillers=2, max_fillers=2,
                                                   max_tokens=2, design="single"),
                       engine_factory=_factory)
    assert report.outcome == "vacuous"
    assert report.reason.startswith("invariant: the engine's batching evidence shows the needle "
                                    "never shared an engine step with another request")
    assert "per-step batch sizes while the needle ran: " in report.reason
    assert report.reason.endswith(" step(s), max 1, mean 1)")
