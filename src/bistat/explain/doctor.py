"""``bistat doctor``: which engines are usable here, the GPU and driver, versions, cache, models,
and which table bistat's tuned GEMM would use on this GPU, and the servers a killed ``bistat run``
left running (stopped: :mod:`bistat.engines.lifetime`).

Nothing heavy is imported: optional engines are looked up with ``importlib.util.find_spec``
(neither vLLM nor SGLang is imported), versions come from package metadata, the GPU from ``nvidia-smi``
(``bistat.run.fingerprint.gpu_info``), and a model counts as cached when its cache folder holds a
manifest (``bistat model fetch`` writes it last). Only where ``nvidia-smi`` found a GPU and torch
is installed is torch imported, for the compute capability and multiprocessor count the GEMM
table's resolution needs (:func:`gemm_table`).
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat.engines.lifetime import LeftoverServer, leftover_servers, stop_group
from bistat.run.fingerprint import gpu_info, package_versions

__all__ = ["DOCTOR_SCHEMA", "DoctorReport", "EngineCheck", "ModelCheck", "doctor",
           "render_doctor"]

DOCTOR_SCHEMA = "bistat.doctor/1"


@dataclass(frozen=True)
class EngineCheck:
    kind: str
    usable: bool
    detail: str


@dataclass(frozen=True)
class ModelCheck:
    name: str
    cached: bool
    path: str


@dataclass(frozen=True)
class DoctorReport:
    engines: tuple[EngineCheck, ...]
    gpus: tuple[dict[str, Any], ...]
    nvidia_smi: str | None
    versions: dict[str, str | None]
    cache_dir: str
    models: tuple[ModelCheck, ...]
    #: vLLM's version and commit against the newest release known (:func:`vllm_release`);
    #: None when vLLM is not installed
    vllm_release: dict[str, Any] | None = None
    #: the same for SGLang (package ``sglang``); None when SGLang is not installed
    sglang_release: dict[str, Any] | None = None
    #: which table bistat's tuned GEMM would use on GPU 0 and how it was chosen
    #: (:func:`gemm_table`); None without an NVIDIA GPU
    gemm_table: dict[str, Any] | None = None
    #: servers a killed ``bistat run`` left running (:func:`bistat.engines.lifetime.leftover_servers`):
    #: pid, pgid, argv, owner (the mark naming the gone ``bistat`` process) and whether doctor
    #: stopped it
    leftover_servers: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"schema": DOCTOR_SCHEMA,
                "engines": [{"kind": e.kind, "usable": e.usable, "detail": e.detail}
                            for e in self.engines],
                "gpus": [dict(g) for g in self.gpus], "nvidia_smi": self.nvidia_smi,
                "versions": dict(self.versions), "cache_dir": self.cache_dir,
                "models": [{"name": m.name, "cached": m.cached, "path": m.path}
                           for m in self.models],
                "vllm_release": self.vllm_release, "sglang_release": self.sglang_release,
                "gemm_table": self.gemm_table,
                "leftover_servers": [dict(s) for s in self.leftover_servers]}


def _has(module: str, find_spec: Callable[[str], Any]) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def package_commit(package: str,
                   find_spec: Callable[[str], Any] = importlib.util.find_spec) -> str | None:
    """A package's git commit from ``PACKAGE/_version.py`` (``__commit_id__``, vcs-versioning's
    file, which vLLM and SGLang ship), read with ``ast`` without importing the package; None when
    it cannot be read or records none (SGLang's release wheels write None)."""
    try:
        spec = find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = getattr(spec, "submodule_search_locations", None)
    if not locations:
        return None
    path = Path(next(iter(locations))) / "_version.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__commit_id__"
                                                for t in ast.walk(node)):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return str(value) if value is not None else None
    return None


