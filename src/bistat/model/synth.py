"""Synthetic-weight Hugging Face model folders with real architectures (``bistat synth-model``).

A divergence test needs a model whose GEMMs have the shapes where cuBLAS changes its strategy with
the batch size (8B-class: ``o_proj`` 4096→4096, ``down_proj`` 12288→4096), and whose outputs are not
degenerate. vLLM's ``--load-format dummy`` weights are uniform in ±1e-3: the logits are nearly flat
and greedy decoding collapses. Weights drawn from N(0, 0.02²) — the scale of the published
``initializer_range`` — give varied, non-degenerate token streams (``../shared/device/README.md``).

:func:`write_synthetic_model` writes a folder that vLLM (and transformers) load as a normal model:

* ``config.json`` — the published configuration of the architecture (:data:`ARCHITECTURES`), with
  ``num_hidden_layers`` (and ``max_window_layers``) overridden;
* ``generation_config.json`` — the published generation defaults (bistat always sends its
  sampling settings explicitly, so these never decide an experiment);
* ``model.safetensors`` — every weight in bf16: linear and embedding weights drawn from
  N(0, ``std``²), RMSNorm weights exactly 1.0 (``input_layernorm``, ``post_attention_layernorm``,
  ``q_norm``, ``k_norm``, ``model.norm``);
* ``bistat-synth.json`` — provenance: arguments, backend, versions, per-tensor generator seeds and
  the file's sha256.

No tokenizer is written: serve the folder with ``skip_tokenizer_init`` and token-id prompts.

Two backends produce the numbers. ``torch`` draws each tensor with ``torch.randn`` on the GPU (or
CPU) from a ``torch.Generator`` seeded per tensor and casts to bf16 with torch's
round-to-nearest-even. ``numpy`` draws with ``numpy.random.default_rng(SeedSequence([seed, i]))``
and rounds float32 to bf16 itself (:func:`float32_to_bf16_bits`: the upper 16 bits after adding
``0x7FFF`` plus the lowest kept bit — round to nearest, ties to even). The two backends give
different (equally distributed) weights for one seed; each is reproducible on its own, and
``bistat-synth.json`` says which one wrote the file.

The safetensors file is written by a small streaming writer (:func:`write_safetensors_stream`):
the header is computed from the shapes first, then each tensor is generated, converted and
appended in turn, so host memory holds one tensor at a time (a 36-layer Qwen3-8B is 16 GB).

References
----------
.. [1] Qwen team, "Qwen3 Technical Report", arXiv:2505.09388 (2025); configurations published
   with the checkpoints ``Qwen/Qwen3-8B`` and ``Qwen/Qwen3-1.7B`` (``config.json``,
   ``generation_config.json``).
.. [2] Hugging Face, "safetensors" format specification,
   https://github.com/huggingface/safetensors (8-byte little-endian header length, JSON header
   with ``dtype``/``shape``/``data_offsets``, then the raw little-endian data).
.. [3] Intel, "BFLOAT16 — Hardware Numerics Definition" (2018): bf16 is the upper half of an
   IEEE float32; conversion rounds to nearest even.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Literal, Sequence

from bistat.core.lazy import lazy_module

# numpy loads when a model is written: `bistat synth-model --help` lists ARCHITECTURES without it
np = lazy_module("numpy")

__all__ = [
    "ARCHITECTURES",
    "GENERATION_CONFIGS",
    "SynthModelError",
    "SynthResult",
    "TensorSpec",
    "float32_to_bf16_bits",
    "free_space_ok",
    "model_config",
    "resolve_backend",
    "tensor_specs",
    "write_safetensors_stream",
    "write_synthetic_model",
]

Backend = Literal["auto", "torch", "numpy"]

#: Published ``config.json`` of each architecture (Qwen/Qwen3-8B and Qwen/Qwen3-1.7B).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

_QWEN3_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

#: Published ``generation_config.json`` of each architecture.
GENERATION_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(_QWEN3_GENERATION),
    "qwen3-1.7b": dict(_QWEN3_GENERATION),
}

PROVENANCE_FILE = "bistat-synth.json"
WEIGHTS_FILE = "model.safetensors"
_CHUNK_ELEMENTS = 1 << 22  # numpy backend: rows drawn per block (bounded host memory)


class SynthModelError(ValueError):
    """Arguments that cannot produce a model folder; the message says what to change."""


@dataclass(frozen=True)
class TensorSpec:
    """One weight: Hugging Face name, shape ``[out, in]`` (or ``[n]``), and how it is filled."""

    name: str
    shape: tuple[int, ...]
    fill: Literal["normal", "ones"]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SynthResult:
    """What :func:`write_synthetic_model` wrote."""

    out_dir: Path
    arch: str
    layers: int
    backend: str
    device: str
    n_parameters: int
    n_bytes: int
    sha256: str
    files: tuple[str, ...] = field(default=())


def model_config(arch: str, layers: int) -> dict[str, Any]:
    """The published configuration of ``arch`` with ``layers`` hidden layers.

    ``max_window_layers`` follows ``num_hidden_layers`` (sliding windows are off in Qwen3; the
    published configurations set the two equal).

    Raises
    ------
    SynthModelError
        unknown architecture or fewer than one layer.
    """
    if arch not in ARCHITECTURES:
        raise SynthModelError(f"unknown architecture {arch!r}; expected one of "
                              + ", ".join(repr(a) for a in ARCHITECTURES))
    if layers < 1:
        raise SynthModelError(f"--layers must be at least 1, got {layers}")
    config = dict(ARCHITECTURES[arch])
    config["num_hidden_layers"] = int(layers)
    config["max_window_layers"] = int(layers)
    return config


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every weight of a Qwen3 causal LM with Hugging Face names, in file order."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    hd = config["head_dim"]
    nq = config["num_attention_heads"] * hd
    nkv = config["num_key_value_heads"] * hd
    vocab = config["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "self_attn.q_proj.weight", (nq, h), "normal"),
            TensorSpec(p + "self_attn.k_proj.weight", (nkv, h), "normal"),
            TensorSpec(p + "self_attn.v_proj.weight", (nkv, h), "normal"),
            TensorSpec(p + "self_attn.q_norm.weight", (hd,), "ones"),
            TensorSpec(p + "self_attn.k_norm.weight", (hd,), "ones"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, nq), "normal"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), "normal"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if not config.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (vocab, h), "normal"))
    return specs


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (``uint16``) of float32 values, rounded to nearest, ties to even.

    bf16 keeps the upper 16 bits of the float32 pattern; adding ``0x7FFF`` plus the lowest kept
    bit before truncating rounds to nearest with ties to even (the rounding torch and CUDA use).
    NaNs become the canonical quiet NaN ``0x7FC0`` (the addition could otherwise carry a NaN
    payload into the exponent). [3]_

    Examples
    --------
    >>> float32_to_bf16_bits(np.array([1.0, -2.0, 1.00390625, 1.01171875], dtype=np.float32))
    array([16256, 49152, 16256, 16258], dtype=uint16)
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def _tensor_seed(seed: int, index: int) -> int:
    """The generator seed of tensor ``index``: independent of the tensor order and backend."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def write_safetensors_stream(
    path: Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[int, TensorSpec], Iterable[bytes]],
    metadata: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Write a bf16 safetensors file, producing each tensor's bytes only when it is written.

    ``produce(i, spec)`` yields the little-endian bf16 bytes of tensor ``i`` (in any number of
    pieces, ``2 * spec.numel`` bytes in all). The header (``dtype = "BF16"``, shapes, offsets and
    ``__metadata__``) is padded with spaces to a multiple of 8 bytes, as the format asks. [2]_

    Returns
    -------
    (int, str)
        The file's size in bytes and its sha256.

    Raises
    ------
    SynthModelError
        a producer returned the wrong number of bytes (the file is removed).
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        n = 2 * spec.numel
        header[spec.name] = {"dtype": "BF16", "shape": list(spec.shape),
                             "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()

    def write(fh: BinaryIO, data: bytes) -> None:
        fh.write(data)
        digest.update(data)

    try:
        with open(path, "wb") as fh:
            write(fh, len(raw).to_bytes(8, "little"))
            write(fh, raw)
            for i, spec in enumerate(specs):
                written = 0
                for piece in produce(i, spec):
                    write(fh, piece)
                    written += len(piece)
                if written != 2 * spec.numel:
                    raise SynthModelError(f"{spec.name}: produced {written} bytes, expected "
                                          f"{2 * spec.numel}")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return 8 + len(raw) + offset, digest.hexdigest()


def resolve_backend(backend: Backend) -> tuple[str, str]:
    """``(backend, device)`` to use: ``auto`` is torch on a CUDA GPU when there is one, else numpy.

    Raises
    ------
    SynthModelError
        ``torch`` requested but not importable.
    """
    if backend not in ("auto", "torch", "numpy"):
        raise SynthModelError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'numpy'")
    if backend == "numpy":
        return "numpy", "cpu"
    try:
        import torch
    except ImportError as exc:
        if backend == "torch":
            raise SynthModelError("--backend torch: torch is not installed; install it or use "
                                  "--backend numpy") from exc
        return "numpy", "cpu"
    if torch.cuda.is_available():
        return "torch", "cuda"
    if backend == "torch":
        return "torch", "cpu"
    return "numpy", "cpu"


def _numpy_producer(seed: int, std: float) -> Callable[[int, TensorSpec], Iterator[bytes]]:
    def produce(i: int, spec: TensorSpec) -> Iterator[bytes]:
        if spec.fill == "ones":
            yield float32_to_bf16_bits(np.ones(spec.shape, dtype=np.float32)).tobytes()
            return
        rng = np.random.default_rng(_tensor_seed(seed, i))
        row = math.prod(spec.shape[1:]) if len(spec.shape) > 1 else 1
        rows = spec.shape[0]
        step = max(1, _CHUNK_ELEMENTS // max(row, 1))
        for start in range(0, rows, step):
            n = min(step, rows - start) * row
            block = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
            yield float32_to_bf16_bits(block).tobytes()

    return produce


def _torch_producer(seed: int, std: float, device: str) -> Callable[[int, TensorSpec], Iterator[bytes]]:
    import torch

    def produce(i: int, spec: TensorSpec) -> Iterator[bytes]:
        if spec.fill == "ones":
            t = torch.ones(spec.shape, dtype=torch.bfloat16, device=device)
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(_tensor_seed(seed, i))
            t = torch.randn(spec.shape, generator=gen, dtype=torch.float32, device=device)
            t = (t * std).to(torch.bfloat16)
        yield t.contiguous().view(torch.int16).cpu().numpy().tobytes()

    return produce


def _versions(backend: str) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for pkg in ("numpy", "torch", "bistat"):
        if pkg == "torch" and backend != "torch":
            continue
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def write_synthetic_model(
    out_dir: str | Path,
    *,
    arch: str,
    layers: int,
    init: str = "normal",
    std: float = 0.02,
    seed: int = 0,
    backend: Backend = "auto",
    overwrite: bool = False,
    config_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SynthResult:
    """Write a Hugging Face model folder with random weights of a real architecture.

    Parameters
    ----------
    out_dir
        The folder to write (created; an existing non-empty folder needs ``overwrite``).
    arch
        A key of :data:`ARCHITECTURES`.
    layers
        ``num_hidden_layers``; fewer layers than published keep every GEMM shape and save time.
    init
        Weight distribution; ``"normal"`` (N(0, ``std``²)) is the one supported.
    std
        Standard deviation of the normal weights (> 0).
    seed
        Base seed; tensor ``i`` uses a generator seeded from ``SeedSequence([seed, i])``.
    backend
        ``auto`` (torch on a GPU when there is one, else numpy), ``torch`` or ``numpy``.
    overwrite
        Replace the files of an existing folder.
    config_only
        Write only ``config.json`` and ``generation_config.json`` (for vLLM's
        ``load_format = "dummy"``, which makes its own weights).
    progress
        Called with one line per finished stage.

    Raises
    ------
    SynthModelError
        bad arguments, or an existing folder without ``overwrite``.
    """
    if init != "normal":
        raise SynthModelError(f"--init {init!r} is not supported; use --init normal")
    if not (isinstance(std, (int, float)) and math.isfinite(std) and std > 0):
        raise SynthModelError(f"--std must be a positive number, got {std!r}")
    config = model_config(arch, layers)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SynthModelError(f"{out}: exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise SynthModelError(f"{out}: folder exists and is not empty; choose another --out or "
                              "pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    generation = GENERATION_CONFIGS.get(arch, _QWEN3_GENERATION)
    if config_only:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        say(f"wrote {out / 'config.json'} and generation_config.json (no weights)")
        return SynthResult(out_dir=out, arch=arch, layers=layers, backend="none", device="none",
                           n_parameters=sum(s.numel for s in tensor_specs(config)), n_bytes=0,
                           sha256="", files=("config.json", "generation_config.json"))
    name, device = resolve_backend(backend)
    specs = tensor_specs(config)
    n_params = sum(s.numel for s in specs)
    if not free_space_ok(out, 2 * n_params):
        raise SynthModelError(f"{out}: not enough free disk space for {2 * n_params:,} bytes of "
                              "weights; free some space, choose another --out or fewer --layers")
    produce = (_torch_producer(seed, float(std), device) if name == "torch"
               else _numpy_producer(seed, float(std)))
    metadata = {"format": "pt", "bistat_synth": f"{arch} layers={layers} init={init} "
                                                f"std={std:g} seed={seed} backend={name}"}
    say(f"writing {len(specs)} tensors ({n_params:,} parameters, bf16) with {name} on {device}")
    size, digest = write_safetensors_stream(out / WEIGHTS_FILE, specs, produce, metadata)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(generation, indent=2) + "\n")
    provenance = {
        "schema": "bistat.synth-model/1",
        "arch": arch,
        "layers": layers,
        "init": init,
        "std": std,
        "seed": seed,
        "backend": name,
        "device": device,
        "n_parameters": n_params,
        "weights": {"file": WEIGHTS_FILE, "bytes": size, "sha256": digest},
        "tensor_seeds": {s.name: _tensor_seed(seed, i) for i, s in enumerate(specs)
                         if s.fill == "normal"},
        "versions": _versions(name),
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    say(f"wrote {out / WEIGHTS_FILE} ({size:,} bytes, sha256 {digest})")
    files = ("config.json", "generation_config.json", WEIGHTS_FILE, PROVENANCE_FILE)
    return SynthResult(out_dir=out, arch=arch, layers=layers, backend=name, device=device,
                       n_parameters=n_params, n_bytes=size, sha256=digest, files=files)


def free_space_ok(out_dir: str | Path, n_bytes: int) -> bool:
    """Whether the file system of ``out_dir`` (or its nearest existing parent) has ``n_bytes``."""
    p = Path(out_dir).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free >= n_bytes
