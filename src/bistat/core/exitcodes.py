"""Documented exit codes of every ``bistat`` command.

==== ==========================================================================
code meaning
==== ==========================================================================
0    success; for verdict-producing commands: the verdict is *working*
1    error: bad input, a failed check (``verify``), an engine that could not run
2    usage error (click's own: unknown option, missing argument)
3    ``bistat run``: the run directory was removed or replaced while the run recorded; the run
     stopped before its next pass and copied its records into a new directory beside it
10   verdict *doubtful*
11   verdict *reported as observed*
12   verdict *untested*
==== ==========================================================================

Verdict-producing commands return 0 for every verdict unless ``--fail-on`` names labels;
then the code of the first named verdict met is returned (see ``verdict_exit_code``).
"""

from __future__ import annotations

__all__ = ["ERROR", "OK", "RUN_DIR_LOST", "USAGE", "VERDICT_CODES"]

OK = 0
ERROR = 1
USAGE = 2
RUN_DIR_LOST = 3
VERDICT_CODES = {
    "working": 0,
    "doubtful": 10,
    "reported as observed": 11,
    "untested": 12,
}
