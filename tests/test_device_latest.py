"""The device scripts' two payloads (issue 19): vLLM 0.25.0 (/tmp/site) and the newest release,
vLLM 0.33.0 with torch 2.14 carried (/tmp/site-latest). What can be checked without the GPU:
the environment each payload gets, staging either payload's parts, re-splitting the latest one
with a checksum per part, and that the pins build_payload.sh downloads are the tested recipe's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "scripts" / "device"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _env(payload: str | None, tmp_path: Path) -> dict[str, str]:
    script = (f"export VLLM_PAYLOAD={payload}; " if payload else "unset VLLM_PAYLOAD; ") + (
        f". {DEVICE / 'env.sh'} && env")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "REPO": "/r"})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_env_gives_each_payload_its_site_and_the_latest_its_cudnn_setting(tmp_path):
    latest, old = _env("latest", tmp_path), _env("0.25", tmp_path)
    assert latest["PYTHONPATH"] == "/r/src:/tmp/site-latest" and latest["SITE"] == "/tmp/site-latest"
    assert latest["PATH"].startswith("/tmp/site-latest/bin:")
    assert latest["PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK"] == "1"
    assert old["PYTHONPATH"] == "/r/src:/tmp/site" and "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK" not in old
    for env in (latest, old):
        assert {k: env[k] for k in ("VLLM_USE_FLASHINFER_SAMPLER", "NCCL_NVLS_ENABLE",
                                    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                                    "BISTAT_PACKAGE_INDEX", "HF_HUB_OFFLINE")} == {
            "VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "BISTAT_PACKAGE_INDEX": "off", "HF_HUB_OFFLINE": "1"}


def test_env_refuses_an_unknown_payload(tmp_path):
    done = subprocess.run(["bash", "-c", f"export VLLM_PAYLOAD=0.40; . {DEVICE / 'env.sh'}"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                               "OUT": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr == "env.sh: VLLM_PAYLOAD=0.40; expected 0.25 or latest\n"


def test_stage_moves_the_latest_parts_whether_or_not_the_checksums_travel(tmp_path):
    repo, stage = tmp_path / "repo", tmp_path / "stage-latest"
    parts = repo / ".dev" / "latest" / "p"
    parts.mkdir(parents=True)
    (parts / "part00").write_bytes(b"a" * 10)
    (parts / "SHA256SUMS").write_text("x  part00\ny  part01\n")
    run = lambda: subprocess.run(["bash", str(DEVICE / "stage.sh")], cwd=repo, capture_output=True,
                                 text=True, env={"PATH": "/usr/bin:/bin",
                                                 "STAGE_LATEST": str(stage)})
    assert run().stdout.startswith("stage latest: 1 of 2 parts (part00 last), ")
    (parts / "SHA256SUMS").unlink()
    (parts / "part01").write_bytes(b"b" * 10)  # a later call carries only its part
    assert run().stdout.startswith("stage latest: 2 of 2 parts (part01 last), ")
    assert sorted(p.name for p in stage.iterdir()) == ["SHA256SUMS", "part00", "part01"]
    assert list(parts.iterdir()) == []


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("split") is None,
                    reason="needs git and coreutils")
def test_the_latest_payload_resplits_with_one_checksum_per_part(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    shutil.copy(DEVICE / "build_payload.sh", repo / "scripts" / "device" / "build_payload.sh")
    (repo / ".gitignore").write_text("/.dev/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    parts = repo / ".dev" / "latest" / "p"
    parts.mkdir(parents=True)
    payload = bytes(range(256)) * (4096 * 17)  # 17 MiB
    (parts / "part00").write_bytes(payload)
    subprocess.run("sha256sum part00 > SHA256SUMS", shell=True, cwd=parts, check=True)
    done = subprocess.run(["bash", "scripts/device/build_payload.sh", "--resplit"], cwd=repo,
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "VLLM_PAYLOAD": "latest", "PART_MIB": "8"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "payload latest re-split: 3 parts of 8 MiB\n"
    assert b"".join((parts / f"part0{i}").read_bytes() for i in range(3)) == payload
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=parts, capture_output=True,
                           text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 3


def test_the_latest_pins_are_the_tested_recipes():
    """scripts/device/wheels-latest.txt is ../shared/device-latest/wheels-latest.txt (the 81
    pins that ran on the H200) with a comment on top; the shared copy does not travel."""
    pins = [line for line in (DEVICE / "wheels-latest.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert len(pins) == 81 and all("==" in p for p in pins)
    versions = dict(p.split("==") for p in pins)
    assert {k: versions[k] for k in ("vllm", "torch", "triton", "torchvision", "nvidia-nccl-cu13")} == {
        "vllm": "0.33.0", "torch": "2.14.0", "triton": "3.8.0", "torchvision": "0.29.0",
        "nvidia-nccl-cu13": "2.30.7"}
    shared = ROOT.parent / "shared" / "device-latest" / "wheels-latest.txt"
    if shared.is_file():
        assert pins == shared.read_text().split()


def test_every_device_script_parses():
    for script in sorted(DEVICE.glob("*.sh")):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, (script.name, done.stderr)
