"""The package builds without a warning and ships every data file it reads.

``bash scripts/main.sh`` on a fresh clone installs bistat first (``pip install -e .``); setuptools'
warnings there were the first thing a new user read: ``project.license`` as a TOML table
(deprecated since setuptools 77) and every data folder "absent from the packages configuration".
Here the same configuration is built with warnings turned into errors (``python -W error``), into
a temporary folder: nothing is written into the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked_data_files() -> set[str]:
    """Every tracked file of the two packages that is not Python, as its path in the package."""
    out = subprocess.run(["git", "ls-files", "src/bistat", "kernels/bistat_kernels"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return {p.split("/", 1)[1] for p in out if not p.endswith(".py")}


def test_the_package_builds_without_a_warning_and_ships_its_data_files(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    from packaging.version import Version

    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(f"setuptools {setuptools.__version__}: the SPDX license string needs 77 "
                    f"(the [dev] extra installs it)")
    lib = tmp_path / "lib"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-W", "error", "setup.py", "-q",
                           "egg_info", "--egg-base", str(tmp_path), "build_py", "--build-lib", str(lib)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the one line build_py prints where PYTHONDONTWRITEBYTECODE is set is not a warning of ours
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.strip() and line != "warning: build_py: byte-compiling is disabled, skipping."]
    assert said == []
    shipped = {str(p.relative_to(lib)) for p in lib.rglob("*")
               if p.is_file() and p.suffix != ".py"}
    assert shipped == _tracked_data_files()
    assert {"bistat/data/vllm_args.json", "bistat/schemas/run.schema.json",
            "bistat_kernels/tables/nvidia_h200.json"} <= shipped
