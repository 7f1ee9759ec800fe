"""``Model`` and ``load_model``: a converted model folder -> config, float32 weights, tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from bistat.model import cache
from bistat.model.config import ModelConfig
from bistat.model.errors import CacheCorruptError, ModelError, ModelNotCachedError, UnknownModelError
from bistat.model.registry import REGISTRY
from bistat.model.tokenizer import Tokenizer

__all__ = ["Model", "load_model", "load_tokenizer", "local_config_and_tokenizer", "model_files",
           "model_problem", "save_model"]


@dataclass(frozen=True, eq=False)
class Model:
    """A LLaMA model ready for the embedded engine.

    Parameters
    ----------
    config
        Its shape (Hugging Face LLaMA names).
    weights
        Hugging Face tensor names -> float32 arrays, linear layers ``[out, in]``
        (``model.layers.{i}.self_attn.q_proj.weight``, ...); Q/K rows in Hugging Face order (llama.cpp's
        permutation undone). No ``lm_head.weight`` when ``config.tie_word_embeddings``. Arrays
        loaded from the cache are read-only memory maps.
    tokenizer
        Its tokenizer and chat template.
    name
        The registered name (``smollm2-135m``), or the folder's manifest name.
    sha256
        Content hash: sha256 of the canonical JSON ``{file: sha256}`` of its model folder
        (`bistat.model.cache.content_sha256`); equal models have equal hashes.
    """

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer
    name: str
    sha256: str

    @property
    def n_parameters(self) -> int:
        """Number of weights (the tied output projection counted once)."""
        return int(sum(w.size for w in self.weights.values()))


def _fix_for(folder: Path, name: str | None) -> str:
    if name in REGISTRY and folder.resolve() == cache.model_dir(name).resolve():
        return f"run `bistat model fetch --force {name}` to fetch it again"
    return "re-create this folder (it is not the cache folder of a registered model)"


def _resolve(name_or_path: str | Path) -> tuple[Path, str | None]:
    text = str(name_or_path)
    if text in REGISTRY:
        folder = cache.model_dir(text)
        if not (folder / cache.MANIFEST).is_file():
            raise ModelNotCachedError(
                f"model {text!r} is not in the cache ({folder}); fetch it with `bistat model fetch {text}`")
        return folder, text
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / cache.MANIFEST).is_file():
        return path, None
    known = ", ".join(repr(n) for n in sorted(REGISTRY))
    if path.is_dir():
        raise UnknownModelError(f"{path}: no {cache.MANIFEST} here; expected a model folder written by "
                                f"`bistat model fetch` (or one of the names {known})")
    raise UnknownModelError(f"unknown model {text!r}; expected one of {known}, or the path of a model folder")


def model_problem(name_or_path: str | Path) -> str | None:
    """Why ``name_or_path`` can never load (not a registered name, not a model folder), or None.
    A registered model that is not fetched yet is no problem: ``bistat model fetch`` fetches it."""
    try:
        _resolve(name_or_path)
    except ModelNotCachedError:
        return None
    except UnknownModelError as exc:
        return str(exc)
    return None


def _read_config_and_tokenizer(folder: Path, fix: str) -> tuple[ModelConfig, Tokenizer]:
    path = folder / cache.CONFIG_FILE
    try:
        config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
        path = folder / cache.TEMPLATE_FILE
        template = path.read_text()
        path = folder / cache.TOKENIZER_FILE
        backend = tokenizers.Tokenizer.from_str(path.read_text())
        tokenizer = Tokenizer(backend, template, bos_token_id=config.bos_token_id,
                              eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    # tokenizers raises a plain Exception for a malformed tokenizer.json
    except Exception as exc:
        raise CacheCorruptError(f"{path}: unreadable ({exc}); {fix}") from exc
    return config, tokenizer


def load_tokenizer(name_or_path: str | Path, *, verify: bool = True) -> Tokenizer:
    """Load only a model folder's tokenizer and chat template (checking just those files' sha256)."""
    folder, registered = _resolve(name_or_path)
    manifest = cache.read_manifest(folder, _fix_for(folder, registered))
    fix = _fix_for(folder, registered or manifest["name"])
    if verify:
        names = (cache.CONFIG_FILE, cache.TOKENIZER_FILE, cache.TEMPLATE_FILE)
        cache.verify_files(folder, manifest, fix, only=names)
    return _read_config_and_tokenizer(folder, fix)[1]


def local_config_and_tokenizer(name_or_path: str | Path) -> tuple[ModelConfig, Tokenizer] | None:
    """A model's configuration and tokenizer when they are on this machine (its files checked
    against the manifest), else None: not fetched yet, unknown or unreadable (registration's
    checks then leave what needs them to the run, and say so)."""
    try:
        folder, registered = _resolve(name_or_path)
        manifest = cache.read_manifest(folder, _fix_for(folder, registered))
        fix = _fix_for(folder, registered or manifest["name"])
        cache.verify_files(folder, manifest, fix,
                           only=(cache.CONFIG_FILE, cache.TOKENIZER_FILE, cache.TEMPLATE_FILE))
        return _read_config_and_tokenizer(folder, fix)
    except (ModelError, OSError, ValueError, KeyError):
        return None


def load_model(name_or_path: str | Path, *, verify: bool = True, mmap: bool = True) -> Model:
    """Load a converted model: a registered name (from the cache) or a model folder's path.

    Parameters
    ----------
    name_or_path
        ``"smollm2-135m"`` or a folder written by `save_model` / ``bistat model fetch``.
    verify
        Check every file's sha256 against the manifest first (about 0.3 s for SmolLM2-135M).
    mmap
        Memory-map the weights read-only (pages shared with the page cache) instead of reading
        them into private memory.

    Raises
    ------
    UnknownModelError, ModelNotCachedError, CacheCorruptError
        With the file at fault and the command that fixes it.
    """
    folder, registered = _resolve(name_or_path)
    fix = _fix_for(folder, registered)
    manifest = cache.read_manifest(folder, fix)
    fix = _fix_for(folder, registered or manifest["name"])
    if verify:
        cache.verify_files(folder, manifest, fix)
    config, tokenizer = _read_config_and_tokenizer(folder, fix)
    weights: dict[str, np.ndarray] = {}
    shapes = config.weight_shapes()
    if set(manifest["tensors"]) != set(shapes):
        raise CacheCorruptError(f"{folder / cache.MANIFEST}: field 'tensors' does not list the tensors "
                                f"config.json implies; {fix}")
    for tname, shape in shapes.items():
        path = folder / manifest["tensors"][tname]["file"]
        try:
            arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CacheCorruptError(f"{path}: unreadable ({exc}); {fix}") from exc
        if arr.dtype != np.float32 or arr.shape != shape:
            raise CacheCorruptError(f"{path}: holds {arr.dtype}{list(arr.shape)}, expected float32{list(shape)}; {fix}")
        weights[tname] = arr
    if tokenizer.vocab_size > config.vocab_size:
        raise CacheCorruptError(f"{folder / cache.TOKENIZER_FILE}: {tokenizer.vocab_size} tokens, more than "
                                f"config.json's vocab_size {config.vocab_size}; {fix}")
    return Model(config=config, weights=weights, tokenizer=tokenizer, name=registered or manifest["name"],
                 sha256=manifest["sha256"])


def model_files(model_config: ModelConfig, weights: Mapping[str, np.ndarray], tokenizer: Tokenizer) -> dict[str, str]:
    """``{relative path: sha256}`` of the folder `save_model` would write (without writing it)."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in
            cache.serialize_model_files(model_config, weights, tokenizer.backend.to_str(), tokenizer.chat_template)}


def save_model(model: Model, dest: str | Path, *, source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``model`` as a model folder at ``dest`` (atomically); `load_model(dest)` reads it back.

    Returns the manifest; its ``sha256`` equals ``model.sha256`` when that was computed by
    `model_files` / `cache.content_sha256` from the same contents.
    """
    from bistat import __version__
    return cache.write_model_dir(dest, name=model.name, config=model.config, weights=model.weights,
                                 tokenizer_json=model.tokenizer.backend.to_str(),
                                 chat_template=model.tokenizer.chat_template,
                                 source=dict(source or {}), bistat_version=__version__)
