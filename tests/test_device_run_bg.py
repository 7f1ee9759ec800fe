"""scripts/device/run_bg.sh: a study in the background, watched call by call, and stopped cleanly.

On 2026-12-03 a study that could not finish in the session had to be stopped by hand; a `pkill -f`
of a pattern in the call's own command line killed the call itself. `run_bg.sh --stop` sends
SIGINT to `bistat run` alone, so it records the pass in flight as interrupted and stops its
engines, and the data stay for `pack.sh`. These tests run the script in a throw-away copy whose
`bistat` is a stand-in module (no GPU, no vLLM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("pgrep") is None
                                or sys.platform != "linux", reason="needs bash, pgrep and Linux")

# A stand-in `bistat run`: prints a pass line a second; on SIGINT (KeyboardInterrupt) it records
# the pass in flight as interrupted, as bistat's runner does, and exits 130.
FAKE_CLI = '''
import sys, time
from pathlib import Path

def main():
    run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text("{}")
    ignore = "--ignore-sigint" in Path("preregistrations/fake.json").read_text()
    if ignore:
        import signal
        signal.signal(signal.SIGINT, lambda *a: None)
    try:
        for i in range(600):
            print(f"pass {i + 1}/600 counted", flush=True)
            with open(run_dir / "passes.jsonl", "a") as f:
                f.write('{"status": "complete"}\\n')
            time.sleep(1)
    except KeyboardInterrupt:
        with open(run_dir / "passes.jsonl", "a") as f:
            f.write('{"status": "interrupted"}\\n')
        print("run stopped: interrupted; data kept", flush=True)
        sys.exit(130)
'''


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "scripts" / "device").mkdir(parents=True)
    for name in ("run_bg.sh", "env.sh"):
        shutil.copy(ROOT / "scripts" / "device" / name, r / "scripts" / "device" / name)
    (r / "src" / "bistat").mkdir(parents=True)
    (r / "src" / "bistat" / "__init__.py").write_text("")
    (r / "src" / "bistat" / "cli.py").write_text(FAKE_CLI)
    (r / "preregistrations").mkdir()
    (r / "preregistrations" / "fake.json").write_text("{}")
    return r


def _run_bg(repo: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REPO", "PYTHONPATH", "OUT")}
    env.update(OUT=str(repo / "out"), VLLM_PAYLOAD="0.25", SITE_LATEST=str(repo / "site"))
    return subprocess.run(["bash", "scripts/device/run_bg.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _wait_for(path: Path, text: str, seconds: float = 20) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} never said {text!r}")


def test_stop_interrupts_bistat_run_keeps_its_data_and_leaves_nothing_running(repo):
    started = _run_bg(repo, "fake", "2")
    assert started.returncode == 3, started.stdout + started.stderr   # still running
    assert "[bg] starting" in started.stdout and "pass 1/600" in started.stdout
    log = repo / "runs" / "fake.log"
    _wait_for(log, "pass 3/600")
    group = int((repo / "runs" / "fake.pid").read_text())

    stopped = _run_bg(repo, "--stop", "fake", "20")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "SIGINT to bistat run" in stopped.stdout
    assert "run stopped: interrupted; data kept" in stopped.stdout      # the log's tail
    assert '"status": 130' in stopped.stdout                           # the wrapper's record
    assert "did not stop" not in stopped.stdout
    passes = (repo / "runs" / "fake" / "passes.jsonl").read_text().splitlines()
    assert passes[-1] == '{"status": "interrupted"}' and len(passes) >= 4
    # the stopped run's snapshot in $OUT holds every pass, the interrupted one last
    import tarfile

    assert "[bg] snapshot: $OUT/fake.partial.tar.xz" in stopped.stdout
    with tarfile.open(repo / "out" / "fake.partial.tar.xz") as tar:
        assert tar.extractfile("fake/passes.jsonl").read().decode().splitlines() == passes
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)                                             # nothing of it is left
    # stopping again is harmless
    again = _run_bg(repo, "--stop", "fake")
    assert again.returncode == 0 and "is not running" in again.stdout


def test_stop_kills_the_process_group_when_sigint_is_ignored(repo):
    (repo / "preregistrations" / "fake.json").write_text('{"x": "--ignore-sigint"}')
    assert _run_bg(repo, "fake", "1").returncode == 3
    _wait_for(repo / "runs" / "fake.log", "pass 2/600")
    group = int((repo / "runs" / "fake.pid").read_text())
    stopped = _run_bg(repo, "--stop", "fake", "2")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "did not stop within 2 s: SIGTERM, then SIGKILL, to its process group" in stopped.stdout
    assert "no status (killed)" in stopped.stdout
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    assert (repo / "runs" / "fake" / "passes.jsonl").read_text().count("complete") >= 2


def test_every_watching_call_leaves_a_snapshot_of_the_recorded_data_in_out(repo):
    import tarfile

    first = _run_bg(repo, "fake", "3")
    assert first.returncode == 3, first.stdout + first.stderr
    snap = repo / "out" / "fake.partial.tar.xz"
    assert "[bg] snapshot: $OUT/fake.partial.tar.xz" in first.stdout
    with tarfile.open(snap) as tar:
        names = set(tar.getnames())
        got = tar.extractfile("fake/passes.jsonl").read().decode().splitlines()
    assert {"fake/run.json", "fake/passes.jsonl", "fake.log"} <= names
    assert len(got) >= 2 and set(got) == {'{"status": "complete"}'}
    second = _run_bg(repo, "fake", "2")                      # the next call: a newer snapshot
    with tarfile.open(snap) as tar:
        later = tar.extractfile("fake/passes.jsonl").read().decode().splitlines()
    assert second.returncode == 3 and len(later) > len(got)
    assert _run_bg(repo, "--stop", "fake", "20").returncode == 0
