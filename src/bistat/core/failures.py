"""Failed requests grouped by their error: what a run's output, ``bistat inspect`` and a finding
show of a run's failures (the first error texts, and how many requests shared each).

Two requests share an error when their texts agree once every number is set aside
(:func:`error_key`): an engine names the request in its message ("request chat-0012: prompt (57
tokens) + max_tokens (10000000) exceeds max_model_len=2048"), so texts that differ only in ids,
counts and lengths are one cause. Pure: strings in, results out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

__all__ = ["ErrorGroup", "error_groups", "error_key", "describe_groups"]

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def error_key(text: str) -> str:
    """``text`` with every number replaced by ``#``: the key under which errors are one cause.

    >>> error_key("request chat-0012: prompt (57 tokens) exceeds max_model_len=2048")
    'request chat-#: prompt (# tokens) exceeds max_model_len=#'
    """
    return _NUMBER.sub("#", text)


@dataclass(frozen=True)
class ErrorGroup:
    """The failed requests that share one error (:func:`error_key`).

    Attributes
    ----------
    first : str
        The first text of the group, as recorded.
    count : int
        How many failed requests share it.
    """

    first: str
    count: int


def error_groups(errors: Iterable[str]) -> tuple[ErrorGroup, ...]:
    """The errors grouped by :func:`error_key`, in the order each group first appears.

    >>> error_groups(["HTTP 500: busy", "request 1: too long (70)", "request 2: too long (55)"])
    (ErrorGroup(first='HTTP 500: busy', count=1), ErrorGroup(first='request 1: too long (70)', count=2))
    """
    order: dict[str, list] = {}
    for text in errors:
        key = error_key(text)
        if key in order:
            order[key][1] += 1
        else:
            order[key] = [text, 1]
    return tuple(ErrorGroup(first, count) for first, count in order.values())


def describe_groups(groups: Iterable[ErrorGroup], total: int, *, limit: int = 3,
                    width: int = 300) -> list[str]:
    """One line per group (the first ``limit``): ``N of TOTAL failed request(s): TEXT``, the text
    cut at ``width`` characters; a last line counts the groups left out.

    >>> describe_groups(error_groups(["a 1", "a 2", "b"]), 3, limit=1)
    ['2 of 3 failed requests: a 1', '... and 1 other error (1 request)']
    """
    groups = list(groups)
    lines = []
    for g in groups[:limit]:
        text = g.first if len(g.first) <= width else g.first[:width] + "..."
        lines.append(f"{g.count} of {total} failed request{'s' if total != 1 else ''}: {text}")
    if len(groups) > limit:
        rest = sum(g.count for g in groups[limit:])
        lines.append(f"... and {len(groups) - limit} other error{'s' if len(groups) - limit > 1 else ''}"
                     f" ({rest} request{'s' if rest != 1 else ''})")
    return lines
