"""The bitwise needle-in-batch probe with its negative control, on the fake engine."""

from __future__ import annotations

import pytest

import fakes
import helpers_runner as h
import json
import math
import struct
from dataclasses import replace

from bistat.engines.base import GenerationResult, MetricsSample
from bistat.analysis.probe_report import (ProbeSettings, compare_bitwise, merge_reports, report_from_json)
from bistat.analysis.probe_report import run_probe
from bistat.run.probe import shared_step_evidence

SMALL = ProbeSettings(trials=3, min_fillers=32, max_fillers=40, max_tokens=6, seed=1, design="single")


def _exp(control=None, treatment=None):
    return h.experiment(arms=[{"name": "blas", "role": "control", "args": {"fake": control or {}}},
                              {"name": "invariant", "role": "treatment", "args": {"fake": treatment or {}}}])


def _r(ids, lps):
    return GenerationResult("n", ids, "", lps, None, None, None, 0.0, None, 0.0)


def test_compare_bitwise_sees_one_ulp_and_signed_zero():
    assert compare_bitwise(_r([1, 2, 3], [-0.5, -1.0, 0.0]), _r([1, 2, 3], [-0.5, -1.0, 0.0])).identical
    c = compare_bitwise(_r([1, 2, 3], [-0.5, -1.0, 0.0]), _r([1, 2, 3], [-0.5, -1.0, -0.0]))
    assert (c.tokens_equal, c.logprobs_equal, c.first_divergence) == (True, False, 2)
    c = compare_bitwise(_r([1, 2, 3], None), _r([1, 9, 3], None))
    assert (c.tokens_equal, c.logprobs_equal, c.first_divergence) == (False, None, 1)
    c = compare_bitwise(_r([1, 2], None), _r([1, 2, 3], None))
    assert (c.tokens_equal, c.first_divergence) == (False, 2)


def test_confirmed_when_invariant_and_the_negative_control_differs():
    script = fakes.FakeScript()
    report = run_probe(_exp(control={"divergence": 0.9}), settings=SMALL, engine_factory=script.factory)
    assert (report.outcome, report.reason) == (
        "confirmed", "bitwise identical alone and in every batch (the fillers too, across trials), "
        "and the negative control differs")
    probed, control = report.arms
    assert (probed.arm, probed.role, probed.alone_repeat_identical) == ("invariant", "probed", True)
    assert all(t.identical for t in probed.trials) and len(probed.trials) == 3
    assert control.role == "negative_control" and control.differs
    assert all(32 <= t.n_fillers <= 40 and 0 <= t.position <= t.n_fillers for t in probed.trials)
    # the needle really ran among its fillers, in one batch, at the reported position
    batches = [order for arm, order in script.passes if arm == "invariant"]
    assert [len(b) for b in batches] == [1, 1] + [t.n_fillers + 1 for t in probed.trials]
    assert [b.index(report.needle_prompt_id) for b in batches[2:]] == [t.position for t in probed.trials]
    assert script.running == set()


def test_placements_are_seeded():
    a = run_probe(_exp(), settings=SMALL, engine_factory=fakes.FakeScript().factory)
    b = run_probe(_exp(), settings=SMALL, engine_factory=fakes.FakeScript().factory)
    assert [(t.n_fillers, t.position) for t in a.arms[0].trials] == [(t.n_fillers, t.position) for t in b.arms[0].trials]


def test_violated_when_the_probed_arm_differs_even_only_in_logprob_bits():
    report = run_probe(_exp(control={"divergence": 0.9}, treatment={"logprob_jitter": True}),
                       settings=ProbeSettings(trials=4, min_fillers=32, max_fillers=40, max_tokens=6,
                                              design="single"),
                       engine_factory=fakes.FakeScript().factory)
    assert report.outcome == "violated"
    assert report.reason == "bitwise differences on invariant: not batch invariant"
    diffs = [t for t in report.arms[0].trials if not t.identical]
    assert diffs and all(t.tokens_equal and t.logprobs_equal is False and t.first_divergence == 0 for t in diffs)


def test_no_power_when_the_negative_control_shows_nothing():
    report = run_probe(_exp(), settings=SMALL, engine_factory=fakes.FakeScript().factory)
    assert report.outcome == "no_power"
    assert report.reason.startswith("the negative control showed no difference either")
    report = run_probe(_exp(), control="", settings=SMALL, engine_factory=fakes.FakeScript().factory)
    assert (report.outcome, len(report.arms)) == ("no_power", 1)


def test_untested_when_the_engine_refuses_or_the_needle_fails():
    report = run_probe(_exp(treatment={"refuse": "no such mode"}), settings=SMALL,
                       engine_factory=fakes.FakeScript().factory)
    assert report.outcome == "untested" and report.arms[0].error == "EngineRefused: no such mode"
    report = run_probe(_exp(control={"divergence": 0.9}, treatment={"fail_prompts": ["chat-0000"]}),
                       settings=SMALL, engine_factory=fakes.FakeScript().factory)
    assert report.outcome == "untested"
    assert report.arms[0].error == "the needle's request failed: HTTP 500: Internal Server Error"


