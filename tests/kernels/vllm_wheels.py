"""vLLM's own batch-invariant table module, executed from a wheel, for the tests that read vLLM's
code (none needs vLLM installed). The wheel comes from the folder ``BISTAT_VLLM_WHEELS`` names
(tests/external.py), never from a fixed path: unset, a test that needs it skips and says so.
"""

from __future__ import annotations

import sys
import types
import zipfile
from pathlib import Path
from typing import NamedTuple



from external import vllm_wheel  # noqa: F401 - the wheel BISTAT_VLLM_WHEELS names

CONFIGS_IN_WHEEL = "vllm/model_executor/determinism/batch_invariant_configs.py"


class _DeviceCapability(NamedTuple):  # vllm/platforms/interface.py's, fields only
    major: int
    minor: int


def load_vllm_configs_module(monkeypatch, wheel: Path,
                             capability: tuple[int, int] = (9, 0)) -> types.ModuleType:
    """vLLM's batch_invariant_configs.py from ``wheel``, executed with vllm.platforms stubbed to
    report ``capability``."""
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
