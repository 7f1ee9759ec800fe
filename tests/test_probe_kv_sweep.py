"""The probe's kv-sweep design: needles of several lengths, fillers arriving while they
decode, a verdict per needle; against a step-by-step fake whose outputs change only past a KV
tile and only beside a prefill (FlashAttention 3 at head size 64), and on the embedded engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fakes
import helpers_runner as h
from helpers_explain import validate

from bistat.analysis.probe_report import (LONG_NEEDLES, ProbeSettings, needle_verdicts, report_from_json)
from bistat.analysis.probe_report import run_probe
from bistat.run.probe import filler_tokens_of, fillers_in_flight, long_needle
from bistat.run.workload import Prompt, load_prompts

REPO = Path(__file__).resolve().parents[1]


def _exp(**engine_args):
    return h.experiment(engine={"kind": "fake", "model": "fake-model", "args": engine_args},
                        arms=[{"name": "blas", "role": "control"},
                              {"name": "invariant", "role": "treatment"}])


def _probe(treatment: str, settings: ProbeSettings = ProbeSettings(), **engine_args):
    engines: dict[str, fakes.StepFakeEngine] = {}
    factory = fakes.step_factory({"blas": fakes.StepArm("batched"),
                                  "invariant": fakes.StepArm(treatment)}, engines)
    return run_probe(_exp(**engine_args), settings=settings, engine_factory=factory), engines


def test_the_default_design():
    st = ProbeSettings()
    assert (st.design, st.long_needles, st.max_tokens, st.filler_tokens) == (
        "kv-sweep", (112, 176, 304, 600), 128, 16)
    assert (st.trials, st.min_fillers, st.max_fillers, st.sweep) == (3, 32, 128, True)
    assert not ProbeSettings(mode="prefill-decode").sweep


def test_a_single_needle_submitted_at_once_misses_a_kv_tile_break():
    """The design bistat had (h200-match-smollm2-r2's probe): every filler is prefilled in the
    first step, the needle then decodes among decode rows only, so it never sees the break."""
    report, engines = _probe("tile", ProbeSettings(design="single", max_tokens=256, max_fillers=64))
    assert report.outcome == "confirmed"
    assert engines["invariant"].perturbed == []


def test_the_default_design_catches_a_kv_tile_break_without_being_aimed():
    report, engines = _probe("tile")
    assert (report.outcome, report.reason) == (
        "violated", "bitwise differences on invariant: not batch invariant")
    invariant = report.arms[0]
    assert invariant.arm == "invariant" and invariant.alone_repeat_identical is True
    # the fake changed nothing at or below 128 keys, and every needle length saw the break
    assert engines["invariant"].perturbed and all(kv > 128 for _, _, kv in engines["invariant"].perturbed)
    verdicts = needle_verdicts(report.arms)
    assert [(v.needle, v.target_tokens, v.outcome) for v in verdicts] == [
        ("chat-0000", None, "violated"), ("needle-112", 112, "violated"),
        ("needle-176", 176, "violated"), ("needle-304", 304, "violated"),
        ("needle-600", 600, "violated")]
    for v in verdicts:
        # the engine's prompt count (len // 4 in the fake) is close to the design's length
        assert v.target_tokens is None or v.target_tokens <= v.n_prompt_tokens <= v.target_tokens + 13
        assert (v.kv_low, v.kv_high) == (v.n_prompt_tokens, v.n_prompt_tokens + 127)
        # the break shows at the first step past 128 keys that holds another prompt's prefill
        assert 129 <= v.kv_first_divergence <= max(129, v.kv_low + 1) + 20
        assert v.reason.startswith("bitwise differences on invariant, the earliest at KV length ")
    base = verdicts[0]
    assert base.n_prompt_tokens < 20 and base.kv_first_divergence in range(129, 150)


def test_the_default_design_confirms_an_engine_that_never_diverges():
    report, _ = _probe("never")
    assert (report.outcome, report.reason) == (
        "confirmed", "every needle bitwise identical alone and in every batch (the fillers too, "
        "across trials), and the negative control differs")
    assert {v.outcome for v in needle_verdicts(report.arms)} == {"confirmed"}
    assert {v.reason for v in needle_verdicts(report.arms)} == {
        "bitwise identical on every probed arm, and the negative control differs at it"}


def test_fillers_keep_arriving_while_the_needles_decode():
    report, engines = _probe("never")
    calls = engines["invariant"].calls
    needles = [n.needle for n in report.arms[0].needles]
    assert needles == ["chat-0000", "needle-112", "needle-176", "needle-304", "needle-600"]
    # each needle alone, twice, then one pass per trial
    assert [c for c, _ in calls[:10]] == [(n,) for n in needles for _ in (0, 1)]
    assert len(calls) == 10 + 3
    for (order, concurrency), trial, steps in zip(calls[10:], report.arms[0].trials,
                                                  engines["invariant"].prefill_steps[10:]):
        n = trial.n_fillers
        assert len(order) == n + 5 and 32 <= n <= 128
        fillers = load_prompts("builtin:chat", 129, 0)
        steps_of = {p.prompt_id: filler_tokens_of(p, 16) for p in fillers}
        assert concurrency == 5 + fillers_in_flight(
            sum(steps_of[x] for x in order if x not in needles), 128, 16)
        # every needle starts in the first wave, at a random place in it
        assert all(order.index(x) < concurrency for x in needles)
        # a prompt is prefilled at least every 16 steps until the needles' last token
        decode = [s for s in steps if s <= 128]
        assert decode[0] == 0 and max(b - a for a, b in zip(decode, decode[1:])) <= 16
        assert steps[-1] >= 128
    assert all(len(order) == 1 for order, _ in calls[:10])


def test_each_needle_is_the_needle_prompt_followed_by_the_next_prompts():
    prompts = load_prompts("builtin:chat", 20, 0)
    needle = long_needle(prompts[0], prompts[1:], 112)
    assert needle.prompt_id == "needle-112" and needle.chat and needle.index == 0
    parts = needle.prompt.split("\n\n")
    assert parts[0] == prompts[0].prompt and parts[1:] == [p.prompt for p in prompts[1:len(parts)]]
    assert len(needle.prompt) >= 4 * 112 > len("\n\n".join(parts[:-1]))
    ids = [Prompt(f"t{i}", i, tuple(range(10 * i, 10 * i + 6)), False) for i in range(3)]
    assert long_needle(ids[0], ids[1:], 15).prompt == (0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15,
                                                        20, 21, 22)
    with pytest.raises(ValueError, match="cannot join a text prompt to a token-id needle"):
        long_needle(ids[0], prompts[1:], 15)


def test_needles_the_context_cannot_hold_are_left_out_and_said_so():
    report, _ = _probe("tile", ProbeSettings(trials=1, max_fillers=40), max_model_len=400)
    assert [n.needle for n in report.arms[0].needles] == ["chat-0000", "needle-112", "needle-176"]
    assert report.left_out == (
        "needle-304: about 304 prompt tokens (+25 %) and 128 generated exceed max_model_len 400 "
        "(engine.args)",
        "needle-600: about 600 prompt tokens (+25 %) and 128 generated exceed max_model_len 400 "
        "(engine.args)")
    lines = report.summary_lines()
    assert lines[0] == ("needles chat-0000 and about 112, 176, 304, 600 prompt tokens, 128 tokens "
                        "each; 1 trial(s) of 32-40 fillers of 16 tokens arriving while they decode")
    assert "  left out: " + report.left_out[0] in lines


def test_summary_json_schema_and_round_trip():
    report, _ = _probe("tile", ProbeSettings(trials=2, max_fillers=48))
    lines = report.summary_lines()
    i = lines.index("per needle:")
    assert lines[i + 1].startswith("  chat-0000 (")
    assert all(": violated — bitwise differences on invariant, the earliest at KV length " in x
               for x in lines[i + 1:i + 6])
    assert lines[-1] == "outcome: violated — bitwise differences on invariant: not batch invariant"
    needle_lines = [x for x in lines if x.startswith("    needle-304 (")]
    assert len(needle_lines) == 2  # one per arm
    assert "alone twice identical; in batch identical in 0/2 trial(s); first divergence at token " \
        in needle_lines[0]
    data = json.loads(json.dumps(report.to_json()))
    validate(data, "probe.schema.json")
    assert data["settings"]["design"] == "kv-sweep" and data["settings"]["long_needles"] == list(LONG_NEEDLES)
    assert [n["needle"] for n in data["arms"][0]["needles"]][-1] == "needle-600"
    assert [v["outcome"] for v in data["needle_outcomes"]] == ["violated"] * 5
    assert report_from_json(data) == report


@pytest.mark.parametrize("path", ["data/h200/h200-match-smollm2-r2/probe.json",
                                  "data/h200/h200-match-smollm2-r2/probe-default.json",
                                  "data/h200/h200-fa3-kv128-smollm2/probe.json",
                                  "data/h200-tp/tp1-match/probe.json"])
def test_reports_written_before_designs_read_as_the_single_design_and_write_back_the_same(path):
    data = json.loads((REPO / path).read_text(encoding="utf-8"))
    assert "design" not in data["settings"]
    report = report_from_json(data, path)
    assert report.settings.design == "single" and not report.settings.sweep
    assert json.loads(json.dumps(report.to_json())) == data and needle_verdicts(report.arms) == ()


def test_the_embedded_engine_end_to_end_through_the_cli(tmp_path, monkeypatch):
    """`bistat probe` on the real embedded engine (a saved near-tie tiny model, byte tokenizer):
    the invariant GEMM keeps every needle bitwise identical, the BLAS control does not."""
    from click.testing import CliRunner
    from helpers_explain import BLAS_ARMS, declaration_toml, save_near_tie

    from bistat.cli import cli

    model = save_near_tie(tmp_path / "model")
    decl = tmp_path / "p.toml"
    decl.write_text(declaration_toml("p", model, BLAS_ARMS,
                                     engine_args="max_batch_size = 16, prefill_chunk = 8, "
                                                 "max_model_len = 160"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, [
        "probe", str(decl), "--long-needles", "16,32,200", "--max-tokens", "8",
        "--filler-tokens", "2", "--trials", "2", "--min-fillers", "6", "--max-fillers", "10",
        "--output", "probe.json"], prog_name="bistat", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "probe.json").read_text())
    validate(data, "probe.schema.json")
    assert data["outcome"] == "confirmed"
    assert data["left_out"] == ["needle-200: about 200 prompt tokens (+25 %) and 8 generated "
                                "exceed max_model_len 160 (engine.args)"]
    inv = next(a for a in data["arms"] if a["arm"] == "invariant")
    # the byte tokenizer counts every character: the text needles are 4x the design's length
    assert [(n["needle"], n["n_tokens"]) for n in inv["needles"]] == [
        ("chat-0000", 8), ("needle-16", 8), ("needle-32", 8)]
    lengths = [n["n_prompt_tokens"] for n in inv["needles"]]
    assert lengths == sorted(lengths) and lengths[1] >= 64 and lengths[2] >= 128
    # Whether a trial's needle shared an engine step is timed evidence (per-step batch sizes
    # while it ran): on a loaded 2-core CI machine single trials have come back unshared, so the
    # check is that the probe's batching evidence shows sharing, with the evidence in the message.
    trials = [(n["needle"], t["shared_step"], t.get("evidence")) for n in inv["needles"]
              for t in n["trials"]]
    assert any(shared for _, shared, _ in trials), trials
    assert [v["outcome"] for v in data["needle_outcomes"]] == ["confirmed"] * 3
    # every arm's report keeps where its engine ran: the run's fingerprint in brief
    import importlib.metadata
    import socket

    from bistat.run.fingerprint import gpu_info
    for arm in data["arms"]:
        machine = arm["machine"]
        assert machine["host"] == socket.gethostname()
        assert machine["gpus"] == [{k: g[k] for k in ("name", "uuid", "driver", "serial")}
                                   for g in gpu_info()]
        assert machine["engine"]["kind"] == "embedded"
        assert machine["versions"]["numpy"] == importlib.metadata.version("numpy")
    assert result.stdout.splitlines()[0] == (
        "needles chat-0000 and about 16, 32, 200 prompt tokens, 8 tokens each; 2 trial(s) of "
        "6-10 fillers of 2 tokens arriving while they decode")


def test_a_finding_shows_the_outcome_per_needle_and_old_reports_render_as_before():
    import dataclasses

    from bistat.analysis.summary import analyze_run
    from bistat.report.finding import _probe_detail, _probe_needles

    summary = analyze_run(REPO / "data" / "h200" / "h200-match-smollm2-r2")
    assert summary.probe is not None and not summary.probe.settings.sweep
    assert _probe_needles(summary) == []   # a report written before designs: as it rendered
    report, _ = _probe("tile", ProbeSettings(trials=2, max_fillers=40), max_model_len=600)
    lines = _probe_detail(dataclasses.replace(summary, probe=report))
    start = lines.index(
        "Per needle (the kv-sweep design: the needle prompt and needles of about 112, 176, 304, 600 "
        "prompt tokens, 128 tokens each, among fillers of 16 tokens arriving while they decode; "
        "in how many trials identical, or different, bitwise). Left out: needle-600: about 600 prompt tokens "
        "(+25 %) and 128 generated exceed max_model_len 600 (engine.args).")
    table = lines[start + 2].splitlines()
    assert table[0] == ("| needle | design tokens | prompt tokens | keys decoded | invariant: in "
                        "batch | blas: in batch | outcome |")
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in table[2:]}
    assert list(rows) == ["chat-0000", "needle-112", "needle-176", "needle-304"]
    assert rows["needle-304"][1:3] == ["304", "308"]
    assert rows["needle-304"][4].startswith("**different** in 2 / 2, first at KV length ")
    assert rows["needle-304"][6].startswith("**violated** — bitwise differences on invariant, the "
                                            "earliest at KV length ")


def test_a_finding_says_where_the_probe_ran_and_whether_that_is_the_runs_gpu():
    """A probe report keeps each arm's machine; the finding names the GPU and says when it is not
    the unit the study's passes ran on (a probe in a later session gets another card)."""
    import dataclasses

    from bistat.analysis.summary import analyze_run
    from bistat.report.finding import _probe_detail

    summary = analyze_run(REPO / "data" / "h200" / "h200-match-smollm2-r2")
    assert any("The probe's report does not record the machine it ran on" in x
               for x in _probe_detail(summary))   # written before probes recorded it
    (run_uuid,) = {u for _, env in summary.environments for u in env.gpu_uuids}

    def on(uuid):
        machine = {"gpus": [{"name": "NVIDIA H200", "uuid": uuid, "driver": "580.95.05"}],
                   "versions": {}, "host": "node", "engine": {"kind": "vllm-server",
                                                              "version": "0.25.0"}}
        probe = dataclasses.replace(summary.probe, arms=tuple(
            dataclasses.replace(a, machine=machine) for a in summary.probe.arms))
        (line,) = [x for x in _probe_detail(dataclasses.replace(summary, probe=probe))
                   if x.startswith("The probe ran on ")]
        return line

    assert on(run_uuid) == (f"The probe ran on NVIDIA H200 ({run_uuid}, driver 580.95.05), "
                            "vllm-server 0.25.0: the GPU of the study's passes.")
    assert on("GPU-other") == (
        "The probe ran on NVIDIA H200 (GPU-other, driver 580.95.05), vllm-server 0.25.0: **not "
        f"the GPU of the study's passes** ({run_uuid}): it speaks for the setting on this card "
        "type, not for that unit.")
