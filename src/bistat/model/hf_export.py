"""Export a model as a Hugging Face folder that transformers and vLLM load, without torch.

Files: ``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``
(with the chat template), ``special_tokens_map.json`` and ``model.safetensors``.

The safetensors file is written here directly, since numpy has no bfloat16 dtype and
``safetensors.numpy`` cannot take one: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with
spaces to a multiple of 8 bytes, then the tensors' raw little-endian bytes in header order.
bfloat16 is the upper half of a float32 rounded to nearest, ties to even.

References
----------
.. [1] huggingface/safetensors, ``docs/source/index.mdx`` ("Format") and ``safetensors/src/tensor.rs``.
.. [2] Intel, BFLOAT16 - Hardware Numerics Definition, document 338302-001US, 2018 (round to nearest even).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bistat.core.lazy import lazy_module

if TYPE_CHECKING:  # pragma: no cover
    from bistat.model.loader import Model

# numpy loads on first use: `bistat model export --help` lists DTYPES without it
np = lazy_module("numpy")

__all__ = ["DTYPES", "bf16_to_fp32", "export_hf", "fp32_to_bf16", "read_safetensors", "write_safetensors"]

#: Export dtypes and their safetensors names.
DTYPES = {"bfloat16": "BF16", "float32": "F32"}
_NUMPY = {"BF16": "<u2", "F32": "<f4"}   # the numpy dtype of each safetensors dtype


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even; NaN stays NaN.

    Examples
    --------
    >>> fp32_to_bf16(np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=np.float32))
    array([16256, 16256, 16258], dtype=uint16)
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(np.ascontiguousarray(x, dtype=np.float32))
    if nan.any():
        rounded = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def bf16_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], *, dtype: str = "bfloat16",
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write float tensors to a safetensors file in ``dtype`` ("bfloat16" or "float32"), one at a time."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {', '.join(map(repr, DTYPES))}")
    st = DTYPES[dtype]
    itemsize = np.dtype(_NUMPY[st]).itemsize
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    names = sorted(tensors)
    for name in names:
        shape = [int(s) for s in tensors[name].shape]
        size = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = Path(f"{path}.partial")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name in names:
            arr = np.asarray(tensors[name], dtype=np.float32)
            data = fp32_to_bf16(arr) if st == "BF16" else np.ascontiguousarray(arr, dtype="<f4")
            fh.write(data.tobytes())
    os.replace(tmp, path)


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a BF16/F32 safetensors file to float32 arrays; return ``(tensors, metadata)``."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        base = 8 + n
    metadata = header.pop("__metadata__", {})
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _NUMPY:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; only BF16 and F32 are read")
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[base + begin: base + end], dtype=_NUMPY[info["dtype"]]).reshape(info["shape"])
        out[name] = bf16_to_fp32(arr) if info["dtype"] == "BF16" else np.array(arr, dtype=np.float32)
    return out, metadata


def _tokenizer_config(model: Model) -> dict[str, Any]:
    tok = model.tokenizer
    added = tok.backend.get_added_tokens_decoder()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return {
        "added_tokens_decoder": {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                                          "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
                                 for i, t in sorted(added.items())},
        "additional_special_tokens": [tok.bos_token, tok.eos_token],
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.id_to_token(pad),
        "unk_token": tok.id_to_token(0),
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "model_max_length": model.config.max_position_embeddings,
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": tok.vocab_size,
    }


def _json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_hf(model: Model | str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
              overwrite: bool = False) -> list[Path]:
    """Write ``model`` as a Hugging Face ``LlamaForCausalLM`` folder at ``out_dir``.

    Parameters
    ----------
    model
        A `Model`, or a name / folder for `load_model`.
    out_dir
        Created if missing; must be empty unless ``overwrite``.
    dtype
        ``"bfloat16"`` (what vLLM serves) or ``"float32"`` (the embedded engine's exact weights).

    Returns
    -------
    list of Path
        The files written, sorted.
    """
    from bistat.model.loader import Model, load_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {', '.join(map(repr, DTYPES))}")
    if not isinstance(model, Model):
        model = load_model(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: folder is not empty; choose an empty one or pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    _json(out / "config.json", cfg.to_hf_dict(torch_dtype=dtype))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    _json(out / "generation_config.json", gen)
    (out / "tokenizer.json").write_text(model.tokenizer.backend.to_str(pretty=True))
    tok_cfg = _tokenizer_config(model)
    _json(out / "tokenizer_config.json", tok_cfg)
    _json(out / "special_tokens_map.json", {k: tok_cfg[k] for k in ("additional_special_tokens", "bos_token",
                                                                     "eos_token", "pad_token", "unk_token")})
    (out / "chat_template.jinja").write_text(model.tokenizer.chat_template)
    write_safetensors(out / "model.safetensors", model.weights, dtype=dtype,
                      metadata={"format": "pt", "bistat_model": model.name, "bistat_sha256": model.sha256})
    return sorted(p for p in out.iterdir() if p.is_file())
