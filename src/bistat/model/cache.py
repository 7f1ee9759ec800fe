"""The converted-model folder: layout, manifest, atomic writes and verification on every load.

Layout of a model folder (``<cache root>/models/<name>/`` for a fetched model)::

    manifest.json          schema "bistat.model-cache/1": source, files (path -> sha256), tensors, sha256
    config.json            Hugging Face LLaMA config (ModelConfig.to_hf_dict)
    tokenizer.json         the ``tokenizers`` serialization
    chat_template.jinja    the chat template (Jinja)
    weights/<hf name>.npy  one float32 array per tensor, memory-mappable

The cache root is ``$BISTAT_HOME`` if set, else ``$XDG_CACHE_HOME/bistat``, else the platform's
user cache folder (``~/.cache/bistat`` on Linux, via ``platformdirs``). Every file's sha256 is
recorded in the manifest when the folder is written and checked on every load.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs

from bistat.model.config import ModelConfig
from bistat.model.errors import CacheCorruptError

__all__ = ["MANIFEST", "SCHEMA", "cache_root", "content_sha256", "file_sha256", "model_dir",
           "read_manifest", "serialize_model_files", "verify_files", "write_model_dir"]

SCHEMA = "bistat.model-cache/1"
MANIFEST = "manifest.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
WEIGHTS_DIR = "weights"

_CHUNK = 1 << 20


def cache_root() -> Path:
    """bistat's cache folder: ``$BISTAT_HOME``, else ``$XDG_CACHE_HOME/bistat``, else the user cache."""
    home = os.environ.get("BISTAT_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says relative values are to be ignored
        return Path(xdg) / "bistat"
    return platformdirs.user_cache_path("bistat", appauthor=False)


def model_dir(name: str) -> Path:
    """Where the registered model ``name`` lives in the cache."""
    return cache_root() / "models" / name


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def content_sha256(files: Mapping[str, str]) -> str:
    """The model's identity: sha256 of the canonical JSON of ``{relative path: file sha256}``."""
    return hashlib.sha256(json.dumps(dict(files), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tensor_file(name: str) -> str:
    """Relative path of the ``.npy`` file holding tensor ``name``."""
    return f"{WEIGHTS_DIR}/{name}.npy"


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def serialize_model_files(config: ModelConfig, weights: Mapping[str, np.ndarray], tokenizer_json: str,
                          chat_template: str):
    """Yield ``(relative path, bytes)`` for every file of a model folder except the manifest.

    Tensors come one at a time, in ``config.weight_shapes()`` order, so a caller that writes them
    as they come holds one serialized tensor at a time.
    """
    yield CONFIG_FILE, (json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n").encode()
    yield TOKENIZER_FILE, tokenizer_json.encode()
    yield TEMPLATE_FILE, chat_template.encode()
    for name in config.weight_shapes():
        yield tensor_file(name), _npy_bytes(weights[name])


def write_model_dir(dest: str | Path, *, name: str, config: ModelConfig, weights: Mapping[str, np.ndarray],
                    tokenizer_json: str, chat_template: str, source: Mapping[str, Any],
                    bistat_version: str) -> dict[str, Any]:
    """Write a model folder at ``dest`` atomically (a sibling temporary folder, then a rename).

    An existing ``dest`` is replaced only once the new folder is complete, so an interrupted write
    leaves the old folder (or nothing) in place, never a half-written one.

    Returns
    -------
    dict
        The manifest written.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shapes = config.weight_shapes()
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for n, shape in shapes.items():
        if tuple(weights[n].shape) != shape:
            raise ValueError(f"weight {n} has shape {tuple(weights[n].shape)}, the config implies {shape}")
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / WEIGHTS_DIR).mkdir(parents=True)
    files: dict[str, str] = {}
    try:
        for rel, data in serialize_model_files(config, weights, tokenizer_json, chat_template):
            (tmp / rel).write_bytes(data)
            files[rel] = hashlib.sha256(data).hexdigest()
        manifest = {
            "schema": SCHEMA,
            "name": name,
            "sha256": content_sha256(files),
            "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "bistat_version": bistat_version,
            "source": dict(source),
            "tensors": {n: {"file": tensor_file(n), "shape": list(s), "dtype": "float32"}
                        for n, s in shapes.items()},
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def read_manifest(folder: str | Path, fix: str) -> dict[str, Any]:
    """Read and check ``folder/manifest.json``; ``fix`` is the remedy quoted in errors."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: missing; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheCorruptError(f"{path}: unreadable ({exc}); {fix}") from exc
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise CacheCorruptError(f"{path}: schema {got!r} is not {SCHEMA!r}; {fix}")
    for key, kind in (("files", dict), ("tensors", dict), ("sha256", str), ("name", str)):
        if not isinstance(manifest.get(key), kind):
            raise CacheCorruptError(f"{path}: field {key!r} is missing or not a {kind.__name__}; {fix}")
    return manifest


def verify_files(folder: str | Path, manifest: Mapping[str, Any], fix: str,
                 only: tuple[str, ...] | None = None) -> None:
    """Check that every file the manifest lists exists and has its recorded sha256.

    ``only`` restricts the sha256 checks to those relative paths.

    Raises
    ------
    CacheCorruptError
        Naming the first file that is missing or differs, and ``fix``.
    """
    folder = Path(folder)
    files = manifest["files"]
    required = {CONFIG_FILE, TOKENIZER_FILE, TEMPLATE_FILE} | {t["file"] for t in manifest["tensors"].values()}
    unlisted = sorted(required - set(files))
    if unlisted:
        raise CacheCorruptError(f"{folder / MANIFEST}: files {unlisted[:3]} are not listed; {fix}")
    if content_sha256(files) != manifest["sha256"]:
        raise CacheCorruptError(f"{folder / MANIFEST}: field 'sha256' does not match its file list; {fix}")
    for rel, expected in sorted(files.items()):
        if only is not None and rel not in only:
            continue
        path = folder / rel
        try:
            got = file_sha256(path)
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}: missing; {fix}") from None
        if got != expected:
            raise CacheCorruptError(f"{path}: sha256 {got} differs from the manifest's {expected}; {fix}")