def test_report_json_and_summary():
    report = run_probe(_exp(control={"divergence": 0.9}), settings=SMALL, engine_factory=fakes.FakeScript().factory)
    data = report.to_json()
    assert data["schema"] == "bistat.probe/1" and data["outcome"] == "confirmed"
    assert [a["differs"] for a in data["arms"]] == [False, True]
    lines = report.summary_lines()
    assert lines[0] == "needle chat-0000, 3 trial(s) of 32-40 fillers, 6 tokens"
    assert lines[1] == ("  invariant (probed): alone twice identical; in batch identical in 3/3 trial(s); "
                        "needle shared a step in 3/3 trial(s); fillers in two or more trials: 40, all "
                        "identical")
    assert lines[2].startswith("  blas (negative control): alone twice identical; in batch identical in ")
    # the fillers of the batch-dependent arm differ between trials too (the fake changes a
    # request's first token when its batch hashes below `divergence`)
    blas = report.arms[1]
    assert blas.n_fillers_compared == 40 and len(blas.fillers_differing) == 33
    assert blas.filler_first_divergence == 0
    assert lines[2].endswith("; fillers in two or more trials: 40, DIFFERENT in 33 (first at token 0)")
    assert lines[-1] == ("outcome: confirmed — bitwise identical alone and in every batch (the fillers too, "
                         "across trials), and the negative control differs")
    assert report_from_json(json.loads(json.dumps(data))) == report


def _result(pid, ids, lps=None, error=None):
    return GenerationResult(pid, list(ids), "", lps, None, None, None, 0.0, None, 1.0, error=error)


def test_fillers_are_compared_across_the_trials_they_ran_in():
    """The same filler among other neighbours in another trial: a difference there is a
    difference (h200-match-smollm2-r2's needle stayed identical on arms whose prompts diverged)."""
    from bistat.run.probe import _compare_fillers

    trials = [{"f1": _result("f1", [1, 2, 3], [-0.5, -1.0, -2.0]), "f2": _result("f2", [4, 5])},
              {"f1": _result("f1", [1, 2, 3], [-0.5, -1.0000000000000002, -2.0]),
               "f3": _result("f3", [7])},
              {"f2": _result("f2", [4, 6]), "f3": _result("f3", [7], error="HTTP 500"),
               "f1": _result("f1", [1, 2, 3], [-0.5, -1.0, -2.0])}]
    ev = _compare_fillers(trials)
    # f1 and f2 came back from two trials or more; f3's second result failed, so it compared none
    assert (ev.n_compared, ev.differing, ev.first_divergence) == (2, ("f1", "f2"), 1)
    assert _compare_fillers([trials[0]]).n_compared == 0


def test_a_filler_difference_alone_makes_the_arm_differ_and_old_reports_still_read():
    from bistat.analysis.probe_report import ArmProbe, ProbeSettings, ProbeTrial, decide_report

    same = ProbeTrial(0, 40, 3, True, True, None, shared_step=True)
    quiet = ArmProbe("bi", "probed", True, (same,), 164, n_fillers_compared=120)
    loud = ArmProbe("bi", "probed", True, (same,), 164, n_fillers_compared=120,
                    fillers_differing=("chat-0007",), filler_first_divergence=97)
    control = ArmProbe("default", "negative_control", True, (same,), 199, n_fillers_compared=120,
                       fillers_differing=("chat-0003",), filler_first_divergence=131)
    assert not quiet.differs and loud.differs
    report = decide_report([loud, control], ProbeSettings(), "chat-0000")
    assert (report.outcome, report.reason) == ("violated", "bitwise differences on bi: not batch invariant")
    assert decide_report([quiet, control], ProbeSettings(), "chat-0000").outcome == "confirmed"
    # a report written before the fillers were compared reads as "no filler evidence" and
    # writes back as it was
    old = decide_report([ArmProbe("bi", "probed", True, (same,), 164)], ProbeSettings(), "p").to_json()
    assert "n_fillers_compared" not in old["arms"][0]
    assert report_from_json(old).arms[0].n_fillers_compared is None
    assert report_from_json(old).to_json() == old


def test_bad_arguments():
    with pytest.raises(ValueError, match="arm 'nope' is not in the declaration; arms: blas, invariant"):
        run_probe(_exp(), arms=["nope"], settings=SMALL, engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match="cannot be both probed and the negative control"):
        run_probe(_exp(), arms=["blas"], settings=SMALL, engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match="need 1 <= min_fillers <= max_fillers, got 64 and 32"):
        ProbeSettings(min_fillers=64, max_fillers=32)


# --- the vacuity guard ------------------------------------------------------------------------


