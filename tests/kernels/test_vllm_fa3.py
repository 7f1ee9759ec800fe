"""The FlashAttention-3 pin (bistat_kernels.vllm_fa3): what FA3 receives, with vLLM stood in.

CI has no vLLM and no GPU: the module vLLM's FLASH_ATTN backend is (``vllm.v1.attention.backends
.flash_attn``) is replaced by a stand-in whose two entry points have the real parameter lists and
record what they are called with; shapes are those of SmolLM2-135M (9 query heads, 3 KV heads,
head size 64, vLLM's 16-key pages). ``fa3_host_choice`` restates FA3's host-side kernel choice
(vllm-project/flash-attention ``hopper/`` at 617264c1, lines cited) so the tests can say which
kernel each call would run. The GPU test at the end calls the real FA3 kernel.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from types import SimpleNamespace

import pytest

from bistat_kernels import vllm_fa3

SMOL = dict(heads_q=9, heads_kv=3, head_size=64, page=16)


def fa3_host_choice(max_seqlen_q: int, heads_q: int, heads_kv: int, head_size: int,
                    page: int | None, causal: bool = True) -> tuple[int, int, bool, bool]:
    """(kBlockM, kBlockN, causal, paged KV by TMA) that FA3 picks for a varlen bf16 call on SM90,
    at head size 64 or 128, no sliding window, no softcap, ``num_splits = 1``."""
    per_kv = heads_q // heads_kv
    # flash_api.cpp:868-872: a query length of 1 relaxes causal (kept at head size 128 when paged)
    if max_seqlen_q == 1 and (head_size <= 64 or head_size > 128 or page is None):
        causal = False
    # heuristics.h:10-14
    one_wg = head_size in (64, 128) and max_seqlen_q * per_kv <= 64

    def tile(paged_non_tma: bool) -> tuple[int, int]:  # tile_size.h:23-30 and :40-45
        if head_size <= 64:
            if one_wg:
                return 64, 192
            return 192, 128 if causal else (160 if paged_non_tma else 192)
        if one_wg:
            return 64, 128 if causal or paged_non_tma else 176
        return 128, 128 if causal or paged_non_tma else 160

    tma = False
    if page is not None:  # flash_api.cpp:464-474 (the TMA test uses the non-TMA-free tile)
        block_m, block_n = tile(False)
        tma = page % block_n == 0 and max_seqlen_q * per_kv > block_m
    block_m, block_n = tile(page is not None and not tma)
    return block_m, block_n, causal, tma


def test_the_model_of_fa3_reproduces_the_reported_flips():
    # vLLM issue #51902 (H100, 14/2 heads, head size 64): max_seqlen_q 9 -> <64,192>, 10 -> <192,128>
    assert fa3_host_choice(9, 14, 2, 64, 16)[:2] == (64, 192)
    assert fa3_host_choice(10, 14, 2, 64, 16)[:2] == (192, 128)
    # SmolLM2 (docs/STUDIES.md): a decode-only step 64 x 192 non-causal, a step with a chat prompt
    # (36-52 tokens) 192 x 128 causal; 21 is the last one-warpgroup length at 3 q heads per KV head
    assert fa3_host_choice(1, **SMOL) == (64, 192, False, False)
    assert fa3_host_choice(21, **SMOL) == (64, 192, True, False)
    assert fa3_host_choice(40, **SMOL) == (192, 128, True, False)
    # head size 128 (Qwen3-8B, 32/8): 128-key tiles either way, so its study held
    assert {fa3_host_choice(n, 32, 8, 128, 16)[1] for n in (1, 16, 17, 300)} == {128}


@pytest.mark.parametrize("heads_q,heads_kv,head_size,page", [
    (9, 3, 64, 16), (14, 2, 64, 16), (14, 2, 64, 128), (32, 32, 64, 16), (16, 16, 64, 64),
    (32, 8, 128, 16), (32, 8, 128, 128), (64, 1, 64, 16), (9, 3, 64, None)])
def test_the_pinned_length_is_the_smallest_that_fixes_the_kernel(heads_q, heads_kv, head_size, page):
    pinned = vllm_fa3.pinned_max_seqlen_q(heads_q, heads_kv, page)
    longest = fa3_host_choice(4096, heads_q, heads_kv, head_size, page)
    # every step the pin can see runs the kernel of the longest query
    assert all(fa3_host_choice(max(n, pinned), heads_q, heads_kv, head_size, page) == longest
               for n in range(1, 600))
    smallest = next(m for m in range(2, 600) if all(
        fa3_host_choice(n, heads_q, heads_kv, head_size, page) == longest for n in range(m, 600)))
    if page is None or page < vllm_fa3.SMALLEST_BLOCK_N:
        assert pinned == smallest          # vLLM's 16-key pages: exactly the smallest
    else:
        # pages that a tile's kBlockN may divide: the TMA bound is taken at the largest kBlockM
        # (192) rather than restating FA3's tile table; the kernel chosen is the same
        assert smallest <= pinned <= vllm_fa3.LARGEST_BLOCK_M // (heads_q // heads_kv) + 1


def test_pinned_length_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"query heads \(10\) must be a positive multiple of KV "
                                         r"heads \(3\)"):
        vllm_fa3.pinned_max_seqlen_q(10, 3, 16)


# --------------------------------------------------------------------------------------------
# vLLM's FLASH_ATTN backend module, stood in
# --------------------------------------------------------------------------------------------


def _backend_module():
    """A stand-in for vllm.v1.attention.backends.flash_attn with the entry points' real
    parameter lists (vllm/vllm_flash_attn/flash_attn_interface.py, 0.33.0 :122-143, :176-219)
    and the forward's call as vLLM makes it (keywords; the module global looked up at call time,
    flash_attn.py:113-116)."""
    module = types.ModuleType(vllm_fa3.TARGET_MODULE)
    module.forward_calls, module.scheduler_calls = [], []

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
                               cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None, return_softmax_lse=False, out=None,
                               scheduler_metadata=None, q_descale=None, k_descale=None,
                               v_descale=None, num_splits=0, output_scale=None, fa_version=2,
                               s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
                               mask_mod=None, block_sparse_tensors=None, aux_tensors=None,
                               aux_tensor_leading_dims=None, dynamic_causal=None,
                               gather_kv_indices=None, gather_kv_valid_length=None):
        module.forward_calls.append(dict(max_seqlen_q=max_seqlen_q, num_splits=num_splits,
                                         fa_version=fa_version,
                                         scheduler_metadata=scheduler_metadata))
        return "out"

    def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                               headdim, cache_seqlens, qkv_dtype=None, headdim_v=None,
                               cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                               page_size=None, max_seqlen_k_new=0, causal=False,
                               window_size=(-1, -1), has_softcap=False, num_splits=0,
                               pack_gqa=None, sm_margin=0):
        module.scheduler_calls.append(dict(max_seqlen_q=max_seqlen_q, num_splits=num_splits,
                                           pack_gqa=pack_gqa))
        return f"metadata(max_seqlen_q={max_seqlen_q}, num_splits={num_splits})"

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.get_scheduler_metadata = get_scheduler_metadata

    def forward(query_tokens: int, max_query_len: int, max_num_splits: int, fa_version: int = 3,
                scheduler_metadata=None):
        """FlashAttentionImpl.forward's call (0.33.0 flash_attn.py:1283, :1395, :1404-1428)."""
        q = SimpleNamespace(shape=(query_tokens, 9, 64))          # [total_q, q heads, head size]
        cache = SimpleNamespace(shape=(4096, 16, 3, 64))          # [pages, page size, KV heads, D]
        return module.flash_attn_varlen_func(
            q=q, k=cache, v=cache, out=None, cu_seqlens_q=None, max_seqlen_q=max_query_len,
            seqused_k=None, max_seqlen_k=700, softmax_scale=0.125, causal=True,
            alibi_slopes=None, window_size=None, block_table=object(), softcap=0.0,
            scheduler_metadata=scheduler_metadata, fa_version=fa_version, q_descale=None,
            k_descale=None, v_descale=None, num_splits=max_num_splits, s_aux=None)

    def schedule(max_query_len: int, max_num_splits: int):
        """FlashAttentionMetadataBuilder._get_scheduler_metadata's call (0.33.0 :654-668)."""
        return module.get_scheduler_metadata(
            batch_size=64, max_seqlen_q=max_query_len, max_seqlen_k=700, num_heads_q=9,
            num_heads_kv=3, headdim=64, cache_seqlens=None, qkv_dtype="bf16", cu_seqlens_q=None,
            page_size=16, causal=True, window_size=(-1, -1), num_splits=max_num_splits)

    module.forward, module.schedule = forward, schedule
    return module


