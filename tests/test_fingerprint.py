"""The environment fingerprint and the same-node / same-versions comparisons."""

from __future__ import annotations

import importlib.metadata
import platform

from bistat.run.fingerprint import (
    _package_digest,
    _parse_nvidia_smi,
    code_digests,
    collect_fingerprint,
    cpu_info,
    gpu_info,
    git_info,
    gpu_processes,
    package_versions,
    same_node,
    same_versions,
)


def test_fingerprint_format_on_this_cpu_only_machine():
    fp = collect_fingerprint()
    assert set(fp) == {"gpus", "cpu", "os", "versions", "git", "code", "host"}
    assert fp["gpus"] == []
    assert set(fp["cpu"]) == {"model", "count", "machine"}
    assert set(fp["versions"]) == {"python", "numpy", "torch", "triton", "vllm", "bistat"}
    assert fp["versions"]["python"] == platform.python_version()
    assert fp["versions"]["numpy"] == importlib.metadata.version("numpy")
    assert fp["versions"]["vllm"] is None
    assert set(fp["git"]) == {"commit", "dirty"}
    assert fp["git"]["commit"] is None or len(fp["git"]["commit"]) == 40


def test_versions_come_from_metadata_without_importing(monkeypatch):
    import sys

    before = "torch" in sys.modules
    versions = package_versions(["numpy", "no-such-package-xyz"])
    assert versions["no-such-package-xyz"] is None
    assert ("torch" in sys.modules) == before


def test_cpu_model_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert cpu_info(f)["model"] == "AMD EPYC 9654 96-Core Processor"


def test_nvidia_smi_parsing_maps_na_to_null():
    text = ("NVIDIA H200, GPU-5a3e0c1d-aaaa-bbbb-cccc-000000000001, 1654923012345, 580.65.06\n"
            "NVIDIA H200, GPU-5a3e0c1d-aaaa-bbbb-cccc-000000000002, [N/A], 580.65.06\n")
    assert _parse_nvidia_smi(text) == [
        {"name": "NVIDIA H200", "uuid": "GPU-5a3e0c1d-aaaa-bbbb-cccc-000000000001", "serial": "1654923012345",
         "driver": "580.65.06"},
        {"name": "NVIDIA H200", "uuid": "GPU-5a3e0c1d-aaaa-bbbb-cccc-000000000002", "serial": None,
         "driver": "580.65.06"},
    ]


