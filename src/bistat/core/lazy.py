"""Deferred imports of the heavy libraries (scipy, statsmodels, numpy, ...).

``bistat --help``, every command's ``--help`` and every command that never computes a statistic
must start without loading them (together they take over a second to import); a module binds
``lazy_module("scipy.stats")`` or ``lazy_function("statsmodels.stats.proportion",
"proportion_confint")`` at import time and the real import happens on first use.

The rule the command line keeps (``tests/test_lazy.py`` checks it, ``benchmarks/
bench_cli_startup.py`` times it): a ``bistat.cli`` module imports at its top only click, the
standard library and the light modules its options need (constants, exception classes); the
library a command calls is imported inside the command. A library module that such a light
module is binds its third-party dependencies lazily (``bistat.store.format``'s numpy, pyarrow)
or imports its heavier bistat modules where they are used (``bistat.declare.prereg``). A module
of bistat is imported inside a function, not through :func:`lazy_module`, so that
``tests/test_layers.py`` still sees the import.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable


class _LazyModule:
    """Stands for a module; the first attribute access imports it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` whose import happens on first attribute access."""
    return _LazyModule(name)


def lazy_function(module: str, name: str) -> Callable[..., Any]:
    """A stand-in for ``from module import name`` (a callable) imported on first call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = name
    return call
