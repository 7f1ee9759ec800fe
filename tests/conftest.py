"""Settings for the whole test suite.

The tests never reach the network: bistat's newest-release checks (``bistat.declare.releases``, made at
registration, at the start of a vLLM run and by ``bistat doctor``) record "not checked" with
``BISTAT_PACKAGE_INDEX=off``, which subprocesses inherit too; the tests of the check itself pass
an ``httpx.MockTransport``.
"""

import os

os.environ["BISTAT_PACKAGE_INDEX"] = "off"