class _Wrapped:
    """A fake engine whose batching or capabilities a test changes (delegating the rest)."""

    def __init__(self, inner, *, serial=False, no_metrics=False):
        self.inner, self.kind, self.serial, self.no_metrics = inner, inner.kind, serial, no_metrics

    def start(self):
        return self.inner.start()

    def run_pass(self, requests, *, concurrency, on_result, on_metrics):
        self.inner.run_pass(requests, concurrency=1 if self.serial else concurrency,
                            on_result=on_result,
                            on_metrics=(lambda s: None) if self.no_metrics else on_metrics)

    def fingerprint(self):
        return self.inner.fingerprint()

    def stop(self):
        self.inner.stop()


def _factory(**kw):
    script = fakes.FakeScript()
    return lambda exp, arm: _Wrapped(script.factory(exp, arm), **kw)


def test_vacuous_when_the_needle_never_shared_a_step():
    # one request per engine step: every sample says 1 running, the "batch" never batched
    report = run_probe(_exp(control={"divergence": 0.9}), settings=SMALL,
                       engine_factory=_factory(serial=True))
    assert report.outcome == "vacuous"
    assert report.reason.startswith(
        "invariant: the engine's batching evidence shows the needle never shared an engine step "
        "with another request; the sweep tested nothing -- raise the concurrency or the engine's "
        "batch size (trial 0: running requests from 1 metrics sample(s) around the needle: max 1")
    assert [t.shared_step for t in report.arms[0].trials] == [False, False, False]
    assert "; needle shared a step in 0/3 trial(s); " in report.summary_lines()[1]
    from bistat.report.gating import gate

    assert gate(["untested"], {"untested"}).exit_code == 12


def test_vacuous_without_any_batching_evidence():
    report = run_probe(_exp(control={"divergence": 0.9}), settings=SMALL,
                       engine_factory=_factory(no_metrics=True))
    assert report.outcome == "vacuous"
    assert "the engine gave no batching evidence, so sharing a step cannot be shown" in report.reason
    assert "; no batching evidence; " in report.summary_lines()[1]


def test_a_difference_is_a_violation_even_without_batching_evidence():
    report = run_probe(_exp(treatment={"divergence": 0.9}), settings=SMALL,
                       engine_factory=_factory(no_metrics=True))
    assert report.outcome == "violated"


def _step(t, b):
    return MetricsSample(t, math.nan, math.nan, math.nan, math.nan, math.nan, "embedded-step",
                         step_batch_size=b)


def _sec(t, running):
    return MetricsSample(t, running, 0.0, 0.0, 0.0, 0.0, "prometheus")


def test_shared_step_evidence_prefers_per_step_sizes_within_the_needles_lifetime():
    needle = GenerationResult("n", [1], "", None, None, None, None, 1.0, None, 2.0)
    # steps outside (t_submit, t_done] do not count, however big
    assert shared_step_evidence([_step(0.5, 9.0), _step(1.5, 1.0), _step(2.5, 9.0)], needle) == (
        False, "per-step batch sizes while the needle ran: 1 step(s), max 1, mean 1")
    # per-step sizes win over per-second running counts
    assert shared_step_evidence([_sec(1.2, 8.0), _step(1.5, 1.0)], needle)[0] is False
    # running counts: the last sample before submission, and those while it ran
    assert shared_step_evidence([_sec(0.0, 1.0), _sec(0.9, 4.0), _sec(3.0, 9.0)], needle) == (
        True, "running requests from 1 metrics sample(s) around the needle: max 4")
    assert shared_step_evidence([_sec(3.0, 9.0)], needle) == (
        None, "no batching evidence: the engine reported no metrics while the needle ran")


# --- prefill vs decode, prefix cache --------------------------------------------------------


def test_modes_are_checked():
    with pytest.raises(ValueError, match="mode \\('sideways'\\) must be one of 'batch', "
                                         "'prefill-decode', 'prefix-cache'"):
        ProbeSettings(mode="sideways")


def test_prefill_decode_is_unsupported_without_prompt_logprobs():
    report = run_probe(_exp(control={"divergence": 0.9}), settings=ProbeSettings(
        trials=1, min_fillers=1, max_fillers=1, max_tokens=4, mode="prefill-decode"),
        engine_factory=fakes.FakeScript().factory)
    assert report.outcome == "untested"
    assert report.reason == ("invariant: unsupported: engine kind 'fake' offers no prompt logprobs "
                             "(a prompt_logprobs method), so prefill cannot be compared with decode")


