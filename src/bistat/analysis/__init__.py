"""From recorded data to a run summary: ``summary`` (``analyze_run``, in phases: the registration
and its ``siblings``, the ``passes``, ``matching``, ``validity``, the comparisons) hands on a
``results.RunSummary`` whose ``timing`` views are computed once when it is made; divergence
``anatomy``, kernel ``activation`` evidence, the probe's decision (``probe_report``) and the needle
a recorded run chooses (``probe_needle``), published numbers classified under a rule
(``published``), release-to-release comparisons (``version_compare``) and the trimmed compaction
that keeps of a run's outputs only what the analysis reads (``trim``).
"""


def __getattr__(name: str):
    """The names ``bistat.analysis`` exported when it was a module (now ``bistat.analysis.summary``):
    deprecated, each warns once (:mod:`bistat.core.deprecated`)."""
    from bistat.core.deprecated import moved_attribute

    return moved_attribute(__name__, name)
