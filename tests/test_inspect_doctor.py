"""``bistat inspect`` (what a run holds, its gaps) and ``bistat doctor`` (what this machine can run)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from helpers_analysis import declaration, register_tiny
from helpers_explain import blas_run, validate

from bistat.cli import cmd_doctor, cmd_inspect
from bistat.explain.doctor import doctor, render_doctor
from bistat.explain.inspect_run import inspect_run, render_inspection
from bistat.store.writer import RunWriter
from bistat.store.format import token_sha256


@pytest.fixture()
def cli():
    group = click.Group("bistat")
    cmd_inspect.register(group)
    cmd_doctor.register(group)
    return group


def test_inspect_a_complete_run(tmp_path_factory, cli):
    run = blas_run(tmp_path_factory)
    ins = inspect_run(run)
    assert ins.schema == "bistat.run/1" and ins.run_id == "blasrun"
    assert ins.registration_state == "seal verified"
    assert [(t.table, t.source, t.gaps) for t in ins.tables][:2] == [
        ("schedule", "parquet", ()), ("responses", "parquet", ())]
    assert {t.table: t.n_records for t in ins.tables}["responses"] == 192
    assert [(p.arm, p.pass_index, p.status, p.n_responses) for p in ins.passes] == [
        ("blas", 0, "complete", 32), ("invariant", 0, "complete", 32),
        ("invariant", 1, "complete", 32), ("blas", 1, "complete", 32),
        ("blas", 2, "complete", 32), ("invariant", 2, "complete", 32)]
    assert ins.missing == () and ins.gaps == () and ins.events == ()
    result = CliRunner().invoke(cli, ["inspect", str(run)], catch_exceptions=False)
    assert result.exit_code == 0 and result.output == render_inspection(ins)
    assert result.output.splitlines()[-1] == "gaps: none"
    data = json.loads(CliRunner().invoke(cli, ["inspect", str(run), "--json"]).output)
    validate(data, "inspect.schema.json")


def test_probe_parts_are_run_files_and_anything_else_is_named(tmp_path):
    import shutil
    from pathlib import Path

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "synthetic" / "run", run)
    for name in ("probe.json", "probe-bi-tuned-gemm.json", "scratch.txt"):
        (run / name).write_text("{}")
    assert inspect_run(run).extra_files == ("scratch.txt",)


def _resp(p, pid, error=None):
    return {"arm": "a", "seq": p, "pass_index": p, "kind": "counted", "prompt_id": pid,
            "prompt_index": 0, "token_ids": [] if error else [1], "text": "", "logprobs": None,
            "top_logprobs": None, "finish_reason": None, "n_prompt_tokens": 2, "t_submit": 0.0,
            "t_first_token": None, "t_done": 0.1, "error": error, "attempts": 3,
            "token_sha256": None if error else token_sha256([1]), "logprob_sha256": None}


def test_inspect_reports_every_gap(tmp_path, cli):
    reg = tmp_path / "reg.json"
    reg.write_text(json.dumps({"sealed": {"declaration": {
        "arms": [{"name": "a", "role": "control"}], "workload": {"passes": 2}}}}))
    run = tmp_path / "run"
    with RunWriter.create(run, {"run_id": "gappy", "registration": {"path": str(reg)},
                                "engine_kind": "fake", "command": ["bistat", "run"]}) as w:
        base = {"arm": "a", "kind": "counted", "block": 0, "time_utc": "t"}
        w.append("schedule", {"event": "start", "seq": 0, "pass_index": 0, **base})
        w.append("schedule", {"event": "end", "seq": 0, "pass_index": 0, "status": "failed",
                              "n_failed": 1, **base})
        w.append("schedule", {"event": "start", "seq": 1, "pass_index": 1, **base})
        w.append("responses", _resp(0, "p0"))
        w.append("responses", _resp(0, "p1", error="HTTP 500 after 3 attempts"))
        w.append("responses", _resp(1, "p0"))
        w.append("events", {"arm": "a", "event": "exited", "time_utc": "t", "detail": "killed"})
    with open(run / "responses.jsonl", "ab") as fh:
        fh.write(b'{"schema": "bistat.responses/1", "arm": "a", "pass')   # cut by a crash
    ins = inspect_run(run)
    assert ins.registration_state.startswith(f"seal broken: {reg}: schema None is not ")
    assert ins.missing == ()   # the declaration of a registration that does not verify is not used
    # the same run under a sealed registration of arm "a", two passes: its missing passes
    sealed = register_tiny(tmp_path, declaration(passes=2).replace('name = "ctl"', 'name = "a"'))
    header = json.loads((run / "run.json").read_text())
    header["registration"] = {"path": str(sealed.path)}
    (run / "run.json").write_text(json.dumps(header))
    ins = inspect_run(run)
    assert ins.registration_state == "seal verified"
    assert [(p.pass_index, p.status, p.n_responses, p.n_failed, p.first_errors)
            for p in ins.passes] == [(0, "failed", 2, 1, ("HTTP 500 after 3 attempts",)),
                                     (1, "started, never ended", 1, 0, ())]
    assert ins.gaps == ("responses.jsonl:4: truncated line (no newline: cut off while being "
                        "written); ignored",)
    assert ins.missing == ("arm a: 2 of 2 counted passes not recorded complete",
                           "arm trt: 2 of 2 counted passes not recorded complete")
    assert ins.events == ("arm a: exited (killed)",)
    assert ins.n_failed_requests == 1
    text = CliRunner().invoke(cli, ["inspect", str(run)], catch_exceptions=False).output
    assert text.splitlines()[-9:] == [
        "passes:",
        "  seq 0 a pass 0 (counted): failed; 2 response(s), 1 failed",
        "    error: HTTP 500 after 3 attempts",
        "  seq 1 a pass 1 (counted): started, never ended; 1 response(s)",
        "gaps:",
        "  responses.jsonl:4: truncated line (no newline: cut off while being written); ignored",
        "  missing: arm a: 2 of 2 counted passes not recorded complete",
        "  missing: arm trt: 2 of 2 counted passes not recorded complete",
        "  event: arm a: exited (killed)",
    ]
    validate(ins.to_dict(), "inspect.schema.json")


def test_inspect_a_directory_that_is_not_a_run(tmp_path, cli):
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'run.json'}: not found; is {tmp_path} a bistat "
                             "run directory?\n")


def test_doctor_on_a_gpu_host_with_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    found = {"numpy", "httpx", "vllm"}
    rep = doctor(find_spec=lambda m: object() if m in found else None,
                 which=lambda c: f"/usr/bin/{c}",
                 gpus=lambda: [{"name": "NVIDIA H200", "uuid": "GPU-1", "serial": None,
                                "driver": "580.1"}])
    assert [(e.kind, e.usable) for e in rep.engines] == [
        ("embedded", True), ("openai", True), ("vllm-server", True), ("vllm-offline", True),
        ("sglang-server", False), ("command-server", True)]
    assert rep.engines[2].detail == "vllm importable, `vllm` at /usr/bin/vllm"
    assert rep.cache_dir == str(tmp_path)
    assert [(m.name, m.cached) for m in rep.models] == [("smollm2-135m", False)]
    text = render_doctor(rep)
    assert "GPUs:\n  NVIDIA H200 GPU-1 driver 580.1\n" in text
    assert f"cache: {tmp_path}\n  model smollm2-135m: not cached " in text
    validate(rep.to_dict(), "doctor.schema.json")


def test_doctor_without_vllm_or_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m" / "manifest.json").write_text("{}")
    rep = doctor(find_spec=lambda m: None if m == "vllm" else object(), which=lambda c: None,
                 gpus=list)
    assert [(e.kind, e.usable, e.detail) for e in rep.engines][2:4] == [
        ("vllm-server", False, "vllm is not installed: pip install 'bistat[vllm]'"),
        ("vllm-offline", False, "vllm is not installed: pip install 'bistat[vllm]'")]
    assert [(m.name, m.cached) for m in rep.models] == [("smollm2-135m", True)]
    assert "GPUs: none found (no nvidia-smi on PATH)\n" in render_doctor(rep)


def test_doctor_reports_sglang_installed_or_not(tmp_path, monkeypatch):
    """SGLang found (its version and commit read without importing it, against the newest release
    the index knows) and not found."""
    import types

    from bistat.declare.releases import ReleaseCheck

    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "_version.py").write_text("__version__ = '0.5.23'\n__commit_id__ = commit_id = None\n")
    (pkg / "__init__.py").write_text("raise ImportError('doctor must not import sglang')\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr("bistat.explain.doctor.sglang_versions",
                        lambda: {"sglang": "0.5.23", "sglang-kernel": "0.4.10",
                                 "flashinfer-python": "0.7.2"})
    check = lambda package: ReleaseCheck(package, "0.5.23", "2026-12-04T00:00:00Z", "idx")
    rep = doctor(find_spec=lambda m: spec if m == "sglang" else object() if m in ("numpy", "httpx")
                 else None, which=lambda c: None,
                 gpus=lambda: [{"name": "NVIDIA H200", "uuid": "GPU-1", "serial": None,
                                "driver": "580.1"}], release_check=check)
    (sgl,) = [e for e in rep.engines if e.kind == "sglang-server"]
    assert (sgl.usable, sgl.detail) == (True, "sglang 0.5.23 importable "
                                              "(`python -m sglang.launch_server`)")
    assert (rep.versions["sglang"], rep.versions["sglang-kernel"],
            rep.versions["flashinfer-python"]) == ("0.5.23", "0.4.10", "0.7.2")
    assert rep.sglang_release == {"version": "0.5.23", "commit": None, "newest": "0.5.23",
                                  "comparison": "newest", "checked_utc": "2026-12-04T00:00:00Z",
                                  "index": "idx", "error": None}
    assert "sglang 0.5.23: the newest release (idx, checked 2026-12-04T00:00:00Z)\n" in \
        render_doctor(rep)
    validate(rep.to_dict(), "doctor.schema.json")
    none = doctor(find_spec=lambda m: object() if m in ("numpy", "httpx") else None,
                  which=lambda c: None, gpus=list, release_check=check)
    assert [(e.usable, e.detail) for e in none.engines if e.kind == "sglang-server"] == [
        (False, "sglang is not installed: pip install 'bistat[sglang]'")]
    assert none.sglang_release is None
    assert not any(line.startswith("sglang ") for line in render_doctor(none).splitlines())


def test_doctor_says_whether_the_invariant_gemm_kernel_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    details = [doctor(find_spec=lambda m: object() if m in found else None, which=lambda c: None,
                      gpus=list).engines[0].detail
               for found in ({"numpy", "bistat.engines.embedded._rowgemm"}, {"numpy"})]
    assert details == [
        "in-process numpy engine (needs a model: `bistat model fetch`); its invariant GEMM kernel "
        "is built",
        "in-process numpy engine (needs a model: `bistat model fetch`); its invariant GEMM kernel "
        "is not built, so gemm = 'invariant' fails: `pip install -e .` with a C compiler"]
    assert "its invariant GEMM kernel is built" in doctor().engines[0].detail  # this checkout


def test_doctor_cli_never_imports_vllm(cli):
    import sys

    result = CliRunner().invoke(cli, ["doctor", "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    validate(json.loads(result.output), "doctor.schema.json")
    assert "vllm" not in sys.modules


def test_doctor_says_which_gemm_table_serves_the_gpu_and_how(tmp_path, monkeypatch):
    """An H100 with the H200's table shipped and none of its own: by architecture, and the
    shapes without an entry go to vLLM's table (here: no vLLM, its fixed configuration)."""
    import shutil

    from bistat_kernels import tables
    from bistat_kernels.resolution import DeviceFacts

    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    monkeypatch.delenv("BISTAT_GEMM_TABLE", raising=False)
    monkeypatch.delenv("BISTAT_GEMM_TABLE_DIR", raising=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    shutil.copy(tables.TABLES_DIR / "nvidia_h200.json", shipped)
    monkeypatch.setattr(tables, "TABLES_DIR", shipped)
    monkeypatch.setattr("bistat_kernels.resolution.configs_path", lambda: None)
    found = {"numpy", "httpx", "torch", "triton"}
    h100 = [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1", "serial": None, "driver": "580.1"}]
    rep = doctor(find_spec=lambda m: object() if m in found else None, which=lambda c: None,
                 gpus=lambda: h100, release_check=lambda p: None,
                 gemm_device=lambda: DeviceFacts("NVIDIA H100 80GB HBM3", "9.0", 132))
    assert (rep.gemm_table["how"], rep.gemm_table["table"]) == (
        "architecture", str(shipped / "nvidia_h200.json"))
    assert ("tuned GEMM table (BISTAT_TUNED_GEMM=1): NVIDIA H100 80GB HBM3 (compute capability "
            "9.0, 132 multiprocessors): nvidia_h200.json, by architecture (no table for NVIDIA "
            "H100 80GB HBM3; NVIDIA H200's was measured with the same compute capability 9.0 and "
            "132 multiprocessors); shapes without an entry: vLLM's fixed configuration (vLLM is "
            "not installed)\n") in render_doctor(rep)
    validate(rep.to_dict(), "doctor.schema.json")
    # without torch it cannot tell; without a GPU it says nothing
    rep = doctor(find_spec=lambda m: object() if m in {"numpy", "httpx"} else None,
                 which=lambda c: None, gpus=lambda: h100, release_check=lambda p: None)
    assert rep.gemm_table == {"detail": "torch and triton are not installed, so the tuned GEMM "
                                        "cannot run: pip install 'bistat[kernels]'"}
    validate(rep.to_dict(), "doctor.schema.json")
    rep = doctor(find_spec=lambda m: object() if m in found else None, which=lambda c: None,
                 gpus=list, release_check=lambda p: None)
    assert rep.gemm_table is None and "tuned GEMM" not in render_doctor(rep)


@pytest.mark.parametrize("error,detail", [
    (RuntimeError("No CUDA GPUs are available"),
     "torch sees no CUDA GPU (RuntimeError: No CUDA GPUs are available)"),
    (ImportError("libcudart.so.13: cannot open shared object file"),
     "torch cannot be imported (ImportError: libcudart.so.13: cannot open shared object file)"),
])
def test_doctor_says_why_it_cannot_tell_the_gemm_table(tmp_path, monkeypatch, error, detail):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))

    def device():
        raise error

    rep = doctor(find_spec=lambda m: object() if m in {"numpy", "httpx", "torch", "triton"}
                 else None, which=lambda c: None, release_check=lambda p: None,
                 gpus=lambda: [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1"}],
                 gemm_device=device)
    assert rep.gemm_table == {"detail": detail}
    assert f"tuned GEMM table (BISTAT_TUNED_GEMM=1): {detail}\n" in render_doctor(rep)


def test_doctor_lists_and_stops_a_server_whose_bistat_process_is_gone(tmp_path):
    """A process group marked as started by a bistat process that is gone (here a `sleep` whose
    mark names PID 1 with a start time it never had): listed, and stopped unless asked not
    to; the report validates."""
    import subprocess
    import sys

    from bistat.engines.lifetime import LeftoverServer, group_alive, leftover_servers

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True,
                             env={"BISTAT_SERVER_OF": "1:999999999999", "PATH": "/usr/bin:/bin"})
    try:
        found = [s for s in leftover_servers() if s.pid == child.pid]
        assert found == [LeftoverServer(child.pid, child.pid, (sys.executable, "-c",
                                                               "import time; time.sleep(60)"),
                                        "1:999999999999")]
        kept = doctor(leftovers=lambda: found, stop_leftovers=False)
        assert kept.leftover_servers == ({**found[0].to_dict(), "stopped": False},)
        assert group_alive(child.pid)
        validate(kept.to_dict(), "doctor.schema.json")
        assert (f"  still running: pid {child.pid} (process group {child.pid}), started by "
                "bistat process 1: ") in render_doctor(kept)
        stopped = doctor(leftovers=lambda: found)
        assert stopped.leftover_servers[0]["stopped"] is True
        child.wait(timeout=30)      # SIGTERM ended it
        assert child.returncode == -15
    finally:
        child.kill()
        child.wait()
