"""The launcher's direct path and the descriptor-load (TMA) option.

On the CPU the direct path is exercised with a fake kernel: the first launch of a kind goes
through Triton's JIT call and keeps what it returns; later launches of that kind must hand the
compiled kernel's launcher exactly the arguments the JIT call bound, and any change Triton
specialises on (a stride, an alignment, the config) must go back through the JIT call. On a GPU
(``BISTAT_KERNELS_GPU=1``) the direct path and the descriptor loads are checked bitwise against
Triton's own path and the pointer loads.
"""

from __future__ import annotations

import dataclasses

import pytest

from helpers_kernels import needs_gpu, torch

from bistat_kernels import matmul_persistent as mp  # noqa: E402
from bistat_kernels import sweep, tables  # noqa: E402

CFG = tables.GemmConfig(16, 32, 64, 8, 4, 3)


class _FakeCompiled:
    packed_metadata = ("packed",)
    function = "function-handle"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _FakeKernel:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _FakeCompiled(self.log)
        return launch


@pytest.fixture
def fake_kernel(monkeypatch):
    log: list = []
    monkeypatch.setattr(mp, "_matmul_persistent_kernel", _FakeKernel(log))
    monkeypatch.setattr(mp, "_interpreting", lambda: False)
    monkeypatch.setattr(mp, "_COMPILED", {})
    monkeypatch.setattr(mp, "_TAILS", {})
    monkeypatch.setattr(mp, "_PLANS", {})
    monkeypatch.setattr(mp, "_FAST_LAUNCH", True)
    monkeypatch.setattr(mp, "_STREAM_OF", None)
    monkeypatch.setattr(mp, "_stream_functions", lambda: (lambda device: 1000 + device,
                                                          lambda: 7))
    return log