class _Cached(_Wrapped):
    """A fake with a prefix cache: a warm run shifts the logprobs when ``warm_differs``."""

    enable_prefix_caching = True

    def __init__(self, inner, warm_differs=False, has_reset=True):
        super().__init__(inner)
        self.warm_differs, self.seen, self.resets = warm_differs, set(), 0
        if has_reset:
            self.reset_prefix_cache = self._reset

    def _reset(self):
        self.seen.clear()
        self.resets += 1
        return True

    def run_pass(self, requests, *, concurrency, on_result, on_metrics):
        from dataclasses import replace

        def deliver(r):
            warm = r.prompt_id in self.seen
            self.seen.add(r.prompt_id)
            if warm and self.warm_differs and r.logprobs:
                r = replace(r, logprobs=[fakes._next_after(r.logprobs[0])] + r.logprobs[1:])
            on_result(r)

        self.inner.run_pass(requests, concurrency=concurrency, on_result=deliver,
                            on_metrics=on_metrics)


def test_prefix_cache_cold_vs_warm():
    settings = ProbeSettings(trials=2, min_fillers=1, max_fillers=1, max_tokens=4,
                             mode="prefix-cache")
    script = fakes.FakeScript()
    engines = {}

    def factory(exp, arm):
        engines[arm.name] = _Cached(script.factory(exp, arm), warm_differs=arm.name == "blas")
        return engines[arm.name]

    report = run_probe(_exp(), settings=settings, engine_factory=factory)
    assert (report.outcome, report.reason) == (
        "confirmed", "bitwise identical with the prefix cache cold and warm, and the negative "
                     "control differs")
    assert engines["invariant"].resets == 1  # between trial 0 (cold after start) and trial 1
    assert [t.evidence for t in report.arms[0].trials] == [
        "prefix caching on; cold: first after engine start",
        "prefix caching on; cold: after /reset_prefix_cache"]
    assert report.summary_lines()[1] == ("  invariant (probed): alone twice n/a; warm identical "
                                         "to cold in 2/2 trial(s)")
    bad = run_probe(_exp(), arms=["blas"], control="", settings=settings,
                    engine_factory=lambda e, a: _Cached(script.factory(e, a), warm_differs=True))
    assert bad.outcome == "violated"
    assert bad.reason == "bitwise differences on blas: a warm prefix cache changes the output"


def test_prefix_cache_is_unsupported_on_an_engine_without_one():
    report = run_probe(_exp(), settings=ProbeSettings(trials=1, min_fillers=1, max_fillers=1,
                                                      max_tokens=4, mode="prefix-cache"),
                       engine_factory=fakes.FakeScript().factory)
    assert (report.outcome, report.reason) == (
        "untested", "invariant: unsupported: engine kind 'fake' has no prefix cache")


def test_every_request_asks_for_the_declared_top_logprobs():
    seen = []
    script = fakes.FakeScript()

    class Spy(_Wrapped):
        def run_pass(self, requests, **kw):
            seen.extend(r.logprobs for r in requests)
            super().run_pass(requests, **kw)

    exp = h.experiment(arms=[{"name": "blas", "role": "control"},
                             {"name": "invariant", "role": "treatment"}],
                       workload={"top_logprobs": 7})
    run_probe(exp, settings=SMALL, engine_factory=lambda e, a: Spy(script.factory(e, a)))
    assert seen and set(seen) == {7}


def test_prefill_decode_on_the_embedded_engine(tmp_path):
    import tomllib

    from helpers_explain import BLAS_ARMS, declaration_toml, save_near_tie

    from bistat.declare.experiment import validate_experiment

    exp = validate_experiment(tomllib.loads(declaration_toml("pd", save_near_tie(tmp_path / "m"),
                                                             BLAS_ARMS)))
    report = run_probe(exp, settings=ProbeSettings(trials=1, min_fillers=1, max_fillers=1,
                                                   max_tokens=8, mode="prefill-decode"))
    # invariant mode computes a prefill's attention row by row as decode steps would: confirmed
    assert (report.outcome, report.arms[0].arm, report.arms[0].differs) == ("confirmed", "invariant", False)
    for arm in report.arms:
        (trial,) = arm.trials
        assert arm.error is None and arm.alone_repeat_identical is True
        assert trial.evidence.startswith("8 position(s) compared; max |decode - prefill| ")
        assert trial.tokens_equal is True and trial.logprobs_equal is not None
    # blas GEMMs over 1 row (decode) and over the whole prefix (prefill) round differently
    assert report.arms[1].arm == "blas" and report.arms[1].differs


