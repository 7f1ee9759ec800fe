"""The recorded-data format: append-only writer, readers with gaps, schema checks, compaction."""

from __future__ import annotations

import hashlib
import json
import struct
import threading

import numpy as np
import pandas as pd
import pytest
import pyarrow.parquet as pq

from bistat.store.format import RecordsError, logprob_sha256, token_sha256
from bistat.store.readers import (
    _check_parquet_pages,
    _parquet_meta,
    load_table,
    read_header,
    read_jsonl,
    read_table,
)
from bistat.store.compact import compact
from bistat.store.passes import pass_counts, pass_states
from bistat.store.writer import RunWriter


def _resp(i: int, **kw) -> dict:
    ids = [i, i + 1, i + 2]
    rec = {"arm": "a", "seq": 0, "pass_index": 0, "kind": "counted", "prompt_id": f"p{i}",
           "prompt_index": i, "token_ids": ids, "text": "x", "logprobs": [-0.5, -0.25, 0.0],
           "top_logprobs": [[[i, -0.5], [7, -2.0]]], "finish_reason": "length",
           "n_prompt_tokens": 4, "t_submit": 0.0, "t_first_token": None, "t_done": 1.25,
           "error": None, "attempts": 1, "token_sha256": token_sha256(ids),
           "logprob_sha256": None}
    rec.update(kw)
    return rec


def test_create_writes_header_once_and_refuses_an_existing_run(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {"run_id": "x"}):
        pass
    assert json.loads((run / "run.json").read_text()) == {"run_id": "x", "schema": "bistat.run/1"}
    with pytest.raises(RecordsError) as err:
        RunWriter.create(run, {"run_id": "y"})
    assert str(err.value) == (
        f"{run / 'run.json'}: a run is already recorded here and is never overwritten; choose a "
        "new run directory, or resume this one (RunWriter.open_existing / bistat run --resume)")
    assert json.loads((run / "run.json").read_text())["run_id"] == "x"


def test_append_adds_schema_one_line_per_record(tmp_path):
    with RunWriter.create(tmp_path / "r", {}) as w:
        w.append("events", {"arm": "a", "event": "started", "time_utc": "t", "detail": None})
        w.append("events", {"arm": "a", "event": "stopped", "time_utc": "u", "detail": "d"})
    lines = (tmp_path / "r" / "events.jsonl").read_text().splitlines()
    assert lines == [
        '{"schema":"bistat.events/1","arm":"a","event":"started","time_utc":"t","detail":null}',
        '{"schema":"bistat.events/1","arm":"a","event":"stopped","time_utc":"u","detail":"d"}']


