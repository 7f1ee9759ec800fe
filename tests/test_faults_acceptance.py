"""Acceptance tests of bistat under faults and tampering: no verdict from a partial run, a dying
engine, what ``register`` checks, the seal, stored data checked by content, ``bistat serve``'s
limits, a full disk, and smaller points.

Each test states the behaviour bistat must have. Where the interface was open, the contract
chosen is written in the test's docstring.

bistat is driven only through its public surfaces (see ``faults_support``): the CLI in a
subprocess whose working directory is a fresh ``tmp_path`` holding ``experiments/``, ``bistat
serve`` over HTTP, and the run directory's files (docs/RECORDS.md). The model is a 2-layer random
LLaMA written to disk with SmolLM2's tokenizer, so a pass takes a fraction of a second; the tests
skip when SmolLM2 is not cached.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import faults_support as s

httpx = pytest.importorskip("httpx")


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def complete_run(tmp_path_factory, tiny_model) -> Path:
    """A registered, complete and compacted embedded run (3 counted passes per arm) in
    ``<root>/runs/full``; tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("complete")
    s.write_declaration(root, "full", s.declaration("full", tiny_model))
    rc, out = s.bistat("register", "experiments/full.toml", cwd=root)
    assert rc == 0, out
    rc, out = s.bistat("run", "preregistrations/full.json", "--run-dir", "runs/full", "--no-progress",
                       cwd=root)
    assert rc == 0, out
    assert (root / "runs" / "full" / "responses.parquet").exists()
    return root


def _copy_project(src_root: Path, dest: Path) -> Path:
    for part in ("experiments", "preregistrations", "runs"):
        shutil.copytree(src_root / part, dest / part)
    return dest


def _counted_ends(run_dir: Path) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for r in s.read_jsonl(run_dir / "schedule.jsonl"):
        if r["event"] == "end" and r["kind"] == "counted":
            out[(r["arm"], r["status"])] = out.get((r["arm"], r["status"]), 0) + 1
    return out


# --------------------------------------------------------------------------------------------------
# no verdict from a partial run


def _truncate_to_first_passes(run_dir: Path) -> None:
    """Leave exactly what SIGKILL after schedule position 1 leaves (abba: seq 0 = blas's first
    counted pass, seq 1 = invariant's): every record of seq 0 and 1, the start line of seq 2, and
    no Parquet copy (a killed run is never compacted)."""
    for p in run_dir.glob("*.parquet"):
        p.unlink()
    for table in run_dir.glob("*.jsonl"):
        kept = []
        for line in table.read_text().splitlines(True):
            r = json.loads(line)
            seq = r.get("seq")
            if seq is None or seq < 2 or (table.name == "schedule.jsonl" and seq == 2
                                          and r["event"] == "start"):
                kept.append(line)
        table.write_text("".join(kept))


def test_one_counted_pass_per_arm_is_untested(complete_run, tmp_path):
    """Contract: a comparison needs >= 2 counted passes per arm. With one, ``bistat analyze``
    prints the verdict UNTESTED (never WORKING), ``--fail-on untested`` exits 12, and the finding
    says ``Run status: not testable`` (the finding's existing wording for an untestable run;
    the test first asked for ``untested.``, which would have reworded every committed finding)
    with a reason that mentions the counted passes."""
    root = _copy_project(complete_run, tmp_path / "p")
    run_dir = root / "runs" / "full"
    _truncate_to_first_passes(run_dir)
    assert _counted_ends(run_dir) == {("blas", "complete"): 1, ("invariant", "complete"): 1}
    rc, out = s.bistat("analyze", "runs/full", "--out", "findings", "--fail-on", "untested", cwd=root)
    assert rc == 12, out
    assert "VERDICT invariant vs blas: UNTESTED" in out
    assert "WORKING" not in out
    finding = (root / "findings" / "full.md").read_text()
    assert "Run status: not testable (" in finding
    status_line = next(line for line in finding.splitlines() if line.startswith("Run status:"))
    assert "counted pass" in finding[finding.index(status_line) - 2000:finding.index(status_line) + 500]


