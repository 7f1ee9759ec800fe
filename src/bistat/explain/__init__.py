"""Explaining a run beyond its verdict: single-prompt ``replay``, ``diagnose`` with the ``remedies``
table, ``inspect_run`` and the environment ``doctor``. (``probe`` is the batch-invariance probe's
former path: it runs in ``bistat.run.probe`` and is decided in ``bistat.analysis.probe_report``.)
"""
