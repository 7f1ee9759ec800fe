"""Recording a run: the run loop with resume and GPU checks (``runner``, naming its parts:
``session`` (one execution of planned blocks), ``run_engines``, ``pass_records``, ``outcome``,
``resume_state``, ``gpu_check``, ``progress``), running a sealed registration from its path
(``registered``), the requests of each pass (``workload``), the environment
fingerprint (``fingerprint``), the batching summary the runner writes and analysis recomputes
with the same function (``batching``), and the bitwise needle-in-batch ``probe`` run on the
engines with what it records (``probe_records``).

This package is also the public API's ``run``: ``bistat.run(registration, ...)`` calls
:func:`bistat.run.registered.run`. One name cannot be both a subpackage and a function (importing
``bistat.run.runner`` sets the attribute ``bistat.run`` to the package), so the package itself is
made callable; its modules import as before.
"""

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    """``bistat.run``: the stage folder, and when called, :func:`bistat.run.registered.run`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from bistat.run.registered import run

        return run(*args, **kwargs)

    @property
    def __wrapped__(self) -> Any:   # what inspect.signature(bistat.run) and the API reference read
        from bistat.run.registered import run

        return run


sys.modules[__name__].__class__ = _CallablePackage