def test_gpu_info_uses_nvidia_smi_and_visible_devices(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, GPU-aaa, 1, 580'\necho 'NVIDIA H200, GPU-bbb, 2, 580'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert [g["uuid"] for g in gpu_info()] == ["GPU-aaa", "GPU-bbb"]
    assert [g["uuid"] for g in gpu_info("1")] == ["GPU-bbb"]
    assert [g["uuid"] for g in gpu_info("GPU-aaa")] == ["GPU-aaa"]


def _fp(uuid=None, host="n1", cpu="EPYC", driver="580", vllm="0.25.0", commit="abc"):
    gpus = [] if uuid is None else [{"name": "H200", "uuid": uuid, "serial": None, "driver": driver}]
    return {"gpus": gpus, "cpu": {"model": cpu}, "host": host,
            "versions": {"python": "3.11", "numpy": "2", "torch": "2.9", "triton": "3.5", "vllm": vllm,
                         "bistat": "0.1.0"},
            "git": {"commit": commit, "dirty": False}}


def test_same_node():
    assert same_node([_fp("GPU-1"), _fp("GPU-1", host="renamed")])
    assert not same_node([_fp("GPU-1"), _fp("GPU-2")])
    assert not same_node([_fp("GPU-1"), _fp(None)])
    assert same_node([_fp(None), _fp(None)])
    assert not same_node([_fp(None), _fp(None, host="n2")])
    no_uuid = _fp("x")
    no_uuid["gpus"][0]["uuid"] = None
    assert not same_node([no_uuid, no_uuid])


def test_same_versions():
    assert same_versions([_fp("GPU-1"), _fp("GPU-2")])
    assert not same_versions([_fp("GPU-1"), _fp("GPU-1", vllm="0.24.0")])
    assert not same_versions([_fp("GPU-1"), _fp("GPU-1", driver="575")])
    assert not same_versions([_fp("GPU-1"), _fp("GPU-1", commit="def")])
    # the code digests count where recorded; fingerprints from before them compare as before
    a, b = _fp("GPU-1"), _fp("GPU-1")
    a["code"], b["code"] = {"bistat": "1" * 64}, {"bistat": "2" * 64}
    assert not same_versions([a, b])
    b["code"] = dict(a["code"])
    assert same_versions([a, b])


def test_version_differences_name_what_differs():
    """The phrases the findings' "same versions" check prints."""
    from bistat.run.fingerprint import version_differences

    assert version_differences([_fp("GPU-1"), _fp("GPU-2")]) == []
    a, b = _fp("GPU-1", vllm="0.24.0", driver="575", commit="def"), _fp("GPU-1")
    a["code"], b["code"] = {"bistat": "1" * 64}, {"bistat": "2" * 64}
    vllm = b["versions"]["vllm"]
    commit = b["git"]["commit"]
    assert version_differences([a, b]) == [
        f"vllm: {' / '.join(sorted(['0.24.0', str(vllm)]))}",
        f"git commit: {' / '.join(sorted(['def', str(commit)]))}",
        "GPU driver differs", "bistat code: 111111111111 / 222222222222"]


def test_code_digests_cover_the_installed_files_and_change_with_them(tmp_path, monkeypatch):
    digests = code_digests()
    assert set(digests) == {"bistat", "bistat_kernels"}
    assert all(d is None or len(d) == 64 for d in digests.values()) and digests["bistat"]
    pkg = tmp_path / "bistat_digest_probe"
    (pkg / "results").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "table.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = _package_digest.__wrapped__("bistat_digest_probe")
    (pkg / "results" / "r.json").write_text("[1]")      # measurements: not code
    (pkg / "notes.md").write_text("text")               # neither .py nor .json
    assert _package_digest.__wrapped__("bistat_digest_probe") == first
    (pkg / "table.json").write_text("{ }")
    assert _package_digest.__wrapped__("bistat_digest_probe") != first
    assert _package_digest.__wrapped__("no_such_package_xyz") is None


def test_gpu_processes_from_nvidia_smi(monkeypatch):
    import subprocess

    import bistat.run.fingerprint as fpmod

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = ("GPU-2118561a-f2eb-496b-e3c2-589114747d6c, 1105, VLLM::EngineCore, 28930\n"
               "GPU-2118561a-f2eb-496b-e3c2-589114747d6c, 2372, python3, [N/A]\n")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(fpmod.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(fpmod.subprocess, "run", fake_run)
    assert gpu_processes() == [
        {"gpu_uuid": "GPU-2118561a-f2eb-496b-e3c2-589114747d6c", "pid": 1105,
         "name": "VLLM::EngineCore", "used_memory_mib": 28930},
        {"gpu_uuid": "GPU-2118561a-f2eb-496b-e3c2-589114747d6c", "pid": 2372, "name": "python3",
         "used_memory_mib": None}]
    assert calls[0][1].startswith("--query-compute-apps=")
    monkeypatch.setattr(fpmod.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    assert gpu_processes() == []
    monkeypatch.setattr(fpmod.shutil, "which", lambda name: None)
    assert gpu_processes() is None


def _repo_at_two_commits(tmp_path):
    import subprocess
    repo = tmp_path / "copy"
    repo.mkdir()
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                               *args], check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "a.py").write_text("1\n")
    git("add", "a.py")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    (repo / "a.py").write_text("2\n")
    git("commit", "-qam", "second")
    return repo, first, git("rev-parse", "HEAD")


def test_a_copy_declares_the_commit_it_is_a_copy_of(tmp_path, monkeypatch):
    # The lent GPU machine's copy kept an earlier commit's .git (runs of 2026-12-03 recorded
    # ad07555 "dirty" for a tree of 5935d64): travel.sh says which commit travelled.
    import shutil
    if shutil.which("git") is None:
        import pytest
        pytest.skip("needs git")
    repo, first, second = _repo_at_two_commits(tmp_path)
    monkeypatch.delenv("BISTAT_SOURCE_COMMIT", raising=False)
    assert git_info(repo) == {"commit": second, "dirty": False}

    monkeypatch.setenv("BISTAT_SOURCE_COMMIT", f"{first} dirty")
    assert git_info(repo) == {"commit": first, "dirty": True, "from": "BISTAT_SOURCE_COMMIT",
                              "copy_git": {"commit": second, "dirty": False}}
    monkeypatch.setenv("BISTAT_SOURCE_COMMIT", f"{second} clean\n")
    assert git_info(repo) == {"commit": second, "dirty": False, "from": "BISTAT_SOURCE_COMMIT"}

    for bad in ("5935d64 clean", f"{second}", f"{second} modified", "HEAD clean"):
        monkeypatch.setenv("BISTAT_SOURCE_COMMIT", bad)
        info = git_info(repo)
        assert (info["commit"], info["dirty"]) == (second, False)     # the copy's own answer
        assert info["invalid"] == (f"BISTAT_SOURCE_COMMIT={bad!r} is not 'SHA clean' or 'SHA "
                                   "dirty' (a full 40-digit commit); the copy's own git answer "
                                   "is recorded")
    monkeypatch.setenv("BISTAT_SOURCE_COMMIT", f"{first} clean")
    assert collect_fingerprint()["git"]["commit"] == first