@pytest.fixture
def backend(monkeypatch):
    module = _backend_module()
    monkeypatch.setitem(sys.modules, vllm_fa3.TARGET_MODULE, module)
    monkeypatch.setenv(vllm_fa3.ENABLE_ENV, "1")
    vllm_fa3.CALLS.clear()
    vllm_fa3.RAISED.clear()
    yield module
    vllm_fa3.uninstall(module)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" ON ", True),
                                            ("yes", True), ("0", False), ("", False)])
def test_enabled_reads_its_own_environment_variable(value, expected):
    assert vllm_fa3.ENABLE_ENV == "BISTAT_FA3_PIN"
    assert vllm_fa3.enabled({vllm_fa3.ENABLE_ENV: value}) is expected
    assert vllm_fa3.enabled({"BISTAT_TUNED_GEMM": "1"}) is False


def test_register_does_nothing_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_fa3.ENABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, vllm_fa3.TARGET_MODULE, None)  # importing would fail
    vllm_fa3.register()
    assert not vllm_fa3.installed()


def test_a_decode_only_step_and_a_mixed_step_reach_fa3_with_the_same_kernel(backend, caplog):
    """Batch-invariant mode (num_splits 1, no AOT schedule): without the pin a decode-only step
    reaches FA3 with max_seqlen_q 1, a step holding a 40-token prompt with 40 and one holding an
    11-token prompt with 11, three kernels; with it, 22, 40 and 22, one kernel."""
    backend.forward(64, 1, 1)
    backend.forward(104, 40, 1)
    backend.forward(74, 11, 1)   # a prefill of 11 tokens: still one warpgroup without the pin
    unpinned = [c["max_seqlen_q"] for c in backend.forward_calls]
    assert unpinned == [1, 40, 11]
    assert [fa3_host_choice(n, **SMOL) for n in unpinned] == [
        (64, 192, False, False), (192, 128, True, False), (64, 192, True, False)]
    with caplog.at_level(logging.WARNING, logger="bistat_kernels.vllm_fa3"):
        vllm_fa3.register()
        backend.forward(64, 1, 1)
        backend.forward(104, 40, 1)
        backend.forward(74, 11, 1)
        vllm_fa3.register()   # loaded again in another process of the engine: idempotent
    pinned = backend.forward_calls[3:]
    assert [(c["max_seqlen_q"], c["num_splits"]) for c in pinned] == [(22, 1), (40, 1), (22, 1)]
    assert {fa3_host_choice(c["max_seqlen_q"], **SMOL) for c in pinned} == {(192, 128, True, False)}
    key = (9, 3, 64, 16, 22)
    assert vllm_fa3.CALLS == {key: 3} and vllm_fa3.RAISED == {key: 2}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("bistat_kernels: FlashAttention-3 pin installed in "
                                  "vllm.v1.attention.backends.flash_attn (BISTAT_FA3_PIN=1; pid ")
    assert messages[1].startswith("bistat_kernels: FlashAttention-3 pin: max_seqlen_q >= 22 and "
                                  "num_splits = 1 for 9 query heads / 3 KV heads, head size 64, "
                                  "page size 16 (pid ")


