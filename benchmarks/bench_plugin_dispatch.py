"""Benchmark: the host time the tuned-GEMM plugin adds to each GEMM call outside CUDA graphs.

Why: at workload (i) of the H200 cost study (1000 requests at once, 650-800 running, more than
vLLM 0.25.0 captures in CUDA graphs) the tuned GEMM cost 13 % throughput while vLLM's own
batch-invariant kernel cost 3 %, although the kernel bench has the tuned kernel faster at those
sizes (docs/STUDIES.md). A step that is not a graph replay runs each GEMM's Python: vLLM calls its
``matmul_persistent`` directly; the plugin (``bistat_kernels.vllm_plugin``) routes the same call
through a ``torch.library`` operator and a table lookup. This measures that extra host time per
call, side by side in one process, with the kernel launch itself replaced by the same stub in
both paths (so it runs on a CPU, with torch alone):

* ``direct``: a function with vLLM's signature calling the stub (what vLLM's path costs beyond
  the launch);
* ``plugin``: the plugin installed on a stand-in for vLLM's module, called the same way (operator
  dispatch, ``_device_facts``, the launch configuration's lookup, then the stub);
* ``custom_op``: the plugin as it was until session 6, for comparison: the same body made an
  operator by ``torch.library.custom_op``, looking the configuration up on every call.

Printed: microseconds per call of each, the difference, and that difference times the GEMM calls
of one Qwen3-8B decode step (36 layers x 4 linear layers + the LM head = 145). The host here is
not the GPU machine's: the figure says how large the effect can be, not what it is on the H200.

    python benchmarks/bench_plugin_dispatch.py [--calls 20000] [--repeats 5] [--m 700]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import types

QWEN3_8B_GEMMS_PER_STEP = 36 * 4 + 1  # qkv, o, gate_up, down per layer + the LM head


def _per_call_us(fn, calls: int) -> float:
    for _ in range(min(calls, 1000)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--m", type=int, default=700, help="rows per GEMM (running requests)")
    args = parser.parse_args()

    import torch

    from bistat_kernels import matmul_persistent as mp
    from bistat_kernels import tables, vllm_plugin

    # the H200's table, as on the GPU machine (here the device has no name to find it by)
    tables.set_device_table(tables.load_table(tables.TABLES_DIR / "nvidia_h200.json"))

    def stub(a, b, bias=None, config=None):  # the launch, the same in both paths
        return a.new_empty((a.shape[0], b.shape[1]))

    mp.matmul_persistent = stub  # the plugin's op calls mp.matmul_persistent(a, b, bias, config=cfg)
    vllm_like = types.ModuleType("vllm_like_batch_invariant")
    vllm_like.matmul_persistent = lambda a, b, bias=None: stub(a, b, bias)
    direct = vllm_like.matmul_persistent
    if not vllm_plugin.install(vllm_like):
        print("the plugin did not install", file=sys.stderr)
        return 1
    plugin = vllm_like.matmul_persistent

    @torch.library.custom_op("bistat_bench::matmul_persistent", mutates_args=(),
                             schema="(Tensor a, Tensor b, Tensor? bias) -> Tensor")
    def before(a, b, bias):
        M, K = a.shape
        N = b.shape[1]
        _, facts = mp._device_facts(a.device)
        cfg = tables.lookup_config(M, N, K, mp.dtype_name(a.dtype), facts)
        key = (N, K, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
        vllm_plugin.CALLS[key] = vllm_plugin.CALLS.get(key, 0) + 1
        return mp.matmul_persistent(a, b, bias, config=cfg)

    a = torch.empty(args.m, 4096, dtype=torch.bfloat16)
    b = torch.empty(4096, 6144, dtype=torch.bfloat16)  # Qwen3-8B's qkv projection
    rows = []
    for _ in range(args.repeats):  # alternate the two paths, so drift hits both alike
        rows.append((_per_call_us(lambda: direct(a, b, None), args.calls),
                     _per_call_us(lambda: plugin(a, b, None), args.calls),
                     _per_call_us(lambda: before(a, b, None), args.calls)))
    d, p, c = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"host: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"torch {torch.__version__}; M = {args.m}, {args.calls} calls x {args.repeats} repeats "
          "(medians)")
    print(f"direct (vLLM's path, launch stubbed):  {d:8.2f} us per call")
    print(f"plugin (torch.library op + lookup):    {p:8.2f} us per call")
    print(f"custom_op (the plugin until session 6): {c:7.2f} us per call")
    for name, t in (("plugin", p), ("custom_op", c)):
        print(f"added by {name + ':':<11} {t - d:8.2f} us per call; x {QWEN3_8B_GEMMS_PER_STEP} GEMM "
              f"calls per Qwen3-8B step: {(t - d) * QWEN3_8B_GEMMS_PER_STEP / 1e3:.2f} ms of host time "
              "per step outside CUDA graphs")
    print(f"ratio of the added host time, custom_op / plugin: {(c - d) / (p - d):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
