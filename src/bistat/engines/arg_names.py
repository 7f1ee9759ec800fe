"""The registration check of a declaration's engine ``args`` against the argument names recorded
from an engine's wheel (``bistat/data/vllm_args.json``, ``bistat/data/sglang_args.json``): a name
the engine does not accept is refused before any data, with the closest accepted name suggested."""
from __future__ import annotations

import difflib
from typing import Any, Collection, Sequence


def unknown_args(experiment: Any, accepted: Collection[str], adapter_keys: Sequence[str], *,
                 what: str, where: str, otherwise: str) -> list[tuple[str, str]]:
    """``(field, message with the fix)`` for every key of ``engine.args`` or an arm's ``args``
    that is neither one of the adapter's own keys nor in ``accepted``.

    ``what`` names an argument (``vllm serve argument``), ``where`` the release(s) checked
    against (``vLLM 0.33.0``), ``otherwise`` the fix when no name is close (``see `vllm serve
    --help```).
    """
    names = sorted(frozenset(adapter_keys).union(accepted))
    tables = [("engine.args", dict(experiment.engine.args))]
    tables += [(f"arms[{i}].args", dict(arm.args)) for i, arm in enumerate(experiment.arms)]
    problems = []
    for table, args in tables:
        for key in sorted(set(args) - set(names)):
            close = difflib.get_close_matches(key, names, n=1)
            fix = f"did you mean {close[0]!r}?" if close else otherwise
            problems.append((f"{table}.{key}", f"unknown {what} {key!r} in {where} "
                             f"(nor one of bistat's own keys {list(adapter_keys)}); {fix}"))
    return problems
