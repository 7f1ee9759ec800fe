"""scripts/device/run_bg.sh: a study in the background, watched call by call, and stopped cleanly.

On 2026-12-03 a study that could not finish in the session had to be stopped by hand; a `pkill -f`
of a pattern in the call's own command line killed the call itself. `run_bg.sh --stop` sends
SIGINT to `bistat run` alone, so it records the pass in flight as interrupted and stops its
engines, and the data stay for `pack.sh`. These tests run the script in a throw-away copy whose
`bistat` is a stand-in module (no GPU, no vLLM).

Every watching call and `--stop` end with an incremental snapshot (`snap.py`): on 2026-12-03
(fifth session) a whole-run snapshot of 96 passes was 104 MB, over the 16 MiB a returned file may
have, and compressing it ran the call into its 600 s limit. `unsnap.py` rebuilds the run here.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("pgrep") is None
                                or sys.platform != "linux", reason="needs bash, pgrep and Linux")

# A stand-in `bistat run`: records a pass (appends it to passes.jsonl), then prints its line; pass 1
# at once, each later pass only once the test allows it (`_allow`: the file passes.allowed holds the
# highest pass it may record), so what a call sees depends on what the test did, never on how fast
# this machine is. On SIGINT (KeyboardInterrupt) it records the pass in flight as interrupted, as
# bistat's runner does, and exits 130. Options in the registration: --ignore-sigint;
# --rewrite-run-json (run.json rewritten in place each pass, as no bistat file is: snapshots must
# send it whole); --blob (a 500 KB incompressible file at the start: snapshots in several parts);
# --finish-after-3 (three passes, then exit 0).
FAKE_CLI = '''
import os, sys, time
from pathlib import Path

def allowed():
    try:
        return int(Path("passes.allowed").read_text())
    except (FileNotFoundError, ValueError):
        return 1

def probe():
    # a stand-in `bistat probe`: its report names the arguments it was given
    import json
    out = Path(sys.argv[sys.argv.index("--output") + 1])
    out.write_text(json.dumps({"argv": sys.argv[1:]}))
    print("probe: confirmed", flush=True)

def main():
    if sys.argv[1] == "probe":
        return probe()
    run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text("{}")
    options = Path("preregistrations/fake.json").read_text()
    if "--ignore-sigint" in options:
        import signal
        signal.signal(signal.SIGINT, lambda *a: None)
    if "--blob" in options:
        (run_dir / "blob.bin").write_bytes(os.urandom(500_000))
    last = 600
    if "--finish-after-3" in options:
        last = 3
    try:
        for i in range(last):
            while allowed() < i + 1:
                time.sleep(0.05)
            with open(run_dir / "passes.jsonl", "a") as f:
                f.write('{"status": "complete", "pass": %d}\\n' % (i + 1))
            if "--rewrite-run-json" in options:
                (run_dir / "run.json").write_text('{"passes": %d}' % (i + 1))
            print(f"pass {i + 1}/{last} counted", flush=True)
    except KeyboardInterrupt:
        with open(run_dir / "passes.jsonl", "a") as f:
            f.write('{"status": "interrupted"}\\n')
        print("run stopped: interrupted; data kept", flush=True)
        sys.exit(130)
    print("run complete", flush=True)
'''


def _make_repo(r: Path) -> Path:
    """A throw-away copy at ``r``: the scripts, and a stand-in ``bistat`` with one registration."""
    (r / "scripts" / "device").mkdir(parents=True)
    for name in ("run_bg.sh", "env.sh", "snap.py"):
        shutil.copy(ROOT / "scripts" / "device" / name, r / "scripts" / "device" / name)
    (r / "src" / "bistat").mkdir(parents=True)
    (r / "src" / "bistat" / "__init__.py").write_text("")
    (r / "src" / "bistat" / "cli.py").write_text(FAKE_CLI)
    (r / "preregistrations").mkdir()
    (r / "preregistrations" / "fake.json").write_text("{}")
    return r


@pytest.fixture
def repo(tmp_path):
    r = _make_repo(tmp_path / "repo")
    yield r
    pid = r / "runs" / "fake.pid"          # a test that failed before its --stop: end its run
    if pid.is_file():
        try:
            os.killpg(int(pid.read_text()), 9)
        except (ProcessLookupError, ValueError):
            pass


def _run_bg(repo: Path, *args: str, timeout: float = 120, out: str = "out",
            **env_extra: str) -> subprocess.CompletedProcess:
    """One call of run_bg.sh; ``out`` is its $OUT under ``repo`` (the device empties $OUT before
    each call: give each call its own to keep what each brought back). No snapshot reserve unless
    SNAP_RESERVE_S is given: a call of 2 s then watches 2 s. A call that is to come back with
    the run still going waits on an event, WATCH_UNTIL (a line of the log), within a budget far
    beyond it (`_watch`): what it brings back does not depend on how busy the machine is."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REPO", "PYTHONPATH", "OUT") and not k.startswith("SNAP_")}
    env.update(OUT=str(repo / out), VLLM_PAYLOAD="0.25", SITE_LATEST=str(repo / "site"),
               **{"SNAP_RESERVE_S": "0", **env_extra})
    return subprocess.run(["bash", "scripts/device/run_bg.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _unsnap(dest: Path, *sources: Path) -> subprocess.CompletedProcess:
    """unsnap.py as it runs here: without bistat (-S: no site-packages, -E: no PYTHONPATH)."""
    script = ROOT / "scripts" / "device" / "unsnap.py"
    return subprocess.run([sys.executable, "-S", "-E", str(script), str(dest), *map(str, sources)],
                          capture_output=True, text=True, timeout=60)


def _snapshot(out: Path, name: str = "fake") -> tuple[dict, dict[str, bytes], list[Path]]:
    """The one snapshot in ``out``: its manifest, its data members by path, and its parts."""
    parts = sorted(out.glob(f"{name}.snap-*.tgz.[0-9][0-9]"))
    assert parts and len({p.name[:-3] for p in parts}) == 1, sorted(out.iterdir())
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        data = {m.name[len("data/"):]: tar.extractfile(m).read() for m in tar.getmembers()
                if m.name.startswith("data/")}
    return manifest, data, parts


def _entries(manifest: dict) -> dict[str, dict]:
    return {e["path"]: e for e in manifest["files"]}


def _tree(root: Path, name: str = "fake") -> dict[str, bytes]:
    """Every file of root/NAME and root/NAME.log, by path relative to root."""
    files = {str(p.relative_to(root)): p.read_bytes()
             for p in (root / name).rglob("*") if p.is_file()}
    files[f"{name}.log"] = (root / f"{name}.log").read_bytes()
    return files


def _watch(repo: Path, until: str, out: str, **env_extra: str) -> subprocess.CompletedProcess:
    """A watching call that comes back once the log says ``until`` (the run still going)."""
    return _run_bg(repo, "fake", "100", out=out, WATCH_UNTIL=until, **env_extra)


def _allow(repo: Path, last_pass: int) -> None:
    """Let the stand-in run record its passes up to ``last_pass`` (written whole, then renamed)."""
    tmp = repo / "passes.allowed.tmp"
    tmp.write_text(str(last_pass))
    tmp.rename(repo / "passes.allowed")


def _wait_for(path: Path, text: str, seconds: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} never said {text!r}")


def test_stop_interrupts_bistat_run_keeps_its_data_and_leaves_nothing_running(repo):
    started = _watch(repo, "pass 1/600", out="out1")
    assert started.returncode == 3, started.stdout + started.stderr   # still running
    assert "[bg] starting" in started.stdout and "pass 1/600" in started.stdout
    log = repo / "runs" / "fake.log"
    _allow(repo, 3)
    _wait_for(log, "pass 3/600")
    group = int((repo / "runs" / "fake.pid").read_text())

    stopped = _run_bg(repo, "--stop", "fake", "20", out="out2")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "SIGINT to bistat run" in stopped.stdout
    assert "run stopped: interrupted; data kept" in stopped.stdout      # the log's tail
    assert '"status": 130' in stopped.stdout                           # the wrapper's record
    assert "did not stop" not in stopped.stdout
    passes = (repo / "runs" / "fake" / "passes.jsonl").read_text().splitlines()
    assert passes[-1] == '{"status": "interrupted"}' and len(passes) == 4
    # the stopped run's snapshot, its second, holds the passes since the first, the interrupted
    # one last; the two rebuild every pass
    assert "[bg] snapshot 2: $OUT/fake.snap-002.tgz.* (1 part(s)," in stopped.stdout
    manifest, data, _ = _snapshot(repo / "out2")
    assert data["fake/passes.jsonl"].decode().splitlines()[-1] == '{"status": "interrupted"}'
    assert _unsnap(repo / "here", repo / "out1", repo / "out2").returncode == 0
    assert (repo / "here" / "fake" / "passes.jsonl").read_text().splitlines() == passes
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)                                             # nothing of it is left
    # stopping again is harmless
    again = _run_bg(repo, "--stop", "fake")
    assert again.returncode == 0 and "is not running" in again.stdout


def test_a_run_alive_without_its_pid_file_gets_no_twin_and_another_copy_is_not_it(repo, tmp_path):
    """A run of this copy whose pid file was lost (its runs/ wiped between calls) is found by its
    command line and no second run is started into its path; a run of another copy of the
    repository (another session's, on the same machine) does not stop this one's start."""
    assert _watch(repo, "pass 1/600", out="c1").returncode == 3
    pid_file = repo / "runs" / "fake.pid"
    group = pid_file.read_text()
    pid_file.unlink()
    refused = _run_bg(repo, "fake", "5", out="c2")
    assert refused.returncode == 1
    assert refused.stdout.startswith("run_bg: not starting fake: a bistat run is alive (FORCE=1 "
                                     "starts anyway):\n")
    assert f" {repo}/runs/fake " in refused.stdout
    other = _make_repo(tmp_path / "other")
    try:
        started = _watch(other, "pass 1/600", out="c3")
        assert started.returncode == 3, started.stdout + started.stderr
        assert "[bg] starting" in started.stdout
    finally:
        assert _run_bg(other, "--stop", "fake", "20", out="c4").returncode == 0
    pid_file.write_text(group)
    assert _run_bg(repo, "--stop", "fake", "20", out="c5").returncode == 0


def test_stop_kills_the_process_group_when_sigint_is_ignored(repo):
    (repo / "preregistrations" / "fake.json").write_text('{"x": "--ignore-sigint"}')
    assert _watch(repo, "pass 1/600", out="c1").returncode == 3
    _allow(repo, 2)
    _wait_for(repo / "runs" / "fake.log", "pass 2/600")
    group = int((repo / "runs" / "fake.pid").read_text())
    stopped = _run_bg(repo, "--stop", "fake", "2")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "did not stop within 2 s: SIGTERM, then SIGKILL, to its process group" in stopped.stdout
    assert "no status (killed)" in stopped.stdout
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    assert (repo / "runs" / "fake" / "passes.jsonl").read_text().count("complete") == 2


def test_snapshots_carry_only_new_bytes_and_unsnap_rebuilds_the_run_byte_for_byte(repo):
    _allow(repo, 2)
    first = _watch(repo, "pass 2/600", out="c1")
    assert first.returncode == 3, first.stdout + first.stderr
    assert "[bg] snapshot 1: $OUT/fake.snap-001.tgz.* (1 part(s)," in first.stdout
    assert sorted(p.name for p in (repo / "c1").iterdir()) == ["fake.snap-001.tgz.00",
                                                                "fake.snap-001.tgz.sha256"]
    m1, d1, _ = _snapshot(repo / "c1")
    e1 = _entries(m1)
    assert (m1["run"], m1["snapshot"]) == ("fake", 1)
    assert set(e1) == {"fake/run.json", "fake/passes.jsonl", "fake.log"}
    assert all(e["mode"] == "whole" and e["offset"] == 0 for e in e1.values())
    passes1 = d1["fake/passes.jsonl"]
    assert len(passes1.splitlines()) == 2 and e1["fake/passes.jsonl"]["length"] == len(passes1)
    assert f"new bytes {m1['new_bytes']} of {m1['recorded_bytes']} recorded" in first.stdout

    _allow(repo, 4)
    second = _watch(repo, "pass 4/600", out="c2")
    assert second.returncode == 3, second.stdout + second.stderr
    m2, d2, _ = _snapshot(repo / "c2")
    e2 = _entries(m2)
    assert m2["snapshot"] == 2 and m2["series"] == m1["series"]
    # passes.jsonl: only the lines since snapshot 1, appended at the size it had then
    assert e2["fake/passes.jsonl"]["mode"] == "append"
    assert e2["fake/passes.jsonl"]["offset"] == len(passes1)
    new = d2["fake/passes.jsonl"].decode().splitlines()
    assert new and e2["fake/passes.jsonl"]["length"] == len(d2["fake/passes.jsonl"])
    before = {json.loads(line)["pass"] for line in passes1.decode().splitlines()}
    assert [json.loads(line)["pass"] for line in new] == [3, 4] and before == {1, 2}
    # run.json unchanged: listed with its hash, no bytes sent
    assert e2["fake/run.json"] == {**e1["fake/run.json"], "mode": "append", "offset": 2,
                                   "length": 0}
    assert "fake/run.json" not in d2
    assert m2["new_bytes"] == sum(len(b) for b in d2.values())

    stopped = _run_bg(repo, "--stop", "fake", "20", out="c3")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    m3, d3, _ = _snapshot(repo / "c3")
    e3 = _entries(m3)
    assert e3["fake/passes.jsonl"]["offset"] == e2["fake/passes.jsonl"]["size"]
    assert d3["fake/passes.jsonl"].decode().splitlines()[-1] == '{"status": "interrupted"}'
    assert e3["fake.log"]["mode"] == "append" and e3["fake.log"]["offset"] == e2["fake.log"]["size"]
    assert f"{m3['passes']} passes recorded" in stopped.stdout
    assert m3["passes"] == len((repo / "runs" / "fake" / "passes.jsonl").read_text().splitlines())

    here = repo / "here"
    rebuilt = _unsnap(here, repo / "c3", repo / "c1", repo / "c2")          # any order
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "from snapshots 1-3: 3 files" in rebuilt.stdout and "last snapshot 3" in rebuilt.stdout
    assert _tree(here) == _tree(repo / "runs")
    # the same snapshots again: a no-op that says so
    again = _unsnap(here, repo / "c1", repo / "c2", repo / "c3")
    assert again.returncode == 0, again.stderr
    assert "up to date at snapshot 3; nothing applied (no-op)" in again.stdout
    assert _tree(here) == _tree(repo / "runs")


def test_a_run_that_finished_between_calls_still_sends_what_it_recorded_since(repo):
    """The run ends after the first call's snapshot and before the next call: the next call
    finds it finished, and its snapshot carries the passes since; nothing is started again."""
    (repo / "preregistrations" / "fake.json").write_text('{"options": "--finish-after-3"}')
    first = _watch(repo, "pass 1/3", out="c1")
    assert first.returncode == 3, first.stdout + first.stderr
    m1, d1, _ = _snapshot(repo / "c1")
    assert len(d1["fake/passes.jsonl"].splitlines()) == 1
    _allow(repo, 3)
    _wait_for(repo / "runs" / "fake.status", '"status": 0')
    second = _run_bg(repo, "fake", "5", out="c2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "[bg] fake already finished" in second.stdout and "run complete" in second.stdout
    m2, d2, _ = _snapshot(repo / "c2")
    assert m2["snapshot"] == 2 and m2["passes"] == 3
    assert _entries(m2)["fake/passes.jsonl"]["offset"] == len(d1["fake/passes.jsonl"])
    here = repo / "here"
    rebuilt = _unsnap(here, repo / "c1", repo / "c2")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert _tree(here) == _tree(repo / "runs")
    assert len((here / "fake" / "passes.jsonl").read_text().splitlines()) == 3
    assert (repo / "runs" / "fake.log").read_text().count("pass 1/3 counted") == 1  # not rerun


def test_a_rewritten_file_goes_whole_and_is_rebuilt_right(repo):
    (repo / "preregistrations" / "fake.json").write_text('{"x": "--rewrite-run-json"}')
    assert _watch(repo, "pass 1/600", out="c1").returncode == 3
    run_json = repo / "runs" / "fake" / "run.json"
    m1, d1, _ = _snapshot(repo / "c1")
    assert d1["fake/run.json"] == b'{"passes": 1}'
    _allow(repo, 2)
    _wait_for(run_json, '"passes": 2')
    assert _run_bg(repo, "--stop", "fake", "20", out="c2").returncode == 0
    m2, d2, _ = _snapshot(repo / "c2")
    e = _entries(m2)["fake/run.json"]
    assert e["mode"] == "whole" and e["offset"] == 0 and e["length"] == len(run_json.read_bytes())
    assert d2["fake/run.json"] == run_json.read_bytes() != d1["fake/run.json"]
    assert _unsnap(repo / "here", repo / "c1", repo / "c2").returncode == 0
    assert _tree(repo / "here") == _tree(repo / "runs")


def test_a_large_snapshot_comes_in_parts_and_is_rebuilt_from_them(repo):
    (repo / "preregistrations" / "fake.json").write_text('{"x": "--blob"}')
    first = _watch(repo, "pass 1/600", out="c1", SNAP_PART_BYTES="200000")
    assert first.returncode == 3, first.stdout + first.stderr
    assert "[bg] snapshot 1: $OUT/fake.snap-001.tgz.* (3 part(s)," in first.stdout
    parts = sorted((repo / "c1").glob("fake.snap-001.tgz.[0-9][0-9]"))
    assert [p.stat().st_size for p in parts][:2] == [200000, 200000]
    assert 100000 < parts[2].stat().st_size <= 200000                      # 500 KB of noise
    sums = (repo / "c1" / "fake.snap-001.tgz.sha256").read_text().split()
    assert sums[1::2] == ["fake.snap-001.tgz"] + [p.name for p in parts]
    _, data, _ = _snapshot(repo / "c1")
    assert data["fake/blob.bin"] == (repo / "runs" / "fake" / "blob.bin").read_bytes()
    assert _run_bg(repo, "--stop", "fake", "20", out="c2").returncode == 0
    assert _unsnap(repo / "here", repo / "c1", repo / "c2").returncode == 0
    assert _tree(repo / "here") == _tree(repo / "runs")


def test_parts_beyond_what_a_call_brings_back_are_resent(repo):
    (repo / "preregistrations" / "fake.json").write_text('{"x": "--blob"}')
    first = _watch(repo, "pass 1/600", out="c1", SNAP_PART_BYTES="90000")
    assert first.returncode == 3, first.stdout + first.stderr
    assert "(6 part(s)," in first.stdout
    assert "$OUT has parts 00-03; get the rest, 4 a call, with: bash scripts/device/run_bg.sh" \
           " --resend fake 4 1" in first.stdout
    assert len(list((repo / "c1").iterdir())) == 5                          # 4 parts, .sha256
    refused = _unsnap(repo / "here", repo / "c1")
    assert refused.returncode == 1 and "part fake.snap-001.tgz.04 is missing" in refused.stderr
    resent = _run_bg(repo, "--resend", "fake", "4", out="c2")
    assert resent.returncode == 0, resent.stdout + resent.stderr
    assert sorted(p.name for p in (repo / "c2").iterdir()) == [
        "fake.snap-001.tgz.04", "fake.snap-001.tgz.05", "fake.snap-001.tgz.sha256"]
    assert _run_bg(repo, "--stop", "fake", "20", out="c3").returncode == 0
    rebuilt = _unsnap(repo / "here", repo / "c1", repo / "c2", repo / "c3")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert _tree(repo / "here") == _tree(repo / "runs")


def _snap_py(repo: Path, out: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["python3", "-E", "scripts/device/snap.py", "make", "runs", "fake", out],
                          cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SNAP_PART_BYTES": "1500", **env})


@pytest.fixture
def three_snapshots(repo):
    """Snapshots 1-3 of a run written here by hand (snap.py alone), snapshot 2 in 3 parts."""
    run = repo / "runs" / "fake"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "passes.jsonl").write_text('{"pass": 1}\n')
    (repo / "runs" / "fake.log").write_text("pass 1\n")
    assert _snap_py(repo, "c1").returncode == 0
    with open(run / "passes.jsonl", "a") as f:
        f.write('{"pass": 2}\n')
    (run / "noise.bin").write_bytes(os.urandom(2500))
    assert "(3 part(s)," in _snap_py(repo, "c2").stdout
    with open(run / "passes.jsonl", "a") as f:
        f.write('{"pass": 3}\n')
    (run / "noise.bin").unlink()
    assert _snap_py(repo, "c3").returncode == 0
    assert _entries(_snapshot(repo / "c3")[0])["fake/noise.bin"] == {"path": "fake/noise.bin",
                                                                     "mode": "deleted"}
    return repo


def test_unsnap_refuses_a_missing_snapshot_a_missing_part_and_a_corrupted_part(three_snapshots):
    repo = three_snapshots
    c1, c2, c3 = repo / "c1", repo / "c2", repo / "c3"
    gap = _unsnap(repo / "d1", c1, c3)
    assert gap.returncode == 1
    assert "fake snapshot 2 is missing (found [1, 3]" in gap.stderr
    assert not (repo / "d1" / "fake" / "passes.jsonl").exists() or \
        (repo / "d1" / "fake" / "passes.jsonl").read_text() == '{"pass": 1}\n'

    (c2 / "fake.snap-002.tgz.01").rename(repo / "part01")
    missing = _unsnap(repo / "d2", c1, c2, c3)
    assert missing.returncode == 1
    assert "fake snapshot 2: part fake.snap-002.tgz.01 is missing (3 part(s))" in missing.stderr
    assert "--resend fake 1 2" in missing.stderr

    bad = bytearray((repo / "part01").read_bytes())
    bad[10] ^= 0xFF
    (c2 / "fake.snap-002.tgz.01").write_bytes(bytes(bad))
    corrupt = _unsnap(repo / "d3", c1, c2, c3)
    assert corrupt.returncode == 1
    assert "fake snapshot 2: part fake.snap-002.tgz.01 fails its sha256" in corrupt.stderr
    # snapshot 1 was applied, nothing of snapshot 2: the good part, given later, completes it
    assert (repo / "d3" / "fake" / "passes.jsonl").read_text() == '{"pass": 1}\n'
    (repo / "resent").mkdir()                             # a later call's copy of the part
    (repo / "part01").rename(repo / "resent" / "fake.snap-002.tgz.01")
    good = _unsnap(repo / "d3", c1, c2, c3, repo / "resent")
    assert good.returncode == 0, good.stderr
    assert "from snapshots 2-3" in good.stdout
    assert _tree(repo / "d3") == _tree(repo / "runs")
    assert not (repo / "d3" / "fake" / "noise.bin").exists()


def test_unsnap_refuses_an_append_at_the_wrong_offset(three_snapshots):
    repo = three_snapshots
    assert _unsnap(repo / "d", repo / "c1").returncode == 0
    with open(repo / "d" / "fake" / "passes.jsonl", "a") as f:
        f.write("edited here\n")
    refused = _unsnap(repo / "d", repo / "c1", repo / "c2")
    assert refused.returncode == 1
    assert "fake snapshot 2: fake/passes.jsonl: appends at offset 12, but" in refused.stderr
    assert "has 24 bytes" in refused.stderr


def test_a_snapshot_cut_short_loses_nothing(repo):
    assert _watch(repo, "pass 1/600", out="c1").returncode == 3
    m1, d1, _ = _snapshot(repo / "c1")
    _allow(repo, 2)
    cut = _watch(repo, "pass 2/600", out="c2", SNAP_TEST_DIE_BEFORE_STATE="1")
    assert cut.returncode == 3, cut.stdout + cut.stderr
    assert ("[bg] snapshot of fake failed (the next one carries its data); the run goes on"
            in cut.stdout)
    assert not any((repo / "c2").iterdir())               # nothing of it came back
    state = json.loads((repo / "runs" / "fake.snapshots" / "state.json").read_text())
    assert state["snapshot"] == 1                         # the state did not advance
    assert _run_bg(repo, "--stop", "fake", "20", out="c3").returncode == 0
    m2, d2, _ = _snapshot(repo / "c3")
    e = _entries(m2)["fake/passes.jsonl"]
    assert m2["snapshot"] == 2 and e["offset"] == len(d1["fake/passes.jsonl"])
    assert d1["fake/passes.jsonl"] + d2["fake/passes.jsonl"] == \
        (repo / "runs" / "fake" / "passes.jsonl").read_bytes()
    assert _unsnap(repo / "here", repo / "c1", repo / "c2", repo / "c3").returncode == 0
    assert _tree(repo / "here") == _tree(repo / "runs")


def test_the_snapshot_reserve_shortens_the_watch(repo):
    """A call of 600 s with 598 s kept for its snapshot watches 2 s: without the reserve it would
    run into the test's limit of 120 s. (Its snapshot may be empty: the run need not have begun
    recording within 2 s on a busy machine.)"""
    t0 = time.monotonic()
    call = _run_bg(repo, "fake", "600", out="c1", SNAP_RESERVE_S="598")
    elapsed = time.monotonic() - t0
    assert call.returncode == 3, call.stdout + call.stderr
    assert "still running after this call's 600 s" in call.stdout
    assert elapsed >= 1
    assert _run_bg(repo, "--stop", "fake", "20", out="c2").returncode == 0


def test_a_wrapper_left_as_a_zombie_counts_as_ended(repo):
    """A wrapper that exited without writing its status and that nothing reaped stays a zombie,
    which ``kill -0`` still finds: read as alive, every later call would watch a dead run until
    its time ran out. Here the zombie is a child of this test, left unreaped on purpose."""
    zombie = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{zombie.pid}/stat")
        t0 = time.monotonic()
        while " Z " not in stat.read_text() and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert " Z " in stat.read_text()                  # exited, not reaped
        (repo / "runs").mkdir()
        (repo / "runs" / "fake.pid").write_text(str(zombie.pid))
        os.kill(zombie.pid, 0)                            # what kill -0 alone would call alive
        stop = _run_bg(repo, "--stop", "fake", "2", out="c1")
        assert stop.returncode == 0 and "[bg] fake is not running" in stop.stdout, stop.stdout
        watched = _watch(repo, "pass 1/600", out="c2")
        assert watched.returncode == 3, watched.stdout + watched.stderr
        assert "[bg] starting" in watched.stdout          # a new run, not a watch of the dead one
        assert int((repo / "runs" / "fake.pid").read_text()) != zombie.pid
        assert _run_bg(repo, "--stop", "fake", "20", out="c3").returncode == 0
    finally:
        zombie.wait()


def test_probe_mode_runs_the_probe_in_the_background_with_the_needle_from_the_run(repo):
    """PROBE=1: `bistat probe` of the study's arms in the background (a probe of four SGLang arms
    outlasts a call), its needle from the study's run where that run was brought along, its report
    and log returned by every call instead of a snapshot; PROBE_PART and PROBE_ARGS probe one more
    arm into probe-ARM.json (which merges with probe.json), under files of its own."""
    run = repo / "runs" / "fake"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")          # the committed run, copied in on the device
    done = _run_bg(repo, "fake", "30", PROBE="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[bg] fake finished" in done.stdout and "probe: confirmed" in done.stdout
    report = json.loads((repo / "out" / "fake.probe.json").read_text())
    argv = report["argv"]
    assert argv[:2] == ["probe", "preregistrations/fake.json"]
    assert argv[argv.index("--output") + 1] == str(run / "probe.json")
    assert argv[argv.index("--needle-from") + 1] == str(run)
    assert (repo / "out" / "fake.probe.log").is_file()
    assert not list((repo / "out").glob("fake.snap-*")), "a probe call sends no snapshot"
    assert not (repo / "runs" / "fake.status").exists(), "the study's own files are untouched"

    part = _run_bg(repo, "fake", "30", out="out2", PROBE="1", PROBE_PART="det",
                   PROBE_ARGS="--arm det --no-control")
    assert part.returncode == 0, part.stdout + part.stderr
    argv = json.loads((repo / "out2" / "fake.probe-det.json").read_text())["argv"]
    assert argv[argv.index("--output") + 1] == str(run / "probe-det.json")
    assert argv[argv.index("--arm") + 1] == "det" and "--no-control" in argv
    assert json.loads((run / "probe.json").read_text())["argv"] != argv


def test_probe_mode_without_a_run_uses_the_declared_needle(repo):
    done = _run_bg(repo, "fake", "30", PROBE="1")
    assert done.returncode == 0, done.stdout + done.stderr
    argv = json.loads((repo / "out" / "fake.probe.json").read_text())["argv"]
    assert "--needle-from" not in argv
