"""``kernels/device/tune_card.py`` on the CPU: its stages, their commands, budget and files.

The probe and the tune run for real under the Triton interpreter (tiny float32 shape, the tiny
sweep of ``use_tiny_sweep``); the bench, which needs CUDA graphs, is stood in for after its
command line has been parsed, so that what reaches it and what it writes are checked.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest
from helpers_kernels import small_table_dict, torch, use_tiny_sweep

from bistat_kernels import bench, sweep, tables  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "kernels" / "device" / "tune_card.py"
SLUG = tables.device_slug(sweep.INTERPRETER_DEVICE)


def _script():
    spec = importlib.util.spec_from_file_location("tune_card", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def card(tmp_path, monkeypatch):
    """The script, a table to compare (fp32, "Test GPU") and a stand-in bench that records the
    command line it was run under and the table in force."""
    from bistat.cli import cmd_kernels

    use_tiny_sweep(monkeypatch, [0.0])
    other = tmp_path / "test_gpu.json"
    other.write_text(json.dumps(small_table_dict()), encoding="utf-8")
    benched: list[tuple[list[str], str]] = []

    def fake_bench(shapes, command, **kw):
        benched.append((list(command), tables._DEVICE_TABLE.source))
        return {"summary": {"goal_ms": [1], "geomean_tuned_over_mm": 1.01, "decode_max_m": 32,
                            "decode_geomean_tuned_over_mm": 0.99,
                            "geomean_default_over_mm": 2.3, "goal_overall_met": True},
                "table": tables._DEVICE_TABLE.source}

    monkeypatch.setattr(cmd_kernels, "_require_torch", lambda *a, **k: torch)
    monkeypatch.setattr(bench, "run_bench", fake_bench)
    return _script(), other, benched


def _args(tmp_path, other, budget="600"):
    return ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget-s",
            budget, "--compare", str(other), "--shape", "40x72", "--dtype", "float32",
            "--max-m", "40", "--no-edge-cases"]


def test_one_call_probes_tunes_and_benches_in_order_and_returns_at_most_8_files(tmp_path,
                                                                                 card):
    script, other, benched = card
    assert script.main(_args(tmp_path, other)) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted([
        f"{SLUG}.json", f"probe_{SLUG}.json", f"probe_test_gpu_on_{SLUG}.json",
        f"bench_{SLUG}.json", f"bench_test_gpu_on_{SLUG}.json", "manifest.json", "extras.tgz"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema"] == "bistat_kernels.card_run/1"
    assert manifest["device_name"] == sweep.INTERPRETER_DEVICE and manifest["budget_kept"]
    assert [(s["stage"], s["exit"]) for s in manifest["stages"]] == [
        ("probe test_gpu.json", 0), ("tune", 0), (f"bench {SLUG}.json", 0),
        ("bench test_gpu.json", 0), (f"bench {SLUG}.json (repeat)", 0)]
    table = tmp_path / "work" / "tables" / f"{SLUG}.json"
    assert manifest["stages"][1]["command"].startswith(
        "bistat kernels tune --shape 40x72 --dtype float32 --max-m 40 --budget-s ")
    assert manifest["stages"][1]["command"].endswith(
        f"--workers 16 --tables-dir {tmp_path / 'work' / 'tables'} --report "
        f"{tmp_path / 'work' / 'extras' / f'tune_report_{SLUG}.json'}")
    assert manifest["tune"]["complete"] is True and manifest["tune"]["in_table"] == ["shape/40x72"]
    # each bench ran under its own bistat command line, with the table it names in force
    assert [(cmd[:5], source) for cmd, source in benched] == [
        (["bistat", "kernels", "bench", "--table", str(table)], str(table)),
        (["bistat", "kernels", "bench", "--table", str(other)], str(other)),
        (["bistat", "kernels", "bench", "--table", str(table)], str(table))]
    assert [(b["file"], b["repeat"], b["geomean_default_over_mm"]) for b in manifest["benches"]] \
        == [(f"bench_{SLUG}.json", False, 2.3), (f"bench_test_gpu_on_{SLUG}.json", False, 2.3),
            (f"bench_{SLUG}_repeat.json", True, 2.3)]
    probe_other = json.loads((out / f"probe_test_gpu_on_{SLUG}.json").read_text())
    assert probe_other["passed"] is True and probe_other["table"] == str(other)
    assert tables.load_table(out / f"{SLUG}.json").entries.keys() == {("float32", 40, 72)}
    with tarfile.open(out / "extras.tgz") as tar:
        names = set(tar.getnames())
    assert {f"extras/tune_report_{SLUG}.json", f"extras/bench_{SLUG}_repeat.json",
            f"extras/tune-state/sweep_raw_{SLUG}.json",
            f"extras/tune-state/probe_{SLUG}.json"} <= names


def test_a_budget_too_small_for_a_stage_skips_it_and_says_so(tmp_path, card):
    script, other, benched = card
    assert script.main(_args(tmp_path, other, budget="40")) == 1  # no table made
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [(s["stage"], s["skipped"].split(" s ")[1]) for s in manifest["stages"]] == [
        ("probe test_gpu.json", "left"), ("tune", "would be left for it"),
        ("bench test_gpu.json", "left")]
    assert benched == [] and manifest["budget_kept"]


def test_a_second_call_resumes_the_tune_left_in_the_work_folder(tmp_path, card):
    script, other, _ = card
    assert script.main(_args(tmp_path, other)) == 0
    assert script.main(_args(tmp_path, other)) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tune"]["tuned_now"] == [] and manifest["tune"]["complete"]


def test_the_script_imports_nothing_the_device_image_lacks():
    """The image has torch, triton, numpy, click and jinja2 but not pydantic, platformdirs,
    gguf or starlette: the script and every `bistat kernels` command it runs must import without
    them (a fresh interpreter with those blocked)."""
    import subprocess

    blocker = ("import sys, importlib.abc\n"
               "class B(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in {'pydantic', 'platformdirs', 'gguf', "
               "'starlette', 'uvicorn', 'sniffio', 'vllm'}:\n"
               "            raise ImportError(name)\n"
               "sys.meta_path.insert(0, B())\n"
               "import bistat.cli, bistat_kernels.tune, bistat_kernels.bench\n"
               "bistat.cli.cli.main(['kernels', 'tune', '--help'], prog_name='bistat', "
               "standalone_mode=False)\n"
               "import runpy\n"
               "sys.argv = ['tune_card.py', '--help']\n"
               f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: bistat kernels tune [OPTIONS]")
    assert "usage: tune_card.py [-h] --out OUT" in done.stdout
