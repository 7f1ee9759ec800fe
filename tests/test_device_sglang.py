"""The SGLang 0.5.23 payload for the lent H200, on the CPU: the environment it gets, the pins
build_payload.sh downloads and how they derive from the vLLM 0.34.0 recipe, and the import
simulation that chose them (scripts/device/sglang_imports.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from external import SGLANG_PAYLOAD_SITE_VAR, SGLANG_WHEELS_VAR, named_folder

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
            "nvidia-cutlass-dsl-libs-cu13", "distro", "nvidia-cutlass-dsl-libs-core"} <= added
    assert len(added) == 28


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


def _named(var: str) -> Path:
    """The folder ``var`` names (tests/external.py); the test skips where it is unset."""
    path = named_folder(var, "bash scripts/device/build_payload.sh with PAYLOAD=sglang, then "
                             "unzip every wheel of $W/payload/whl into one folder")
    assert path.is_dir(), f"{var}={path} is not a folder"
    return path


def test_the_simulation_on_the_wheel_finds_what_the_pins_carry():
    """On the SGLang 0.5.23 payload's site: every third-party module the launcher imports
    unconditionally at load comes from the image or the pins."""
    site = _named(SGLANG_PAYLOAD_SITE_VAR)
    found = _imports().closure(site, _imports().ENTRIES)
    required = {name for name, (kind, _) in found.items() if kind == "required"}
    assert {"torch", "sgl_kernel", "IPython", "zmq", "msgspec", "orjson", "uvloop"} <= required
    assert found["flashinfer"][0] == "conditional" and found["deep_gemm"][0] == "conditional"


def test_the_payload_site_misses_no_import_on_the_load_and_model_path():
    """The same site through every package (payload_check.py imports): nothing that the server
    or its model's construction imports unconditionally is missing."""
    site = _named(SGLANG_PAYLOAD_SITE_VAR)
    done = subprocess.run([sys.executable, str(DEVICE / "payload_check.py"), "imports", str(site)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith("imports: 0 missing")


def test_the_requires_snapshot_is_the_wheels_own_metadata():
    wheels = _named(SGLANG_WHEELS_VAR)
    check = _check()
    snap = json.loads((DEVICE / "wheels-sglang-0.5.23.requires.json").read_text())
    assert check.snapshot(wheels) == snap


def _check():
    spec = importlib.util.spec_from_file_location("payload_check", DEVICE / "payload_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PINS = DEVICE / "wheels-sglang-0.5.23.txt"


def test_every_pinned_wheels_own_requirements_are_met():
    """Every Requires-Dist of every pinned wheel (markers for the device, the extras its
    dependents ask for) is pinned at an admitted version, on the image, or left out with a reason."""
    check = _check()
    snap = json.loads((DEVICE / "wheels-sglang-0.5.23.requires.json").read_text())
    pinned = check.pins(PINS)
    # build_payload.sh adds platformdirs (bistat's own need) beside the pins
    assert set(snap) == set(pinned) | {"platformdirs"}, "the snapshot and the pins differ"
    assert check.unmet(pinned, snap, check.image_packages(), check.left_out(PINS),
                       check.version_ok(PINS)) == []
    assert {"distro", "nvidia-cutlass-dsl-libs-core"} <= set(pinned)
    assert all(len(why.split()) >= 3 for why in check.left_out(PINS).values())  # a reason each


def test_the_requirements_check_finds_what_the_old_pins_lacked():
    """The pins as first committed (without distro and cutlass-dsl's libs-core) fail the check,
    naming the wheel that needs each: openai imports distro at load, and libs-base needs libs-core
    (which holds cutlass's Python package, cutlass.cute among it)."""
    check = _check()
    snap = json.loads((DEVICE / "wheels-sglang-0.5.23.requires.json").read_text())
    pinned = {k: v for k, v in check.pins(PINS).items()
              if k not in ("distro", "nvidia-cutlass-dsl-libs-core")}
    problems = check.unmet(pinned, snap, check.image_packages(), check.left_out(PINS),
                           check.version_ok(PINS))
    assert [p.split(":")[0] for p in problems] == [
        "nvidia-cutlass-dsl-libs-base needs nvidia-cutlass-dsl-libs-core==4.8.0",
        "openai needs distro<2,>=1.7.0", "sglang needs distro"]


def test_extras_asked_by_a_dependent_are_followed_and_markers_read_for_the_device():
    check = _check()
    from packaging.version import Version

    pinned = {"app": Version("1"), "lib": Version("2.0"), "lib-cu13": Version("2.0")}
    requires = {"app": ["lib[cu13]==2.0", "winonly; sys_platform == 'win32'",
                        "old; python_version < '3.11'"],
                "lib": ["lib-cu12==2.0", "lib-cu13==2.0; extra == 'cu13'",
                        "qnx==2.0; extra == 'qnx'"],
                "lib-cu13": ["numpy>=1"]}
    assert check.unmet(pinned, requires, {"numpy"}, {}) == [
        "lib needs lib-cu12==2.0: neither pinned nor on the device image (pin it, or add "
        "'# left-out: lib-cu12 WHY' to the pins)"]
    assert check.unmet(pinned, requires, {"numpy"}, {"lib-cu12": "the CUDA 12 build"}) == []
    pinned["lib-cu13"] = Version("1.9")
    assert check.unmet(pinned, requires, {"numpy"}, {"lib-cu12": "x"}) == [
        "lib needs lib-cu13==2.0; extra == \"cu13\": pinned lib-cu13==1.9"]


def _site(tmp_path: Path) -> Path:
    """A site as a payload leaves it: an SGLang module that builds its model through a
    function-level import, a dependency with a module-level import of its own, a .pth file that
    adds a folder (as cutlass-dsl's does), guarded and fallback imports that must not count."""
    site = tmp_path / "site"
    files = {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/server.py": "import openai\nfrom sglang.srt import gemm\n",
        "sglang/srt/gemm.py": "def build():\n    from sglang.kernels.dual import Dual\n",
        "sglang/kernels/__init__.py": "",
        "sglang/kernels/dual.py": "import cutlass.cute as cute\nclass Dual: pass\n",
        "openai/__init__.py": "from . import _base\nfrom ._base import Client\n",
        "openai/_base.py": ("import distro\nfrom contextlib import suppress\n"
                            "with suppress(ImportError):\n    import fancy\n"
                            "try:\n    import _thread\nexcept ImportError:\n    import _dummy\n"
                            "class Client: pass\n"),
        "dsl/__init__.py": "",
        "dsl/packages/cutlass/__init__.py": "from .cute import x\n",
        "ext/__init__.py": "from ext._lib._core import y\n",
        "ext/_lib.cpython-312-x86_64-linux-gnu.so": "",
        "dsl_packages.pth": ("import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], "
                             "'packages'))\n"),
    }
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return site


def test_the_import_check_follows_dependencies_pth_folders_and_the_model_path(tmp_path):
    site = _site(tmp_path)
    check = _check()
    entries = ["sglang.srt.server", "sglang.kernels.dual", "ext"]
    # the old simulation follows only sglang: it sees neither distro nor cutlass.cute missing
    old = _imports().closure(site, entries)
    assert not getattr(old, "missing", {}) and set(old) == {"openai", "cutlass", "ext"}
    missing = check.missing_imports(site, entries, set())
    assert [m.split(" ")[0] for m in missing] == ["cutlass.cute", "distro"]
    assert "openai._base <- openai <- sglang.srt.server" in missing[1]
    (site / "distro.py").write_text("")
    (site / "dsl/packages/cutlass/cute.py").write_text("x = 1\n")
    assert check.missing_imports(site, entries, set()) == []
    # a module on the image counts as present
    (site / "distro.py").unlink()
    assert check.missing_imports(site, entries, {"distro"}) == []


def test_the_device_import_check_names_the_module_and_fails(tmp_path):
    (tmp_path / "good.py").write_text("")
    (tmp_path / "bad.py").write_text("import cutlass.cute\n")
    done = subprocess.run([sys.executable, str(DEVICE / "sglang_imports.py"), "--import-check",
                           "good", "bad"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1
    assert "[import-check] bad: ModuleNotFoundError: No module named 'cutlass'" in done.stdout
    assert "1 of 2 modules import" in done.stdout


def test_install_stops_on_an_import_failure_instead_of_going_on():
    text = (DEVICE / "install.sh").read_text()
    assert "SMOKE FAILED rc=$?\"; exit 6" in text and "IMPORT CHECK FAILED\"; exit 6" in text
    assert 'echo "[install] SMOKE FAILED rc=$?"\n' not in text
    assert "WARNING: Target directory" not in text  # no pip warning is filtered out


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal wheel (the dist-info pip reads, unhashed RECORD) holding ``files``."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                    "true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "".join(f"{r},,\n" for r in [*files, f"{info}/METADATA",
                                                                   f"{info}/WHEEL", f"{info}/RECORD"]))
    return path


def test_site_install_merges_wheels_that_share_a_top_level_folder(tmp_path):
    """libs-base and libs-core both install into nvidia_cutlass_dsl/: a second wheel of a shared
    folder installed later is merged, where pip --target alone skips it with a warning."""
    base = _wheel(tmp_path, "libs_base", {"shared/base.py": "B = 1\n"})
    core = _wheel(tmp_path, "libs_core", {"shared/dsl/cutlass/__init__.py": "C = 1\n"})
    plain, merged = tmp_path / "plain", tmp_path / "merged"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--disable-pip-version-check"]
    for w in (base, core):
        subprocess.run(pip + ["--target", str(plain), str(w)], capture_output=True, check=True)
    assert not (plain / "shared/dsl/cutlass/__init__.py").exists()  # what the old install did
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for w in (base, core):
        done = subprocess.run(["bash", str(DEVICE / "site_install.sh"), str(merged), str(w)],
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    assert (merged / "shared/base.py").read_text() == "B = 1\n"
    assert (merged / "shared/dsl/cutlass/__init__.py").read_text() == "C = 1\n"
    assert "merged into folders it had: shared" in done.stdout
    assert not list(tmp_path.glob("merged.new.*"))  # the temporary folder is gone
    done = subprocess.run(["bash", str(DEVICE / "site_install.sh"), str(merged),
                           str(tmp_path / "missing.whl")], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "[site-install] pip failed" in done.stdout


def test_env_sets_cuda_home_for_sglang_jit(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    done = subprocess.run(["bash", "-c", f"export VLLM_PAYLOAD=sglang CUDA_HOME={cuda}; "
                           f". {DEVICE / 'env.sh'} && echo $CUDA_HOME && echo $PATH"],
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "REPO": "/r"})
    home, path = done.stdout.split()
    assert home == str(cuda) and f":{cuda}/bin:" in f":{path}"
