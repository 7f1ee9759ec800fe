"""The CLI's name for :mod:`bistat.core.exitcodes` (the documented exit codes of every command).

The codes live outside this package so that library modules (:mod:`bistat.report.gating`) can use them
without importing the CLI package, whose ``__init__`` imports every command module (and
``cmd_analyze`` imports :mod:`bistat.report.gating`: a cycle when ``bistat.report.gating`` is imported first).
"""

from bistat.core.exitcodes import *  # noqa: F401,F403
from bistat.core.exitcodes import __all__  # noqa: F401
