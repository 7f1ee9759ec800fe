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


@pytest.fixture(autouse=True)
def _fresh_plugin_state(monkeypatch):
    """No table, no vLLM function kept and no looked-up launch carried over from another test."""
    monkeypatch.setattr(vllm_plugin, "_VLLM_OWN", None)
    monkeypatch.setattr(vllm_plugin, "_CONFIGS", {})
    monkeypatch.setattr(vllm_plugin, "VLLM_CALLS", vllm_plugin.Counter())
    tables.reset_device_table()
    yield
    tables.reset_device_table()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" ON ", True),
                                            ("yes", True), ("0", False), ("", False),
                                            ("no", False)])
def test_enabled_reads_the_environment_variable(value, expected):
    assert vllm_plugin.enabled({vllm_plugin.ENABLE_ENV: value}) is expected
    assert vllm_plugin.enabled({}) is False


def test_register_does_nothing_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENABLE_ENV, raising=False)
    for name in vllm_plugin.TARGET_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # importing would fail
    vllm_plugin.register()  # no import attempted, nothing raised
    assert not vllm_plugin.installed()


def test_register_without_vllm_warns_and_installs_nothing(monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.setitem(sys.modules, "vllm", None)  # "vLLM is not installed"
    with caplog.at_level(logging.WARNING, logger="bistat_kernels.vllm_plugin"):
        vllm_plugin.register()
    assert [r.getMessage() for r in caplog.records] == [
        "bistat_kernels: BISTAT_TUNED_GEMM=1 but vLLM is not installed; the tuned GEMM is not "
        "installed"]
    assert not vllm_plugin.installed()


#: vLLM's call chain, as each release has it (the names and the signatures, not the kernels)
LAYOUTS = {
    "0.25.0": ("vllm.model_executor.layers.batch_invariant", """
def matmul_persistent(a, b, bias=None):
    raise AssertionError("vLLM's fixed-config kernel must not run once the plugin is in")

def matmul_batch_invariant(a, b, *, out=None):
    return matmul_persistent(a, b)

def linear_batch_invariant(input, weight, bias=None):
    return matmul_batch_invariant(input, weight.t())
"""),
    "0.33.0": ("vllm.model_executor.determinism.batch_invariant", """
def _get_matmul_config(M, N, K, dtype, default):
    return default

def matmul_persistent(a, b, bias=None):
    raise AssertionError("vLLM's tuned-table kernel must not run once the plugin is in")

def mm_batch_invariant(a, b, bias=None):
    return matmul_persistent(a, b, bias=bias)

def matmul_batch_invariant(a, b, *, out=None):
    return mm_batch_invariant(a, b)

def linear_batch_invariant(input, weight, bias=None):
    return mm_batch_invariant(input.reshape(-1, input.shape[-1]), weight.t(), bias=bias)
"""),
}


#: vLLM 0.34.0 gave matmul_persistent an out_dtype (aten::mm.dtype's fp32 output, SM80/ROCm only)
LAYOUTS["0.34.0"] = ("vllm.model_executor.determinism.batch_invariant", LAYOUTS["0.33.0"][1].replace(
    """def matmul_persistent(a, b, bias=None):
    raise AssertionError("vLLM's tuned-table kernel must not run once the plugin is in")""",
    """def matmul_persistent(a, b, bias=None, out_dtype=None):
    if out_dtype is None or out_dtype == a.dtype:
        raise AssertionError("vLLM's tuned-table kernel must not run once the plugin is in")
    return ("vllm's kernel", out_dtype)

def mm_dtype_batch_invariant(a, b, out_dtype, *, out=None):
    return matmul_persistent(a, b, out_dtype=out_dtype)"""))


def _fake_vllm(monkeypatch, layout, source=None):
    """A stand-in vLLM with one batch-invariant module (the other layout absent), its
    functions defined in that module as vLLM's are; returns (module, its matmul_persistent)."""
    name, text = LAYOUTS[layout]
    module = types.ModuleType(name)
    exec(compile(source or text, f"<fake {name}>", "exec"), module.__dict__)
    vllm = types.ModuleType("vllm")
    vllm.__version__ = layout
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for other in vllm_plugin.TARGET_MODULES:
        monkeypatch.setitem(sys.modules, other, module if other == name else None)
    monkeypatch.setattr(vllm_plugin, "vllm_version", lambda: layout)
    return module, module.matmul_persistent


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_register_replaces_vllms_matmul_persistent_once(monkeypatch, layout):
    module, original = _fake_vllm(monkeypatch, layout)
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    vllm_plugin.register()
    replaced = module.matmul_persistent
    assert replaced is not original and replaced.__wrapped__ is original
    assert vllm_plugin.installed() and vllm_plugin.hooked_module() is module
    vllm_plugin.register()  # plugins are loaded again in every process: idempotent
    assert module.matmul_persistent is replaced

    vllm_plugin.CALLS.clear()
    tables.set_device_table(tables.parse_table(small_table_dict()))  # it has (N, K) = (40, 72)
    a = torch.randn(3, 72, generator=torch.Generator().manual_seed(0))
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    out = module.linear_batch_invariant(a, w)  # the linear layers' call
    assert torch.equal(out, mp.matmul_persistent(a, w.t()))
    assert sum(vllm_plugin.CALLS.values()) == 1
    (key,) = vllm_plugin.CALLS
    assert key[:2] == (40, 72)


def test_a_shape_without_an_entry_runs_on_vllms_own_kernel_and_says_so(monkeypatch, caplog):
    """The table lacks (10, 24): the op hands it to vLLM's own matmul_persistent (its own table or
    its fixed configuration, as vLLM ships it), and the log says which table served each shape."""
    source = LAYOUTS["0.33.0"][1].replace(
        """raise AssertionError("vLLM's tuned-table kernel must not run once the plugin is in")""",
        "return a.new_full((a.shape[0], b.shape[1]), 7.0)  # vLLM's own kernel, recognisably")
    module, original = _fake_vllm(monkeypatch, "0.33.0", source)
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    vllm_plugin.register()
    tables.set_device_table(tables.parse_table(small_table_dict(), "tables/test.json"))
    vllm_plugin.CALLS.clear()
    a = torch.randn(3, 72, generator=torch.Generator().manual_seed(0))
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="bistat_kernels"):
        for _ in range(2):
            assert torch.equal(module.linear_batch_invariant(a[:, :24], w[:10, :24]),
                               torch.full((3, 10), 7.0))
        assert torch.equal(module.linear_batch_invariant(a, w), mp.matmul_persistent(a, w.t()))
    assert vllm_plugin.VLLM_CALLS == {(10, 24): 2}
    assert sum(vllm_plugin.CALLS.values()) == 1
    assert [r.getMessage() for r in caplog.records if "served by" in r.getMessage()] == [
        "bistat_kernels: batch-invariant GEMM float32 N=10 K=24 served by vLLM's fixed "
        "configuration, on vLLM's own kernel",
        "bistat_kernels: batch-invariant GEMM float32 N=40 K=72 served by bistat table test.json"]



