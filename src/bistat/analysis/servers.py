"""What each arm's inference server declared about itself, as its engine starts recorded it
(``environment.jsonl``, ``engine.args``): the server a study measured, not the client that drove it.

- ``openai`` (a server started elsewhere), ``command-server`` and ``vllm-server``: the server's
  ``GET /version`` answer and its ``GET /v1/models`` entry (``server_reported``:
  :func:`bistat.engines.openai_http.server_report`). ``bistat serve`` says ``{"version",
  "server": "bistat serve", "gemm", "max_batch_size", "max_model_len", ...}``; vLLM only its
  version; a server with neither says nothing, and nothing is what the finding then states
  (*unknown*, never "the same settings").
- ``sglang-server``: ``/server_info``'s resolved arguments (``server_reported``: the attention
  backend, the deterministic flag, ...) and the versions its environment holds (``versions``).

Runs recorded before servers were asked have no ``server_reported``: :func:`server_reports`
gives nothing for them and every section reads as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pandas as pd

__all__ = ["ServerReport", "server_reports", "SGLANG_SETTINGS"]

#: the settings of an SGLang server's ``/server_info`` the finding names (the rest are recorded)
SGLANG_SETTINGS = ("attention_backend", "enable_deterministic_inference", "sampling_backend",
                   "disable_radix_cache")
#: the ``/version`` keys that name the server rather than a setting
_NAME_KEYS = ("version", "server")


@dataclass(frozen=True)
class ServerReport:
    """What one arm's server declared at its last engine start.

    Attributes
    ----------
    arm : str
    reported : bool
        The server declared something (a version or a setting); False: nothing, so what it runs
        is unknown.
    name : str or None
        What it calls itself (``bistat serve``; ``SGLang`` for an SGLang server), None when it
        does not say.
    version : str or None
    settings : tuple of (key, text)
        Everything else it declared (``gemm``, ``max_model_len``, ``attention_backend``, ...),
        by key.
    """

    arm: str
    reported: bool
    name: str | None
    version: str | None
    settings: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """``bistat serve 0.1.0`` / ``SGLang 0.5.23`` / ``unknown (the server reports nothing)``."""
        if not self.reported:
            return "unknown (the server reports nothing)"
        return " ".join(x for x in (self.name or "server", self.version or "version unknown"))

    def settings_text(self) -> str:
        """``gemm=blas, max_model_len=2048`` (``—`` when it declared none)."""
        return ", ".join(f"{k}={v}" for k, v in self.settings) or "—"

    def setting(self, key: str) -> str | None:
        return dict(self.settings).get(key)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _report(arm: str, engine: Mapping[str, Any], args: Mapping[str, Any]) -> ServerReport | None:
    if "server_reported" not in args:
        return None
    reported = args.get("server_reported")
    if engine.get("kind") == "sglang-server":
        info = reported if isinstance(reported, Mapping) else {}
        versions = args.get("versions") if isinstance(args.get("versions"), Mapping) else {}
        version = versions.get("sglang")
        if version is None and engine.get("version") not in (None, "unknown"):
            version = engine.get("version")   # what the server said (/server_info)
        settings = tuple((k, _text(info[k])) for k in sorted(info) if info[k] is not None)
        return ServerReport(arm, bool(settings) or version is not None, "SGLang",
                            None if version is None else str(version), settings)
    reported = reported if isinstance(reported, Mapping) else {}
    declared = reported.get("version") if isinstance(reported.get("version"), Mapping) else {}
    model = reported.get("model") if isinstance(reported.get("model"), Mapping) else {}
    settings = {k: _text(v) for k, v in declared.items() if k not in _NAME_KEYS and v is not None}
    for k, v in model.items():   # what its model list says (max_model_len), unless /version did
        if k != "id" and v is not None:
            settings.setdefault(k, _text(v))
    name, version = declared.get("server"), declared.get("version")
    return ServerReport(arm, bool(settings) or version is not None or name is not None,
                        None if name is None else str(name),
                        None if version is None else str(version),
                        tuple(sorted(settings.items())))


def server_reports(env: pd.DataFrame, arm_names: Sequence[str]) -> tuple[ServerReport, ...]:
    """Each arm's server report from its last engine start (``environment.jsonl``), in the arms'
    order; arms whose starts recorded none (embedded, vLLM offline, runs recorded before servers
    were asked) have no entry."""
    if env.empty or "engine" not in env:
        return ()
    out = []
    for arm in arm_names:
        rows = env[env["arm"] == arm]
        if rows.empty:
            continue
        engine = rows["engine"].iloc[-1]
        if not isinstance(engine, Mapping):
            continue
        args = engine.get("args") if isinstance(engine.get("args"), Mapping) else {}
        report = _report(arm, engine, args)
        if report is not None:
            out.append(report)
    return tuple(out)
