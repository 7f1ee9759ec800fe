"""The argument names each supported vLLM release accepts, recorded from its wheel by
``scripts/vllm_arg_names.py`` (``bistat/data/vllm_args.json``), and the registration check of a
vLLM declaration's ``args`` against them: vLLM is not imported (a registration is often written
on a machine without it), and a name no supported release knows is refused before any data."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Literal, Sequence

from bistat.engines.arg_names import unknown_args

Surface = Literal["offline", "server"]


@lru_cache(maxsize=1)
def known_names() -> dict[str, dict[str, frozenset[str]]]:
    """``{version: {"offline": names, "server": names}}`` as recorded."""
    raw = json.loads(resources.files("bistat").joinpath("data/vllm_args.json").read_text())
    return {v: {s: frozenset(names) for s, names in d.items()} for v, d in raw.items()}


def arg_problems(experiment: Any, surface: Surface,
                 adapter_keys: Sequence[str]) -> list[tuple[str, str]]:
    """``(field, message with the fix)`` for every argument in ``engine.args`` or an arm's
    ``args`` that is neither one of the adapter's own keys nor a name the declared vLLM accepts
    (``engine.required_version`` when it is a recorded release, else any recorded release)."""
    recorded = known_names()
    required = getattr(experiment.engine, "required_version", None)
    versions = [required] if required in recorded else sorted(recorded)
    accepted = frozenset().union(*(recorded[v][surface] for v in versions))
    what = ("vllm.LLM keyword argument" if surface == "offline" else "vllm serve argument")
    where = f"vLLM {versions[0]}" if len(versions) == 1 else f"vLLM {' or '.join(versions)}"
    otherwise = "see `vllm serve --help`" if surface == "server" else "see vllm.EngineArgs"
    return unknown_args(experiment, accepted, adapter_keys, what=what, where=where,
                        otherwise=otherwise)
