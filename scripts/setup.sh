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
if [ "$extras" = dev ]; then
  # torch==2.13.0 resolves to the CPU build on these machines; an unpinned torch would pull CUDA wheels.
  python -m pip install -q -e ".[dev]" "torch==2.13.0" "triton==${TRITON_VERSION:-3.7.1}"
else
  python -m pip install -q -e .
fi
