"""A run interrupted and resumed keeps its cost pairs, and a killed run's unfinished pass never
counts.

The paired and HAC cost intervals pair the arms' counted passes that the schedule ran side by
side: one pair per round of the counted order (``A B | B A | ...``). A resume gives its new
warm-ups pass indices, so the arms' pass indices of one round stop lining up; the pairs must not.
The test kills a two-arm embedded run with a paired cost rule (SIGKILL or SIGINT during a counted
pass, or a kill between two passes), resumes it, and checks its pairs and the cost decided on
them against *the same data uninterrupted*: a copy of the resumed run's records renumbered as a
run that was never stopped numbers them (its warm-ups, then the counted order, every pass in
engine block 0), without the passes the kill cut short and the resume's warm-ups.

bistat is driven through its CLI as in ``test_faults_acceptance.py``; the renumbering is written
here from the schedule's definition (docs/RECORDS.md), not taken from bistat.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import faults_support as s

ARMS = ("blas", "invariant")            # control, treatment: declared order
PASSES, WARMUPS = 4, 1

def _declare(root: Path, name: str, model: str) -> None:
    text = s.declaration(name, model, passes=PASSES, warmup_passes=WARMUPS, max_tokens=24,
                         concurrency=1) + s.PAIRED_COST
    s.write_declaration(root, name, text)
    rc, out = s.bistat("register", f"experiments/{name}.toml", cwd=root)
    assert rc == 0, out


def _last_ends(run_dir: Path) -> dict[int, dict]:
    """seq -> the last ``end`` line of that pass (a resume may end a pass a second time)."""
    out: dict[int, dict] = {}
    for r in s.read_jsonl(run_dir / "schedule.jsonl"):
        if r["event"] == "end":
            out[r["seq"]] = r
    return out


def _uninterrupted_plan() -> list[tuple[str, str]]:
    """(arm, kind) of every pass of the run never stopped, in schedule order: ``WARMUPS`` rounds
    of warm-ups in declared order, then the ABBA counted order (engines up together)."""
    plan = [(arm, "warmup") for _ in range(WARMUPS) for arm in ARMS]
    for r in range(PASSES):
        plan += [(arm, "counted") for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
    return plan


def _same_data_uninterrupted(root: Path, src: str, dest: str) -> dict[tuple[str, int], int]:
    """Write ``runs/DEST``: the records of ``runs/SRC``'s passes that count (and of its first
    warm-ups), renumbered as the run never stopped numbers them. Returns (arm, pass index in
    SRC) -> pass index in DEST for its counted passes."""
    src_dir, dest_dir = root / "runs" / src, root / "runs" / dest
    dest_dir.mkdir(parents=True)
    (dest_dir / "run.json").write_bytes((src_dir / "run.json").read_bytes())
    ends = _last_ends(src_dir)
    kept: dict[tuple[str, str], list[dict]] = {}
    for seq in sorted(ends):
        e = ends[seq]
        if e["status"] == "complete" and (e["kind"] == "counted" or e["block"] == 0):
            kept.setdefault((e["arm"], e["kind"]), []).append(e)
    renumber: dict[int, tuple[int, int]] = {}    # seq in SRC -> (seq, pass index) in DEST
    next_index = {arm: 0 for arm in ARMS}
    for new_seq, (arm, kind) in enumerate(_uninterrupted_plan()):
        renumber[kept[(arm, kind)].pop(0)["seq"]] = (new_seq, next_index[arm])
        next_index[arm] += 1
    for table in ("schedule", "passes", "responses", "metrics"):
        rows = []
        for r in s.read_jsonl(src_dir / f"{table}.jsonl"):
            seq = r.get("seq")
            if seq not in renumber or (table == "schedule" and r["event"] == "end"
                                       and r != ends[seq]):
                continue
            r = {**r, "seq": renumber[seq][0]}
            if "pass_index" in r:
                r["pass_index"] = renumber[seq][1]
            if "block" in r:
                r["block"] = 0
            rows.append(json.dumps(r) + "\n")
        (dest_dir / f"{table}.jsonl").write_text("".join(rows))
    for table in ("environment", "events"):
        rows = [json.dumps(r) + "\n" for r in s.read_jsonl(src_dir / f"{table}.jsonl")
                if r.get("block", 0) == 0]
        (dest_dir / f"{table}.jsonl").write_text("".join(rows))
    return {(ends[seq]["arm"], ends[seq]["pass_index"]): index
            for seq, (_, index) in renumber.items() if ends[seq]["kind"] == "counted"}


def _analysis(root: Path, run: str) -> tuple[dict, str]:
    """``bistat analyze runs/RUN --json``: the summary, and the finding's text."""
    done = subprocess.run([sys.executable, "-m", "bistat", "analyze", f"runs/{run}", "--out",
                           f"findings/{run}", "--json"], cwd=root, capture_output=True,
                          text=True, env=s.env(), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    return data, (root / data["finding"]["markdown"]).read_text()


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGINT", "between passes"])
def test_a_resumed_run_pairs_its_passes_as_the_same_data_uninterrupted(tmp_path, tiny_model,
                                                                       fault):
    """Killed in a counted pass (about schedule position 4: warm-ups at 0 and 1, then blas,
    invariant | invariant, blas | ...), or between positions 4 and 5, then resumed: the pairs are
    the four rounds of the schedule, the same passes and the same cost verdict as the same data
    uninterrupted, and the finding names them. Paired by pass index, as the analysis did, the
    resumed run had three pairs, two of them of passes from different rounds."""
    root = tmp_path
    _declare(root, "pairs", tiny_model)
    run_dir = root / "runs" / "pairs"
    proc = subprocess.Popen([sys.executable, "-m", "bistat", "run", "preregistrations/pairs.json",
                             "--run-dir", "runs/pairs", "--no-progress"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=s.env())
    if fault == "between passes":
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        s.cut_records(run_dir, after_seq=4)
    else:
        # 8 prompts a pass: with 28 answered, seq 0-2 are done and seq 3 is half done
        deadline = time.monotonic() + 120
        while len(s.read_jsonl(run_dir / "responses.jsonl")) < 28:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL if fault == "SIGKILL" else signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == (-9 if fault == "SIGKILL" else 1), out
    rc, out = s.bistat("run", "--resume", "runs/pairs", "--no-progress", cwd=root)
    assert rc == 0, out
    ends = _last_ends(run_dir)
    counted = {arm: [e["pass_index"] for _, e in sorted(ends.items())
                     if e["arm"] == arm and e["kind"] == "counted" and e["status"] == "complete"]
               for arm in ARMS}
    assert [len(v) for v in counted.values()] == [PASSES, PASSES]
    assert counted["blas"] != counted["invariant"], "the resume left the pass indices in line"

    index_of = _same_data_uninterrupted(root, "pairs", "same")
    resumed, finding = _analysis(root, "pairs")
    same, _ = _analysis(root, "same")
    pair, want = resumed["serial"]["pairs"][0], same["serial"]["pairs"][0]
    assert want["passes"] == want["treatment_passes"] == [1, 2, 3, 4]   # uninterrupted: in line
    assert pair["rounds"] == want["rounds"] == [0, 1, 2, 3]
    assert [index_of[("blas", p)] for p in pair["passes"]] == want["passes"]
    assert [index_of[("invariant", p)] for p in pair["treatment_passes"]] == want["treatment_passes"]
    assert pair["log_differences"] == want["log_differences"]
    cost, want_cost = (d["comparisons"][0]["verdict"]["cost"] for d in (resumed, same))
    assert cost["n_pairs"] == want_cost["n_pairs"] == PASSES
    for key in ("outcome", "ratio", "interval", "statement"):
        assert cost[key] == want_cost[key], key
    # the finding names the passes paired, with their schedule positions
    seq = {(p["arm"], p["pass_index"]): p["seq"] for p in resumed["passes"]}
    cells = [f"{t} / {c} ({seq[('invariant', t)]} / {seq[('blas', c)]})"
             for t, c in zip(pair["treatment_passes"], pair["passes"])]
    assert (f"invariant ÷ blas: 4 pairs of passes, one per round of the schedule (treatment pass "
            f"/ control pass, their schedule positions in parentheses): {', '.join(cells)}."
            in finding)
    assert "ran on different engine starts (the run was resumed between them)" in finding


def test_an_unfinished_pass_of_a_killed_run_is_not_counted(tmp_path, tiny_model):
    """Analysed before its resume, a run killed during a counted pass compares only the passes
    that ended: blas's cut-short second counted pass (3 of 8 prompts answered) is a deviation,
    not a pass in which 3 prompts matched 3 of 3 (docs/CONTRACTS.md: an interrupted pass is never
    counted)."""
    root = tmp_path
    s.write_declaration(root, "cut", s.declaration("cut", tiny_model))
    assert s.bistat("register", "experiments/cut.toml", cwd=root)[0] == 0
    rc, out = s.bistat("run", "preregistrations/cut.json", "--run-dir", "runs/cut", "--no-progress",
                       cwd=root)
    assert rc == 0, out
    run_dir = root / "runs" / "cut"
    s.cut_records(run_dir, after_seq=2, answered=3)       # abba: blas, invariant | invariant, [blas
    rc, out = s.bistat("analyze", "runs/cut", "--out", "findings", cwd=root)
    assert rc == 0, out
    assert "arm blas (control): matched 8/8" in out and "matched 3/3" not in out
    finding = (root / "findings" / "cut.md").read_text()
    row = next(line for line in finding.splitlines() if line.startswith("| blas (control) |"))
    assert row.startswith("| blas (control) | 0 | 8 | 8 |"), row     # counted passes: 0 only
    assert ("blas counted pass 1 (schedule position 3) has no end: the run stopped during it; its "
            "responses are a partial sample, not counted" in finding)