def test_vllm_034s_out_dtype_stays_tuned_for_the_inputs_dtype_and_passes_fp32_output_back(
        monkeypatch, caplog):
    """0.34.0's matmul_persistent(a, b, bias=None, out_dtype=None): out_dtype None or the inputs'
    dtype runs the tuned op; fp32 output (mm.dtype) runs vLLM's own kernel, logged once."""
    module, original = _fake_vllm(monkeypatch, "0.34.0")
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.setattr(vllm_plugin, "PASSED_THROUGH", vllm_plugin.Counter())
    vllm_plugin.register()
    tables.set_device_table(tables.parse_table(small_table_dict()))  # it has (N, K) = (40, 72)
    a = torch.randn(3, 72, generator=torch.Generator().manual_seed(0))
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    vllm_plugin.CALLS.clear()
    same = module.matmul_persistent(a, w.t(), None, out_dtype=torch.float32)  # a is float32
    assert torch.equal(same, mp.matmul_persistent(a, w.t()))
    assert sum(vllm_plugin.CALLS.values()) == 1 and not vllm_plugin.PASSED_THROUGH
    half = a.to(torch.float16)
    with caplog.at_level(logging.WARNING, logger="bistat_kernels.vllm_plugin"):
        for _ in range(2):
            got = module.mm_dtype_batch_invariant(half, w.t().to(torch.float16), torch.float32)
            assert got == ("vllm's kernel", torch.float32)
    assert vllm_plugin.PASSED_THROUGH == {("torch.float32", ()): 2}
    assert [r.getMessage() for r in caplog.records if "own kernel" in r.getMessage()] == [
        "bistat_kernels: matmul_persistent(out_dtype=torch.float32) runs on vLLM's own kernel "
        "(the tuned GEMM writes its inputs' dtype)"]
    assert sum(vllm_plugin.CALLS.values()) == 1  # the fp32-output calls never reached the op