def test_outside_batch_invariant_mode_the_split_heuristic_and_aot_metadata_are_pinned_together(backend):
    """vLLM's default mode: num_splits 0 (FA3's heuristic) or the CUDA-graph bound, and AOT
    scheduler metadata computed from the same max_query_len: both get the pinned values, so the
    metadata always matches the call it is made for."""
    vllm_fa3.register()
    for max_query_len, splits in ((1, 0), (1, 32), (300, 0)):
        metadata = backend.schedule(max_query_len, splits)
        backend.forward(64, max_query_len, splits, scheduler_metadata=metadata)
    assert [(c["max_seqlen_q"], c["num_splits"], c["pack_gqa"]) for c in backend.scheduler_calls] \
        == [(22, 1, None), (22, 1, None), (300, 1, None)]
    assert [(c["max_seqlen_q"], c["num_splits"], c["scheduler_metadata"])
            for c in backend.forward_calls] == [
        (22, 1, "metadata(max_seqlen_q=22, num_splits=1)"),
        (22, 1, "metadata(max_seqlen_q=22, num_splits=1)"),
        (300, 1, "metadata(max_seqlen_q=300, num_splits=1)")]


def test_other_flash_attention_versions_pass_through_unchanged(backend):
    vllm_fa3.register()
    backend.forward(64, 1, 0, fa_version=2)
    backend.forward(64, 1, 0, fa_version=4)
    assert [(c["max_seqlen_q"], c["num_splits"]) for c in backend.forward_calls] == [(1, 0), (1, 0)]
    assert vllm_fa3.CALLS == {}


