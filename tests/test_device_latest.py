"""The device scripts' payloads: vLLM 0.25.0 (/tmp/site), and vLLM 0.34.0, the newest
release (`latest`), or 0.33.0 (`0.33`), each with torch 2.14 carried (/tmp/site-latest). What can
be checked without the GPU: the environment each payload gets, staging either payload's parts,
re-splitting the latest one with a checksum per part, and that the pins build_payload.sh downloads
are the tested recipe's (0.33.0) or derived from it (0.34.0)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from external import vllm_wheel

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "scripts" / "device"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _env(payload: str | None, tmp_path: Path, repo: str = "/r") -> dict[str, str]:
    script = (f"export VLLM_PAYLOAD={payload}; " if payload else "unset VLLM_PAYLOAD; ") + (
        f". {DEVICE / 'env.sh'} && env")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "REPO": repo})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_env_gives_each_payload_its_site_and_the_latest_its_cudnn_setting(tmp_path):
    latest, old = _env("latest", tmp_path), _env("0.25", tmp_path)
    v033 = _env("0.33", tmp_path)  # 0.33.0 on the same carried stack and site
    assert v033.pop("VLLM_PAYLOAD") == "0.33" and latest["VLLM_PAYLOAD"] == "latest"
    assert v033 == {k: v for k, v in latest.items() if k != "VLLM_PAYLOAD"}
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


def test_env_exports_the_commit_travel_sh_says_travelled(tmp_path):
    assert "BISTAT_SOURCE_COMMIT" not in _env("latest", tmp_path)     # no note: none declared
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    (repo / "scripts" / "device" / "SOURCE_COMMIT").write_text("a" * 40 + " dirty\n")
    env = _env("latest", tmp_path, repo=str(repo))
    assert env["BISTAT_SOURCE_COMMIT"] == "a" * 40 + " dirty"


def test_env_refuses_an_unknown_payload(tmp_path):
    done = subprocess.run(["bash", "-c", f"export VLLM_PAYLOAD=0.40; . {DEVICE / 'env.sh'}"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                               "OUT": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr == "env.sh: VLLM_PAYLOAD=0.40; expected 0.25, 0.33, latest or sglang\n"


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


def _pins(name: str) -> dict[str, str]:
    lines = [line for line in (DEVICE / name).read_text().splitlines()
             if line and not line.startswith("#")]
    assert all(line.count("==") == 1 for line in lines) and len(set(lines)) == len(lines)
    return dict(line.split("==") for line in lines)


def test_the_033_pins_are_the_tested_recipes():
    """scripts/device/wheels-0.33.txt is ../shared/device-latest/wheels-latest.txt (the 81 pins
    that ran on the H200) with a comment on top; the shared copy does not travel."""
    pins = _pins("wheels-0.33.txt")
    assert len(pins) == 81
    assert {k: pins[k] for k in ("vllm", "torch", "triton", "torchvision", "nvidia-nccl-cu13")} == {
        "vllm": "0.33.0", "torch": "2.14.0", "triton": "3.8.0", "torchvision": "0.29.0",
        "nvidia-nccl-cu13": "2.30.7"}
    shared = ROOT.parent / "shared" / "device-latest" / "wheels-latest.txt"
    if shared.is_file():
        assert [f"{k}=={v}" for k, v in pins.items()] == shared.read_text().split()


def test_the_034_pins_are_the_033_recipe_with_the_newest_vllm_and_its_new_floors():
    """0.34.0 pins the same torch stack as 0.33.0 (torch 2.14.0, torchvision 0.29.0, torchaudio
    2.11.0, numba 0.65.0); its Requires-Dist raised huggingface_hub to >= 2 (the image's
    transformers 5.17 caps it below 2, so transformers travels), filelock, tokenizers and
    mistral_common. The 0.34 set is the 0.33 set with vLLM swapped and nine pins added (truststore after the
    device: huggingface-hub 2.4 imports httpcore2, which imports it)."""
    old, new = _pins("wheels-0.33.txt"), _pins("wheels-0.34.txt")
    assert new["vllm"] == "0.34.0" and {k: v for k, v in new.items() if k in old and k != "vllm"} == {
        k: v for k, v in old.items() if k != "vllm"}
    assert {k: v for k, v in new.items() if k not in old} == {
        "transformers": "5.22.2", "huggingface-hub": "2.4.0", "hf-xet": "1.8.0",
        "filelock": "4.2.11", "tokenizers": "0.23.3", "click": "8.5.1", "typer": "0.29.1",
        "shellingham": "1.5.4", "truststore": "0.10.5"}
    assert old["mistral-common"] == "1.13.1"  # 0.34 asks >= 1.13.0: already carried


@pytest.mark.parametrize("payload,pins", [("latest", "wheels-0.34.txt"), ("0.33", "wheels-0.33.txt")])
def test_build_payload_takes_each_payloads_pins(tmp_path, payload, pins):
    """Which pin file a payload downloads (python3 is a stub that records pip's arguments)."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    for f in ("build_payload.sh", "wheels-0.33.txt", "wheels-0.34.txt"):
        shutil.copy(DEVICE / f, repo / "scripts" / "device" / f)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/pip.log\nexit 1\n')
    (stub / "python3").chmod(0o755)
    done = subprocess.run(["bash", str(repo / "scripts" / "device" / "build_payload.sh")],
                          capture_output=True, text=True, cwd=repo,
                          env={"PATH": f"{stub}:/usr/bin:/bin", "VLLM_PAYLOAD": payload,
                               "W": str(tmp_path / "w"), "PART_MIB": "60"})
    assert done.returncode == 1  # the stub's pip fails: nothing downloaded, the script stops
    (call,) = (tmp_path / "pip.log").read_text().splitlines()
    assert call.endswith(f"-r {repo}/scripts/device/{pins}")


def test_every_device_script_parses():
    for script in sorted(DEVICE.glob("*.sh")):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, (script.name, done.stderr)


def _vllm_patches():
    import importlib.util
    spec = importlib.util.spec_from_file_location("vllm_patches", DEVICE / "vllm_patches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_034_patch_applies_to_the_stock_file_only_and_once(tmp_path):
    """The stock file (from the 0.34.0 wheel in BISTAT_VLLM_WHEELS) is replaced by the no-op; a
    second run reports it applied; a file with other bytes is refused and left as it was."""
    import zipfile

    vp = _vllm_patches()
    (rel, (stock, text)), = vp.PATCHES.items()
    target = tmp_path / "site" / rel
    target.parent.mkdir(parents=True)
    with zipfile.ZipFile(vllm_wheel("0.34.0")) as wheel:
        target.write_bytes(wheel.read(rel))
    assert vp._sha256(target) == stock  # the recorded digest is the wheel's file
    (target.parent / "__pycache__").mkdir()
    pyc = target.parent / "__pycache__" / "minimax_m3_msa_warmup.cpython-312.pyc"
    pyc.write_bytes(b"stale")
    assert vp.apply(tmp_path / "site") == [
        f"vllm_patches: {rel} patched (stock sha256 {stock[:16]}...)"]
    assert target.read_text() == text and not pyc.exists()
    namespace: dict = {}
    exec(compile(text, str(target), "exec"), namespace)
    assert namespace["minimax_m3_msa_warmup"](object()) is None
    assert vp.apply(tmp_path / "site") == [f"vllm_patches: {rel} already patched"]


def test_the_034_patch_refuses_a_file_it_was_not_written_for(tmp_path):
    vp = _vllm_patches()
    (rel, (stock, _)), = vp.PATCHES.items()
    target = tmp_path / "site" / rel
    target.parent.mkdir(parents=True)
    target.write_text("def minimax_m3_msa_warmup(worker):\n    import cutlass\n")
    before = target.read_bytes()
    with pytest.raises(SystemExit) as err:
        vp.apply(tmp_path / "site")
    assert str(err.value).startswith(f"vllm_patches: {target} has sha256 ")
    assert str(err.value).endswith(f"not vLLM 0.34.0's {stock}: nothing patched; check the file "
                                   "and this script's PATCHES")
    assert target.read_bytes() == before
    with pytest.raises(SystemExit, match="is missing"):
        vp.apply(tmp_path / "elsewhere")


@pytest.mark.parametrize("found", ["0.33", ""])
def test_install_redoes_a_shared_site_that_holds_another_payload(tmp_path, found):
    # 0.33 and latest unpack into one folder and install into one site: a warm machine that had
    # one must not run the other's studies on it under the new name
    pl, site = tmp_path / "pl-latest", tmp_path / "site-latest"
    for folder, marker in ((pl, ".unpacked"), (site, ".installed")):
        (folder / "payload").mkdir(parents=True)
        (folder / marker).write_text(found + ("\n" if found else ""))
    done = subprocess.run(
        ["bash", str(DEVICE / "install.sh")], capture_output=True, text=True, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "REPO": str(tmp_path),
             "VLLM_PAYLOAD": "latest", "PL_LATEST": str(pl), "SITE_LATEST": str(site),
             "STAGE_LATEST": str(tmp_path / "no-stage")})
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"[install] {pl}/.unpacked is payload '{found}', not 'latest': removing {pl} and {site}",
        f"[install] no {tmp_path / 'no-stage'}: stage the parts first"]
    assert not pl.exists() and not site.exists()


def test_the_device_readme_is_a_runbook_and_every_script_it_names_exists():
    """scripts/device/README.md holds the steps (per payload: build, stage, install, smoke, run,
    pack, import) in at most 150 lines; the sessions' accounts live in the data folders'
    READMEs it names."""
    import re

    text = (DEVICE / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == [
        "The machine", "Rules", "Payloads", "The steps", "One session (device calls, back to back)",
        "Per payload", "The next sessions"]
    steps = re.findall(r"^\s*\d+\. \*\*(\w+)\*\*", text, flags=re.M)
    assert steps == ["Build", "Stage", "Install", "Smoke", "Run", "Snapshots", "Stop", "Probe",
                     "Pack", "Import"]
    assert "**SGLang 0.5.23**" in text and "sglang_smoke.py" in text
    assert "as it went" not in text
    for folder in ("data/h200/", "data/h200-v033/", "data/h200-v034/", "data/h100-sglang/"):
        assert f"`{folder}`" in text
        assert "## The device sess" in (ROOT / folder / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b([\w-]+\.(?:sh|py))\b", text))
    missing = sorted(n for n in named if not (DEVICE / n).is_file()
                     and not list(ROOT.glob(f"*/**/{n}")))
    assert missing == []
