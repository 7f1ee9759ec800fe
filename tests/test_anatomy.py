"""Divergence anatomy: first divergences, margins from top-k logprobs, near-tie vs large-drift labels."""

from __future__ import annotations

import math

import pytest
from helpers_explain import blas_run, invariant_run, validate

from bistat.analysis.anatomy import (
    DEFAULT_NEAR_TIE_EPSILON,
    LARGE_DRIFT,
    NEAR_TIE,
    UNDETERMINED,
    divergence_anatomy,
    first_divergence,
    label_divergence,
    pair_margin,
)
from bistat.report.anatomy import plot_anatomy, render_anatomy_section
from bistat.store.writer import RunWriter
from bistat.store.format import token_sha256


@pytest.fixture(scope="module")
def blas(tmp_path_factory):
    return blas_run(tmp_path_factory)


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    return invariant_run(tmp_path_factory)


# --- pure core --------------------------------------------------------------------------------

def test_first_divergence_token_length_logprob_and_identical():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == (2, "token")
    assert first_divergence([1, 2, 3], [1, 2]) == (2, "length")
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    # a logprob one ulp apart is a divergence when logprobs are compared, earlier than a token one
    assert first_divergence([1, 2, 3], [1, 2, 4], [-0.5, -1.0, -2.0],
                            [-0.5, math.nextafter(-1.0, 0.0), -2.0]) == (1, "logprob")
    assert first_divergence([1, 2], [1, 2], [-0.0, -1.0], [0.0, -1.0]) == (0, "logprob")


def test_pair_margin_is_the_larger_gap_between_the_two_candidates():
    ref = [(7, -0.60), (9, -0.80), (3, -5.0)]
    oth = [(9, -0.69), (7, -0.70), (3, -5.0)]
    margin, bound = pair_margin(ref, 7, oth, 9)
    assert not bound
    assert margin == pytest.approx(0.20)


def test_pair_margin_bound_when_the_rival_is_outside_the_top_k():
    margin, bound = pair_margin([(7, -0.1), (3, -4.0)], 7, [(9, -0.2), (7, -3.0)], 9)
    assert bound and margin == pytest.approx(3.9)
    # nothing usable: only the chosen tokens listed
    assert pair_margin([(7, -0.1)], 7, [(9, -0.2)], 9) == (None, False)


@pytest.mark.parametrize("kind,margin,bound,eps,expected", [
    ("token", 0.0, False, 0.125, NEAR_TIE),
    ("token", 0.125, False, 0.125, NEAR_TIE),
    ("token", 0.1251, False, 0.125, LARGE_DRIFT),
    ("token", 0.01, True, 0.125, UNDETERMINED),
    ("token", 0.5, True, 0.125, LARGE_DRIFT),
    ("token", None, False, 0.125, UNDETERMINED),
    ("length", 0.0, False, 0.125, UNDETERMINED),
    ("logprob", 1e-7, False, 1e-3, "logprob jitter"),
    ("logprob", 0.01, False, 1e-3, LARGE_DRIFT),
])
def test_label_divergence(kind, margin, bound, eps, expected):
    assert label_divergence(kind, margin, bound, eps) == expected


def test_label_divergence_refuses_a_negative_epsilon():
    with pytest.raises(ValueError, match=r"epsilon \(-1\.0\) must be a number >= 0"):
        label_divergence("token", 0.0, False, -1.0)


# --- records written directly -----------------------------------------------------------------

def _resp(arm, p, pid, ids, lps, top):
    return {"arm": arm, "seq": p, "pass_index": p, "kind": "counted", "prompt_id": pid,
            "prompt_index": 0, "token_ids": ids, "text": "", "logprobs": lps,
            "top_logprobs": top, "finish_reason": "length", "n_prompt_tokens": 3,
            "t_submit": 0.0, "t_first_token": 0.1, "t_done": 0.2, "error": None, "attempts": 1,
            "token_sha256": token_sha256(ids), "logprob_sha256": None}


