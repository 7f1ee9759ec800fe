"""What the evidence package is built from: ``kernels/upstream/sources.toml`` (the table, the runs
that measured each bucket, the benches, the probe, vLLM's own table and kernel bench, the
determinism listing, the device folders), read strictly, and the names of the files and schemas
involved. A raw file that is missing or says something the package cannot stand on is a
:class:`PackageError` naming the file, the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


SOURCES = "kernels/upstream/sources.toml"


TABLE_OUT = "kernels/upstream/batch_invariant_configs_nvidia_h200.py"


PROVENANCE_OUT = "kernels/upstream/provenance.json"


README_OUT = "kernels/upstream/README.md"


SCHEMA = "bistat_kernels.upstream_package/1"


DEVICE_SCHEMA = "bistat_kernels.upstream_device/1"


DEVICE_SCRIPT = "scripts/device/upstream_bench.py"


KERNEL_AB_SCHEMA = "bistat_kernels.upstream_kernel_ab/1"


DETERMINISM_SCHEMA = "bistat_kernels.upstream_determinism/1"


PROVENANCE_KEYS = ("gpu_name", "gpu_uuid", "gpu_serial", "driver", "compute_capability", "torch",
                   "cuda", "triton", "python", "date_utc", "command")


INSTALLED = "tuned GEMM installed"   # the plugin's log line (bistat_kernels.vllm_plugin.install)


STATUSES = ("runs", "runs-local-model", "skips", "cannot")


class PackageError(ValueError):
    """A raw file is missing or says something the package cannot stand on; the message names the
    file, the field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VllmRelease(_Strict):
    version: str
    commit: str
    configs_sha256: str
    kernel_sha256: str


class RunSource(_Strict):
    raw: str
    what: str


class NamedRaw(_Strict):
    name: str
    raw: str


class TableBench(NamedRaw):
    table_sha256: str


class RawFile(_Strict):
    raw: str


class DeviceFolders(_Strict):
    folders: list[str] = []


class Sources(_Strict):
    table: str
    vllm: VllmRelease
    runs: dict[str, RunSource]
    benches: list[TableBench]
    probe: TableBench
    vllm_kernel_bench: NamedRaw
    determinism: RawFile
    device: DeviceFolders = DeviceFolders()


def load_sources(path: Path) -> Sources:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PackageError(f"{path}: not found (the package's list of raw files)") from None
    except tomllib.TOMLDecodeError as exc:
        raise PackageError(f"{path}: not valid TOML ({exc}); fix the syntax") from None
    try:
        return Sources.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise PackageError(f"{path}: field {where}: {err['msg']}; see the comments in the file "
                           f"for what it takes") from None


def _read_json(root: Path, rel: str, field_name: str) -> Any:
    path = root / rel
    if not path.is_file():
        raise PackageError(f"{SOURCES}: {field_name} = {rel!r}: no such file; fix the path or "
                           f"remove the entry")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PackageError(f"{rel}: not valid JSON ({exc}); restore it from git") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
