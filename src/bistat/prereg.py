"""Deprecated: the path of ``bistat.declare.prereg`` before the stage folders, removed in bistat 0.2.0
(:mod:`bistat.core.deprecated`)."""

from bistat.core.deprecated import alias_module

alias_module(__name__)
del alias_module
