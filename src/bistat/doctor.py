"""``bistat doctor``: which engines are usable here, the GPU and driver, versions, cache, models.

Nothing heavy is imported: optional engines are looked up with ``importlib.util.find_spec``
(vLLM is never imported), versions come from package metadata, the GPU from ``nvidia-smi``
(``bistat.fingerprint.gpu_info``), and a model counts as cached when its cache folder holds a
manifest (``bistat model fetch`` writes it last).
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat.fingerprint import gpu_info, package_versions

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

    def to_dict(self) -> dict[str, Any]:
        return {"schema": DOCTOR_SCHEMA,
                "engines": [{"kind": e.kind, "usable": e.usable, "detail": e.detail}
                            for e in self.engines],
                "gpus": [dict(g) for g in self.gpus], "nvidia_smi": self.nvidia_smi,
                "versions": dict(self.versions), "cache_dir": self.cache_dir,
                "models": [{"name": m.name, "cached": m.cached, "path": m.path}
                           for m in self.models]}


def _has(module: str, find_spec: Callable[[str], Any]) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def doctor(*, find_spec: Callable[[str], Any] = importlib.util.find_spec,
           which: Callable[[str], str | None] = shutil.which,
           gpus: Callable[[], list[dict[str, Any]]] = gpu_info) -> DoctorReport:
    """Check this machine. The lookups are parameters so tests can fake a GPU host."""
    from bistat.model.cache import cache_root, model_dir
    from bistat.model.registry import REGISTRY

    kernel = ("its invariant GEMM kernel is built" if _has("bistat.embedded._rowgemm", find_spec)
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
    models = tuple(ModelCheck(name, (model_dir(name) / "manifest.json").exists(),
                              str(model_dir(name))) for name in sorted(REGISTRY))
    return DoctorReport(engines=tuple(engines), gpus=tuple(found), nvidia_smi=which("nvidia-smi"),
                        versions=package_versions(), cache_dir=str(Path(cache_root())),
                        models=models)


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
    lines.append(f"cache: {rep.cache_dir}")
    lines += [f"  model {m.name}: {'cached' if m.cached else 'not cached'} ({m.path})"
              for m in rep.models]
    return "\n".join(lines) + "\n"
