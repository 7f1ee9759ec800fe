"""The vLLM plugin's registration logic, with vLLM absent (CI has no vLLM)."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import pytest
from helpers_kernels import torch

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import vllm_plugin  # noqa: E402


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" ON ", True),
                                            ("yes", True), ("0", False), ("", False),
                                            ("no", False)])
def test_enabled_reads_the_environment_variable(value, expected):
    assert vllm_plugin.enabled({vllm_plugin.ENABLE_ENV: value}) is expected
    assert vllm_plugin.enabled({}) is False


def test_register_does_nothing_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, vllm_plugin.TARGET_MODULE, None)  # importing would fail
    vllm_plugin.register()  # no import attempted, nothing raised
    assert not vllm_plugin.installed()


def test_register_without_vllm_warns_and_installs_nothing(monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.setitem(sys.modules, vllm_plugin.TARGET_MODULE, None)  # "vLLM is not installed"
    with caplog.at_level(logging.WARNING, logger="bistat_kernels.vllm_plugin"):
        vllm_plugin.register()
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "bistat_kernels: BISTAT_TUNED_GEMM=1 but vllm.model_executor.layers.batch_invariant "
        "cannot be imported (")


def _fake_batch_invariant_module():
    module = types.ModuleType(vllm_plugin.TARGET_MODULE)

    def matmul_persistent(a, b, bias=None):
        raise AssertionError("vLLM's fixed-config kernel must not run once the plugin is in")

    module.matmul_persistent = matmul_persistent

    def matmul_batch_invariant(a, b):  # looks the global up at call time, as vLLM's does
        return module.matmul_persistent(a, b)

    module.matmul_batch_invariant = matmul_batch_invariant
    return module, matmul_persistent


def test_register_replaces_vllms_matmul_persistent_once(monkeypatch):
    module, original = _fake_batch_invariant_module()
    monkeypatch.setitem(sys.modules, vllm_plugin.TARGET_MODULE, module)
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    vllm_plugin.register()
    replaced = module.matmul_persistent
    assert replaced is not original and replaced.__wrapped__ is original
    assert vllm_plugin.installed()
    vllm_plugin.register()  # plugins are loaded again in every process: idempotent
    assert module.matmul_persistent is replaced

    vllm_plugin.CALLS.clear()
    a = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))
    w = torch.randn(10, 24, generator=torch.Generator().manual_seed(1))
    out = module.matmul_batch_invariant(a, w.t())
    assert torch.equal(out, mp.matmul_persistent(a, w.t()))
    assert sum(vllm_plugin.CALLS.values()) == 1
    (key,) = vllm_plugin.CALLS
    assert key[:2] == (10, 24)


def test_the_op_is_opaque_to_torch_compile():
    op = vllm_plugin.tuned_matmul_op()
    w = torch.randn(12, 20, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(lambda x: op(x, w.t(), None) * 2, backend="eager", fullgraph=True,
                             dynamic=True)
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(compiled(x), mp.matmul_persistent(x, w.t()) * 2)
    assert str(torch.ops.bistat.matmul_persistent.default._schema) == (
        "bistat::matmul_persistent(Tensor a, Tensor b, Tensor? bias) -> Tensor")


def test_the_entry_point_is_declared_for_vllm():
    try:
        points = importlib.metadata.entry_points(group="vllm.general_plugins")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - bistat not installed
        pytest.skip("bistat is not installed, so its entry points are not registered")
    ours = [p for p in points if p.name == "bistat_tuned_gemm"]
    if not ours:
        pytest.skip("bistat's metadata has no entry points (not installed from pyproject)")
    assert ours[0].value == "bistat_kernels.vllm_plugin:register"
    assert ours[0].load() is vllm_plugin.register
