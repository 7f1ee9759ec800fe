"""Trimmed compaction (``bistat.analysis.trim.trim`` / ``bistat compact --trim``): of a slim run's outputs
only what the registered analysis reads, and findings that regenerate unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers_analysis import declaration, make_run, register_tiny

from bistat.store.format import TRIM_RULE
from bistat.store.readers import check_trim, read_table, trim_info
from bistat.store.compact import compact
from bistat.store.passes import counted_passes
from bistat.analysis.summary import analyze_run, summary_to_dict
from bistat.analysis.anatomy import divergence_anatomy
from bistat.cli import cli
from bistat.store.format import OUTPUTS_FILE, OUTPUT_LENGTH, RecordsError
from bistat.report.finding import write_finding
from bistat.analysis.trim import trim

ROOT = Path(__file__).resolve().parents[1]
N_PROMPTS, PASSES, WARMUP, LENGTH = 8, 3, 1, 8
REF = WARMUP   # every arm's reference pass: its first counted pass


def _out(prompt: int, ids=None, lps=None, *, alts=None, json_top=False) -> dict:
    """An output of LENGTH tokens by default: ids, float32-exact logprobs, top-2 (chosen first);
    ``alts`` gives some positions more alternatives; ``json_top`` writes one alternative's
    logprob as an int, which makes the slim compaction keep top_logprobs as JSON text."""
    ids = [100 * prompt + j for j in range(LENGTH)] if ids is None else ids
    lps = [-0.125 * (j + 1) for j in range(len(ids))] if lps is None else lps
    top = [[[t, v], [9, v - 1.0]] for t, v in zip(ids, lps)]
    for pos, extra in (alts or {}).items():
        top[pos] = top[pos] + [[8 + k, -20.0 - k] for k in range(extra)]
    if json_top and top:
        top[0][1][1] = -30   # an int: not an [int, float] pair
    return {"token_ids": ids, "logprobs": lps, "top_logprobs": top,
            "text": " ".join(map(str, ids))}


def _outputs(json_top: bool = False):
    """Per (arm, pass, prompt): what each case of the trim needs."""
    def outputs(arm: str, p: int, i: int) -> dict:
        base = _out(i, json_top=json_top)
        ids, lps = list(base["token_ids"]), list(base["logprobs"])

        def out(ids=ids, lps=lps, **kw):
            return _out(i, ids, lps, json_top=json_top, **kw)

        if i == 1 and p == 2:                       # a token difference at index 2
            return out(ids[:2] + [999] + ids[3:])
        if i == 2 and p == 2:                       # a logprob difference (bits) at index 1
            return out(ids, lps[:1] + [-0.375] + lps[2:])
        if i == 2 and p == 3:                       # a token difference at index 5
            return out(ids[:5] + [998] + ids[6:])
        if i == 3 and p == 2:                       # a prefix of the reference: ends first
            return out(ids[:5], lps[:5])
        if i == 3 and p == 3:                       # the reference is a prefix of it
            return out(ids + [777, 778], lps + [-2.0, -2.5])
        if i == 4 and p == 0:                       # a warm-up output no counted pass gave
            return out(ids[::-1])
        if i == 5:
            # one output (pass 2 of both arms) diverging from ctl's reference at index 1 and
            # from trt's at index 4: it keeps what the later one needs
            shared = ids[:4] + [555] + ids[5:]
            if p == 2:
                return out(shared)
            if arm == "ctl":
                return out(ids[:1] + [444] + shared[2:])
        if i == 6 and p == 2:                       # index 0 differs; index 6 has 4 alternatives
            return out([997] + ids[1:], alts={6: 2})
        return base
    return outputs


def _make(tmp_path: Path, *, unit="token_ids+logprobs", json_top=False, status=None,
          name="tiny") -> Path:
    reg = register_tiny(tmp_path, declaration(name, n_prompts=N_PROMPTS, passes=PASSES,
                                              warmup=WARMUP, unit=unit), name)
    run = make_run(tmp_path, reg, _outputs(json_top), n_prompts=N_PROMPTS, passes=PASSES,
                   warmup=WARMUP, status=status or (lambda arm, p: "complete"),
                   run_name=f"run-{name}")
    compact(run, slim=True)
    (run / "responses.jsonl").unlink()   # as committed: the two Parquet files only
    return run


def _analysis(run: Path) -> tuple[dict, dict]:
    return (summary_to_dict(analyze_run(run)),
            divergence_anatomy(run).to_dict())


def _rows(run: Path) -> dict[tuple[str, int, str], dict]:
    frame = read_table(run, "responses", ["arm", "pass_index", "prompt_id", "token_ids",
                                          "text", "logprobs", "top_logprobs",
                                          OUTPUT_LENGTH, "token_sha256",
                                          "logprob_sha256"])
    return {(r["arm"], int(r["pass_index"]), r["prompt_id"]): r
            for r in frame.to_dict("records")}


def _footer(path: Path) -> dict[str, str]:
    meta = pq.read_metadata(path).metadata
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"bistat.")}


def _text(row: dict) -> str | None:
    """``text`` as read (a missing string reads as missing: NaN or None)."""
    return row["text"] if isinstance(row["text"], str) else None


def _kept(row: dict) -> int | None:
    return None if row["token_ids"] is None else len(row["token_ids"])


@pytest.mark.parametrize("json_top", [False, True], ids=["parallel-top", "json-top"])
def test_trim_keeps_what_the_analysis_reads_and_findings_are_unchanged(tmp_path, monkeypatch,
                                                                      json_top):
    monkeypatch.chdir(tmp_path)   # run.json names the registration relative to here
    run = _make(tmp_path, json_top=json_top)
    enc = json.loads(_footer(run / OUTPUTS_FILE)["bistat.encoding"])
    assert enc["top_logprobs"] == ("json" if json_top else "parallel")
    before_rows = _rows(run)
    before = _analysis(run)
    before_md = write_finding(analyze_run(run), tmp_path / "before").markdown.read_text()
    columns = list(read_table(run, "responses").columns)
    assert before_rows[("ctl", 1, "q00")][OUTPUT_LENGTH] is None   # not trimmed: null

    written = trim(run)
    assert [p.name for p in written] == ["responses.parquet", OUTPUTS_FILE]
    rows = _rows(run)

    # the hashes are the recorded ones (never recomputed from what is kept)
    for key, row in before_rows.items():
        assert (rows[key]["token_sha256"], rows[key]["logprob_sha256"]) == \
            (row["token_sha256"], row["logprob_sha256"])
        assert rows[key][OUTPUT_LENGTH] == len(row["token_ids"])   # the full length, recorded
    # the reference pass: every output in full, text included
    for arm in ("ctl", "trt"):
        for i in range(N_PROMPTS):
            assert rows[(arm, REF, f"q{i:02d}")] == {**before_rows[(arm, REF, f"q{i:02d}")],
                                                     OUTPUT_LENGTH: LENGTH}
    # an output only a warm-up gave: emptied; warm-ups that equal a counted output: kept
    warm = rows[("ctl", 0, "q04")]
    assert (warm["token_ids"], warm["logprobs"], warm["top_logprobs"], _text(warm)) == \
        (None, None, None, None)
    assert warm[OUTPUT_LENGTH] == LENGTH
    assert _kept(rows[("ctl", 0, "q00")]) == LENGTH
    # cut exactly one past the first difference
    expect = {
        ("ctl", 2, "q01"): 3,     # token difference at 2
        ("ctl", 2, "q02"): 2,     # logprob bits differ at 1
        ("ctl", 3, "q02"): 6,     # token difference at 5
        ("ctl", 2, "q03"): 5,     # a prefix of the reference (5 of 8): in full
        ("ctl", 3, "q03"): 9,     # the reference (8) is a prefix of it (10): 8 + 1
        ("ctl", 2, "q05"): 5,     # shared with trt pass 2 (needs 5), ctl needs 2: the most
        ("trt", 2, "q05"): 5,
        ("ctl", 3, "q05"): LENGTH,  # identical to the reference
        ("ctl", 2, "q06"): 7,     # differs at 0, but kept to its most alternatives (index 6)
        ("ctl", 3, "q01"): LENGTH,
    }
    for key, n in expect.items():
        row, full = rows[key], before_rows[key]
        assert _kept(row) == n, key
        assert row["token_ids"] == full["token_ids"][:n]
        assert row["logprobs"] == full["logprobs"][:n]
        assert row["top_logprobs"] == full["top_logprobs"][:n]
        assert _text(row) == (full["text"] if n == len(full["token_ids"]) else None), key
    # both footers marked; what was kept counted
    info = trim_info(run)
    assert info["unit"] == "token_ids+logprobs" and info["rule"] == TRIM_RULE
    assert info["reference_passes"] == {"ctl": REF, "trt": REF}
    for path in (run / OUTPUTS_FILE, run / "responses.parquet"):
        assert json.loads(_footer(path)["bistat.trim"]) == info
    assert sum(info["outputs"].values()) == pq.read_metadata(run / OUTPUTS_FILE).num_rows
    assert info["outputs"]["emptied"] == 1
    # same columns; the analysis, the anatomy and the finding unchanged
    assert list(read_table(run, "responses").columns) == columns
    after = _analysis(run)
    assert after == before
    divs = [(d["arm"], d["prompt_id"], d["other"]["pass_index"], d["position"], d["kind"],
             d["other"]["n_tokens"], d["relative_position"]) for d in after[1]["divergences"]]
    assert ("ctl", "q02", 2, 1, "logprob", 8, 1 / 8) in divs
    assert ("ctl", "q03", 3, 8, "length", 10, 1.0) in divs
    assert after[1]["top_k"] == 4
    md = write_finding(analyze_run(run), tmp_path / "after").markdown.read_text()
    assert md == before_md


def test_trim_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _make(tmp_path)
    trim(run)
    files = {p: p.read_bytes() for p in (run / OUTPUTS_FILE, run / "responses.parquet")}
    assert trim(run) == []
    assert trim(run, unit="token_ids+logprobs") == []
    assert {p: p.read_bytes() for p in files} == files
    result = CliRunner().invoke(cli, ["compact", "--trim", str(run)])
    assert result.exit_code == 0, result.output
    assert "already trimmed" in result.output and "nothing to do" in result.output
    # a unit that needs more than was kept: refused with the fix
    with pytest.raises(RecordsError, match=r"outputs\.parquet: already trimmed for match unit "
                                           r"'token_ids\+logprobs'.*bistat compact --slim"):
        trim(run, unit="token_ids")


def test_trim_refuses_a_run_that_is_not_slim(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reg = register_tiny(tmp_path, declaration(n_prompts=2, passes=2))
    run = make_run(tmp_path, reg, lambda arm, p, i: [1, 2], n_prompts=2)
    with pytest.raises(RecordsError, match=r"responses\.parquet: not found; trimming works on a "
                                           r"slim compaction: run `bistat compact --slim "):
        trim(run)
    compact(run)
    with pytest.raises(RecordsError, match=r"responses\.parquet: compacted without --slim; .*"
                                           r"run `bistat compact --slim .*` first"):
        trim(run)
    result = CliRunner().invoke(cli, ["compact", "--trim", str(run)])
    assert result.exit_code == 1 and "compacted without --slim" in result.output
    # --slim --trim: both
    result = CliRunner().invoke(cli, ["compact", "--slim", "--trim", str(run)])
    assert result.exit_code == 0, result.output
    assert "trimmed" in result.output and trim_info(run)["unit"] == "token_ids"


def test_a_token_ids_trim_keeps_to_the_token_difference_and_serves_both_units(tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _make(tmp_path)
    before = _analysis(run)
    trim(run, unit="token_ids")
    rows = _rows(run)
    assert _kept(rows[("ctl", 2, "q02")]) == LENGTH   # only its logprobs differ: in full
    assert _kept(rows[("ctl", 3, "q02")]) == 6
    assert _analysis(run) == before                      # registered unit token_ids+logprobs
    check_trim(run, {"ctl": REF}, "token_ids")


def test_a_reference_or_unit_other_than_the_trims_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _make(tmp_path)
    trim(run)
    with pytest.raises(RecordsError, match=r"outputs\.parquet: trimmed \(bistat compact --trim\) "
                                           r"for match unit 'token_ids\+logprobs'.*'token_ids'"):
        divergence_anatomy(run, unit="token_ids")
    with pytest.raises(RecordsError, match=r"outputs\.parquet: arm 'ctl' was trimmed against "
                                           r"reference pass 1 .* pass 2 is its reference here"):
        check_trim(run, {"ctl": 2, "trt": REF}, "token_ids+logprobs")
    check_trim(run, {"ctl": REF, "trt": None, "other": 5}, "token_ids+logprobs")


def test_a_first_counted_pass_that_failed_is_the_analysis_reference(tmp_path, monkeypatch):
    """``bistat analyze`` counts a pass that ended 'failed' (its failed prompts are excluded),
    and so do the standalone anatomy (``bistat diagnose``, ``bistat replay``) and the trim: one
    rule, ``bistat.store.passes.counted_passes``. A trim made against another reference is refused."""
    monkeypatch.chdir(tmp_path)
    run = _make(tmp_path, status=lambda arm, p: "failed" if (arm, p) == ("ctl", REF)
                else "complete")
    summary = analyze_run(run)
    before = summary_to_dict(summary)
    assert counted_passes(run)["ctl"][0] == REF
    anatomy_before = divergence_anatomy(run)
    trim(run)
    assert trim_info(run)["reference_passes"] == {"ctl": REF, "trt": REF}
    assert summary_to_dict(analyze_run(run)) == before
    assert divergence_anatomy(run) == anatomy_before
    assert {a.name: len(a.divergences) for a in summary.arms} == {
        a: anatomy_before.arm(a).n_divergences for a in ("ctl", "trt")}
    with pytest.raises(RecordsError, match=r"arm 'ctl' was trimmed against reference pass 1"):
        check_trim(run, {"ctl": REF + 1}, "token_ids+logprobs")


def test_trimming_a_copy_of_the_committed_pilot_leaves_its_analysis_unchanged(tmp_path,
                                                                              monkeypatch):
    src = ROOT / "data" / "h200" / "h200-match-smollm2"
    reg = Path("preregistrations") / "h200-match-smollm2.json"
    monkeypatch.chdir(ROOT)
    run = tmp_path / src.name
    shutil.copytree(src, run)
    before = summary_to_dict(analyze_run(run, reg))
    committed_trimmed = trim_info(src) is not None
    written = trim(run)
    info = trim_info(run)
    assert info["unit"] == "token_ids+logprobs"
    assert info["reference_passes"] == {"batch-invariant": 2, "bi-triton-attn": 2,
                                        "bi-tuned-gemm": 2, "default": 3}
    assert info["outputs"]["cut"] > 1000 and info["outputs"]["emptied"] > 1000
    if committed_trimmed:   # the committed copy is trimmed already: trimming it is a no-op
        assert written == []
    else:
        assert (run / OUTPUTS_FILE).stat().st_size < 0.65 * (src / OUTPUTS_FILE).stat().st_size
    assert summary_to_dict(analyze_run(run, reg)) == before
