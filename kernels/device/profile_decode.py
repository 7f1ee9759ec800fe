#!/usr/bin/env python3
"""Where vLLM's small-batch decode time goes: default, batch-invariant, bistat's tuned GEMM.

Measures
--------
The claim: at small batch the batch-invariant "tax" of vLLM 0.25.0 *is* its persistent
Triton GEMM (``matmul_kernel_persistent``), and that bistat's tuned GEMM plugin
(``bistat_kernels.vllm_plugin``, ``BISTAT_TUNED_GEMM=1``) removes most of it while the model stays
inside torch.compile and CUDA graphs. This script checks that with the torch profiler, per arm:

``default``
    ``VLLM_BATCH_INVARIANT=0`` (cuBLAS GEMMs);
``batch-invariant``
    ``VLLM_BATCH_INVARIANT=1`` (vLLM's fixed-configuration persistent GEMM);
``bi-tuned-gemm``
    ``VLLM_BATCH_INVARIANT=1`` and ``BISTAT_TUNED_GEMM=1`` (bistat's tuned persistent GEMM).

Each arm runs in a fresh subprocess (this script with ``--worker``) with the vLLM engine in that
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the profiler sees the GPU work and the
plugin's call counter is readable. The worker builds ``vllm.LLM`` in compiled mode (torch.compile +
CUDA graphs: ``enforce_eager`` is not passed) on a config-only model folder with
``load_format="dummy"`` and ``skip_tokenizer_init=True``, sends one batch of ``--batch`` token-id
prompts (``--prompt-tokens`` random ids in [3, 151000), fixed seed) for exactly ``--max-tokens``
greedy tokens each, runs ``--warmups`` untimed calls, times ``--calls`` calls (median reported),
then profiles one more call (``torch.profiler``, CPU + CUDA activities) and summarises
``key_averages()``: total device time, the top kernels, and four categories by kernel name
(:func:`categorise`) with their time, share and time per decode step (time divided by the output
tokens per request; the one prefill step is included). CUDA-graph use is read three ways: the
engine's compilation config, ``cudaGraphLaunch`` calls in the profiled call, and the engine's log
("Capturing CUDA graphs", "Graph capturing finished"; :func:`log_facts`).

Running
-------
On the GPU machine, from the repository root (vLLM 0.25.0 on ``PYTHONPATH``)::

    python3 kernels/device/profile_decode.py --model /tmp/model/qwen3-8b-config \\
        --out "$OUT/profile_decode.json"

``--arms batch-invariant,bi-tuned-gemm`` picks a subset; ``--timeout`` bounds each worker and
``--budget-s`` the whole command (a worker never gets more than what is left). ``bistat_kernels``
is imported if installed (``pip install -e .``, which also installs the plugin's entry point);
otherwise the ``kernels/`` folder (which holds the package) is put on ``sys.path``, and the
worker calls the plugin's ``register()`` itself (the function the entry point names), saying so in
the JSON.

Output
------
``--out`` (JSON, rewritten after every arm, so a killed command keeps the finished arms)::

    {"schema": "bistat_kernels.profile_decode/1",
     "provenance": {...},     # bistat_kernels.provenance.gpu_provenance + vllm version and commit
     "settings": {...},       # model, batch, tokens, calls, common environment
     "arms": {"<arm>": {"env": {...}, "returncode": 0, "elapsed_s": ..., "log_file": "...",
                        "engine_init_s": ..., "call_s": [...], "median_call_s": ...,
                        "ms_per_step": ..., "profiled_call_s": ...,
                        "profile": {summarise(...)}, "graphs": {...}, "plugin": {...},
                        "versions": {...}, "log": {log_facts(...)}, "errors": [...]}}}

and, beside it, one engine log per arm (``profile_decode_<arm>.log``). The table printed at the
end is :func:`format_table`.

Everything above the ``# --- GPU side`` line is pure (no torch, no vLLM) and is tested in
``tests/kernels/test_profile_decode.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "bistat_kernels.profile_decode/1"

#: Arm name -> the environment that defines it.
ARMS: dict[str, dict[str, str]] = {
    "default": {"VLLM_BATCH_INVARIANT": "0", "BISTAT_TUNED_GEMM": "0"},
    "batch-invariant": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "0"},
    "bi-tuned-gemm": {"VLLM_BATCH_INVARIANT": "1", "BISTAT_TUNED_GEMM": "1"},
}

#: Set in every worker: engine in-process, no NVLink multicast, no flashinfer sampler, offline.
COMMON_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}

CATEGORIES: tuple[str, ...] = ("persistent_gemm", "cublas_gemm", "attention", "other")
GEMM_CATEGORIES: tuple[str, ...] = ("persistent_gemm", "cublas_gemm")

# vLLM's batch-invariant GEMM (also as "matmul_kernel_persistent [M=.., N=.., K=..]" when Triton's
# launch metadata names it) and bistat's tuned kernels (kernels/bistat_kernels/matmul_kernels.py).
_PERSISTENT = ("matmul_kernel_persistent", "_matmul_persistent_kernel", "_splitk_reduce_kernel")
# Kernels that torch.compile's Inductor generates: elementwise/reduction fusions, never attention
# or a library GEMM, whatever ops their names list.
_INDUCTOR = ("triton_poi_", "triton_red_", "triton_per_", "triton_for_", "triton_tem_")
# FlashAttention 2/3 (flash::FlashAttnFwdSm90 inside cutlass::device_kernel<...>, combine and
# scheduler kernels), vLLM's Triton attention (kernel_unified_attention_2d/3d, reduce_segments),
# paged attention, and the KV-cache write (reshape_and_cache_flash_kernel).
_ATTENTION = ("flash", "attn", "attention", "fwd", "reshape_and_cache")
# cuBLAS / cuBLASLt on Hopper: nvjet_* (the current cuBLAS kernels), sm90_xmma_gemm_*, cutlass
# kernels, gemv, and cuBLASLt's split-K reduction.
_CUBLAS = ("nvjet", "gemm", "xmma", "cutlass", "sm90", "sm80", "gemv", "splitkreduce", "cublas")


def categorise(kernel_name: str) -> str:
    """The category of a GPU kernel name: one of :data:`CATEGORIES`.

    Checked in order: the persistent (batch-invariant) GEMMs of vLLM and bistat, Inductor's
    generated kernels (``other``), attention (before cuBLAS: FlashAttention 3's kernels are
    ``cutlass::device_kernel<flash::...Sm90...>``), cuBLAS/cutlass GEMMs, and ``other``.
    """
    if any(p in kernel_name for p in _PERSISTENT):
        return "persistent_gemm"
    lowered = kernel_name.lower()
    if lowered.startswith(_INDUCTOR):
        return "other"
    if any(p in lowered for p in _ATTENTION):
        return "attention"
    if any(p in lowered for p in _CUBLAS):
        return "cublas_gemm"
    return "other"


_GRAPH_LAUNCH = re.compile(r"^(cuda|cu)GraphLaunch")
_KERNEL_LAUNCH = re.compile(r"^(cuda|cu)LaunchKernel")


def summarise(rows: Iterable[Mapping[str, Any]], steps: int, top: int = 20) -> dict[str, Any]:
    """Device time of one profiled call, by kernel and by category.

    Parameters
    ----------
    rows
        One mapping per ``key_averages()`` entry (:func:`rows_from_key_averages`): ``name``,
        ``device_type`` (``"CUDA"`` for GPU activity, ``"CPU"`` for host ops and runtime calls),
        ``count`` and ``self_device_us``.
    steps
        Decode steps in the call (output tokens per request); the per-step figures divide by it.
    top
        How many kernels to list, longest total device time first.

    Returns
    -------
    dict
        ``total_device_ms``, ``total_device_ms_per_step``, ``distinct_kernels``,
        ``kernel_launches`` (GPU activities), ``categories`` (per :data:`CATEGORIES`: ``ms``,
        ``share``, ``ms_per_step``, ``launches``), ``gemm_share``, ``top_kernels`` (``name``,
        ``category``, ``ms``, ``share``, ``ms_per_step``, ``count``), and from the host rows
        ``cuda_graph_launches`` and ``kernel_launch_calls``.
    """
    if steps < 1:
        raise ValueError(f"profile_decode.summarise: steps must be >= 1, got {steps}")
    device: list[tuple[str, float, int]] = []
    graph_launches = kernel_calls = 0
    for row in rows:
        name = str(row["name"])
        count = int(row.get("count", 0))
        if str(row.get("device_type", "CPU")).upper() == "CPU":
            if _GRAPH_LAUNCH.match(name):
                graph_launches += count
            elif _KERNEL_LAUNCH.match(name):
                kernel_calls += count
            continue
        device.append((name, float(row.get("self_device_us", 0.0)), count))
    total_us = sum(us for _, us, _ in device)

    def share(us: float) -> float:
        return us / total_us if total_us > 0 else 0.0

    cats = {c: {"us": 0.0, "launches": 0} for c in CATEGORIES}
    for name, us, count in device:
        cat = cats[categorise(name)]
        cat["us"] += us
        cat["launches"] += count
    categories = {
        c: {"ms": v["us"] / 1e3, "share": share(v["us"]), "ms_per_step": v["us"] / 1e3 / steps,
            "launches": v["launches"]}
        for c, v in cats.items()}
    ranked = sorted(device, key=lambda r: (-r[1], r[0]))[:top]
    return {
        "steps": steps,
        "total_device_ms": total_us / 1e3,
        "total_device_ms_per_step": total_us / 1e3 / steps,
        "distinct_kernels": len(device),
        "kernel_launches": sum(c for _, _, c in device),
        "categories": categories,
        "gemm_share": sum(categories[c]["share"] for c in GEMM_CATEGORIES),
        "top_kernels": [{"name": n, "category": categorise(n), "ms": us / 1e3, "share": share(us),
                         "ms_per_step": us / 1e3 / steps, "count": count}
                        for n, us, count in ranked],
        "cuda_graph_launches": graph_launches,
        "kernel_launch_calls": kernel_calls,
    }


def rows_from_key_averages(averages: Iterable[Any]) -> list[dict[str, Any]]:
    """Plain rows from ``torch.profiler``'s ``key_averages()`` (works across torch versions).

    Device time is ``self_device_time_total`` (torch >= 2.4) or ``self_cuda_time_total`` (older),
    in microseconds; ``device_type`` is the ``DeviceType`` member's name (``CUDA``, ``CPU``).
    """
    rows = []
    for avg in averages:
        self_us = getattr(avg, "self_device_time_total", None)
        if self_us is None:
            self_us = getattr(avg, "self_cuda_time_total", 0.0)
        total_us = getattr(avg, "device_time_total", None)
        if total_us is None:
            total_us = getattr(avg, "cuda_time_total", 0.0)
        dtype = getattr(avg, "device_type", "CPU")
        rows.append({"name": str(avg.key), "device_type": str(getattr(dtype, "name", dtype)),
                     "count": int(getattr(avg, "count", 0)), "self_device_us": float(self_us),
                     "device_us": float(total_us),
                     "cpu_us": float(getattr(avg, "self_cpu_time_total", 0.0))})
    return rows


_LOG_PATTERNS: dict[str, re.Pattern[str]] = {
    "attention_backend": re.compile(r"Using (\S+) attention backend"),
    "graph_capturing_finished_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "compile_s": re.compile(r"torch\.compile and initial profiling/warmup run together took "
                            r"([\d.]+) s"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took "
                                r"([\d.]+) s"),
}
_CAPTURE = re.compile(r"Capturing CUDA graphs \(([^)]*)\)")
_JIT = re.compile(r"Triton kernel JIT compilation during inference: (\S+?)\.?(?:\s|$)")


def log_facts(text: str) -> dict[str, Any]:
    """Facts from a vLLM engine log: CUDA-graph captures, backend, compile, inference-time JIT.

    Returns ``cuda_graph_capture_modes`` (the distinct ``Capturing CUDA graphs (...)`` labels, in
    order of first appearance), ``attention_backend``, ``graph_capturing_finished_s``,
    ``compile_s``, ``engine_init_s`` (None when absent), ``jit_during_inference`` (kernel names
    that vLLM's JIT monitor saw compiled after start-up) and ``tuned_gemm_installed_lines``.
    """
    lines = re.split(r"[\r\n]+", text)
    modes: list[str] = []
    jit: list[str] = []
    facts: dict[str, Any] = {k: None for k in _LOG_PATTERNS}
    installed = 0
    for line in lines:
        for m in _CAPTURE.finditer(line):
            if m.group(1) not in modes:
                modes.append(m.group(1))
        for key, pat in _LOG_PATTERNS.items():
            m = pat.search(line)
            if m and facts[key] is None:
                value = m.group(1)
                facts[key] = value if key == "attention_backend" else float(value)
        m = _JIT.search(line)
        if m and m.group(1) not in jit:
            jit.append(m.group(1))
        if "tuned GEMM installed as" in line:
            installed += 1
    facts["cuda_graph_capture_modes"] = modes
    facts["jit_during_inference"] = jit
    facts["tuned_gemm_installed_lines"] = installed
    return facts


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(arms: Mapping[str, Mapping[str, Any]]) -> str:
    """The summary table: one line per arm (a failed arm shows its first error)."""
    header = (f"{'arm':<16} {'call s':>7} {'GEMM share':>10} {'persist ms/step':>15} "
              f"{'cuBLAS ms/step':>14} {'attn ms/step':>12} {'dev ms/step':>11} {'graphs':>6}")
    out = [header, "-" * len(header)]
    for name, arm in arms.items():
        prof = arm.get("profile") or {}
        cats = prof.get("categories") or {}
        per_step = {c: (cats.get(c) or {}).get("ms_per_step") for c in CATEGORIES}
        share = prof.get("gemm_share")
        graphs = arm.get("graphs") or {}
        used = graphs.get("used")
        share_text = "-" if share is None else f"{100 * share:.1f} %"
        line = (f"{name:<16} {_fmt(arm.get('median_call_s'), '.3f'):>7} {share_text:>10} "
                f"{_fmt(per_step['persistent_gemm'], '.2f'):>15} "
                f"{_fmt(per_step['cublas_gemm'], '.2f'):>14} "
                f"{_fmt(per_step['attention'], '.2f'):>12} "
                f"{_fmt(prof.get('total_device_ms_per_step'), '.2f'):>11} "
                f"{'-' if used is None else ('yes' if used else 'NO'):>6}")
        errors = arm.get("errors") or []
        if errors:
            first = errors[0].get("error", "") if isinstance(errors[0], Mapping) else errors[0]
            line += f"  error: {(str(first).splitlines() or [''])[0][:100]}"
        out.append(line)
    return "\n".join(out)


_CALL_KEY = ("n", "k", "block_m", "block_n", "block_k", "split_k")


def plugin_calls(calls: Mapping[tuple[int, ...], int]) -> list[dict[str, Any]]:
    """``bistat_kernels.vllm_plugin.CALLS`` as rows, sorted by key.

    Keys are ``(N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)``; a key of another length is kept
    whole under ``key``. The counts are executions of the tuned op's Python body: eager calls and
    CUDA-graph captures (a graph replay runs no Python).
    """
    rows = []
    for key, count in sorted(calls.items()):
        row: dict[str, Any] = (dict(zip(_CALL_KEY, key)) if len(key) == len(_CALL_KEY)
                               else {"key": list(key)})
        row["calls"] = int(count)
        rows.append(row)
    return rows


def make_prompt_ids(batch: int, prompt_tokens: int, seed: int = 0,
                    low: int = 3, high: int = 151000) -> list[list[int]]:
    """``batch`` lists of ``prompt_tokens`` token ids in [low, high), the same for every seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(prompt_tokens)] for _ in range(batch)]


