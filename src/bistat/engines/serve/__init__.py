"""``bistat serve``: bistat's embedded engine behind an OpenAI-compatible HTTP server (``server``)
and the request/response models of that API (``protocol``).
"""
