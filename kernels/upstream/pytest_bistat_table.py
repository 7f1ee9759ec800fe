"""pytest plugin: run vLLM's own tests with bistat's tuned GEMM table in the test process.

vLLM loads its general plugins (bistat's ``bistat_tuned_gemm`` among them) when it builds an
engine, so tests that start an ``LLM`` or ``vllm serve`` pick up bistat's table from the
environment alone (``BISTAT_TUNED_GEMM=1``). Kernel-level tests (``test_matmul_batch_invariant.py``
calls ``matmul_batch_invariant`` directly) build no engine; in them vLLM's own kernel and table run
unless something loads the plugins first. This plugin does, before collection::

    BISTAT_TUNED_GEMM=1 PYTHONPATH=kernels/upstream:$PYTHONPATH \\
        python -m pytest -p pytest_bistat_table tests/v1/determinism/test_matmul_batch_invariant.py

With ``BISTAT_TUNED_GEMM=1`` it calls ``vllm.plugins.load_general_plugins()`` and refuses to run
(a usage error, no test runs) unless bistat's hook is then installed; with anything else it
changes nothing and says so. The report header names which GEMM the tests ran.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

ENABLE_ENV = "BISTAT_TUNED_GEMM"
_STATE: dict[str, str] = {}


def describe() -> str:
    return _STATE.get("header", "bistat tuned GEMM: not configured")


def pytest_configure(config: Any) -> None:
    if os.environ.get(ENABLE_ENV) != "1":
        _STATE["header"] = (f"bistat tuned GEMM: off ({ENABLE_ENV} is not 1): vLLM's own "
                            f"persistent GEMM and tuned table")
        return
    from vllm.plugins import load_general_plugins

    from bistat_kernels import vllm_plugin

    load_general_plugins()
    module = vllm_plugin.hooked_module()
    if module is None:
        raise pytest.UsageError(
            f"{ENABLE_ENV}=1 but vLLM's plugins did not install bistat's tuned GEMM: is bistat "
            f"installed beside vLLM with its vllm.general_plugins entry point "
            f"(scripts/device/prepare.sh), and is VLLM_PLUGINS unset or naming bistat_tuned_gemm?")
    _STATE["header"] = (f"bistat tuned GEMM: installed as {module.__name__}.matmul_persistent "
                        f"(bistat_kernels.vllm_plugin)")


def pytest_report_header(config: Any) -> str:
    return describe()