def test_probe_on_vllm_offline_samples_every_step_so_the_needle_is_seen_sharing_steps(tmp_path):
    """The H200 probe said "1 metrics sample(s) around the needle: max 0" in 2 of 3 trials: a
    pass shorter than the worker's 1 s interval got one sample, a stale one. The probe asks the
    offline adapter for a sample after every step during its passes (and only then)."""
    from bistat.engines.vllm_offline import VLLMOfflineEngine

    site = fakes.fake_vllm_site(tmp_path)
    exp = h.experiment(
        engine={"kind": "vllm-offline", "model": "smol",
                "args": {"max_num_seqs": 4, "start_timeout_s": 60, "pass_idle_timeout_s": 30}},
        arms=[{"name": "default", "role": "control", "env": {"PYTHONPATH": site}},
              {"name": "batch-invariant", "role": "treatment", "env": {"PYTHONPATH": site}}],
        workload={"source": "builtin:token-ids?length=3&vocab=900"})
    engines = []

    def factory(experiment, arm):
        engines.append(VLLMOfflineEngine.from_experiment(experiment, arm))
        return engines[-1]

    settings = ProbeSettings(trials=2, min_fillers=8, max_fillers=12, max_tokens=6, seed=1, design="single")
    report = run_probe(exp, control="", settings=settings, engine_factory=factory)
    (arm,) = report.arms
    assert arm.error is None and arm.alone_repeat_identical is True
    assert [t.shared_step for t in arm.trials] == [True, True]
    for t in arm.trials:  # 6 tokens: a sample after each of the needle's first 5 steps at least
        n = int(t.evidence.split(" from ")[1].split(" ")[0])
        assert n >= 5 and t.evidence.endswith("around the needle: max 4"), t.evidence
    assert engines[0].metrics_interval_s == 1.0  # throughput passes keep their interval


# --- partial reports and merging (a probe spread over device calls) ----------------------------


def _three_arms():
    return h.experiment(arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.9}}},
                              {"name": "inv-a", "role": "treatment"},
                              {"name": "inv-b", "role": "treatment"}])


def test_a_partial_report_follows_every_arm_but_the_last_and_the_control_runs_first():
    """The negative control runs first, so that a probe stopped by its budget keeps its power
    (h200-match-smollm2-r2's probe ran it last and lost it)."""
    seen = []
    report = run_probe(_three_arms(), settings=SMALL, engine_factory=fakes.FakeScript().factory,
                       on_report=seen.append)
    assert [(r.pending, r.outcome) for r in seen] == [
        (("inv-a", "inv-b"), "untested"), (("inv-b",), "confirmed"), ((), "confirmed")]
    assert seen[0].reason == ("partial: inv-a, inv-b not probed yet; no arm has been probed yet, "
                              "only the negative control")
    assert seen[1].reason.startswith("partial: inv-b not probed yet; bitwise identical alone")
    assert [a.arm for a in seen[1].arms] == ["inv-a", "blas"]  # report order: control last
    assert seen[-1] is report and "pending" not in report.to_json()
    assert report_from_json(seen[0].to_json()).pending == ("inv-a", "inv-b")


def test_report_json_round_trips_and_bad_reports_name_the_file():
    report = run_probe(_exp(control={"divergence": 0.9}), settings=SMALL,
                       engine_factory=fakes.FakeScript().factory)
    assert report_from_json(json.loads(json.dumps(report.to_json()))) == report
    with pytest.raises(ValueError, match=r"^run/probe\.json: field 'schema' is None, expected "
                                         r"'bistat\.probe/1'"):
        report_from_json({}, "run/probe.json")
    broken = {**report.to_json(), "settings": {"trials": 0}}
    with pytest.raises(ValueError, match=r"^p\.json: not a complete bistat\.probe/1 report "
                                         r"\(ValueError\('trials must be at least 1, got 0'\)\)"):
        report_from_json(broken, "p.json")


def test_merging_gives_a_control_less_probe_the_other_reports_power():
    exp = _three_arms()
    # session 1 probed inv-a with the control and was stopped before inv-b; session 2 probed
    # inv-b alone (no control): alone it has no power, merged it is confirmed
    first = run_probe(exp, arms=["inv-a"], settings=SMALL, engine_factory=fakes.FakeScript().factory)
    second = run_probe(exp, arms=["inv-b"], control="", settings=SMALL,
                       engine_factory=fakes.FakeScript().factory)
    assert (first.outcome, second.outcome) == ("confirmed", "no_power")
    merged = merge_reports([("probe.json", first), ("probe-inv-b.json", second)])
    assert merged.outcome == "confirmed" and merged.merged_from == ("probe.json", "probe-inv-b.json")
    assert [(a.arm, a.role) for a in merged.arms] == [
        ("inv-a", "probed"), ("blas", "negative_control"), ("inv-b", "probed")]
    # a violation in the second report is the merged report's violation
    bad = run_probe(h.experiment(arms=[{"name": "blas", "role": "control"},
                                       {"name": "inv-b", "role": "treatment",
                                        "args": {"fake": {"logprob_jitter": True}}}]),
                    control="", settings=ProbeSettings(trials=4, min_fillers=32, max_fillers=40,
                                                        max_tokens=6, seed=1),
                    engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match=r"^probe-b\.json: a different probe from probe\.json"):
        merge_reports([("probe.json", first), ("probe-b.json", bad)])
    bad = run_probe(h.experiment(arms=[{"name": "blas", "role": "control"},
                                       {"name": "inv-b", "role": "treatment",
                                        "args": {"fake": {"logprob_jitter": True}}}]),
                    control="", settings=SMALL, engine_factory=fakes.FakeScript().factory)
    merged = merge_reports([("probe.json", first), ("probe-b.json", bad)])
    assert (merged.outcome, merged.reason) == (
        "violated", "bitwise differences on inv-b: not batch invariant")
    with pytest.raises(ValueError, match=r"^probe-again\.json: arm 'inv-a' was probed in "
                                         r"probe\.json too; keep one"):
        merge_reports([("probe.json", first), ("probe-again.json", first)])
    # a pending arm probed by another report is no longer pending
    partial = []
    run_probe(exp, settings=SMALL, engine_factory=fakes.FakeScript().factory, on_report=partial.append)
    merged = merge_reports([("probe.json", partial[0]), ("probe-b.json", second)])
    assert merged.pending == ("inv-a",) and merged.outcome == "confirmed"
    assert merged.reason.startswith("partial: inv-a not probed yet; bitwise identical")


