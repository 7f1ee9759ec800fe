"""From recorded data to a run summary: ``summary`` (``analyze_run``: load, passes, matching,
validity, comparisons, siblings), divergence ``anatomy``, kernel ``activation`` evidence, published
numbers classified under a rule (``published``), release-to-release comparisons (``version_compare``)
and the trimmed compaction that keeps of a run's outputs only what the analysis reads (``trim``).
"""


def __getattr__(name: str):
    """The names ``bistat.analysis`` exported when it was a module (now ``bistat.analysis.summary``):
    deprecated, each warns once (:mod:`bistat.core.deprecated`)."""
    from bistat.core.deprecated import moved_attribute

    return moved_attribute(__name__, name)
