"""Formatting only: the markdown ``finding`` of a run summary, its ``plots``, the CI ``gating`` of
verdicts to exit codes and the findings ``index``. No statistics are computed here.
"""
