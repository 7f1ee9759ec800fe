"""Loading vLLM 0.33.0's batch-invariant GEMM for the bench (``--vllm-kernel PATH``).

The loader's errors name PATH and what is wrong; a vLLM-shaped module loads with the stand-ins and
leaves ``sys.modules`` as it was. Where BISTAT_VLLM_WHEELS names a folder with the 0.33.0 wheel
(tests/external.py), vLLM's own kernel runs under the interpreter: its rows are bitwise
invariant at K 512, and its float32 GEMM fails the float32 gate because its ``tl.dot`` takes the
default TF32 precision (vLLM #55466; conftest's dot rounds to TF32 where a GPU would).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from external import vllm_wheel
from helpers_kernels import torch

from bistat.cli import cli
from bistat_kernels import probe, vllm_kernel  # noqa: E402

_FAKE_MODULE = '''
from vllm.model_executor.determinism.batch_invariant_configs import _get_matmul_config
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.platform_utils import num_compute_units


def matmul_persistent(a, b, bias=None):
    return a @ b if bias is None else a @ b + bias


def mm_batch_invariant(a, b, bias=None):
    return matmul_persistent(a, b, bias)
'''
_FAKE_CONFIGS = '''
from vllm.platforms.interface import DeviceCapability

_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS = {"hopper": {(64, 32): None}}


def _get_tuned_matmul_arch_family(capability):
    return "hopper" if capability is not None and capability.major == 9 else None


def _get_matmul_config(M, N, K, dtype, default):
    return default
'''


def _layout(root: Path, module: str | None = _FAKE_MODULE,
            configs: str | None = _FAKE_CONFIGS) -> Path:
    """A vllm package directory with the two determinism files (either may be left out)."""
    det = root / "vllm" / "model_executor" / "determinism"
    det.mkdir(parents=True)
    if module is not None:
        (det / "batch_invariant.py").write_text(module, encoding="utf-8")
    if configs is not None:
        (det / "batch_invariant_configs.py").write_text(configs, encoding="utf-8")
    (root / "vllm" / "_version.py").write_text(
        "__version__ = version = '9.9.9'\n__commit_id__ = commit_id = 'gabc'\n", encoding="utf-8")
    return root / "vllm"


def test_a_vllm_shaped_package_loads_from_any_of_the_three_paths(tmp_path):
    pkg = _layout(tmp_path)
    before = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    for path in (pkg, pkg / "model_executor" / "determinism",
                 pkg / "model_executor" / "determinism" / "batch_invariant.py"):
        k = vllm_kernel.load_vllm_kernel(path)
        assert (k.version, k.commit) == ("9.9.9", "gabc")
        assert k.module_file == str(pkg / "model_executor/determinism/batch_invariant.py")
        assert set(k.sha256) == {"batch_invariant.py", "batch_invariant_configs.py"}
        a, b = torch.ones(2, 3), torch.ones(3, 4)
        assert torch.equal(k.mm(a, b), torch.full((2, 4), 3.0))
        assert k.arch_family((9, 0)) == "hopper" and k.arch_family((8, 0)) is None
        assert k.tuned_shapes("hopper") == frozenset({(64, 32)})
        assert k.provenance()["vllm"] == "9.9.9"
    # the stand-ins were importable during the load only
    assert {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")} == before


@pytest.mark.parametrize("setup, message", [
    (lambda root: root / "missing",
     r"--vllm-kernel {root}/missing: no such file or directory; pass the installed vllm package "
     r"directory"),
    (lambda root: root,
     r"--vllm-kernel {root}: found no model_executor/determinism/batch_invariant\.py there"),
    (lambda root: _layout(root, configs=None),
     r"--vllm-kernel {root}/vllm: .*batch_invariant_configs\.py is missing; vLLM 0\.33\.0 keeps "
     r"its tuned tables there"),
    (lambda root: _layout(root, module="raise ZeroDivisionError('boom')\n"),
     r"--vllm-kernel {root}/vllm: loading .*batch_invariant\.py failed: ZeroDivisionError: boom"),
    (lambda root: _layout(root, module="from vllm.distributed import x\n"),
     r"--vllm-kernel {root}/vllm: loading .*batch_invariant\.py failed: "
     r"ModuleNotFoundError: No module named 'vllm.distributed'"),
    (lambda root: _layout(root, module="def matmul_persistent(a, b, bias=None): pass\n"),
     r"--vllm-kernel {root}/vllm: batch_invariant\.py / batch_invariant_configs\.py define no "
     r"mm_batch_invariant; this bench reads vLLM 0\.33\.0's layout"),
])
def test_loader_errors_name_the_path_and_the_problem(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(vllm_kernel.VllmKernelError, match=message.format(root=tmp_path)):
        vllm_kernel.load_vllm_kernel(path)


def test_bench_reports_a_bad_vllm_kernel_path_before_the_missing_gpu(tmp_path):
    result = CliRunner().invoke(cli, ["kernels", "bench", "--vllm-kernel",
                                      str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: --vllm-kernel {tmp_path / 'nope'}: no such file "
                                    f"or directory")


@pytest.fixture(scope="module")
def vllm033(tmp_path_factory) -> vllm_kernel.VllmKernel:
    wheel_path = vllm_wheel("0.33.0")
    root = tmp_path_factory.mktemp("vllm033")
    with zipfile.ZipFile(wheel_path) as wheel:
        for name in ("vllm/_version.py", "vllm/model_executor/determinism/batch_invariant.py",
                     "vllm/model_executor/determinism/batch_invariant_configs.py"):
            wheel.extract(name, root)
    return vllm_kernel.load_vllm_kernel(root / "vllm")


def test_vllm_0_33_0_loads_with_its_own_hopper_table(vllm033):
    assert (vllm033.version, vllm033.commit) == ("0.33.0", "g4ba787ec9")
    assert vllm033.arch_family((9, 0)) == "hopper"
    hopper = vllm033.tuned_shapes("hopper")
    # Qwen3-8B's and Qwen3-1.7B's shapes are in it, SmolLM2's are not
    assert {(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (4096, 2048),
            (2048, 2048), (12288, 2048), (2048, 6144)} <= hopper
    assert (960, 576) not in hopper


def test_vllm_0_33_0_rows_are_invariant_at_k_512_but_fp32_is_tf32(vllm033):
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(33, 512, generator=gen)
    b = (torch.randn(64, 512, generator=gen) * 0.02).t()
    inv = probe.check_invariance(a, b, None, (1, 2, 7, 16, 33), mm=vllm033.mm)
    assert inv.passed and inv.rows_checked == 15
    theirs = probe.check_accuracy(a, b, None, mm=vllm033.mm)
    ours = probe.check_accuracy(a, b, None)  # no table: the fixed default, IEEE fp32
    assert not theirs.passed and theirs.max_rel_err > 1e-4, theirs  # TF32 (vLLM #55466)
    assert ours.passed and ours.max_rel_err < 1e-6, ours
