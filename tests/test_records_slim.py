"""Slim compaction (``compact(run_dir, slim=True)``): each distinct output stored once, rejoined on read."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from bistat.store.compact import compact
from bistat.store.readers import load_table, read_table
from bistat.store.format import logprob_sha256, token_sha256
from bistat.cli import cli
from bistat.store.format import OUTPUTS_FILE, RecordsError
from bistat.store.writer import RunWriter

F32 = [-0.5, -0.25, -1.125, 0.0, -3.0]          # exact in float32
NOT_F32 = [-0.1, -0.2, -0.30000000000000004]     # not exact in float32


def _top(ids, lps, rival=7, gap=-2.0):
    """Top-2 per position: the chosen token first, then a rival."""
    return [[[t, v], [rival, v + gap]] for t, v in zip(ids, lps)]


def _resp(prompt: int, passno: int, ids, lps, *, top="chosen", text=None, error=None,
          arm="a") -> dict:
    if top == "chosen":
        top = None if lps is None else _top(ids, lps)
    return {"arm": arm, "seq": passno, "pass_index": passno, "kind": "counted",
            "prompt_id": f"p{prompt:02d}", "prompt_index": prompt, "token_ids": ids,
            "text": f"text {ids}" if text is None else text, "logprobs": lps,
            "top_logprobs": top, "finish_reason": "length" if error is None else None,
            "n_prompt_tokens": 4, "t_submit": 0.01 * passno, "t_first_token": None,
            "t_done": 1.0 + prompt, "error": error, "attempts": 1 if error is None else 3,
            "token_sha256": token_sha256(ids),
            "logprob_sha256": logprob_sha256(lps)}


def _responses(exact: bool = True) -> list[dict]:
    """3 passes x 6 prompts; 18 responses, 9 distinct outputs."""
    lps = F32 if exact else F32[:2] + NOT_F32
    out = []
    for p in range(3):
        out.append(_resp(0, p, [1, 2, 3, 4, 5], lps))                  # same in every pass
        out.append(_resp(1, p, [9, 8, 7], [-1.5, -0.75, -0.5]))        # same in every pass
        out.append(_resp(2, p, [4, 4, 4 + p], [-2.0, -2.0, -0.5]))      # differs every pass
        out.append(_resp(3, p, [6, 6], None))                           # no logprobs
        out.append(_resp(4, p, [], [], text=""))                        # empty output
        if p == 1:
            out.append(_resp(5, p, [], None, top=None, text="", error="HTTP 500 after 3 tries"))
        else:
            # a near-tie: the chosen token is listed second (no first-alternative elision),
            # and a position without alternatives
            out.append(_resp(5, p, [11, 13], [-0.6875, -1.0],
                             top=[[[12, -0.6875], [11, -0.6875]], None]))
    return out


def _run(tmp_path, name: str, recs: list[dict]):
    run = tmp_path / name
    with RunWriter.create(run, {"run_id": name}) as w:
        for r in recs:
            w.append("responses", r)
        w.append("passes", {"arm": "a", "seq": 0, "pass_index": 0, "batching": {"max": 2}})
    return run


def _twin(tmp_path, recs, **slim_kw):
    """The same records compacted plainly and slim; returns (plain run, slim run, JSONL frame)."""
    plain, slim = _run(tmp_path, "plain", recs), _run(tmp_path, "slim", recs)
    jsonl = load_table(slim, "responses")
    assert jsonl.source == "jsonl"
    compact(plain)
    written = compact(slim, slim=True, **slim_kw)
    assert [p.name for p in written] == ["responses.parquet", OUTPUTS_FILE, "passes.parquet"]
    return plain, slim, jsonl.frame


def _footer(path) -> dict[str, str]:
    meta = pq.read_metadata(path).metadata
    return {k.decode()[len("bistat."):]: v.decode() for k, v in meta.items()
            if k.startswith(b"bistat.")}


@pytest.mark.parametrize("exact", [True, False], ids=["float32-exact", "float64-fallback"])
def test_slim_round_trip_is_the_plain_read(tmp_path, exact):
    plain, slim, before = _twin(tmp_path, _responses(exact))
    after = load_table(slim, "responses")
    assert after.source == "parquet"
    pd.testing.assert_frame_equal(before, after.frame)
    pd.testing.assert_frame_equal(read_table(plain, "responses"), after.frame)
    assert list(after.frame.columns) == list(before.columns)
    row = after.frame.iloc[1]   # prompt 1, pass 0
    assert row["token_ids"] == [9, 8, 7] and type(row["token_ids"][0]) is int
    assert row["logprobs"] == [-1.5, -0.75, -0.5]
    assert row["top_logprobs"] == [[[9, -1.5], [7, -3.5]], [[8, -0.75], [7, -2.75]],
                                   [[7, -0.5], [7, -2.5]]]
    if not exact:   # -0.1 etc. come back bit for bit
        assert after.frame.iloc[0]["logprobs"] == [-0.5, -0.25, -0.1, -0.2, -0.30000000000000004]
    assert after.frame.loc[after.frame["error"].notna(), "top_logprobs"].tolist() == [None]
    assert after.frame.loc[after.frame["prompt_id"] == "p03", "logprobs"].tolist() == [None] * 3
    assert after.frame.loc[after.frame["prompt_id"] == "p04", "token_ids"].tolist() == [[]] * 3

    # column subsets and filters give what the plain compaction gives
    for cols, flt in [(["arm", "prompt_id", "token_sha256"], None),
                      (["prompt_id", "token_ids", "absent"], {"prompt_id": ["p02", "p05"]}),
                      (["top_logprobs", "pass_index"], {"pass_index": [1], "arm": ["a"]}),
                      (["prompt_id"], {"text": ["text [9, 8, 7]"]}),
                      (["prompt_id"], {"no_such_field": [1]})]:
        pd.testing.assert_frame_equal(read_table(plain, "responses", cols, filters=flt),
                                      read_table(slim, "responses", cols, filters=flt))

    out = pq.read_table(slim / OUTPUTS_FILE)
    assert out.num_rows == 9   # dedup: 18 responses, 9 distinct outputs
    assert str(out.schema.field("token_ids").type) == "list<element: int32>"
    assert str(out.schema.field("logprobs").type) == (
        "list<element: float>" if exact else "list<element: double>")
    assert str(out.schema.field("top_logprob_values").type) == (
        "list<element: list<element: float>>" if exact
        else "list<element: list<element: double>>")
    footer = _footer(slim / "responses.parquet")
    assert footer["layout"] == "slim"
    assert footer["outputs_key"] == "token_sha256+logprob_sha256"
    assert footer["source_records"] == "18"
    assert footer["source_bytes"] == str((slim / "responses.jsonl").stat().st_size)
    assert pq.read_schema(slim / "responses.parquet").names[-1] == "output_index"
    assert "token_ids" not in pq.read_schema(slim / "responses.parquet").names
    enc = json.loads(_footer(slim / OUTPUTS_FILE)["encoding"])
    assert enc == {"logprobs": "float32" if exact else "float64", "text": "string",
                   "token_ids": "int32", "top_logprobs": "parallel", "top_token_ids": "int32",
                   "top_logprob_values": "float32" if exact else "float64"}


def test_slim_reads_without_the_jsonl_and_falls_back_when_it_grows(tmp_path):
    _plain, slim, before = _twin(tmp_path, _responses())
    moved = tmp_path / "kept.jsonl"
    shutil.move(slim / "responses.jsonl", moved)   # a committed run without responses.jsonl
    pd.testing.assert_frame_equal(before, read_table(slim, "responses"))
    shutil.move(moved, slim / "responses.jsonl")
    with RunWriter.open_existing(slim) as w:
        w.append("responses", _resp(6, 0, [3], [-1.0]))
    grown = load_table(slim, "responses")
    assert (grown.source, len(grown.frame)) == ("jsonl", 19)


def test_identical_keys_with_different_payloads_key_on_the_payload_hash(tmp_path):
    recs = _responses()
    recs[1] = dict(recs[1], text="another decoding")   # same hashes, different text
    plain, slim, before = _twin(tmp_path, recs)
    pd.testing.assert_frame_equal(before, read_table(slim, "responses"))
    pd.testing.assert_frame_equal(read_table(plain, "responses"),
                                  read_table(slim, "responses"))
    assert _footer(slim / "responses.parquet")["outputs_key"] == "payload_sha256"
    out = pq.read_table(slim / OUTPUTS_FILE)
    assert out.num_rows == 10 and out.column_names[0] == "payload_sha256"


def test_top_logprobs_that_are_not_int_float_pairs_are_kept_as_json(tmp_path):
    recs = _responses()
    recs[0] = dict(recs[0], top_logprobs=[[[1, 0], [7, -2.5]]] * 5)   # an int logprob
    recs[2] = dict(recs[2], token_ids=[4, 2 ** 40, 4],
                   token_sha256=token_sha256([4, 2 ** 40, 4]))   # beyond int32
    _plain, slim, before = _twin(tmp_path, recs)
    after = read_table(slim, "responses")
    pd.testing.assert_frame_equal(before, after)
    assert type(after.iloc[0]["top_logprobs"][0][0][1]) is int
    enc = json.loads(_footer(slim / OUTPUTS_FILE)["encoding"])
    assert (enc["top_logprobs"], enc["token_ids"]) == ("json", "int64")


def test_top_k_keeps_the_first_alternatives_and_is_recorded(tmp_path):
    recs = [_resp(p, 0, [1, 2], [-0.5, -1.0],
                  top=[[[1, -0.5], [3, -1.5], [4, -2.0]], [[2, -1.0], [3, -1.25], [5, -3.0]]])
            for p in range(3)]
    _plain, slim, before = _twin(tmp_path, recs, top_k=2)
    after = read_table(slim, "responses")
    assert after["top_logprobs"].tolist() == [[[[1, -0.5], [3, -1.5]],
                                               [[2, -1.0], [3, -1.25]]]] * 3
    pd.testing.assert_frame_equal(before.drop(columns="top_logprobs"),
                                  after.drop(columns="top_logprobs"))
    assert _footer(slim / OUTPUTS_FILE)["top_k"] == "2"
    assert _footer(slim / OUTPUTS_FILE)["max_alternatives_recorded"] == "3"
    assert _footer(slim / "responses.parquet")["top_k"] == "2"
    compact(slim, slim=True)
    assert _footer(slim / OUTPUTS_FILE)["top_k"] == "recorded"
    pd.testing.assert_frame_equal(before, read_table(slim, "responses"))
    with pytest.raises(RecordsError, match=r"top_k=2 applies to a slim compaction only; pass "
                                           r"slim=True \(bistat compact --slim --top-k K\)"):
        compact(slim, top_k=2)
    with pytest.raises(RecordsError, match="top_k must be a whole number >= 1, got 0"):
        compact(slim, slim=True, top_k=0)


def test_missing_or_foreign_outputs_file_is_named_with_the_fix(tmp_path):
    _plain, slim, _ = _twin(tmp_path, _responses())
    out = slim / OUTPUTS_FILE
    holds = ("responses.parquet was compacted with --slim and keeps token_ids, text, logprobs "
             "and top_logprobs in it")
    out.unlink()
    with pytest.raises(RecordsError) as err:
        read_table(slim, "responses", ["prompt_id"])
    assert str(err.value) == (f"{out}: not found; {holds}; re-create it with "
                              f"`bistat compact --slim {slim}`")
    out.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(RecordsError, match=r"outputs.parquet: not a readable Parquet file \("):
        read_table(slim, "responses")
    (slim / "responses.jsonl").unlink()
    with pytest.raises(RecordsError) as err:
        read_table(slim, "responses")
    assert str(err.value).endswith(f"; {holds}; restore it from where the run is kept (git "
                                   f"never committed {out}, so git cannot restore it); without "
                                   "responses.jsonl it cannot be rebuilt")
    other = _run(tmp_path, "other", _responses()[:6])
    compact(other, slim=True)
    shutil.copy(other / OUTPUTS_FILE, out)
    with pytest.raises(RecordsError, match=r"outputs.parquet: does not belong to .*"
                                           r"responses.parquet \(its outputs_id '[0-9a-f]{64}' "
                                           r"differs from '[0-9a-f]{64}'\); restore it"):
        read_table(slim, "responses")


def test_plain_compaction_after_slim_removes_the_outputs_file(tmp_path):
    _plain, slim, before = _twin(tmp_path, _responses())
    compact(slim)
    assert not (slim / OUTPUTS_FILE).exists()
    assert "layout" not in _footer(slim / "responses.parquet")
    pd.testing.assert_frame_equal(before, read_table(slim, "responses"))


def test_cli_compact_slim(tmp_path):
    run = _run(tmp_path, "r", _responses())
    result = CliRunner().invoke(cli, ["compact", "--slim", "--top-k", "1", str(run)],
                                catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == (f"wrote {run / 'responses.parquet'}\nwrote {run / OUTPUTS_FILE}\n"
                             f"wrote {run / 'passes.parquet'}\n")
    assert _footer(run / OUTPUTS_FILE)["top_k"] == "1"
    result = CliRunner().invoke(cli, ["compact", "--top-k", "2", str(run)])
    assert result.exit_code == 2
    assert result.output.endswith("Error: --top-k applies to a slim compaction only; add "
                                  "--slim\n")
