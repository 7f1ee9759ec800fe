"""The kernels' device scripts on the CPU, each with a stand-in ``gpu_call.py``.

``kernels/device/retune_and_confirm.sh`` (the background kernel job of a device session; it ran
on the H200 on 2026-12-03, kernels/results/k12/): the order of its stages, the table each one
starts from and the files left for the calls that follow. ``kernels/device/bench_tables.sh``
(two tables benched on one GPU, interleaved): the order of the benches, the table in each folder
and the summary it writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or sys.platform != "linux",
                                reason="needs bash and Linux")

# The stand-in: appends its argv to calls.jsonl; "buckets" writes --out/nvidia_h200.json with the
# table it started from (the --out copy if there is one, else the committed one) plus its stage
# name; "bench" writes a bench file naming the table it found in --out.
FAKE_GPU_CALL = r'''
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
log = Path(__file__).resolve().parents[3] / "calls.jsonl"
with log.open("a") as f:
    f.write(json.dumps(args) + "\n")
table = out / "nvidia_h200.json"
start = table if table.is_file() else Path("kernels/bistat_kernels/tables/nvidia_h200.json")
doc = json.loads(start.read_text())
if "buckets" in args:
    doc["stages"] = doc.get("stages", []) + [str(out.name)]
    table.write_text(json.dumps(doc))
if "bench" in args:
    (out / "bench_nvidia_h200.json").write_text(json.dumps({"table_stages": doc.get("stages")}))
'''


def _repo_with(root: Path, script: str, fake_gpu_call: str) -> Path:
    """A throw-away checkout holding kernels/device/SCRIPT and a stand-in gpu_call.py."""
    r = root / "repo"
    (r / "kernels" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "kernels" / "device" / script, r / "kernels" / "device" / script)
    (r / "kernels" / "device" / "gpu_call.py").write_text(fake_gpu_call)
    return r


@pytest.fixture
def repo(tmp_path):
    r = _repo_with(tmp_path, "retune_and_confirm.sh", FAKE_GPU_CALL)
    (r / "kernels" / "bistat_kernels" / "tables").mkdir(parents=True)
    (r / "kernels" / "bistat_kernels" / "tables" / "nvidia_h200.json").write_text(
        json.dumps({"stages": ["committed"]}))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, GPU-test, 1.0'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    (fake_bin / "python3").symlink_to(sys.executable)
    return r


def test_the_job_retunes_mid_then_the_split_shapes_then_benches_the_new_table_twice(repo):
    job = repo / ".dev" / "k12"
    env = dict(os.environ, PATH=f"{repo.parent / 'bin'}:{os.environ['PATH']}")
    subprocess.run(["bash", "kernels/device/retune_and_confirm.sh", str(job), "33", "128",
                    "576x1536,2048x6144", "256", "300"], cwd=repo, env=env, check=True,
                   timeout=60)
    assert (job / "done").read_text().split() == ["mid=0", "after=0", "confirm1=0", "confirm2=0"]
    calls = [json.loads(line) for line in (job / "calls.jsonl").read_text().splitlines()]
    assert calls == [
        ["buckets", "--min-m", "33", "--retune-max-m", "128", "--out", f"{job}/mid",
         "--budget-s", "300"],
        ["buckets", "probe", "bench", "--shapes", "576x1536,2048x6144", "--min-m", "256",
         "--out", f"{job}/after", "--budget-s", "300"],
        ["bench", "--out", f"{job}/confirm1", "--budget-s", "60"],
        ["bench", "--out", f"{job}/confirm2", "--budget-s", "60"]]
    # the split-K re-tune starts from the mid re-tune's table; both confirmations bench its result
    after = json.loads((job / "after" / "nvidia_h200.json").read_text())
    assert after["stages"] == ["committed", "mid", "after"]
    for n in (1, 2):
        bench = json.loads((job / f"confirm{n}" / "bench_nvidia_h200.json").read_text())
        assert bench["table_stages"] == ["committed", "mid", "after"]
    log = (job / "log.txt").read_text()
    assert "NVIDIA H200, GPU-test" in log
    # it ran from its own copy of the package: the checkout's files may change under it
    assert (job / "src" / "kernels" / "device" / "gpu_call.py").is_file()


# The stand-in bench of bench_tables.sh: a summary computed from the table it finds in --out.
FAKE_BENCH = r'''
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
table = json.loads((out / "nvidia_h200.json").read_text())
with (Path(__file__).resolve().parents[2] / "calls.jsonl").open("a") as f:
    f.write(json.dumps([args, table["name"]]) + "\n")
(out / "bench_nvidia_h200.json").write_text(json.dumps({
    "summary": {"geomean_tuned_over_mm": table["g"], "decode_geomean_tuned_over_mm": table["d"]},
    "provenance": {"gpu_uuid": "GPU-test", "date_utc": "2026-12-03T00:00:00Z"}}))
'''


def _two_tables(tmp_path: Path) -> tuple[Path, Path]:
    """Two stand-in tables: FAKE_BENCH reports their "g" and "d" as its geometric means."""
    a, b = tmp_path / "old.json", tmp_path / "new.json"
    a.write_text(json.dumps({"name": "old", "g": 1.0512, "d": 1.0006}))
    b.write_text(json.dumps({"name": "new", "g": 1.0463, "d": 1.0079}))
    return a, b


def test_bench_tables_interleaves_the_two_tables_and_summarises_every_run(tmp_path):
    r = _repo_with(tmp_path, "bench_tables.sh", FAKE_BENCH)
    a, b = _two_tables(tmp_path)
    done = subprocess.run(["bash", "kernels/device/bench_tables.sh", str(tmp_path / "ab"), "2",
                           str(a), str(b)], cwd=r, capture_output=True, text=True, timeout=60,
                          check=True)
    calls = [json.loads(line) for line in (r / "calls.jsonl").read_text().splitlines()]
    assert [name for _, name in calls] == ["old", "new", "old", "new"]
    assert [args[args.index("--out") + 1] for args, _ in calls] == [
        str(tmp_path / "ab" / d) for d in ("a1", "b1", "a2", "b2")]
    lines = (tmp_path / "ab" / "summary.txt").read_text().splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["a1", "1.0512", "1.0006"], ["b1", "1.0463", "1.0079"],
        ["a2", "1.0512", "1.0006"], ["b2", "1.0463", "1.0079"]]
    assert lines[1].endswith(str(b)) and "GPU-test" in lines[1]
    assert done.stdout.splitlines() == lines


def test_bench_tables_passes_bench_args_to_every_bench_and_names_them(tmp_path):
    """BENCH_ARGS (e.g. one shape, the k13 follow-up) reaches each bench, word-split, and ends
    each summary line, so two summaries of different benches cannot be taken for one."""
    r = _repo_with(tmp_path, "bench_tables.sh", FAKE_BENCH)
    a, b = _two_tables(tmp_path)
    subprocess.run(["bash", "kernels/device/bench_tables.sh", str(tmp_path / "ab"), "1", str(a),
                    str(b)], cwd=r, capture_output=True, text=True, timeout=60, check=True,
                   env={**os.environ, "BENCH_ARGS": "--bench-shapes 151936x4096 --empty-cache"})
    calls = [json.loads(line) for line in (r / "calls.jsonl").read_text().splitlines()]
    assert [args[-3:] for args, _ in calls] == [["--bench-shapes", "151936x4096",
                                                 "--empty-cache"]] * 2
    lines = (tmp_path / "ab" / "summary.txt").read_text().splitlines()
    assert [line.endswith(" --bench-shapes 151936x4096 --empty-cache") for line in lines] == [
        True, True]