def tail(text: str, lines: int = 40, chars: int = 4000) -> str:
    """The last ``lines`` lines of ``text``, at most ``chars`` characters."""
    return "\n".join(text.splitlines()[-lines:])[-chars:]


# --- GPU side (parent driver and worker); imports torch / vLLM only inside functions ----------

KERNELS_DIR = Path(__file__).resolve().parents[1]  # kernels/, the folder that holds bistat_kernels/


def ensure_bistat_kernels() -> str | None:
    """Make ``bistat_kernels`` importable; return the folder added to ``sys.path`` (or None)."""
    import importlib.util

    if importlib.util.find_spec("bistat_kernels") is not None:
        return None
    sys.path.insert(0, str(KERNELS_DIR))
    return str(KERNELS_DIR)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _error(stage: str, exc: BaseException) -> dict[str, str]:
    return {"stage": stage, "error": f"{type(exc).__name__}: {exc}",
            "traceback_tail": traceback.format_exc()[-3000:]}


def worker(args: argparse.Namespace) -> int:
    """One arm in this process: engine, warm-up, timed calls, a profiled call; JSON to --result."""
    result: dict[str, Any] = {"arm": args.arm, "errors": []}
    out = Path(args.result)
    stage = "import"
    try:
        ensure_bistat_kernels()
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.plugins import load_general_plugins

        try:
            from vllm._version import __commit_id__ as vllm_commit
        except ImportError:
            vllm_commit = None
        result["versions"] = {"vllm": vllm.__version__, "vllm_commit": vllm_commit,
                              "torch": torch.__version__, "cuda": torch.version.cuda}
        try:
            import triton
            result["versions"]["triton"] = triton.__version__
        except ImportError:
            pass

        stage = "plugin"
        from bistat_kernels import vllm_plugin

        load_general_plugins()
        plugin: dict[str, Any] = {"requested": vllm_plugin.enabled(), "registered_by": None}
        if plugin["requested"]:
            plugin["registered_by"] = "entry point"
            if not vllm_plugin.installed():
                vllm_plugin.register()
                plugin["registered_by"] = "profile_decode.py (no entry point installed)"
        result["plugin"] = plugin

        stage = "engine"
        t0 = time.perf_counter()
        llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=args.max_model_len, max_num_seqs=args.batch,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=False, seed=args.seed)
        result["engine_init_s"] = time.perf_counter() - t0
        props = torch.cuda.get_device_properties(0)  # after the engine: it initialises CUDA
        result["versions"]["gpu_name"] = props.name
        result["versions"]["gpu_uuid"] = str(getattr(props, "uuid", ""))
        cc = getattr(llm.llm_engine.vllm_config, "compilation_config", None)
        result["graphs"] = {
            "compilation_mode": str(getattr(cc, "mode", getattr(cc, "level", None))),
            "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
            "cudagraph_capture_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or []),
        }
        _write_json(out, result)

        prompts = [TokensPrompt(prompt_token_ids=ids)
                   for ids in make_prompt_ids(args.batch, args.prompt_tokens, args.seed)]
        sp = SamplingParams(temperature=0.0, top_p=1.0, top_k=0,
                            max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            ignore_eos=True, detokenize=False)

        def call() -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            lengths = sorted({len(o.outputs[0].token_ids) for o in outs})
            if len(outs) != args.batch or lengths != [args.max_tokens]:
                raise RuntimeError(f"expected {args.batch} outputs of {args.max_tokens} tokens, "
                                   f"got {len(outs)} with lengths {lengths}")
            return took

        stage = "warm-up"
        result["warmup_s"] = [call() for _ in range(args.warmups)]
        stage = "timed calls"
        result["call_s"] = [call() for _ in range(args.calls)]
        result["median_call_s"] = statistics.median(result["call_s"])
        result["ms_per_step"] = result["median_call_s"] * 1e3 / args.max_tokens
        _write_json(out, result)

        stage = "profile"
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result["profiled_call_s"] = call()
        stage = "summary"
        rows = rows_from_key_averages(prof.key_averages())
        summary = summarise(rows, steps=args.max_tokens, top=args.top)
        result["profile"] = summary
        result["device_rows"] = sorted(
            (r for r in rows if r["device_type"].upper() != "CPU"),
            key=lambda r: -r["self_device_us"])
        if summary["distinct_kernels"] == 0:
            result["errors"].append({"stage": stage, "error": "the profile holds no GPU "
                                     "activity (is CUPTI available to torch.profiler?)"})
        result["graphs"]["cuda_graph_launches_in_profile"] = summary["cuda_graph_launches"]
        result["graphs"]["kernel_launch_calls_in_profile"] = summary["kernel_launch_calls"]
        result["graphs"]["used"] = summary["cuda_graph_launches"] > 0

        stage = "plugin calls"
        bi = vllm_plugin.hooked_module() or vllm_plugin.find_hook()[0]  # 0.25 layers/, 0.33 determinism/

        plugin["installed"] = vllm_plugin.installed()
        plugin["matmul_persistent_is_ours"] = hasattr(getattr(bi, "matmul_persistent", None), "__wrapped__")
        plugin["calls"] = plugin_calls(vllm_plugin.CALLS)
        if plugin["requested"] and not (plugin["installed"] and plugin["calls"]):
            result["errors"].append({"stage": stage, "error": "BISTAT_TUNED_GEMM=1 but the tuned "
                                     "GEMM was not installed or never called"})
        _write_json(out, result)
    except BaseException as exc:  # noqa: BLE001 - the arm's record must survive any failure
        result["errors"].append(_error(stage, exc))
        _write_json(out, result)
        print(f"[profile_decode] arm {args.arm} failed at {stage}: {exc}", flush=True)
        sys.stdout.flush()
        os._exit(1)
    print(f"[profile_decode] arm {args.arm} done", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's teardown: the result is written and the parent reaps the group


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_arm(name: str, args: argparse.Namespace, out_dir: Path, timeout_s: float,
            extra_path: str | None) -> dict[str, Any]:
    """Run one arm's worker; return its record (worker result + environment, log facts, errors)."""
    env = dict(os.environ)
    env.update(COMMON_ENV)
    env.update(ARMS[name])
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    log_path = out_dir / f"profile_decode_{name}.log"
    with tempfile.TemporaryDirectory(prefix="profile_decode_") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--arm", name,
               "--result", str(result_path), "--model", args.model, "--out", str(args.out),
               "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens),
               "--max-tokens", str(args.max_tokens), "--warmups", str(args.warmups),
               "--calls", str(args.calls), "--top", str(args.top), "--seed", str(args.seed),
               "--max-model-len", str(args.max_model_len),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        record: dict[str, Any] = {"env": {k: env[k] for k in ARMS[name]}, "log_file": log_path.name,
                                  "timeout_s": round(timeout_s, 1)}
        errors: list[dict[str, str]] = []
        t0 = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                record["returncode"] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                record["returncode"] = proc.wait()
                errors.append({"stage": "parent", "error": f"worker timed out after "
                               f"{timeout_s:.0f} s and was killed"})
            finally:
                _kill_group(proc)  # compile workers and anything else the worker left behind
        record["elapsed_s"] = time.perf_counter() - t0
        text = log_path.read_text(encoding="utf-8", errors="replace")
        record["log"] = log_facts(text)
        worker_result: dict[str, Any] = {}
        if result_path.exists():
            try:
                worker_result = json.loads(result_path.read_text(encoding="utf-8"))
            except ValueError as exc:
                errors.append({"stage": "parent", "error": f"unreadable worker result: {exc}"})
        else:
            errors.append({"stage": "parent", "error": "the worker wrote no result"})
    errors = list(worker_result.pop("errors", [])) + errors
    record.update(worker_result)
    graphs = record.setdefault("graphs", {})
    graphs["capture_modes_in_log"] = record["log"]["cuda_graph_capture_modes"]
    if record.get("returncode") != 0 or not worker_result:
        errors.append({"stage": "parent", "error": f"worker exit code {record.get('returncode')}",
                       "log_tail": tail(text)})
    record["errors"] = errors
    return record


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    """GPU, driver, versions, date and command (bistat_kernels.provenance) plus vLLM's commit."""
    from bistat_kernels.provenance import gpu_provenance

    prov = gpu_provenance(0, command=[Path(sys.executable).name, *argv])
    try:
        from vllm._version import __commit_id__, __version__

        prov["vllm"], prov["vllm_commit"] = __version__, __commit_id__
    except ImportError as exc:
        prov["vllm_error"] = str(exc)
    return prov


def driver(args: argparse.Namespace) -> int:
    """Run the arms one after another, each in a fresh worker; write the JSON; print the table."""
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        print(f"profile_decode.py: --arms: unknown arm(s) {unknown}; choose from {list(ARMS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra_path = ensure_bistat_kernels()
    start = time.perf_counter()
    doc: dict[str, Any] = {
        "schema": SCHEMA, "provenance": None,
        "settings": {"model": args.model, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "warmups": args.warmups,
                     "timed_calls": args.calls, "max_model_len": args.max_model_len,
                     "gpu_memory_utilization": args.gpu_memory_utilization, "seed": args.seed,
                     "load_format": "dummy", "common_env": COMMON_ENV, "arms": names,
                     "bistat_kernels_linked_from": extra_path},
        "arms": {}}
    for name in names:
        left = args.budget_s - (time.perf_counter() - start) - 20
        if left < 30:
            doc["arms"][name] = {"env": ARMS[name], "errors": [{"stage": "parent", "error":
                                 f"skipped: {left:.0f} s of the budget left"}]}
            continue
        print(f"[profile_decode] {time.strftime('%H:%M:%S')} arm {name} ...", flush=True)
        try:
            doc["arms"][name] = run_arm(name, args, out.parent, min(args.timeout, left),
                                        extra_path)
        except Exception as exc:  # noqa: BLE001 - one arm's failure must not lose the others
            doc["arms"][name] = {"env": ARMS[name], "errors": [_error("parent", exc)]}
        arm = doc["arms"][name]
        print(f"[profile_decode] arm {name}: median call {arm.get('median_call_s')} s, "
              f"elapsed {arm.get('elapsed_s', 0):.0f} s, errors {len(arm['errors'])}", flush=True)
        _write_json(out, doc)
    try:
        doc["provenance"] = provenance(sys.argv)
    except Exception as exc:  # noqa: BLE001
        doc["provenance"] = {"error": _error("provenance", exc)}
    doc["total_s"] = time.perf_counter() - start
    _write_json(out, doc)
    print(format_table(doc["arms"]))
    print(f"[profile_decode] wrote {out} in {doc['total_s']:.0f} s")
    return 0 if all(not a.get("errors") for a in doc["arms"].values()) else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder (config only: dummy weights)")
    p.add_argument("--out", required=True, help="output JSON path")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {list(ARMS)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per worker")
    p.add_argument("--budget-s", type=float, default=570.0, help="seconds for the whole command")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
