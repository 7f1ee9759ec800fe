"""bistat: pre-registered, statistically sound tests of batch invariance in LLM inference.

Public entry points are the command line (``bistat --help``) and the modules
``bistat.stats`` (pure statistics), ``bistat.classify`` (the mechanical classifier),
``bistat.experiment`` (declarations), ``bistat.prereg`` (sealed registrations),
``bistat.records`` (the recorded-data format), ``bistat.analysis`` and ``bistat.report``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
