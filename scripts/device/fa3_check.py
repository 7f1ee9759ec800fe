"""Device check of bistat's FlashAttention-3 pin (BISTAT_FA3_PIN, kernels/vllm_fa3.py).

    python scripts/device/fa3_check.py kernel OUT.json     # FA3 itself, no engine (≈ 20 s)
    python scripts/device/fa3_check.py ARM OUT.json        # ARM: bi_fa3 | bi_fa3_pin | bi_triton

``kernel``: vLLM's FA3 (``vllm.vllm_flash_attn.flash_attn_varlen_func``) on SmolLM2-135M's
attention shape (9 query heads, 3 KV heads, head size 64, bf16, 16-key pages): one decode row
of KV length L alone (``max_seqlen_q`` 1) and beside a 40-token prefill (``max_seqlen_q`` 40),
compared bitwise, as vLLM calls it and pinned (``vllm_fa3.pin_forward_arguments``), for L in
64, 128, 129, 192, 200, 300, 640. Expected: as called, equal up to 128 keys and different past
them; pinned, equal everywhere.

``ARM``: the long-needle procedure of shared/device-latest/README.md "(d) Long needles" on the
offline engine (SmolLM2-135M-Instruct at /tmp/model/smollm2, torch.compile + CUDA graphs as
vLLM chooses them, prefix caching off, ``VLLM_BATCH_INVARIANT=1`` in every arm): needles
``STORY * r + "Chapter r: There once was a "`` (r = 5, 12, 25: about 134, 310 and 635 prompt
tokens), greedy, 128 tokens, logprobs 1, each alone twice, then in ``TRIALS`` (default 5) trials
at a random position among 63-127 fillers of 200-450 tokens (vLLM's determinism test prompts),
seed 20240919, the same batches in every arm. A trial counts as identical when the needle's
token ids and every logprob (float64 hex) equal its first run alone. ``bi_fa3_pin`` sets
``BISTAT_FA3_PIN=1`` and installs the plugin in this process (the engine core runs in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so no entry point is needed) and reports how many FA3 calls
the pin saw and raised. Expected (the recipe's measurement on 0.33.0): bi_fa3 identical in few
of 15 trials (logprobs 1/15 there), bi_fa3_pin and bi_triton in 15/15.

Run both engine arms at once with ``scripts/device/fa3_check.sh`` (≈ 3 min, see there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

T0 = time.time()
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARMS = ("bi_fa3", "bi_fa3_pin", "bi_triton")
STORY = ("The lighthouse keeper counted the ships that passed each night, writing their names in a "
         "leather book that had belonged to his grandfather. ")
SEED = 20240919


def log(arm: str, *a: object) -> None:
    print(f"[{arm} {time.time() - T0:6.1f}s]", *a, flush=True)


def load_pin():
    """bistat_kernels.vllm_fa3, installed or loaded from this checkout by path."""
    try:
        from bistat_kernels import vllm_fa3
        return vllm_fa3
    except ImportError:
        spec = importlib.util.spec_from_file_location("bistat_kernels.vllm_fa3",
                                                      ROOT / "kernels" / "bistat_kernels" / "vllm_fa3.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bistat_kernels.vllm_fa3"] = module
        spec.loader.exec_module(module)
        return module


def kernel_check(out_path: str) -> dict:
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    pin = load_pin()
    res = {"check": "kernel", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "capability": list(torch.cuda.get_device_capability()), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt, page, prefill = "cuda", torch.bfloat16, 16, 40
    k_cache = torch.randn(128, page, 3, 64, generator=g, device=dev).to(dt)
    v_cache = torch.randn(128, page, 3, 64, generator=g, device=dev).to(dt)
    q_decode = torch.randn(1, 9, 64, generator=g, device=dev).to(dt)
    q_prefill = torch.randn(prefill, 9, 64, generator=g, device=dev).to(dt)
    i32 = dict(device=dev, dtype=torch.int32)
    row = torch.arange(0, 41, **i32)          # 41 pages: up to 656 keys
    other = torch.arange(60, 101, **i32)

    def call(q, cu, seqused, table, max_q, max_k, pinned):
        kwargs = dict(q=q, k=k_cache, v=v_cache, max_seqlen_q=max_q, cu_seqlens_q=cu,
                      max_seqlen_k=max_k, seqused_k=seqused, softmax_scale=0.125, causal=True,
                      block_table=table, fa_version=3, num_splits=1)
        if pinned:
            kwargs, _ = pin.pin_forward_arguments(kwargs)
        return flash_attn_varlen_func(**kwargs)

    for kv in (64, 128, 129, 192, 200, 300, 640):
        entry = {"kv_length": kv}
        for pinned in (False, True):
            alone = call(q_decode, torch.tensor([0, 1], **i32), torch.tensor([kv], **i32),
                         row[None], 1, kv, pinned)
            mixed = call(torch.cat([q_decode, q_prefill]), torch.tensor([0, 1, 1 + prefill], **i32),
                         torch.tensor([kv, prefill], **i32), torch.stack([row, other]), prefill,
                         kv, pinned)
            diff = (alone[0].float() - mixed[0].float()).abs().max().item()
            entry["pinned" if pinned else "as_called"] = {
                "bitwise_equal": bool(torch.equal(alone[0], mixed[0])), "max_abs_diff": diff}
        res["rows"].append(entry)
        log("kernel", f"KV {kv}: as called equal {entry['as_called']['bitwise_equal']}, "
                      f"pinned equal {entry['pinned']['bitwise_equal']}")
    res["expected"] = ("as called: equal up to 128 keys (one tile in both kernels), different "
                       "past them; pinned: equal at every length")
    rows = res["rows"]
    res["as_expected"] = (all(r["pinned"]["bitwise_equal"] for r in rows)
                          and all(r["as_called"]["bitwise_equal"] for r in rows if r["kv_length"] <= 128)
                          and any(not r["as_called"]["bitwise_equal"] for r in rows
                                  if r["kv_length"] > 128))
    res["total_s"] = round(time.time() - T0, 1)
    Path(out_path).write_text(json.dumps(res, indent=1))
    log("kernel", "RESULT", json.dumps({"as_expected": res["as_expected"], "total_s": res["total_s"]}))
    return res


def _random_prompt(rng: random.Random, min_words: int = 1024, max_words: int = 2048) -> str:
    # as vLLM's tests/v1/determinism/utils.py builds its prompts (shared/device-latest/arm.py)
    templates = [
        "Question: What is the capital of France?\nAnswer: The capital of France is",
        "Q: How does photosynthesis work?\nA: Photosynthesis is the process by which",
        "User: Can you explain quantum mechanics?\nAssistant: Quantum mechanics is",
        "Once upon a time in a distant galaxy, there lived",
        "The old man walked slowly down the street, remembering",
        "In the year 2157, humanity finally discovered",
        "To implement a binary search tree in Python, first we need to",
        "The algorithm works by iterating through the array and",
        "Here's how to optimize database queries using indexing:",
        "The Renaissance was a period in European history that",
        "Climate change is caused by several factors including",
        "The human brain contains approximately 86 billion neurons which",
        "I've been thinking about getting a new laptop because",
        "Yesterday I went to the store and bought",
        "My favorite thing about summer is definitely",
    ]
    base = rng.choice(templates)
    words = rng.randint(min_words, max_words)
    return (" This is an interesting topic that deserves more explanation. " * (words // 50)) + base


def _record(o) -> dict:
    c = o.outputs[0]
    lps = [sorted([int(t), float(v.logprob).hex()] for t, v in d.items()) for d in (c.logprobs or [])]
    return {"token_ids": list(c.token_ids), "logprobs": lps, "prompt_len": len(o.prompt_token_ids or [])}


def _compare(base: dict, got: dict) -> dict:
    n = min(len(base["token_ids"]), len(got["token_ids"]))
    first_tok = next((i for i in range(n) if base["token_ids"][i] != got["token_ids"][i]), None)
    first_lp = next((i for i in range(min(len(base["logprobs"]), len(got["logprobs"])))
                     if base["logprobs"][i] != got["logprobs"][i]), None)
    return {"token_ids_equal": base["token_ids"] == got["token_ids"],
            "logprobs_bitwise_equal": base["logprobs"] == got["logprobs"],
            "first_token_diff": first_tok, "first_logprob_diff": first_lp,
            "kv_at_first_logprob_diff": None if first_lp is None else got["prompt_len"] + first_lp}


def arm_check(arm: str, out_path: str) -> dict:
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the pin's counters in-process
    pin = None
    if arm == "bi_fa3_pin":
        os.environ["BISTAT_FA3_PIN"] = "1"
        pin = load_pin()
        pin.register()    # before the engine builds (and captures CUDA graphs of) its attention
    else:
        os.environ.pop("BISTAT_FA3_PIN", None)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    kw = dict(model=os.environ.get("MODEL", "/tmp/model/smollm2"), max_num_seqs=128,
              max_model_len=5120, enable_prefix_caching=False, gpu_memory_utilization=0.2,
              kv_cache_memory_bytes=4 << 30, seed=0, enforce_eager=False)
    if arm == "bi_triton":
        kw["attention_config"] = {"backend": "TRITON_ATTN"}
    res = {"check": "needles", "arm": arm, "vllm": vllm.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(), "llm_kwargs": kw,
           "env": {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "BISTAT_FA3_PIN",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING")}}
    t = time.time()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.time() - t, 1)
    cc = llm.llm_engine.vllm_config.compilation_config
    res["compilation_mode"], res["cudagraph_mode"] = str(cc.mode), str(cc.cudagraph_mode)
    if pin is not None:
        res["pin_installed"] = pin.installed()
    log(arm, "engine ready", res["engine_start_s"], "s", res["compilation_mode"], res["cudagraph_mode"])
    sp = SamplingParams(temperature=0.0, max_tokens=128, seed=SEED, logprobs=1)
    rng = random.Random(SEED)
    trials = int(os.environ.get("TRIALS", "5"))
    res["needles"] = []
    t = time.time()
    for r in (5, 12, 25):
        needle = STORY * r + f"Chapter {r}: There once was a "
        base = _record(llm.generate([needle], sp, use_tqdm=False)[0])
        again = _compare(base, _record(llm.generate([needle], sp, use_tqdm=False)[0]))
        runs = []
        for trial in range(trials):
            bs = rng.randint(64, 128)
            pos = rng.randint(0, bs - 1)
            prompts = [needle if i == pos else _random_prompt(rng) for i in range(bs)]
            c = _compare(base, _record(llm.generate(prompts, sp, use_tqdm=False)[pos]))
            c.update(trial=trial, batch_size=bs, needle_pos=pos)
            runs.append(c)
            log(arm, f"needle {base['prompt_len']} tok trial {trial}: bs {bs} logprobs "
                     f"{c['logprobs_bitwise_equal']} kv {c['kv_at_first_logprob_diff']}")
        res["needles"].append({
            "prompt_len": base["prompt_len"], "alone_twice": again, "trials": runs,
            "token_ids_identical": sum(x["token_ids_equal"] for x in runs),
            "logprobs_identical": sum(x["logprobs_bitwise_equal"] for x in runs)})
    res["needles_s"] = round(time.time() - t, 1)
    if pin is not None:
        res["pin_calls"] = {str(k): v for k, v in pin.CALLS.items()}
        res["pin_raised"] = {str(k): v for k, v in pin.RAISED.items()}
    res["summary"] = {n["prompt_len"]: f"{n['logprobs_identical']}/{trials}" for n in res["needles"]}
    res["total_s"] = round(time.time() - T0, 1)
    Path(out_path).write_text(json.dumps(res, indent=1))
    log(arm, "RESULT", json.dumps({k: res.get(k) for k in (
        "summary", "engine_start_s", "needles_s", "total_s", "pin_installed", "pin_raised")}))
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("kernel", *ARMS):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "kernel":
        return 0 if kernel_check(argv[2])["as_expected"] else 1
    arm_check(argv[1], argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
