"""Regenerate ``kernels/RESULTS.md`` from the recorded JSON (tables, bench, probe, check, fused,
the decode profile and the plugin probe in compiled vLLM, the sweep timing check).

Nothing here measures; every number comes from a file written on the GPU, and the page says which
file and which command. Rendering is deterministic, so a deleted RESULTS.md regenerates to the
same bytes (STYLE §1.5). Needs only the standard library (no torch)::

    python -m bistat_kernels.make_results            # or: bistat kernels results
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
# The repository folder kernels/ (README, RESULTS.md, recorded results) holds the package.
KERNELS_DIR = PACKAGE_DIR.parent
RESULTS_DIR = KERNELS_DIR / "results"
TABLES_DIR = PACKAGE_DIR / "tables"
GOAL_OVERALL = 1.15
GOAL_DECODE = 1.25
# Layers per model, for the per-decode-step sum (config.json num_hidden_layers).
LAYERS = {"qwen3-8b": 36, "qwen3-1.7b": 28, "smollm2-135m": 30}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _us(ms: float) -> str:
    return f"{ms * 1000:.1f}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _prov_line(prov: dict[str, Any]) -> str:
    """GPU, UUID, serial, driver, versions, date and command; fields a file lacks are left out."""
    ident = ", ".join(f"{label} {prov[key]}" for label, key in (("UUID", "gpu_uuid"),
                                                               ("serial", "gpu_serial"))
                      if key in prov)
    rest = ", ".join(f"{label} {prov[key]}" for label, key in (
        ("driver", "driver"), ("torch", "torch"), ("CUDA", "cuda"), ("triton", "triton"))
        if key in prov)
    return (f"{prov.get('gpu_name', '?')} ({ident}), {rest}, {prov.get('date_utc', '?')}; "
            f"command `{prov.get('command', '?')}`")


def _and_words(words: list[str]) -> str:
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def _status_section(bench: dict[str, Any] | None, probe: dict[str, Any] | None,
                    check: dict[str, Any] | None, table: dict[str, Any] | None,
                    fused: dict[str, Any] | None, slug: str,
                    extra_rows: tuple[tuple[str, dict[str, Any]], ...] = ()) -> list[str]:
    """Goal status in one line, then which GPU and command each artefact came from.

    ``extra_rows`` are (what, provenance) pairs of further artefacts, listed after the check.
    """
    lines = ["## Status and provenance", ""]
    if bench is not None:
        s = bench["summary"]
        met = s["geomean_tuned_over_mm"] <= GOAL_OVERALL
        met_d = s["decode_geomean_tuned_over_mm"] <= GOAL_DECODE
        lines += [f"Goal {'met' if met and met_d else '**not met**'}: geometric mean of tuned / "
                  f"torch.mm {s['geomean_tuned_over_mm']:.3f} (target <= {GOAL_OVERALL}, "
                  f"{'met' if met else '**not met**'}), at M <= {s['decode_max_m']} "
                  f"{s['decode_geomean_tuned_over_mm']:.3f} (target <= {GOAL_DECODE}, "
                  f"{'met' if met_d else '**not met**'}); both gates on every table entry: "
                  + ("yes" if probe is not None and probe["passed"] else "**no**") + ".", ""]
    lines += ["| artefact | GPU (UUID) | date (UTC) | command |", "|---|---|---|---|"]

    def row(what: str, prov: dict[str, Any]) -> None:
        lines.append(f"| {what} | {prov.get('gpu_name', '?')} ({prov.get('gpu_uuid', '?')}) | "
                     f"{prov.get('date_utc', '?')} | `{prov.get('command', '?')}` |")

    bench_uuid = bench["provenance"].get("gpu_uuid") if bench is not None else None
    if table is not None:
        sweeps: dict[tuple[str, str, str], list[str]] = {}
        for e in table["entries"]:
            p = e["provenance"]
            sweeps.setdefault((p.get("gpu_uuid", "?"), p.get("date_utc", "?"),
                               p.get("command", "?")), []).append(f"{e['n']}x{e['k']}")
        for (uuid, date, command), shapes in sorted(sweeps.items()):
            row(f"`kernels/bistat_kernels/tables/{slug}.json`: sweep of {len(shapes)} entr"
                f"{'y' if len(shapes) == 1 else 'ies'}",
                {"gpu_name": table.get("device_name", "?"), "gpu_uuid": uuid, "date_utc": date,
                 "command": command})
        sourced = [(e, b) for e in table["entries"] for b in e["buckets"]
                   if "source" in b["measured"]]
        if sourced and fused is not None:
            where = ", ".join(f"{e['n']}x{e['k']} M<={b['m_max']}" for e, b in sourced)
            row(f"`kernels/bistat_kernels/tables/{slug}.json`: {len(sourced)} bucket"
                f"{'s' if len(sourced) != 1 else ''} set from the fused split-K comparison "
                f"({where})", fused["provenance"])
    if fused is not None:
        row(f"`kernels/results/fused_compare_{slug}.json`", fused["provenance"])
    if probe is not None:
        row(f"`kernels/results/probe_{slug}.json`", probe["provenance"])
    if bench is not None:
        row(f"`kernels/results/bench_{slug}.json`", bench["provenance"])
    if check is not None:
        row("`kernels/results/check_gpu.json`", check["provenance"])
    for what, prov in extra_rows:
        row(what, prov)
    if bench is not None and table is not None:
        others = {e["provenance"].get("gpu_uuid", "?"): e["provenance"]
                  for e in table["entries"] if e["provenance"].get("gpu_uuid") != bench_uuid}
        keys = (("gpu_name", "model"), ("driver", "driver"), ("torch", "torch"),
                ("triton", "triton"))
        text = ("Every ratio to torch.mm in the bench was measured side by side in one run on "
                f"one GPU ({bench_uuid}), so the goal status stands on its own. ")
        if not others:
            text += "The table was tuned on the same GPU."
        for uuid, prov in sorted(others.items()):
            same = [word for key, word in keys if prov.get(key) == bench["provenance"].get(key)]
            differ = [word for key, word in keys if prov.get(key) != bench["provenance"].get(key)]
            text += (f"The table's sweep ran on another GPU ({uuid}), a sibling with the same "
                     f"{_and_words(same) if same else 'nothing'}"
                     + (f" but a different {_and_words(differ)}" if differ else "")
                     + ": the bench measures how well its launch choices carry over, and the "
                       "sweep-time ratios in the table section are that GPU's. ")
        lines += ["", text.rstrip()]
    return lines


def _bench_section(bench: dict[str, Any], source: str) -> list[str]:
    s = bench["summary"]
    met = "met" if s["geomean_tuned_over_mm"] <= GOAL_OVERALL else "**not met**"
    met_d = "met" if s["decode_geomean_tuned_over_mm"] <= GOAL_DECODE else "**not met**"
    lines = [
        "## Tuned kernel vs torch.mm (cuBLAS) vs the fixed default configuration",
        "",
        f"Source: `{source}`. Measured on {_prov_line(bench['provenance'])}.",
        f"Timing: {bench['timing']}. Inputs bf16, `x[M, K] @ W[N, K].t()` as vLLM calls it; "
        "every tuned output was validated against a float32 reference before timing.",
        "",
        "| goal | measured | target | |",
        "|---|---|---|---|",
        f"| geometric mean of tuned / torch.mm over the 15 shapes and M in "
        f"{{{', '.join(map(str, s['goal_ms']))}}} | {s['geomean_tuned_over_mm']:.3f} | "
        f"<= {GOAL_OVERALL} | {met} |",
        f"| the same at M <= {s['decode_max_m']} (M in 1, 4, 8, 16, 32) | "
        f"{s['decode_geomean_tuned_over_mm']:.3f} | <= {GOAL_DECODE} | {met_d} |",
        f"| fixed default / torch.mm, goal set (vLLM 0.25.0's configuration) | "
        f"{s['geomean_default_over_mm']:.3f} | | |",
        f"| fixed default / torch.mm, M <= {s['decode_max_m']} | "
        f"{s['decode_geomean_default_over_mm']:.3f} | | |",
        f"| speed-up of tuned over fixed default, M <= {s['decode_max_m']} (geometric mean) | "
        f"{s['decode_speedup_over_default']:.2f}x | >= 2.5x | "
        f"{'met' if s['decode_speedup_over_default'] >= 2.5 else '**not met**'} |",
        "",
        "Per shape and M (times in microseconds; ratios to torch.mm):",
        "",
        "| model | layer | N | K | M | tuned | torch.mm | default | tuned/mm | default/mm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        lines.append(f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | "
                     f"{_us(r['tuned_ms'])} | {_us(r['torch_mm_ms'])} | {_us(r['default_ms'])} | "
                     f"{r['tuned_over_mm']:.2f} | {r['default_over_mm']:.2f} |")
    lines += ["", "Geometric mean of tuned / torch.mm per model over the goal set of M:", "",
              "| model | tuned/mm | default/mm |", "|---|---|---|"]
    for model in sorted({r["model"] for r in bench["rows"]}):
        rows = [r for r in bench["rows"] if r["model"] == model and r["m"] in s["goal_ms"]]
        lines.append(f"| {model} | {_geomean([r['tuned_over_mm'] for r in rows]):.3f} | "
                     f"{_geomean([r['default_over_mm'] for r in rows]):.3f} |")
    lines += ["", "Summed per decode step (layers x (qkv + o + gate_up + down) + lm_head, from the "
              "rows above; an arithmetic sum of measured per-call times, not a separate "
              "measurement):", "", "| model | M | tuned ms | torch.mm ms | default ms |",
              "|---|---|---|---|---|"]
    for model, layers in sorted(LAYERS.items()):
        for m in sorted({r["m"] for r in bench["rows"] if r["m"] <= s["decode_max_m"]}):
            rows = {r["layer"]: r for r in bench["rows"] if r["model"] == model and r["m"] == m}
            if set(rows) != {"qkv", "o", "gate_up", "down", "lm_head"}:
                continue
            totals = []
            for key in ("tuned_ms", "torch_mm_ms", "default_ms"):
                per_layer = sum(rows[name][key] for name in ("qkv", "o", "gate_up", "down"))
                totals.append(layers * per_layer + rows["lm_head"][key])
            lines.append(f"| {model} | {m} | {totals[0]:.2f} | {totals[1]:.2f} | {totals[2]:.2f} |")
    return lines


def _table_section(table: dict[str, Any], source: str) -> list[str]:
    lines = ["## The H200 table", "", f"Source: `{source}` ({len(table['entries'])} shapes, "
             "bf16). BLOCK_K and SPLIT_K are fixed per shape; the launch parameters per M "
             "bucket (a bucket covers M up to its bound; larger M use the last bucket). "
             "Layout scores are the decode-weighted geometric mean of best time / torch.mm "
             "time (lower is better).", "",
             "| N | K | layers | BLOCK_K | SPLIT_K | layout scores | measured on |",
             "|---|---|---|---|---|---|---|"]
    for e in table["entries"]:
        scores = ", ".join(f"{k} {v}" for k, v in sorted(e["selection"]["scores"].items()))
        prov = e["provenance"]
        lines.append(f"| {e['n']} | {e['k']} | {', '.join(e['layers'])} | {e['block_k']} | "
                     f"{e['split_k']} | {scores} | {prov['gpu_uuid']} {prov['date_utc']} |")
    any_fused = any(b.get("fuse_splits", False) for e in table["entries"] for b in e["buckets"])
    lines += ["", "Buckets (BLOCK_M x BLOCK_N, warps, stages, programs per SM; sweep-time "
              "tuned / torch.mm at the bucket bound)"
              + ("; `fused`: the split-K partial sums are added inside the GEMM kernel, in split "
                 "order, instead of by the separate reduce kernel (same bits, no workspace)"
                 if any_fused else "") + ":", "",
              "| N | K | " + " | ".join(f"M<={b['m_max']}" for b in table["entries"][0]["buckets"])
              + " |", "|---|---|" + "---|" * len(table["entries"][0]["buckets"])]
    for e in table["entries"]:
        cells = []
        for b in e["buckets"]:
            ratio = b["measured"]["time_ms"] / b["measured"]["torch_mm_ms"]
            fused = " fused" if b.get("fuse_splits", False) else ""
            mark = "*" if "source" in b["measured"] else ""
            cells.append(f"{b['block_m']}x{b['block_n']} w{b['num_warps']} s{b['num_stages']} "
                         f"p{b.get('programs_per_sm', 1)}{fused} ({ratio:.2f}{mark})")
        lines.append(f"| {e['n']} | {e['k']} | " + " | ".join(cells) + " |")
    sources = sorted({b["measured"]["source"] for e in table["entries"] for b in e["buckets"]
                      if "source" in b["measured"]})
    if sources:
        lines += ["", "`*`: not a sweep measurement; the bucket was set, and its ratio measured, "
                  "by " + "; ".join(f"`{src}`" if " " not in src else src for src in sources)
                  + "."]
    first = table["entries"][0]["provenance"]
    lines += ["", f"Provenance of the first entry: {_prov_line(first)}."]
    return lines


def _probe_section(probe: dict[str, Any], source: str) -> list[str]:
    lines = ["## Gates on every table entry", "", f"Source: `{source}`. Measured on "
             f"{_prov_line(probe['provenance'])}.", "",
             "Gate 1: each checked row computed alone (M = 1) equals the same row inside "
             "batches of M in {1, 2, 3, 7, 8, 16, 64, 255, 256, 1024, 4096} plus every bucket's "
             "bounds (rows first, second, middle, last), bitwise (`torch.equal`). Gate 2: max "
             "error relative to max |reference| against a float32 (no TF32) reference, beside "
             "torch.mm's own error on the same inputs.", "",
             "| N | K | rows equal / checked | max rel err (ours) | max rel err (torch.mm) | "
             "tolerance | result |", "|---|---|---|---|---|---|---|"]
    for shp in probe["shapes"]:
        inv = shp["invariance"]
        ours = max(a["max_rel_err"] for a in shp["accuracy"])
        theirs = max(a["torch_mm_max_rel_err"] for a in shp["accuracy"])
        lines.append(f"| {shp['n']} | {shp['k']} | {inv['rows_equal']}/{inv['rows_checked']} | "
                     f"{ours:.2e} | {theirs:.2e} | {shp['accuracy'][0]['tolerance']:.0e} | "
                     f"{'pass' if shp['passed'] else '**FAIL**'} |")
    lines += ["", f"All entries pass both gates: {'yes' if probe['passed'] else '**no**'}."]
    return lines


def _variant_label(name: str, cfg: dict[str, Any] | None) -> str:
    """Row key -> words: the table's launch, the same fused, or a fused BMxBN wW sS launch."""
    def launch(c: dict[str, Any]) -> str:
        return (f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} "
                f"p{c['programs_per_sm']}")
    if name == "table":
        return f"table ({launch(cfg)}{' fused' if cfg.get('fuse_splits') else ''})" if cfg \
            else "table"
    if name == "fused":
        return f"table's launch, fused ({launch(cfg)})" if cfg else "table's launch, fused"
    bm_bn, _, ws = name.removeprefix("fused_").partition("w")
    warps, _, stages = ws.partition("s")
    return f"fused {bm_bn} w{warps} s{stages} p1"