def test_an_interrupt_while_an_engine_starts_stops_that_engine():
    stopped = []

    class Starting:
        kind = "fake"

        def start(self):
            raise KeyboardInterrupt

        def stop(self):
            stopped.append(True)

    seen = []
    with pytest.raises(KeyboardInterrupt):
        run_probe(_exp(), settings=SMALL, engine_factory=lambda exp, arm: Starting(),
                  on_report=seen.append)
    assert stopped == [True] and seen == []


# --- the needle a recorded run chooses (bistat probe --needle-from) ----------------------------


def _hand_run(path, outputs, *, workload_sha256="auto"):
    """A run written record by record: ``outputs`` maps (arm, pass_index, prompt_index) to
    (token ids, logprobs); passes 0, 1, 2 of every arm are counted and complete."""
    from bistat.store.writer import RunWriter
    from bistat.store.format import token_sha256
    from bistat.run.workload import load_prompts, prompts_sha256

    exp = h.experiment()
    wl = exp.workload
    header = {"run_id": path.name, "registration": {}, "engine_kind": "fake"}
    if workload_sha256 == "auto":
        header["workload_sha256"] = prompts_sha256(load_prompts(wl.source, wl.n_prompts, wl.seed))
    elif workload_sha256 is not None:
        header["workload_sha256"] = workload_sha256
    arms = sorted({a for a, _, _ in outputs})
    with RunWriter.create(path, header) as w:
        for n, arm in enumerate(arms):
            for p in (0, 1, 2):
                for event in ("start", "end"):
                    w.append("schedule", {"event": event, "seq": 3 * n + p, "arm": arm,
                                          "pass_index": p, "kind": "counted", "block": 0,
                                          "time_utc": "t", **({"status": "complete", "n_failed": 0}
                                                              if event == "end" else {})})
        for (arm, p, i), (ids, lps) in outputs.items():   # i: an index, or (index, prompt id)
            i, pid = (i, f"chat-{i:04d}") if isinstance(i, int) else i
            w.append("responses", {
                "arm": arm, "seq": 3 * arms.index(arm) + p, "pass_index": p, "kind": "counted",
                "prompt_id": pid,
                "prompt_index": i, "token_ids": ids, "text": "", "logprobs": lps,
                "top_logprobs": None, "finish_reason": "length", "n_prompt_tokens": 3,
                "t_submit": 0.0, "t_first_token": 0.1, "t_done": 0.2, "error": None,
                "attempts": 1, "token_sha256": token_sha256(ids), "logprob_sha256": None})
    return exp


SAME = ([5, 6, 7, 8, 9, 10], [-0.5, -1.0, -1.5, -2.0, -2.5, -3.0])


def _outputs(**changed):
    """Every prompt 0-5 of arms a and b identical in passes 0-2 but where ``changed`` says
    (``a1_4=(ids, lps)``: arm a, pass 1, prompt 4)."""
    out = {(arm, p, i): SAME for arm in "ab" for p in (0, 1, 2) for i in range(6)}
    for key, value in changed.items():
        arm, rest = key[0], key[1:]
        p, i = rest.split("_")
        out[(arm, int(p), int(i))] = value
    return out


