"""From recorded data to a run summary: ``summary`` (``analyze_run``: load, passes, matching,
validity, comparisons, siblings), divergence ``anatomy``, kernel ``activation`` evidence, published
numbers classified under a rule (``published``), release-to-release comparisons (``version_compare``)
and the trimmed compaction that keeps of a run's outputs only what the analysis reads (``trim``).
"""
