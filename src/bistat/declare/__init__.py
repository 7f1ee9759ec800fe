"""Declaration time: an experiment declared in ``experiments/NAME.toml`` (``experiment``), its sealed
registration (``prereg``), the design report printed at registration (``design_report``: its
criteria in ``design_power``, false verdicts in ``design_false_verdicts``, an earlier run's CV in
``design_cv`` and the run-time estimate in ``design_runtime``), the engine
release checks sealed with it (``engine_version``, ``releases``) and made after it (``release_log``),
``bistat new``'s template, the prompt sources a declaration names (``prompts``), and the one resolver of the registration a recorded run belongs to, its
seal checked (``run_registration``).
"""