def test_a_positional_call_is_pinned_too(backend):
    vllm_fa3.register()
    q, cache = SimpleNamespace(shape=(8, 9, 64)), SimpleNamespace(shape=(10, 16, 3, 64))
    backend.flash_attn_varlen_func(q, cache, cache, 1, None, 100, block_table=object(),
                                   fa_version=3, num_splits=0)
    q_unpaged = SimpleNamespace(shape=(8, 9, 64))
    k_unpaged = SimpleNamespace(shape=(100, 3, 64))    # [total_k, KV heads, head size]: no pages
    backend.flash_attn_varlen_func(q_unpaged, k_unpaged, k_unpaged, 1, None, 100, fa_version=3)
    assert [(c["max_seqlen_q"], c["num_splits"]) for c in backend.forward_calls] == [(22, 1), (22, 1)]
    assert set(vllm_fa3.CALLS) == {(9, 3, 64, 16, 22), (9, 3, 64, None, 22)}


def test_uninstall_restores_vllms_functions(backend):
    original = backend.flash_attn_varlen_func
    vllm_fa3.register()
    assert backend.flash_attn_varlen_func is not original and vllm_fa3.installed()
    assert backend.flash_attn_varlen_func.__wrapped__ is original
    assert vllm_fa3.uninstall(backend) and backend.flash_attn_varlen_func is original
    assert not vllm_fa3.installed() and not vllm_fa3.uninstall(backend)


def test_a_vllm_without_the_hook_is_refused_with_its_version_and_what_was_looked_for(monkeypatch):
    monkeypatch.setenv(vllm_fa3.ENABLE_ENV, "1")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.40.0"))
    module = types.ModuleType(vllm_fa3.TARGET_MODULE)
    module.flash_attn_varlen_func = lambda q, k, v, max_seqlen_q: None   # no num_splits etc.
    monkeypatch.setitem(sys.modules, vllm_fa3.TARGET_MODULE, module)
    with pytest.raises(RuntimeError) as err:
        vllm_fa3.register()
    assert str(err.value) == (
        "bistat_kernels.vllm_fa3: BISTAT_FA3_PIN=1 but vLLM 0.40.0: "
        "vllm.v1.attention.backends.flash_attn has flash_attn_varlen_func takes no parameter(s) "
        "num_splits, fa_version, block_table; no function get_scheduler_metadata (vLLM imports it "
        "only where FlashAttention is available: a CUDA build of vLLM) (looked for "
        "flash_attn_varlen_func(q, k, max_seqlen_q, num_splits, fa_version, block_table) and "
        "get_scheduler_metadata(max_seqlen_q, num_heads_q, num_heads_kv, page_size, num_splits)): "
        "the FlashAttention-3 pin cannot be installed; unset BISTAT_FA3_PIN, or run a vLLM whose "
        "FLASH_ATTN backend it was read in (0.25.0, 0.33.0)")
    assert not vllm_fa3.installed()
    monkeypatch.setitem(sys.modules, vllm_fa3.TARGET_MODULE, None)   # no such module
    with pytest.raises(RuntimeError, match=r"^bistat_kernels.vllm_fa3: BISTAT_FA3_PIN=1 but vLLM "
                                           r"0.40.0 has no module vllm.v1.attention.backends"
                                           r".flash_attn \("):
        vllm_fa3.register()