def test_the_direct_launch_passes_what_the_jit_call_bound(fake_kernel):
    a = torch.randn(5, 64)
    b = torch.randn(96, 64).t()  # [K, N] as vLLM passes weight.t()
    mp.matmul_persistent(a, b, config=CFG)
    mp.matmul_persistent(a, b, config=CFG)
    jit, direct = fake_kernel
    assert jit[0] == "jit" and direct[0] == "direct"
    grid, jit_args, options = jit[1], jit[2], jit[3]
    assert options == {"num_warps": 4, "num_stages": 3}
    d = direct[1]
    # grid, stream of the current device, the compiled function, packed metadata, no hooks
    assert d[:9] == (grid[0], 1, 1, 1007, "function-handle", ("packed",), None, None, None)
    launched = d[9:]
    assert len(launched) == len(jit_args)
    # tensors are fresh outputs per call (c, workspace): compare everything else by value
    for i, (x, y) in enumerate(zip(jit_args, launched)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.stride() == y.stride()
        else:
            assert x == y, f"argument {i}: JIT {x!r}, direct {y!r}"
    # a, b, c, workspace (the output again: no split), bias, split-K counters, then the sizes
    assert launched[0] is a and launched[3] is launched[2] and launched[4] is None
    assert launched[5].dtype == torch.int32 and launched[5] is mp._LOCKS[(None, 1007)]
    assert launched[6:15] == (5, 96, 64, 64, 1, 1, 64, 96, 1)
    assert launched[15:] == (16, 32, 64, 8, 1, 4, False, False, False, False, True, False, False)


def test_anything_triton_specialises_on_goes_back_through_the_jit_call(fake_kernel):
    a = torch.randn(8, 64)
    b = torch.randn(96, 64).t()
    mp.matmul_persistent(a, b, config=CFG)
    mp.matmul_persistent(a[:3], b, config=CFG)  # another M: same kind (M is not specialised)
    mp.matmul_persistent(a[:, :48].contiguous(), torch.randn(96, 48).t(), config=CFG)  # K
    mp.matmul_persistent(torch.randn(8, 80)[:, :64], b, config=CFG)  # a's row stride 80
    mp.matmul_persistent(a, b.contiguous(), config=CFG)  # b's strides
    mp.matmul_persistent(a, b, config=tables.GemmConfig(16, 32, 64, 8, 4, 4))  # num_stages
    mp.matmul_persistent(a, b, torch.randn(96), config=CFG)  # a bias
    mp.matmul_persistent(a, b, config=CFG)
    kinds = [entry[0] for entry in fake_kernel]
    assert kinds == ["jit", "direct", "jit", "jit", "jit", "jit", "jit", "direct"]


def test_plans_are_one_per_call_shape_and_bounded(fake_kernel, monkeypatch):
    monkeypatch.setattr(mp, "MAX_PLANS", 3)
    b = torch.randn(32, 64).t()
    for m in (1, 2, 3):
        mp.matmul_persistent(torch.randn(m, 64), b, config=CFG)
        mp.matmul_persistent(torch.randn(m, 64), b, config=CFG)
    assert len(mp._PLANS) == 3
    mp.matmul_persistent(torch.randn(4, 64), b, config=CFG)  # a fourth shape: the cache restarts
    assert len(mp._PLANS) == 1
    kinds = [entry[0] for entry in fake_kernel]
    assert kinds == ["jit"] + ["direct"] * 6  # one compile; every later launch direct


def test_the_direct_path_can_be_switched_off(fake_kernel, monkeypatch):
    monkeypatch.setattr(mp, "_FAST_LAUNCH", False)
    a, b = torch.randn(4, 64), torch.randn(32, 64).t()
    for _ in range(3):
        mp.matmul_persistent(a, b, config=CFG)
    assert [entry[0] for entry in fake_kernel] == ["jit"] * 3
    assert mp.fast_launch_stats() == {"compiled_kinds": 0, "plans": 0, "enabled": 0}


def test_the_interpreter_keeps_nothing():
    a, b = torch.randn(4, 64), torch.randn(32, 64).t()
    before = dict(mp._COMPILED)
    out = mp.matmul_persistent(a, b, config=CFG)
    assert torch.allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    assert mp._COMPILED == before


def test_tma_is_an_optional_bucket_field_that_round_trips():
    doc = {"schema": tables.SCHEMA, "device_name": "NVIDIA H200", "entries": [{
        "dtype": "bfloat16", "n": 4096, "k": 4096, "block_k": 64, "split_k": 1,
        "provenance": {"gpu": "test"},
        "buckets": [{"m_max": 16, "block_m": 16, "block_n": 64, "group_m": 8, "num_warps": 4,
                     "num_stages": 4},
                    {"m_max": 4096, "block_m": 128, "block_n": 128, "group_m": 8,
                     "num_warps": 8, "num_stages": 3, "tma": True}]}]}
    table = tables.parse_table(doc, "t.json")
    entry = table.entries[("bfloat16", 4096, 4096)]
    assert [entry.config_for(m).tma for m in (1, 16, 17, 9999)] == [False, False, True, True]
    assert entry.config_for(3) is entry.config_for(16)  # built once, not per call
    again = tables.table_to_dict("NVIDIA H200", [entry])
    assert "tma" not in again["entries"][0]["buckets"][0]
    assert again["entries"][0]["buckets"][1]["tma"] is True
    assert tables.parse_table(again, "again.json").entries == table.entries


@pytest.mark.parametrize("value, dtype, message", [
    ("yes", "bfloat16", "tma: got 'yes'; expected true or false"),
    (True, "float32", "tma: true is for bfloat16/float16 entries"),
])
def test_a_bad_tma_field_names_the_file_the_field_and_the_fix(value, dtype, message):
    doc = {"schema": tables.SCHEMA, "device_name": "X", "entries": [{
        "dtype": dtype, "n": 64, "k": 64, "block_k": 32, "split_k": 1, "provenance": {"a": 1},
        "buckets": [{"m_max": 1, "block_m": 64, "block_n": 64, "group_m": 8, "num_warps": 4,
                     "num_stages": 3, "tma": value}]}]}
    with pytest.raises(tables.TableError, match=r"t\.json: entries\[0\]\.buckets\[0\]\." + message):
        tables.parse_table(doc, "t.json")


def test_the_sweep_offers_each_pointer_candidate_also_with_descriptor_loads():
    for m in (1, 16, 32, 64, 256, 4096):
        plain = sweep.launch_candidates(m, 4096, 64, 1)
        both = sweep.launch_candidates(m, 4096, 64, 1, tma=True)
        with_tma = [c for c in both if c.tma]
        assert with_tma and all(c.block_m >= sweep.TMA_MIN_BLOCK_M for c in with_tma)
        assert [c for c in both if not c.tma] == plain
        # each descriptor form is a pointer form with tma=True: same tiles, same reduction
        assert {dataclasses.replace(c, tma=False) for c in with_tma} <= set(plain)
        assert {c.reduction_key() for c in both} == {(64, 1)}
    assert not any(c.tma for c in sweep.launch_candidates(4096, 4096, 64, 1, tma=False))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_direct_launch_and_descriptor_loads_give_triton_path_bits(tma):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    a = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    for split, fused in ((1, False), (2, False), (2, True)):
        cfg = tables.GemmConfig(128, 128, 64, 8, 8, 3, split, fuse_splits=fused, tma=tma)
        pointer = tables.GemmConfig(128, 128, 64, 8, 8, 3, split, fuse_splits=fused)
        mp.set_fast_launch(False)
        try:
            ref = mp.matmul_persistent(a, w.t(), bias, config=pointer)
        finally:
            mp.set_fast_launch(True)
        for m in (300, 17, 1):
            for _ in range(2):  # the first launch of a kind through Triton, then directly
                out = mp.matmul_persistent(a[:m], w.t(), bias, config=cfg)
                assert torch.equal(out, ref[:m]), (split, fused, m)


# ---- the plan's launch below Triton's CudaLauncher (descriptor arguments kept per address) ----

_nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")


class _FakeUtils:
    """Stands in for the CUDA utilities: a tensor map is the tuple of what it encodes."""

    def __init__(self):
        self.fills = 0

    def fill_tma_descriptor_tiled(self, ptr, swizzle, elem_size, elem_type, block, shape, strides,
                                  padding):
        self.fills += 1
        return ("tensor-map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape),
                tuple(strides), padding)

    fill_tma_descriptor = fill_tma_descriptor_tiled  # triton 3.6's name


class _FakeDriver:
    def __init__(self):
        self.utils = _FakeUtils()


def _cuda_launcher(record, tma: bool):
    """Triton's own CudaLauncher (installed version) around a recording C launcher."""
    launcher_cls = _nvidia_driver.CudaLauncher
    run = object.__new__(launcher_cls)
    if tma:
        signature = {0: "tensordesc<bf16[16, 64]>", 1: "tensordesc<bf16[32, 64]>", 2: "*bf16",
                     3: "*fp32", 4: "*bf16", 5: "*i32", 6: "i32", 7: "i32", 8: "i32", 9: "i32",
                     10: "i32", 11: "constexpr"}
        metas = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [16, 64],
                  "fp4_padded": False},
                 {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [32, 64],
                  "fp4_padded": False}]
        run.launch = _nvidia_driver.wrap_handle_tensordesc(record, signature, metas)
    else:
        run.launch = record  # no descriptor: Triton's wrapper is the C launcher itself
    run.num_ctas = 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    if "arg_annotations" in launcher_cls.__init__.__code__.co_names:
        run.arg_annotations, run.kernel_signature = "annotations", "kernel-signature"
    return run


