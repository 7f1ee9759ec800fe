"""The public module paths of bistat 0.1's flat layout, kept as deprecated aliases of their new
homes until :data:`REMOVED_IN`.

Before the stage folders (docs/ARCHITECTURE.md), the public modules were ``bistat.stats``,
``bistat.classify``, ``bistat.experiment``, ``bistat.prereg``, ``bistat.records``,
``bistat.analysis`` and ``bistat.report`` (the package docstring's list), with ``bistat.rule``,
``bistat.design_report``, ``bistat.design`` and ``bistat.version_compare`` (named in findings'
text) beside them. Each old path still works:

* a module that is gone has a file of two lines at its old path (``src/bistat/stats.py``, ...)
  that calls :func:`alias_module`: importing it warns once, with a DeprecationWarning naming the
  new path and the release that removes it, and every name looked up on it is the very object
  of its new home (``bistat.stats.wilson_interval is bistat.core.stats.wilson_interval``);
* ``bistat.analysis`` and ``bistat.report`` are stage folders now; the names their modules
  exported resolve on the package (:func:`moved_attribute`, from the package's ``__getattr__``),
  each warning once.

The rest of bistat 0.1's top-level modules were internal (the runner, the engines, the probe, ...)
and have no alias; nor has ``bistat.experiment.register_engine_kind``, since an engine kind is
registered with its adapter (``bistat.engines.registry.register_adapter``).
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["MOVED", "REMOVED_IN", "Moved", "alias_module", "moved_attribute"]

#: The release that removes the aliases (they are kept for one minor release).
REMOVED_IN = "0.2.0"


@dataclass(frozen=True)
class Moved:
    """Where an old module's names live now."""

    #: the new homes, searched in order for a name (the first is named in the warning)
    modules: tuple[str, ...]
    #: old names that were renamed or moved elsewhere: old name -> ``"module:attribute"``
    renamed: Mapping[str, str] = field(default_factory=dict)
    #: the old public names, where they must be known without importing the new homes (a
    #: package's ``__getattr__`` is asked about its submodules too); else the homes' ``__all__``
    names: tuple[str, ...] | None = None
    #: what calling the alias calls (``"module:attribute"``): ``bistat.classify`` is also the
    #: package's ``classify`` function, and an import of the old module rebinds that name
    call: str | None = None
    #: what the warning names as the new path (default: the first of ``modules``)
    home: str | None = None


MOVED: dict[str, Moved] = {
    "bistat.stats": Moved(("bistat.core.stats",)),
    "bistat.classify": Moved(("bistat.core.classify",),
                             {"RunStatus": "bistat.core.classify:RunTestable"},
                             call="bistat.core.classify:classify"),
    "bistat.rule": Moved(("bistat.core.rule",)),
    "bistat.design": Moved(("bistat.core.design",)),
    "bistat.experiment": Moved(("bistat.declare.experiment",),
                               {"ENGINE_KINDS": "bistat.engines.registry:ENGINE_KINDS"}),
    "bistat.prereg": Moved(("bistat.declare.prereg",)),
    "bistat.design_report": Moved(("bistat.declare.design_report",)),
    "bistat.records": Moved(("bistat.store.format", "bistat.store.writer", "bistat.store.readers",
                             "bistat.store.compact", "bistat.store.passes"),
                            home="bistat.store (format, writer, readers, compact, passes)"),
    "bistat.version_compare": Moved(("bistat.analysis.version_compare",)),
    "bistat.analysis": Moved(
        ("bistat.analysis.summary",), {"Comparison": "bistat.analysis.summary:ArmComparison"},
        names=("AnalysisError", "PassSummary", "Divergence", "ArmSummary", "ArmEnvironment",
               "Comparison", "MetricsSeries", "RunSummary", "analyze_run", "summary_to_dict")),
    "bistat.report": Moved(
        ("bistat.report.finding",),
        names=("FindingFiles", "render_markdown", "write_finding", "render_version_comparison")),
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    """Warn that ``old`` is deprecated; ``stacklevel`` counts from the caller of this function."""
    warnings.warn(f"{old} is deprecated and is removed in bistat {REMOVED_IN}; use {new} "
                  f"(the supported names: from bistat import ...)", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def _target(spec: str) -> Any:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def public_names(old: str) -> tuple[str, ...]:
    """The names ``old`` exports: the old list where kept, else its new homes' ``__all__``
    (imports them) and the renamed names."""
    moved = MOVED[old]
    if moved.names is not None:
        return moved.names
    names: dict[str, None] = {}
    for module in moved.modules:
        names.update(dict.fromkeys(getattr(importlib.import_module(module), "__all__", ())))
    names.update(dict.fromkeys(moved.renamed))
    return tuple(names)


def _lookup(old: str, name: str) -> Any:
    """``old.name`` at its new home; AttributeError (as for a missing attribute) if none has it."""
    moved = MOVED[old]
    if name in moved.renamed:
        return _target(moved.renamed[name])
    for module in moved.modules:
        found = importlib.import_module(module)
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module {old!r} has no attribute {name!r}")


class _Alias(types.ModuleType):
    """An old module path whose names are looked up in their new homes."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _lookup(self.__name__, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.__all__))


class _CallableAlias(_Alias):
    """An alias that is also called (see :attr:`Moved.call`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = MOVED[self.__name__].call
        assert call is not None
        return _target(call)(*args, **kwargs)


def alias_module(old: str) -> None:
    """Make the module being imported as ``old`` (``sys.modules[old]``) an alias of its new home,
    warning (once: a module is imported once) at the line that imports it."""
    moved = MOVED[old]
    # stack: this function, the alias module's body, then (the import machinery's frames are
    # skipped by warnings) the line that imports it
    _warn(old, moved.home or moved.modules[0], stacklevel=3)
    module = sys.modules[old]
    module.__class__ = _CallableAlias if moved.call else _Alias
    module.__all__ = list(public_names(old))


_warned: set[tuple[str, str]] = set()


def moved_attribute(package: str, name: str) -> Any:
    """``package.name`` for a name ``package`` exported when it was a module (``bistat.analysis``,
    ``bistat.report``), warning the first time; AttributeError for any other name (so that a
    submodule of that name is imported instead)."""
    moved = MOVED[package]
    if name not in public_names(package):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    if (package, name) not in _warned:
        _warned.add((package, name))
        new = moved.renamed.get(name, f"{moved.modules[0]}:{name}").replace(":", ".")
        # stack: this function, the package's __getattr__, the line that looks the name up
        _warn(f"{package}.{name}", new, stacklevel=3)
    return _lookup(package, name)
