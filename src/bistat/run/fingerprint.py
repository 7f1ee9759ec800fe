"""The environment fingerprint recorded for every arm at every engine start.

"Version or it doesn't count" and "same node, logged serials, or re-run" (docs of the field):
a comparison between arms is only valid on one physical machine with identical software. The
fingerprint records what is needed to check both, and :func:`same_node` / :func:`same_versions`
are the comparisons the analysis' validity checks use.

Format (a JSON object)::

    {"gpus": [{"name", "uuid", "serial", "driver"}],        # [] without an NVIDIA GPU
     "cpu": {"model", "count", "machine"},
     "os": {"system", "release", "platform"},
     "versions": {"python", "numpy", "torch", "triton", "vllm", "bistat"},   # null: not installed
     "git": {"commit", "dirty"},                             # nulls outside a git checkout
                                  # + "from", "copy_git" when BISTAT_SOURCE_COMMIT declares it
     "code": {"bistat", "bistat_kernels"},                   # SHA-256 of each package's files
     "host": "hostname"}

``code`` identifies the code that ran where ``git`` cannot: a copy of a checkout whose ``.git`` is
another commit's (a copy of the working tree synced onto a GPU machine can keep the metadata of the
commit it was first made from), or an install without git. Such a copy can also say which commit it
is a copy of: ``BISTAT_SOURCE_COMMIT="SHA clean"`` (or ``dirty``: tracked files differed from the
commit), which ``scripts/device/travel.sh run`` writes to ``scripts/device/SOURCE_COMMIT`` and
``scripts/device/env.sh`` exports. ``git`` then records that commit with ``"from":
"BISTAT_SOURCE_COMMIT"`` and, where the copy's own git metadata names another commit, what it named
under ``copy_git``; a malformed value is recorded as ``invalid`` beside the copy's own answer,
never taken for a commit. Each digest covers the package's ``.py`` and ``.json`` files (relative
path and bytes, in path order; not the measurements under ``results/``), found with
:func:`importlib.util.find_spec` without importing the package; null where it is not installed.

Versions come from :mod:`importlib.metadata` (package metadata), never by importing the
packages: importing torch or vLLM takes seconds and can initialise CUDA. GPU details come from
``nvidia-smi --query-gpu=name,uuid,serial,driver_version`` or, where ``nvidia-smi`` is absent,
from ``pynvml`` when it is installed. A GPU field the driver does not report (serials are often
``[N/A]`` on consumer boards) is null.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "CODE_PACKAGES",
    "SOURCE_COMMIT_ENV",
    "VERSIONED_PACKAGES",
    "code_digests",
    "collect_fingerprint",
    "engine_fingerprint",
    "machine_summary",
    "cpu_info",
    "git_info",
    "gpu_info",
    "gpu_processes",
    "package_versions",
    "same_node",
    "same_versions",
    "version_differences",
]

VERSIONED_PACKAGES = ("numpy", "torch", "triton", "vllm", "bistat")
#: The packages whose files ``code`` digests: bistat and its tuned-GEMM plugin.
CODE_PACKAGES = ("bistat", "bistat_kernels")
_NVIDIA_SMI_FIELDS = ("name", "uuid", "serial", "driver_version")
_TIMEOUT_S = 10


def _na(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value in ("", "[N/A]", "N/A", "[Not Supported]") else value


def _parse_nvidia_smi(text: str) -> list[dict[str, str | None]]:
    gpus = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(_NVIDIA_SMI_FIELDS):
            raise ValueError(f"nvidia-smi: expected {len(_NVIDIA_SMI_FIELDS)} fields per GPU, got {row!r}")
        name, uuid, serial, driver = (_na(x) for x in row)
        gpus.append({"name": name, "uuid": uuid, "serial": serial, "driver": driver})
    return gpus


def _gpus_from_pynvml() -> list[dict[str, str | None]]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)

            def get(fn: Any, handle: Any = handle) -> str | None:
                try:
                    value = fn(handle)
                except pynvml.NVMLError:
                    return None
                return _na(value.decode() if isinstance(value, bytes) else str(value))

            gpus.append(
                {
                    "name": get(pynvml.nvmlDeviceGetName),
                    "uuid": get(pynvml.nvmlDeviceGetUUID),
                    "serial": get(pynvml.nvmlDeviceGetSerial),
                    "driver": _na(driver.decode() if isinstance(driver, bytes) else str(driver)),
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def gpu_info(visible_devices: str | None = None) -> list[dict[str, str | None]]:
    """Name, UUID, serial and driver of each NVIDIA GPU; ``[]`` when there is none.

    ``visible_devices`` (an arm's ``CUDA_VISIBLE_DEVICES``, comma-separated indices or UUIDs)
    restricts the list to the GPUs that arm's engine can see.
    """
    gpus: list[dict[str, str | None]] = []
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=" + ",".join(_NVIDIA_SMI_FIELDS), "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
                check=True,
            ).stdout
            gpus = _parse_nvidia_smi(out)
        except (OSError, subprocess.SubprocessError, ValueError):
            gpus = _gpus_from_pynvml()
    else:
        gpus = _gpus_from_pynvml()
    if visible_devices is not None and visible_devices.strip():
        wanted = [v.strip() for v in visible_devices.split(",") if v.strip()]
        selected = []
        for w in wanted:
            if w.isdigit() and int(w) < len(gpus):
                selected.append(gpus[int(w)])
            else:
                selected.extend(g for g in gpus if g["uuid"] is not None and g["uuid"].startswith(w))
        gpus = selected
    return gpus


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """CPU model name (from ``/proc/cpuinfo`` where it exists), logical CPU count, machine type."""
    model = None
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                model = value.strip()
                break
    except OSError:
        model = None
    return {"model": model or platform.processor() or None, "count": os.cpu_count(), "machine": platform.machine()}


def package_versions(packages: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """Installed versions from package metadata (never by import); ``python`` too; null if absent."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


#: A copy of a checkout without its own git history names the commit it is a copy of here.
SOURCE_COMMIT_ENV = "BISTAT_SOURCE_COMMIT"
_SOURCE_COMMIT = re.compile(r"(?P<commit>[0-9a-f]{40}) (?P<state>clean|dirty)")


def git_info(directory: Path | None = None) -> dict[str, Any]:
    """The git commit of ``directory`` (default: bistat's own source tree) and whether it is dirty.

    Where :data:`SOURCE_COMMIT_ENV` is set (``"SHA clean"`` or ``"SHA dirty"``), the commit it
    declares, marked ``"from": "BISTAT_SOURCE_COMMIT"`` (see the module docstring).
    """
    local = _local_git(directory)
    declared = os.environ.get(SOURCE_COMMIT_ENV, "").strip()
    if not declared:
        return local
    m = _SOURCE_COMMIT.fullmatch(declared)
    if m is None:
        return {**local, "from": SOURCE_COMMIT_ENV,
                "invalid": f"{SOURCE_COMMIT_ENV}={declared!r} is not 'SHA clean' or 'SHA dirty' "
                           "(a full 40-digit commit); the copy's own git answer is recorded"}
    out: dict[str, Any] = {"commit": m["commit"], "dirty": m["state"] == "dirty",
                           "from": SOURCE_COMMIT_ENV}
    if local["commit"] != m["commit"]:
        out["copy_git"] = local
    return out


def _local_git(directory: Path | None) -> dict[str, Any]:
    directory = directory or Path(__file__).resolve().parent
    git = shutil.which("git")
    if git is None:
        return {"commit": None, "dirty": None}
    try:
        commit = subprocess.run(
            [git, "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(
            [git, "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return {"commit": commit.stdout.strip() or None, "dirty": dirty}


@functools.cache
def _package_digest(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file()
                   and not {"__pycache__", "results"} & set(p.relative_to(root).parts))
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def code_digests() -> dict[str, str | None]:
    """SHA-256 of each of :data:`CODE_PACKAGES` as installed here (null: not installed).

    Computed once per process: the code a process runs does not change while it runs.
    """
    return {name: _package_digest(name) for name in CODE_PACKAGES}


def collect_fingerprint(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fingerprint of this machine (see the module docstring for the format).

    ``env`` is the arm's environment; its ``CUDA_VISIBLE_DEVICES`` (if any) selects the GPUs.
    """
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return {
        "gpus": gpu_info(visible),
        "cpu": cpu_info(),
        "os": {"system": platform.system(), "release": platform.release(), "platform": sys.platform},
        "versions": package_versions(),
        "git": git_info(),
        "code": code_digests(),
        "host": socket.gethostname(),
    }


def engine_fingerprint(engine: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A started engine's fingerprint in this module's format.

    An engine whose fingerprint lacks ``gpus`` (in-process engines return ``{}``; the server
    adapters return only their own details) gets this machine's (:func:`collect_fingerprint`,
    ``env`` the arm's environment), marked ``"source": "runner"``, with what the engine reported
    kept under ``engine_reported``.
    """
    fp = engine.fingerprint()
    if isinstance(fp, dict) and "gpus" in fp:
        return fp
    local = {**collect_fingerprint(env), "source": "runner"}
    if fp:
        local["engine_reported"] = fp
    return local


def machine_summary(fp: Mapping[str, Any], info: Any = None) -> dict[str, Any]:
    """What a fingerprint says of where something ran, in brief: the GPUs (name, UUID, driver,
    serial), the package versions (the engine's own where it reported them), the host and the
    engine's kind and version (``info``'s, the :class:`~bistat.engines.base.EngineInfo` its start
    returned, where given; else what the fingerprint says). A probe report keeps it per arm."""
    engine = fp.get("engine_reported") if isinstance(fp.get("engine_reported"), Mapping) else fp
    versions = {**(fp.get("versions") or {}), **(engine.get("versions") or {})}
    kind = getattr(info, "kind", None)
    return {"gpus": [{k: g.get(k) for k in ("name", "uuid", "driver", "serial") if k in g}
                     for g in fp.get("gpus") or []],
            "versions": {k: v for k, v in sorted(versions.items()) if v is not None},
            "host": fp.get("host"),
            "engine": ({"kind": kind, "version": getattr(info, "version", None)} if kind else
                       {"kind": engine.get("kind"), "version": engine.get("version")})}


def gpu_processes() -> list[dict[str, Any]] | None:
    """The compute processes on this machine's NVIDIA GPUs (``nvidia-smi --query-compute-apps``).

    Returns
    -------
    list of dict or None
        ``{"gpu_uuid", "pid", "name", "used_memory_mib"}`` per process (``[]``: none); None when
        it cannot be told (no ``nvidia-smi``, or it failed).
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    procs = []
    for row in csv.reader(io.StringIO(out)):
        if len(row) < 4:
            continue
        uuid, pid, name, mem = (_na(x) for x in row[:4])
        procs.append({"gpu_uuid": uuid, "pid": int(pid) if pid and pid.isdigit() else None,
                      "name": name,
                      "used_memory_mib": int(mem) if mem and mem.isdigit() else None})
    return procs


def _node_key(fp: Mapping[str, Any]) -> tuple[Any, ...]:
    gpus = fp.get("gpus") or []
    if gpus:
        return ("gpu", tuple(sorted(str(g.get("uuid")) for g in gpus)))
    return ("host", fp.get("host"), (fp.get("cpu") or {}).get("model"))


def same_node(fingerprints: Sequence[Mapping[str, Any]]) -> bool:
    """Whether all fingerprints come from the same hardware.

    With GPUs: the same set of GPU UUIDs (the physical devices, which survive a host rename).
    Without GPUs: the same host name and CPU model. A GPU fingerprint never equals a CPU-only one.
    A GPU without a readable UUID cannot be shown to be the same device: the check fails.

    Examples
    --------
    >>> a = {"gpus": [{"name": "H200", "uuid": "GPU-1", "serial": None, "driver": "580"}], "host": "n1"}
    >>> same_node([a, dict(a, host="n2")]), same_node([a, dict(a, gpus=[])])
    (True, False)
    """
    if not fingerprints:
        return True
    for fp in fingerprints:
        if any(g.get("uuid") is None for g in fp.get("gpus") or []):
            return False
    keys = {_node_key(fp) for fp in fingerprints}
    return len(keys) == 1


def version_differences(
    fingerprints: Sequence[Mapping[str, Any]], packages: Iterable[str] = ("python",) + VERSIONED_PACKAGES
) -> list[str]:
    """What differs between the fingerprints' software, one phrase per item (empty: nothing):
    versions of ``packages`` (absent == absent), git commit, GPU driver, and code digests
    (``code``; absent in fingerprints recorded before it existed, so those differ from any)."""
    out = []
    for k in packages:
        vals = {str((fp.get("versions") or {}).get(k)) for fp in fingerprints}
        if len(vals) > 1:
            out.append(f"{k}: {' / '.join(sorted(vals))}")
    commits = {str((fp.get("git") or {}).get("commit")) for fp in fingerprints}
    if len(commits) > 1:
        out.append(f"git commit: {' / '.join(sorted(commits))}")
    drivers = {tuple(sorted(str(g.get("driver")) for g in fp.get("gpus") or []))
               for fp in fingerprints}
    if len(drivers) > 1:
        out.append("GPU driver differs")
    for pkg in sorted({k for fp in fingerprints for k in (fp.get("code") or {})}):
        digests = {str((fp.get("code") or {}).get(pkg))[:12] for fp in fingerprints}
        if len(digests) > 1:
            out.append(f"{pkg} code: {' / '.join(sorted(digests))}")
    return out


def same_versions(
    fingerprints: Sequence[Mapping[str, Any]], packages: Iterable[str] = ("python",) + VERSIONED_PACKAGES
) -> bool:
    """Whether all fingerprints have identical software (:func:`version_differences` finds
    nothing). The GPU driver is part of the software too and must match."""
    return not version_differences(fingerprints, tuple(packages))