@pytest.mark.parametrize("change,found", [
    ("def matmul_persistent(a, b, bias=None):", "def matmul_persistent(a, b, c, bias=None):"),
    ("return mm_batch_invariant(input.reshape(-1, input.shape[-1]), weight.t(), bias=bias)",
     "return input @ weight.t()"),
    ("def linear_batch_invariant(", "def linear_batch_invariant_v2("),
])
def test_register_refuses_a_vllm_whose_hook_moved_naming_version_and_what_it_sought(
        monkeypatch, change, found):
    """A future vLLM (here 0.33.0's module, changed) that moves or changes the hook: the plugin
    raises, naming vLLM's version, what it looked for and what each module lacked, and vLLM's
    own GEMM stays in place (an arm that asked for the tuned GEMM must not silently run it)."""
    source = LAYOUTS["0.33.0"][1].replace(change, found)
    assert source != LAYOUTS["0.33.0"][1]
    module, original = _fake_vllm(monkeypatch, "0.33.0", source)
    monkeypatch.setattr(vllm_plugin, "vllm_version", lambda: "0.99.0")
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    with pytest.raises(vllm_plugin.UnsupportedVLLMError) as err:
        vllm_plugin.register()
    why = {"def matmul_persistent(a, b, c, bias=None):":
           "matmul_persistent has parameters (a, b, c, bias), not (a, b, bias=None)",
           "return input @ weight.t()": "linear_batch_invariant does not reach "
                                        "matmul_persistent through module-level names within 3 "
                                        "calls",
           "def linear_batch_invariant_v2(": "no function linear_batch_invariant"}[found]
    assert str(err.value) == (
        "bistat_kernels: the tuned GEMM (BISTAT_TUNED_GEMM=1) is not supported on vLLM 0.99.0: "
        "it looks for matmul_persistent(a, b, bias=None), reached from linear_batch_invariant "
        "through module-level names, in vllm.model_executor.determinism.batch_invariant or "
        f"vllm.model_executor.layers.batch_invariant; "
        f"vllm.model_executor.determinism.batch_invariant: {why}; "
        "vllm.model_executor.layers.batch_invariant: cannot be imported (import of "
        "vllm.model_executor.layers.batch_invariant halted; None in sys.modules). Unset "
        "BISTAT_TUNED_GEMM, or use a vLLM that bistat_kernels/vllm_hooks/ has a manifest for "
        "(bistat_kernels.hook_manifest derives one from a wheel)")
    assert "not supported" in str(err.value)  # bistat's adapters classify the start as refused
    assert module.matmul_persistent is original and not vllm_plugin.installed()


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


def test_the_first_call_of_a_shape_compiles_every_bucket_of_it(monkeypatch, caplog):
    """Every bucket's kind is launched (so compiled) at a shape's first call, on the caller's own
    weight and the first row of its input; later calls of any M of that shape launch once."""
    launched = []
    real = mp.matmul_persistent

    def recording(a, b, bias=None, *, config=None):
        launched.append((a.shape[0], config))
        return real(a, b, bias, config=config)

    monkeypatch.setattr(mp, "matmul_persistent", recording)
    monkeypatch.setattr(vllm_plugin, "_PRECOMPILED", set())
    monkeypatch.setattr(vllm_plugin, "_CONFIGS", {})
    monkeypatch.setattr(vllm_plugin, "PRECOMPILE", True)
    table = tables.parse_table(small_table_dict())
    entry = table.lookup("float32", 40, 72)
    op = vllm_plugin.tuned_matmul_op()
    a = torch.randn(6, 72, generator=torch.Generator().manual_seed(6))
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(7))
    try:
        tables.set_device_table(table)
        with caplog.at_level(logging.WARNING, logger="bistat_kernels.vllm_plugin"):
            out = op(a, w.t(), None)
        buckets = [entry.config_for(b.m_max) for b in entry.buckets]
        assert len(set(buckets)) == 4
        assert launched == [(1, c) for c in buckets] + [(6, entry.config_for(6))]
        assert torch.equal(out, real(a, w.t(), config=entry.config_for(6)))
        assert "precompiled 4 bucket configurations of float32 N=40 K=72" in caplog.text
        launched.clear()
        op(a[:2], w.t(), None)  # another M of the same shape: nothing compiled again
        assert launched == [(2, entry.config_for(2))]
        monkeypatch.setattr(vllm_plugin, "PRECOMPILE", False)  # BISTAT_GEMM_PRECOMPILE=0
        launched.clear()
        b = torch.randn(100, 37, generator=torch.Generator().manual_seed(8))
        op(torch.randn(3, 100), b, None)
        assert [m for m, _ in launched] == [3]
    finally:
        tables.reset_device_table()
        vllm_plugin.CALLS.clear()


def test_precompiling_launches_nothing_without_rows():
    entry = tables.parse_table(small_table_dict()).lookup("float32", 40, 72)
    assert mp.precompile_buckets(torch.empty(0, 72), torch.randn(72, 40), None, entry) == 0


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
