"""The sections of ``kernels/RESULTS.md`` on the tuned GEMM inside compiled vLLM: the decode
profile per arm (default, batch-invariant, batch-invariant with the tuned GEMM) and bistat's
probe of the plugin (a needle alone and in batches, per arm).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from bistat_kernels.results_common import LAYERS, Provenance, provenance


# --- decode profile in compiled vLLM ---------------------------------------------------------

# vLLM 0.25.0's CompilationMode values (vllm/config/compilation.py), as the engine logs them.
VLLM_COMPILATION_MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE",
                          "3": "VLLM_COMPILE"}
PROFILE_CATEGORIES = (("persistent_gemm", "persistent GEMM"), ("cublas_gemm", "cuBLAS GEMM"),
                      ("attention", "attention"), ("other", "other"))
KERNEL_NAME_WIDTH = 56


def model_layers(model_path: str) -> tuple[str, int] | None:
    """(known model, its layers) for a model folder named after one of ``LAYERS``."""
    base = PurePath(model_path).name
    known = [name for name in LAYERS if base.startswith(name)]
    return (max(known, key=len), LAYERS[max(known, key=len)]) if known else None


def largest_capture_size(doc: dict[str, Any]) -> int | None:
    """The largest CUDA-graph capture size of any arm (None when no arm records one)."""
    sizes = [int(size) for arm in doc["arms"].values()
             for size in arm.get("graphs", {}).get("cudagraph_capture_sizes", [])]
    return max(sizes) if sizes else None


def beyond_graphs(doc: dict[str, Any]) -> bool:
    """Whether the batch exceeds every CUDA-graph capture size, so the decode steps ran eagerly."""
    largest = largest_capture_size(doc)
    return largest is not None and int(doc["settings"]["batch"]) > largest


@dataclass(frozen=True)
class ProfileArm:
    name: str
    batch_invariant: Any          # the arm's VLLM_BATCH_INVARIANT ("?" when unset)
    tuned_gemm: Any               # its BISTAT_TUNED_GEMM
    median_call_s: float
    device_ms_per_step: float
    category_ms_per_step: tuple[float, ...]   # in PROFILE_CATEGORIES order
    gemm_share_pct: float
    graph_launches: Any
    kernel_launches: Any
    host_ms_per_step: float       # median call ms / output tokens per request
    host_minus_device_ms: float   # host time per step not hidden behind the GPU
    call_s: tuple[float, ...]


@dataclass(frozen=True)
class ProfileComparison:
    """The three arms default, batch-invariant and bi-tuned-gemm set against each other."""

    bi_persistent: float
    tuned_persistent: float
    default_cublas: float
    bi_over_tuned_persistent: float
    tuned_over_cublas: float
    tuned_over_default_call: float
    bi_over_default_call: float
    tuned_over_default_device: float
    bi_over_default_device: float
    extra_device: float
    extra_gemm: float
    extra_gemm_pct: float
    recovered_pct: float
    tuned_over_bi_call: float
    tuned_over_bi_device: float
    tuned_over_bi_persistent: float


@dataclass(frozen=True)
class GraphRow:
    name: str
    mode: str
    mode_name: str
    cudagraph_mode: Any
    capture_sizes: tuple[Any, ...]
    captured: tuple[str, ...]
    graph_launches: Any
    kernel_launches: Any
    compile_s: float | None
    jit_during_inference: int


@dataclass(frozen=True)
class PluginRow:
    name: str
    requested: Any
    registered_by: Any
    installed: Any
    ours: Any
    log_lines: Any


@dataclass(frozen=True)
class OpLaunch:
    n: int
    k: int
    layer: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    calls: int


@dataclass(frozen=True)
class OpLaunches:
    arm: str
    shapes: int
    splits: tuple[tuple[int, str], ...]     # (SPLIT_K, layer) of the split-K launches
    launches: tuple[OpLaunch, ...]


@dataclass(frozen=True)
class TopKernel:
    arm: str
    name: str             # cut at its argument list and to KERNEL_NAME_WIDTH characters
    cut: bool             # whether the width cut it
    category: str
    share_pct: float
    ms_per_step: float


@dataclass(frozen=True)
class Profile:
    title: str
    source: str
    logs: str
    provenance: Provenance
    model: str
    model_layers: tuple[str, int] | None
    load_format: Any
    batch: Any
    prompt_tokens: Any
    max_tokens: Any
    warmups: Any
    timed_calls: Any
    eager: bool
    largest_capture: int | None
    category_labels: tuple[str, ...]
    arms: tuple[ProfileArm, ...]
    comparison: ProfileComparison | None
    graphs: tuple[GraphRow, ...]
    graphs_used: tuple[str, ...]
    graphs_captured: tuple[str, ...]
    plugin: tuple[PluginRow, ...]
    op_launches: tuple[OpLaunches, ...]
    top_kernels: tuple[TopKernel, ...]


def layer_names() -> dict[tuple[int, int], str]:
    """(N, K) -> 'model/layer' for every tuned shape (from ``shapes.py``, which is pure)."""
    from bistat_kernels.shapes import MODEL_SHAPES
    names: dict[tuple[int, int], list[str]] = {}
    for model_shapes in MODEL_SHAPES.values():
        for shape in model_shapes:
            names.setdefault((shape.n, shape.k), []).append(f"{shape.model}/{shape.layer}")
    return {key: ", ".join(value) for key, value in names.items()}


def _comparison(arms: dict[str, Any]) -> ProfileComparison | None:
    default, bi, tuned = (arms.get(k) for k in ("default", "batch-invariant", "bi-tuned-gemm"))
    if default is None or bi is None or tuned is None:
        return None

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
    return ProfileComparison(
        bi_p, t_p, d_c, bi_p / t_p, t_p / d_c, t_s / d_s, b_s / d_s, dev(tuned) / dev(default),
        dev(bi) / dev(default), extra_dev, extra_gemm, 100 * extra_gemm / extra_dev,
        100 * (b_s - t_s) / (b_s - d_s), t_s / b_s, dev(tuned) / dev(bi), t_p / bi_p)


def profile(doc: dict[str, Any], source: str, logs: str, title: str) -> Profile:
    st, arms = doc["settings"], doc["arms"]
    names = layer_names()
    rows, graphs, plugin, launches, top = [], [], [], [], []
    for name, arm in arms.items():
        prof, g, log = arm["profile"], arm["graphs"], arm.get("log", {})
        rows.append(ProfileArm(
            name, arm["env"].get("VLLM_BATCH_INVARIANT", "?"),
            arm["env"].get("BISTAT_TUNED_GEMM", "?"), arm["median_call_s"],
            prof["total_device_ms_per_step"],
            tuple(prof["categories"][key]["ms_per_step"] for key, _ in PROFILE_CATEGORIES),
            100 * prof["gemm_share"], g.get("cuda_graph_launches_in_profile", "?"),
            g.get("kernel_launch_calls_in_profile", "?"),
            1000 * arm["median_call_s"] / st["max_tokens"],
            1000 * arm["median_call_s"] / st["max_tokens"] - prof["total_device_ms_per_step"],
            tuple(arm.get("call_s", []))))
        mode = str(g.get("compilation_mode", "?"))
        graphs.append(GraphRow(
            name, mode, VLLM_COMPILATION_MODES.get(mode, "unknown"), g.get("cudagraph_mode", "?"),
            tuple(g.get("cudagraph_capture_sizes", [])), tuple(g.get("capture_modes_in_log", [])),
            g.get("cuda_graph_launches_in_profile", "?"),
            g.get("kernel_launch_calls_in_profile", "?"), log.get("compile_s"),
            len(log.get("jit_during_inference", []))))
        pl = arm["plugin"]
        plugin.append(PluginRow(name, pl["requested"], pl["registered_by"] or "nothing",
                                pl["installed"], pl["matmul_persistent_is_ours"],
                                log.get("tuned_gemm_installed_lines", "?")))
        if pl["calls"]:
            calls = pl["calls"]
            launches.append(OpLaunches(
                name, len({(c["n"], c["k"]) for c in calls}),
                tuple(sorted({(c["split_k"], names.get((c["n"], c["k"]), f"{c['n']}x{c['k']}"))
                              for c in calls if c.get("split_k", 1) > 1})),
                tuple(OpLaunch(c["n"], c["k"], names.get((c["n"], c["k"]), "?"), c["block_m"],
                               c["block_n"], c["block_k"], c["split_k"], c["calls"])
                      for c in calls)))
        for k in prof["top_kernels"][:3]:
            short = k["name"].split("(")[0]
            top.append(TopKernel(name, short[:KERNEL_NAME_WIDTH], len(short) > KERNEL_NAME_WIDTH,
                                 k["category"], 100 * k["share"], k["ms_per_step"]))
    return Profile(
        title, source, logs, provenance(doc["provenance"]), st["model"],
        model_layers(st["model"]), st["load_format"], st["batch"], st["prompt_tokens"],
        st["max_tokens"], st["warmups"], st["timed_calls"], beyond_graphs(doc),
        largest_capture_size(doc), tuple(label for _, label in PROFILE_CATEGORIES), tuple(rows),
        _comparison(arms), tuple(graphs),
        tuple(name for name, arm in arms.items() if arm["graphs"].get("used")),
        tuple(name for name, arm in arms.items() if arm["graphs"].get("capture_modes_in_log")),
        tuple(plugin), tuple(launches), tuple(top))


# --- the bistat probe of the plugin in compiled vLLM -----------------------------------------

@dataclass(frozen=True)
class ProbeModel:
    """The synthetic model a probe ran on (its sidecar file)."""

    layers: Any
    arch: Any
    init: Any
    std: Any
    seed: Any
    n_parameters: int
    weights_sha256: str
    path: str


@dataclass(frozen=True)
class Sidecar:
    """The probe's provenance, recorded beside it (the probe's output records no GPU)."""

    source: str
    provenance: Provenance
    date_note: str
    declaration: str
    registered_utc: str
    registration: str
    registration_sha256: str
    engine_kind: str
    engine_model: str
    model: ProbeModel | None
    note: str | None


@dataclass(frozen=True)
class ProbeTrial:
    trial: Any
    fillers: Any
    evidence: str
    shared_step: bool


@dataclass(frozen=True)
class ProbeArm:
    name: str
    role: str
    gemm: str | None                # "tuned" | "batch-invariant" | "default"; None: not declared
    attention: str | None
    alone_repeat_identical: bool
    equal: int                      # trials whose tokens and logprobs equal the needle alone
    divergences: tuple[int, ...]    # distinct first-divergence tokens
    diverged: int                   # trials with a first divergence
    shared: int                     # trials with shared-step evidence
    trials: tuple[ProbeTrial, ...]


@dataclass(frozen=True)
class PluginProbe:
    source: str
    sidecar: Sidecar | None
    needle: str
    max_tokens: Any
    min_fillers: Any
    max_fillers: Any
    trials: Any
    mode: Any
    seed: Any
    outcome: str
    reason: str
    arms: tuple[ProbeArm, ...]
    probed_shared: tuple[int, ...]  # distinct shared-step trial counts of the probed arms
    probed_trials: int | None       # trials per probed arm (None: no arm probed)


def gemm_kind(env: dict[str, str]) -> str:
    if env.get("VLLM_BATCH_INVARIANT") == "1":
        return "tuned" if env.get("BISTAT_TUNED_GEMM") == "1" else "batch-invariant"
    return "default"


def plugin_probe(doc: dict[str, Any], sidecar: dict[str, Any] | None,
                 model_doc: dict[str, Any] | None, source: str,
                 sidecar_source: str) -> PluginProbe:
    side = None
    if sidecar is not None:
        pm = None if model_doc is None else ProbeModel(
            model_doc["layers"], model_doc["arch"], model_doc["init"], model_doc["std"],
            model_doc["seed"], model_doc["n_parameters"], model_doc["weights"]["sha256"],
            sidecar["model"])
        side = Sidecar(sidecar_source, provenance(sidecar["provenance"]), sidecar["date_note"],
                       sidecar["declaration"], sidecar["registered_utc"],
                       sidecar["registration"], sidecar["registration_sha256"],
                       sidecar["engine"]["kind"], sidecar["engine"]["model"], pm,
                       sidecar.get("note"))
    declared = {a["name"]: a for a in (sidecar or {}).get("arms", [])}
    arms = []
    for arm in doc["arms"]:
        trials = arm["trials"]
        diverge = [t["first_divergence"] for t in trials if t["first_divergence"] is not None]
        decl = declared.get(arm["arm"])
        arms.append(ProbeArm(
            arm["arm"], arm["role"], gemm_kind(decl["env"]) if decl else None,
            decl.get("args", {}).get("attention_backend", "engine default") if decl else None,
            bool(arm["alone_repeat_identical"]),
            sum(t["tokens_equal"] and t["logprobs_equal"] for t in trials),
            tuple(sorted(set(diverge))), len(diverge), sum(t["shared_step"] for t in trials),
            tuple(ProbeTrial(t["trial"], t["n_fillers"], t["evidence"], bool(t["shared_step"]))
                  for t in trials)))
    probed = [a for a in arms if a.role == "probed"]
    st = doc["settings"]
    return PluginProbe(
        source, side, doc["needle_prompt_id"], st["max_tokens"], st["min_fillers"],
        st["max_fillers"], st["trials"], st["mode"], st["seed"], doc["outcome"], doc["reason"],
        tuple(arms), tuple(sorted({a.shared for a in probed})),
        len(probed[0].trials) if probed else None)
