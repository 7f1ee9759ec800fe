"""vLLM 0.33.0's batch-invariant GEMM, loaded from its source for a side-by-side bench.

``load_vllm_kernel(PATH)`` reads ``vllm/model_executor/determinism/batch_invariant.py`` and its
sibling ``batch_invariant_configs.py`` (vLLM's M-bucketed tuned tables) from PATH — the installed
``vllm`` package directory, its ``model_executor/determinism`` directory, or the
``batch_invariant.py`` file itself (an unzipped wheel works too) — and executes them as private
modules. vLLM itself is not imported: its package ``__init__`` pulls in the whole engine and
overrides environment variables. The handful of ``vllm.*`` names the two files import are
supplied for the duration of the load by small stand-ins backed by torch (``current_platform``
answers from ``torch.cuda``: CUDA, the device's compute capability, so vLLM's loader picks its own
architecture family's table; ``num_compute_units`` is the multiprocessor count), then removed
from ``sys.modules`` again. The kernels, the launcher and the table lookup are vLLM's code,
unchanged.

What the bench calls is ``mm_batch_invariant(a, b, bias)``, the function vLLM's linear layers
reach in batch-invariant mode (it calls ``matmul_persistent`` on CUDA).
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

MODULE_REL = Path("model_executor/determinism/batch_invariant.py")
CONFIGS_NAME = "batch_invariant_configs.py"
_PRIVATE = "bistat_vllm_kernel"
_CONFIGS_IMPORT = "vllm.model_executor.determinism.batch_invariant_configs"
_REQUIRED = ("matmul_persistent", "mm_batch_invariant")
_REQUIRED_CONFIGS = ("_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS", "_get_matmul_config",
                     "_get_tuned_matmul_arch_family")


class VllmKernelError(RuntimeError):
    """PATH does not hold a loadable vLLM batch-invariant GEMM; the message names PATH and why."""


class DeviceCapability(NamedTuple):
    """vllm/platforms/interface.py's ``DeviceCapability`` (the fields its loader reads)."""

    major: int
    minor: int


class _Platform:
    """Stand-in for ``vllm.platforms.current_platform``, answered from torch."""

    def is_cuda(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.hip is None

    def is_cuda_alike(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        import torch

        if not torch.cuda.is_available():
            return None
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))


