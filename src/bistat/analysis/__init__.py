"""From recorded data to a run summary: ``summary`` (``analyze_run``: load, passes, matching,
validity, comparisons, siblings), divergence ``anatomy``, kernel ``activation`` evidence, published
numbers classified under a rule (``published``) and release-to-release comparisons (``version_compare``).
"""
