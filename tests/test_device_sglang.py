"""The SGLang 0.5.23 payload for the lent H200, on the CPU: the environment it gets, the pins
build_payload.sh downloads and how they derive from the vLLM 0.34.0 recipe, and the import
simulation that chose them (scripts/device/sglang_imports.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "scripts" / "device"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _pins(name: str) -> dict[str, str]:
    lines = [line for line in (DEVICE / name).read_text().splitlines()
             if line and not line.startswith("#")]
    assert all(line.count("==") == 1 for line in lines) and len(set(lines)) == len(lines)
    return dict(line.split("==") for line in lines)


def test_the_sglang_pins_are_the_034_stack_with_sglang_instead_of_vllm():
    """SGLang's own exact pins (torch 2.14.1, sglang-kernel 0.4.10, flashinfer-python 0.7.2, and
    where it pins a package the 0.34 set carries at another version), the rest of the 0.34 set
    unchanged, and what SGLang imports at load that the image lacks."""
    old, new = _pins("wheels-0.34.txt"), _pins("wheels-sglang-0.5.23.txt")
    assert {k: new[k] for k in ("sglang", "sglang-kernel", "flashinfer-python", "torch", "triton",
                                "nvidia-nccl-cu13", "sgl-deep-gemm")} == {
        "sglang": "0.5.23", "sglang-kernel": "0.4.10", "flashinfer-python": "0.7.2",
        "torch": "2.14.1", "triton": "3.8.0", "nvidia-nccl-cu13": "2.30.7",
        "sgl-deep-gemm": "0.2.3.post2"}
    assert "vllm" not in new
    changed = {k: (old[k], new[k]) for k in old if k in new and old[k] != new[k]}
    assert changed == {"torch": ("2.14.0", "2.14.1"), "torchvision": ("0.29.0", "0.29.1"),
                       "transformers": ("5.22.2", "5.19.0"), "tokenizers": ("0.23.3", "0.23.2"),
                       "openai": ("3.42.1", "2.8.0"), "xgrammar": ("0.2.8", "0.2.7"),
                       "compressed-tensors": ("0.17.0", "0.18.0")}
    assert set(old) - set(new) == {"vllm"}
    added = set(new) - set(old)
    assert {"ipython", "soundfile", "zstandard", "uvloop", "nvidia-ml-py",
            "nvidia-cutlass-dsl-libs-cu13"} <= added and len(added) == 26


def _env(payload: str, tmp_path: Path) -> dict[str, str]:
    done = subprocess.run(["bash", "-c", f"export VLLM_PAYLOAD={payload}; . {DEVICE / 'env.sh'} && env"],
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "REPO": "/r"})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_env_gives_the_sglang_payload_the_carried_torch_site(tmp_path):
    env = _env("sglang", tmp_path)
    assert (env["SITE"], env["PYTHONPATH"]) == ("/tmp/site-latest", "/r/src:/tmp/site-latest")
    assert env["PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK"] == "1"
    assert {k: env[k] for k in ("NCCL_NVLS_ENABLE", "BISTAT_PACKAGE_INDEX", "HF_HUB_OFFLINE")} == {
        "NCCL_NVLS_ENABLE": "0", "BISTAT_PACKAGE_INDEX": "off", "HF_HUB_OFFLINE": "1"}


def test_build_payload_takes_the_sglang_pins(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    for f in ("build_payload.sh", "wheels-sglang-0.5.23.txt"):
        shutil.copy(DEVICE / f, repo / "scripts" / "device" / f)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/pip.log\nexit 1\n')
    (stub / "python3").chmod(0o755)
    done = subprocess.run(["bash", str(repo / "scripts" / "device" / "build_payload.sh")],
                          capture_output=True, text=True, cwd=repo,
                          env={"PATH": f"{stub}:/usr/bin:/bin", "PAYLOAD": "sglang",
                               "W": str(tmp_path / "w"), "PART_MIB": "60"})
    assert done.returncode == 1  # the stub's pip fails: nothing downloaded, the script stops
    (call,) = (tmp_path / "pip.log").read_text().splitlines()
    assert call.endswith(f"-r {repo}/scripts/device/wheels-sglang-0.5.23.txt")
    assert "--python-version 3.12" in call and "--abi cp312" in call


def test_install_writes_the_pth_reader_and_smoke_for_sglang():
    text = (DEVICE / "install.sh").read_text()
    assert "site.addsitedir" in text and "sglang_smoke.py" in (DEVICE / "README.md").read_text()
    done = subprocess.run(["bash", "-n", str(DEVICE / "install.sh")], capture_output=True)
    assert done.returncode == 0


def _imports():
    spec = importlib.util.spec_from_file_location("sglang_imports", DEVICE / "sglang_imports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_import_simulation_sorts_required_conditional_and_optional(tmp_path):
    pkg = tmp_path / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from sglang.utils import x\n")
    (pkg / "utils.py").write_text("import numpy as np\nfrom IPython.display import HTML\n"
                                  "def later():\n    import matplotlib\n")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "server.py").write_text(
        "import os, json\nfrom . import backend\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pandas\n"
        "try:\n    import vllm\nexcept ImportError:\n    vllm = None\n")
    (pkg / "srt" / "backend.py").write_text(
        "import torch\nif is_npu():\n    import torch_npu\n"
        "class K:\n    import zmq\n")
    found = _imports().closure(tmp_path, ["sglang.srt.server"])
    assert found == {"numpy": ("required", "sglang.utils"),
                     "IPython": ("required", "sglang.utils"),
                     "torch": ("required", "sglang.srt.backend"),
                     "zmq": ("required", "sglang.srt.backend"),
                     "torch_npu": ("conditional", "sglang.srt.backend"),
                     "vllm": ("optional", "sglang.srt.server")}


WHEEL = Path("/tmp/sglwheel")


def test_the_simulation_on_the_wheel_finds_what_the_pins_carry():
    """On SGLang 0.5.23's wheel (where this machine has it unpacked at /tmp/sglsrc): every
    third-party module the launcher imports unconditionally at load comes from the image or the pins."""
    site = Path("/tmp/sglsrc")
    if not (site / "sglang" / "srt" / "server_args.py").is_file():
        pytest.skip("SGLang 0.5.23's wheel is not unpacked at /tmp/sglsrc (pip download --no-deps "
                    "sglang==0.5.23, then unzip)")
    found = _imports().closure(site, _imports().ENTRIES)
    required = {name for name, (kind, _) in found.items() if kind == "required"}
    assert {"torch", "sgl_kernel", "IPython", "zmq", "msgspec", "orjson", "uvloop"} <= required
    assert found["flashinfer"][0] == "conditional" and found["deep_gemm"][0] == "conditional"