def _fused_section(fused: dict[str, Any], source: str) -> list[str]:
    """The fused split-K comparison: per shape and M, the table's launch, the fused ones, mm."""
    prov = fused["provenance"]
    recon = fused.get("table_configs_reconstructed", {})
    lines = ["## Fused split-K comparison", "",
             f"Source: `{source}`. Measured on {_prov_line(prov)}."]
    if prov.get("reconstructed"):
        lines += ["", f"Note: {prov.get('note', '')}"]
    lines += ["",
              "Each M: the table's launch (parallel split-K unless marked fused), the same launch "
              "fused, and fused launches of other tile sizes, every one with the table's BLOCK_K "
              "and SPLIT_K, against torch.mm; CUDA-graph timing as in the bench. Times in "
              "microseconds; `equal`: every variant that ran returned the table launch's bits.",
              "", "| N | K | M | table launch | table | same, fused | best fused launch | best "
              "fused | torch.mm | best fused / table | best fused / mm | equal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in fused["rows"]:
        cfg = r.get("table_config") or recon.get(f"{r['n']}x{r['k']}/M={r['m']}")
        timed = {name: ms for name, ms in r.items()
                 if name.startswith("fused") and not name.endswith("_equal")
                 and isinstance(ms, float)}
        best = min(timed, key=timed.__getitem__)
        equal = all(v for key, v in r.items() if key.endswith("_equal"))
        lines.append(f"| {r['n']} | {r['k']} | {r['m']} | {_variant_label('table', cfg)} | "
                     f"{_us(r['table'])} | {_us(r['fused'])} | {_variant_label(best, cfg)} | "
                     f"{_us(timed[best])} | {_us(r['mm'])} | {timed[best] / r['table']:.2f} | "
                     f"{timed[best] / r['mm']:.2f} | {'yes' if equal else '**no**'} |")
    failed = sorted({name for r in fused["rows"] for name, v in r.items()
                     if isinstance(v, str) and not name.endswith("_equal")})
    if failed:
        lines += ["", "Did not launch (error text in the file): "
                  + ", ".join(f"`{name}`" for name in failed) + "."]
    return lines


_NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve")


def _and_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def _check_configs(gates: list[dict[str, Any]]) -> str:
    """'five launch configurations including split-K 2 and 3' (+ the fused ones), from the data."""
    configs = {json.dumps(g["config"], sort_keys=True): g["config"] for g in gates}
    count = len(configs)
    text = (f"{_NUMBER_WORDS[count] if count < len(_NUMBER_WORDS) else count} launch "
            f"configurations")
    parallel = sorted({c["split_k"] for c in configs.values()
                       if c["split_k"] > 1 and not c.get("fuse_splits", False)})
    fused = sorted({c["split_k"] for c in configs.values()
                    if c["split_k"] > 1 and c.get("fuse_splits", False)})
    if parallel:
        text += f" including split-K {_and_list(parallel)}"
    if fused:
        text += (f"{' and' if parallel else ' including'} fused split-K {_and_list(fused)} "
                 f"(partial sums added inside the GEMM kernel)")
    return text


def _check_section(check: dict[str, Any], source: str) -> list[str]:
    gates = check["gates"]
    comp = check["compiled"]
    lines = ["## Kernel checks and the compiled path", "", f"Source: `{source}`. Measured on "
             f"{_prov_line(check['provenance'])}.", "",
             f"- Both gates on ragged shapes (N x K = 1000 x 1000, 4096 x 2048, 576 x 1536 with "
             f"bias) with {_check_configs(gates)}, in bf16, fp16 "
             f"and fp32 (IEEE): {sum(g['passed'] for g in gates)}/{len(gates)} passed.",
             *([f"- Fused split-K equals parallel split-K bitwise (split-K 2 and 3, M = 1, 17 "
                f"and 1031, with and without bias, bf16, fp16 and fp32): "
                f"{sum(check['fused_equals_parallel'])}/{len(check['fused_equals_parallel'])} "
                f"comparisons."] if "fused_equals_parallel" in check else []),
             f"- torch.compile (fullgraph, dynamic M) through the plugin's custom op equals eager "
             f"bitwise: {comp.get('compile_equal_eager')}; rows invariant across M inside the "
             f"compiled graph: {comp.get('compile_row_invariant')}; a CUDA graph of the compiled "
             f"function replays to the same bits: {comp.get('cuda_graph_replay_equal')}.",
             f"- Launch configurations the custom op chose per M while compiling and capturing "
             f"(N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K: calls): "
             f"{', '.join(f'{k}: {v}' for k, v in sorted(comp.get('op_calls', {}).items()))}."]
    fused = comp.get("fused_table")
    if fused is not None:
        lines.append(
            f"- The same through a table whose entry for N x K = 4096 x 2048 uses split-K 2, "
            f"parallel for M <= {fused.get('parallel_max_m', '?')} and fused above: compiled "
            f"equals eager bitwise: {fused.get('compile_equal_eager')}; rows invariant across M "
            f"(a row computed alone by the parallel mode equals it inside a fused batch): "
            f"{fused.get('compile_row_invariant')}; CUDA graph replay equal: "
            f"{fused.get('cuda_graph_replay_equal')}.")
    return lines


# vLLM 0.25.0's CompilationMode values (vllm/config/compilation.py), as the engine logs them.
_VLLM_COMPILATION_MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE",
                           "3": "VLLM_COMPILE"}