def test_needle_from_run_picks_the_earliest_first_divergence_ties_to_the_lowest_index(tmp_path):
    from bistat.analysis.probe_needle import needle_from_run

    lps = list(SAME[1])
    lps[2] = math.nextafter(lps[2], 0.0)                                 # one ulp at token 2
    exp = _hand_run(tmp_path / "run", _outputs(
        a1_1=([5, 6, 7, 1, 9, 10], SAME[1]),      # prompt 1: token 3
        a2_3=(SAME[0], lps),                      # prompt 3: logprob bits at token 2
        b2_4=([5, 6, 1, 8, 9, 10], SAME[1]),      # prompt 4: token 2 in arm b ...
        a1_4=([5, 6, 7, 8, 9, 1], SAME[1]),       # ... and token 5 in arm a
        b1_5=(SAME[0][:4], SAME[1][:4])))         # prompt 5: ended first, at token 4
    src = needle_from_run(tmp_path / "run", exp, declaration="exp.toml")
    # tokens 2 for prompts 3 and 4: the lower index wins; the logprob bits count (bitwise, as
    # the probe compares), although the run's unit (the default) is token ids
    assert (src.prompt_index, src.prompt_id, src.arm, src.pass_index, src.reference_pass,
            src.position, src.kind, src.n_prompts_diverged) == (
        3, "chat-0003", "a", 2, 0, 2, "logprob", 4)
    assert src.run == str(tmp_path / "run") and src.run_id == "run"
    assert src.describe() == (
        f"prompt 3 (chat-0003) first diverged at token 2 (chosen-token logprob bits) in arm a, "
        f"pass 2 of {tmp_path / 'run'} (against pass 0), the earliest of 4 diverging prompt(s)")
    # without the logprob difference, prompt 4 (arm b) is first; an earlier token anywhere wins
    exp = _hand_run(tmp_path / "run2", _outputs(
        a1_1=([5, 6, 7, 1, 9, 10], SAME[1]), b2_4=([5, 6, 1, 8, 9, 10], SAME[1]),
        a1_4=([5, 6, 7, 8, 9, 1], SAME[1])))
    src = needle_from_run(tmp_path / "run2", exp)
    assert (src.prompt_index, src.arm, src.pass_index, src.position, src.kind) == (4, "b", 2, 2, "token")
    exp = _hand_run(tmp_path / "run3", _outputs(
        a1_4=([5, 6, 1, 8, 9, 10], SAME[1]), b2_5=([1, 6, 7, 8, 9, 10], SAME[1])))
    assert needle_from_run(tmp_path / "run3", exp).prompt_index == 5


def test_needle_from_run_refuses_a_run_where_nothing_diverged(tmp_path):
    from bistat.analysis.probe_needle import NeedleError, needle_from_run

    exp = _hand_run(tmp_path / "run", _outputs())
    with pytest.raises(NeedleError, match=(
            rf"^{tmp_path / 'run'}: no prompt diverged in the run \(prompts compared across the "
            r"counted passes per arm, bitwise: a 6, b 6\), so it cannot choose the needle; give "
            r"the needle's index with --needle INDEX instead$")):
        needle_from_run(tmp_path / "run", exp)


def test_needle_from_run_refuses_a_run_of_other_prompts(tmp_path):
    from bistat.declare.prereg import register
    from bistat.analysis.probe_needle import NeedleError, needle_from_run
    from bistat.run.runner import start_run

    (tmp_path / "experiments").mkdir()
    decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml", h.declaration(
        arms=[{"name": "blas", "role": "control", "args": {"fake": {"divergence": 0.5}}},
              {"name": "invariant", "role": "treatment"}]))
    reg, _ = register(decl, registrations_dir=tmp_path / "preregistrations")
    run = tmp_path / "runs" / "r"
    start_run(reg.experiment(), reg.reference(), run, engine_factory=fakes.FakeScript().factory)
    assert needle_from_run(run, reg.experiment()).n_prompts_diverged > 0
    more = h.experiment(workload={"n_prompts": 16})
    with pytest.raises(NeedleError, match=(
            rf"^{run / 'run.json'}: the run was recorded with other prompts than probe\.toml's "
            r"workload \(workload\.n_prompts 12 in the run, 16 in probe\.toml; workload_sha256 "
            r"[0-9a-f]{12}… in the run, [0-9a-f]{12}… for probe\.toml\): a prompt index names "
            r"another prompt in each; choose the needle from a run of this declaration's "
            r"workload, or give the needle's index with --needle INDEX$")):
        needle_from_run(run, more, declaration="probe.toml")
    # a run recorded before workload_sha256 was kept: the prompt ids it recorded decide
    outputs = _outputs(a1_1=([5, 6, 7, 1, 9, 10], SAME[1]))
    exp = _hand_run(tmp_path / "old", outputs, workload_sha256=None)
    assert needle_from_run(tmp_path / "old", exp).prompt_index == 1
    outputs[("a", 0, (3, "x-3"))] = SAME
    _hand_run(tmp_path / "older", outputs, workload_sha256=None)
    with pytest.raises(NeedleError, match=(
            rf"^{tmp_path / 'older'}: the run was recorded with other prompts than the "
            r"declaration's workload \(its responses record prompt 3 as 'x-3', but prompt 3 is "
            rf"'chat-0003' in the declaration; {tmp_path / 'older' / 'run.json'} has no "
            r"workload_sha256 to compare\)")):
        needle_from_run(tmp_path / "older", exp)