def test_a_prompt_missing_from_a_pass_is_not_compared(complete_run, tmp_path):
    """Already holds: a prompt kept in just one counted pass of the invariant arm is not compared
    with nothing; that arm compares the 7 other prompts (``matched 7/7``, not 8/8)."""
    root = _copy_project(complete_run, tmp_path / "p")
    run_dir = root / "runs" / "full"
    for p in run_dir.glob("*.parquet"):
        p.unlink()
    lines = (run_dir / "responses.jsonl").read_text().splitlines(True)
    recs = [json.loads(x) for x in lines]
    inv = sorted({r["seq"] for r in recs if r["arm"] == "invariant" and r["kind"] == "counted"})
    victim = recs[0]["prompt_id"]
    kept = [x for x, r in zip(lines, recs)
            if not (r["arm"] == "invariant" and r["prompt_id"] == victim and r["seq"] != inv[0])]
    assert len(kept) == len(lines) - (len(inv) - 1)
    (run_dir / "responses.jsonl").write_text("".join(kept))
    rc, out = s.bistat("analyze", "runs/full", "--out", "findings", cwd=root)
    assert rc == 0, out
    assert re.search(r"arm invariant \(treatment\): matched 7/7, two-sided 95 % Wilson ", out), out


def test_register_refuses_fewer_than_two_passes(tmp_path, tiny_model):
    """Contract: ``passes = 1`` (no reference-arm mode exists) is refused: exit 1, a message
    naming the file and ``workload.passes``, and no registration written."""
    path = s.write_declaration(tmp_path, "onepass", s.declaration("onepass", tiny_model, passes=1))
    rc, out = s.bistat("register", path, cwd=tmp_path)
    assert rc == 1, out
    assert "experiments/onepass.toml" in out and "workload.passes" in out
    assert "Traceback" not in out
    assert not (tmp_path / "preregistrations" / "onepass.json").exists()


# --------------------------------------------------------------------------------------------------
# an openai engine that dies mid-run interrupts the run, and --resume re-runs it


