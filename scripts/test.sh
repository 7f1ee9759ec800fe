#!/usr/bin/env bash
# The test command (README and CI): set up .venv with the test extras, fetch the real model, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
bistat model fetch smollm2-135m
python -m pytest -q "$@"
