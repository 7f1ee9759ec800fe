"""Fault-and-abuse benchmark: inject faults into runs on the embedded engine and on
``bistat serve`` + an ``openai`` experiment, feed bad inputs to the CLI and the server, and print
what held. No asserts: it prints numbers.

    python benchmarks/bench_faults.py            # about 2-3 minutes on 2 cores

Faults: SIGKILL / SIGINT of ``bistat run`` mid-pass (then ``--resume``), the server killed mid-pass
and restarted (then ``--resume``), a full disk (writes fail with ENOSPC after a byte budget, via a
``sitecustomize`` on PYTHONPATH; then ``--resume``), a same-size edit of responses.jsonl / of
responses.parquet after compaction (is it reported?). "lost" counts the response lines present
before the resume that are gone or changed after it (append-only: must be 0).

Abuse: bad declarations (a clear error = exit code 1, the file named, the field named, no
traceback) and bad HTTP requests (the right 4xx; a disconnecting client's work cancelled).

bistat is driven only through its CLI and HTTP API (tests/faults_support.py), never imported.
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
    print(f"faults injected: {sum(1 for f in t.faults if f['injected'])}")
    print(f"runs resumed: {sum(1 for f in resumable if f['resumed'])} of {len(resumable)}")
    print(f"responses lost: {sum(f['lost'] or 0 for f in t.faults)}")
    print(f"same-size edits detected: {sum(1 for f in t.faults if f.get('detected'))} of "
          f"{sum(1 for f in t.faults if 'detected' in f)}")
    print(f"bad inputs tried: {len(t.abuse)}; clear error: {sum(1 for a in t.abuse if a['clear'])}")
    print(f"wall time: {time.monotonic() - t0:.0f} s")
    print(f"measured with: {provenance()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