def test_the_hook_exists_in_both_vllm_releases_it_was_read_in():
    """The stand-in's parameter lists are those of the releases' interface (names checked here
    against the signatures the plugin looks for; the wheels themselves are not in CI)."""
    module = _backend_module()
    assert vllm_fa3.problems(module) == []
    fsig = inspect.signature(module.flash_attn_varlen_func)
    assert fsig.parameters["fa_version"].default == 2   # DEFAULT_FA_VERSION, interface :49


def test_the_entry_point_is_declared():
    import importlib.metadata

    points = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins")
              if p.name == "bistat_fa3_pin"]
    if not points:
        pytest.skip("bistat's metadata has no entry points (not installed from pyproject)")
    assert points[0].value == "bistat_kernels.vllm_fa3:register"
    assert points[0].load() is vllm_fa3.register


# --------------------------------------------------------------------------------------------
# on the GPU: the real FA3 kernel
# --------------------------------------------------------------------------------------------


def _fa3_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (FlashAttention 3)")
    interface = pytest.importorskip("vllm.vllm_flash_attn")
    return torch, interface.flash_attn_varlen_func


@pytest.mark.gpu
def test_on_hopper_a_decode_row_is_bitwise_the_same_beside_a_prefill_once_pinned():
    """A decode row of 200 keys alone and beside a 40-token prefill (SmolLM2's heads, 16-key
    pages, bf16): FA3 gives different bits as vLLM calls it and the same bits pinned."""
    torch, flash_attn_varlen_func = _fa3_or_skip()
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    kv_len, prefill, page = 200, 40, 16
    pages = torch.randn(64, page, 3, 64, generator=g, device=dev).to(dt)
    k_cache, v_cache = pages, torch.randn(64, page, 3, 64, generator=g, device=dev).to(dt)
    q_decode = torch.randn(1, 9, 64, generator=g, device=dev).to(dt)
    q_prefill = torch.randn(prefill, 9, 64, generator=g, device=dev).to(dt)
    row = torch.arange(0, 13, device=dev, dtype=torch.int32)          # 13 pages >= 200 keys
    other = torch.arange(20, 33, device=dev, dtype=torch.int32)
    i32 = dict(device=dev, dtype=torch.int32)

    def call(q, cu, seqused, table, max_q, pin):
        kwargs = dict(q=q, k=k_cache, v=v_cache, max_seqlen_q=max_q, cu_seqlens_q=cu,
                      max_seqlen_k=kv_len, seqused_k=seqused, softmax_scale=0.125, causal=True,
                      block_table=table, fa_version=3, num_splits=1)
        if pin:
            kwargs, _ = vllm_fa3.pin_forward_arguments(kwargs)
        return flash_attn_varlen_func(**kwargs)

    for pin in (False, True):
        alone = call(q_decode, torch.tensor([0, 1], **i32), torch.tensor([kv_len], **i32),
                     row[None], 1, pin)
        mixed = call(torch.cat([q_decode, q_prefill]), torch.tensor([0, 1, 1 + prefill], **i32),
                     torch.tensor([kv_len, prefill], **i32), torch.stack([row, other]),
                     prefill, pin)
        same = torch.equal(alone[0], mixed[0])
        assert same is pin, f"pin={pin}: decode row alone vs beside a prefill equal: {same}"


def test_the_device_check_states_its_usage_and_loads_the_plugin_by_path(monkeypatch):
    """scripts/device/fa3_check.py runs where bistat is not installed (vLLM 0.33's device
    environment): it then loads kernels/bistat_kernels/vllm_fa3.py from the checkout by path."""
    import importlib.util
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "device" / "fa3_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 2 and "python scripts/device/fa3_check.py kernel OUT.json" in done.stderr
    spec = importlib.util.spec_from_file_location("fa3_check", script)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setitem(sys.modules, "bistat_kernels", None)           # not installed
    monkeypatch.setitem(sys.modules, "bistat_kernels.vllm_fa3", None)
    pin = check.load_pin()
    assert pin is not vllm_fa3 and Path(pin.__file__) == Path(vllm_fa3.__file__)
    assert pin.pinned_max_seqlen_q(9, 3, 16) == 22 and pin.ENABLE_ENV == "BISTAT_FA3_PIN"
