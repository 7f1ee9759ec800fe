#!/usr/bin/env bash
# Create .venv (if missing) and install bistat into it. Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: "" (the core: enough for the main job) or "dev" (tests: adds pytest, notebooks, torch CPU, triton).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Every editable install makes setuptools say "Editable installation. Please be careful with folders
# in your working directory ...": a notice about editable installs in general, not a warning about
# this package, so it is not shown; the package builds without a warning of its own
# (tests/test_packaging.py builds it with warnings as errors).
export PYTHONWARNINGS="ignore:Editable installation"
if [ "$extras" = dev ]; then
  # torch==2.13.0 resolves to the CPU build on these machines; an unpinned torch would pull CUDA wheels.
  python -m pip install -q -e ".[dev]" "torch==2.13.0" "triton==${TRITON_VERSION:-3.7.1}"
else
  python -m pip install -q -e .
fi
