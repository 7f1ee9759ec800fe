"""Every bistat module imports first, in a fresh interpreter.

A cycle can hide in the suite, where another test has already imported one side of it:
``import bistat.report.gating`` first once failed (gating -> bistat.cli.exitcodes -> the CLI package's
``__init__`` -> cmd_analyze -> bistat.report.gating, partially initialised).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import bistat

MODULES = sorted(m.name for m in pkgutil.walk_packages(bistat.__path__, "bistat.")
                 if m.name != "bistat.__main__")


def test_the_walk_found_the_package():
    assert {"bistat.report.gating", "bistat.cli", "bistat.cli.cmd_analyze", "bistat.analysis.summary",
            "bistat.engines.vllm_offline"} <= set(MODULES)


def test_every_module_imports_first_in_a_fresh_interpreter():
    # one interpreter per module: each import is the first bistat import of its process
    script = ("import importlib, subprocess, sys\n"
              "bad = []\n"
              "for name in sys.argv[1:]:\n"
              "    r = subprocess.run([sys.executable, '-c', f'import {name}'], capture_output=True, text=True)\n"
              "    if r.returncode:\n"
              "        bad.append((name, r.stderr.strip().splitlines()[-1]))\n"
              "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", script, *MODULES], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
