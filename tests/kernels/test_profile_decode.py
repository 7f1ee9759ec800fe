"""kernels/device/profile_decode.py: kernel categories, profile summary, log facts, table, driver.

The GPU side (vLLM engine, torch.profiler) runs only on the lent H200; here the pure parts are
tested with real kernel names, and the driver with a fake worker script standing in for the real
one (same command line, same result file), so that its environment, timeout and error handling
are exercised without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from external import vllm_wheel

SCRIPT = Path(__file__).resolve().parents[2] / "kernels" / "device" / "profile_decode.py"


def _load():
    spec = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pd = _load()

FA3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
       "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
       "cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t, float, "
       "cutlass::arch::Sm90, true, false, false, true, true, false, false, true, true, false, "
       "false, false>>>>(flash::FlashAttnFwdSm90<...>::Params)")
XMMA = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cublas")


@pytest.mark.parametrize("name, expected", [
    ("matmul_kernel_persistent", "persistent_gemm"),
    ("matmul_kernel_persistent [M=8, N=4096, K=12288]", "persistent_gemm"),
    ("_matmul_persistent_kernel", "persistent_gemm"),
    ("_splitk_reduce_kernel", "persistent_gemm"),
    (XMMA, "cublas_gemm"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN", "cublas_gemm"),
    ("nvjet_hsh_64x8_64x16_4x1_v_bz_splitK_TNT", "cublas_gemm"),
    (("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
     "__nv_bfloat16, false, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
     "__nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, "
     "float const*, __nv_bfloat16*, void*, long, float*, int*)"), "cublas_gemm"),
    (("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, "
     "4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 "
     "const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
     "cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(...)"), "cublas_gemm"),
    ("flash::FlashAttnFwdSm90<...>", "attention"),
    (FA3, "attention"),
    (("void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*, int const*, "
     "int const*, int const*, int const*, int const*, int, int, int, int, int, "
     "cutlass::FastDivmod, cutlass::FastDivmod, int*, int*, bool)"), "attention"),
    ("kernel_unified_attention_2d", "attention"),
    (("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
     "(vllm::Fp8KVCacheDataType)0>(...)"), "attention"),
    ("triton_poi_fused_add_mul_0", "other"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "other"),
    ("_rms_norm_kernel", "other"),
    (("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"),
     "other"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
])
def test_categorise_real_kernel_names(name, expected):
    assert pd.categorise(name) == expected


def _rows():
    # (name, device_type, count, self device us): two GEMM families, attention, other, and
    # host-side rows that must not count as device time.
    spec = [
        ("matmul_kernel_persistent", "CUDA", 4736, 1_920_000.0),
        ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN", "CUDA", 128, 64_000.0),
        (FA3, "CUDA", 4608, 128_000.0),
        ("triton_poi_fused_add_mul_0", "CUDA", 9216, 64_000.0),
        ("Memset (Device)", "CUDA", 128, 4_000.0),
        ("cudaGraphLaunch_v10000", "CPU", 127, 0.0),
        ("cuLaunchKernel", "CPU", 300, 0.0),
        ("cudaLaunchKernelExC_v11060", "CPU", 20, 0.0),
        ("aten::mm", "CPU", 10, 50_000.0),
    ]
    return [{"name": n, "device_type": d, "count": c, "self_device_us": us}
            for n, d, c, us in spec]


def test_summarise_splits_device_time_by_category_and_per_step():
    s = pd.summarise(_rows(), steps=128, top=3)
    assert s["total_device_ms"] == pytest.approx(2180.0)
    assert s["total_device_ms_per_step"] == pytest.approx(2180.0 / 128)
    assert s["distinct_kernels"] == 5
    assert s["kernel_launches"] == 4736 + 128 + 4608 + 9216 + 128
    cats = s["categories"]
    assert list(cats) == ["persistent_gemm", "cublas_gemm", "attention", "other"]
    assert cats["persistent_gemm"] == pytest.approx(
        {"ms": 1920.0, "share": 1920 / 2180, "ms_per_step": 15.0, "launches": 4736})
    assert cats["cublas_gemm"]["ms_per_step"] == pytest.approx(0.5)
    assert cats["attention"]["ms_per_step"] == pytest.approx(1.0)
    assert cats["other"]["ms"] == pytest.approx(68.0)
    assert s["gemm_share"] == pytest.approx(1984 / 2180)
    assert [k["name"] for k in s["top_kernels"]] == [
        "matmul_kernel_persistent", FA3, "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN"]
    assert s["top_kernels"][1]["category"] == "attention"
    assert s["top_kernels"][0]["ms_per_step"] == pytest.approx(15.0)
    assert s["cuda_graph_launches"] == 127
    assert s["kernel_launch_calls"] == 320


def test_summarise_of_an_empty_profile_is_zero_not_a_division_error():
    s = pd.summarise([], steps=128)
    assert s["total_device_ms"] == 0.0
    assert s["gemm_share"] == 0.0
    assert s["top_kernels"] == []
    assert s["cuda_graph_launches"] == 0


def test_summarise_rejects_zero_steps():
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        pd.summarise(_rows(), steps=0)


def test_rows_from_key_averages_reads_new_and_old_attribute_names():
    cuda = SimpleNamespace(name="CUDA")
    new = SimpleNamespace(key="nvjet_x", device_type=cuda, count=3, self_device_time_total=12.5,
                          device_time_total=12.5, self_cpu_time_total=0.0)
    old = SimpleNamespace(key="aten::mm", device_type="CPU", count=2, self_cuda_time_total=0.0,
                          cuda_time_total=7.0, self_cpu_time_total=40.0)
    assert pd.rows_from_key_averages([new, old]) == [
        {"name": "nvjet_x", "device_type": "CUDA", "count": 3, "self_device_us": 12.5,
         "device_us": 12.5, "cpu_us": 0.0},
        {"name": "aten::mm", "device_type": "CPU", "count": 2, "self_device_us": 0.0,
         "device_us": 7.0, "cpu_us": 40.0}]


LOG = (
    "INFO 11-29 10:53:49 [cuda.py:476] Using FLASH_ATTN attention backend out of potential "
    "backends: ['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].\n"
    "WARNING 11-29 10:53:50 [vllm_plugin.py:97] bistat_kernels: tuned GEMM installed as "
    "vllm.model_executor.layers.batch_invariant.matmul_persistent (pid 77)\n"
    "INFO 11-29 10:54:03 [monitor.py:53] torch.compile and initial profiling/warmup run together "
    "took 12.04 s in total\n"
    "Capturing CUDA graphs (PIECEWISE):   0%|          | 0/35 [00:00<?, ?it/s]\r"
    "Capturing CUDA graphs (PIECEWISE):   6%|▌         | 2/35 [00:00<00:01, 17.56it/s]\n"
    "Capturing CUDA graphs (decode, FULL):  11%|█  | 2/19 [00:00<00:01, 14.93it/s]\n"
    "INFO 11-29 10:54:08 [model_runner.py:722] Graph capturing finished in 4 secs, took 0.18 GiB\n"
    "INFO 11-29 10:54:08 [core.py:337] init engine (profile, create kv cache, warmup model) took "
    "17.87 s (compilation: 12.04 s)\n"
    "WARNING 11-29 10:54:09 [jit_monitor.py:129] Triton kernel JIT compilation during inference: "
    "_matmul_persistent_kernel. This causes a latency spike; consider extending warmup.\n")


def test_log_facts_reads_captures_backend_compile_and_inference_jit():
    assert pd.log_facts(LOG) == {
        "attention_backend": "FLASH_ATTN",
        "graph_capturing_finished_s": 4.0,
        "compile_s": 12.04,
        "engine_init_s": 17.87,
        "cuda_graph_capture_modes": ["PIECEWISE", "decode, FULL"],
        "jit_during_inference": ["_matmul_persistent_kernel"],
        "tuned_gemm_installed_lines": 1,
    }


def test_log_facts_of_an_eager_log_finds_no_captures():
    facts = pd.log_facts("INFO Using TRITON_ATTN attention backend\n")
    assert facts["cuda_graph_capture_modes"] == []
    assert facts["graph_capturing_finished_s"] is None


def _arm(call_s, persistent, cublas, attention, total, share, used=True, errors=()):
    cats = {"persistent_gemm": {"ms_per_step": persistent}, "cublas_gemm": {"ms_per_step": cublas},
            "attention": {"ms_per_step": attention}, "other": {"ms_per_step": 0.0}}
    return {"median_call_s": call_s, "graphs": {"used": used}, "errors": list(errors),
            "profile": {"categories": cats, "gemm_share": share,
                        "total_device_ms_per_step": total}}


def test_format_table_exact_output():
    arms = {
        "default": _arm(0.7104, 0.0, 5.4, 0.81, 6.9, 0.7826),
        "batch-invariant": _arm(2.4012, 18.02, 0.0, 0.8, 19.5, 0.9241),
        "bi-tuned-gemm": {"env": {}, "errors": [
            {"stage": "engine", "error": "RuntimeError: CUDA out of memory\nmore"}]},
    }
    assert pd.format_table(arms).splitlines() == [
        ("arm               call s GEMM share persist ms/step cuBLAS ms/step attn ms/step "
        "dev ms/step graphs"),
        "-" * 98,
        ("default            0.710     78.3 %            0.00           5.40         0.81"
        "        6.90    yes"),
        ("batch-invariant    2.401     92.4 %           18.02           0.00         0.80"
        "       19.50    yes"),
        ("bi-tuned-gemm          -          -               -              -            -"
        "           -      -  error: RuntimeError: CUDA out of memory"),
    ]


def test_prompt_ids_are_fixed_by_the_seed_and_inside_the_vocabulary():
    ids = pd.make_prompt_ids(8, 128, seed=0)
    assert len(ids) == 8 and {len(p) for p in ids} == {128}
    assert min(min(p) for p in ids) >= 3 and max(max(p) for p in ids) < 151000
    assert ids == pd.make_prompt_ids(8, 128, seed=0)
    assert ids != pd.make_prompt_ids(8, 128, seed=1)


def test_importing_the_script_loads_neither_torch_nor_vllm():
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("pd", {str(SCRIPT)!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        print(sorted(k for k in ("torch", "vllm", "triton") if k in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


FAKE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    argv = sys.argv
    arm = argv[argv.index("--arm") + 1]
    result = argv[argv.index("--result") + 1]
    assert "--worker" in argv
    print("INFO Using FLASH_ATTN attention backend")
    print("Capturing CUDA graphs (decode, FULL): 100%")
    sys.stdout.flush()
    if arm == "bi-tuned-gemm":
        time.sleep(60)
    env = {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "BISTAT_TUNED_GEMM",
                                          "VLLM_ENABLE_V1_MULTIPROCESSING", "NCCL_NVLS_ENABLE",
                                          "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE")}
    batch = int(argv[argv.index("--batch") + 1])
    with open(result, "w") as fh:
        json.dump({"arm": arm, "seen_env": env, "batch": batch, "median_call_s": 1.5,
                   "graphs": {"used": True}, "errors": []}, fh)
""")


