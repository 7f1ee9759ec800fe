"""The workload's fields an HTTP engine reads (:data:`WORKLOAD_HTTP_KEYS`): the HTTP client's
``retries`` and ``request_timeout_s`` where neither ``engine.args`` nor the arm's ``args`` set them
(:func:`workload_defaults`), and a declaration that sets one in both places to different values,
refused at registration (:func:`workload_conflicts`).
"""

from __future__ import annotations

from typing import Any


#: the workload's fields an HTTP engine reads, unless ``engine.args`` or an arm's ``args`` set them
WORKLOAD_HTTP_KEYS = ("retries", "request_timeout_s")


def workload_defaults(experiment: Any) -> dict[str, Any]:
    """The :data:`WORKLOAD_HTTP_KEYS` of ``experiment.workload`` (those it has): the HTTP client's
    settings where the engine's and the arm's arguments do not set them."""
    workload = getattr(experiment, "workload", None)
    return {k: getattr(workload, k) for k in WORKLOAD_HTTP_KEYS if hasattr(workload, k)}


def workload_conflicts(experiment: Any, kind: str) -> list[tuple[str, str]]:
    """``(field, message)`` for each of :data:`WORKLOAD_HTTP_KEYS` that the declaration sets in
    ``workload`` and, to another value, in ``engine.args`` or an arm's ``args``: which one the
    run would use is not what the declaration says."""
    workload = experiment.workload
    problems = []
    for key in WORKLOAD_HTTP_KEYS:
        if key not in workload.model_fields_set:
            continue
        value = getattr(workload, key)
        declared = [(f"engine.args.{key}", experiment.engine.args)]
        declared += [(f"arms[{i}].args.{key}", arm.args) for i, arm in enumerate(experiment.arms)]
        problems += [(field, f"{args[key]!r} disagrees with workload.{key} = {value}, which "
                             f"engine '{kind}' reads as well; declare the {key} once: remove "
                             f"{field}, or remove workload.{key} and keep {field}")
                     for field, args in declared if key in args and args[key] != value]
    return problems