_PROFILE_CATEGORIES = (("persistent_gemm", "persistent GEMM"), ("cublas_gemm", "cuBLAS GEMM"),
                       ("attention", "attention"), ("other", "other"))


def _layer_names() -> dict[tuple[int, int], str]:
    """(N, K) -> 'model/layer' for every tuned shape (from ``shapes.py``, which is pure)."""
    from bistat_kernels.shapes import MODEL_SHAPES
    names: dict[tuple[int, int], list[str]] = {}
    for model_shapes in MODEL_SHAPES.values():
        for shape in model_shapes:
            names.setdefault((shape.n, shape.k), []).append(f"{shape.model}/{shape.layer}")
    return {key: ", ".join(value) for key, value in names.items()}


def _kernel_label(name: str, width: int = 56) -> str:
    """A kernel name cut at its argument list and to ``width`` characters, in backticks."""
    short = name.split("(")[0]
    return f"`{short[:width]}…`" if len(short) > width else f"`{short}`"


def _vllm_suffix(prov: dict[str, Any]) -> str:
    if "vllm" not in prov:
        return ""
    commit = f" (commit {prov['vllm_commit']})" if "vllm_commit" in prov else ""
    return f"; vLLM {prov['vllm']}{commit}"


def _model_words(model: str) -> str:
    base = Path(model).name
    known = [name for name in LAYERS if base.startswith(name)]
    return f" ({max(known, key=len)} config, {LAYERS[max(known, key=len)]} layers)" if known else ""