@pytest.fixture()
def fake_worker(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(pd, "__file__", str(script))
    monkeypatch.setattr(pd, "provenance", lambda argv: {"command": "test"})
    return script


def test_driver_runs_each_arm_in_its_environment_and_survives_a_timeout(
        fake_worker, tmp_path, capsys):
    out = tmp_path / "o" / "profile_decode.json"
    rc = pd.main(["--model", "/m", "--out", str(out), "--batch", "4", "--timeout", "3"])
    assert rc == 1  # the timed-out arm is an error
    doc = json.loads(out.read_text())
    assert doc["schema"] == "bistat_kernels.profile_decode/1"
    assert doc["provenance"] == {"command": "test"}
    assert list(doc["arms"]) == ["default", "batch-invariant", "bi-tuned-gemm"]
    default, bi, tuned = (doc["arms"][a] for a in doc["arms"])
    assert default["seen_env"] == {"VLLM_BATCH_INVARIANT": "0", "BISTAT_TUNED_GEMM": "0",
                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                   "NCCL_NVLS_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                                   "HF_HUB_OFFLINE": "1"}
    assert bi["seen_env"]["VLLM_BATCH_INVARIANT"] == "1"
    assert bi["seen_env"]["BISTAT_TUNED_GEMM"] == "0"
    assert default["batch"] == 4 and default["returncode"] == 0 and default["errors"] == []
    assert default["graphs"]["capture_modes_in_log"] == ["decode, FULL"]
    assert default["log"]["attention_backend"] == "FLASH_ATTN"
    assert (out.parent / "profile_decode_default.log").exists()
    assert tuned["env"] == {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "1"}
    messages = [e["error"] for e in tuned["errors"]]
    assert messages[:2] == ["worker timed out after 3 s and was killed",
                            "the worker wrote no result"]
    assert "Capturing CUDA graphs" in tuned["errors"][-1]["log_tail"]
    table = capsys.readouterr().out
    assert "default            1.500" in table
    assert "bi-tuned-gemm" in table and "error: worker timed out after 3 s" in table


def test_driver_rejects_an_unknown_arm(tmp_path, capsys):
    rc = pd.main(["--model", "/m", "--out", str(tmp_path / "x.json"), "--arms", "default,fast"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "profile_decode.py: --arms: unknown arm(s) ['fast']; choose from "
        "['default', 'batch-invariant', 'bi-tuned-gemm']")


def test_plugin_calls_names_the_launch_of_each_tuned_gemm():
    calls = {(4096, 12288, 16, 64, 128, 2): 36, (4096, 4096, 16, 64, 128, 1): 72, (7, 8): 1}
    assert pd.plugin_calls(calls) == [
        {"key": [7, 8], "calls": 1},
        {"n": 4096, "k": 4096, "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 1,
         "calls": 72},
        {"n": 4096, "k": 12288, "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 2,
         "calls": 36}]


@pytest.mark.parametrize("version", ["0.25.0", "0.34.0"])
def test_the_worker_calls_only_what_the_vllm_release_accepts(version):
    """The worker's vLLM calls, checked against the release's own source without a GPU: each
    keyword it gives LLM(...) and SamplingParams(...) is a parameter there (LLM's **kwargs go to
    EngineArgs, whose fields they must then be), and each name it imports exists. It had run on
    0.25.0 only; the next device session profiles on 0.34.0 (skipped where the wheel is not on
    BISTAT_VLLM_WHEELS names no folder with the wheel: tests/external.py)."""
    import ast
    import zipfile

    with zipfile.ZipFile(vllm_wheel(version)) as zf:
        def source(rel: str) -> ast.Module:
            return ast.parse(zf.read(rel).decode())

        def params(tree: ast.Module, cls: str, method: str | None) -> set[str]:
            node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
            if method is None:   # a dataclass or msgspec struct: its annotated fields
                return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name)}
            fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
            return {a.arg for a in fn.args.args + fn.args.kwonlyargs}

        llm = params(source("vllm/entrypoints/llm.py"), "LLM", "__init__")
        engine_args = params(source("vllm/engine/arg_utils.py"), "EngineArgs", None)
        sampling = params(source("vllm/sampling_params.py"), "SamplingParams", None)
        names = {rel: {a.asname or a.name for n in ast.walk(source(rel))
                       if isinstance(n, ast.ImportFrom) for a in n.names}
                 | {n.name for n in ast.walk(source(rel))
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                 | {t.id for n in ast.walk(source(rel)) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
                 for rel in ("vllm/__init__.py", "vllm/inputs/__init__.py",
                             "vllm/plugins/__init__.py")}
        version_py = zf.read("vllm/_version.py").decode()
        init_py = zf.read("vllm/__init__.py").decode()
    worker = ast.parse(SCRIPT.read_text())

    def keywords(callee: str) -> set[str]:
        return {k.arg for n in ast.walk(worker) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id == callee for k in n.keywords}
    used_llm, used_sp = keywords("LLM"), keywords("SamplingParams")
    assert {"load_format", "max_num_seqs", "seed"} <= used_llm and "detokenize" in used_sp
    assert used_llm - llm <= engine_args, used_llm - llm - engine_args
    assert used_sp <= sampling, used_sp - sampling
    # vllm/__init__.py exports lazily in later releases (a table of names as strings)
    assert {"LLM", "SamplingParams"} <= names["vllm/__init__.py"] or all(
        f'"{n}"' in init_py for n in ("LLM", "SamplingParams"))
    assert "TokensPrompt" in names["vllm/inputs/__init__.py"]
    assert "load_general_plugins" in names["vllm/plugins/__init__.py"]
    assert "__commit_id__" in version_py