def test_append_refusals_name_the_problem(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        with pytest.raises(RecordsError, match="unknown table 'response'; expected one of "
                                               "'schedule', 'responses'"):
            w.append("response", {})
        with pytest.raises(RecordsError, match=r"record schema 'bistat.passes/1' does not match "
                                               r"table schema 'bistat.responses/1'"):
            w.append("responses", {"schema": "bistat.passes/1"})
        with pytest.raises(RecordsError) as err:
            w.append("passes", {"wall_s": float("nan")})
        assert "field(s) ['wall_s'] hold NaN or infinity" in str(err.value)
        w.append("passes", {"n": np.int64(3), "x": np.float32(0.5), "ids": np.arange(2)})
    assert read_jsonl(run / "passes.jsonl")[0] == [
        {"schema": "bistat.passes/1", "n": 3, "x": 0.5, "ids": [0, 1]}]
    with pytest.raises(RecordsError, match="writer is closed"):
        w.append("passes", {})


def test_truncated_last_line_is_a_gap_and_resume_closes_it_off(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        w.append("responses", _resp(0))
        w.append("responses", _resp(1))
    with open(run / "responses.jsonl", "a") as fh:   # a crash in the middle of a line
        fh.write('{"schema":"bistat.responses/1","arm":"a","se')
    recs, gaps = read_jsonl(run / "responses.jsonl")
    assert [r["prompt_id"] for r in recs] == ["p0", "p1"]
    assert gaps == ["responses.jsonl:3: truncated line (no newline: cut off while being "
                    "written); ignored"]
    with RunWriter.open_existing(run) as w:
        w.append("responses", _resp(2))
    recs, gaps = read_jsonl(run / "responses.jsonl")
    assert [r["prompt_id"] for r in recs] == ["p0", "p1", "p2"]
    assert gaps == ["responses.jsonl:3: unreadable line (cut off by a crash and closed off on "
                    "resume); ignored"]
    # the partial line was kept, not rewritten
    assert (run / "responses.jsonl").read_text().splitlines()[2].endswith('"arm":"a","se')


def test_unknown_schema_versions_are_refused(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        w.append("events", {"arm": "a"})
    with open(run / "events.jsonl", "a") as fh:
        fh.write('{"schema":"bistat.events/2","arm":"b"}\n')
    with pytest.raises(RecordsError) as err:
        read_jsonl(run / "events.jsonl")
    assert str(err.value) == (f"{run / 'events.jsonl'}:2: schema version 'bistat.events/2' is "
                              "not supported; this bistat reads 'bistat.events/1'. Upgrade "
                              "bistat to read newer records")
    (run / "run.json").write_text('{"schema": "bistat.run/9"}')
    with pytest.raises(RecordsError, match=r"run.json: field 'schema': schema version "
                                           r"'bistat.run/9' is not supported"):
        read_header(run)
    with pytest.raises(RecordsError, match="not found; is .* a bistat run directory"):
        read_header(tmp_path / "nothing")


def test_compact_round_trip_and_fallback_when_jsonl_grows(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        for i in range(5):
            w.append("responses", _resp(i, error="boom" if i == 3 else None))
        w.append("passes", {"arm": "a", "seq": 0, "pass_index": 0, "batching": {"max": 2}})
    before = load_table(run, "responses")
    assert before.source == "jsonl"
    written = compact(run)
    assert [p.name for p in written] == ["responses.parquet", "passes.parquet"]
    after = load_table(run, "responses")
    assert after.source == "parquet"
    pd.testing.assert_frame_equal(before.frame, after.frame)
    assert after.frame.loc[0, "top_logprobs"] == [[[0, -0.5], [7, -2.0]]]
    assert after.frame.loc[2, "token_ids"] == [2, 3, 4]
    assert read_table(run, "passes")["batching"].tolist() == [{"max": 2}]
    cols = ["prompt_id", "token_ids", "absent"]
    sub = read_table(run, "responses", cols, filters={"prompt_id": ["p1", "p4"]})
    assert sub["prompt_id"].tolist() == ["p1", "p4"]
    assert sub["token_ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert sub["absent"].isna().all()
    with RunWriter.open_existing(run) as w:   # the JSONL grows: Parquet is stale
        w.append("responses", _resp(5))
    grown = load_table(run, "responses", cols, filters={"prompt_id": ["p1", "p5"]})
    assert grown.source == "jsonl"
    assert grown.frame["prompt_id"].tolist() == ["p1", "p5"]
    pd.testing.assert_frame_equal(
        sub.reset_index(drop=True),
        read_table(run, "responses", cols, filters={"prompt_id": ["p1", "p4"]}))


def test_compact_keeps_gaps_and_refuses_badly_typed_fields(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        w.append("responses", _resp(0))
    with open(run / "responses.jsonl", "a") as fh:
        fh.write("{broken\n")
    compact(run)
    read = load_table(run, "responses")
    assert (read.source, read.gaps) == ("parquet", (
        "responses.jsonl:2: unreadable line (cut off by a crash and closed off on resume); "
        "ignored",))
    bad = tmp_path / "b"
    with RunWriter.create(bad, {}) as w:
        w.append("responses", _resp(0, seq="first"))
    with pytest.raises(RecordsError, match=r"responses.jsonl: field 'seq' does not hold int64 "
                                           r"values"):
        compact(bad)


def test_hashes_are_little_endian_int64_and_float64():
    assert token_sha256([]) == hashlib.sha256(b"").hexdigest()
    assert token_sha256([1, 256]) == hashlib.sha256(
        struct.pack("<qq", 1, 256)).hexdigest()
    assert logprob_sha256(None) is None
    assert logprob_sha256([-0.5]) == hashlib.sha256(struct.pack("<d", -0.5)).hexdigest()
    # bitwise: -0.0 and 0.0 compare equal as floats but are different records
    assert logprob_sha256([0.0]) != logprob_sha256([-0.0])


def test_concurrent_appends_never_interleave(tmp_path):
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        def work(k: int) -> None:
            for i in range(50):
                w.append("metrics", {"arm": f"a{k}", "seq": i, "t": float(i),
                                     "source": "x" * 500})
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    recs, gaps = read_jsonl(run / "metrics.jsonl")
    assert gaps == [] and len(recs) == 200
    assert sorted((r["arm"], r["seq"]) for r in recs) == sorted(
        (f"a{k}", i) for k in range(4) for i in range(50))


def test_strict_jsonl_ignores_only_a_truncated_last_line(tmp_path):
    from bistat.store.format import RecordsError
    from bistat.store.readers import iter_jsonl_strict

    path = tmp_path / "passes.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    assert list(iter_jsonl_strict(path)) == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(RecordsError, match=r"passes.jsonl:2: not a JSON line"):
        list(iter_jsonl_strict(path))
    assert list(iter_jsonl_strict(tmp_path / "absent.jsonl")) == []


def test_writer_fsyncs_at_most_every_interval_and_on_sync(tmp_path, monkeypatch):
    """Lines are flushed at once (readable by another reader), fsync'ed at most every
    FSYNC_INTERVAL_S, and every written table is fsync'ed by sync() and close()."""
    import os as _os

    from bistat.store import writer as rec
    from bistat.store.readers import read_jsonl
    synced = []
    real_fsync = _os.fsync
    monkeypatch.setattr(rec.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    clock = [100.0]
    monkeypatch.setattr(rec.time, "monotonic", lambda: clock[0])
    w = rec.RunWriter.create(tmp_path / "run", {"run_id": "r"})
    synced.clear()
    w.append("events", {"arm": "a", "event": "x"})          # first line of the table: fsync
    w.append("events", {"arm": "a", "event": "y"})          # within the interval: flushed only
    assert len(synced) == 1
    lines, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [r["event"] for r in lines] == ["x", "y"]        # flushed: another reader sees both
    clock[0] += rec.FSYNC_INTERVAL_S
    w.append("events", {"arm": "a", "event": "z"})          # interval passed: fsync
    assert len(synced) == 2
    w.append("events", {"arm": "a", "event": "w"})
    w.sync()
    assert len(synced) == 3
    w.sync()                                                 # nothing new: no fsync
    assert len(synced) == 3
    w.append("metrics", {"arm": "a", "t": 0.0})              # new table: fsync
    w.append("metrics", {"arm": "a", "t": 1.0})
    w.close()                                                # the dirty table is fsync'ed
    assert len(synced) == 5


def test_pass_states_one_rule_for_kind_and_status():
    """The kind and end status of each pass, as the analysis and ``counted_passes`` read them:
    the pass record's kind before its start event's, missing or empty fields as absent, the last
    ``end`` event's status, None without one."""

    passes = pd.DataFrame([{"arm": "a", "pass_index": 0, "kind": "warmup"},
                           {"arm": "a", "pass_index": 1, "kind": ""},          # empty: absent
                           {"arm": "a", "pass_index": 2, "kind": float("nan")}])
    schedule = pd.DataFrame([
        {"event": "start", "arm": "a", "pass_index": 0, "kind": "counted", "status": None},
        {"event": "end", "arm": "a", "pass_index": 0, "kind": None, "status": "complete"},
        {"event": "start", "arm": "a", "pass_index": 1, "kind": "counted", "status": None},
        {"event": "end", "arm": "a", "pass_index": 1, "kind": None, "status": "interrupted"},
        {"event": "end", "arm": "a", "pass_index": 1, "kind": None, "status": "complete"},
        {"event": "end", "arm": "b", "pass_index": 0, "kind": None, "status": ""}])
    states = pass_states(passes, schedule, {("a", 2), ("a", 3)})
    assert states == {("a", 0): ("warmup", "complete"), ("a", 1): ("counted", "complete"),
                      ("a", 2): ("counted", None), ("a", 3): ("counted", None),
                      ("b", 0): ("unknown", "no status")}
    # a pass with responses but no end event was cut short by a killed run: never counted
    counts = {k: pass_counts(kind, st) for k, (kind, st) in states.items()}
    assert counts == {("a", 0): False, ("a", 1): True, ("a", 2): False, ("a", 3): False,
                      ("b", 0): False}
    assert pass_states(pd.DataFrame(), pd.DataFrame(), set()) == {}


def test_a_same_size_edit_after_compaction_is_a_gap_and_the_jsonl_is_read(tmp_path):
    """Compaction records the JSONL's sha256; a same-size edit is caught."""
    import hashlib

    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        for i in range(3):
            w.append("responses", _resp(i))
    compact(run)
    path = run / "responses.jsonl"
    meta = _parquet_meta(run / "responses.parquet")
    assert meta["source_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_table(run, "responses").source == "parquet"
    raw = path.read_bytes()
    edited = raw.replace(b'"p1"', b'"q1"', 1)
    assert len(edited) == len(raw) and edited != raw
    path.write_bytes(edited)
    read = load_table(run, "responses")
    assert read.source == "jsonl"
    assert read.frame["prompt_id"].tolist() == ["p0", "q1", "p2"]
    (gap,) = read.gaps
    assert gap.startswith(f"{path}: content changed since compaction (sha256 "
                          f"{hashlib.sha256(edited).hexdigest()}, recorded {meta['source_sha256']}")


def _compacted(tmp_path, n: int):
    """A run of ``n`` responses in one ended counted pass, compacted (page CRCs written)."""
    run = tmp_path / "r"
    with RunWriter.create(run, {}) as w:
        pass_ = {"seq": 0, "arm": "a", "pass_index": 0, "kind": "counted", "block": 0}
        w.append("schedule", {"event": "start", **pass_})
        for i in range(n):
            w.append("responses", _resp(i))
        w.append("schedule", {"event": "end", **pass_, "status": "complete", "n_failed": 0})
    compact(run)
    return run


def test_a_same_size_edit_inside_the_parquet_fails_its_page_crc_and_the_jsonl_is_read(tmp_path):
    """Compaction writes page CRCs; a flipped byte inside a data page is found
    on read (never read as data), the JSONL is read instead and the gap names the Parquet file;
    without the JSONL the read refuses with the file named."""
    run = _compacted(tmp_path, 40)
    pq_path = run / "responses.parquet"
    raw = bytearray(pq_path.read_bytes())
    # a byte inside the first column chunk's data page (after the 4-byte magic and page header)
    md = pq.ParquetFile(pq_path).metadata
    col = md.row_group(0).column(0)
    start = col.data_page_offset
    pos = start + col.total_compressed_size - 2
    raw[pos] ^= 0xFF
    pq_path.write_bytes(bytes(raw))
    read = load_table(run, "responses")
    assert read.source == "jsonl"
    assert read.frame["prompt_id"].tolist() == [f"p{i}" for i in range(40)]
    assert len(read.gaps) == 1 and read.gaps[0].startswith(f"{pq_path}: unreadable (")
    assert read.gaps[0].endswith("read from responses.jsonl instead")
    (run / "responses.jsonl").unlink()
    with pytest.raises(RecordsError, match=r"(?s)responses\.parquet: unreadable .*JSONL is not kept"):
        load_table(run, "responses")


def test_a_damaged_page_is_found_in_a_column_the_read_does_not_ask_for(tmp_path):
    """Every page is checked once per file version, not only the columns a caller reads."""
    run = _compacted(tmp_path, 40)
    pq_path = run / "responses.parquet"
    rg = pq.ParquetFile(pq_path).metadata.row_group(0)
    last = rg.column(rg.num_columns - 1)
    assert last.path_in_schema != "prompt_id"
    raw = bytearray(pq_path.read_bytes())
    first = last.dictionary_page_offset if last.has_dictionary_page else last.data_page_offset
    data_page_bytes = last.total_compressed_size - (last.data_page_offset - first)
    raw[last.data_page_offset + data_page_bytes // 2] ^= 0xFF   # inside its data page
    pq_path.write_bytes(bytes(raw))
    read = load_table(run, "responses", columns=["prompt_id"])
    assert read.source == "jsonl"
    assert read.frame["prompt_id"].tolist() == [f"p{i}" for i in range(40)]
    assert read.gaps[0].startswith(f"{pq_path}: unreadable (")


def test_no_flipped_byte_inside_any_column_chunk_is_read_as_data(tmp_path):
    """A byte flipped anywhere in the column chunks of a compacted table (dictionary pages,
    data pages, page headers; every 5th byte) either leaves the decoded table unchanged (a
    header field that does not touch the values) or is found: the JSONL is read, the gap names
    the Parquet file. Never a changed value read from the Parquet."""
    run = _compacted(tmp_path, 30)
    pq_path = run / "responses.parquet"
    orig = pq_path.read_bytes()
    want = load_table(run, "responses").frame
    rg = pq.ParquetFile(pq_path).metadata.row_group(0)
    starts = [rg.column(c).dictionary_page_offset if rg.column(c).has_dictionary_page
              else rg.column(c).data_page_offset for c in range(rg.num_columns)]
    end = max(s + rg.column(c).total_compressed_size for c, s in enumerate(starts))
    found = unchanged = 0
    for pos in range(min(starts), end, 5):
        raw = bytearray(orig)
        raw[pos] ^= 0x01
        pq_path.write_bytes(bytes(raw))
        _check_parquet_pages.cache_clear()
        read = load_table(run, "responses")
        if read.source == "parquet":
            pd.testing.assert_frame_equal(read.frame, want)
            unchanged += 1
        else:
            assert read.source == "jsonl" and read.gaps[0].startswith(f"{pq_path}: unreadable (")
            found += 1
    assert found > 3 * unchanged   # most bytes are values; the rest header fields (measured: 650 found, 122 harmless)


def test_recorded_run_reads_each_table_once_and_hands_out_copies(tmp_path, monkeypatch):
    """RecordedRun: the Parquet check (a hash of the whole JSONL) once per table, each read once
    per (columns, filters), the same frames and gaps as load_table, frames the caller may change."""
    import bistat.store.run_dir as rd

    run = _compacted(tmp_path, 4)
    with open(run / "responses.jsonl", "a") as fh:   # grown since compaction: the JSONL is read
        fh.write('{"schema":"bistat.responses/1","arm":"a","se')
    states, loads = [], []
    real_state, real_load = rd._parquet_state, rd._load_table
    monkeypatch.setattr(rd, "_parquet_state", lambda d, t: (states.append(t), real_state(d, t))[1])
    monkeypatch.setattr(rd, "_load_table", lambda *a: (loads.append(a[1]), real_load(*a))[1])
    opened = rd.RecordedRun.open(run)
    assert rd.RecordedRun.of(opened) is opened and opened.run_id == "r"
    first = opened.load("responses", ["arm", "prompt_id"])
    want = load_table(run, "responses", ["arm", "prompt_id"])
    pd.testing.assert_frame_equal(first.frame, want.frame)
    assert (first.gaps, first.source) == (want.gaps, "jsonl") and len(first.gaps) == 1
    first.frame["prompt_id"] = "changed"
    again = opened.table("responses", ["arm", "prompt_id"])
    assert again["prompt_id"].tolist() == ["p0", "p1", "p2", "p3"]
    assert opened.table("responses", ["arm"], filters={"prompt_id": ["p1", "p3"]}).shape == (2, 1)
    assert opened.trim_info is None
    opened.check_trim({"a": 0}, "token_ids")
    assert opened.counted_passes == {"a": [0]}
    assert states == ["responses", "passes", "schedule"]
    assert loads == ["responses", "responses", "responses", "passes", "schedule"]
    opened.table("responses", ["arm", "prompt_id"])
    assert len(loads) == 5


def test_store_doctests():
    import doctest

    from bistat.store import format as fmt, run_dir, writer
    for module in (fmt, writer, run_dir):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_a_recorded_command_names_bistat_not_this_machine_s_path():
    """run.json records ``sys.argv``; a finding showed ``/tmp/fresh/.venv/bin/bistat run ...``
    or ``-c run ...`` as the Command. Both the recording and the analysis of runs recorded
    before write the program as ``bistat``."""
    from bistat.store.format import command_words

    for argv0 in ("/tmp/fresh/.venv/bin/bistat", "-c", "/work/main/src/bistat/__main__.py",
                  "bistat"):
        assert command_words([argv0, "run", "preregistrations/q.json"]) == (
            "bistat", "run", "preregistrations/q.json")
    assert command_words(["my_study.py", "--fast"]) == ("my_study.py", "--fast")
    assert command_words([]) == ()
