"""What a run leaves on disk: the records format with its writer and readers (``records``), the
engine logs kept beside them (``enginelog``) and slimming a run for committing (``trim``).
"""