def _assert_same_call(ours, triton_s):
    """The same C call, argument for argument (tensors: the very same objects)."""
    assert len(ours) == len(triton_s)
    for i, (x, y) in enumerate(zip(ours, triton_s)):
        if isinstance(y, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in y):
            assert type(x) is type(y), f"argument {i}: {type(x)} vs {type(y)}"
            _assert_same_call(x, y)
        elif isinstance(y, torch.Tensor):
            assert x is y, f"argument {i}: another tensor"
        else:
            assert type(x) is type(y) and x == y, f"argument {i}: ours {x!r}, Triton's {y!r}"


@pytest.mark.parametrize("tma", [False, True])
def test_the_plan_hands_the_c_launcher_what_triton_does(tma, monkeypatch):
    import triton

    fake = _FakeDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    class Record:  # a C launcher has no closure; a Python function here would
        def __call__(self, *args):
            calls.append(args)

    calls: list = []
    run = _cuda_launcher(Record(), tma)
    raw = mp._raw_launcher(type("Compiled", (), {"run": run})(), tma)
    assert raw is not None
    a = torch.zeros(5, 64, dtype=torch.bfloat16)
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    c, ws, locks = torch.empty(5, 96), torch.empty(1), torch.zeros(4, dtype=torch.int32)
    tail = (16,)
    if tma:
        kernel_args = (mp._TmaOperand(a, (5, 64), (64, 1)), mp._TmaOperand(w, (96, 64), (64, 1)),
                       c, ws, None, locks, 5, 96, 64, 96, 1, *tail)
    else:
        kernel_args = (a, w, c, ws, None, locks, 5, 96, 64, 64, 1, 1, 64, 96, 1, *tail)
    run(7, 1, 1, 1234, "function", ("packed",), None, None, None, *kernel_args)
    fills_by_triton = fake.utils.fills
    if tma:
        args = (*raw.descriptor(0, a, (5, 64), (64, 1)), *raw.descriptor(1, w, (96, 64), (64, 1)),
                *kernel_args[2:])
    else:
        args = kernel_args
    raw(7, 1234, "function", ("packed",), args)
    assert len(calls) == 2
    _assert_same_call(calls[1], calls[0])
    if tma:
        assert fills_by_triton == 2 and fake.utils.fills == 4
        # kept per address: the same operands again encode nothing; a new activation one map
        raw.descriptor(0, a, (5, 64), (64, 1)), raw.descriptor(1, w, (96, 64), (64, 1))
        assert fake.utils.fills == 4
        raw.descriptor(0, torch.zeros(5, 64, dtype=torch.bfloat16), (5, 64), (64, 1))
        assert fake.utils.fills == 5


