"""The CLI's name for :mod:`bistat.exitcodes` (the documented exit codes of every command).

The codes live outside this package so that library modules (:mod:`bistat.gating`) can use them
without importing the CLI package, whose ``__init__`` imports every command module (and
``cmd_analyze`` imports :mod:`bistat.gating`: a cycle when ``bistat.gating`` is imported first).
"""

from bistat.exitcodes import *  # noqa: F401,F403
from bistat.exitcodes import __all__  # noqa: F401
