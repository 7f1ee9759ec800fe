"""The bitwise needle-in-batch probe with its negative control, on the fake engine."""

from __future__ import annotations

import pytest

import fakes
import helpers_runner as h
from bistat.engines.base import GenerationResult
from bistat.probe import ProbeSettings, compare_bitwise, run_probe

SMALL = ProbeSettings(trials=3, min_fillers=32, max_fillers=40, max_tokens=6, seed=1)


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
        "confirmed", "bitwise identical alone and in every batch, and the negative control differs")
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
                       settings=ProbeSettings(trials=4, min_fillers=32, max_fillers=40, max_tokens=6),
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
    assert lines[1] == "  invariant (probed): alone twice identical; in batch identical in 3/3 trial(s)"
    assert lines[2].startswith("  blas (negative control): alone twice identical; in batch identical in ")
    assert lines[-1] == ("outcome: confirmed — bitwise identical alone and in every batch, and the negative "
                         "control differs")


def test_bad_arguments():
    with pytest.raises(ValueError, match="arm 'nope' is not in the declaration; arms: blas, invariant"):
        run_probe(_exp(), arms=["nope"], settings=SMALL, engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match="cannot be both probed and the negative control"):
        run_probe(_exp(), arms=["blas"], settings=SMALL, engine_factory=fakes.FakeScript().factory)
    with pytest.raises(ValueError, match="need 1 <= min_fillers <= max_fillers, got 64 and 32"):
        ProbeSettings(min_fillers=64, max_fillers=32)
