"""The default rule in the analysis and the CLI: exploratory analyses under a rule sealed after the
data, ``bistat classify`` on published numbers, one batching mean, one first-divergence function.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from bistat.store.readers import read_jsonl, read_table
from bistat.analysis.summary import analyze_run
from bistat.core.divergence import divergence_position
from bistat.run.batching import batching_summary
from bistat.cli import cli
from bistat.core.divergence import first_divergence
from bistat.engines.base import GenerationResult, MetricsSample
from bistat.analysis.probe_report import compare_bitwise
from bistat.report.finding import render_markdown
from bistat.core.rule import Label

ROOT = Path(__file__).resolve().parents[1]
TP1 = ROOT / "data" / "h200-tp" / "tp1-match"
REG = ROOT / "preregistrations"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# ---- exploratory analyses ------------------------------------------------------------------


@pytest.fixture(scope="module")
def exploratory():
    return analyze_run(TP1.relative_to(ROOT), Path("preregistrations/tp1-match-exploratory.json"))


def test_a_rule_sealed_after_the_data_is_applied_only_as_exploratory(exploratory):
    s = exploratory
    reg = json.loads((REG / "tp1-match-exploratory.json").read_text())["sealed"]
    assert s.exploratory is True
    assert s.sealed_utc == reg["sealed_utc"] > s.created_utc
    assert s.recorded_registration == "preregistrations/tp1-match.json"
    assert "registration precedes data" not in [v.name for v in s.validity]
    assert s.deviations[0].endswith(
        f"sealed at {reg['sealed_utc']}, after the run's first record ({s.created_utc}): an "
        "exploratory analysis, not a test of the hypothesis")
    text = render_markdown(s)
    first, _, verdict = text.splitlines()[:3]
    assert first == ("# Finding: tp1-match-exploratory — exploratory analysis, not a test of the "
                     "hypothesis")
    assert verdict.startswith("Exploratory verdict: **working** — cost undecidable at 4 passes "
                              "(ratio 1.07, 95 % interval 0.89–1.28; about ")
    # it never calls itself a test: every "test of the hypothesis" is "not a test of ..."
    assert text.count("test of the hypothesis") == text.count("not a test of the hypothesis") > 0


def test_study_1bs_twin_is_working_by_the_default_rule_with_every_activation_criterion(
        exploratory):
    """tp1-match (Study 1(b)'s model and load): default 0/541, batch-invariant 541/541, every
    discordant prompt in the treatment's favour."""
    (c,) = exploratory.comparisons
    assert c.verdict.label is Label.WORKING
    assert [cr.criterion for cr in c.verdict.labels[0].criteria] == [
        "match_lower_bound", "control_diverges", "treatment_beats_control"]
    assert c.mcnemar.b == 0 and c.mcnemar.c == 541
    assert c.verdict.cost.outcome.value == "undecidable"
    assert c.verdict.cost.ratio == c.ratio_point   # one point estimate


def test_the_confirmatory_finding_shows_the_exploratory_verdict_beside_its_own():
    s = analyze_run(TP1.relative_to(ROOT))
    assert s.exploratory is False
    assert [v.name for v in s.validity][0] == "registration precedes data"
    (sib,) = [v for v in s.siblings if v.name == "tp1-match-exploratory"]
    assert sib.exploratory is True and sib.verdict.label is Label.WORKING
    text = render_markdown(s)
    assert "| `tp1-match-exploratory` | exploratory | batch-invariant vs default | **working** |" \
        in text


# ---- bistat classify -----------------------------------------------------------------------


def test_classify_gives_seed_003_reported_as_observed_from_its_summary_numbers():
    result = CliRunner().invoke(cli, [
        "classify", "experiments/published-protocol.toml", "--arm", "default=78/541",
        "--arm", "batch-invariant=541/541", "--ratio", "0.979"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output.splitlines()[:3] == [
        "published-protocol: its rule applied to published summary numbers",
        "batch-invariant vs default: reported as observed",
        "  The results are reported as observed: the registered rule assigns them no other "
        "label."]
    assert ("  [not met] working: throughput ratio (treatment ÷ control), point estimate: 0.9790 "
            "(published point estimate) (needs < 0.9)") in result.output
    as_json = CliRunner().invoke(cli, [
        "classify", "preregistrations/tp1-match-exploratory.json", "--arm", "default=0/541",
        "--arm", "batch-invariant=541/541", "--discordant", "0,541", "--ratio", "1.07",
        "--interval", "0.89:1.28", "--json"], catch_exceptions=False)
    (v,) = json.loads(as_json.output)
    assert v["label"] == "working"
    # 0.89-1.28 reaches across both margins of the default cost rule
    assert v["cost"]["outcome"] == "undecidable"
    assert v["cost"]["statement"] == ("cost undecidable (published ratio 1.07, 95 % interval "
                                      "0.89–1.28)")


@pytest.mark.parametrize("args, message", [
    (["--arm", "default=78/541"], "--arm: give at least one treatment arm's counts "
                                  "(batch-invariant=K/N)"),
    (["--arm", "default=78-541", "--arm", "batch-invariant=541/541"],
     "--arm 'default=78-541': expected NAME=K/N, the prompts matched and compared, e.g. "
     "default=78/541"),
    (["--arm", "defalt=78/541", "--arm", "batch-invariant=541/541"],
     "--arm 'defalt=78/541': 'defalt' is not an arm of the declaration; expected one of default, "
     "batch-invariant"),
    (["--arm", "default=78/541", "--arm", "batch-invariant=541/541", "--ratio", "x"],
     "--ratio 'x': not a number"),
])
def test_classify_names_what_is_wrong(args, message):
    result = CliRunner().invoke(cli, ["classify", "experiments/published-protocol.toml", *args])
    assert result.exit_code == 1
    assert result.output == f"Error: {message}\n"


# ---- one batching mean ---------------------------------------------------------------------


COMMITTED_RUNS = sorted([*(p for p in (ROOT / "data" / "h200").iterdir() if p.is_dir()), TP1,
                         *(ROOT / "examples" / "quickstart").iterdir()])


def _samples(rows) -> list[MetricsSample]:
    def f(v):
        return math.nan if v is None or v != v else float(v)
    return [MetricsSample(float(r.t), f(r.num_requests_running), f(r.num_requests_waiting),
                          f(r.num_preemptions_total), math.nan, math.nan, str(r.source))
            for r in rows.itertuples()]


@pytest.mark.parametrize("run", COMMITTED_RUNS, ids=lambda p: p.name)
def test_the_batching_mean_the_validity_check_reads_is_the_runners(run):
    """The analysis's mean running batch per pass (the Batching table, the min_mean_running
    check) is bistat.run.batching.batching_summary over the pass's metrics samples, the function the
    runner writes passes.jsonl with. For vLLM's readings it equals the recorded figure: exactly for
    runs recorded under Python >= 3.12 (whose sum() compensates, as math.fsum does), to rounding
    for 3.11's. The embedded engine's samples are means since the previous sample and now stand
    for the time before them; its committed runs were recorded when they stood for the time
    after, so their passes.jsonl figure differs by that weighting."""
    metrics = read_table(run, "metrics")
    passes, _ = read_jsonl(run / "passes.jsonl")
    env, _ = read_jsonl(run / "environment.jsonl")
    python = env[0]["fingerprint"]["versions"]["python"]
    exact = tuple(int(x) for x in python.split(".")[:2]) >= (3, 12)
    summary = {(x.arm, x.pass_index): x.mean_running
               for x in analyze_run(run.relative_to(ROOT)).passes}
    checked = 0
    for p in passes:
        rows = metrics[(metrics["arm"] == p["arm"]) & (metrics["seq"] == p["seq"])]
        samples = _samples(rows)
        got = batching_summary(samples, p["wall_s"])["mean_running"]
        assert summary[(p["arm"], p["pass_index"])] == got
        want = p["batching"]["mean_running"]
        if want is None or any(x.source == "embedded" for x in samples):
            continue
        assert got == want if exact else got == pytest.approx(want, rel=1e-12)
        checked += 1
    embedded = any(metrics["source"] == "embedded")
    assert checked > 0 or embedded


def test_an_embedded_sample_stands_for_the_time_before_it():
    """The embedded engine's reading at the pass's start (nothing running yet) weighs nothing;
    its later samples, means over the steps since the previous one, weigh their interval."""
    s = lambda t, running, src: MetricsSample(t, running, 0.0, 0.0, math.nan, math.nan, src)  # noqa
    embedded = [s(0.0, 0.0, "embedded"), s(1.0, 12.0, "embedded"), s(1.5, 6.0, "embedded")]
    assert batching_summary(embedded, 1.5)["mean_running"] == (12.0 * 1.0 + 6.0 * 0.5) / 1.5
    readings = [s(0.0, 0.0, "prometheus"), s(1.0, 12.0, "prometheus"), s(1.5, 6.0, "prometheus")]
    # a reading stands until the next sample, the last until the pass ends (wall 2.0)
    assert batching_summary(readings, 2.0)["mean_running"] == (0.0 + 12.0 * 0.5 + 6.0 * 0.5) / 2.0


# ---- one first-divergence function ---------------------------------------------------------


def _reference(a, b, la, lb):
    """The definition, written out: token ids first (or the shorter length); then chosen-token
    logprob bits at the indices both have, before that position."""
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    kind = "token" if pos is not None else None
    if pos is None and len(a) != len(b):
        pos, kind = min(len(a), len(b)), "length"
    n = min(len(la), len(lb), len(a), len(b))
    limit = n if pos is None else min(n, pos)
    bits = lambda x: np.float64(x).view(np.int64)   # noqa: E731
    for i in range(limit):
        if bits(la[i]) != bits(lb[i]):
            return i, "logprob"
    return None if pos is None else (pos, kind)


outputs = st.lists(st.integers(0, 3), max_size=8)


@settings(max_examples=300, deadline=None)
@given(outputs, outputs, st.data())
def test_every_reader_uses_the_one_first_divergence(a, b, data):
    la = data.draw(st.lists(st.sampled_from([-0.5, -1.0, -0.0, 0.0, -1.0000000000000002]),
                            min_size=len(a), max_size=len(a)))
    lb = data.draw(st.lists(st.sampled_from([-0.5, -1.0, -0.0, 0.0, -1.0000000000000002]),
                            min_size=len(b), max_size=len(b)))
    want = _reference(a, b, la, lb)
    assert first_divergence(a, b, la, lb) == want
    pos = None if want is None else want[0]
    assert divergence_position(a, b, la, lb, "token_ids+logprobs") == pos
    r = lambda ids, lps: GenerationResult("n", list(ids), "", list(lps), None, None, None,  # noqa
                                          0.0, None, 0.0)
    assert compare_bitwise(r(a, la), r(b, lb)).first_divergence == pos
    # the trimmed compaction hands it the recorded arrays as lists
    assert divergence_position(np.asarray(a, dtype=np.int64).tolist(),
                               np.asarray(b, dtype=np.int64).tolist(), np.asarray(la).tolist(),
                               np.asarray(lb).tolist(), "token_ids+logprobs") == pos
    tok = _reference(a, b, [], [])
    assert divergence_position(a, b, la, lb, "token_ids") == (None if tok is None else tok[0])


def test_the_point_ratio_a_finding_shows_is_the_one_the_classifier_decided_on():
    """A one-pass ratio of 90 to 100: 0.9 in the summary, the criterion and the finding."""
    from bistat.core.classify import ArmStats, classify
    from bistat.declare.experiment import load_experiment
    from bistat.core import stats
    rule = load_experiment(ROOT / "experiments" / "published-protocol.toml").rule
    assert stats.ratio_of_geometric_means([90.0], [100.0]) == 0.9
    v = classify(rule, ArmStats("c", "control", 541, 78, (100.0,)),
                 ArmStats("t", "treatment", 541, 541, (90.0,)))
    assert v.labels[0].criteria[1].observed == 0.9 and v.labels[0].criteria[1].met is False
