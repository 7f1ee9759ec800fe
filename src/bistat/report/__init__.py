"""Formatting only: the markdown ``finding`` of a run summary, its ``plots``, the CI ``gating`` of
verdicts to exit codes and the findings ``index``. No statistics are computed here.
"""


def __getattr__(name: str):
    """The names ``bistat.report`` exported when it was a module (now ``bistat.report.finding``):
    deprecated, each warns once (:mod:`bistat.core.deprecated`)."""
    from bistat.core.deprecated import moved_attribute

    return moved_attribute(__name__, name)
