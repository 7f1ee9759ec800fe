"""Fault-and-abuse benchmark: inject faults into runs on the embedded engine and on
``bistat serve`` + an ``openai`` experiment, feed bad inputs to the CLI and the server, and print
what held. No asserts: it prints numbers.

    python benchmarks/bench_faults.py            # about 5 minutes on 2 cores

Faults: SIGKILL / SIGINT of ``bistat run`` mid-pass (then ``--resume``), the server killed mid-pass
and restarted (then ``--resume``), a full disk (writes fail with ENOSPC after a byte budget, via a
``sitecustomize`` on PYTHONPATH; then ``--resume``), a same-size edit of responses.jsonl / of
responses.parquet after compaction (is it reported?). "lost" counts the response lines present
before the resume that are gone or changed after it (append-only: must be 0). Third round: a
paired-cost study killed by SIGKILL, SIGINT, SIGTERM or between two passes, analysed before its
resume (the unfinished pass must not count) and after (its 4 rounds must be its 4 pairs); the
servers of ``command-server`` and ``sglang-server`` studies after a SIGKILL of ``bistat run``
(with their watchdogs killed too: the resume or ``bistat doctor`` must stop them), and the
``vllm-server``'s through its adapter.

Abuse: bad declarations (a clear error = exit code 1, the file named, the field named, no
traceback), bad HTTP requests (the right 4xx; a disconnecting client's work cancelled), fields of
vLLM's and SGLang's servers (served where they change nothing, refused where they would), a toy
run analysed and indexed (the committed findings unchanged).

bistat is driven only through its CLI and HTTP API (tests/faults_support.py), never imported here
(the adapter driver runs in a process of its own).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

import faults_support as s  # noqa: E402


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def lost_after(before: list[bytes], path: Path) -> int:
    after = set(lines(path))
    return sum(1 for line in before if line not in after)


def counted_complete(run_dir: Path) -> int:
    return sum(1 for r in s.read_jsonl(run_dir / "schedule.jsonl")
               if r["event"] == "end" and r["kind"] == "counted" and r["status"] == "complete")


def wait_for_responses(path: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while len(s.read_jsonl(path)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Table:
    def __init__(self) -> None:
        self.faults: list[dict] = []
        self.abuse: list[dict] = []


def fault_kill_run(t: Table, root: Path, name: str, decl: str, sig: int, label: str, engine: str,
                   server_for_resume=None) -> None:
    path = s.write_declaration(root, name, decl)
    s.bistat("register", path, cwd=root)
    run_dir = root / "runs" / name
    proc = subprocess.Popen([sys.executable, "-m", "bistat", "run", f"preregistrations/{name}.json",
                             "--run-dir", f"runs/{name}", "--no-progress"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env())
    injected = wait_for_responses(run_dir / "responses.jsonl", proc, 12)
    if injected:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    before = lines(run_dir / "responses.jsonl")
    rc, rout = s.bistat("run", "--resume", f"runs/{name}", "--no-progress", cwd=root)
    t.faults.append({"engine": engine, "fault": label, "injected": injected, "exit": proc.returncode,
                     # a SIGKILLed process cannot print anything
                     "resume_cmd_shown": (None if sig == signal.SIGKILL
                                          else f"bistat run --resume runs/{name}" in out),
                     "resumed": rc == 0 and "nothing left to run" not in rout,
                     "lost": lost_after(before, run_dir / "responses.jsonl"),
                     "traceback": "Traceback" in out})


def fault_disk_full(t: Table, root: Path, model: str) -> None:
    name = "diskfull"
    path = s.write_declaration(root, name, s.declaration(name, model))
    s.bistat("register", path, cwd=root)
    run_dir = root / "runs" / name
    run_dir.mkdir(parents=True)
    rc, out = s.bistat("run", f"preregistrations/{name}.json", "--run-dir", f"runs/{name}",
                       "--no-progress", cwd=root,
                       extra_env=s.enospc_env(root / "site", run_dir, 30_000))
    before = lines(run_dir / "responses.jsonl")
    rc2, rout = s.bistat("run", "--resume", f"runs/{name}", "--no-progress", cwd=root)
    t.faults.append({"engine": "embedded", "fault": "disk full (ENOSPC after 30 kB)", "injected": True,
                     "exit": rc, "resume_cmd_shown": f"bistat run --resume runs/{name}" in out,
                     "resumed": rc2 == 0 and "nothing left to run" not in rout,
                     "lost": lost_after(before, run_dir / "responses.jsonl"),
                     "traceback": "Traceback" in out})


def fault_same_size_edit(t: Table, root: Path, model: str, which: str) -> None:
    name = f"edit-{which}"
    path = s.write_declaration(root, name, s.declaration(name, model))
    s.bistat("register", path, cwd=root)
    s.bistat("run", f"preregistrations/{name}.json", "--run-dir", f"runs/{name}", "--no-progress", cwd=root)
    run_dir = root / "runs" / name
    target = run_dir / f"responses.{which}"
    raw = bytearray(target.read_bytes())
    if which == "jsonl":
        ls = bytes(raw).splitlines(True)
        mid = len(ls) // 2
        m = re.search(rb'"token_ids": ?\[(\d)', ls[mid])
        ls[mid] = ls[mid][:m.start(1)] + (b"1" if m.group(1) != b"1" else b"2") + ls[mid][m.end(1):]
        raw = bytearray(b"".join(ls))
    else:
        i = len(raw) // 2
        raw[i] ^= 0x01
    target.write_bytes(bytes(raw))
    rc, out = s.bistat("analyze", f"runs/{name}", "--out", "findings", cwd=root)
    finding = (root / "findings" / f"{name}.md")
    text = finding.read_text() if finding.exists() else ""
    gaps = text[text.find("## Data gaps"):] if "## Data gaps" in text else ""
    detected = rc != 0 or (bool(gaps) and "None: every record line was readable" not in gaps)
    t.faults.append({"engine": "embedded", "fault": f"same-size edit of responses.{which}",
                     "injected": True, "exit": rc, "resume_cmd_shown": None, "resumed": None,
                     "lost": None, "traceback": "Traceback" in out, "detected": detected})


def fault_server_killed(t: Table, root: Path, model: str) -> None:
    server = s.Server(model, root / "serve-kill.log", max_batch_size=1)
    name = "srvkill"
    url = f'url = "{server.url}"'
    path = s.write_declaration(root, name, s.declaration(
        name, model, kind="openai", engine_args="retries = 1, backoff_s = 0.05", blas_args=url,
        invariant_args=url, passes=4, max_tokens=24, concurrency=1))
    s.bistat("register", path, cwd=root)
    run_dir = root / "runs" / name
    proc = subprocess.Popen([sys.executable, "-m", "bistat", "run", f"preregistrations/{name}.json",
                             "--run-dir", f"runs/{name}", "--no-progress"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env())
    injected = wait_for_responses(run_dir / "responses.jsonl", proc, 12)
    server.kill()
    server.proc.wait(timeout=10)
    out, _ = proc.communicate(timeout=300)
    server.stop()
    before = lines(run_dir / "responses.jsonl")
    all_failed = sum(1 for p in s.read_jsonl(run_dir / "passes.jsonl") if p["n_failed"] == p["n_requests"])
    server = s.Server(model, root / "serve-kill2.log", port=server.port, max_batch_size=1)
    try:
        rc, rout = s.bistat("run", "--resume", f"runs/{name}", "--no-progress", cwd=root)
    finally:
        server.stop()
    t.faults.append({"engine": "serve+openai", "fault": "server SIGKILLed mid-pass, restarted",
                     "injected": injected, "exit": proc.returncode,
                     "resume_cmd_shown": f"bistat run --resume runs/{name}" in out,
                     "resumed": rc == 0 and "nothing left to run" not in rout and counted_complete(run_dir) >= 8,
                     "lost": lost_after(before, run_dir / "responses.jsonl"), "traceback": "Traceback" in out,
                     "note": f"{all_failed} pass(es) with every request failed"})


# --- third round: cost pairs after a resume, servers after a kill ---------------------------------

def analysis_json(root: Path, run: str) -> dict:
    """``bistat analyze runs/RUN --json`` (its finding under findings/local/RUN)."""
    proc = subprocess.run([sys.executable, "-m", "bistat", "analyze", f"runs/{run}", "--out",
                           f"findings/local/{run}", "--json"], cwd=root, capture_output=True,
                          text=True, env=s.env(), timeout=300)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def fault_pairs(t: Table, root: Path, model: str, how: str) -> None:
    """A paired-cost study (4 counted passes per arm, 1 warm-up) killed mid-pass by ``how``
    (SIGKILL, SIGINT, SIGTERM) or between two passes, analysed before its resume (does the
    unfinished pass count?), then resumed: how many of the 4 rounds are paired, and do the arms'
    pass indices still line up (they do not after a resume: pairing by them mispaired)?"""
    name = "pairs-" + how.lower().replace(" ", "-")
    s.write_declaration(root, name, s.declaration(name, model, passes=4, warmup_passes=1,
                                                  max_tokens=24, concurrency=1)
                         + s.PAIRED_COST)
    s.bistat("register", f"experiments/{name}.toml", cwd=root)
    run_dir = root / "runs" / name
    proc = subprocess.Popen([sys.executable, "-m", "bistat", "run", f"preregistrations/{name}.json",
                             "--run-dir", f"runs/{name}", "--no-progress"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env())
    if how == "between passes":
        out, _ = proc.communicate(timeout=300)
        s.cut_records(run_dir, 4)
        injected = True
    else:
        injected = wait_for_responses(run_dir / "responses.jsonl", proc, 28)
        if injected:
            proc.send_signal(getattr(signal, how))
        out, _ = proc.communicate(timeout=300)
    before = analysis_json(root, name)
    unfinished = [p for p in before.get("passes", []) if p["counted"] and p["status"] == "no end event"]
    kept = lines(run_dir / "responses.jsonl")
    rc, rout = s.bistat("run", "--resume", f"runs/{name}", "--no-progress", cwd=root)
    after = analysis_json(root, name)
    cost = (after.get("comparisons") or [{}])[0].get("verdict", {}).get("cost") or {}
    ends = {r["seq"]: r for r in s.read_jsonl(run_dir / "schedule.jsonl") if r["event"] == "end"}
    indices = {arm: [e["pass_index"] for _, e in sorted(ends.items()) if e["arm"] == arm
                     and e["kind"] == "counted" and e["status"] == "complete"]
               for arm in ("blas", "invariant")}
    said = "" if how != "SIGTERM" else (" · said SIGTERM" if "interrupted by SIGTERM" in out
                                        else " · did not say SIGTERM")
    t.faults.append({"engine": "embedded, paired cost", "fault": f"{how} of bistat run"
                     if how != "between passes" else "SIGKILL between two passes",
                     "injected": injected, "exit": proc.returncode,
                     "resume_cmd_shown": (None if how in ("SIGKILL", "between passes")
                                          else f"bistat run --resume runs/{name}" in out),
                     "resumed": rc == 0 and "nothing left to run" not in rout,
                     "lost": lost_after(kept, run_dir / "responses.jsonl"),
                     "traceback": "Traceback" in out + rout,
                     "pairs_ok": cost.get("n_pairs") == 4,
                     "unfinished_counted": bool(unfinished),
                     "note": f"{cost.get('n_pairs')} pair(s) of 4 rounds; pass indices "
                             f"{'in' if indices['blas'] == indices['invariant'] else 'out of'} line"
                             f"; unfinished pass counted before the resume: "
                             f"{'yes' if unfinished else 'no'}{said}"})


def _kill_groups(pgids) -> None:
    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fault_server_lifetime(t: Table, root: Path, model: str, kind: str, watchdogs_too: bool,
                          then: str) -> None:
    """``bistat run`` of a ``kind`` study killed with SIGKILL mid-pass (with its servers'
    watchdogs first, when ``watchdogs_too``): how many server processes are left 15 s later, and
    after ``then`` ("resume" or "doctor", then the resume) none may be."""
    name = f"srv-{kind}-{'wd' if watchdogs_too else 'run'}-{then}"
    if kind == "command-server":
        decl = s.declaration(name, model, kind=kind,
                             engine_args=f"command = {json.dumps(s.SERVE)}, stop_grace_s = 5",
                             blas_args='gemm = "blas"', invariant_args='gemm = "invariant"',
                             passes=4, max_tokens=24, concurrency=1)
        extra = {}
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_engine_sglang import DECLARATION as SGLANG
        decl = SGLANG.format(name=name, model=model, treatment_env="", command=json.dumps(
            [sys.executable, str(ROOT / "tests" / "sglang_standin.py")]))
        extra = {"STANDIN_STEP_S": "0.02"}
    s.write_declaration(root, name, decl)
    s.bistat("register", f"experiments/{name}.toml", cwd=root)
    run_dir = root / "runs" / name
    try:
        proc = s.run_until(root, name, name, 10, **extra)
    except AssertionError:
        t.faults.append({"engine": kind, "fault": "SIGKILL of bistat run", "injected": False,
                         "exit": None, "resume_cmd_shown": None, "resumed": None, "lost": None,
                         "traceback": False, "note": "the run ended before the kill"})
        return
    servers = s.recorded_servers(run_dir)
    if watchdogs_too:
        for p in servers:
            os.kill(p["watchdog_pid"], signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    kept = lines(run_dir / "responses.jsonl")
    groups = [p["pgid"] for p in servers]
    s.gone_within(groups, 15)
    left = sum(len(s.group_alive(g)) for g in groups)
    listed = stopped = 0
    try:
        if then == "doctor":
            done = subprocess.run([sys.executable, "-m", "bistat", "doctor", "--json"],
                                  capture_output=True, text=True, env=s.env(), timeout=120)
            found = json.loads(done.stdout).get("leftover_servers", [])
            listed = sum(1 for d in found if d["pgid"] in groups)
            stopped = sum(1 for d in found if d["pgid"] in groups and d["stopped"])
        rc, rout = s.bistat("run", "--resume", f"runs/{name}", "--no-progress", cwd=root,
                            extra_env=extra)
        if then == "resume":
            stopped = rout.count("an earlier process of this run left running")
        after = sum(len(s.group_alive(g)) for g in groups)
    finally:
        _kill_groups(groups)
    what = " and its servers' watchdogs" if watchdogs_too else ""
    t.faults.append({"engine": kind, "fault": f"SIGKILL of bistat run{what}, then {then}",
                     "injected": True, "exit": proc.returncode, "resume_cmd_shown": None,
                     "resumed": rc == 0 and "nothing left to run" not in rout,
                     "lost": lost_after(kept, run_dir / "responses.jsonl"),
                     "traceback": "Traceback" in rout, "servers_left": after,
                     "note": f"{len(servers)} server(s) up; {left} process(es) of them left 15 s "
                             f"after the kill; {then} stopped {stopped}"
                             + (f" (doctor listed {listed})" if then == "doctor" else "")
                             + f"; left after the resume: {after}"})


def fault_server_driver_killed(t: Table, root: Path, model: str, kind: str) -> None:
    """The process holding one ``kind`` server (as ``bistat run`` holds it) killed with SIGKILL:
    is the server's process group gone 15 s later? For the kinds whose study cannot be
    registered here (``vllm-server``: no vLLM), the adapter driven directly."""
    tmp = Path(tempfile.mkdtemp(prefix=f"driver-{kind}-", dir=root))
    spec = {**s.server_spec(kind, model, tmp, ROOT / "tests", ROOT / "src"),
            "report": str(tmp / "processes.jsonl")}
    driver = subprocess.Popen([sys.executable, "-c", s.SERVER_DRIVER, json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=s.env(PYTHONPATH=str(ROOT / "src")))
    ready = driver.stdout.readline() == "ready\n"
    groups = [r["pgid"] for r in s.read_jsonl(tmp / "processes.jsonl") if r["state"] == "started"]
    members = sum(len(s.group_alive(g)) for g in groups)
    driver.kill()
    driver.wait(timeout=30)
    gone = s.gone_within(groups, 15)
    left = sum(len(s.group_alive(g)) for g in groups)
    _kill_groups(groups)
    t.faults.append({"engine": f"{kind} (adapter)", "fault": "SIGKILL of the process holding "
                     "the server", "injected": ready, "exit": -9, "resume_cmd_shown": None,
                     "resumed": None, "lost": None, "traceback": False, "servers_left": left,
                     "note": f"{members} process(es) in the server's group; "
                             f"{'all gone' if gone else f'{left} left'} 15 s later"})


BAD_DECLARATIONS = [
    # (label, old, new, words the error must name)
    ("misspelt field n_prompt", "n_prompts = 8", "n_prompt = 8", ("n_prompt",)),
    ("unknown engine 'vlm'", 'kind = "embedded"', 'kind = "vlm"', ("engine.kind", "vlm")),
    ("bad gemm mode 'invarient'", 'gemm = "invariant"', 'gemm = "invarient"', ("gemm", "invarient")),
    ("missing prompt file", 'source = "builtin:chat"', 'source = "file:prompts/missing.jsonl"',
     ("workload.source", "missing.jsonl")),
    ("passes = 1", "passes = 3", "passes = 1", ("workload.passes",)),
    ("engine argument typo", "max_batch_size = 4", "max_batch_sise = 4", ("max_batch_sise",)),
    ("unknown model", 'model = "{model}"', 'model = "no-such-model"', ("engine.model", "no-such-model")),
    # what `run` used to refuse (or fail on) only after the registration was sealed
    ("openai engine without url", [('kind = "embedded"', 'kind = "openai"'), ("max_batch_size = 4", ""),
                                   ('gemm = "blas"', ""), ('gemm = "invariant"', "")],
     ("engine.args.url", "needs the URL")),
    ("openai engine with an unknown key gemm",
     [('kind = "embedded"', 'kind = "openai"'), ("max_batch_size = 4", 'url = "http://127.0.0.1:1"'),
      ('gemm = "blas"', "")], ("arms[1].args.gemm", "unknown argument 'gemm'")),
    ("openai engine with a malformed url",
     [('kind = "embedded"', 'kind = "openai"'), ("max_batch_size = 4", 'url = "127.0.0.1:1"'),
      ('gemm = "blas"', ""), ('gemm = "invariant"', "")], ("engine.args.url", "not a server URL")),
    ("max_tokens = 10000000 over max_model_len", "max_tokens = 4", "max_tokens = 10000000",
     ("workload.max_tokens", "max_model_len")),
    ("n_prompts = 100000 from builtin:chat", "n_prompts = 8", "n_prompts = 100000",
     ("workload.n_prompts", "1200")),
    ("environment on an embedded arm", 'args = { gemm = "invariant" }',
     'args = { gemm = "invariant" }\nenv = { OMP_NUM_THREADS = "1" }', ("arms[1].env",)),
]


def abuse_cli(t: Table, root: Path, model: str) -> None:
    for i, entry in enumerate(BAD_DECLARATIONS):
        label, words = entry[0], entry[-1]
        edits = entry[1] if isinstance(entry[1], list) else [(entry[1], entry[2])]
        name = f"bad{i}"
        text = s.declaration(name, model)
        for old, new in edits:
            text = text.replace(old.replace("{model}", model), new, 1)
        path = s.write_declaration(root, name, text)
        rc, out = s.bistat("register", path, cwd=root)
        clear = rc == 1 and path in out and all(w in out for w in words) and "Traceback" not in out
        t.abuse.append({"surface": "cli register", "input": label, "result": f"exit {rc}", "clear": clear})
    path = s.write_declaration(root, "filename", s.declaration("othername", model))
    for cmd in ("register", "design"):
        rc, out = s.bistat(cmd, path, cwd=root)
        t.abuse.append({"surface": f"cli {cmd}", "input": "name differs from file name",
                        "result": f"exit {rc}", "clear": rc == 1 and path in out and "name" in out})
    path = s.write_declaration(root, "plain", s.declaration("plain", model))
    rc, out = s.bistat("run", path, cwd=root)
    t.abuse.append({"surface": "cli run", "input": "a declaration instead of a registration",
                    "result": f"exit {rc}", "clear": rc == 1 and "bistat register experiments/plain.toml" in out,
                    "want": "exit 1, 'register it first: bistat register ...'"})
    rc, out = s.bistat("verify", path, cwd=root)
    t.abuse.append({"surface": "cli verify", "input": "a declaration instead of a registration",
                    "result": f"exit {rc}", "clear": rc == 1 and "give the sealed .json" in out
                    and "Traceback" not in out, "want": "exit 1, 'give the sealed .json'"})
    # a missing file is missing, not "a declaration"
    for cmd, missing in (("run", "nothere.toml"), ("verify", "nonexistent.toml")):
        rc, out = s.bistat(cmd, missing, cwd=root)
        t.abuse.append({"surface": f"cli {cmd}", "input": f"a missing file {missing}",
                        "result": f"exit {rc}", "clear": rc == 1 and f"{missing}: no such file" in out
                        and "a declaration" not in out, "want": "exit 1, 'no such file'"})
    abuse_index(t, root, model)


def abuse_index(t: Table, root: Path, model: str) -> None:
    """A user's own run must never rewrite the committed answers: ``bistat analyze`` without
    --out, then ``bistat index`` without options (on an index written with options, and on one
    written by an older bistat, without its options line)."""
    proj = root / "index-proj"
    shutil.copytree(ROOT / "findings", proj / "findings",
                    ignore=shutil.ignore_patterns("*.png", "local"))
    shutil.copy(ROOT / "README.md", proj / "README.md")
    (proj / "preregistrations").symlink_to(ROOT / "preregistrations")   # read only
    committed = {p: p.read_bytes() for p in [proj / "README.md", *(proj / "findings").rglob("*.md")]}
    toy = "toy"
    s.write_declaration(proj, toy, s.declaration(toy, model, passes=2))
    s.bistat("register", f"experiments/{toy}.toml", "--registrations-dir", "mine", cwd=proj)
    s.bistat("run", f"mine/{toy}.json", "--run-dir", f"runs/{toy}", "--no-progress", cwd=proj)
    rc, out = s.bistat("analyze", f"runs/{toy}", cwd=proj)
    rc2, out2 = s.bistat("index", cwd=proj)
    changed = [p for p, b in committed.items() if not p.exists() or p.read_bytes() != b]
    t.abuse.append({"surface": "cli analyze + index", "input": "a toy run analysed, then bistat "
                    "index with no options", "result": f"exit {rc}/{rc2}, {len(changed)} "
                    "committed file(s) changed", "clear": rc == 0 and rc2 == 0 and not changed
                    and (proj / "findings" / "local" / f"{toy}.md").exists(),
                    "want": "findings/local/toy.md; the committed findings and README unchanged"})
    index = proj / "findings" / "README.md"
    old = re.sub(r"<!-- bistat index options: .* -->\n\n", "", index.read_text())
    index.write_text(old)
    rc, out = s.bistat("index", cwd=proj)
    t.abuse.append({"surface": "cli index", "input": "no options, an index that records none but "
                    "has the answers", "result": f"exit {rc}", "clear": rc == 1
                    and index.read_text() == old and "would delete" in out,
                    "want": "exit 1, naming the options; the index unchanged"})


def abuse_http(t: Table, root: Path, model: str) -> None:
    server = s.Server(model, root / "serve-abuse.log", max_batch_size=2,
                      extra=("--max-queued-prompts", "16"))
    url = server.url + "/v1/completions"
    hdr = {"content-type": "application/json"}

    def post(label: str, content: bytes, want: tuple[int, ...], timeout: float = 30,
             words: tuple[str, ...] = ()) -> None:
        try:
            r = httpx.post(url, content=content, headers=hdr, timeout=timeout)
            result, ok = f"HTTP {r.status_code}", r.status_code in want
            ok = ok and all(w in r.text for w in words)
        except httpx.TimeoutException:
            result, ok = f"no answer in {timeout:g} s", False
        t.abuse.append({"surface": "serve", "input": label, "result": result, "clear": ok,
                        "want": "/".join(map(str, want))
                        + (f" naming {', '.join(words)}" if words else "")})

    try:
        post("invalid JSON", b'{"model": ', (400,))
        post("deeply nested JSON (100k levels)", b'{"model":"x","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", (400,))
        post("9 MiB body", json.dumps({"model": model, "prompt": "x" * (9 * 2**20), "max_tokens": 1}).encode(),
             (413,), timeout=60)
        post("max_tokens = -1", json.dumps({"model": model, "prompt": "hi", "max_tokens": -1}).encode(), (400,))
        post("unknown model", json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 1}).encode(), (404, 400))
        post("5000 prompts in one request",
             json.dumps({"model": model, "prompt": [f"p{i}" for i in range(5000)], "max_tokens": 4}).encode(),
             (413, 429), timeout=10)
        # a misspelt field, and a request too large ever to be admitted
        post("misspelt field temprature", json.dumps({"model": model, "prompt": "hi", "max_tokens": 1,
                                                      "temprature": 0}).encode(), (400,),
             words=("temprature", "did you mean 'temperature'"))
        post("20 prompts, over --max-queued-prompts 16",
             json.dumps({"model": model, "prompt": [f"p{i}" for i in range(20)], "max_tokens": 1}).encode(),
             (413,), words=("can never be admitted",))
        abuse_client_fields(t, url.replace("/v1/completions", "/v1/chat/completions"), model)
    finally:
        server.stop()
    # disconnecting clients: 4 clients leave after 1 s; is the work cancelled within 3 s?
    server = s.Server(model, root / "serve-abuse2.log", max_batch_size=2)
    try:
        body = {"model": model, "prompt": [f"story {i}" for i in range(32)], "max_tokens": 400, "ignore_eos": True}

        def client() -> None:
            try:
                httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=client) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        deadline = time.monotonic() + 3
        m = server.metrics()
        while time.monotonic() < deadline and (m.get("num_requests_running") or m.get("num_requests_waiting")):
            time.sleep(0.1)
            m = server.metrics()
        left = int(m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0))
        t.abuse.append({"surface": "serve", "input": "4 clients disconnect after 1 s (128 prompts)",
                        "result": f"{left} requests still queued/running 3 s later", "clear": left == 0,
                        "want": "0 left"})
        t0 = time.monotonic()
        server.kill(signal.SIGTERM)
        try:
            server.proc.wait(timeout=15)
            stopped = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            stopped = None
        t.abuse.append({"surface": "serve", "input": "SIGTERM with work queued",
                        "result": f"exited after {stopped:.1f} s" if stopped is not None else "still running after 15 s",
                        "clear": stopped is not None and stopped <= 5, "want": "<= 5 s"})
    finally:
        server.stop()


def abuse_client_fields(t: Table, url: str, model: str) -> None:
    """Fields of vLLM's and SGLang's servers that bistat serve does not implement: a
    determinism-testing client's switches are served, with logprobs bitwise those of the plain
    request; what would change the output, or needs a tool call, is refused naming the field."""
    base = {"model": model, "messages": [{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0, "seed": 0, "logprobs": True, "top_logprobs": 3}

    def chat(**extra):
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        lp = ([c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]]
              if r.status_code == 200 else None)
        return r, lp

    _, plain = chat()
    switches = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
                "include_reasoning": False, "separate_reasoning": False}
    r, lp = chat(**switches)
    t.abuse.append({"surface": "serve", "input": "a determinism client's chat payload "
                    "(chat_template_kwargs, reasoning_effort, ...)", "result": f"HTTP {r.status_code}",
                    "clear": r.status_code == 200 and lp == plain and plain is not None,
                    "want": "200, logprobs bitwise those without the switches"})
    r, lp = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto")
    t.abuse.append({"surface": "serve", "input": "tools with tool_choice auto (template renders "
                    "none)", "result": f"HTTP {r.status_code}",
                    "clear": r.status_code == 200 and lp == plain, "want": "200, answered in text"})
    for label, extra, words in (
            ("presence_penalty = 0.5", {"presence_penalty": 0.5}, ("presence_penalty",)),
            ("tool_choice required", {"tool_choice": "required"}, ("tool_choice", "tool call"))):
        r, _ = chat(**extra)
        t.abuse.append({"surface": "serve", "input": label, "result": f"HTTP {r.status_code}",
                        "clear": r.status_code == 400 and all(w in r.text for w in words),
                        "want": f"400 naming {words[0]}"})


def survived(f: dict) -> bool:
    """A fault bistat survived: injected, no traceback, resumed where resumable, nothing lost, an
    edit detected, the pairs kept, no unfinished pass counted, no server left."""
    return (bool(f["injected"]) and not f["traceback"] and f["resumed"] is not False
            and not f["lost"] and f.get("detected", True) and f.get("pairs_ok", True)
            and not f.get("unfinished_counted") and not f.get("servers_left"))


def provenance() -> str:
    rc, version = s.bistat("--version", cwd=ROOT)
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import numpy

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    blas = {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}
    return (f"{version.strip()} (git {git}); Python {platform.python_version()}; numpy {numpy.__version__}; "
            f"httpx {httpx.__version__}; {platform.platform()}; CPU {cpu} x {os.cpu_count()}; env {blas}")


def main() -> int:
    source = s.smollm2_folder()
    if source is None:
        print("smollm2-135m is not cached (its tokenizer is needed): bistat model fetch smollm2-135m")
        return 1
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    try:
        model = str(s.build_tiny_model(work / "tiny", source))
        root = work / "proj"
        root.mkdir()
        t = Table()
        slow = dict(passes=4, max_tokens=24, concurrency=1)
        fault_kill_run(t, root, "kill9", s.declaration("kill9", model, **slow), signal.SIGKILL,
                       "SIGKILL of bistat run mid-pass", "embedded")
        fault_kill_run(t, root, "sigint", s.declaration("sigint", model, **slow), signal.SIGINT,
                       "SIGINT (Ctrl-C) of bistat run mid-pass", "embedded")
        fault_disk_full(t, root, model)
        fault_same_size_edit(t, root, model, "jsonl")
        fault_same_size_edit(t, root, model, "parquet")
        server = s.Server(model, work / "serve-run.log", max_batch_size=2)
        try:
            url = f'url = "{server.url}"'
            fault_kill_run(t, root, "httpkill9", s.declaration(
                "httpkill9", model, kind="openai", engine_args="retries = 1, backoff_s = 0.05",
                blas_args=url, invariant_args=url, **slow), signal.SIGKILL,
                "SIGKILL of bistat run mid-pass", "serve+openai")
        finally:
            server.stop()
        fault_server_killed(t, root, model)
        for how in ("SIGKILL", "SIGINT", "SIGTERM", "between passes"):
            fault_pairs(t, root, model, how)
        fault_server_lifetime(t, root, model, "command-server", False, "resume")
        fault_server_lifetime(t, root, model, "command-server", True, "resume")
        fault_server_lifetime(t, root, model, "command-server", True, "doctor")
        fault_server_lifetime(t, root, model, "sglang-server", False, "resume")
        for kind in ("command-server", "vllm-server", "sglang-server"):
            fault_server_driver_killed(t, root, model, kind)
        abuse_cli(t, root, model)
        abuse_http(t, root, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def yn(v) -> str:
        return "-" if v is None else ("yes" if v else "no")

    print("Faults")
    print(f"| engine | fault | injected | exit | resume cmd shown | traceback | resumed | lost | detected / note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in t.faults:
        print(f"| {f['engine']} | {f['fault']} | {yn(f['injected'])} | {f['exit']} | {yn(f['resume_cmd_shown'])} | "
              f"{yn(f['traceback'])} | {yn(f['resumed'])} | {'-' if f['lost'] is None else f['lost']} | "
              f"{yn(f['detected']) if 'detected' in f else f.get('note', '')} |")
    print()
    print("Bad inputs")
    print("| surface | input | result | wanted | clear error |")
    print("|---|---|---|---|---|")
    for a in t.abuse:
        print(f"| {a['surface']} | {a['input']} | {a['result']} | {a.get('want', 'exit 1, file + field named')} | {yn(a['clear'])} |")
    resumable = [f for f in t.faults if f["resumed"] is not None]
    print()
    print(f"faults injected: {sum(1 for f in t.faults if f['injected'])}; survived: "
          f"{sum(1 for f in t.faults if survived(f))}")
    print(f"runs resumed: {sum(1 for f in resumable if f['resumed'])} of {len(resumable)}")
    print(f"responses lost: {sum(f['lost'] or 0 for f in t.faults)}")
    print(f"same-size edits detected: {sum(1 for f in t.faults if f.get('detected'))} of "
          f"{sum(1 for f in t.faults if 'detected' in f)}")
    paired = [f for f in t.faults if "pairs_ok" in f]
    print(f"cost pairs as uninterrupted after a resume: {sum(1 for f in paired if f['pairs_ok'])} "
          f"of {len(paired)} runs")
    print(f"unfinished passes counted before a resume: "
          f"{sum(1 for f in paired if f['unfinished_counted'])} of {len(paired)} runs")
    servers = [f for f in t.faults if "servers_left" in f]
    print(f"server processes left after a kill (and the resume or doctor): "
          f"{sum(f['servers_left'] for f in servers)} in {len(servers)} kills")
    print(f"bad inputs tried: {len(t.abuse)}; answered as wanted: "
          f"{sum(1 for a in t.abuse if a['clear'])}")
    print(f"wall time: {time.monotonic() - t0:.0f} s")
    print(f"measured with: {provenance()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
