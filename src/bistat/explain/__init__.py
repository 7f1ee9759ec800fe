"""Explaining a run beyond its verdict: the batch-invariance ``probe``, single-prompt ``replay``,
``diagnose`` with the ``remedies`` table, ``inspect_run`` and the environment ``doctor``.
"""
