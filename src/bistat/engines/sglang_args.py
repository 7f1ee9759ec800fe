"""The flags each supported SGLang release's ``python -m sglang.launch_server`` accepts, recorded
from its wheel by ``scripts/sglang_arg_names.py`` (``bistat/data/sglang_args.json``), and the
registration check of an ``sglang-server`` declaration's ``args`` against them: SGLang is not
imported (a registration is often written on a machine without it), and a name no supported
release knows is refused before any data, with the closest name suggested."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

from bistat.engines.arg_names import unknown_args


@lru_cache(maxsize=1)
def known_names() -> dict[str, frozenset[str]]:
    """``{version: names}`` as recorded."""
    raw = json.loads(resources.files("bistat").joinpath("data/sglang_args.json").read_text())
    return {v: frozenset(names) for v, names in raw.items()}


def arg_problems(experiment: Any, adapter_keys: Sequence[str]) -> list[tuple[str, str]]:
    """``(field, message with the fix)`` for every argument in ``engine.args`` or an arm's
    ``args`` that is neither one of the adapter's own keys nor a flag the declared SGLang accepts
    (``engine.required_version`` when it is a recorded release, else any recorded release)."""
    recorded = known_names()
    required = getattr(experiment.engine, "required_version", None)
    versions = [required] if required in recorded else sorted(recorded)
    accepted = frozenset().union(*(recorded[v] for v in versions))
    where = f"SGLang {' or '.join(versions)}"
    return unknown_args(experiment, accepted, adapter_keys,
                        what="sglang.launch_server argument", where=where,
                        otherwise="see `python -m sglang.launch_server --help`")