@functools.cache  # as vLLM's own (vllm/utils/platform_utils.py): not a per-call cost
def _num_compute_units(device_index: int | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        return 4  # the Triton interpreter runs programs one after another
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


@functools.cache  # as vLLM's own (vllm/utils/mem_utils.py)
def _max_shared_memory_bytes(gpu: int = 0) -> int:
    import torch

    props = torch.cuda.get_device_properties(gpu)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def _is_torch_equal_or_newer(target: str) -> bool:
    import torch

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    return key(torch.__version__) >= key(target)


def _pin_nccl_env(*args: Any, **kwargs: Any) -> None:
    raise VllmKernelError("vllm.utils.nccl.pin_nccl_env is not available outside vLLM")


def _stand_ins(configs: types.ModuleType | None) -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    mods = {
        "vllm": module("vllm"),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.platforms": module("vllm.platforms", current_platform=_Platform()),
        "vllm.platforms.interface": module("vllm.platforms.interface",
                                           DeviceCapability=DeviceCapability),
        "vllm.triton_utils": module("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.utils": module("vllm.utils"),
        "vllm.utils.mem_utils": module("vllm.utils.mem_utils",
                                       get_max_shared_memory_bytes=_max_shared_memory_bytes),
        "vllm.utils.nccl": module("vllm.utils.nccl", pin_nccl_env=_pin_nccl_env),
        "vllm.utils.platform_utils": module("vllm.utils.platform_utils",
                                            num_compute_units=_num_compute_units),
        "vllm.utils.torch_utils": module("vllm.utils.torch_utils",
                                         is_torch_equal_or_newer=_is_torch_equal_or_newer),
        "vllm.model_executor": module("vllm.model_executor"),
        "vllm.model_executor.determinism": module("vllm.model_executor.determinism"),
    }
    if configs is not None:
        mods[_CONFIGS_IMPORT] = configs
    return mods


def _exec_file(path: Path, name: str, configs: types.ModuleType | None) -> types.ModuleType:
    """Execute ``path`` as module ``name`` with the stand-ins importable, then remove them."""
    stand_ins = _stand_ins(configs)
    saved = {key: sys.modules.get(key) for key in stand_ins}
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules.update(stand_ins)
    sys.modules[name] = module  # Triton and NamedTuple look the defining module up by name
    try:
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    finally:
        for key, previous in saved.items():
            if previous is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = previous
    return module


def _find_module(path: Path) -> Path:
    candidates = ([path] if path.is_file() else
                  [path / MODULE_REL, path / "batch_invariant.py", path / "vllm" / MODULE_REL])
    for c in candidates:
        if c.is_file() and c.name == "batch_invariant.py":
            return c
    if not path.exists():
        raise VllmKernelError(f"--vllm-kernel {path}: no such file or directory; pass the "
                              f"installed vllm package directory (python -c \"import vllm, os; "
                              f"print(os.path.dirname(vllm.__file__))\") or its "
                              f"{MODULE_REL.as_posix()}")
    raise VllmKernelError(f"--vllm-kernel {path}: found no {MODULE_REL.as_posix()} there (looked "
                          f"for {', '.join(str(c) for c in candidates)}); pass the vllm package "
                          f"directory or that file")


def _version_of(module_file: Path) -> tuple[str | None, str | None]:
    """(version, commit) from ``vllm/_version.py`` beside the package, if it is there."""
    version_file = module_file.parents[2] / "_version.py"
    if not version_file.is_file():
        return None, None
    text = version_file.read_text(encoding="utf-8")
    version = re.search(r"__version__ = version = '([^']+)'", text)
    commit = re.search(r"__commit_id__ = commit_id = '([^']+)'", text)
    return (version.group(1) if version else None, commit.group(1) if commit else None)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class VllmKernel:
    """vLLM's batch-invariant GEMM and its tuned table, loaded from ``path``."""

    path: str
    module_file: str
    configs_file: str
    version: str | None
    commit: str | None
    sha256: dict[str, str]
    module: types.ModuleType = field(repr=False)
    configs: types.ModuleType = field(repr=False)

    def mm(self, a: Any, b: Any, bias: Any = None) -> Any:
        """vLLM's ``mm_batch_invariant(a, b, bias)``: ``a`` [M, K] @ ``b`` [K, N] (+ bias)."""
        return self.module.mm_batch_invariant(a, b, bias)

    def arch_family(self, capability: tuple[int, int] | None) -> str | None:
        cap = DeviceCapability(*capability) if capability is not None else None
        return self.configs._get_tuned_matmul_arch_family(cap)

    def tuned_shapes(self, family: str | None) -> frozenset[tuple[int, int]]:
        """The (N, K) of vLLM's own table for ``family`` (bfloat16 only)."""
        table = self.configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.get(family or "", {})
        return frozenset(table)

    def config_for(self, m: int, n: int, k: int, dtype: Any) -> dict[str, int]:
        """The launch vLLM picks for one GEMM (its table or its fixed default)."""
        import torch

        default = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128,
                   "BLOCK_SIZE_K": 32 if dtype == torch.float32 else 64, "GROUP_SIZE_M": 8,
                   "num_stages": 3, "num_warps": 8}
        return dict(self.configs._get_matmul_config(m, n, k, dtype, default))

    def provenance(self) -> dict[str, Any]:
        return {"path": self.path, "module": self.module_file, "configs": self.configs_file,
                "vllm": self.version, "vllm_commit": self.commit, "sha256": dict(self.sha256)}


def load_vllm_kernel(path: str | Path) -> VllmKernel:
    """Load vLLM's batch-invariant GEMM from ``path`` (see the module docstring).

    Raises
    ------
    VllmKernelError
        Naming ``path`` and what is missing or failed (file not found, the configs module absent,
        a name the bench needs not defined, an import the stand-ins do not cover).
    """
    path = Path(path)
    module_file = _find_module(path)
    configs_file = module_file.with_name(CONFIGS_NAME)
    if not configs_file.is_file():
        raise VllmKernelError(f"--vllm-kernel {path}: {configs_file} is missing; vLLM 0.33.0 "
                              f"keeps its tuned tables there (older releases have no "
                              f"determinism/ module: use the vllm package of 0.33.0 or later)")
    try:
        configs = _exec_file(configs_file, f"{_PRIVATE}.batch_invariant_configs", None)
        module = _exec_file(module_file, f"{_PRIVATE}.batch_invariant", configs)
    except VllmKernelError:
        raise
    except Exception as exc:  # any failure of vLLM's module code: say which file and why
        raise VllmKernelError(f"--vllm-kernel {path}: loading {module_file} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    missing = [n for n in _REQUIRED if not callable(getattr(module, n, None))]
    missing += [n for n in _REQUIRED_CONFIGS if not hasattr(configs, n)]
    if missing:
        raise VllmKernelError(f"--vllm-kernel {path}: {module_file.name} / {configs_file.name} "
                              f"define no {', '.join(missing)}; this bench reads vLLM 0.33.0's "
                              f"layout")
    version, commit = _version_of(module_file)
    return VllmKernel(str(path), str(module_file), str(configs_file), version, commit,
                      {module_file.name: _sha256(module_file),
                       configs_file.name: _sha256(configs_file)}, module, configs)
