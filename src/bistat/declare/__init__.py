"""Declaration time: an experiment declared in ``experiments/NAME.toml`` (``experiment``), its sealed
registration (``prereg``), the design report printed at registration (``design_report``), the engine
release checks sealed with it (``engine_version``, ``releases``) and made after it (``release_log``),
``bistat new``'s template, and the one resolver of the registration a recorded run belongs to, its
seal checked (``run_registration``).
"""
