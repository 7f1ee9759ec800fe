"""vLLM's wheels on this machine, for the tests that read vLLM's own code (none needs torch).

The wheels are fetched by hand, never by the tests: ``pip download --no-deps vllm==VERSION -d
/tmp/vllmwheels``; where one is absent, a test that needs it skips and says so.
"""

from __future__ import annotations

import sys
import types
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest


CONFIGS_IN_WHEEL = "vllm/model_executor/determinism/batch_invariant_configs.py"
VLLM_WHEELS = Path("/tmp/vllmwheels")  # pip download --no-deps vllm==VERSION -d /tmp/vllmwheels


def vllm_wheel(version: str) -> Path:
    return VLLM_WHEELS / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"


class _DeviceCapability(NamedTuple):  # vllm/platforms/interface.py's, fields only
    major: int
    minor: int


def load_vllm_configs_module(monkeypatch, wheel: Path,
                             capability: tuple[int, int] = (9, 0)) -> types.ModuleType:
    """vLLM's batch_invariant_configs.py from ``wheel``, executed with vllm.platforms stubbed to
    report ``capability``; skips the test where the wheel is not on this machine."""
    if not wheel.is_file():
        pytest.skip(f"{wheel} is not on this machine (pip download vllm==VERSION --no-deps -d "
                    f"{wheel.parent})")
    source = zipfile.ZipFile(wheel).read(CONFIGS_IN_WHEEL).decode()
    platform = types.SimpleNamespace(is_cuda=lambda: True,
                                     get_device_capability=lambda: _DeviceCapability(*capability))
    stubs = {"vllm": types.ModuleType("vllm"),
             "vllm.platforms": types.ModuleType("vllm.platforms"),
             "vllm.platforms.interface": types.ModuleType("vllm.platforms.interface"),
             "vllm.model_executor": types.ModuleType("vllm.model_executor"),
             "vllm.model_executor.determinism": types.ModuleType("vllm.model_executor.determinism")}
    stubs["vllm.platforms"].current_platform = platform
    stubs["vllm.platforms.interface"].DeviceCapability = _DeviceCapability
    name = "vllm.model_executor.determinism.batch_invariant_configs"
    module = types.ModuleType(name)
    module.__file__ = f"{wheel}/{CONFIGS_IN_WHEEL}"
    for key, stub in {**stubs, name: module}.items():
        monkeypatch.setitem(sys.modules, key, stub)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
