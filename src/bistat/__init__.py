"""bistat: pre-registered, statistically sound tests of batch invariance in LLM inference.

The supported API is what this package exports (``__all__``; reference: docs/API.md): the
operations ``load`` (a declaration), ``register``, ``verify``, ``run``, ``resume``, ``analyze`` and
``classify``; the statistics of ``bistat.core.stats``; the rule, result and error types. Each is
imported from its stage folder on first use (PEP 562), so ``import bistat`` loads nothing heavy.
Everything else, and the command line (``bistat --help``), may change between releases; the module
paths of bistat 0.1's flat layout (``bistat.stats``, ``bistat.classify``, ...) still import, with
a DeprecationWarning (:mod:`bistat.core.deprecated`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Every supported name -> ``(module, attribute)``; ``attribute`` None: the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    # operations, in the order of a study
    "load": ("bistat.declare.experiment", "load_experiment"),
    "register": ("bistat.declare.prereg", "register"),
    "amend": ("bistat.declare.prereg", "amend"),
    "load_registration": ("bistat.declare.prereg", "load_registration"),
    "verify": ("bistat.declare.prereg", "verify"),
    # the stage folder bistat.run, callable: calling it is bistat.run.registered.run
    "run": ("bistat.run", None),
    "resume": ("bistat.run.registered", "resume"),
    "analyze": ("bistat.analysis.summary", "analyze_run"),
    "classify": ("bistat.core.classify", "classify"),
    "classify_cost": ("bistat.core.classify", "classify_cost"),
    # statistics
    **{name: ("bistat.core.stats", name) for name in (
        "ALTERNATIVES", "BlockEffect", "CVResult", "Interval", "McNemarResult", "RatioResult",
        "TostResult", "block_effect_test", "geometric_mean", "intervals_overlap",
        "match_fraction", "mcnemar_test", "newcombe_difference", "paired_ratio", "pooled_cv",
        "ratio_of_geometric_means", "throughput_ratio", "tost_ratio", "wilson_interval")},
    # the declaration and its rule
    "Experiment": ("bistat.declare.experiment", "Experiment"),
    "Rule": ("bistat.core.rule", "Rule"),
    "CostRule": ("bistat.core.rule", "CostRule"),
    "Label": ("bistat.core.rule", "Label"),
    "LabelSpec": ("bistat.core.rule", "LabelSpec"),
    # results
    "Registration": ("bistat.declare.prereg", "Registration"),
    "VerifyReport": ("bistat.declare.prereg", "VerifyReport"),
    "DesignReport": ("bistat.declare.design_report", "DesignReport"),
    "RunOutcome": ("bistat.run.runner", "RunOutcome"),
    "RunSummary": ("bistat.analysis.summary", "RunSummary"),
    "ArmSummary": ("bistat.analysis.summary", "ArmSummary"),
    "ArmComparison": ("bistat.analysis.summary", "ArmComparison"),
    "PassSummary": ("bistat.analysis.summary", "PassSummary"),
    **{name: ("bistat.core.classify", name) for name in (
        "ActivationEvidence", "ArmStats", "CostOutcome", "CostVerdict", "CriterionResult",
        "LabelResult", "PairedCounts", "RatioSummary", "RunTestable", "ValidityCheck",
        "Verdict")},
    # errors, each with the file, the field and the fix in its message
    "DeclarationError": ("bistat.declare.experiment", "DeclarationError"),
    "RegistrationError": ("bistat.declare.prereg", "RegistrationError"),
    "DesignError": ("bistat.declare.design_report", "DesignError"),
    "RunRefused": ("bistat.run.registered", "RunRefused"),
    "GpuBusyError": ("bistat.run.runner", "GpuBusyError"),
    "ResumeError": ("bistat.run.runner", "ResumeError"),
    "RecordsError": ("bistat.store.format", "RecordsError"),
    "AnalysisError": ("bistat.analysis.summary", "AnalysisError"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Import a supported name from its stage folder on first use."""
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'bistat' has no attribute {name!r}") from None
    found = importlib.import_module(module)
    value = found if attribute is None else getattr(found, attribute)
    globals()[name] = value   # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