def _largest_capture_size(doc: dict[str, Any]) -> int | None:
    """The largest CUDA-graph capture size of any arm (None when no arm records one)."""
    sizes = [int(size) for arm in doc["arms"].values()
             for size in arm.get("graphs", {}).get("cudagraph_capture_sizes", [])]
    return max(sizes) if sizes else None


def _beyond_graphs(doc: dict[str, Any]) -> bool:
    """Whether the batch exceeds every CUDA-graph capture size, so the decode steps ran eagerly."""
    largest = _largest_capture_size(doc)
    return largest is not None and int(doc["settings"]["batch"]) > largest


def _profile_section(doc: dict[str, Any], source: str, logs: str,
                     title: str = "Decode profile in compiled vLLM (before/after)") -> list[str]:
    """Per arm: call time, device time per decode step by category, CUDA graphs, the plugin.

    When the batch exceeds the CUDA-graph capture sizes (the decode steps ran eagerly), the
    section says so with the launch counts, gives each arm's wall minus device time per step and
    the tuned / batch-invariant ratios; a batch within the capture sizes renders without them.
    """
    prov, st, arms = doc["provenance"], doc["settings"], doc["arms"]
    largest, eager = _largest_capture_size(doc), _beyond_graphs(doc)
    lines = [f"## {title}", "",
             f"Source: `{source}` (the engine log of each arm is in `{logs}`). Measured on "
             f"{_prov_line(prov)}{_vllm_suffix(prov)}.", "",
             f"Offline engine (`vllm.LLM` in the profiling process, compiled mode: `enforce_eager` "
             f"not set) on `{st['model']}`{_model_words(st['model'])}, `load_format` "
             f"{st['load_format']}; one batch of {st['batch']} requests, {st['prompt_tokens']} "
             f"prompt + {st['max_tokens']} output tokens each; {st['warmups']} warm-up "
             f"call{'s' if st['warmups'] != 1 else ''}, "
             f"{st['timed_calls']} timed calls (median), then one call under the torch profiler. "
             f"Per step: device time of the profiled call / output tokens per request (the one "
             f"prefill step included). GEMM share: GEMM kernels' share of device time.", ""]
    if eager:
        counts = ", ".join(f"{name} {arm['graphs'].get('cuda_graph_launches_in_profile', '?')} / "
                           f"{arm['graphs'].get('kernel_launch_calls_in_profile', '?')}"
                           for name, arm in arms.items())
        lines += [f"The decode steps ran eagerly: batch {st['batch']} > largest CUDA-graph "
                  f"capture size {largest}, so no captured graph fits them and their kernels are "
                  f"launched one by one. Launches in the profiled call (cudaGraphLaunch / "
                  f"cudaLaunchKernel): {counts}.", ""]
    lines += ["| arm | VLLM_BATCH_INVARIANT | BISTAT_TUNED_GEMM | call s (median) | "
              "device ms/step | "
              + " | ".join(f"{label} ms/step" for _, label in _PROFILE_CATEGORIES)
              + " | GEMM share |",
              "|---|---|---|---|---|" + "---|" * len(_PROFILE_CATEGORIES) + "---|"]
    for name, arm in arms.items():
        prof = arm["profile"]
        cats = " | ".join(f"{prof['categories'][key]['ms_per_step']:.2f}"
                          for key, _ in _PROFILE_CATEGORIES)
        lines.append(f"| {name} | {arm['env'].get('VLLM_BATCH_INVARIANT', '?')} | "
                     f"{arm['env'].get('BISTAT_TUNED_GEMM', '?')} | {arm['median_call_s']:.3f} | "
                     f"{prof['total_device_ms_per_step']:.2f} | {cats} | "
                     f"{100 * prof['gemm_share']:.1f} % |")
    default, bi, tuned = (arms.get(k) for k in ("default", "batch-invariant", "bi-tuned-gemm"))
    if default is not None and bi is not None and tuned is not None:
        def per_step(arm: dict[str, Any], key: str) -> float:
            return float(arm["profile"]["categories"][key]["ms_per_step"])

        def gemm(arm: dict[str, Any]) -> float:
            return per_step(arm, "persistent_gemm") + per_step(arm, "cublas_gemm")

        def dev(arm: dict[str, Any]) -> float:
            return float(arm["profile"]["total_device_ms_per_step"])

        bi_p, t_p = per_step(bi, "persistent_gemm"), per_step(tuned, "persistent_gemm")
        d_c = per_step(default, "cublas_gemm")
        d_s, b_s, t_s = (a["median_call_s"] for a in (default, bi, tuned))
        extra_dev, extra_gemm = dev(bi) - dev(default), gemm(bi) - gemm(default)
        lines += ["", f"- Persistent GEMM per decode step: vLLM's fixed configuration {bi_p:.2f} "
                  f"ms, bistat's tuned kernel {t_p:.2f} ms ({bi_p / t_p:.1f}x less); cuBLAS in "
                  f"the default arm {d_c:.2f} ms (tuned / cuBLAS {t_p / d_c:.2f}).",
                  f"- Batch latency (median call): tuned / default {t_s / d_s:.3f}, "
                  f"batch-invariant / default {b_s / d_s:.2f}. Device time per step: tuned / "
                  f"default {dev(tuned) / dev(default):.3f}, batch-invariant / default "
                  f"{dev(bi) / dev(default):.2f}.",
                  f"- The batch-invariant arm spends {extra_dev:.2f} ms more device time per step "
                  f"than default, and its GEMMs {extra_gemm:.2f} ms more than cuBLAS's "
                  f"({100 * extra_gemm / extra_dev:.0f} % of the difference). The tuned GEMM "
                  f"recovers {100 * (b_s - t_s) / (b_s - d_s):.0f} % of the batch-invariant "
                  f"arm's extra batch time."]
        if eager:
            lines += [f"- Tuned / batch-invariant: median call {t_s / b_s:.3f}, device time per "
                      f"step {dev(tuned) / dev(bi):.3f}, persistent GEMM per step "
                      f"{t_p / bi_p:.3f}."]
    if eager:
        lines += ["", "Wall minus device time per step, i.e. host time not hidden behind the GPU "
                  "(median call ms / output tokens per request, minus the profiled call's device "
                  "ms/step):", ""]
        for name, arm in arms.items():
            wall = 1000 * arm["median_call_s"] / st["max_tokens"]
            dev_ms = arm["profile"]["total_device_ms_per_step"]
            calls = ", ".join(f"{c:.3f}" for c in arm.get("call_s", []))
            lines.append(f"- `{name}`: {wall:.2f} - {dev_ms:.2f} = {wall - dev_ms:.2f} ms"
                         + (f" (timed calls {calls} s)" if calls else "") + ".")
    lines += ["", "CUDA graphs and compilation, per arm (compilation mode and CUDA graph mode from "
              "the engine's config; captured modes, compile time and JIT compiles after start-up "
              "from its log; launches counted in the profiled call):", "",
              "| arm | compilation mode | CUDA graph mode | capture sizes | captured (log) | "
              "cudaGraphLaunch | cudaLaunchKernel | torch.compile s | JIT compiles during "
              "inference |", "|---|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        g, log = arm["graphs"], arm.get("log", {})
        mode = str(g.get("compilation_mode", "?"))
        compile_s = log.get("compile_s")
        lines.append(
            f"| {name} | {mode} ({_VLLM_COMPILATION_MODES.get(mode, 'unknown')}) | "
            f"{g.get('cudagraph_mode', '?')} | "
            f"{', '.join(str(v) for v in g.get('cudagraph_capture_sizes', []))} | "
            f"{', '.join(g.get('capture_modes_in_log', [])) or 'none'} | "
            f"{g.get('cuda_graph_launches_in_profile', '?')} | "
            f"{g.get('kernel_launch_calls_in_profile', '?')} | "
            f"{'not logged' if compile_s is None else f'{compile_s:.2f}'} | "
            f"{len(log.get('jit_during_inference', []))} |")
    used = [name for name, arm in arms.items() if arm["graphs"].get("used")]
    captured = [name for name, arm in arms.items() if arm["graphs"].get("capture_modes_in_log")]
    if eager:
        graphs_line = ("CUDA graphs: captured in "
                       + ("every arm" if len(captured) == len(arms) else
                          f"{len(captured)} of {len(arms)} arms"
                          + (f" ({', '.join(captured)})" if captured else ""))
                       + f", but decode steps beyond size {largest} run eagerly (launch counts "
                         "above).")
    else:
        graphs_line = (f"CUDA graphs replayed in the profiled call: {len(used)} of {len(arms)} "
                       "arms" + (f" ({', '.join(used)})" if 0 < len(used) < len(arms) else "")
                       + ".")
    lines += ["", graphs_line, "",
              "The plugin, per arm (`requested`: BISTAT_TUNED_GEMM=1; `ours`: vLLM's "
              "`batch_invariant.matmul_persistent` is bistat's custom op in the engine process; "
              "`log`: engine log lines announcing the tuned GEMM):", ""]
    for name, arm in arms.items():
        pl = arm["plugin"]
        lines.append(f"- `{name}`: requested {pl['requested']}, registered by "
                     f"{pl['registered_by'] or 'nothing'}, installed {pl['installed']}, ours "
                     f"{pl['matmul_persistent_is_ours']}, log "
                     f"{arm.get('log', {}).get('tuned_gemm_installed_lines', '?')}.")
    names = _layer_names()
    for name, arm in arms.items():
        calls = arm["plugin"]["calls"]
        if not calls:
            continue
        splits = sorted({(c["split_k"], names.get((c["n"], c["k"]), f"{c['n']}x{c['k']}"))
                         for c in calls if c.get("split_k", 1) > 1})
        shapes = len({(c["n"], c["k"]) for c in calls})
        lines += ["", f"Launch configurations the tuned op chose in `{name}`: {len(calls)} over "
                  f"{shapes} shapes"
                  + (", including " + ", ".join(f"split-K {k} ({layer})" for k, layer in splits)
                     if splits else "")
                  + ". Op runs count executions of the op's Python body, i.e. eager calls and "
                  "CUDA-graph captures (a graph replay runs no Python), not tokens:", "",
                  "| N | K | layer | BLOCK_M | BLOCK_N | BLOCK_K | SPLIT_K | op runs |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in calls:
            lines.append(f"| {c['n']} | {c['k']} | {names.get((c['n'], c['k']), '?')} | "
                         f"{c['block_m']} | {c['block_n']} | {c['block_k']} | {c['split_k']} | "
                         f"{c['calls']} |")
    lines += ["", "Top three kernels per arm (share of device time, ms per step):", "",
              "| arm | kernel | category | share | ms/step |", "|---|---|---|---|---|"]
    for name, arm in arms.items():
        for k in arm["profile"]["top_kernels"][:3]:
            lines.append(f"| {name} | {_kernel_label(k['name'])} | {k['category']} | "
                         f"{100 * k['share']:.1f} % | {k['ms_per_step']:.2f} |")
    return lines


def _gemm_words(env: dict[str, str]) -> str:
    if env.get("VLLM_BATCH_INVARIANT") == "1":
        return ("bistat's tuned GEMM (plugin)" if env.get("BISTAT_TUNED_GEMM") == "1"
                else "vLLM's batch-invariant GEMM")
    return "default (cuBLAS)"


def _plugin_probe_section(probe: dict[str, Any], sidecar: dict[str, Any] | None,
                          model: dict[str, Any] | None, source: str,
                          sidecar_source: str) -> list[str]:
    """The ``bistat probe`` of the plugin in compiled vLLM, with the sidecar's provenance."""
    lines = ["## The plugin inside compiled vLLM keeps bitwise invariance (bistat probe)", ""]
    if sidecar is not None:
        prov = sidecar["provenance"]
        lines += [f"Source: `{source}` (the probe's output; it records no GPU, so its provenance "
                  f"is in `{sidecar_source}`). Measured on {_prov_line(prov)}{_vllm_suffix(prov)}.",
                  f"Date: {sidecar['date_note']}", "",
                  f"Declaration `{sidecar['declaration']}`, registered {sidecar['registered_utc']} "
                  f"(`{sidecar['registration']}`, sha256 {sidecar['registration_sha256'][:12]}…) "
                  f"before the probe ran. Engine {sidecar['engine']['kind']} on "
                  f"`{sidecar['engine']['model']}`"
                  + (f" ({model['layers']}-layer {model['arch']}-shaped model, {model['init']} "
                     f"weights with std {model['std']} and seed {model['seed']}, "
                     f"{model['n_parameters']:,} parameters, weights sha256 "
                     f"{model['weights']['sha256'][:12]}…; `{sidecar['model']}`)"
                     if model is not None else "")
                  + ", compiled mode (torch.compile + CUDA graphs)."]
    else:
        lines += [f"Source: `{source}`. It records no GPU and no provenance file was found."]
    st = probe["settings"]
    lines += ["", f"Needle `{probe['needle_prompt_id']}` ({st['max_tokens']} greedy tokens) alone, "
              f"then among {st['min_fillers']}–{st['max_fillers']} fillers submitted with it, "
              f"{st['trials']} trials (mode {st['mode']}, seed {st['seed']}); equal means token "
              f"ids and logprobs bitwise equal to the needle alone.", "",
              f"Outcome: **{probe['outcome']}**: {probe['reason']}.", "",
              "| arm | role | GEMM | attention | alone twice identical | trials equal | fillers | "
              "first divergence | trials with shared-step evidence |",
              "|---|---|---|---|---|---|---|---|---|"]
    declared = {a["name"]: a for a in (sidecar or {}).get("arms", [])}
    for arm in probe["arms"]:
        trials = arm["trials"]
        equal = sum(t["tokens_equal"] and t["logprobs_equal"] for t in trials)
        diverge = [t["first_divergence"] for t in trials if t["first_divergence"] is not None]
        decl = declared.get(arm["arm"], {})
        lines.append(
            f"| {arm['arm']} | {arm['role']} | "
            f"{_gemm_words(decl['env']) if decl else '?'} | "
            f"{decl.get('args', {}).get('attention_backend', 'engine default') if decl else '?'} | "
            f"{'yes' if arm['alone_repeat_identical'] else '**no**'} | {equal}/{len(trials)} | "
            f"{', '.join(str(t['n_fillers']) for t in trials)} | "
            + (f"token {', '.join(str(v) for v in sorted(set(diverge)))} in "
               f"{len(diverge)}/{len(trials)}" if diverge else "none")
            + f" | {sum(t['shared_step'] for t in trials)}/{len(trials)} |")
    lines += ["", "Shared-step evidence per trial (the offline engine's metrics samples around "
              "the needle):", ""]
    for arm in probe["arms"]:
        lines.append(f"- `{arm['arm']}`: " + "; ".join(
            f"trial {t['trial']} ({t['n_fillers']} fillers): {t['evidence']}"
            + ("" if t["shared_step"] else " (no evidence of sharing)") for t in arm["trials"])
            + ".")
    probed = [a for a in probe["arms"] if a["role"] == "probed"]
    if probed:
        shown = sorted({sum(t["shared_step"] for t in a["trials"]) for a in probed})
        lines += ["", f"Caveat: in the arms probed, the samples show the needle sharing a step "
                  f"with the fillers in {' to '.join(str(v) for v in shown)} of "
                  f"{len(probed[0]['trials'])} trials per arm; the bitwise equality of the other "
                  f"trials stands, but those trials alone do not show that the needle was batched."
                  + (f" {sidecar['note']}" if sidecar is not None and "note" in sidecar else "")]
    return lines


def _sweep_timing_section(raw: dict[str, Any], table: dict[str, Any] | None,
                          committed: dict[str, Any] | None, before: dict[str, Any] | None,
                          device_output: dict[str, Any] | None, source: str,
                          before_source: str) -> list[str]:
    """A full re-tune after ``sweep.pin_triton_toolchain``: time per shape, first launches."""
    shapes = raw["shapes"]
    lines = ["## Sweep timing after pinning the Triton toolchain", "",
             f"Source: `{source}` (raw candidate timings; the table it chose is beside it). "
             f"Measured on {_prov_line(raw['provenance'])}.", ""]
    if device_output is not None and device_output.get("adopted") is False:
        lines += [f"Not adopted: {device_output['why_not_adopted']}", ""]
    elapsed = [s["elapsed_s"] for s in shapes]
    records = sum(len(s["records"]) for s in shapes)
    first = [r["first_launch_s"] for s in shapes for r in s["records"] if "first_launch_s" in r]
    slow = sum(s.get("slow_first_launches", 0) for s in shapes)
    text = (f"{len(shapes)} shapes, {records:,} candidate measurements in {sum(elapsed):.1f} s of "
            f"per-shape sweep ({min(elapsed):.1f}–{max(elapsed):.1f} s per shape)")
    if device_output is not None:
        text += (f"; precompilation {device_output['precompile_s']} s and "
                 f"{device_output['sweep_total_s']} s for the whole sweep, from the device "
                 f"command's printed output (`device_output.json` beside the source: the raw file "
                 f"times each shape, not the precompilation)")
    lines.append(text + ".")
    if first:
        lines.append(f"Slowest first launch of any candidate in the timed process: "
                     f"{max(first):.3f} s; first launches counted as compiles in the timed loop "
                     f"(`slow_first_launches`): {slow}.")
    if before is not None:
        by_name = {(s["model"], s["layer"]): s for s in shapes}
        for old in before["shapes"]:
            new = by_name.get((old["model"], old["layer"]))
            if new is None:
                continue
            old_ms = 1000 * old["elapsed_s"] / len(old["records"])
            new_ms = 1000 * new["elapsed_s"] / len(new["records"])
            lines.append(
                f"Before the fix (`{before_source}`, {before['provenance'].get('date_utc', '?')}) "
                f"{old['model']}/{old['layer']} took {old['elapsed_s']:.1f} s for "
                f"{len(old['records'])} measurements ({old_ms:.0f} ms each); here "
                f"{new['elapsed_s']:.1f} s for {len(new['records'])} ({new_ms:.1f} ms each).")
    chosen = {(e["n"], e["k"]): e for e in (table or {}).get("entries", [])}
    kept = {(e["n"], e["k"]): e for e in (committed or {}).get("entries", [])}
    lines += ["", "| model | layer | N | K | measurements | sweep s | slowest first launch s | "
              "compiles in timed loop | BLOCK_K / SPLIT_K chosen | committed table |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    changed = []
    for s in shapes:
        key = (s["n"], s["k"])
        mine = [r["first_launch_s"] for r in s["records"] if "first_launch_s" in r]
        new, old = chosen.get(key), kept.get(key)
        new_txt = f"{new['block_k']} / {new['split_k']}" if new else "?"
        old_txt = f"{old['block_k']} / {old['split_k']}" if old else "?"
        if new and old and (new["block_k"], new["split_k"]) != (old["block_k"], old["split_k"]):
            changed.append(f"{s['model']}/{s['layer']} BLOCK_K / SPLIT_K {old_txt} -> {new_txt}")
        lines.append(f"| {s['model']} | {s['layer']} | {s['n']} | {s['k']} | {len(s['records'])} | "
                     f"{s['elapsed_s']:.1f} | {f'{max(mine):.3f}' if mine else '?'} | "
                     f"{s.get('slow_first_launches', '?')} | {new_txt} | {old_txt} |")
    if changed:
        lines += ["", "Layouts this sweep chose differently from the committed table, reported as "
                  "observed (the committed table is unchanged): " + "; ".join(changed) + "."]
    return lines


def _history_section(results_dir: Path) -> list[str]:
    lines = ["## Earlier runs (kept for the record)", ""]
    found = False
    for sub, what in (("call1_do_bench", "first sweep and bench timed with "
                       "`triton.testing.do_bench`: it starts its event before the Python "
                       "launch, so kernels shorter than a Triton launch (tens of "
                       "microseconds) were timed as launch overhead; the method was replaced "
                       "by CUDA-graph replays"),
                      ("call2_first_graph_sweep", "first sweep with CUDA-graph timing and a "
                       "smaller candidate set (decode-heavier layout score 3:3:1:1)"),
                      ("call4_retune_partial", "device call 10 (`results/log_call4.txt`): a "
                       "re-tune that reached only qwen3-8b/qkv before its budget ran out (its "
                       "kernels compiled inside the timed loop; kernels/README.md says why); "
                       "the bench used that qkv entry with the other 14 of the committed table, "
                       "before the fused buckets; that table was not adopted")):
        bench = _load(results_dir / sub / "bench_nvidia_h200.json")
        if bench is None:
            continue
        found = True
        s = bench["summary"]
        lines.append(f"- `results/{sub}/`: {what}. Geometric mean tuned/torch.mm "
                     f"{s['geomean_tuned_over_mm']:.3f} (M <= 32: "
                     f"{s['decode_geomean_tuned_over_mm']:.3f}); default/torch.mm "
                     f"{s['geomean_default_over_mm']:.3f}. {_prov_line(bench['provenance'])}.")
    return lines if found else []


def _batch_profiles(results_dir: Path, device_slug: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(file name, log folder name, document) of each ``profile_decode_b<N>_<slug>.json``, by
    the batch in its settings; its engine logs are in ``profile_decode_b<N>_logs/``."""
    pattern = re.compile(rf"profile_decode_b(\d+)_{re.escape(device_slug)}\.json")
    found = []
    for path in results_dir.glob(f"profile_decode_b*_{device_slug}.json"):
        match = pattern.fullmatch(path.name)
        doc = _load(path) if match else None
        if match and doc is not None:
            found.append((path.name, f"profile_decode_b{match.group(1)}_logs", doc))
    return sorted(found, key=lambda item: (int(item[2]["settings"]["batch"]), item[0]))


def _batch_profile_title(doc: dict[str, Any]) -> str:
    return (f"Decode profile at batch {doc['settings']['batch']}"
            + (" (beyond the CUDA-graph sizes)" if _beyond_graphs(doc) else ""))


def render_results(results_dir: Path = RESULTS_DIR, tables_dir: Path = TABLES_DIR,
                   device_slug: str = "nvidia_h200") -> str:
    """The markdown page, from the files under ``results_dir`` and ``tables_dir``."""
    lines = ["# Batch-invariant GEMM on the H200: measured results", "",
             "<!-- generated by kernels/bistat_kernels/make_results.py from "
             "kernels/results/*.json and kernels/bistat_kernels/tables/*.json; "
             "do not edit by hand -->", ""]
    bench = _load(results_dir / f"bench_{device_slug}.json")
    table = _load(tables_dir / f"{device_slug}.json")
    probe = _load(results_dir / f"probe_{device_slug}.json")
    check = _load(results_dir / "check_gpu.json")
    fused = _load(results_dir / f"fused_compare_{device_slug}.json")
    profile = _load(results_dir / f"profile_decode_{device_slug}.json")
    batch_profiles = _batch_profiles(results_dir, device_slug)
    plugin_probe = _load(results_dir / f"plugin_probe_{device_slug}.json")
    sidecar = _load(results_dir / f"plugin_probe_{device_slug}.provenance.json")
    check_dir = results_dir / "sweep_timing_check"
    sweep_raw = _load(check_dir / f"sweep_raw_{device_slug}.json")
    extra: list[tuple[str, dict[str, Any]]] = []
    if profile is not None:
        extra.append((f"`kernels/results/profile_decode_{device_slug}.json`: decode profile in "
                      "compiled vLLM", profile["provenance"]))
    for name, _, doc in batch_profiles:
        extra.append((f"`kernels/results/{name}`: decode profile at batch "
                      f"{doc['settings']['batch']} in compiled vLLM", doc["provenance"]))
    if plugin_probe is not None and sidecar is not None:
        extra.append((f"`kernels/results/plugin_probe_{device_slug}.json`: bistat probe of the "
                      "plugin in compiled vLLM (provenance from its sidecar)",
                      sidecar["provenance"]))
    if sweep_raw is not None:
        extra.append(("`kernels/results/sweep_timing_check/`: sweep timing check (not adopted)",
                      sweep_raw["provenance"]))
    if bench is not None or table is not None:
        lines += _status_section(bench, probe, check, table, fused, device_slug,
                                 tuple(extra)) + [""]
    if bench is not None:
        lines += _bench_section(bench, f"kernels/results/bench_{device_slug}.json") + [""]
    if probe is not None:
        lines += _probe_section(probe, f"kernels/results/probe_{device_slug}.json") + [""]
    if check is not None:
        lines += _check_section(check, "kernels/results/check_gpu.json") + [""]
    if table is not None:
        lines += _table_section(table,
                                f"kernels/bistat_kernels/tables/{device_slug}.json") + [""]
    if fused is not None:
        lines += _fused_section(fused, f"kernels/results/fused_compare_{device_slug}.json") + [""]
    if profile is not None:
        lines += _profile_section(profile, f"kernels/results/profile_decode_{device_slug}.json",
                                  "kernels/results/profile_decode_logs/") + [""]
    for name, logs, doc in batch_profiles:
        lines += _profile_section(doc, f"kernels/results/{name}", f"kernels/results/{logs}/",
                                  _batch_profile_title(doc)) + [""]
    if plugin_probe is not None:
        model = (_load(results_dir / Path(sidecar["model"]).name)
                 if sidecar is not None and "model" in sidecar else None)
        lines += _plugin_probe_section(
            plugin_probe, sidecar, model, f"kernels/results/plugin_probe_{device_slug}.json",
            f"kernels/results/plugin_probe_{device_slug}.provenance.json") + [""]
    if sweep_raw is not None:
        lines += _sweep_timing_section(
            sweep_raw, _load(check_dir / f"{device_slug}.json"), table,
            _load(results_dir / "call4_retune_partial" / f"sweep_raw_{device_slug}.json"),
            _load(check_dir / "device_output.json"),
            f"kernels/results/sweep_timing_check/sweep_raw_{device_slug}.json",
            f"results/call4_retune_partial/sweep_raw_{device_slug}.json") + [""]
    history = _history_section(results_dir)
    if history:
        lines += history + [""]
    if bench is None and table is None:
        lines += ["No results recorded yet: run `bistat kernels sweep` and `bistat kernels bench` "
                  "on a GPU.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate kernels/RESULTS.md")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tables-dir", type=Path, default=TABLES_DIR)
    parser.add_argument("--output", type=Path, default=KERNELS_DIR / "RESULTS.md")
    args = parser.parse_args(argv)
    args.output.write_text(render_results(args.results_dir, args.tables_dir), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