def test_anatomy_of_handwritten_records_labels_each_divergence(tmp_path):
    run = tmp_path / "run"
    with RunWriter.create(run, {"run_id": "hand", "registration": {}, "engine_kind": "fake"}) as w:
        for p in (0, 1):
            w.append("schedule", {"event": "start", "seq": p, "arm": "a", "pass_index": p,
                                  "kind": "counted", "block": 0, "time_utc": "t"})
            w.append("schedule", {"event": "end", "seq": p, "arm": "a", "pass_index": p,
                                  "kind": "counted", "block": 0, "time_utc": "t",
                                  "status": "complete", "n_failed": 0})
        # p0: a near-tie flip at index 1 (margin 1e-4)
        w.append("responses", _resp("a", 0, "p0", [5, 7, 1], [-0.1, -0.69, -0.2],
                                    [[[5, -0.1]], [[7, -0.6900], [9, -0.6901]], [[1, -0.2]]]))
        w.append("responses", _resp("a", 1, "p0", [5, 9, 2], [-0.1, -0.69, -0.3],
                                    [[[5, -0.1]], [[9, -0.6900], [7, -0.6901]], [[2, -0.3]]]))
        # p1: a large drift at index 0 (margin 2 nats)
        w.append("responses", _resp("a", 0, "p1", [4, 4], [-0.1, -0.1],
                                    [[[4, -0.1], [6, -2.1]], [[4, -0.1], [6, -3.0]]]))
        w.append("responses", _resp("a", 1, "p1", [6, 4], [-0.2, -0.1],
                                    [[[6, -0.2], [4, -2.2]], [[4, -0.1], [6, -3.0]]]))
        # p2: identical
        w.append("responses", _resp("a", 0, "p2", [1], [-0.1], [[[1, -0.1], [2, -3.0]]]))
        w.append("responses", _resp("a", 1, "p2", [1], [-0.1], [[[1, -0.1], [2, -3.0]]]))
    an = divergence_anatomy(run, epsilon=0.01)
    assert an.epsilon == 0.01 and an.unit == "token_ids" and an.top_k == 2
    got = {(d.prompt_id, d.position, d.reference.token_id, d.other.token_id, d.label)
           for d in an.divergences}
    assert got == {("p0", 1, 7, 9, NEAR_TIE), ("p1", 0, 4, 6, LARGE_DRIFT)}
    p0 = next(d for d in an.divergences if d.prompt_id == "p0")
    assert p0.margin == pytest.approx(1e-4, abs=1e-9)
    assert p0.reference.top1_top2_margin == pytest.approx(1e-4, abs=1e-9)
    assert p0.relative_position == pytest.approx(1 / 3)
    arm = an.arm("a")
    assert (arm.n_prompts, arm.n_diverging_prompts, arm.n_divergences) == (3, 2, 2)
    assert an.large_drifts() == {"a": 1}
    validate(an.to_dict(), "anatomy.schema.json")
    text = render_anatomy_section(an, "plot.png")
    assert "| a | 2 | 1 (50 %) | 1 (50 %) | 0 (0 %) | 0 (0 %) |" in text
    assert "| a | p1 | 0 / 1 | 0 | 4 | 6 | 2 | large drift |" in text
    assert text.endswith("![Margins and positions at first divergence](plot.png)\n")


# --- a real run on the embedded engine ----------------------------------------------------------

def test_blas_run_divergences_are_labelled_near_tie_flips(blas):
    an = divergence_anatomy(blas)
    assert an.epsilon == DEFAULT_NEAR_TIE_EPSILON and an.top_k == 5
    assert an.arm("invariant").n_divergences == 0
    blas_arm = an.arm("blas")
    assert blas_arm.n_divergences >= 1
    # the near-tie model's pairs differ by ~25 float32 ulps: every flip is a near-tie
    assert blas_arm.count(NEAR_TIE) == blas_arm.n_divergences
    for d in an.divergences:
        assert d.kind == "token" and not d.margin_is_bound
        assert 0 <= d.margin < 1e-4
        assert {d.reference.token_id, d.other.token_id} == {d.reference.top[0][0],
                                                            d.reference.top[1][0]}
    validate(an.to_dict(), "anatomy.schema.json")


def test_a_tighter_epsilon_turns_the_flips_into_large_drifts(blas):
    an = divergence_anatomy(blas, epsilon=0.0)
    assert an.arm("blas").count(LARGE_DRIFT) == sum(d.margin > 0 for d in an.divergences)


def test_invariant_run_has_no_divergence(invariant):
    an = divergence_anatomy(invariant)
    assert an.n_divergences == 0
    assert [a.n_prompts for a in an.arms] == [32, 32]
    assert "nothing to dissect" in render_anatomy_section(an)


def test_plot_is_deterministic(blas, tmp_path):
    an = divergence_anatomy(blas)
    a = plot_anatomy(an, tmp_path / "a.png").read_bytes()
    b = plot_anatomy(an, tmp_path / "b.png").read_bytes()
    assert a[:8] == b"\x89PNG\r\n\x1a\n" and a == b


def test_unknown_unit_is_refused(blas):
    with pytest.raises(ValueError, match="unit \\('tokens'\\) must be one of"):
        divergence_anatomy(blas, unit="tokens")
