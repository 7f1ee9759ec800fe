"""``bistat kernels tune`` on the CPU: the sweep's interpreter path, tiny shapes, a tiny budget.

The kernels run under the Triton interpreter (the gates compare real outputs bitwise); the
candidates' times and the budget's clock are the deterministic fake of ``use_tiny_sweep``: one
second per timed measurement, 19 measurements per shape with its tiny candidate set.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers_kernels import torch, use_tiny_sweep

from bistat.cli import cli
from bistat_kernels import probe, resolution, sweep, tables, tune  # noqa: E402

SHAPES = ["--shape", "40x72", "--shape", "37x100"]
SLUG = tables.device_slug(sweep.INTERPRETER_DEVICE)
PER_SHAPE_S = 19  # fake seconds: 14 measurements scoring two layouts at M 1 and 32, 5 at M = 8


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    use_tiny_sweep(monkeypatch, now)
    return now


def _tune(tmp_path, *args):
    return CliRunner().invoke(cli, ["kernels", "tune", *SHAPES, "--dtype", "float32",
                                    "--max-m", "40", "--tables-dir", str(tmp_path), *args],
                              catch_exceptions=False)


def _report(tmp_path) -> dict:
    path = tmp_path / tune.STATE_DIR / SLUG / f"tune_{SLUG}.json"
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_budget_is_split_before_anything_runs():
    b = tune.TuneBudget.split(40, 2)
    assert (b.total_s, b.precompile_s, b.sweep_s, b.probe_s) == (40, 8.0, 35.0, 5.0)
    assert tune.TuneBudget.split(10, 30).probe_s == 5  # at most half for the probe


def test_a_tune_writes_the_probed_table_that_resolution_finds_for_the_gpu(tmp_path, clock):
    result = _tune(tmp_path, "--budget-s", "100")
    assert result.exit_code == 0, result.output
    table_path = tmp_path / f"{SLUG}.json"
    assert result.output.splitlines()[-2:] == [
        f"table: {table_path} (2 of the 2 shapes asked for, each through both gates)",
        "time: 38 s of a 100 s budget"]
    assert result.output.splitlines()[0] == (
        f"tune: {sweep.INTERPRETER_DEVICE}, 2 shape(s); budget 100 s: precompile at most 20 s, "
        f"sweep until 95 s, probe until 100 s; state in {tmp_path / 'tune-state' / SLUG}")
    table = tables.load_table(table_path)
    assert table.device_name == sweep.INTERPRETER_DEVICE
    assert sorted(table.entries) == [("float32", 37, 100), ("float32", 40, 72)]
    for entry in table.entries.values():
        got = entry.extra["probe"]
        assert got["passed"] and got["rows_equal"] == got["rows_checked"] > 0
        assert max(got["m_values"]) == 33 and got["max_rel_err"] <= got["tolerance"] == 1e-5
        assert entry.extra["selection"]["chosen"] == "bk32_s1"  # the fake clock's favourite
        assert entry.provenance["gpu_name"] == sweep.INTERPRETER_DEVICE
    report = _report(tmp_path)
    assert (report["complete"], report["budget_kept"], report["elapsed_s"]) == (True, True, 38)
    assert report["tuned_now"] == ["shape/40x72", "shape/37x100"]
    probe_doc = json.loads((tmp_path / "tune-state" / SLUG / f"probe_{SLUG}.json").read_text())
    assert probe_doc["schema"] == probe.PROBE_SCHEMA and probe_doc["passed"] is True
    # the table is found for that device's name in the user folder: "user"
    found = resolution.resolve(resolution.DeviceFacts(sweep.INTERPRETER_DEVICE), environ={},
                               user_dir=tmp_path, vllm_configs=None)
    assert (found.how, found.path) == ("user", str(table_path))
    tables.install_resolution(found)
    try:
        assert tables.lookup_config(8, 40, 72, "float32", None) == \
            table.entries[("float32", 40, 72)].config_for(8)
    finally:
        tables.reset_device_table()


def test_a_tune_stopped_by_its_budget_keeps_it_and_resumes_where_it_stopped(tmp_path, clock):
    # 15 s for the sweep: the first shape (19 s) is dropped at its deadline, nothing is written
    first = _tune(tmp_path, "--budget-s", "20")
    assert first.exit_code == 0, first.output
    assert "sweep: budget 15s reached inside shape/40x72 after 16s; it is left for a later run" \
        in first.output
    assert first.output.splitlines()[-2:] == [
        "time: 16 s of a 20 s budget",
        "not yet tuned (run again to resume): shape/40x72, shape/37x100"]
    assert "table: none written (no entry has passed both gates yet)" in first.output
    assert not (tmp_path / f"{SLUG}.json").exists()
    assert _report(tmp_path)["budget_kept"] is True
    # 33 s for the sweep: one shape fits, the second would not start (its estimate: 19 s)
    clock[0] = 0.0
    second = _tune(tmp_path, "--budget-s", "38")
    assert "sweep: budget 33s reached after 19s; resume later" in second.output
    assert second.output.splitlines()[-2:] == [
        "time: 19 s of a 38 s budget", "not yet tuned (run again to resume): shape/37x100"]
    assert list(tables.load_table(tmp_path / f"{SLUG}.json").entries) == [("float32", 40, 72)]
    # resumed: only the second shape is swept and probed now
    clock[0] = 0.0
    third = _tune(tmp_path, "--budget-s", "100")
    assert third.exit_code == 0, third.output
    assert "sweep: 1 shape(s) to tune on Triton interpreter (CPU), 1 already in the table" \
        in third.output
    assert [line for line in third.output.splitlines() if line.startswith("tune: probe")] == [
        line for line in third.output.splitlines() if "N=37 K=100" in line and "probe" in line]
    assert _report(tmp_path)["tuned_now"] == ["shape/37x100"]
    assert third.output.splitlines()[-1] == f"time: {PER_SHAPE_S} s of a 100 s budget"
    assert len(tables.load_table(tmp_path / f"{SLUG}.json").entries) == 2
    raw = json.loads((tmp_path / "tune-state" / SLUG / f"sweep_raw_{SLUG}.json").read_text())
    assert [(s["n"], s["k"]) for s in raw["shapes"]] == [(40, 72), (37, 100)]


def test_an_entry_that_fails_the_probe_is_left_out_and_the_tune_fails(tmp_path, clock,
                                                                       monkeypatch):
    real = probe.probe_shape

    def breaks_37(n, k, *args, **kwargs):
        res = real(n, k, *args, **kwargs)
        if n != 37:
            return res
        inv = res.invariance
        return probe.ShapeProbe(probe.InvarianceResult(inv.n, inv.k, inv.dtype, inv.m_values,
                                                       inv.rows_checked, inv.rows_checked - 1,
                                                       ((33, 32),)), res.accuracy, res.case)

    monkeypatch.setattr(probe, "probe_shape", breaks_37)
    result = _tune(tmp_path, "--budget-s", "100")
    assert result.exit_code == 1
    assert result.output.splitlines()[-3:] == [
        f"table: {tmp_path / f'{SLUG}.json'} (1 of the 2 shapes asked for, each through both "
        "gates)",
        "time: 38 s of a 100 s budget",
        "FAILED the probe (left out of the table): shape/37x100"]
    assert list(tables.load_table(tmp_path / f"{SLUG}.json").entries) == [("float32", 40, 72)]


def test_a_later_tune_of_other_shapes_keeps_the_earlier_entries(tmp_path, clock):
    first = CliRunner().invoke(cli, ["kernels", "tune", "--shape", "40x72", "--dtype", "float32",
                                     "--max-m", "8", "--budget-s", "60", "--tables-dir",
                                     str(tmp_path)], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(cli, ["kernels", "tune", "--shape", "37x100", "--dtype",
                                      "float32", "--max-m", "8", "--budget-s", "60",
                                      "--tables-dir", str(tmp_path)], catch_exceptions=False)
    assert f"table: {tmp_path / f'{SLUG}.json'} (1 of the 1 shapes asked for, each through both " \
        "gates)" in second.output
    assert sorted(tables.load_table(tmp_path / f"{SLUG}.json").entries) == [
        ("float32", 37, 100), ("float32", 40, 72)]


def test_tune_with_retune_forgets_the_earlier_state(tmp_path, clock):
    assert _tune(tmp_path, "--budget-s", "100").exit_code == 0
    clock[0] = 0.0
    again = _tune(tmp_path, "--budget-s", "100", "--retune")
    assert "sweep: 2 shape(s) to tune on Triton interpreter (CPU), 0 already in the table" \
        in again.output
    assert _report(tmp_path)["tuned_now"] == ["shape/40x72", "shape/37x100"]


def test_tune_writes_under_the_user_folder_by_default(tmp_path, clock, monkeypatch):
    monkeypatch.setenv(resolution.TABLE_DIR_ENV, str(tmp_path / "mine"))
    result = CliRunner().invoke(cli, ["kernels", "tune", "--shape", "40x72", "--dtype",
                                      "float32", "--max-m", "8", "--budget-s", "60",
                                      "--report", str(tmp_path / "r.json")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "mine" / f"{SLUG}.json").is_file()
    assert json.loads((tmp_path / "r.json").read_text())["in_table"] == ["shape/40x72"]


def test_tune_refuses_without_a_gpu_unless_interpreting(monkeypatch):
    if torch.cuda.is_available():  # pragma: no cover - GPU machines run the real thing
        return
    monkeypatch.delenv("TRITON_INTERPRET")
    result = CliRunner().invoke(cli, ["kernels", "tune"])
    assert result.exit_code == 1
    assert result.output == ("Error: bistat kernels tune needs a CUDA GPU or set "
                             "TRITON_INTERPRET=1 to run small shapes on the CPU interpreter\n")
