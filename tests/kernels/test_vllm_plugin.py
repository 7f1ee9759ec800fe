"""The vLLM plugin's registration logic, with vLLM absent (CI has no vLLM)."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import pytest
from helpers_kernels import small_table_dict, torch

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import tables, vllm_plugin  # noqa: E402


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


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_op_is_opaque_to_torch_compile(backend):
    """aot_eager traces with fake tensors: the op's fake kernel gives the shape, symbolic in M."""
    torch._dynamo.reset()
    op = vllm_plugin.tuned_matmul_op()
    w = torch.randn(12, 20, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(lambda x: op(x, w.t(), None) * 2, backend=backend, fullgraph=True,
                             dynamic=True)
    for m in (5, 9):  # one graph for both M: the bucket is chosen when the op runs
        x = torch.randn(m, 20, generator=torch.Generator().manual_seed(m))
        assert torch.equal(compiled(x), mp.matmul_persistent(x, w.t()) * 2)
    assert str(torch.ops.bistat.matmul_persistent.default._schema) == (
        "bistat::matmul_persistent(Tensor a, Tensor b, Tensor? bias) -> Tensor")


def test_the_op_keeps_each_lookup_until_the_table_changes():
    """The launch configuration of an (M, N, K) is looked up once per table: a table set later
    (tests, `bistat kernels` commands) is used from the next call on."""
    op = vllm_plugin.tuned_matmul_op()
    a = torch.randn(3, 72, generator=torch.Generator().manual_seed(4))
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(5))
    changed = small_table_dict()
    changed["entries"][0]["buckets"][1]["block_n"] = 16  # M = 3 falls in the bucket m_max = 4
    try:
        tables.set_device_table(tables.parse_table(small_table_dict()))
        vllm_plugin.CALLS.clear()
        first = op(a, w.t(), None)
        op(a, w.t(), None)
        assert vllm_plugin.CALLS == {(40, 72, 16, 32, 32, 1): 2}
        tables.set_device_table(tables.parse_table(changed))
        vllm_plugin.CALLS.clear()
        again = op(a, w.t(), None)
        assert vllm_plugin.CALLS == {(40, 72, 16, 16, 32, 1): 1}
        assert torch.equal(first, again)  # same BLOCK_K and SPLIT_K: the same bits
    finally:
        tables.reset_device_table()
        vllm_plugin.CALLS.clear()


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


def test_the_dispatch_benchmark_runs_both_paths():
    """benchmarks/bench_plugin_dispatch.py, tiny: it installs the plugin on a stand-in module and
    times it beside vLLM's direct call and the session-6 custom op (numbers not asserted here)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_plugin_dispatch.py"
    done = subprocess.run([sys.executable, str(script), "--calls", "50", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:4]] == [
        "direct (vLLM's path, launch stubbed)", "plugin (torch.library op + lookup)",
        "custom_op (the plugin until session 6)"]
    assert lines[-1].startswith("ratio of the added host time, custom_op / plugin: ")