def test_openai_server_killed_mid_run_is_interrupted_and_resumable(tmp_path, tiny_model):
    """Contract: when every request of a pass fails because the endpoint is dead (connection
    refused/reset), that pass ends ``interrupted``, no later pass runs, ``bistat run`` exits 1
    and prints ``bistat run --resume RUN_DIR``; after the server is back, the resume completes
    every declared counted pass (6 per arm) and exits 0. No pass ends ``complete``/``failed``
    with all of its requests failed."""
    server = s.Server(tiny_model, tmp_path / "serve.log", max_batch_size=1)
    try:
        url = f'url = "{server.url}"'
        path = s.write_declaration(tmp_path, "http", s.declaration(
            "http", tiny_model, kind="openai", engine_args="retries = 1, backoff_s = 0.05", blas_args=url,
            invariant_args=url, passes=6, max_tokens=24, concurrency=1))
        rc, out = s.bistat("register", path, cwd=tmp_path)
        assert rc == 0, out
        run = subprocess.Popen([sys.executable, "-m", "bistat", "run", "preregistrations/http.json",
                                "--run-dir", "runs/http", "--no-progress"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env())
        responses = tmp_path / "runs" / "http" / "responses.jsonl"
        deadline = time.monotonic() + 120
        while not any(r.get("seq", 0) >= 1 for r in s.read_jsonl(responses)):
            assert run.poll() is None and time.monotonic() < deadline, "the run ended before pass 2"
            time.sleep(0.01)
        server.kill()                      # SIGKILL during pass 2 (seq 1)
        server.proc.wait(timeout=10)
        out, _ = run.communicate(timeout=180)
    finally:
        server.stop()
    run_dir = tmp_path / "runs" / "http"
    passes = s.read_jsonl(run_dir / "passes.jsonl")
    assert not [p for p in passes if p["n_failed"] == p["n_requests"]], passes
    assert run.returncode == 1, out
    assert "bistat run --resume runs/http" in out
    assert ("invariant", "interrupted") in _counted_ends(run_dir) or ("blas", "interrupted") in _counted_ends(run_dir)
    kept = len(s.read_jsonl(responses))

    server = s.Server(tiny_model, tmp_path / "serve2.log", port=server.port, max_batch_size=1)
    try:
        rc, out = s.bistat("run", "--resume", "runs/http", "--no-progress", cwd=tmp_path)
    finally:
        server.stop()
    assert rc == 0, out
    assert "nothing left to run" not in out
    ends = _counted_ends(run_dir)
    assert (ends.get(("blas", "complete")), ends.get(("invariant", "complete"))) == (6, 6)
    assert len(s.read_jsonl(responses)) >= kept + 1  # nothing recorded before is lost


# --------------------------------------------------------------------------------------------------
# what register could check, it checks


BAD_DECLARATIONS = {
    # name: (old text, new text, strings the error must name besides the file)
    "unknown-model": ('model = "{model}"', 'model = "no-such-model"', ("engine.model", "no-such-model")),
    "arg-typo": ("max_batch_size = 4", "max_batch_sise = 4", ("max_batch_sise",)),
    "gemm-typo": ('gemm = "invariant"', 'gemm = "invarient"', ("gemm", "invarient")),
    "missing-prompts": ('source = "builtin:chat"', 'source = "file:prompts/missing.jsonl"',
                        ("workload.source", "prompts/missing.jsonl")),
}


@pytest.mark.parametrize("case", sorted(BAD_DECLARATIONS))
def test_register_validates_engine_arguments_model_and_prompts(tmp_path, tiny_model, case):
    """Contract: ``bistat register`` exits 1 with ``experiments/NAME.toml: <field>: ...`` naming
    the offending field (and value), no traceback, and writes no registration."""
    old, new, named = BAD_DECLARATIONS[case]
    text = s.declaration(case, tiny_model)
    old = old.format(model=tiny_model)
    assert old in text
    path = s.write_declaration(tmp_path, case, text.replace(old, new, 1))
    rc, out = s.bistat("register", path, cwd=tmp_path)
    assert rc == 1, out
    assert f"experiments/{case}.toml" in out
    for word in named:
        assert word in out, (word, out)
    assert "Traceback" not in out
    assert not (tmp_path / "preregistrations" / f"{case}.json").exists()


def test_a_run_that_could_not_start_exits_nonzero_and_amendment_proceeds(tmp_path, tiny_model):
    """The model folder exists at registration and is gone at run time, so the engine cannot
    start. Contract: ``bistat run`` exits non-zero (the outcome is *untested*), no response is
    recorded, and ``bistat register --amend`` is then allowed (exit 0) because no response
    exists; the amended registration names the new model."""
    moved = tmp_path / "model-copy"
    shutil.copytree(tiny_model, moved)
    path = s.write_declaration(tmp_path, "gone", s.declaration("gone", str(moved)))
    rc, out = s.bistat("register", path, cwd=tmp_path)
    assert rc == 0, out
    shutil.rmtree(moved)
    rc, out = s.bistat("run", "preregistrations/gone.json", "--run-dir", "runs/gone", "--no-progress",
                       cwd=tmp_path)
    assert s.read_jsonl(tmp_path / "runs" / "gone" / "responses.jsonl") == []
    assert rc != 0, out
    s.write_declaration(tmp_path, "gone", s.declaration("gone", tiny_model))
    rc, out = s.bistat("register", path, "--amend", "--reason", "the model moved", cwd=tmp_path)
    assert rc == 0, out
    sealed = json.loads((tmp_path / "preregistrations" / "gone.json").read_text())["sealed"]
    assert sealed["declaration"]["engine"]["model"] == tiny_model
    assert [a["reason"] for a in sealed["amendments"]] == ["the model moved"]


# --------------------------------------------------------------------------------------------------
# a seal bound to evidence the user cannot rewrite


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env={**s.env(), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
                          ).stdout.strip()


@pytest.fixture
def git_project(tmp_path, tiny_model):
    """A git repository whose first commit holds the registration, then a run recorded after it
    (runs/ is not committed). Returns (root, sha of the registration's commit)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    path = s.write_declaration(root, "sealed", s.declaration("sealed", tiny_model))
    rc, out = s.bistat("register", path, cwd=root)
    assert rc == 0, out
    (root / ".gitignore").write_text("runs/\nfindings/\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "register sealed")
    sha = _git(root, "rev-parse", "HEAD")
    time.sleep(1.1)  # git times are whole seconds: the run's first record is strictly later
    rc, out = s.bistat("run", "preregistrations/sealed.json", "--run-dir", "runs/sealed", "--no-progress",
                       cwd=root)
    assert rc == 0, out
    return root, sha


def _forge(root: Path) -> None:
    """Loosen the sealed rule, recompute both hashes, keep the times, and point the run's
    ``run.json`` at the new seal (it is a plain file the same user can rewrite)."""
    def loosen(declaration: dict) -> None:
        declaration["rule"]["labels"][0]["all"][0]["at_least"] = 0.1

    reg = root / "preregistrations" / "sealed.json"
    s.reseal(reg, loosen)
    header_path = root / "runs" / "sealed" / "run.json"
    header = json.loads(header_path.read_text())
    header["registration"]["sha256"] = json.loads(reg.read_text())["sha256"]
    header_path.write_text(json.dumps(header, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def test_verify_reports_the_git_commit_that_first_holds_the_registration(git_project):
    """Contract for ``bistat verify REGISTRATION [RUN_DIR]``: besides the seal's integrity it
    prints which evidence of time holds. When the registration file is in a git repository and
    its current bytes are the blob of a commit, one line reads
    ``git: first committed in <full commit sha> at <committer time, ISO 8601 UTC>, before the
    run's first record`` and the exit code is 0. The finding (``bistat analyze``) carries the same
    ``git: first committed in <sha>`` line under the registration."""
    root, sha = git_project
    rc, out = s.bistat("verify", "preregistrations/sealed.json", "runs/sealed", cwd=root)
    assert rc == 0, out
    line = next((x for x in out.splitlines() if "git: first committed in" in x), None)
    assert line is not None, out
    assert sha in line and "before the run's first record" in line
    rc, out = s.bistat("analyze", "runs/sealed", "--out", "findings", cwd=root)
    assert rc == 0, out
    assert f"git: first committed in {sha}" in (root / "findings" / "sealed.md").read_text()


def test_a_forged_registration_fails_verify_against_git(git_project):
    """Contract: the registration's bytes differ from every blob git holds for its path, so
    ``bistat verify`` exits 1 and names the commit whose blob differs (``git: ... <sha>``) and
    says the file ``differs``; ``bistat analyze --registration`` with it exits 1 (it is not
    used as a sibling either)."""
    root, sha = git_project
    reg = root / "preregistrations" / "sealed.json"
    before = json.loads(reg.read_text())["sealed"]["registered_utc"]
    _forge(root)
    assert json.loads(reg.read_text())["sealed"]["registered_utc"] == before
    rc, out = s.bistat("verify", "preregistrations/sealed.json", "runs/sealed", cwd=root)
    assert rc == 1, out
    assert "git" in out and sha[:12] in out and "differs" in out, out
    rc, out = s.bistat("analyze", "runs/sealed", "--registration", "preregistrations/sealed.json",
                       "--out", "findings", cwd=root)
    assert rc == 1, out


def test_a_forgery_committed_after_the_run_fails_verify(git_project):
    """Contract: the first commit holding the registration's current blob must be older than
    the run's first record; a forgery committed after the run is refused (exit 1) with a line
    ``git: first committed in <sha> at <time>, after the run's first record``."""
    root, _ = git_project
    _forge(root)
    _git(root, "commit", "-q", "-am", "forge")
    forged = _git(root, "rev-parse", "HEAD")
    rc, out = s.bistat("verify", "preregistrations/sealed.json", "runs/sealed", cwd=root)
    assert rc == 1, out
    line = next((x for x in out.splitlines() if "git: first committed in" in x), "")
    assert forged in line and "after the run's first record" in line, out


def test_outside_git_verify_says_there_is_no_git_evidence(complete_run, tmp_path):
    """Contract: outside a git repository the seal is still checked (exit 0 when intact) and
    verify prints ``no git evidence`` so the reader knows only integrity is shown."""
    root = _copy_project(complete_run, tmp_path / "p")
    rc, out = s.bistat("verify", "preregistrations/full.json", "runs/full", cwd=root)
    assert rc == 0, out
    assert "no git evidence" in out


def test_amendment_is_refused_when_data_lives_outside_runs(tmp_path, tiny_model):
    """Contract: once ``bistat run`` has recorded a response for a registration, ``register
    --amend`` is refused (exit 1, "data has been recorded", naming the run directory) wherever
    the run was written; here ``--run-dir`` is outside the project and no ``--runs-dir`` is given."""
    root = tmp_path / "proj"
    root.mkdir()
    path = s.write_declaration(root, "far", s.declaration("far", tiny_model))
    rc, out = s.bistat("register", path, cwd=root)
    assert rc == 0, out
    far = tmp_path / "elsewhere" / "far-run"
    rc, out = s.bistat("run", "preregistrations/far.json", "--run-dir", str(far), "--no-progress", cwd=root)
    assert rc == 0, out
    assert s.read_jsonl(far / "responses.jsonl")
    s.write_declaration(root, "far", s.declaration("far", tiny_model).replace("at_least = 0.5", "at_least = 0.1"))
    rc, out = s.bistat("register", path, "--amend", "--reason", "looser", cwd=root)
    assert rc == 1, out
    assert "data has been recorded" in out and "far-run" in out


def test_amendment_is_refused_when_data_is_under_runs(complete_run, tmp_path):
    """Already holds: data under the default runs/ blocks an amendment."""
    root = _copy_project(complete_run, tmp_path / "p")
    (root / "experiments" / "full.toml").write_text(
        (root / "experiments" / "full.toml").read_text().replace("at_least = 0.5", "at_least = 0.1"))
    rc, out = s.bistat("register", "experiments/full.toml", "--amend", "--reason", "looser", cwd=root)
    assert rc == 1, out
    assert "data has been recorded for it (runs/full)" in out


# --------------------------------------------------------------------------------------------------
# stored data checked by content


def test_a_same_size_edit_after_compaction_is_reported(complete_run, tmp_path):
    """Contract: compaction records the JSONL's content hash; a reader that finds the JSONL's
    bytes changed (same size) reports it under "Data gaps" in the finding, naming
    ``responses.jsonl`` and the content hash (``sha256``) mismatch."""
    root = _copy_project(complete_run, tmp_path / "p")
    path = root / "runs" / "full" / "responses.jsonl"
    raw = path.read_bytes()
    size = len(raw)
    lines = raw.splitlines(True)
    mid = len(lines) // 2
    m = re.search(rb'"token_ids": ?\[(\d)', lines[mid])
    assert m
    digit = m.group(1)
    swapped = b"1" if digit != b"1" else b"2"
    lines[mid] = lines[mid][:m.start(1)] + swapped + lines[mid][m.end(1):]
    path.write_bytes(b"".join(lines))
    assert path.stat().st_size == size
    rc, out = s.bistat("analyze", "runs/full", "--out", "findings", cwd=root)
    finding = (root / "findings" / "full.md").read_text()
    gaps = finding[finding.index("## Data gaps"):]
    gaps = gaps[:gaps.index("\n---")]
    assert "None: every record line was readable" not in gaps
    assert "responses.jsonl" in gaps and "sha256" in gaps, gaps


# --------------------------------------------------------------------------------------------------
# bistat serve cancels work and bounds it


@pytest.fixture
def server(tmp_path, tiny_model):
    srv = s.Server(tiny_model, tmp_path / "serve.log", max_batch_size=2)
    yield srv
    srv.stop()


def _heavy_body(model: str, n: int = 64, max_tokens: int = 400) -> dict:
    return {"model": model, "prompt": [f"Tell me a long story number {i}." for i in range(n)],
            "max_tokens": max_tokens, "ignore_eos": True}


def _drained(srv: s.Server, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m.get("num_requests_running", 1) == 0 and m.get("num_requests_waiting", 1) == 0:
            return True
        time.sleep(0.1)
    return False


def test_a_disconnected_client_s_requests_are_cancelled(server, tiny_model):
    """Contract: within 3 s of the client closing its connection, the server's
    ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` are both 0. (64 prompts of
    400 tokens at batch 2 take far longer than that.)"""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=_heavy_body(tiny_model), timeout=1.0)
    assert _drained(server, 3.0), server.metrics()


def test_a_request_beyond_the_queue_bound_gets_429(server, tiny_model):
    """Contract: a request whose prompts would exceed the server's queue bound is answered at once
    with 429 (or 413, too large for one request) and an OpenAI-style JSON error; nothing of it
    is queued."""
    body = {"model": tiny_model, "prompt": [f"p{i}" for i in range(5000)], "max_tokens": 4}
    try:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=5)
    except httpx.TimeoutException:
        pytest.fail("5000 prompts were accepted and computed instead of refused")
    assert r.status_code in (413, 429), r.text[:300]
    assert r.json()["error"]["message"]
    assert _drained(server, 1.0)


