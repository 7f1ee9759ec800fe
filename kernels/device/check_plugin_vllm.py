#!/usr/bin/env python3
"""Prove the plugin inside real vLLM 0.25.0: compiled mode, tuned kernel called, bits invariant.

usage: python3 check_plugin_vllm.py MODEL_DIR OUT_JSON [--needles 4] [--max-tokens 32]
                                    [--batch-sizes 1,7,32,96] [--load-format dummy]

Runs the offline engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's
Python state is readable here) with ``VLLM_BATCH_INVARIANT=1`` and ``BISTAT_TUNED_GEMM=1``, in
compiled mode (torch.compile + CUDA graphs: ``enforce_eager=False``, the default). It checks:

1. the plugin replaced ``matmul_persistent`` of vLLM's batch-invariant module (0.25.0:
   ``layers/``, 0.33.0: ``determinism/``) and the tuned op ran (``bistat_kernels.vllm_plugin.CALLS``: eager runs and CUDA-graph captures);
2. each needle prompt alone gives bitwise the same token ids and logprobs as the same prompt
   placed at several positions inside batches of other prompts (``--batch-sizes``);
3. as a negative-control hint, it records whether the needle's outputs differ at all between
   needles (a probe that sees no difference anywhere has no power).

Needs ``bistat_kernels`` importable (e.g. ``PYTHONPATH=$PWD/kernels:/tmp/site``) and the plugin registered: vLLM loads general plugins from
entry points, which exist only if bistat is pip-installed; otherwise this script calls
``register()`` itself before the engine starts (the same function the entry point names) and
says so in the JSON. Exit code 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
os.environ.setdefault("BISTAT_TUNED_GEMM", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

FILLER_TOPICS = ["volcanoes", "jazz", "the Roman Empire", "coral reefs", "chess", "trains",
                 "honey bees", "black holes", "the piano", "coffee", "earthquakes", "vaccines"]


def _bits(values: list[float]) -> str:
    return struct.pack(f"<{len(values)}f", *values).hex()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_json")
    parser.add_argument("--needles", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,7,32,96")
    parser.add_argument("--load-format", default=None, help="e.g. dummy (random weights)")
    args = parser.parse_args()

    from bistat_kernels import vllm_plugin

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    registered_by = "entry point"
    if not vllm_plugin.installed():
        vllm_plugin.register()
        registered_by = "check_plugin_vllm.py (no entry point installed)"
    bi = vllm_plugin.hooked_module() or vllm_plugin.find_hook()[0]  # 0.25 layers/, 0.33 determinism/

    t0 = time.perf_counter()
    extra = {"load_format": args.load_format} if args.load_format else {}
    has_tokenizer = os.path.exists(os.path.join(args.model_dir, "tokenizer.json"))
    llm = LLM(model=args.model_dir, dtype="bfloat16", seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=0.4, max_model_len=1024, max_num_seqs=128,
              skip_tokenizer_init=not has_tokenizer, **extra)
    init_s = time.perf_counter() - t0
    compilation = getattr(llm.llm_engine.vllm_config, "compilation_config", None)

    rng = random.Random(0)
    if has_tokenizer:
        def prompt(i: int, kind: str):
            topic = FILLER_TOPICS[i % len(FILLER_TOPICS)]
            return f"{kind} {i}: write three sentences about {topic}."
    else:
        from vllm.inputs import TokensPrompt

        def prompt(i: int, kind: str):
            r = random.Random(f"{kind}-{i}")
            return TokensPrompt(prompt_token_ids=[r.randrange(100, 30000) for _ in range(24)])

    sp = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=args.max_tokens,
                        logprobs=1, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
            res.append({"ids": ids, "lp_bits": _bits(lps)})
        return res

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    checks = []
    alone_outputs = []
    for n in range(args.needles):
        needle = prompt(n, "needle")
        alone = run([needle])[0]
        alone_outputs.append(alone)
        for size in batch_sizes:
            if size < 2:
                continue
            pos = rng.randrange(size)
            fillers = [prompt(1000 * n + j, "filler") for j in range(size - 1)]
            batch = fillers[:pos] + [needle] + fillers[pos:]
            got = run(batch)[pos]
            checks.append({"needle": n, "batch_size": size, "position": pos,
                           "ids_equal": got["ids"] == alone["ids"],
                           "logprobs_bitwise_equal": got["lp_bits"] == alone["lp_bits"]})
    distinct = len({(tuple(o["ids"]), o["lp_bits"]) for o in alone_outputs})
    calls = {str(k): v for k, v in sorted(vllm_plugin.CALLS.items())}
    result = {
        "vllm": vllm.__version__,
        "model_dir": args.model_dir,
        "env": {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "BISTAT_TUNED_GEMM",
                                               "VLLM_ENABLE_V1_MULTIPROCESSING")},
        "engine_init_s": round(init_s, 1),
        "compilation_level": str(getattr(compilation, "level", getattr(compilation, "mode", None))),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
        "plugin_registered_by": registered_by,
        "plugin_installed": vllm_plugin.installed(),
        "matmul_persistent_is_ours": getattr(getattr(bi, "matmul_persistent", None), "__wrapped__", None) is not None,
        "tuned_op_calls": calls,
        "needle_checks": checks,
        "distinct_needle_outputs": distinct,
        "passed": False,
    }
    result["passed"] = bool(result["plugin_installed"] and result["matmul_persistent_is_ours"]
                            and calls and checks
                            and all(c["ids_equal"] and c["logprobs_bitwise_equal"] for c in checks))
    with open(args.out_json, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "needle_checks"}, indent=1))
    print(f"needle checks: {sum(c['ids_equal'] and c['logprobs_bitwise_equal'] for c in checks)}"
          f"/{len(checks)} bitwise equal; passed={result['passed']}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