def test_anything_unknown_below_run_keeps_run():
    class Run:
        def __call__(self, *args):
            pass

    run = Run()
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), False) is None  # no .launch
    run.launch = print  # a C function, but scratch memory unknown
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), False) is None
    run.global_scratch_size, run.profile_scratch_size = 0, 128  # profiler scratch: keep run
    run.launch_cooperative_grid = run.launch_pdl = False
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), False) is None
    run.profile_scratch_size = 0
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), False) is not None
    run.gsan_enabled = True  # triton 3.8's sanitizer adds an argument
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), False) is None
    run.gsan_enabled = False
    assert mp._raw_launcher(type("Compiled", (), {"run": run})(), True) is None  # no wrapper


@needs_gpu
@pytest.mark.gpu
def test_gpu_precompiled_buckets_are_the_kinds_every_later_call_needs():
    table = tables.load_table(tables.table_path_for(torch.cuda.get_device_name(0)))
    gen = torch.Generator(device="cuda").manual_seed(6)
    for n, k in ((4096, 4096), (4096, 12288)):  # a plain entry and a split-K one (fused buckets)
        entry = table.lookup("bfloat16", n, k)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        a = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        launched = mp.precompile_buckets(a, w.t(), None, entry)
        assert launched == len({entry.config_for(b.m_max) for b in entry.buckets})
        kinds = len(mp._COMPILED)
        for m in (1, 3, 17, 33, 100, 200, 300, 700, 1500, 3000, 4096):
            mp.matmul_persistent(a[:m], w.t(), config=entry.config_for(m))
        assert len(mp._COMPILED) == kinds, (n, k)