def test_an_oversized_body_gets_413(server, tiny_model):
    """Contract: the server bounds request bodies at 8 MiB or less; a 9 MiB body gets 413 with an
    OpenAI-style JSON error, before it is parsed or tokenized."""
    body = json.dumps({"model": tiny_model, "prompt": "x" * (9 * 2**20), "max_tokens": 1})
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["message"]


def test_deeply_nested_json_gets_400(server):
    body = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_invalid_json_gets_400(server):
    """Already holds: malformed (not nested) JSON is a 400."""
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400


def test_sigterm_stops_within_a_few_seconds(server, tiny_model):
    """Contract: with a long request in flight, SIGTERM ends the process within 5 s."""
    import threading

    def client():
        try:
            httpx.post(server.url + "/v1/completions", json=_heavy_body(tiny_model, n=128), timeout=60)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=client, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while server.metrics().get("num_requests_running", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics().get("num_requests_running", 0) > 0
    t0 = time.monotonic()
    server.kill(signal.SIGTERM)
    try:
        server.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("bistat serve still running 5 s after SIGTERM")
    assert time.monotonic() - t0 <= 5


# --------------------------------------------------------------------------------------------------
# a full disk gets a message, not a traceback


def test_disk_full_gives_a_message_and_the_run_resumes(tmp_path, tiny_model):
    """Writes under the run directory fail with ENOSPC after 30 kB (injected with a
    ``sitecustomize`` on PYTHONPATH). Contract: ``bistat run`` exits 1 without a traceback and
    says, in its output, ``No space left`` / ``disk full``, ``kept N responses`` where N is the
    number of response records in responses.jsonl, the free space (``free`` and a size such as
    ``12.3 GiB``), and ``bistat run --resume RUN_DIR``. Every line written before stays
    parseable, and the resume (with space again) completes the schedule."""
    path = s.write_declaration(tmp_path, "disk", s.declaration("disk", tiny_model))
    rc, out = s.bistat("register", path, cwd=tmp_path)
    assert rc == 0, out
    run_dir = tmp_path / "runs" / "disk"
    run_dir.mkdir(parents=True)
    rc, out = s.bistat("run", "preregistrations/disk.json", "--run-dir", "runs/disk", "--no-progress",
                       cwd=tmp_path, extra_env=s.enospc_env(tmp_path / "site", run_dir, 30_000))
    assert rc == 1, out
    assert "Traceback" not in out, out[-3000:]
    assert re.search(r"no space left|disk (is )?full", out, re.I), out
    kept = len(s.read_jsonl(run_dir / "responses.jsonl"))
    assert 0 < kept < 48
    assert re.search(rf"kept {kept} response", out), out
    assert re.search(r"free[^\n]*\d+(\.\d+)? ?(bytes|B|KiB|MiB|GiB|TiB|kB|MB|GB|TB)\b", out), out
    assert "bistat run --resume runs/disk" in out
    for table in run_dir.glob("*.jsonl"):
        for line in table.read_text().splitlines():
            json.loads(line)
    rc, out = s.bistat("run", "--resume", "runs/disk", "--no-progress", cwd=tmp_path)
    assert rc == 0, out
    assert _counted_ends(run_dir)[("blas", "complete")] == 3


# --------------------------------------------------------------------------------------------------
# the CLI: what --help imports, what run advises, the declaration reference


def test_help_does_not_import_scipy_or_statsmodels(tmp_path):
    """Not a timing test: ``python -X importtime -m bistat --help`` must not import scipy or
    statsmodels (they load where they are used)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "bistat", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, env=s.env(), timeout=120)
    assert proc.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "bistat" in imported
    assert not imported & {"scipy", "statsmodels"}, sorted(imported & {"scipy", "statsmodels"})


def test_run_on_a_declaration_says_register_it_first(tmp_path, tiny_model):
    path = s.write_declaration(tmp_path, "decl", s.declaration("decl", tiny_model))
    rc, out = s.bistat("run", path, cwd=tmp_path)
    assert rc == 1, out
    assert "register it first: bistat register experiments/decl.toml" in out
    assert "not a readable registration" not in out


def test_a_declaration_reference_is_generated_and_linked():
    """Contract: ``docs/DECLARATION.md`` is the declaration reference, generated (by cog, like
    docs/CLI.md: it holds ``[[[cog`` markers) from the pydantic models, with every section and
    the workload's fields; the README links to it."""
    root = Path(__file__).resolve().parents[1]
    ref = root / "docs" / "DECLARATION.md"
    assert ref.exists()
    text = ref.read_text()
    assert "[[[cog" in text
    for field in ("engine", "arms", "workload", "rule", "validity", "match", "design", "n_prompts",
                  "max_tokens", "concurrency", "passes", "warmup_passes", "order", "seed", "retries",
                  "gemm"):
        assert re.search(rf"\b{field}\b", text), field
    assert "docs/DECLARATION.md" in (root / "README.md").read_text()


# --------------------------------------------------------------------------------------------------
# smaller points


def test_serve_port_0_prints_the_bound_port(tmp_path, tiny_model):
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "bistat", "serve", "--model", tiny_model,
                                 "--port", "0"], stdout=fh, stderr=subprocess.STDOUT, env=s.env())
    try:
        deadline = time.monotonic() + 60
        m = None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        assert m, log.read_text()
        port = int(m.group(1))
        assert port > 0, log.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_register_and_design_apply_one_name_rule(tmp_path, tiny_model):
    """Contract chosen: one rule, register's: both commands refuse a declaration whose ``name``
    differs from its file name, exit 1, with the same message naming the file and ``name``."""
    path = s.write_declaration(tmp_path, "file-name", s.declaration("other-name", tiny_model))
    rc_r, out_r = s.bistat("register", path, cwd=tmp_path)
    rc_d, out_d = s.bistat("design", path, cwd=tmp_path)
    expected = "experiments/file-name.toml: name: 'other-name' differs from the file name 'file-name'"
    assert (rc_r, rc_d) == (1, 1), (out_r, out_d)
    assert expected in out_r and expected in out_d


def test_an_unknown_request_field_is_refused_every_time_without_flooding_the_log(server,
                                                                                tiny_model):
    """A field bistat serve does not implement is refused (ignoring it would change what is
    measured), with a 400 that names it, on every request; the log does not repeat it."""
    for _ in range(101):
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": tiny_model, "prompt": "hi", "max_tokens": 1, "foo_bar": 1},
                       timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "foo_bar"
        assert "unknown field 'foo_bar'" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": tiny_model, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200
    server.stop()
    assert server.log_text().count("foo_bar") <= 1, server.log_text()[-2000:]
