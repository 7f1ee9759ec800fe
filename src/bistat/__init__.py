"""bistat: pre-registered, statistically sound tests of batch invariance in LLM inference.

Public entry points are the command line (``bistat --help``) and the modules
``bistat.core.stats`` (pure statistics), ``bistat.core.classify`` (the mechanical classifier),
``bistat.declare.experiment`` (declarations), ``bistat.declare.prereg`` (sealed registrations),
``bistat.store`` (the recorded-data format), ``bistat.analysis.summary`` and ``bistat.report.finding``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