def vllm_commit(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> str | None:
    """vLLM's git commit (:func:`package_commit`)."""
    return package_commit("vllm", find_spec)


def vllm_release(version: str | None, commit: str | None,
                 check: Callable[[str], Any], package: str = "vllm") -> dict[str, Any] | None:
    """The installed ``package`` (vLLM, or SGLang) against the newest release the package index
    knows (``check``: :func:`bistat.declare.releases.check_newest_release`); None when it is not
    installed."""
    if version is None:
        return None
    from bistat.declare.engine_version import compare_versions

    found = check(package)
    return {"version": version, "commit": commit, "newest": found.newest,
            "comparison": (compare_versions(version, found.newest) if found.newest
                           else "unknown"),
            "checked_utc": found.checked_utc, "index": found.index, "error": found.error}


#: SGLang's stack as ``bistat doctor`` reports it (distribution names)
SGLANG_PACKAGES = ("sglang", "sglang-kernel", "flashinfer-python")


def sglang_versions() -> dict[str, str | None]:
    """The installed versions of :data:`SGLANG_PACKAGES` (package metadata; None: absent)."""
    from bistat.run import fingerprint

    return {k: v for k, v in fingerprint.package_versions(SGLANG_PACKAGES).items()
            if k != "python"}


def _torch_device_facts() -> Any:
    """GPU 0's facts for the table resolution, from torch (imported only here)."""
    from bistat_kernels.resolution import cuda_device_facts

    return cuda_device_facts(0)


def gemm_table(find_spec: Callable[[str], Any] = importlib.util.find_spec,
               device: Callable[[], Any] = _torch_device_facts) -> dict[str, Any]:
    """Which table the tuned GEMM (``BISTAT_TUNED_GEMM=1``) would use on GPU 0, and how it was
    chosen (:func:`bistat_kernels.resolution.resolve`: the user's or shipped table of the GPU's
    name, else one of its architecture), with what serves the shapes it lacks. Needs torch and
    triton (the ``[kernels]`` extra) to read the GPU's compute capability and multiprocessor
    count; ``detail`` says why when it cannot tell."""
    if not (_has("torch", find_spec) and _has("triton", find_spec)):
        return {"detail": "torch and triton are not installed, so the tuned GEMM cannot run: "
                          "pip install 'bistat[kernels]'"}
    from bistat_kernels import tables
    from bistat_kernels.resolution import resolve

    try:
        facts = device()
    except (RuntimeError, AssertionError) as exc:  # torch's answers when it sees no CUDA GPU
        return {"detail": f"torch sees no CUDA GPU ({type(exc).__name__}: {exc})"}
    except (ImportError, OSError) as exc:  # a torch that is installed but does not load
        return {"detail": f"torch cannot be imported ({type(exc).__name__}: {exc})"}
    try:
        found = resolve(facts)
    except tables.TableError as exc:
        return {"device": facts.name, "detail": f"a GEMM table cannot be read: {exc}"}
    return dict(found.to_dict(), detail=f"{facts.describe()}: {found.describe()}")


#: How doctor stops a leftover server's process group: SIGTERM, SIGKILL after this many seconds.
LEFTOVER_GRACE_S = 10.0


def stop_leftover_servers(found: Sequence[LeftoverServer], stop: bool = True
                          ) -> tuple[dict[str, Any], ...]:
    """Each server a killed ``bistat run`` left running, as the report lists it, stopped first
    when ``stop`` (its process group: SIGTERM, SIGKILL after :data:`LEFTOVER_GRACE_S`)."""
    out = []
    for server in found:
        if stop:
            stop_group(server.pgid, signal.SIGTERM, LEFTOVER_GRACE_S)
        out.append({**server.to_dict(), "stopped": stop})
    return tuple(out)


def doctor(*, find_spec: Callable[[str], Any] = importlib.util.find_spec,
           which: Callable[[str], str | None] = shutil.which,
           gpus: Callable[[], list[dict[str, Any]]] = gpu_info,
           release_check: Callable[[str], Any] | None = None,
           gemm_device: Callable[[], Any] = _torch_device_facts,
           leftovers: Callable[[], Sequence[LeftoverServer]] = leftover_servers,
           stop_leftovers: bool = True) -> DoctorReport:
    """Check this machine. The lookups are parameters so tests can fake a GPU host;
    ``release_check`` asks the package index for vLLM's newest release
    (:func:`bistat.declare.releases.check_newest_release` by default); ``gemm_device`` gives GPU
    0's facts for the GEMM table's resolution (:func:`gemm_table`; asked only where a GPU was
    found). Servers a killed ``bistat run`` left running (``leftovers``) are stopped unless
    ``stop_leftovers`` is false."""
    from bistat.declare.releases import check_newest_release

    from bistat.model.cache import cache_root, model_dir
    from bistat.model.registry import REGISTRY

    kernel = ("its invariant GEMM kernel is built" if _has("bistat.engines.embedded._rowgemm", find_spec)
              else "its invariant GEMM kernel is not built, so gemm = 'invariant' fails: "
                   "`pip install -e .` with a C compiler")
    engines = [EngineCheck("embedded", _has("numpy", find_spec),
                           f"in-process numpy engine (needs a model: `bistat model fetch`); {kernel}")]
    engines.append(EngineCheck("openai", _has("httpx", find_spec),
                               "attaches to an OpenAI-compatible server URL" if
                               _has("httpx", find_spec) else "httpx is not installed"))
    has_vllm = _has("vllm", find_spec)
    vllm_cli = which("vllm")
    found = gpus()
    no_vllm = "vllm is not installed: pip install 'bistat[vllm]'"
    if not has_vllm:
        server = offline = no_vllm
    else:
        server = (f"vllm importable, `vllm` at {vllm_cli}" if vllm_cli else
                  "vllm importable but no `vllm` command on PATH")
        offline = "vllm importable"
        if not found:
            server += "; no NVIDIA GPU found"
            offline += "; no NVIDIA GPU found"
    engines.append(EngineCheck("vllm-server", bool(has_vllm and vllm_cli and found), server))
    engines.append(EngineCheck("vllm-offline", bool(has_vllm and found), offline))
    versions = {**package_versions(), **sglang_versions()}
    has_sglang = _has("sglang", find_spec)
    if not has_sglang:
        sglang = "sglang is not installed: pip install 'bistat[sglang]'"
    else:
        sglang = (f"sglang {versions.get('sglang') or '(version unknown)'} importable "
                  "(`python -m sglang.launch_server`)" + ("" if found else "; no NVIDIA GPU found"))
    engines.append(EngineCheck("sglang-server", bool(has_sglang and found), sglang))
    engines.append(EngineCheck("command-server", _has("httpx", find_spec),
                               "starts any OpenAI-compatible server from a command template"))
    models = tuple(ModelCheck(name, (model_dir(name) / "manifest.json").exists(),
                              str(model_dir(name))) for name in sorted(REGISTRY))
    check = release_check or check_newest_release
    return DoctorReport(engines=tuple(engines), gpus=tuple(found), nvidia_smi=which("nvidia-smi"),
                        versions=versions, cache_dir=str(Path(cache_root())), models=models,
                        vllm_release=vllm_release(versions.get("vllm") if has_vllm else None,
                                                  vllm_commit(find_spec) if has_vllm else None,
                                                  check),
                        sglang_release=vllm_release(
                            versions.get("sglang") if has_sglang else None,
                            package_commit("sglang", find_spec) if has_sglang else None,
                            check, package="sglang"),
                        gemm_table=gemm_table(find_spec, gemm_device) if found else None,
                        leftover_servers=stop_leftover_servers(leftovers(), stop_leftovers))


def render_doctor(rep: DoctorReport) -> str:
    """Plain text for the terminal."""
    lines = ["engines:"]
    lines += [f"  {e.kind}: {'usable' if e.usable else 'not usable'} ({e.detail})"
              for e in rep.engines]
    if rep.gpus:
        lines.append("GPUs:")
        lines += [f"  {g.get('name')} {g.get('uuid')} driver {g.get('driver')}" for g in rep.gpus]
    else:
        lines.append("GPUs: none found" + ("" if rep.nvidia_smi else " (no nvidia-smi on PATH)"))
    lines.append("versions: " + ", ".join(f"{k} {v if v is not None else '-'}"
                                          for k, v in rep.versions.items()))
    for package, r in (("vllm", rep.vllm_release), ("sglang", rep.sglang_release)):
        if r is None:
            continue
        label = f"{package} {r['version']}" + (f" ({r['commit']})" if r.get("commit") else "")
        if r.get("newest") is None:
            lines.append(f"{label}: newest release unknown ({r.get('error')})")
        else:
            how = {"newest": "the newest release", "older": f"older than the newest release, "
                   f"{r['newest']}", "newer": f"newer than the newest release, {r['newest']}",
                   "incomparable": f"not comparable with the newest release, {r['newest']}"}
            lines.append(f"{label}: {how[r['comparison']]} ({r['index']}, "
                         f"checked {r['checked_utc']})")
    if rep.gemm_table is not None:
        lines.append(f"tuned GEMM table (BISTAT_TUNED_GEMM=1): {rep.gemm_table['detail']}")
    if rep.leftover_servers:
        lines.append("servers left running by a bistat process that is gone:")
        lines += [f"  {'stopped' if s['stopped'] else 'still running'}: pid {s['pid']} (process "
                  f"group {s['pgid']}), started by bistat process {s['owner'].split(':')[0]}: "
                  f"{' '.join(s['argv'])}" for s in rep.leftover_servers]
    else:
        lines.append("servers left running by a bistat process that is gone: none")
    lines.append(f"cache: {rep.cache_dir}")
    lines += [f"  model {m.name}: {'cached' if m.cached else 'not cached'} ({m.path})"
              for m in rep.models]
    return "\n".join(lines) + "\n"