def test_needle_from_a_real_embedded_run_is_its_earliest_divergence(tmp_path_factory):
    """The blas arm of a run on the embedded engine flips near-ties with the batch: the needle
    is the prompt whose first differing token (or logprob bits) came earliest, recomputed here
    from responses.jsonl; a run where nothing diverged chooses none."""
    from helpers_explain import blas_run, invariant_run

    from bistat.declare.prereg import load_registration
    from bistat.analysis.probe_needle import NeedleError, needle_from_run
    from bistat.store.readers import read_header, read_jsonl

    run = blas_run(tmp_path_factory)
    exp = load_registration(read_header(run)["registration"]["path"]).experiment()
    rows, _ = read_jsonl(run / "responses.jsonl")
    out = {(r["arm"], r["pass_index"], r["prompt_index"]): (r["token_ids"], r["logprobs"])
           for r in rows if r["kind"] == "counted"}

    def first(a, b):
        (ta, la), (tb, lb) = a, b
        for i in range(min(len(ta), len(tb))):
            if ta[i] != tb[i] or struct.pack("<d", la[i]) != struct.pack("<d", lb[i]):
                return i
        return None if len(ta) == len(tb) else min(len(ta), len(tb))

    firsts = []
    for arm, p, i in out:
        ref = min(q for a, q, _ in out if a == arm)
        pos = None if p == ref else first(out[(arm, ref, i)], out[(arm, p, i)])
        if pos is not None:
            firsts.append((pos, i, arm, p))
    assert firsts and {arm for _, _, arm, _ in firsts} == {"blas"}
    pos, index, arm, p = min(firsts)
    src = needle_from_run(run, exp)
    assert (src.position, src.prompt_index, src.arm, src.pass_index) == (pos, index, arm, p)
    assert src.prompt_id == f"chat-{index:04d}"
    assert src.n_prompts_diverged == len({i for _, i, _, _ in firsts})

    quiet = invariant_run(tmp_path_factory)
    quiet_exp = load_registration(read_header(quiet)["registration"]["path"]).experiment()
    with pytest.raises(NeedleError, match=r"no prompt diverged in the run \(prompts compared "
                                          r"across the counted passes per arm, bitwise: inv-a 32, "
                                          r"inv-b 32\)"):
        needle_from_run(quiet, quiet_exp)


def test_the_report_keeps_where_the_needle_came_from_and_old_reports_still_read():
    from bistat.analysis.probe_report import NeedleSource

    src = NeedleSource(run="runs/r", run_id="r", prompt_id="chat-0003", prompt_index=3, arm="blas",
                       pass_index=2, reference_pass=1, position=0, kind="token",
                       n_prompts_diverged=11)
    exp = _exp(control={"divergence": 0.9})
    report = run_probe(exp, settings=replace(SMALL, needle_index=3), needle_source=src,
                       engine_factory=fakes.FakeScript().factory)
    assert report.needle_prompt_id == "chat-0003" and report.needle_source == src
    assert report.summary_lines()[:2] == [
        "needle chat-0003, 3 trial(s) of 32-40 fillers, 6 tokens",
        "needle chosen: prompt 3 (chat-0003) first diverged at token 0 in arm blas, pass 2 of "
        "runs/r (against pass 1), the earliest of 11 diverging prompt(s)"]
    data = json.loads(json.dumps(report.to_json()))
    assert data["needle_source"]["prompt_index"] == 3 and data["settings"]["needle_index"] == 3
    from helpers_explain import validate

    validate(data, "probe.schema.json")
    assert report_from_json(data) == report
    # a later writer's extra field is ignored; a report without the field has no source
    assert report_from_json({**data, "needle_source": {**data["needle_source"], "new": 1}}) == report
    old = {k: v for k, v in data.items() if k != "needle_source"}
    assert report_from_json(old).needle_source is None
    assert json.loads(json.dumps(report_from_json(old).to_json())) == old   # written back as it was
    # merged: the source of the part that had one
    three = replace(SMALL, needle_index=3)
    part = run_probe(exp, control="", settings=three, engine_factory=fakes.FakeScript().factory)
    other = run_probe(exp, arms=["blas"], control="", settings=three, needle_source=src,
                      engine_factory=fakes.FakeScript().factory)
    merged = merge_reports([("probe.json", part), ("probe-blas.json", other)])
    assert part.needle_source is None and merged.needle_source == src
    with pytest.raises(ValueError, match=r"needle_source names prompt 3 but settings\.needle_index "
                                         r"is 0; set needle_index to the source's prompt_index"):
        run_probe(exp, settings=SMALL, needle_source=src, engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match=r"needle_source names prompt 'x-3' but prompt 3 of the "
                                         r"declaration's source is 'chat-0003'"):
        run_probe(exp, settings=replace(SMALL, needle_index=3), engine_factory=fakes.FakeScript().factory,
                  needle_source=replace(src, prompt_id="x-3"))
